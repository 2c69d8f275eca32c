"""Backward pass of every feature vs the analytic reference, and float64 gradients vs central
finite differences of orchard's own float64 forward."""

import numpy as np
import pytest

from conftest import check_backward, randn

DTYPES = [np.float16, np.float32, np.float64]
DT_IDS = ["f16", "f32", "f64"]


def qkvo(rng, dtype, b=1, h=2, nq=9, nk=13, d=16, dv=None, hkv=None, amp=1.0):
    dv = d if dv is None else dv
    hkv = h if hkv is None else hkv
    return (randn(rng, (b, h, nq, d), dtype, amp), randn(rng, (b, hkv, nk, d), dtype, amp),
            randn(rng, (b, hkv, nk, dv), dtype, amp), randn(rng, (b, h, nq, dv), dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("d", [1, 3, 16, 64, 100, 128, 256])
def test_bwd_head_dims(ops, device, rng, dtype, d):
    q, k, v, do = qkvo(rng, dtype, d=d)
    check_backward(ops, device, q, k, v, do, what="D=%d" % d)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("d,dv", [(16, 1), (3, 64), (64, 256), (256, 7)])
def test_bwd_value_dim_differs(ops, device, rng, dtype, d, dv):
    q, k, v, do = qkvo(rng, dtype, d=d, dv=dv)
    check_backward(ops, device, q, k, v, do, what="D=%d Dv=%d" % (d, dv))


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 37), (37, 1), (17, 33), (33, 17), (65, 65), (128, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_seq_lengths(ops, device, rng, dtype, nq, nk, causal):
    q, k, v, do = qkvo(rng, dtype, nq=nq, nk=nk, d=32)
    check_backward(ops, device, q, k, v, do, what="Nq=%d Nk=%d" % (nq, nk), causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("h,hkv", [(6, 1), (6, 2), (6, 3), (4, 4)])
def test_bwd_gqa(ops, device, rng, dtype, h, hkv):
    q, k, v, do = qkvo(rng, dtype, b=2, h=h, hkv=hkv, nq=6, nk=8, d=16, dv=8)
    check_backward(ops, device, q, k, v, do, what="H=%d Hkv=%d" % (h, hkv))
    check_backward(ops, device, q, k, v, do, what="causal H=%d Hkv=%d" % (h, hkv), causal=True)


@pytest.mark.parametrize("batch", [(), (3,), (2, 1, 3)], ids=["2d", "3d", "5d"])
def test_bwd_input_ranks(ops, device, rng, batch):
    q = randn(rng, batch + (7, 16), np.float32)
    k = randn(rng, batch + (11, 16), np.float32)
    v = randn(rng, batch + (11, 8), np.float32)
    do = randn(rng, batch + (7, 8), np.float32)
    check_backward(ops, device, q, k, v, do, what="batch=%s" % (batch,), causal=True)


def _kw(rng, feat, b, h):
    kw = dict(feat)
    a = kw.pop("alibi", None)
    if a == "H":
        kw["alibi_slopes"] = rng.uniform(0.05, 1.0, (h,))
    elif a == "BH":
        kw["alibi_slopes"] = rng.uniform(0.05, 1.0, (b, h))
    return kw


FEATURES = [
    dict(causal=True),
    dict(window=(2, 0)),
    dict(window=(0, 3)),
    dict(window=(3, 2), causal=True),
    dict(alibi="H"),
    dict(alibi="BH", causal=True),
    dict(softcap=0.5),
    dict(softcap=5.0),
    dict(scale=0.3),
    dict(scale=2.0, softcap=3.0),
    dict(causal=True, window=(2, -1), alibi="H", softcap=2.0, scale=0.7),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("feat", FEATURES, ids=[str(f) for f in FEATURES])
@pytest.mark.parametrize("nq,nk", [(6, 10), (10, 6)])
def test_bwd_features(ops, device, rng, dtype, feat, nq, nk):
    q, k, v, do = qkvo(rng, dtype, b=2, h=3, nq=nq, nk=nk, d=16, dv=12, amp=2.0)
    check_backward(ops, device, q, k, v, do, what=str(feat), **_kw(rng, feat, 2, 3))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kw,nq,nk", [
    (dict(causal=True), 9, 3),
    (dict(window=(-1, 1)), 9, 3),
    (dict(window=(2, 0), softcap=1.0), 12, 4),
])
def test_bwd_fully_masked_rows(ops, device, rng, dtype, kw, nq, nk):
    q, k, v, do = qkvo(rng, dtype, nq=nq, nk=nk, d=8)
    out, lse = ops.flash_attn_fwd(q, k, v, device=device, **kw)
    dq, dk, dv = ops.flash_attn_bwd(do, q, k, v, out, lse, device=device, **kw)
    for g in (dq, dk, dv):
        assert not np.isnan(g).any(), "NaN in gradient with fully masked rows"
    dead = np.isneginf(lse)
    assert dead.any()
    assert np.all(dq[dead] == 0), "dq of masked rows must be 0, got %s" % dq[dead]
    check_backward(ops, device, q, k, v, do, what="masked rows", **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_bwd_empty(ops, device, rng, dtype):
    # Nq == 0: dk, dv are zero
    q, k, v, do = qkvo(rng, dtype, nq=0, nk=5, d=8, dv=3)
    out, lse = ops.flash_attn_fwd(q, k, v, device=device)
    dq, dk, dv = ops.flash_attn_bwd(do, q, k, v, out, lse, device=device)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dk.dtype == dtype and np.all(dk == 0) and np.all(dv == 0)
    # Nk == 0: dq is zero
    q, k, v, do = qkvo(rng, dtype, nq=4, nk=0, d=8, dv=3)
    out, lse = ops.flash_attn_fwd(q, k, v, device=device)
    dq, dk, dv = ops.flash_attn_bwd(do, q, k, v, out, lse, device=device)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert np.all(dq == 0)
    # zero batch
    q, k, v, do = qkvo(rng, dtype, b=0, nq=4, nk=5, d=8)
    out, lse = ops.flash_attn_fwd(q, k, v, device=device)
    dq, dk, dv = ops.flash_attn_bwd(do, q, k, v, out, lse, device=device)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_outputs_owe_nothing_to_reused_memory(ops, device, rng):
    """The native path's outputs are not zeroed before its kernels (problem.c or_new_output),
    and a freed output's memory serves the next one of its size (marshal.c): query rows that
    see no key, and keys that no row sees, still read 0, not a previous call's values."""
    q, k, v, do = qkvo(rng, np.float32, nq=64, nk=40, d=32)
    for _ in range(2):      # outputs of every row and key, freed: their memory comes back
        out, lse = ops.flash_attn_fwd(q, k, v, device=device)
        del out, lse
        out, lse = ops.flash_attn_fwd(q, k, v, causal=True, device=device)
    assert np.all(out[:, :, :24] == 0) and np.all(np.isneginf(lse[:, :, :24]))
    assert np.all(out[:, :, 24:] != 0)
    q, k, v, do = qkvo(rng, np.float32, nq=40, nk=64, d=32)
    out, lse = ops.flash_attn_fwd(q, k, v, device=device)
    for _ in range(2):
        grads = ops.flash_attn_bwd(do, q, k, v, out, lse, device=device)
        del grads
        o1, l1 = ops.flash_attn_fwd(q, k, v, window=(0, 0), device=device)
        dq, dk, dv = ops.flash_attn_bwd(do, q, k, v, o1, l1, window=(0, 0), device=device)
    assert np.all(dk[:, :, :24] == 0) and np.all(dv[:, :, :24] == 0)   # keys no row sees
    assert np.all(dv[:, :, 24:] != 0)


def test_bwd_uses_given_out_and_lse(ops, device, rng):
    """bwd accepts out/lse as returned by fwd even when passed as copies / views."""
    q, k, v, do = qkvo(rng, np.float64, nq=5, nk=7, d=8)
    out, lse = ops.flash_attn_fwd(q, k, v, device=device)
    g1 = ops.flash_attn_bwd(do, q, k, v, out, lse, device=device)
    out2 = np.asfortranarray(out)
    lse2 = np.ascontiguousarray(np.broadcast_to(lse, (2,) + lse.shape)[1])
    g2 = ops.flash_attn_bwd(do, q, k, v, out2, lse2, device=device)
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------- finite differences (float64)


def _fd_check(ops, device, q, k, v, do, eps=1e-6, **kw):
    def loss():
        out, _ = ops.flash_attn_fwd(q, k, v, device=device, **kw)
        return float(np.sum(out * do))

    out, lse = ops.flash_attn_fwd(q, k, v, device=device, **kw)
    grads = ops.flash_attn_bwd(do, q, k, v, out, lse, device=device, **kw)
    for name, x, g in zip(("dq", "dk", "dv"), (q, k, v), grads):
        num = np.zeros_like(x)
        for idx in np.ndindex(*x.shape):
            old = x[idx]
            x[idx] = old + eps
            fp = loss()
            x[idx] = old - eps
            fm = loss()
            x[idx] = old
            num[idx] = (fp - fm) / (2 * eps)
        # central differences: truncation O(eps^2) ~ 1e-12, rounding ~ 1e-16 / eps ~ 1e-10
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-7, err_msg="%s %s" % (name, kw))


FD_FEATURES = [
    dict(),
    dict(causal=True),
    dict(window=(1, 1)),
    dict(softcap=1.5),
    dict(alibi_slopes=np.array([0.3, 0.7])),
    dict(scale=0.8, causal=True, softcap=2.0, alibi_slopes=np.array([0.5, 0.1]), window=(2, -1)),
    dict(dropout_p=0.3, seed=123),
    dict(dropout_p=0.2, seed=7, causal=True, softcap=1.0),
]


@pytest.mark.parametrize("feat", FD_FEATURES, ids=[str(f) for f in FD_FEATURES])
@pytest.mark.parametrize("nq,nk", [(3, 5), (5, 3)])
def test_bwd_finite_differences_f64(ops, device, rng, feat, nq, nk):
    q, k, v, do = qkvo(rng, np.float64, b=1, h=2, nq=nq, nk=nk, d=3, dv=2)
    _fd_check(ops, device, q, k, v, do, **feat)


def test_bwd_finite_differences_gqa_f64(ops, device, rng):
    q, k, v, do = qkvo(rng, np.float64, b=1, h=4, hkv=2, nq=3, nk=4, d=3, dv=2)
    _fd_check(ops, device, q, k, v, do, causal=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("n", [63, 65, 129, 200])
def test_bwd_tile_boundaries(ops, device, rng, dtype, n):
    q, k, v, do = qkvo(rng, dtype, b=1, h=2, hkv=1, nq=n, nk=n + 21, d=64, dv=40)
    check_backward(ops, device, q, k, v, do, what="n=%d" % n)
    check_backward(ops, device, q, k, v, do, what="causal n=%d" % n, causal=True,
                   dropout_p=0.1, seed=4)


def test_bwd_broadcast_dout(ops, device, rng):
    """dout with all strides 0 (np.broadcast_to of a scalar): staged, still correct."""
    q, k, v, _ = qkvo(rng, np.float32, nq=6, nk=9, d=8)
    do = np.broadcast_to(np.float32(0.5), (1, 2, 6, 8))
    check_backward(ops, device, q, k, v, do, causal=True)


def test_bwd_many_heads_gqa(ops, device, rng):
    """dk/dv of one kv head accumulate over many query heads (no lost updates)."""
    q, k, v, do = qkvo(rng, np.float32, b=3, h=32, hkv=2, nq=9, nk=11, d=16)
    check_backward(ops, device, q, k, v, do, what="32 heads on 2 kv heads")
