"""orchard-demo: attention on realistic shapes, checked against the NumPy reference, with timings.

    orchard-demo [--device cpu] [--quick] [--json]

For each case it runs orchard's forward and backward and the same computation in
orchard.reference (float64, materialising the N x N score matrix), and prints the largest
difference and both timings (orchard's of its second call, the first building any OpenCL
programs). It exits non-zero if any difference is out of tolerance.
"""
import json
import sys
import time

import numpy as np

import orchard_ops

from ..reference import ref_bwd, ref_fwd
from .args import Parser, console_script, device


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


EXAMPLES = (
    "orchard-demo --quick",
    "orchard-demo --device opencl:0",
    "orchard-demo --json > demo.json",
)


@console_script("orchard-demo")
def main(argv=None):
    parser = Parser("orchard-demo", __doc__.splitlines()[0], EXAMPLES)
    parser.add_argument("--device", type=device, default="auto",
                        help="The device: auto, cpu, opencl, opencl:N or opencl:NAME.")
    parser.add_argument("--quick", action="store_true",
                        help="Sequences a quarter as long, for a check in seconds.")
    parser.add_argument("--json", action="store_true",
                        help="Print one JSON object per case instead of the text lines.")
    args = parser.parse_args(argv)
    device_id = orchard_ops.resolve_device(None if args.device == "auto" else args.device)
    if not args.quiet and not args.json:
        info = next(d for d in orchard_ops.devices() if d["id"] == device_id)
        where = (f"{orchard_ops.get_num_threads()} threads" if info["backend"] == "native"
                 else f"{info['name']}, {info['compute_units']} compute units")
        print(f"orchard {orchard_ops.__version__} on {device_id} ({where})", file=sys.stderr)
    rng = np.random.default_rng(0)
    failures = 0
    for name, (b, h, hkv, n, d), dtype, causal in CASES:
        if args.quick:
            n //= 4
        q = rng.standard_normal((b, h, n, d)).astype(dtype)
        k = rng.standard_normal((b, hkv, n, d)).astype(dtype)
        v = rng.standard_normal((b, hkv, n, d)).astype(dtype)
        dout = rng.standard_normal((b, h, n, d)).astype(dtype)
        # timed on a second call: the first builds a device's OpenCL programs (seconds the
        # first time, without the cache) and wakes the threads
        for _ in range(2):
            (out, lse), t_fwd = timed(orchard_ops.flash_attn_fwd, q, k, v, causal=causal,
                                      device=device_id)
            grads, t_bwd = timed(orchard_ops.flash_attn_bwd, dout, q, k, v, out, lse,
                                 causal=causal, device=device_id)
        (ref_out, _), t_ref_fwd = timed(ref_fwd, q, k, v, causal=causal)
        ref_grads, t_ref_bwd = timed(ref_bwd, dout, q, k, v, causal=causal)
        # float32 accumulation: ~1e-5 relative; float16 storage rounds to 2**-11 relative.
        tol = 2e-2 if dtype == np.float16 else 1e-4
        err = max(np.abs(a.astype(np.float64) - r).max() / max(1.0, np.abs(r).max())
                  for a, r in zip((out, *grads), (ref_out, *ref_grads)))
        ok = err < tol
        failures += not ok
        if args.json:
            print(json.dumps({"case": name, "B": b, "H": h, "H_kv": hkv, "N": n, "D": d,
                              "dtype": np.dtype(dtype).name, "causal": causal,
                              "max_rel_err": err, "ok": bool(ok), "device": device_id,
                              "orchard_ms": {"fwd": t_fwd * 1e3, "bwd": t_bwd * 1e3},
                              "reference_ms": {"fwd": t_ref_fwd * 1e3, "bwd": t_ref_bwd * 1e3}}))
            continue
        print(f"{name:28s} B={b} H={h}/{hkv} N={n} D={d} {np.dtype(dtype).name:7s} "
              f"max rel err {err:.1e} {'ok' if ok else 'FAIL'} | "
              f"orchard fwd {t_fwd * 1e3:7.1f} ms bwd {t_bwd * 1e3:7.1f} ms | "
              f"NumPy reference fwd {t_ref_fwd * 1e3:7.1f} ms bwd {t_ref_bwd * 1e3:7.1f} ms")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
