"""Memory: reference counts, RSS growth over many calls, O(N) peak memory at N = 16384."""

import json
import sys

import numpy as np
import pytest

from conftest import randn, run_python


def test_refcounts_stable(ops, device, rng):
    q, k, v, do = (randn(rng, (1, 2, 8, 16), np.float32) for _ in range(4))
    qs = randn(rng, (1, 2, 8, 16), np.float32)[..., ::-1]     # staged path
    slopes = np.array([0.1, 0.2])
    scale, window = 0.37, (2, 1)
    cq = np.array([0, 3, 8], np.int32)
    qp, kp, vp = (randn(rng, (8, 2, 16), np.float32) for _ in range(3))
    objs = [q, k, v, do, qs, slopes, scale, window, cq, qp, kp, vp]
    before = [sys.getrefcount(o) for o in objs]
    out = lse = None
    for _ in range(1000):
        out, lse = ops.flash_attn_fwd(q, k, v, scale, 0.1, True, window=window,
                                      alibi_slopes=slopes, seed=3, device=device)
        grads = ops.flash_attn_bwd(do, q, k, v, out, lse, scale, 0.1, True, window=window,
                                   alibi_slopes=slopes, seed=3, device=device)
        ops.flash_attn_fwd(qs, k, v, device=device)
        vo, vl = ops.flash_attn_varlen_fwd(qp, kp, vp, cq, cq, device=device)
        ops.flash_attn_varlen_bwd(qp, qp, kp, vp, vo, vl, cq, cq, device=device)
    after = [sys.getrefcount(o) for o in objs]
    assert before == after, "refcounts changed: %s -> %s" % (before, after)
    # outputs are owned only by us: one reference from the name + one from getrefcount
    assert sys.getrefcount(out) == 2 and sys.getrefcount(lse) == 2
    for g in grads:
        assert sys.getrefcount(g) == 3  # the tuple `grads`, the loop name `g`, getrefcount
    assert sys.getrefcount(vo) == 2 and sys.getrefcount(vl) == 2


def test_refcounts_stable_on_errors(ops, device, rng):
    q, k, v = (randn(rng, (1, 2, 8, 16), np.float32) for _ in range(3))
    k_bad = randn(rng, (1, 2, 8, 15), np.float32)
    slopes_bad = np.array([0.1, 0.2, 0.3])
    objs = [q, k, v, k_bad, slopes_bad]
    before = [sys.getrefcount(o) for o in objs]
    for _ in range(1000):
        for kw in (dict(dropout_p=1.5), dict(alibi_slopes=slopes_bad), dict(softcap=-1.0)):
            with pytest.raises(ValueError):
                ops.flash_attn_fwd(q, k, v, device=device, **kw)
        with pytest.raises(ValueError):
            ops.flash_attn_fwd(q, k_bad, v, device=device)
    after = [sys.getrefcount(o) for o in objs]
    assert before == after, "refcounts changed on error paths: %s -> %s" % (before, after)


RSS_SCRIPT = r"""
import json, functools, numpy as np, orchard_ops as ops
for _name in ("flash_attn_fwd", "flash_attn_bwd", "flash_attn_varlen_fwd", "flash_attn_varlen_bwd"):
    setattr(ops, _name, functools.partial(getattr(ops, _name), device=%(device)r))

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((2, 2, 64, 64)).astype(np.float32) for _ in range(4))
qs = q[..., ::-1]                                   # staged copy every call
qb = q.astype(">f4")                                # staged (byte swap) every call
cq = np.array([0, 50, 128], np.int32)
qp, kp, vp = (rng.standard_normal((128, 2, 64)).astype(np.float32) for _ in range(3))

def one():
    out, lse = ops.flash_attn_fwd(q, k, v, causal=True, dropout_p=0.1, seed=1)
    ops.flash_attn_bwd(do, q, k, v, out, lse, causal=True, dropout_p=0.1, seed=1)
    ops.flash_attn_fwd(qs, k, v, alibi_slopes=np.array([0.1, 0.2]))
    out, lse = ops.flash_attn_fwd(qb, k, v)
    ops.flash_attn_bwd(do, qb, k, v, out, lse)
    vo, vl = ops.flash_attn_varlen_fwd(qp, kp, vp, cq, cq)
    ops.flash_attn_varlen_bwd(qp, qp, kp, vp, vo, vl, cq, cq)
    ops.dropout_mask((2, 2, 64, 64), (2, 2, 64, 64), 0.5, 3)
    ops.stats()
    ops.devices()
    try:
        ops.flash_attn_fwd(q, k[..., :3], v)
    except ValueError:
        pass
    try:
        ops.flash_attn_fwd(q, k, v, device="tpu:0")
    except ValueError:
        pass

for _ in range(200):
    one()
r0 = rss()
for _ in range(%(n)d):
    one()
r1 = rss()
print(json.dumps({"before": r0, "after": r1}))
"""


def test_rss_does_not_grow(device):
    """1000 iterations of every entry point (each allocating >= 64 KiB per output and
    staging copy); leaking a single output per iteration would add >= 64 MiB."""
    r = run_python(RSS_SCRIPT % {"n": 1000, "device": device}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    growth = res["after"] - res["before"]
    assert growth < 16 * 2**20, "RSS grew by %.1f MiB over 1000 iterations" % (growth / 2**20)


BIG_SCRIPT = r"""
import json, resource, functools, numpy as np, orchard_ops as ops
for _name in ("flash_attn_fwd", "flash_attn_bwd"):
    setattr(ops, _name, functools.partial(getattr(ops, _name), device=%(device)r))
n, d = 16384, 64
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 1, n, d), dtype=np.float32) for _ in range(3))
# warm up the thread pool and code paths on a small problem
ops.flash_attn_fwd(q[:, :, :64], k[:, :, :64], v[:, :, :64])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out, lse = ops.flash_attn_fwd(q, k, v)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
# spot-check a few rows against a direct float64 evaluation
rows = [0, 1, 4097, n - 1]
s = (q[0, 0, rows].astype(np.float64) @ k[0, 0].astype(np.float64).T) / np.sqrt(d)
m = s.max(-1, keepdims=True)
p = np.exp(s - m)
ref_lse = (m + np.log(p.sum(-1, keepdims=True)))[:, 0]
ref_out = (p / p.sum(-1, keepdims=True)) @ v[0, 0].astype(np.float64)
err_out = float(np.max(np.abs(out[0, 0, rows] - ref_out)))
err_lse = float(np.max(np.abs(lse[0, 0, rows] - ref_lse)))
print(json.dumps({"before": before, "after": after, "outputs": out.nbytes + lse.nbytes,
                  "err_out": err_out, "err_lse": err_lse}))
"""


def test_big_n_forward_peak_memory(ops, device):
    """N = 16384, D = 64, float32: an N x N score matrix would be 1 GiB.  The forward must
    not raise peak RSS by more than ~96 MiB over its outputs (inputs are already resident)."""
    r = run_python(BIG_SCRIPT % {"device": device}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    extra = res["after"] - res["before"] - res["outputs"]
    assert extra <= 96 * 2**20, "peak RSS rose by %.1f MiB beyond the outputs" % (extra / 2**20)
    assert res["err_out"] < 1e-4 and res["err_lse"] < 1e-4, res


BIG_BWD_SCRIPT = r"""
import json, resource, functools, numpy as np, orchard_ops as ops
for _name in ("flash_attn_fwd", "flash_attn_bwd"):
    setattr(ops, _name, functools.partial(getattr(ops, _name), device=%(device)r))
n, d = 16384, 64
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((1, 1, n, d), dtype=np.float32) for _ in range(4))
out, lse = ops.flash_attn_fwd(q, k, v, causal=True)
ops.flash_attn_bwd(do[:, :, :64], q[:, :, :64], k[:, :, :64], v[:, :, :64],
                   out[:, :, :64], lse[:, :, :64], causal=True)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
dq, dk, dv = ops.flash_attn_bwd(do, q, k, v, out, lse, causal=True)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"before": before, "after": after,
                  "outputs": dq.nbytes + dk.nbytes + dv.nbytes,
                  "finite": bool(np.isfinite(dq).all() and np.isfinite(dk).all())}))
"""


def test_big_n_backward_peak_memory(ops, device):
    """The backward is O(N) in memory too (it regenerates P from lse, never stores N x N)."""
    r = run_python(BIG_BWD_SCRIPT % {"device": device}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    extra = res["after"] - res["before"] - res["outputs"]
    assert extra <= 96 * 2**20, "peak RSS rose by %.1f MiB beyond the outputs" % (extra / 2**20)
    assert res["finite"]
