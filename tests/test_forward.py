"""Forward pass features vs the float64 reference, on every device."""

import json

import numpy as np
import pytest

from conftest import OPENCL_IDS, assert_close, check_forward, lse_dtype, randn, run_python
from orchard.reference import ref_fwd

DTYPES = [np.float16, np.float32, np.float64]
DT_IDS = ["f16", "f32", "f64"]


def qkv(rng, dtype, b=1, h=2, nq=9, nk=13, d=16, dv=None, hkv=None, amp=1.0):
    dv = d if dv is None else dv
    hkv = h if hkv is None else hkv
    return (randn(rng, (b, h, nq, d), dtype, amp), randn(rng, (b, hkv, nk, d), dtype, amp),
            randn(rng, (b, hkv, nk, dv), dtype, amp))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("d", [1, 3, 16, 64, 100, 128, 256])
def test_dtypes_and_head_dims(ops, device, rng, dtype, d):
    q, k, v = qkv(rng, dtype, d=d)
    check_forward(ops, device, q, k, v, what="D=%d" % d)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("d,dv", [(16, 1), (16, 5), (3, 64), (64, 256), (256, 7), (100, 33)])
def test_value_dim_differs(ops, device, rng, dtype, d, dv):
    q, k, v = qkv(rng, dtype, d=d, dv=dv)
    check_forward(ops, device, q, k, v, what="D=%d Dv=%d" % (d, dv))


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 37), (37, 1), (17, 33), (33, 17), (65, 65),
                                   (128, 3), (3, 129), (1, 1000), (4, 2100), (16, 700)])
def test_seq_lengths(ops, device, rng, dtype, nq, nk):
    q, k, v = qkv(rng, dtype, nq=nq, nk=nk, d=32)
    check_forward(ops, device, q, k, v, what="Nq=%d Nk=%d" % (nq, nk))
    check_forward(ops, device, q, k, v, what="causal Nq=%d Nk=%d" % (nq, nk), causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_nq_zero(ops, device, rng, dtype):
    q, k, v = qkv(rng, dtype, nq=0, nk=5, d=8, dv=3)
    out, lse = ops.flash_attn_fwd(q, k, v, device=device)
    assert out.shape == (1, 2, 0, 3) and out.dtype == dtype
    assert lse.shape == (1, 2, 0) and lse.dtype == lse_dtype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("causal", [False, True])
def test_nk_zero(ops, device, rng, dtype, causal):
    q, k, v = qkv(rng, dtype, nq=4, nk=0, d=8, dv=3)
    out, lse = ops.flash_attn_fwd(q, k, v, causal=causal, device=device)
    assert out.shape == (1, 2, 4, 3) and out.dtype == dtype
    assert np.all(out == 0), "Nk=0: out must be 0, got %s" % out
    assert lse.shape == (1, 2, 4) and np.all(np.isneginf(lse)), "Nk=0: lse must be -inf, got %s" % lse


@pytest.mark.parametrize("shape_q,shape_k", [((0, 2, 5, 8), (0, 2, 6, 8)),
                                             ((3, 0, 5, 8), (3, 0, 6, 8)),
                                             ((0, 5, 8), (0, 6, 8)),
                                             ((2, 0, 3, 5, 8), (2, 0, 3, 6, 8))])
def test_zero_batch_dims(ops, device, rng, shape_q, shape_k):
    q = randn(rng, shape_q, np.float32)
    k = randn(rng, shape_k, np.float32)
    v = randn(rng, shape_k[:-1] + (4,), np.float32)
    out, lse = ops.flash_attn_fwd(q, k, v, device=device)
    assert out.shape == shape_q[:-1] + (4,)
    assert lse.shape == shape_q[:-1]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("batch", [(), (3,), (2, 3), (2, 1, 3)], ids=["2d", "3d", "4d", "5d"])
def test_input_ranks(ops, device, rng, dtype, batch):
    q = randn(rng, batch + (7, 16), dtype)
    k = randn(rng, batch + (11, 16), dtype)
    v = randn(rng, batch + (11, 8), dtype)
    check_forward(ops, device, q, k, v, what="batch=%s" % (batch,))
    check_forward(ops, device, q, k, v, what="causal batch=%s" % (batch,), causal=True)


def test_short_positional_call(ops, rng):
    """The spec's `flash_attn_fwd(q, k, v, 1.0, 0.0, False)` on 3-D arrays works as is."""
    q, k, v = (randn(rng, (4, 6, 16), np.float32) for _ in range(3))
    out, lse = ops.flash_attn_fwd(q, k, v, 1.0, 0.0, False)
    ro, rl = ref_fwd(q, k, v, 1.0)
    assert_close(out, ro, np.float32, "out")
    assert_close(lse, rl, np.float32, "lse")
    out2, _ = ops.flash_attn_fwd(q, k, v, 1.0, 0.0, True)
    assert_close(out2, ref_fwd(q, k, v, 1.0, causal=True)[0], np.float32, "out")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("h,hkv", [(6, 1), (6, 2), (6, 3), (6, 6), (4, 1)])
def test_gqa_mqa(ops, device, rng, dtype, h, hkv):
    q, k, v = qkv(rng, dtype, b=2, h=h, hkv=hkv, nq=5, nk=7, d=16, dv=8)
    check_forward(ops, device, q, k, v, what="H=%d Hkv=%d" % (h, hkv))
    check_forward(ops, device, q, k, v, what="causal H=%d Hkv=%d" % (h, hkv), causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("nq,nk", [(5, 9), (9, 5), (8, 8), (1, 9), (9, 1), (40, 70), (70, 40)])
def test_causal_bottom_right(ops, device, rng, dtype, nq, nk):
    q, k, v = qkv(rng, dtype, nq=nq, nk=nk, d=16)
    out, lse = check_forward(ops, device, q, k, v, what="causal", causal=True)
    if nq > nk:  # rows i < Nq - Nk see no key
        n = nq - nk
        assert np.all(out[:, :, :n] == 0) and np.all(np.isneginf(lse[:, :, :n]))
        assert np.all(np.isfinite(lse[:, :, n:]))


WINDOWS = [(0, 0), (2, 0), (0, 3), (3, 2), (-1, 2), (4, -1), (0, -1), (-1, 0), (-1, -1), (100, 100)]


@pytest.mark.parametrize("window", WINDOWS, ids=[str(w) for w in WINDOWS])
@pytest.mark.parametrize("nq,nk", [(7, 7), (5, 11), (11, 5)])
def test_window(ops, device, rng, window, nq, nk):
    q, k, v = qkv(rng, np.float32, nq=nq, nk=nk, d=8)
    check_forward(ops, device, q, k, v, what="window", window=window)
    check_forward(ops, device, q, k, v, what="window+causal", window=window, causal=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_keys_outside_every_window_are_never_read(ops, device, rng, dtype):
    """Keys that no query's window reaches may hold NaN and inf: forward and backward give what
    they give with ordinary numbers there, and those keys get zero gradients. The sizes put the
    first visible key (180) inside a key block of 96, past its start."""
    q, k, v = qkv(rng, dtype, nq=100, nk=300, d=16)
    do = randn(rng, q.shape, dtype)
    kw = dict(window=(20, 0), causal=True, device=device)
    results = []
    for poison in (False, True):
        kp, vp = k.copy(), v.copy()
        if poison:
            kp[..., :180, :], vp[..., :180, :] = np.nan, np.inf
        out, lse = ops.flash_attn_fwd(q, kp, vp, **kw)
        results.append((out, lse) + tuple(ops.flash_attn_bwd(do, q, kp, vp, out, lse, **kw)))
    for name, clean, poisoned in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert np.array_equal(clean[..., 180:, :] if name in ("dk", "dv") else clean,
                              poisoned[..., 180:, :] if name in ("dk", "dv") else poisoned), name
    assert not np.any(results[1][3][..., :180, :]) and not np.any(results[1][4][..., :180, :])


def test_window_tuple_types(ops, device, rng):
    """window given as a list or with numpy integers behaves like the tuple."""
    q, k, v = qkv(rng, np.float64, nq=6, nk=6, d=8)
    o1, _ = ops.flash_attn_fwd(q, k, v, window=(2, 1), device=device)
    o2, _ = ops.flash_attn_fwd(q, k, v, window=[2, 1], device=device)
    o3, _ = ops.flash_attn_fwd(q, k, v, window=(np.int64(2), np.int32(1)), device=device)
    assert np.array_equal(o1, o2) and np.array_equal(o1, o3)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", ["H", "BH", "H_f32", "BH_f16", "H_list"])
def test_alibi(ops, device, rng, dtype, form):
    b, h = 2, 3
    q, k, v = qkv(rng, dtype, b=b, h=h, nq=6, nk=10, d=16)
    if form.startswith("BH"):
        slopes = rng.uniform(0.05, 1.0, size=(b, h))
    else:
        slopes = 0.5 ** np.arange(1, h + 1)
    if form.endswith("f32"):
        slopes = slopes.astype(np.float32)
    elif form.endswith("f16"):
        slopes = slopes.astype(np.float16)
    elif form.endswith("list"):
        slopes = [float(s) for s in slopes]
    check_forward(ops, device, q, k, v, what="alibi " + form, alibi_slopes=slopes)
    check_forward(ops, device, q, k, v, what="alibi causal " + form, alibi_slopes=slopes,
                  causal=True)


def test_alibi_3d_and_5d(ops, device, rng):
    q, k, v = (randn(rng, (3, 5, 8), np.float32) for _ in range(3))
    check_forward(ops, device, q, k, v, what="3-D alibi (H,)", alibi_slopes=np.array([0.1, 0.2, 0.3]))
    q, k, v = (randn(rng, (2, 2, 3, 5, 8), np.float32) for _ in range(3))
    check_forward(ops, device, q, k, v, what="5-D alibi (H,)", alibi_slopes=np.array([0.1, 0.2, 0.3]))
    check_forward(ops, device, q, k, v, what="5-D alibi full", alibi_slopes=rng.uniform(0, 1, (2, 2, 3)))


def test_alibi_gqa(ops, device, rng):
    q, k, v = qkv(rng, np.float32, b=2, h=4, hkv=2, nq=5, nk=8, d=8)
    check_forward(ops, device, q, k, v, what="alibi gqa", alibi_slopes=rng.uniform(0, 1, (2, 4)))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("softcap", [0.5, 5.0, 30.0])
def test_softcap(ops, device, rng, dtype, softcap):
    q, k, v = qkv(rng, dtype, nq=7, nk=9, d=16, amp=3.0)
    check_forward(ops, device, q, k, v, what="softcap", softcap=softcap)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("scale", [0.1, 1.0, 2.5, 1e-3])
def test_scale(ops, device, rng, dtype, scale):
    q, k, v = qkv(rng, dtype, nq=7, nk=9, d=16)
    check_forward(ops, device, q, k, v, what="scale", scale=scale)


def test_large_scores_no_overflow(ops, device, rng):
    """Scores in the hundreds: the online softmax must track the running max."""
    for dtype in (np.float32, np.float64):
        q, k, v = qkv(rng, dtype, nq=17, nk=70, d=32, amp=6.0)
        check_forward(ops, device, q, k, v, what="large scores")
        check_forward(ops, device, q, k, v, what="large scores scale 5", scale=5.0)


COMBOS = [
    dict(causal=True, window=(3, -1), softcap=2.0),
    dict(causal=True, alibi=True, softcap=10.0, scale=0.5),
    dict(window=(2, 2), alibi=True),
    dict(window=(0, 4), softcap=1.0, gqa=True),
    dict(causal=True, window=(1, 1), alibi=True, softcap=3.0, gqa=True, scale=0.3),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("combo", COMBOS, ids=[str(c) for c in COMBOS])
@pytest.mark.parametrize("nq,nk", [(6, 10), (10, 6), (1, 500), (4, 900), (16, 300)])
def test_combinations(ops, device, rng, dtype, combo, nq, nk):
    kw = dict(combo)
    hkv = 1 if kw.pop("gqa", False) else 4
    q, k, v = qkv(rng, dtype, b=2, h=4, hkv=hkv, nq=nq, nk=nk, d=24, dv=12, amp=2.0)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = rng.uniform(0.01, 0.5, (4,))
    check_forward(ops, device, q, k, v, what=str(combo), **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kw,nq,nk", [
    (dict(causal=True), 9, 3),
    (dict(window=(-1, 1)), 9, 3),
    (dict(window=(2, 0), alibi_slopes=np.array([0.5, 0.25])), 12, 4),
    (dict(causal=True, softcap=1.0), 6, 1),
])
def test_fully_masked_rows(ops, device, rng, dtype, kw, nq, nk):
    q, k, v = qkv(rng, dtype, nq=nq, nk=nk, d=8)
    out, lse = ops.flash_attn_fwd(q, k, v, device=device, **kw)
    ro, rl = ref_fwd(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), **kw)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    dead = np.isneginf(rl)
    assert dead.any()
    assert np.all(out[dead] == 0), "masked rows must be 0, got %s" % out[dead]
    assert np.all(np.isneginf(lse[dead])), "masked rows must have lse -inf, got %s" % lse[dead]
    assert_close(out, ro, dtype, "out")
    assert_close(lse, rl, dtype, "lse")


def test_outputs_are_fresh_arrays(ops, device, rng):
    q, k, v = qkv(rng, np.float32)
    out, lse = ops.flash_attn_fwd(q, k, v, device=device)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    assert out.flags.c_contiguous and out.flags.writeable and out.flags.aligned
    assert lse.flags.c_contiguous and lse.flags.writeable
    assert not np.shares_memory(out, q) and not np.shares_memory(out, v)


@pytest.mark.parametrize("dev", [None, "auto", "cpu"])
def test_device_spellings(ops, rng, dev):
    q, k, v = qkv(rng, np.float32)
    out, lse = ops.flash_attn_fwd(q, k, v, device=dev)
    ro, rl = ref_fwd(q, k, v)
    assert_close(out, ro, np.float32, "out")
    assert_close(lse, rl, np.float32, "lse")


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=DT_IDS)
@pytest.mark.parametrize("n", [63, 64, 65, 127, 129, 191, 300])
def test_tile_boundaries(ops, device, rng, dtype, n):
    """Sequence lengths around typical block sizes, Nq != Nk, causal and not."""
    q, k, v = qkv(rng, dtype, b=1, h=1, nq=n, nk=n + 37, d=64, dv=48)
    check_forward(ops, device, q, k, v, what="n=%d" % n)
    check_forward(ops, device, q, k, v, what="causal n=%d" % n, causal=True)
    q, k, v = qkv(rng, dtype, b=1, h=1, nq=n + 37, nk=n, d=64, dv=48)
    check_forward(ops, device, q, k, v, what="causal Nq>Nk n=%d" % n, causal=True)


def test_many_heads_small_n(ops, device, rng):
    """Many batch-heads with tiny sequences (work split over batch-heads)."""
    q, k, v = qkv(rng, np.float32, b=25, h=40, nq=3, nk=2, d=8)
    check_forward(ops, device, q, k, v, what="1000 heads")
    check_forward(ops, device, q, k, v, what="1000 heads causal", causal=True)


@pytest.mark.parametrize("window", [(2**31 - 1, 0), (2**40, 2**40), (0, 2**33), (2**31, 2**31)])
def test_window_huge_values(ops, device, rng, window):
    """Window sizes beyond int32 behave as unbounded on that side (no overflow)."""
    q, k, v = qkv(rng, np.float64, nq=6, nk=9, d=8)
    check_forward(ops, device, q, k, v, what="window=%s" % (window,), window=window)
    check_forward(ops, device, q, k, v, what="window=%s causal" % (window,), window=window,
                  causal=True)


@pytest.mark.parametrize("scale", [0.0, -0.5, np.float32(0.25), np.float64(1.5)])
def test_scale_unusual(ops, device, rng, scale):
    """Any real scale is valid (as in SDPA / FlashAttention): 0 gives uniform attention,
    negative flips the scores; numpy scalars are accepted."""
    q, k, v = qkv(rng, np.float64, nq=5, nk=7, d=8)
    check_forward(ops, device, q, k, v, what="scale=%r" % scale, scale=float(scale))
    out, _ = ops.flash_attn_fwd(q, k, v, scale=scale, device=device)
    assert_close(out, ref_fwd(q, k, v, scale=float(scale))[0], np.float64, "out")


def test_alibi_negative_slopes(ops, device, rng):
    q, k, v = qkv(rng, np.float32, nq=6, nk=8, d=8)
    check_forward(ops, device, q, k, v, what="negative slopes",
                  alibi_slopes=np.array([-0.3, 0.2]), causal=True)


def test_float16_large_magnitudes(ops, device, rng):
    """float16 inputs whose scores overflow float16 (computed in float32 they do not)."""
    q, k, v = qkv(rng, np.float16, nq=8, nk=12, d=64, amp=30.0)
    check_forward(ops, device, q, k, v, what="f16 large")
    v = (rng.uniform(-6e4, 6e4, v.shape)).astype(np.float16)
    out, _ = check_forward(ops, device, q, k, v, what="f16 large values")
    assert np.all(np.isfinite(out))


def test_every_float16_read_exactly(ops, device):
    """Each of the 65,536 float16 bit patterns is widened exactly (subnormals, inf, NaN): one
    key of weight 1 makes out equal v, stored back bit for bit (but -0, which the float
    accumulator's +0 absorbs)."""
    v = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(256, 1, 256)
    q = np.zeros((256, 1, 8), np.float16)
    out, _ = ops.flash_attn_fwd(q, q, v, device=device)
    nan = np.isnan(v)
    assert np.isnan(out[nan]).all()
    same = out.view(np.uint16) == v.view(np.uint16)
    assert (same | nan | (v == 0)).all() and (out[v == 0] == 0).all()


def nonfinite_mismatches(ops, device):
    """The cases where the NaN entries of orchard's out and lse differ from the float64
    reference's (IEEE arithmetic, as torch's): a NaN or an inf in one key, a NaN in one value,
    a NaN query row; 2 query rows (the split-KV decode) and 40 (the forward), causal (rows
    that cannot see the key stay finite) and not."""
    rng = np.random.default_rng(0)
    bad = []
    for nq in (2, 40):
        for causal in (False, True):
            for what in ("k nan", "k inf", "v nan", "q nan"):
                q, k, v = (rng.standard_normal((1, 2, n, 8)).astype(np.float32)
                           for n in (nq, 50, 50))
                x, row = dict(k=(k, 30), v=(v, 30), q=(q, 1))[what[0]]
                x[0, 1, row, 3] = np.nan if what.endswith("nan") else np.inf
                out, lse = ops.flash_attn_fwd(q, k, v, causal=causal, device=device)
                with np.errstate(invalid="ignore"):     # the reference's own NaN
                    ro, rl = ref_fwd(q.astype(np.float64), k.astype(np.float64),
                                     v.astype(np.float64), causal=causal)
                if not (np.array_equal(np.isnan(out), np.isnan(ro))
                        and np.array_equal(np.isnan(lse), np.isnan(rl))):
                    bad.append("%d rows%s, %s" % (nq, " causal" if causal else "", what))
    return bad


@pytest.mark.parametrize("nq,nk", [(16, 16), (20, 7), (7, 20)])
def test_windows_past_any_length_are_unbounded(ops, device, rng, nq, nk):
    """Window entries up to 2**63 - 1 (sys.maxsize, a plausible "unbounded") and past it mask
    nothing, forward and backward: the mask's sums must not overflow. (2**63 and 2**64 were
    refused: "must be ints >= -1".)"""
    q, k, v, do = (randn(rng, (1, 2, n, 8), np.float32) for n in (nq, nk, nk, nq))
    out, lse = ops.flash_attn_fwd(q, k, v, device=device)
    grads = ops.flash_attn_bwd(do, q, k, v, out, lse, device=device)
    for window in ((-1, 2**63 - 1), (2**63 - 1, -1), (2**63 - 2, 2**62 + 1), (2**63, 2**64),
                   (np.uint64(2**63), -1)):
        o, l = ops.flash_attn_fwd(q, k, v, window=window, device=device)
        g = ops.flash_attn_bwd(do, q, k, v, o, l, window=window, device=device)
        assert np.array_equal(o, out) and np.array_equal(l, lse), window
        assert all(np.array_equal(a, b) for a, b in zip(g, grads)), window


def empty_row_leaks(ops, device):
    """The cases where a query row that sees no key (causal, Nq > Nk: the first Nq - Nk rows)
    gets anything but out 0, lse -inf and dQ 0 while a NaN or inf sits in a key or value that
    the rows after it see, in its block (a masked 0 times NaN)."""
    rng = np.random.default_rng(1)
    bad = []
    for nq, nk in ((8, 4), (40, 20), (300, 150)):
        for what in ("k nan", "k inf", "v nan", "v inf"):
            q, do = (rng.standard_normal((1, 2, nq, 8)).astype(np.float32) for _ in range(2))
            k, v = (rng.standard_normal((1, 2, nk, 8)).astype(np.float32) for _ in range(2))
            (k if what[0] == "k" else v)[0, 1, 0, 3] = np.nan if what.endswith("nan") else np.inf
            out, lse = ops.flash_attn_fwd(q, k, v, causal=True, device=device)
            dq = ops.flash_attn_bwd(do, q, k, v, out, lse, causal=True, device=device)[0]
            dead = slice(0, nq - nk)
            if not ((out[..., dead, :] == 0).all() and np.isneginf(lse[..., dead]).all()
                    and (dq[..., dead, :] == 0).all()):
                bad.append("%d x %d, %s" % (nq, nk, what))
    return bad


def test_nan_and_inf_carry_on(ops, device):
    """A NaN or inf that a row's attention reads makes that row NaN, out and lse, on every
    device and path, never a plausible 0 (the encoding of a row that sees no key); a row that
    sees no key stays 0 beside them."""
    assert nonfinite_mismatches(ops, device) == []
    assert empty_row_leaks(ops, device) == []


@pytest.mark.skipif(not OPENCL_IDS, reason="no OpenCL device listed")
@pytest.mark.parametrize("family", ["rows", "wg"])
def test_nan_and_inf_carry_on_in_every_kernel_family(family):
    r = run_python("import json, orchard_ops\n"
                   "from test_forward import empty_row_leaks, nonfinite_mismatches\n"
                   "print(json.dumps(nonfinite_mismatches(orchard_ops, %r)\n"
                   "                 + empty_row_leaks(orchard_ops, %r)))"
                   % (OPENCL_IDS[0], OPENCL_IDS[0]), timeout=300, ORCHARD_CL_FAMILY=family)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1]) == []
