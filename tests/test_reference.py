"""Self-tests of the float64 reference (orchard.reference)."""

import math

import numpy as np
import pytest

from orchard.reference import (philox4x32, ref_bwd, ref_dropout_keep, ref_dropout_mask,
                               ref_fwd, ref_varlen_bwd, ref_varlen_fwd, visible_mask)


# ---------------------------------------------------------------- Philox known answers

# Random123 kat_vectors for philox4x32_10.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,expected", PHILOX_KAT)
def test_philox_known_answers(ctr, key, expected):
    got = philox4x32(ctr, key)
    assert got.dtype == np.uint32
    assert [int(x) for x in got] == list(expected)


def test_philox_vectorised_matches_scalar():
    rng = np.random.default_rng(1)
    ctr = [rng.integers(0, 2**32, size=7, dtype=np.uint64).astype(np.uint32) for _ in range(4)]
    key = [rng.integers(0, 2**32, size=7, dtype=np.uint64).astype(np.uint32) for _ in range(2)]
    vec = philox4x32(ctr, key)
    assert vec.shape == (7, 4)
    for n in range(7):
        one = philox4x32([c[n] for c in ctr], [kk[n] for kk in key])
        assert np.array_equal(one, vec[n])
    # broadcasting of a scalar key against array counters
    vec2 = philox4x32(ctr, (5, 6))
    assert vec2.shape == (7, 4)
    assert np.array_equal(vec2[3], philox4x32([c[3] for c in ctr], (5, 6)))


def test_dropout_mask_keying():
    """Spot-check the keying formula element by element against scalar Philox calls."""
    p, seed = 0.3, (7 << 32) | 12345
    mask = ref_dropout_mask((2, 3, 5, 4), (2, 3, 9, 4), p, seed)
    assert mask.shape == (2, 3, 5, 9) and mask.dtype == bool
    thr = math.floor(p * 2**32)
    key = (seed & 0xFFFFFFFF, seed >> 32)
    for (b, h, i, j) in [(0, 0, 0, 0), (1, 2, 4, 8), (0, 1, 3, 5), (1, 0, 2, 7)]:
        bh = b * 3 + h
        word = int(philox4x32((j // 4, i, bh & 0xFFFFFFFF, bh >> 32), key)[j % 4])
        assert mask[b, h, i, j] == (word >= thr)
    # high bits of bh go to counter word 3
    big = ref_dropout_keep([2**32 + 1], 2, 5, p, seed)
    word = int(philox4x32((1, 1, 1, 1), key)[0])
    assert big[0, 1, 4] == (word >= thr)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_dropout_mask_keep_rate(p):
    mask = ref_dropout_mask((4, 64, 8), (4, 64, 8), p, 42)
    rate = mask.mean()
    n = mask.size
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n) + 1e-12


# ---------------------------------------------------------------- helpers


def _rand(rng, *shape):
    return rng.standard_normal(shape)


def _num_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        idx = it.multi_index
        old = x[idx]
        x[idx] = old + eps
        fp = f()
        x[idx] = old - eps
        fm = f()
        x[idx] = old
        g[idx] = (fp - fm) / (2 * eps)
    return g


FEATURES = [
    dict(),
    dict(causal=True),
    dict(window=(1, 0)),
    dict(window=(2, 1)),
    dict(softcap=1.5),
    dict(scale=0.7),
    dict(alibi=True),
    dict(causal=True, softcap=2.0, alibi=True, window=(2, -1)),
    dict(dropout_p=0.3, seed=11),
    dict(dropout_p=0.25, seed=3, causal=True, softcap=1.0, alibi=True),
]


def _kw(feat, h):
    kw = dict(feat)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = 0.5 ** np.arange(1, h + 1)
    return kw


@pytest.mark.parametrize("feat", FEATURES, ids=[str(f) for f in FEATURES])
@pytest.mark.parametrize("shape", [(1, 2, 3, 4, 5, 3), (1, 4, 4, 2, 3, 2), (2, 2, 4, 3, 2, 5)],
                         ids=["NqltNk", "GQA", "NqgtNk"])
def test_ref_bwd_matches_finite_differences(feat, shape):
    b, h, nq, nk_and_hkv_d = shape[0], shape[1], shape[2], shape[3:]
    nk, d, dv = nk_and_hkv_d
    hkv = 2 if h == 4 else h
    rng = np.random.default_rng(0)
    q = _rand(rng, b, h, nq, d)
    k = _rand(rng, b, hkv, nk, d)
    v = _rand(rng, b, hkv, nk, dv)
    do = _rand(rng, b, h, nq, dv)
    kw = _kw(feat, h)

    def loss():
        return float(np.sum(ref_fwd(q, k, v, **kw)[0] * do))

    dq, dk, dv_ = ref_bwd(do, q, k, v, **kw)
    assert dq.shape == q.shape and dk.shape == k.shape and dv_.shape == v.shape
    for x, g in ((q, dq), (k, dk), (v, dv_)):
        num = _num_grad(loss, x)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-7)


def test_ref_fully_masked_rows():
    rng = np.random.default_rng(2)
    q = _rand(rng, 1, 2, 5, 4)
    k = _rand(rng, 1, 2, 3, 4)
    v = _rand(rng, 1, 2, 3, 4)
    # causal with Nq > Nk: rows i < Nq - Nk see nothing
    out, lse = ref_fwd(q, k, v, causal=True)
    assert np.all(out[:, :, :2] == 0) and np.all(np.isneginf(lse[:, :, :2]))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[:, :, 2:]))
    grads = ref_bwd(np.ones_like(out), q, k, v, causal=True)
    assert np.all(grads[0][:, :, :2] == 0)
    assert all(np.all(np.isfinite(g)) for g in grads)
    # Nk == 0: everything masked
    out, lse = ref_fwd(q, k[:, :, :0], v[:, :, :0])
    assert out.shape == (1, 2, 5, 4) and np.all(out == 0) and np.all(np.isneginf(lse))


def test_ref_visible_mask_bottom_right():
    m = visible_mask(2, 4, causal=True)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]
    m = visible_mask(3, 3, window=(1, 0))
    assert m.tolist() == [[True, False, False], [True, True, False], [False, True, True]]


def test_ref_lse_is_logsumexp():
    rng = np.random.default_rng(3)
    q, k, v = _rand(rng, 3, 4), _rand(rng, 5, 4), _rand(rng, 5, 2)
    out, lse = ref_fwd(q, k, v, scale=0.3)
    s = 0.3 * q @ k.T
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-13)
    np.testing.assert_allclose(out, (np.exp(s - lse[:, None])) @ v, rtol=1e-13)


def test_ref_varlen_matches_dense():
    rng = np.random.default_rng(4)
    lq, lk = [3, 0, 4], [2, 5, 0]
    cq, ck = np.cumsum([0] + lq), np.cumsum([0] + lk)
    h, hkv, d = 4, 2, 3
    q, k, v = _rand(rng, cq[-1], h, d), _rand(rng, ck[-1], hkv, d), _rand(rng, ck[-1], hkv, 2)
    do = _rand(rng, cq[-1], h, 2)
    kw = dict(causal=True, dropout_p=0.2, seed=9, softcap=3.0)
    out, lse = ref_varlen_fwd(q, k, v, cq, ck, **kw)
    dq, dk, dv = ref_varlen_bwd(do, q, k, v, cq, ck, **kw)
    assert out.shape == (cq[-1], h, 2) and lse.shape == (h, cq[-1])
    for b in range(3):
        sl_q, sl_k = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        qb, kb, vb = (x.transpose(1, 0, 2)[None] for x in (q[sl_q], k[sl_k], v[sl_k]))
        keep = ref_dropout_keep(b * h + np.arange(h), lq[b], lk[b], 0.2, 9)[None]
        o, l = ref_fwd(qb, kb, vb, keep=keep, **kw)
        np.testing.assert_array_equal(out[sl_q], o[0].transpose(1, 0, 2))
        np.testing.assert_array_equal(lse[:, sl_q], l[0])
        g = ref_bwd(do[sl_q].transpose(1, 0, 2)[None], qb, kb, vb, keep=keep, **kw)
        np.testing.assert_array_equal(dq[sl_q], g[0][0].transpose(1, 0, 2))
        np.testing.assert_array_equal(dk[sl_k], g[1][0].transpose(1, 0, 2))


def test_ref_varlen_finite_differences():
    rng = np.random.default_rng(5)
    cq, ck = np.array([0, 2, 5]), np.array([0, 3, 4])
    q, k, v = _rand(rng, 5, 2, 3), _rand(rng, 4, 1, 3), _rand(rng, 4, 1, 2)
    do = _rand(rng, 5, 2, 2)
    kw = dict(causal=True, alibi_slopes=np.array([[0.5, 0.25], [0.1, 0.2]]), dropout_p=0.3, seed=5)
    loss = lambda: float(np.sum(ref_varlen_fwd(q, k, v, cq, ck, **kw)[0] * do))  # noqa: E731
    g = ref_varlen_bwd(do, q, k, v, cq, ck, **kw)
    for x, gx in zip((q, k, v), g):
        np.testing.assert_allclose(gx, _num_grad(loss, x), rtol=1e-6, atol=1e-7)


def test_ref_batch_dims_and_2d():
    rng = np.random.default_rng(6)
    q, k, v = _rand(rng, 2, 3, 2, 4, 5), _rand(rng, 2, 3, 2, 6, 5), _rand(rng, 2, 3, 2, 6, 7)
    out, lse = ref_fwd(q, k, v, causal=True)
    assert out.shape == (2, 3, 2, 4, 7) and lse.shape == (2, 3, 2, 4)
    o2, l2 = ref_fwd(q[1, 2, 0], k[1, 2, 0], v[1, 2, 0], causal=True)
    np.testing.assert_allclose(o2, out[1, 2, 0], rtol=1e-14)
    np.testing.assert_allclose(l2, lse[1, 2, 0], rtol=1e-14)
    # dropout keying: bh is the row-major index over q.shape[:-2]
    keep = ref_dropout_mask(q.shape, k.shape, 0.5, 1)
    assert np.array_equal(keep[1, 2, 0], ref_dropout_keep([1 * 6 + 2 * 2 + 0], 4, 6, 0.5, 1)[0])
    # zero-size batch
    out, lse = ref_fwd(q[:0], k[:0], v[:0])
    assert out.shape == (0, 3, 2, 4, 7) and lse.shape == (0, 3, 2, 4)


# ---------------------------------------------------------------- vs torch (float64)

def _torch():
    return pytest.importorskip("torch")


def _torch_scores_bias(nq, nk, causal, window, slopes, h):
    """Additive float mask (H, nq, nk) for SDPA: -inf where not visible, alibi bias elsewhere."""
    vis = visible_mask(nq, nk, causal, window)
    bias = np.where(vis, 0.0, -np.inf)[None].repeat(h, 0)
    if slopes is not None:
        dist = np.abs(np.arange(nq)[:, None] + (nk - nq) - np.arange(nk)[None, :])
        bias = bias - np.asarray(slopes)[:, None, None] * dist
    return bias


SDPA_CASES = [
    # (B, H, Hkv, Nq, Nk, D, Dv, kwargs)
    (2, 3, 3, 5, 5, 8, 8, dict()),
    (2, 3, 3, 5, 7, 8, 4, dict(scale=0.3)),
    (1, 4, 2, 6, 6, 16, 16, dict(causal=True)),
    (1, 4, 1, 6, 9, 16, 5, dict()),
    (2, 2, 2, 7, 7, 4, 4, dict(causal=True)),
]


@pytest.mark.parametrize("case", SDPA_CASES)
def test_ref_vs_torch_sdpa(case):
    torch = _torch()
    F = torch.nn.functional
    b, h, hkv, nq, nk, d, dv, kw = case
    rng = np.random.default_rng(7)
    q, k, v = _rand(rng, b, h, nq, d), _rand(rng, b, hkv, nk, d), _rand(rng, b, hkv, nk, dv)
    do = _rand(rng, b, h, nq, dv)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    causal = kw.get("causal", False)
    assert not causal or nq == nk  # SDPA's causal is top-left aligned
    tout = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, scale=kw.get("scale"),
                                          enable_gqa=(h != hkv))
    tout.backward(torch.tensor(do))
    out, lse = ref_fwd(q, k, v, **kw)
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=1e-12, atol=1e-12)
    dq, dk, dv_ = ref_bwd(do, q, k, v, **kw)
    np.testing.assert_allclose(dq, tq.grad.numpy(), rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(dk, tk.grad.numpy(), rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(dv_, tv.grad.numpy(), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("kw", [
    dict(causal=True), dict(window=(2, 1)), dict(alibi=True), dict(window=(0, 2), alibi=True),
    dict(causal=True, alibi=True, scale=0.5)])
@pytest.mark.parametrize("nq,nk", [(4, 7), (6, 6), (7, 5)])
def test_ref_vs_torch_sdpa_with_mask(kw, nq, nk):
    """Bottom-right causal, windows and ALiBi expressed as SDPA's additive attn_mask."""
    torch = _torch()
    F = torch.nn.functional
    b, h, d = 2, 3, 8
    kw = dict(kw)
    slopes = 0.5 ** np.arange(1, h + 1) if kw.pop("alibi", False) else None
    if slopes is not None:
        kw["alibi_slopes"] = slopes
    vis = visible_mask(nq, nk, kw.get("causal", False), kw.get("window", (-1, -1)))
    if not vis.any(axis=1).all():
        pytest.skip("SDPA gives NaN on fully masked rows; covered elsewhere")
    rng = np.random.default_rng(8)
    q, k, v = _rand(rng, b, h, nq, d), _rand(rng, b, h, nk, d), _rand(rng, b, h, nk, d)
    do = _rand(rng, b, h, nq, d)
    bias = torch.tensor(_torch_scores_bias(nq, nk, kw.get("causal", False),
                                           kw.get("window", (-1, -1)), slopes, h))
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    tout = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=bias, scale=kw.get("scale"))
    tout.backward(torch.tensor(do))
    out, lse = ref_fwd(q, k, v, **kw)
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=1e-12, atol=1e-12)
    scale = kw.get("scale", 1 / math.sqrt(d))
    tlse = torch.logsumexp(scale * tq.detach() @ tk.detach().transpose(-1, -2) + bias, dim=-1)
    np.testing.assert_allclose(lse, tlse.numpy(), rtol=1e-12, atol=1e-12)
    for g, tg in zip(ref_bwd(do, q, k, v, **kw), (tq.grad, tk.grad, tv.grad)):
        np.testing.assert_allclose(g, tg.numpy(), rtol=1e-11, atol=1e-12)


def test_ref_vs_torch_autograd_softcap_dropout():
    """Softcap and a dropout multiplier through torch autograd (SDPA has neither)."""
    torch = _torch()
    b, h, nq, nk, d = 1, 2, 5, 6, 4
    p, seed, cap = 0.3, 17, 1.2
    rng = np.random.default_rng(9)
    q, k, v = _rand(rng, b, h, nq, d), _rand(rng, b, h, nk, d), _rand(rng, b, h, nk, d)
    do = _rand(rng, b, h, nq, d)
    keep = ref_dropout_mask(q.shape, k.shape, p, seed)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    s = (tq @ tk.transpose(-1, -2)) / math.sqrt(d)
    s = cap * torch.tanh(s / cap)
    vis = torch.tensor(visible_mask(nq, nk, causal=True))
    s = s.masked_fill(~vis, float("-inf"))
    P = torch.softmax(s, dim=-1)
    tout = (P * torch.tensor(keep, dtype=torch.float64) / (1 - p)) @ tv
    tout.backward(torch.tensor(do))
    kw = dict(dropout_p=p, seed=seed, softcap=cap, causal=True)
    out, lse = ref_fwd(q, k, v, **kw)
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=1e-12, atol=1e-12)
    for g, tg in zip(ref_bwd(do, q, k, v, **kw), (tq.grad, tk.grad, tv.grad)):
        np.testing.assert_allclose(g, tg.numpy(), rtol=1e-11, atol=1e-12)
