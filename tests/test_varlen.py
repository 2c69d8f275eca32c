"""Variable-length (packed) attention: equals per-sequence dense calls and the reference."""

import numpy as np
import pytest

from conftest import assert_close, grad_floor, lse_dtype, randn, rounded
from orchard.reference import ref_fwd, ref_varlen_bwd, ref_varlen_fwd

DTYPES = [np.float16, np.float32, np.float64]
DT_IDS = ["f16", "f32", "f64"]


def packed(rng, dtype, lq, lk, h=4, hkv=None, d=16, dv=8):
    hkv = h if hkv is None else hkv
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = randn(rng, (int(cq[-1]), h, d), dtype)
    k = randn(rng, (int(ck[-1]), hkv, d), dtype)
    v = randn(rng, (int(ck[-1]), hkv, dv), dtype)
    do = randn(rng, (int(cq[-1]), h, dv), dtype)
    return q, k, v, do, cq, ck


LENGTHS = [
    ([5, 3, 8], [5, 3, 8]),
    ([4, 0, 7, 1], [6, 3, 0, 9]),
    ([0, 0], [0, 0]),
    ([1], [1]),
    ([13, 2], [3, 17]),
    ([33], [40]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("lq,lk", LENGTHS, ids=[str(x) for x in LENGTHS])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_equals_dense_calls(ops, device, rng, dtype, lq, lk, causal):
    q, k, v, do, cq, ck = packed(rng, dtype, lq, lk)
    out, lse = ops.flash_attn_varlen_fwd(q, k, v, cq, ck, causal=causal, device=device)
    assert out.shape == (q.shape[0], q.shape[1], v.shape[2]) and out.dtype == dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == lse_dtype(dtype)
    dq, dk, dv = ops.flash_attn_varlen_bwd(do, q, k, v, out, lse, cq, ck, causal=causal,
                                           device=device)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == dtype
    for b in range(len(lq)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        qb, kb, vb, dob = (np.ascontiguousarray(x.transpose(1, 0, 2))
                           for x in (q[sq], k[sk], v[sk], do[sq]))
        ob, lb = ops.flash_attn_fwd(qb, kb, vb, causal=causal, device=device)
        gb = ops.flash_attn_bwd(dob, qb, kb, vb, ob, lb, causal=causal, device=device)
        what = "seq %d" % b
        fl = grad_floor(dob, ob, qb, kb, None, lq[b] / max(lk[b], 1))
        assert_close(out[sq], ob.astype(np.float64).transpose(1, 0, 2), dtype, "out", what)
        assert_close(lse[:, sq], lb, dtype, "lse", what)
        for name, g, gd in (("dq", dq[sq], gb[0]), ("dk", dk[sk], gb[1]), ("dv", dv[sk], gb[2])):
            assert_close(g, gd.astype(np.float64).transpose(1, 0, 2), dtype, "grad",
                         what + " " + name, floor=fl)


VARLEN_FEATURES = [
    dict(),
    dict(causal=True),
    dict(gqa=True),
    dict(gqa=True, causal=True),
    dict(window=(2, 1)),
    dict(alibi="H", causal=True),
    dict(alibi="BH", softcap=1.5),
    dict(dropout_p=0.3, seed=77),
    dict(dropout_p=0.5, seed=2**33 + 1, causal=True, gqa=True),
    dict(dropout_p=0.2, seed=5, alibi="BH", window=(3, -1), softcap=3.0, scale=0.6),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("feat", VARLEN_FEATURES, ids=[str(f) for f in VARLEN_FEATURES])
@pytest.mark.parametrize("lq,lk", [([4, 0, 7, 2], [6, 3, 0, 9]), ([9, 3], [4, 8]),
                                   ([1, 16, 4, 4], [900, 300, 0, 2])])
def test_varlen_vs_reference(ops, device, rng, dtype, feat, lq, lk):
    kw = dict(feat)
    h = 4
    hkv = 2 if kw.pop("gqa", False) else h
    a = kw.pop("alibi", None)
    if a == "H":
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, (h,))
    elif a == "BH":
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, (len(lq), h))
    q, k, v, do, cq, ck = packed(rng, dtype, lq, lk, h=h, hkv=hkv)
    out, lse = ops.flash_attn_varlen_fwd(q, k, v, cq, ck, device=device, **kw)
    args = [rounded(x) for x in (q, k, v)]
    ro, rl = ref_varlen_fwd(*args, cq, ck, **kw)
    assert_close(out, ro, dtype, "out", "varlen out")
    assert_close(lse, rl, dtype, "lse", "varlen lse")
    grads = ops.flash_attn_varlen_bwd(do, q, k, v, out, lse, cq, ck, device=device, **kw)
    rgrads = ref_varlen_bwd(rounded(do), *args, cq, ck, **kw)
    floor = grad_floor(do, out, q, k, kw.get("scale"), max(a / max(b, 1) for a, b in zip(lq, lk)))
    for name, g, r, x in zip(("dq", "dk", "dv"), grads, rgrads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert_close(g, r, dtype, "grad", "varlen " + name, floor=floor)


def test_varlen_dropout_keyed_by_b_times_h(ops, device, rng):
    """Sequence b, head h uses the dense mask of batch-head b*H + h with local indices."""
    h, lens = 3, [5, 6, 4]
    q, k, v, _, cq, ck = packed(rng, np.float64, lens, lens, h=h)
    p, seed = 0.5, 4242
    out, _ = ops.flash_attn_varlen_fwd(q, k, v, cq, ck, dropout_p=p, seed=seed, device=device)
    mask = np.asarray(ops.dropout_mask((len(lens), h, 6, 16), (len(lens), h, 6, 16), p, seed))
    for b, n in enumerate(lens):
        qb, kb, vb = (x[cq[b]:cq[b + 1]].transpose(1, 0, 2)[None] for x in (q, k, v))
        ro, _ = ref_fwd(qb, kb, vb, dropout_p=p, keep=mask[b:b + 1, :, :n, :n])
        assert_close(out[cq[b]:cq[b + 1]], ro[0].transpose(1, 0, 2), np.float64, "out", "seq %d" % b)


@pytest.mark.parametrize("cu_dtype", [np.int32, np.int64])
def test_varlen_cu_seqlens_dtypes_and_max_seqlen(ops, device, rng, cu_dtype):
    q, k, v, do, cq, ck = packed(rng, np.float32, [3, 5], [4, 2])
    cq, ck = cq.astype(cu_dtype), ck.astype(cu_dtype)
    ro, rl = ref_varlen_fwd(q, k, v, cq, ck, causal=True)
    # (max_seqlen past 2**63 was refused: "must be an int >= 5")
    for mq, mk in [(None, None), (5, 4), (100, 100), (2**63, np.uint64(2**64 - 1))]:
        out, lse = ops.flash_attn_varlen_fwd(q, k, v, cq, ck, mq, mk, causal=True, device=device)
        assert_close(out, ro, np.float32, "out", "max_seqlen=%s,%s" % (mq, mk))
        assert_close(lse, rl, np.float32, "lse")
        grads = ops.flash_attn_varlen_bwd(do, q, k, v, out, lse, cq, ck, mq, mk, causal=True,
                                          device=device)
        for g, r in zip(grads, ref_varlen_bwd(do, q, k, v, cq, ck, causal=True)):
            assert_close(g, r, np.float32, "grad")


def test_varlen_cu_seqlens_as_lists(ops, device, rng):
    q, k, v, _, cq, ck = packed(rng, np.float64, [2, 3], [3, 3])
    out, _ = ops.flash_attn_varlen_fwd(q, k, v, [int(x) for x in cq], [int(x) for x in ck],
                                       device=device)
    assert_close(out, ref_varlen_fwd(q, k, v, cq, ck)[0], np.float64, "out")


def test_varlen_index_arrays_as_torch_tensors(ops, rng):
    """cu_seqlens, seqused_k, leftpad_k and ALiBi slopes as torch tensors (read in place
    through DLPack) of any integer dtype and any strides give what NumPy arrays give; a tensor
    of another kind is refused naming the argument."""
    torch = pytest.importorskip("torch")
    q, k, v, _, cq, ck = packed(rng, np.float32, [3, 5], [6, 4])
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    kw = dict(causal=True, seqused_k=np.array([5, 4]), leftpad_k=np.array([1, 0]))
    want = ops.flash_attn_varlen_fwd(q, k, v, cq, ck, alibi_slopes=slopes, **kw)
    for dtype in (torch.int32, torch.int64, torch.uint8, torch.int16):
        every_other = lambda a: torch.tensor(np.repeat(a, 2)).to(dtype)[::2]    # stride 2
        got = ops.flash_attn_varlen_fwd(
            q, k, v, every_other(cq), every_other(ck), alibi_slopes=torch.tensor(slopes),
            **{name: every_other(a) for name, a in kw.items() if name != "causal"}, causal=True)
        assert all(np.array_equal(g, w) for g, w in zip(got, want)), dtype
    for bad, error, words in ((torch.tensor([0, 3, 8]).bool(), ValueError, "1-D integer array"),
                              (torch.tensor([0, 3, 8]).to(torch.complex64), TypeError,
                               "'cu_seqlens_q' must be an array of integers or floats"),
                              (torch.empty(3, device="meta"), TypeError,
                               "'cu_seqlens_q' cannot be viewed as an array")):
        with pytest.raises(error, match=words):
            ops.flash_attn_varlen_fwd(q, k, v, bad, ck)
    # the slopes' own words reach the caller (they are not replaced by a generic message)
    with pytest.raises(ValueError, match="'alibi_slopes' is a torch tensor with its negative bit"):
        ops.flash_attn_varlen_fwd(q, k, v, cq, ck, alibi_slopes=torch._neg_view(
            torch.tensor(slopes)))


def test_varlen_empty_total(ops, device, rng):
    q, k, v, do, cq, ck = packed(rng, np.float32, [0, 0, 0], [0, 2, 0])
    out, lse = ops.flash_attn_varlen_fwd(q, k, v, cq, ck, device=device)
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0)
    dq, dk, dv = ops.flash_attn_varlen_bwd(do, q, k, v, out, lse, cq, ck, device=device)
    assert dq.shape == q.shape and dk.shape == k.shape
    assert np.all(dk == 0) and np.all(dv == 0)


def test_varlen_empty_sequences_change_nothing(ops, device, rng):
    """Thousands of empty sequences between and after the real ones (a batch padded to a fixed
    number of sequences; orchard.hf's compiled packing) give the results without them, bit for
    bit; the native path leaves their work items out rather than sorting and running them."""
    q, k, v, do, cq, ck = packed(rng, np.float32, [5, 9], [7, 9])
    want = ops.flash_attn_varlen_fwd(q, k, v, cq, ck, causal=True, device=device)
    want += ops.flash_attn_varlen_bwd(do, q, k, v, *want, cq, ck, causal=True, device=device)
    cq, ck = (np.concatenate([c[:1], np.repeat(c[1], 3000), c[1:], np.repeat(c[-1], 3000)])
              .astype(np.int32) for c in (cq, ck))
    got = ops.flash_attn_varlen_fwd(q, k, v, cq, ck, causal=True, device=device)
    got += ops.flash_attn_varlen_bwd(do, q, k, v, *got, cq, ck, causal=True, device=device)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert np.array_equal(g, w), name


def test_varlen_masked_rows(ops, device, rng):
    """Sequences with Nk < Nq under causal and with Nk = 0: out 0, lse -inf, grads 0."""
    q, k, v, do, cq, ck = packed(rng, np.float32, [6, 3], [2, 0])
    out, lse = ops.flash_attn_varlen_fwd(q, k, v, cq, ck, causal=True, device=device)
    ro, rl = ref_varlen_fwd(q, k, v, cq, ck, causal=True)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert_close(out, ro, np.float32, "out")
    assert_close(lse, rl, np.float32, "lse")
    grads = ops.flash_attn_varlen_bwd(do, q, k, v, out, lse, cq, ck, causal=True, device=device)
    for g, r in zip(grads, ref_varlen_bwd(do, q, k, v, cq, ck, causal=True)):
        assert not np.isnan(g).any()
        assert_close(g, r, np.float32, "grad")


def test_opencl_backward_memory_follows_the_tokens_not_the_longest_sequence():
    """The backward's per-row buffers (D, and the tiled family's dQ accumulator) were laid out
    (sequence x longest sequence): 4,000 one-token sequences beside one of 1,000 took a
    gigabyte (native path: a few megabytes). Now they hold the rows there are."""
    from conftest import CPU_OPENCL_IDS, run_python

    if not CPU_OPENCL_IDS:
        pytest.skip("no OpenCL device on the CPU")
    result = run_python("""
        import resource
        import numpy as np, orchard_ops as o
        lens = [1] * 4000 + [1000]
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        q = np.random.default_rng(0).standard_normal((int(cu[-1]), 1, 64), dtype=np.float32)
        out, lse = o.flash_attn_varlen_fwd(q, q, q, cu, cu, causal=True, device="%s")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        o.flash_attn_varlen_bwd(out, q, q, q, out, lse, cu, cu, causal=True, device="%s")
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """ % (CPU_OPENCL_IDS[0], CPU_OPENCL_IDS[0]), ORCHARD_CL_FAMILY="tiled")
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) < 200, result.stdout     # MiB; 1,020 before
