"""Dropout: the Philox keep-mask, and forward/backward with dropout vs the reference."""

import math

import numpy as np
import pytest

from conftest import assert_close, grad_floor, randn, rounded
from orchard.reference import ref_bwd, ref_dropout_mask, ref_fwd

MASK_SHAPES = [
    ((2, 3, 17, 8), (2, 3, 33, 8)),
    ((5, 4), (9, 4)),
    ((3, 7, 4), (3, 1, 4)),
    ((1, 2, 3, 4, 8), (1, 2, 3, 7, 8)),
    ((2, 4, 6, 8), (2, 1, 10, 8)),     # GQA k shape: only Nk is taken from it
    ((1, 1, 64, 8), (1, 1, 64, 8)),
    ((1, 1, 3, 8), (1, 1, 0, 8)),
    ((1, 1, 0, 8), (1, 1, 5, 8)),
]


@pytest.mark.parametrize("q_shape,k_shape", MASK_SHAPES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("seed", [0, 1, 0xDEADBEEF, 2**32 + 5, 2**64 - 1])
def test_dropout_mask_matches_reference(ops, q_shape, k_shape, p, seed):
    mask = np.asarray(ops.dropout_mask(q_shape, k_shape, p, seed))
    ref = ref_dropout_mask(q_shape, k_shape, p, seed)
    assert mask.dtype == np.bool_, mask.dtype
    assert mask.shape == q_shape[:-2] + (q_shape[-2], k_shape[-2])
    if not np.array_equal(mask, ref):
        bad = np.argwhere(mask != ref)
        pytest.fail("mask differs at %d places, first %s: got %s expected %s" % (
            len(bad), bad[0].tolist(), mask[tuple(bad[0])], ref[tuple(bad[0])]))


def test_dropout_mask_default_seed_and_p0(ops):
    q_shape, k_shape = (2, 5, 4), (2, 7, 4)
    np.testing.assert_array_equal(ops.dropout_mask(q_shape, k_shape, 0.3),
                                  ref_dropout_mask(q_shape, k_shape, 0.3, 0))
    assert np.all(ops.dropout_mask(q_shape, k_shape, 0.0, 5))


def test_dropout_mask_of_no_keys_returns_at_once(ops):
    # empty, whatever the other sizes: it used to walk every (unit, row) pair, 2**60 here
    mask = ops.dropout_mask((2**40, 2**20, 5), (2**40, 0, 5), 0.5)
    assert mask.shape == (2**40, 2**20, 0) and mask.dtype == np.bool_


def test_dropout_mask_past_numpy_names_the_shapes(ops):
    """A mask NumPy cannot hold, even an empty one, is refused naming the arguments."""
    with pytest.raises(ValueError, match=r"'q_shape' and 'k_shape' give a mask of shape "
                                         r"\(4611686018427387904, 2, 0, 5\), more than NumPy"):
        ops.dropout_mask((2**62, 2, 0, 8), (2**62, 2, 5, 8), 0.5)


def test_dropout_mask_threshold_edges(ops):
    """p such that p * 2**32 is (nearly) an integer: keep iff word >= floor(p * 2**32)."""
    for p in (2.0**-32, 0.25, 0.5 - 2.0**-33, 1 - 2.0**-32):
        np.testing.assert_array_equal(ops.dropout_mask((1, 40, 4), (1, 40, 4), p, 3),
                                      ref_dropout_mask((1, 40, 4), (1, 40, 4), p, 3), err_msg=str(p))


def test_dropout_mask_same_and_different_seed(ops):
    a = ops.dropout_mask((2, 3, 32, 8), (2, 3, 32, 8), 0.5, 10)
    b = ops.dropout_mask((2, 3, 32, 8), (2, 3, 32, 8), 0.5, 10)
    c = ops.dropout_mask((2, 3, 32, 8), (2, 3, 32, 8), 0.5, 11)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.8])
def test_dropout_keep_rate(ops, p):
    mask = np.asarray(ops.dropout_mask((4, 256, 8), (4, 256, 8), p, 2024))
    n = mask.size
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(mask.mean() - (1 - p)) < 6 * sigma, (mask.mean(), 1 - p)
    # no structure across the 4 lanes of one Philox call
    for lane in range(4):
        assert abs(mask[..., lane::4].mean() - (1 - p)) < 12 * sigma


def test_dropout_expected_output(ops, device, rng):
    """q = 0 makes P uniform; with v = 1 each row is mean(keep) / (1 - p) ~ 1."""
    p, nk = 0.4, 512
    q = np.zeros((1, 2, 64, 8), np.float32)
    k = randn(rng, (1, 2, nk, 8), np.float32)
    v = np.ones((1, 2, nk, 1), np.float32)
    out, _ = ops.flash_attn_fwd(q, k, v, dropout_p=p, seed=1, device=device)
    mask = np.asarray(ops.dropout_mask(q.shape, k.shape, p, 1))
    np.testing.assert_allclose(out[..., 0], mask.mean(-1) / (1 - p), rtol=1e-5)
    assert abs(out.mean() - 1.0) < 0.02


DROP_CASES = [
    dict(),
    dict(causal=True),
    dict(window=(3, 1)),
    dict(alibi=True, softcap=2.0),
    dict(causal=True, alibi=True, scale=0.4, gqa=True),
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=["f16", "f32", "f64"])
@pytest.mark.parametrize("case", DROP_CASES, ids=[str(c) for c in DROP_CASES])
@pytest.mark.parametrize("p", [0.1, 0.6])
@pytest.mark.parametrize("nq,nk", [(7, 12), (12, 7), (70, 90), (130, 67), (1, 800), (4, 300),
                                   (16, 500)])
def test_dropout_fwd_bwd(ops, device, rng, dtype, case, p, nq, nk):
    kw = dict(case)
    b, h = 2, 4
    hkv = 2 if kw.pop("gqa", False) else h
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, (b, h))
    seed = int(rng.integers(0, 2**63))
    q = randn(rng, (b, h, nq, 16), dtype)
    k = randn(rng, (b, hkv, nk, 16), dtype)
    v = randn(rng, (b, hkv, nk, 8), dtype)
    do = randn(rng, (b, h, nq, 8), dtype)
    mask = np.asarray(ops.dropout_mask(q.shape, k.shape, p, seed))
    np.testing.assert_array_equal(mask, ref_dropout_mask(q.shape, k.shape, p, seed))
    out, lse = ops.flash_attn_fwd(q, k, v, dropout_p=p, seed=seed, device=device, **kw)
    args = [rounded(x) for x in (q, k, v)]
    ro, rl = ref_fwd(*args, dropout_p=p, keep=mask, **kw)
    assert_close(out, ro, dtype, "out", "dropout out")
    assert_close(lse, rl, dtype, "lse", "dropout lse")  # lse is independent of dropout
    grads = ops.flash_attn_bwd(do, q, k, v, out, lse, dropout_p=p, seed=seed, device=device, **kw)
    rgrads = ref_bwd(rounded(do), *args, dropout_p=p, keep=mask, **kw)
    floor = grad_floor(do, out, q, k, kw.get("scale"), nq / nk)
    for name, g, r in zip(("dq", "dk", "dv"), grads, rgrads):
        assert_close(g, r, dtype, "grad", "dropout " + name, floor=floor)


def test_dropout_same_seed_identical_different_seed_differs(ops, device, rng):
    q, k, v, do = (randn(rng, (2, 3, 20, 16), np.float32) for _ in range(4))
    o1, l1 = ops.flash_attn_fwd(q, k, v, dropout_p=0.3, seed=99, device=device)
    o2, l2 = ops.flash_attn_fwd(q, k, v, dropout_p=0.3, seed=99, device=device)
    o3, _ = ops.flash_attn_fwd(q, k, v, dropout_p=0.3, seed=100, device=device)
    assert o1.tobytes() == o2.tobytes() and l1.tobytes() == l2.tobytes()
    assert not np.array_equal(o1, o3)
    g1 = ops.flash_attn_bwd(do, q, k, v, o1, l1, dropout_p=0.3, seed=99, device=device)
    g2 = ops.flash_attn_bwd(do, q, k, v, o1, l1, dropout_p=0.3, seed=99, device=device)
    g3 = ops.flash_attn_bwd(do, q, k, v, o1, l1, dropout_p=0.3, seed=100, device=device)
    for a, b, c in zip(g1, g2, g3):
        assert a.tobytes() == b.tobytes()
        assert not np.array_equal(a, c)


def test_dropout_large_seed(ops, device, rng):
    """Seeds above 2**32 use the high key word; the reference must agree."""
    q, k, v = (randn(rng, (1, 2, 9, 8), np.float64) for _ in range(3))
    for seed in (2**32, 2**40 + 3, 2**64 - 1):
        out, _ = ops.flash_attn_fwd(q, k, v, dropout_p=0.5, seed=seed, device=device)
        ro, _ = ref_fwd(q, k, v, dropout_p=0.5, seed=seed)
        assert_close(out, ro, np.float64, "out", "seed=%d" % seed)


def test_dropout_reference_keying_direct(ops, device, rng):
    """fwd with dropout equals ref_fwd keyed by Philox directly (without orchard's mask)."""
    q, k, v = (randn(rng, (2, 3, 2, 5, 8), np.float64) for _ in range(3))
    out, _ = ops.flash_attn_fwd(q, k, v, dropout_p=0.25, seed=31337, device=device)
    ro, _ = ref_fwd(q, k, v, dropout_p=0.25, seed=31337)
    assert_close(out, ro, np.float64, "out")


def test_dropout_numpy_integer_seed(ops, device, rng):
    q, k, v = (randn(rng, (1, 2, 5, 8), np.float64) for _ in range(3))
    ref, _ = ops.flash_attn_fwd(q, k, v, dropout_p=0.5, seed=2**63 + 5, device=device)
    for seed in (np.uint64(2**63 + 5),):
        out, _ = ops.flash_attn_fwd(q, k, v, dropout_p=0.5, seed=seed, device=device)
        np.testing.assert_array_equal(out, ref)
    ref, _ = ops.flash_attn_fwd(q, k, v, dropout_p=0.5, seed=12, device=device)
    for seed in (np.int64(12), np.int32(12), np.uint8(12)):
        out, _ = ops.flash_attn_fwd(q, k, v, dropout_p=0.5, seed=seed, device=device)
        np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(ops.dropout_mask((2, 5, 8), (2, 6, 8), 0.5, np.uint64(2**64 - 1)),
                                  ref_dropout_mask((2, 5, 8), (2, 6, 8), 0.5, 2**64 - 1))


def test_dropout_tiny_p(ops, device, rng):
    """p below 2**-32: threshold 0, everything kept; output equals p=0 scaled by 1/(1-p)."""
    q, k, v = (randn(rng, (1, 2, 5, 8), np.float64) for _ in range(3))
    p = 1e-12
    assert np.all(ops.dropout_mask(q.shape, k.shape, p, 1))
    out, _ = ops.flash_attn_fwd(q, k, v, dropout_p=p, seed=1, device=device)
    ro, _ = ref_fwd(q, k, v, dropout_p=p, seed=1)
    assert_close(out, ro, np.float64, "out")
