"""Property-based tests (hypothesis): random small shapes, dtypes, feature flags and strided
views; forward and backward must match the float64 reference.

The number of examples per test comes from ORCHARD_HYPOTHESIS_EXAMPLES (default 30)."""

import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import (assert_close, grad_floor, lse_dtype, native, rounded,  # noqa: E402
                      score_cond)
from orchard.reference import ref_bwd, ref_fwd, ref_varlen_bwd, ref_varlen_fwd  # noqa: E402

EXAMPLES = int(os.environ.get("ORCHARD_HYPOTHESIS_EXAMPLES", "30"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large])

DTYPES = [np.float16, np.float32, np.float64]
LAYOUTS = ["contig", "bnhd", "reversed", "seq_step", "fortran", "big_endian", "misaligned",
           "broadcast"]


def make_view(data, layout, rng):
    """An array equal to `data` (float64 values already in the target dtype) in `layout`."""
    dt = data.dtype
    if layout == "bnhd" and data.ndim == 4:
        return np.ascontiguousarray(data.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if layout == "reversed":
        return np.ascontiguousarray(data[..., ::-1])[..., ::-1]
    if layout == "seq_step" and data.ndim >= 2:
        shape = list(data.shape)
        shape[-2] *= 2
        big = rng.standard_normal(shape).astype(dt)
        big[..., ::2, :] = data
        return big[..., ::2, :]
    if layout == "fortran":
        return np.asfortranarray(data)
    if layout == "big_endian":
        return data.astype(dt.newbyteorder(">"))
    if layout == "misaligned":
        buf = np.zeros(data.nbytes + 1, np.uint8)
        y = np.frombuffer(buf.data[1:1 + data.nbytes], dtype=dt).reshape(data.shape)
        y[...] = data
        return y
    if layout == "broadcast" and data.ndim >= 3 and data.shape[0] >= 1:
        # stride-0 leading dim: only valid if all batch entries are equal, so make them so
        base = data[:1]
        data[...] = base
        return np.broadcast_to(base, data.shape)
    return data


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from(DTYPES))
    rank = draw(st.sampled_from(["2d", "3d", "4d", "gqa", "5d"]))
    b = draw(st.integers(0, 2)) if draw(st.integers(0, 9)) == 0 else draw(st.integers(1, 2))
    h = draw(st.integers(1, 3))
    hkv = h
    if rank == "gqa":
        h = draw(st.sampled_from([2, 4, 6]))
        hkv = draw(st.sampled_from([x for x in (1, 2, 3) if h % x == 0]))
    if draw(st.integers(0, 4)) == 0:  # now and then past one 64-row/column tile
        nq, nk = draw(st.integers(0, 150)), draw(st.integers(0, 150))
        b = min(b, 1)
        if rank == "gqa":
            h, hkv = 2, draw(st.sampled_from([1, 2]))
        else:
            h = hkv = min(h, 2)
    else:
        nq, nk = draw(st.integers(0, 20)), draw(st.integers(0, 20))
    d = draw(st.one_of(st.integers(1, 40), st.sampled_from([64, 128, 256])))
    dv = d if draw(st.booleans()) else draw(st.integers(1, 40))
    if rank == "2d":
        bq, bk = (), ()
    elif rank == "3d":
        bq, bk = (h,), (h,)
    elif rank == "5d":
        bq = bk = (b, 2, h)
    else:
        bq, bk = (b, h), (b, hkv)
    kw = {}
    if draw(st.booleans()):
        kw["causal"] = True
    if draw(st.booleans()):
        kw["window"] = (draw(st.integers(-1, 6)), draw(st.integers(-1, 6)))
    if draw(st.booleans()):
        kw["softcap"] = draw(st.floats(0.5, 10.0))
    if draw(st.booleans()):
        kw["scale"] = draw(st.floats(0.05, 2.0))
    if rank != "2d" and draw(st.booleans()):
        kw["alibi"] = draw(st.sampled_from(["H", "full"]))
    if draw(st.integers(0, 3)) == 0:
        kw["dropout_p"] = draw(st.floats(0.01, 0.9))
        kw["seed"] = draw(st.integers(0, 2**64 - 1))
    layouts = [draw(st.sampled_from(LAYOUTS)) for _ in range(4)]
    seed = draw(st.integers(0, 2**32 - 1))
    amp = draw(st.sampled_from([0.5, 1.0, 3.0]))
    return dict(dtype=dtype, bq=bq, bk=bk, nq=nq, nk=nk, d=d, dv=dv, kw=kw, layouts=layouts,
                seed=seed, amp=amp)


def build(pb):
    rng = np.random.default_rng(pb["seed"])
    dt = pb["dtype"]
    shapes = [pb["bq"] + (pb["nq"], pb["d"]), pb["bk"] + (pb["nk"], pb["d"]),
              pb["bk"] + (pb["nk"], pb["dv"]), pb["bq"] + (pb["nq"], pb["dv"])]
    data = [(pb["amp"] * rng.standard_normal(s)).astype(dt) for s in shapes]
    data[3] = rng.standard_normal(shapes[3]).astype(dt)
    views = [make_view(x, lay, rng) for x, lay in zip(data, pb["layouts"])]
    kw = dict(pb["kw"])
    a = kw.pop("alibi", None)
    if a == "H":
        kw["alibi_slopes"] = rng.uniform(0.0, 1.0, pb["bq"][-1:])
    elif a == "full":
        kw["alibi_slopes"] = rng.uniform(0.0, 1.0, pb["bq"])
    return views, kw


@SETTINGS
@given(pb=problems())
def test_property_fwd_bwd(ops, device, pb):
    (q, k, v, do), kw = build(pb)
    dt = native(q.dtype)
    out, lse = ops.flash_attn_fwd(q, k, v, device=device, **kw)
    assert out.dtype == dt and lse.dtype == lse_dtype(dt)
    args = [rounded(x) for x in (q, k, v)]
    ro, rl = ref_fwd(*args, **kw)
    cond = score_cond(q, k, kw.get("scale"), kw.get("alibi_slopes"))
    assert_close(out, ro, dt, "out", "out %s" % pb, cond=cond)
    assert_close(lse, rl, dt, "lse", "lse %s" % pb, cond=cond)
    grads = ops.flash_attn_bwd(do, q, k, v, out, lse, device=device, **kw)
    rgrads = ref_bwd(rounded(do), *args, **kw)
    floor = grad_floor(do, out, q, k, kw.get("scale"), pb["nq"] / max(pb["nk"], 1))
    for name, g, r, x in zip(("dq", "dk", "dv"), grads, rgrads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == dt
        assert_close(g, r, dt, "grad", "%s %s" % (name, pb), floor=floor, cond=cond)


@st.composite
def varlen_problems(draw):
    dtype = draw(st.sampled_from(DTYPES))
    nb = draw(st.integers(1, 4))
    lq = [draw(st.integers(0, 12)) for _ in range(nb)]
    lk = [draw(st.integers(0, 12)) for _ in range(nb)]
    h = draw(st.sampled_from([1, 2, 4]))
    hkv = draw(st.sampled_from([x for x in (1, 2, 4) if h % x == 0]))
    d = draw(st.integers(1, 33))
    dv = draw(st.integers(1, 33))
    kw = {}
    if draw(st.booleans()):
        kw["causal"] = True
    if draw(st.booleans()):
        kw["window"] = (draw(st.integers(-1, 4)), draw(st.integers(-1, 4)))
    if draw(st.booleans()):
        kw["softcap"] = draw(st.floats(0.5, 10.0))
    if draw(st.booleans()):
        kw["alibi"] = draw(st.sampled_from(["H", "BH"]))
    if draw(st.booleans()):
        kw["dropout_p"] = draw(st.floats(0.01, 0.9))
        kw["seed"] = draw(st.integers(0, 2**64 - 1))
    cu_dtype = draw(st.sampled_from([np.int32, np.int64]))
    layouts = [draw(st.sampled_from(["contig", "reversed", "seq_step", "misaligned"]))
               for _ in range(4)]
    return dict(dtype=dtype, lq=lq, lk=lk, h=h, hkv=hkv, d=d, dv=dv, kw=kw, cu_dtype=cu_dtype,
                layouts=layouts, seed=draw(st.integers(0, 2**32 - 1)))


@SETTINGS
@given(pb=varlen_problems())
def test_property_varlen(ops, device, pb):
    rng = np.random.default_rng(pb["seed"])
    dt = pb["dtype"]
    cq = np.concatenate([[0], np.cumsum(pb["lq"])]).astype(pb["cu_dtype"])
    ck = np.concatenate([[0], np.cumsum(pb["lk"])]).astype(pb["cu_dtype"])
    tq, tk = int(cq[-1]), int(ck[-1])
    shapes = [(tq, pb["h"], pb["d"]), (tk, pb["hkv"], pb["d"]), (tk, pb["hkv"], pb["dv"]),
              (tq, pb["h"], pb["dv"])]
    data = [rng.standard_normal(s).astype(dt) for s in shapes]
    q, k, v, do = (make_view(x, lay, rng) for x, lay in zip(data, pb["layouts"]))
    kw = dict(pb["kw"])
    a = kw.pop("alibi", None)
    if a == "H":
        kw["alibi_slopes"] = rng.uniform(0, 1, (pb["h"],))
    elif a == "BH":
        kw["alibi_slopes"] = rng.uniform(0, 1, (len(pb["lq"]), pb["h"]))
    out, lse = ops.flash_attn_varlen_fwd(q, k, v, cq, ck, device=device, **kw)
    args = [rounded(x) for x in (q, k, v)]
    ro, rl = ref_varlen_fwd(*args, cq, ck, **kw)
    cond = score_cond(q, k, kw.get("scale"), kw.get("alibi_slopes"))
    assert_close(out, ro, dt, "out", "out %s" % pb, cond=cond)
    assert_close(lse, rl, dt, "lse", "lse %s" % pb, cond=cond)
    grads = ops.flash_attn_varlen_bwd(do, q, k, v, out, lse, cq, ck, device=device, **kw)
    rgrads = ref_varlen_bwd(rounded(do), *args, cq, ck, **kw)
    floor = grad_floor(do, out, q, k, kw.get("scale"),
                       max(a / max(b, 1) for a, b in zip(pb["lq"], pb["lk"])))
    for name, g, r in zip(("dq", "dk", "dv"), grads, rgrads):
        assert_close(g, r, dt, "grad", "%s %s" % (name, pb), floor=floor, cond=cond)
