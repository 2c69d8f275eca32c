"""The representative workload tools/valgrind.sh runs under Memcheck: every feature forward and
backward on every device (dense, GQA, varlen, strided and staged inputs, all dtypes, every
option at once; on OpenCL devices also on DeviceArrays, which must be released with their
objects) and the error paths (bad arguments, sizes refused, impossible allocations). It
checks the devices' results against the native path, so it also fails loudly on its own."""
import numpy as np

import orchard_ops as ops


def check(a, b):
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                   rtol=2e-3, atol=2e-3)


def dense(rng, dtype, nq):
    nk = 29 if nq > 16 else 1000     # decoding: a long cache, several key splits
    q = rng.standard_normal((2, 4, nq, 24)).astype(dtype)
    k = rng.standard_normal((2, 2, nk, 24)).astype(dtype)
    v = rng.standard_normal((2, 2, nk, 16)).astype(dtype)
    do = rng.standard_normal((2, 4, nq, 16)).astype(dtype)
    q = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)   # strided rows
    return q, k[..., ::-1].copy()[..., ::-1], v.astype(v.dtype.newbyteorder(">")), do


def attention(device, q, k, v, do, **kw):
    out, lse = ops.flash_attn_fwd(q, k, v, device=device, **kw)
    return (out, lse) + ops.flash_attn_bwd(do, q, k, v, out, lse, device=device, **kw)


def resident(device, q, k, v, do, **kw):
    """attention() on DeviceArrays, brought back to the host."""
    q, k, v, do = (ops.to_device(x, device) for x in (q, k, v, do))
    out, lse = ops.flash_attn_fwd(q, k, v, **kw)
    results = (out, lse) + ops.flash_attn_bwd(do, q, k, v, out, lse, **kw)
    try:
        ops.flash_attn_fwd(q, k, np.ones(v.shape, np.float32), **kw)
    except ValueError:
        pass
    else:
        raise AssertionError("host and device operands mixed")
    return [r.numpy() for r in results]


def varlen(device, rng):
    cu_q, cu_k = np.array([0, 5, 5, 17], np.int32), np.array([0, 3, 11, 20], np.int32)
    q, do = rng.standard_normal((17, 2, 8)), rng.standard_normal((17, 2, 8))
    k, v = rng.standard_normal((20, 1, 8)), rng.standard_normal((20, 1, 8))
    q, k, v, do = (x.astype(np.float32) for x in (q, k, v, do))
    kw = dict(causal=True, dropout_p=0.3, seed=2)
    out, lse = ops.flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, device=device, **kw)
    return (out, lse) + ops.flash_attn_varlen_bwd(do, q, k, v, out, lse, cu_q, cu_k,
                                                  device=device, **kw)


def errors(device):
    q = np.ones((1, 2, 5, 8), np.float32)
    bad = [lambda: ops.flash_attn_fwd(q, q[..., :4], q, device=device),
           lambda: ops.flash_attn_fwd(q.astype(np.int32), q, q, device=device),
           lambda: ops.flash_attn_fwd(q, q, q, window=(-3, 0), device=device),
           lambda: ops.flash_attn_fwd(q, np.broadcast_to(q[:, :, :1], (1, 2, 2**33, 8)), q,
                                      device=device),
           lambda: ops.flash_attn_fwd(q, np.broadcast_to(np.ones((1,), ">f4"),
                                                         (1, 2, 2**30, 8)), q, device=device)]
    for call in bad:
        try:
            call()
        except (TypeError, ValueError, MemoryError, ops.OrchardError):
            pass
        else:
            raise AssertionError("no error")


def main():
    rng = np.random.default_rng(0)
    kw = dict(causal=True, window=(9, 3), softcap=8.0, alibi_slopes=np.linspace(0.1, 0.4, 4),
              dropout_p=0.2, seed=7)
    devices = [d["id"] for d in ops.devices()]
    for dtype in (np.float16, np.float32, np.float64):
        for nq in (37, 3):      # 3 query rows: the split-KV decode
            args = dense(rng, dtype, nq)
            expected = attention("cpu", *args, **kw)
            for device in devices[1:]:
                check(attention(device, *args, **kw), expected)
                check(resident(device, *args, **kw), expected)
    expected = varlen("cpu", np.random.default_rng(1))
    for device in devices[1:]:
        check(varlen(device, np.random.default_rng(1)), expected)
    for device in devices:
        errors(device)
    assert ops.stats()["fwd_calls"] > 0
    print("workload ok on", ", ".join(devices))


if __name__ == "__main__":
    main()
