"""The split-KV decode path (forwards with at most 16 query rows per head), on every device,
against the float64 reference; and flash_attn_with_kvcache decoding over long and ragged
caches, contiguous and paged."""

import numpy as np
import pytest

from conftest import assert_close, check_forward, randn, rounded, score_cond
from orchard.reference import ref_fwd, ref_varlen_fwd

MAX_QUERIES = 16    # OR_DECODE_MAX_QUERIES (csrc/orchard.h)


def qkv(rng, dtype, b=1, h=4, hkv=None, nq=1, nk=300, d=32, dv=None):
    hkv = h if hkv is None else hkv
    dv = d if dv is None else dv
    return (randn(rng, (b, h, nq, d), dtype), randn(rng, (b, hkv, nk, d), dtype),
            randn(rng, (b, hkv, nk, dv), dtype))


def decode_calls(ops, device):
    return ops.stats()["per_device"].get(device, {}).get("decode_calls", 0)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=["f16", "f32", "f64"])
@pytest.mark.parametrize("nq", [1, 3, MAX_QUERIES])
@pytest.mark.parametrize("h,hkv", [(4, 4), (8, 2), (6, 1)])
def test_decode_against_reference(ops, device, rng, dtype, nq, h, hkv):
    q, k, v = qkv(rng, dtype, h=h, hkv=hkv, nq=nq, nk=1000)
    before = decode_calls(ops, device)
    check_forward(ops, device, q, k, v, what="decode nq=%d h=%d/%d" % (nq, h, hkv))
    check_forward(ops, device, q, k, v, what="causal decode", causal=True)
    assert decode_calls(ops, device) == before + 2, "the split-KV path was not taken"


def test_prefill_is_not_decode(ops, device, rng):
    q, k, v = qkv(rng, np.float32, nq=MAX_QUERIES + 1, nk=64)
    before = decode_calls(ops, device)
    check_forward(ops, device, q, k, v, causal=True)
    assert decode_calls(ops, device) == before


@pytest.mark.parametrize("nk", [0, 1, 5, 95, 96, 97, 289, 2000])
def test_cache_lengths(ops, device, rng, nk):
    """Lengths around the block (96) and split (288) boundaries, and an empty cache."""
    q, k, v = qkv(rng, np.float32, h=4, hkv=2, nq=2, nk=nk, d=64)
    out, lse = check_forward(ops, device, q, k, v, what="nk=%d" % nk, causal=True)
    if nk == 0:
        assert np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("d,dv", [(1, 1), (3, 7), (64, 128), (100, 33), (128, 128), (256, 256)])
def test_head_dims(ops, device, rng, d, dv):
    q, k, v = qkv(rng, np.float32, h=4, hkv=2, nq=1, nk=500, d=d, dv=dv)
    check_forward(ops, device, q, k, v, what="d=%d dv=%d" % (d, dv))


FEATURES = {
    "window": dict(window=(200, 0)),
    "window+right": dict(window=(37, 3)),
    "softcap": dict(softcap=5.0),
    "alibi": dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625])),
    "scale": dict(scale=0.3),
    "everything": dict(window=(300, 0), softcap=10.0, causal=True, scale=0.2,
                       alibi_slopes=np.array([0.01, 0.02, 0.03, 0.04])),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("feature", list(FEATURES), ids=list(FEATURES))
def test_score_features(ops, device, rng, dtype, feature):
    q, k, v = qkv(rng, dtype, h=4, hkv=2, nq=4, nk=1200)
    check_forward(ops, device, q, k, v, what=feature, **FEATURES[feature])


def test_dropout_matches_the_reference_mask(ops, device, rng):
    q, k, v = qkv(rng, np.float64, h=4, hkv=2, nq=3, nk=700)
    check_forward(ops, device, q, k, v, what="dropout", dropout_p=0.3, seed=1234)


def side_by_side(x):
    """x (B, H, N, D) as a view of a (B, N, H, D) array, the heads of each row side by side."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("b,h,hkv,nk,d", [(2, 8, 2, 900, 64), (2, 32, 16, 2003, 128),
                                          (1, 4, 4, 37, 32), (3, 6, 3, 1, 16)])
def test_side_by_side_heads(ops, device, rng, b, h, hkv, nk, d):
    """(B, N, H, D) caches seen as (B, H, N, D), as FlashAttention's and a model's KV cache
    are: read in place, on the native path every head of a sequence in turn over blocks of 128
    keys down to 8 (16 kv heads of D 128: csrc/attn_native.c side_by_side)."""
    q, k, v = qkv(rng, np.float32, b=b, h=h, hkv=hkv, nq=1, nk=nk, d=d)
    check_forward(ops, device, q, side_by_side(k), side_by_side(v), causal=True,
                  what="side by side %d/%d heads, nk=%d" % (h, hkv, nk))


@pytest.mark.parametrize("feature", list(FEATURES), ids=list(FEATURES))
def test_side_by_side_score_features(ops, device, rng, feature):
    q, k, v = qkv(rng, np.float64, h=4, hkv=2, nq=4, nk=1200)
    check_forward(ops, device, q, side_by_side(k), side_by_side(v), what=feature,
                  **FEATURES[feature])


@pytest.mark.parametrize("layout", ["heads apart", "side by side"])
def test_thread_count_does_not_change_results(ops, rng, layout):
    q, k, v = qkv(rng, np.float32, b=2, h=8, hkv=4, nq=2, nk=3000, d=128)
    if layout == "side by side":
        k, v = side_by_side(k), side_by_side(v)
    threads = ops.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            ops.set_num_threads(n)
            results.append(ops.flash_attn_fwd(q, k, v, causal=True, device="cpu"))
    finally:
        ops.set_num_threads(threads)
    for out, lse in results[1:]:
        assert np.array_equal(out, results[0][0]) and np.array_equal(lse, results[0][1])


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("hkv,nk", [(8, 1000), (32, 517), (4, 3001)])
def test_side_by_side_softmax_blocks(ops, rng, dtype, hkv, nk):
    """Side-by-side heads are read a chunk of 32 or 8 keys per head in turn, but their softmax
    blocks are the contiguous path's (csrc/attn_decode_impl.h decode_split): the same bits
    where the splits are the same too (here the shortest, 384 keys, in both layouts)."""
    if dtype == "bfloat16":
        torch = pytest.importorskip("torch")
        q, k, v = (torch.from_numpy(x).to(torch.bfloat16)
                   for x in qkv(rng, np.float32, h=32, hkv=hkv, nk=nk, d=128))
        apart = ops.flash_attn_fwd(q, k, v, causal=True, device="cpu")
        k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
        together = ops.flash_attn_fwd(q, k, v, causal=True, device="cpu")
        same = [torch.equal(a, b) for a, b in zip(apart, together)]
    else:
        q, k, v = qkv(rng, getattr(np, dtype), h=32, hkv=hkv, nk=nk, d=128)
        apart = ops.flash_attn_fwd(q, k, v, causal=True, device="cpu")
        together = ops.flash_attn_fwd(q, side_by_side(k), side_by_side(v), causal=True,
                                      device="cpu")
        same = [np.array_equal(a, b) for a, b in zip(apart, together)]
    assert same == [True, True]


def test_varlen_ragged_decode(ops, device, rng):
    """One query token per sequence over ragged key counts, with seqused_k: the cache layout
    of flash_attn_with_kvcache (each sequence's slot longer than what it uses)."""
    h, hkv, d, slot = 8, 2, 64, 1500
    used = np.array([1, 1500, 0, 777, 96], dtype=np.int32)
    b = len(used)
    q = randn(rng, (b, h, d), np.float32)
    k, v = randn(rng, (b * slot, hkv, d), np.float32), randn(rng, (b * slot, hkv, d), np.float32)
    cu_q = np.arange(b + 1, dtype=np.int32)
    cu_k = np.arange(0, (b + 1) * slot, slot, dtype=np.int32)
    before = decode_calls(ops, device)
    out, lse = ops.flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, causal=True, seqused_k=used,
                                         device=device)
    assert decode_calls(ops, device) == before + 1
    idx = np.concatenate([np.arange(s, s + n) for s, n in zip(cu_k[:-1], used)])
    exact_cu_k = np.concatenate([[0], np.cumsum(used)]).astype(np.int32)
    ro, rl = ref_varlen_fwd(rounded(q), rounded(k[idx]), rounded(v[idx]), cu_q, exact_cu_k,
                            causal=True)
    cond = score_cond(q, k)
    assert_close(out, ro, np.float32, "out", "ragged out", cond=cond)
    assert_close(lse, rl, np.float32, "lse", "ragged lse", cond=cond)


@pytest.mark.parametrize("used,msg", [([1, 2], "seqused_k"), ([5, 2000, 3], r"seqused_k'\[1\]"),
                                      ([-1, 0, 0], r"seqused_k'\[0\]")])
def test_seqused_k_is_checked(ops, rng, used, msg):
    q = randn(rng, (3, 2, 8), np.float32)
    k = randn(rng, (30, 2, 8), np.float32)
    cu_q = np.arange(4, dtype=np.int32)
    cu_k = np.array([0, 10, 20, 30], dtype=np.int32)
    with pytest.raises(ValueError, match=msg):
        ops.flash_attn_varlen_fwd(q, k, k, cu_q, cu_k, seqused_k=np.array(used))


# ------------------------------------------------------------ flash_attn_with_kvcache


def reference_decode(q, k_cache, v_cache, seqlens, causal):
    """float64 reference of one query token per sequence over the first seqlens[b] cache
    rows: out (B, 1, H, Dv)."""
    outs = []
    for b, s in enumerate(seqlens):
        qb = q[b].double().transpose(0, 1).numpy()[None]                # (1, H, 1, D)
        kb = k_cache[b, :s].double().transpose(0, 1).numpy()[None]
        vb = v_cache[b, :s].double().transpose(0, 1).numpy()[None]
        o, _ = ref_fwd(qb, kb, vb, causal=causal)
        outs.append(o[0].transpose(1, 0, 2))
    return np.stack(outs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("seqlens", [[1], [20000], [3, 4095, 17, 1000]], ids=str)
def test_kvcache_decode(dtype, paged, seqlens):
    # a skip here, not at module level, so that the NumPy tests above run without torch
    torch = pytest.importorskip("torch")
    from orchard.flash_attn import flash_attn_with_kvcache
    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(sum(seqlens))
    batch, h, hk, d, cap = len(seqlens), 8, 2, 64, max(seqlens) + 7
    q = torch.randn(batch, 1, h, d, generator=g).to(dtype)
    k_cache = torch.randn(batch, cap, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(batch, cap, hk, d, generator=g).to(dtype)
    kw = dict(cache_seqlens=torch.tensor(seqlens, dtype=torch.int32), causal=True)
    if paged:
        page = 256
        pages = -(-cap // page)
        perm = torch.randperm(batch * pages, generator=g)
        table = perm.reshape(batch, pages).to(torch.int32)
        kp = torch.zeros(batch * pages, page, hk, d, dtype=dtype)
        vp = torch.zeros_like(kp)
        for b in range(batch):
            for i in range(pages):
                rows = slice(i * page, min((i + 1) * page, cap))
                n = rows.stop - rows.start
                kp[table[b, i], :n] = k_cache[b, rows]
                vp[table[b, i], :n] = v_cache[b, rows]
        out = flash_attn_with_kvcache(q, kp, vp, block_table=table, **kw)
    else:
        out = flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    ref = reference_decode(q, k_cache, v_cache, seqlens, causal=True)
    t = 1e-5 if dtype == torch.float32 else 8e-3    # bfloat16: the output's rounding
    assert_close(out.float().numpy(), ref, np.float32, "out", "kvcache %s" % seqlens, t=t)
