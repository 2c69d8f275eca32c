"""orchard-demo: attention on realistic shapes, checked against naive NumPy, with timings.

    orchard-demo [--device cpu] [--quick]

For each case it runs orchard's forward and backward, the same computation written naively
in NumPy (float64, materialising the N x N score matrix), and prints the largest difference
and both timings. It exits non-zero if any difference is out of tolerance.
"""
import argparse
import sys
import time

import numpy as np

import orchard_ops


def naive_attention(q, k, v, causal):
    """float64 softmax(q k^T / sqrt(D)) v with bottom-right causal masking, and its backward."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    if causal:
        nq, nk = s.shape[-2:]
        i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
        s = np.where(j <= i + nk - nq, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = p @ v

    def backward(dout):
        dout = dout.astype(np.float64)
        dv = p.swapaxes(-1, -2) @ dout
        dp = dout @ v.swapaxes(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(q.shape[-1])
        dq, dk = ds @ k, ds.swapaxes(-1, -2) @ q
        b, h = dk.shape[:2]
        fold = lambda x: x.reshape(b, h // group, group, *x.shape[2:]).sum(2)
        return dq, fold(dk), fold(dv)

    return out, backward


def timed(fn, *args, **kwargs):
    t = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - t


CASES = [
    # name, (B, H, Hkv, N, D), dtype, causal
    ("GPT-2 block, causal", (2, 12, 12, 512, 64), np.float32, True),
    ("encoder, bidirectional", (4, 8, 8, 256, 64), np.float32, False),
    ("GQA 8 heads / 2 kv heads", (2, 8, 2, 512, 128), np.float32, True),
    ("float16 inputs", (2, 8, 8, 384, 64), np.float16, True),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="orchard device id (default: auto)")
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    args = parser.parse_args(argv)
    device = args.device or orchard_ops.default_device()
    print(f"orchard {orchard_ops.__version__} on {device} "
          f"({orchard_ops.get_num_threads()} threads)")
    rng = np.random.default_rng(0)
    failures = 0
    for name, (b, h, hkv, n, d), dtype, causal in CASES:
        if args.quick:
            n //= 4
        q = rng.standard_normal((b, h, n, d)).astype(dtype)
        k = rng.standard_normal((b, hkv, n, d)).astype(dtype)
        v = rng.standard_normal((b, hkv, n, d)).astype(dtype)
        dout = rng.standard_normal((b, h, n, d)).astype(dtype)
        (out, lse), t_fwd = timed(orchard_ops.flash_attn_fwd, q, k, v, causal=causal,
                                  device=device)
        grads, t_bwd = timed(orchard_ops.flash_attn_bwd, dout, q, k, v, out, lse,
                             causal=causal, device=device)
        (ref_out, ref_backward), t_naive_fwd = timed(naive_attention, q, k, v, causal)
        ref_grads, t_naive_bwd = timed(ref_backward, dout)
        # float32 accumulation: ~1e-5 relative; float16 storage rounds to 2**-11 relative.
        tol = 2e-2 if dtype == np.float16 else 1e-4
        err = max(np.abs(a.astype(np.float64) - r).max() / max(1.0, np.abs(r).max())
                  for a, r in zip((out, *grads), (ref_out, *ref_grads)))
        ok = err < tol
        failures += not ok
        print(f"{name:28s} B={b} H={h}/{hkv} N={n} D={d} {np.dtype(dtype).name:7s} "
              f"max rel err {err:.1e} {'ok' if ok else 'FAIL'} | "
              f"orchard fwd {t_fwd * 1e3:7.1f} ms bwd {t_bwd * 1e3:7.1f} ms | "
              f"naive NumPy fwd {t_naive_fwd * 1e3:7.1f} ms bwd {t_naive_bwd * 1e3:7.1f} ms")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
