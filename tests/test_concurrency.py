"""Concurrency across devices: threads calling forward and backward on the native path and on
every OpenCL device at once, for a few seconds, with problems of different shapes, dtypes and
features (so different programs build and run side by side), get exactly, bit for bit, what
one thread gets calling them one after another."""
import itertools
import threading
import time

import numpy as np

from conftest import DEVICE_IDS, randn

SECONDS = 3.0
THREADS = 6


def problems():
    rng = np.random.default_rng(7)
    specs = [
        # dtype, q shape, k heads, Nk, Dv, options
        (np.float32, (2, 4, 70, 32), 2, 90, 32, dict(causal=True, dropout_p=0.2, seed=3)),
        (np.float16, (1, 2, 33, 16), 2, 17, 8, dict(window=(5, 2), softcap=5.0)),
        (np.float64, (3, 40, 24), 3, 40, 24, dict(alibi_slopes=np.array([0.1, 0.2, 0.3]))),
        (np.float32, (1, 3, 129, 64), 1, 64, 64, dict(causal=True)),
    ]
    out = []
    for dtype, qshape, hkv, nk, dv, kw in specs:
        kshape = qshape[:-3] + ((hkv,) if len(qshape) == 4 else (qshape[-3],)) + (nk,)
        q = randn(rng, qshape, dtype)
        k = randn(rng, kshape + (qshape[-1],), dtype)
        v = randn(rng, kshape + (dv,), dtype)
        do = randn(rng, qshape[:-1] + (dv,), dtype)
        out.append((q, k, v, do, kw))
    return out


def attention(ops, device, q, k, v, do, kw):
    out, lse = ops.flash_attn_fwd(q, k, v, device=device, **kw)
    return (out, lse) + ops.flash_attn_bwd(do, q, k, v, out, lse, device=device, **kw)


def test_threads_on_mixed_devices_match_serial_results(ops):
    work = list(itertools.product(DEVICE_IDS, problems()))
    serial = [attention(ops, dev, *pb) for dev, pb in work]
    errors, calls = [], [0] * THREADS
    deadline = time.monotonic() + SECONDS
    barrier = threading.Barrier(THREADS)

    def worker(t):
        try:
            barrier.wait()
            i = t       # each thread walks the list from its own start: devices and problems mix
            while time.monotonic() < deadline:
                dev, pb = work[i % len(work)]
                got = attention(ops, dev, *pb)
                for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got,
                                      serial[i % len(work)]):
                    if a.dtype != b.dtype or a.tobytes() != b.tobytes():
                        raise AssertionError("thread %d, %s on %s: %s differs from the serial "
                                             "result" % (t, pb[0].shape, dev, name))
                calls[t] += 1
                i += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SECONDS + 300)
    assert not any(t.is_alive() for t in threads), "a worker thread did not finish: deadlock?"
    assert not errors, errors
    assert min(calls) >= 1 and sum(calls) >= len(work), calls
