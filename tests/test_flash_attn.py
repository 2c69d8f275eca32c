"""orchard.flash_attn: FlashAttention-2's API against float64 references.

Low precision follows FlashAttention-2's rule: orchard's error against the float64 reference
is at most twice (out, lse; three times for gradients, as FA-2's tests allow) the error of the
same attention computed by plain torch in that dtype, plus a small absolute epsilon. Tensors are (batch, seqlen, nheads, headdim) as FA-2 has them.
"""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import orchard_ops  # noqa: E402
from orchard.flash_attn import (  # noqa: E402
    _get_block_size_n, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
    flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache)
from orchard.reference import ref_bwd, ref_fwd  # noqa: E402

LOW = [torch.float32, torch.float16, torch.bfloat16]
EPS = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


# ----------------------------------------------------------------------------- references


def np64(t):
    return t.detach().double().numpy()


def ref(q, k, v, dout, keep=None, **kw):
    """float64 out, lse, dq, dk, dv by orchard.reference, for (batch, seqlen, nheads, headdim)
    tensors; keep (batch, nheads, seqlen_q, seqlen_k) is the dropout keep-mask."""
    qa, ka, va, da = (np64(t).transpose(0, 2, 1, 3) for t in (q, k, v, dout))
    if keep is not None:
        keep = keep.numpy()
    out, lse = ref_fwd(qa, ka, va, keep=keep, **kw)
    grads = ref_bwd(da, qa, ka, va, keep=keep, **kw)
    back = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(0, 2, 1, 3)))
    return [back(out), torch.from_numpy(lse)] + [back(g) for g in grads]


def torch_attn(q, k, v, scale=None, dropout_p=0.0, causal=False, window=(-1, -1),
               alibi_slopes=None, softcap=0.0, keep=None):
    """Plain torch attention in q's dtype (the baseline of the tolerance rule): out, lse."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    nq, nk = q.shape[1], k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    diag = torch.arange(nq)[:, None] + nk - nq
    j = torch.arange(nk)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.reshape(-1 if alibi_slopes.dim() == 1 else q.shape[0], q.shape[2])
        s = s - (slopes[..., None, None] * (diag - j).abs()).to(s.dtype)
    vis = torch.ones(nq, nk, dtype=torch.bool)
    if window[0] >= 0:
        vis &= j >= diag - window[0]
    if window[1] >= 0:
        vis &= j <= diag + window[1]
    if causal:
        vis &= j <= diag
    s = s.masked_fill(~vis, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)  # rows that see no key
    if keep is not None:
        p = p.masked_fill(~keep, 0.0) / (1 - dropout_p)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), torch.logsumexp(s, -1)


def assert_rule(name, got, ref64, low):
    """|got - ref64| <= m |low - ref64| + eps (max over entries), m = 2 (3 for gradients);
    -inf must match exactly."""
    eps = EPS[low.dtype]
    got, low = got.double(), low.double()
    inf = torch.isinf(ref64)
    assert torch.equal(torch.isinf(got), inf), "%s: -inf pattern differs" % name
    assert not torch.isnan(got).any(), "%s: NaN" % name
    got, low, ref64 = (t.masked_fill(inf, 0.0) for t in (got, low, ref64))
    err = (got - ref64).abs().max().item()
    base = (low - ref64).abs().max().item()
    m = 3 if name.startswith("d") else 2
    assert err <= m * base + eps, "%s: error %.3g, torch's %.3g" % (name, err, base)


def keep_from(S):
    """FlashAttention-2's tests read the dropout pattern from S_dmask's sign."""
    return ~torch.signbit(S)


def check_against_reference(q, k, v, out, lse, S, dtype, **opts):
    """out, lse and the gradients of out (already computed, with q, k, v leaves) against the
    float64 reference under the tolerance rule."""
    fa2_to_ref = dict(scale=opts.get("softmax_scale"), causal=opts.get("causal", False),
                      window=tuple(opts.get("window_size", (-1, -1))),
                      alibi_slopes=None if opts.get("alibi_slopes") is None
                      else opts["alibi_slopes"].double().numpy(),
                      softcap=opts.get("softcap", 0.0), dropout_p=opts.get("dropout_p", 0.0))
    keep = keep_from(S) if fa2_to_ref["dropout_p"] > 0 else None
    dout = randn(*out.shape, dtype=dtype, seed=9)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    r = ref(q, k, v, dout, keep, **fa2_to_ref)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref_kw = dict(fa2_to_ref, window=fa2_to_ref["window"],
                  alibi_slopes=opts.get("alibi_slopes"), keep=keep)
    lo, llse = torch_attn(ql, kl, vl, **ref_kw)
    lgrads = torch.autograd.grad(lo, (ql, kl, vl), dout)
    for name, got, r64, low in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + grads, r,
                                   (lo, llse) + lgrads):
        assert_rule(name, got, r64, low)


# ----------------------------------------------------------------------------- dense

CASES = {
    "plain": dict(),
    "causal Nq<Nk": dict(causal=True, nq=5, nk=11),
    "causal Nq>Nk (rows without keys)": dict(causal=True, nq=11, nk=5),
    "window": dict(window_size=(3, 1), nq=9, nk=12),
    "window edges": dict(window_size=(8, 9), nq=9, nk=10),
    "window causal alibi (B, H)": dict(window_size=(4, 0), causal=True, alibi="bh"),
    "softcap alibi (H,) scale": dict(softcap=2.5, alibi="h", softmax_scale=0.4),
    "dropout causal": dict(dropout_p=0.2, causal=True),
    "dropout window alibi MQA": dict(dropout_p=0.17, alibi="bh", window_size=(4, 2), hk=1),
    "GQA headdim 40": dict(hk=2, d=40, causal=True),
}


def make_dense(case, dtype, seed=0):
    case = dict(case)
    b, h = 2, 4
    nq, nk, hk, d = case.pop("nq", 8), case.pop("nk", 10), case.pop("hk", 4), case.pop("d", 16)
    q = randn(b, nq, h, d, dtype=dtype, seed=seed).requires_grad_()
    k = randn(b, nk, hk, d, dtype=dtype, seed=seed + 1).requires_grad_()
    v = randn(b, nk, hk, d, dtype=dtype, seed=seed + 2).requires_grad_()
    alibi = case.pop("alibi", None)
    if alibi:
        case["alibi_slopes"] = torch.rand(*((b, h) if alibi == "bh" else (h,)),
                                          generator=torch.Generator().manual_seed(3)) * 0.5
    return q, k, v, case


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_func_against_reference(case, dtype):
    q, k, v, opts = make_dense(CASES[case], dtype)
    torch.manual_seed(0)
    out, lse, S = flash_attn_func(q, k, v, return_attn_probs=True, **opts)
    assert out.dtype == dtype and out.shape == q.shape and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    check_against_reference(q, k, v, out, lse, S, dtype, **opts)


def test_func_on_every_device(device):
    q, k, v, opts = make_dense(CASES["dropout window alibi MQA"], torch.float32)
    out, lse, S = flash_attn_func(q, k, v, return_attn_probs=True, device=device, **opts)
    check_against_reference(q, k, v, out, lse, S, torch.float32, **opts)


@pytest.mark.parametrize("packing", ["qkv", "kv"])
def test_packed_equal_unpacked(packing):
    q, k, v, opts = make_dense(dict(causal=True, alibi="h", dropout_p=0.1, nk=8, nq=8,
                                    hk=4 if packing == "qkv" else 2), torch.float32)
    dout = randn(*q.shape, seed=5)
    torch.manual_seed(1)
    want = flash_attn_func(q, k, v, return_attn_probs=True, **opts)
    want_grads = torch.autograd.grad(want[0], (q, k, v), dout)
    torch.manual_seed(1)
    if packing == "qkv":
        qkv = torch.stack((q, k, v), 2).detach().requires_grad_()
        got = flash_attn_qkvpacked_func(qkv, opts.pop("dropout_p"), return_attn_probs=True, **opts)
        (dqkv,) = torch.autograd.grad(got[0], qkv, dout)
        grads = dqkv.unbind(2)
    else:
        q2 = q.detach().clone().requires_grad_()
        kv = torch.stack((k, v), 2).detach().requires_grad_()
        got = flash_attn_kvpacked_func(q2, kv, opts.pop("dropout_p"), return_attn_probs=True,
                                       **opts)
        dq, dkv = torch.autograd.grad(got[0], (q2, kv), dout)
        grads = (dq,) + dkv.unbind(2)
    for a, b in zip(got + grads, want + want_grads):
        assert torch.equal(a, b)


def test_gradcheck_float64_every_option():
    q, k, v, opts = make_dense(dict(causal=True, window_size=(3, 2), alibi="bh", softcap=3.0,
                                    dropout_p=0.2, hk=2, nq=5, nk=7, d=8), torch.float64)

    def f(q, k, v):
        torch.manual_seed(4)  # the same dropout mask in every evaluation
        return flash_attn_func(q, k, v, **opts)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_strided_inputs_are_read_in_place():
    big = randn(2, 9, 4, 3, 16)  # a (batch, seqlen, nheads, 3, headdim) buffer
    q, k, v = big[:, :, :, 0], big[:, :, :, 1], big[:, :, :2, 2]  # GQA slice for v
    k = k[:, :, :2]
    assert not q.is_contiguous() and q.stride(-1) == 1
    orchard_ops.reset_stats()
    out = flash_attn_func(q, k, v, causal=True, device="cpu")
    assert orchard_ops.stats()["staged_buffers"] == 0
    want = flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, want) and out.is_contiguous()
    # (batch, nheads, seqlen, headdim) memory seen as FlashAttention-2's layout: out is
    # contiguous in that layout all the same, and so are the gradients' shapes
    qh, kh, vh = (x.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
                  for x in (q, k, v))
    out = flash_attn_func(qh, kh, vh, causal=True, device="cpu")
    assert torch.equal(out, want) and out.is_contiguous()
    out.sum().backward()
    assert all(x.grad.shape == x.shape for x in (qh, kh, vh))


def test_return_values_and_keywords():
    q, k, v, _ = make_dense({}, torch.float32)
    out = flash_attn_func(q, k, v, 0.0, None, False, (-1, -1), 0.0, None, True, False,
                          device="cpu")
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, flash_attn_func(q, k, v, deterministic=False))
    torch.manual_seed(3)
    a = flash_attn_func(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    assert torch.equal(a, flash_attn_func(q, k, v, dropout_p=0.5))
    assert not torch.equal(a, flash_attn_func(q, k, v, dropout_p=0.5))
    # Window sizes as FA-2's tests pass them (a tensor), and a window past every key.
    w = torch.tensor([3, 1])
    assert torch.equal(flash_attn_func(q, k, v, window_size=w),
                       flash_attn_func(q, k, v, window_size=(3, 1)))
    assert torch.equal(flash_attn_func(q, k, v, window_size=(10, 10)), out)


def test_one_unbounded_window_side_reaches_seqlen_k_as_fa2():
    # FlashAttention-2 (set_params_fprop): with one bound set, -1 on the other side becomes
    # seqlen_k; where Nq > Nk that leaves the rows whose window ends before the first key
    # empty, as orchard_ops computes with that bound given
    q, k, v = randn(1, 10, 1, 8), randn(1, 2, 1, 8, seed=1), randn(1, 2, 1, 8, seed=2)
    for window, explicit in (((1, -1), (1, 2)), ((-1, 1), (2, 1))):
        out, lse, _ = flash_attn_func(q, k, v, window_size=window, return_attn_probs=True)
        want, want_lse = orchard_ops.flash_attn_fwd(q.transpose(1, 2), k.transpose(1, 2),
                                                    v.transpose(1, 2), window=explicit)
        assert torch.equal(out, torch.as_tensor(want).transpose(1, 2))
        assert torch.equal(lse, torch.as_tensor(want_lse))
    assert lse[0, 0, :7].eq(-math.inf).all() and lse[0, 0, 7:].isfinite().all()


def test_softcap_at_or_below_zero_is_none_as_fa2():
    # FlashAttention-2: "Anything > 0 activates softcapping attention" (flash_api.cpp sets 0
    # otherwise), so ported code passing a negative one computes plain attention
    q, k, v = randn(2, 5, 2, 8), randn(2, 7, 2, 8, seed=1), randn(2, 7, 2, 8, seed=2)
    plain = flash_attn_func(q, k, v, causal=True)
    for softcap in (-2.0, -math.inf):
        assert torch.equal(flash_attn_func(q, k, v, causal=True, softcap=softcap), plain)
        assert torch.equal(flash_attn_with_kvcache(q, k, v, causal=True, softcap=softcap), plain)
    assert not torch.equal(flash_attn_func(q, k, v, causal=True, softcap=2.0), plain)


def test_S_dmask_normalises_to_the_probabilities_as_fa2_tests_do():
    # Several key blocks, so the per-block scaling matters.
    nk = 2 * _get_block_size_n(None, 8, True, False) + 7
    q, k, v, opts = make_dense(dict(nq=3, nk=nk, d=8, dropout_p=0.3, alibi="h"), torch.float32)
    torch.manual_seed(2)
    out, lse, S = flash_attn_func(q, k, v, return_attn_probs=True, **opts)
    assert S.shape == (2, 4, 3, nk) and S.dtype == torch.float32
    keep = keep_from(S)
    assert abs((~keep).float().mean().item() - 0.3) < 0.05
    # FA-2's normalize_flash_attn_S: block c times exp(max over blocks c.. - lse).
    qa, ka = np64(q).transpose(0, 2, 1, 3), np64(k).transpose(0, 2, 1, 3)
    s = torch.from_numpy(qa @ ka.transpose(0, 1, 3, 2)) / math.sqrt(8)
    dist = (torch.arange(3)[:, None] + nk - 3 - torch.arange(nk)[None, :]).abs()
    s = s - opts["alibi_slopes"].double()[:, None, None] * dist
    bn = _get_block_size_n(None, 8, True, False)
    blocks = s.split(bn, -1)
    m = torch.stack([b.amax(-1) for b in blocks], -1).flip(-1).cummax(-1).values.flip(-1)
    ref_lse = torch.logsumexp(s, -1)
    probs = torch.cat([a.double() * torch.exp(m[..., c] - ref_lse)[..., None]
                       for c, a in enumerate(S.abs().split(bn, -1))], -1)
    torch.testing.assert_close(probs, torch.softmax(s, -1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- varlen


def varlen_inputs(dtype, lens_q, lens_k, h=4, hk=2, d=16, seed=0):
    q = randn(sum(lens_q), h, d, dtype=dtype, seed=seed).requires_grad_()
    k = randn(sum(lens_k), hk, d, dtype=dtype, seed=seed + 1).requires_grad_()
    v = randn(sum(lens_k), hk, d, dtype=dtype, seed=seed + 2).requires_grad_()
    cu = lambda lens: torch.tensor(np.cumsum([0] + lens), dtype=torch.int32)
    return q, k, v, cu(lens_q), cu(lens_k)


VARLEN_CASES = {
    "causal GQA": dict(causal=True),
    "window alibi (B, H) softcap": dict(window_size=(2, 1), alibi="bh", softcap=2.0),
    "dropout causal alibi (H,)": dict(dropout_p=0.2, causal=True, alibi="h"),
}


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("case", list(VARLEN_CASES), ids=list(VARLEN_CASES))
def test_varlen_against_reference(case, dtype):
    lens_q, lens_k = [3, 0, 7, 5], [6, 4, 7, 2]
    q, k, v, cu_q, cu_k = varlen_inputs(dtype, lens_q, lens_k)
    opts = dict(VARLEN_CASES[case])
    alibi = opts.pop("alibi", None)
    if alibi:
        opts["alibi_slopes"] = torch.rand(*((4, 4) if alibi == "bh" else (4,))) * 0.5
    torch.manual_seed(0)
    out, lse, S = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                         return_attn_probs=True, **opts)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    assert S.shape == ((4, 4, max(lens_q), max(lens_k)) if opts.get("dropout_p") else (0,))
    dout = randn(*out.shape, dtype=dtype, seed=7)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    # Each sequence against the dense references, as a batch of one.
    for b in range(4):
        sq, eq, sk, ek = cu_q[b].item(), cu_q[b + 1].item(), cu_k[b].item(), cu_k[b + 1].item()
        seq = dict(opts)
        if alibi == "bh":
            seq["alibi_slopes"] = opts["alibi_slopes"][b]
        keep = S[b:b + 1, :, :eq - sq, :ek - sk] if S.numel() else None
        qb, kb, vb = (t[s:e].detach()[None].requires_grad_()
                      for t, s, e in ((q, sq, eq), (k, sk, ek), (v, sk, ek)))
        ob, lb = out[sq:eq][None], lse[:, sq:eq][None]
        # Gradients of this sequence alone: the other sequences' rows of dout are zero.
        check_sequence(qb, kb, vb, ob, lb, keep, dout[sq:eq][None],
                       [g[s:e][None] for g, s, e in zip(grads, (sq, sk, sk), (eq, ek, ek))],
                       dtype, seq)


def check_sequence(q, k, v, out, lse, S, dout, grads, dtype, opts):
    kw = dict(scale=opts.get("softmax_scale"), causal=opts.get("causal", False),
              window=tuple(opts.get("window_size", (-1, -1))), softcap=opts.get("softcap", 0.0),
              dropout_p=opts.get("dropout_p", 0.0))
    keep = keep_from(S) if kw["dropout_p"] > 0 else None
    slopes = opts.get("alibi_slopes")
    r = ref(q, k, v, dout, keep, alibi_slopes=None if slopes is None else np64(slopes), **kw)
    lo, llse = torch_attn(q, k, v, alibi_slopes=slopes, keep=keep, **kw)
    lgrads = torch.autograd.grad(lo, (q, k, v), dout) if lo.numel() else (q, k, v)
    for name, got, r64, low in zip(("out", "lse", "dq", "dk", "dv"), [out, lse] + grads, r,
                                   (lo, llse) + tuple(lgrads)):
        if got.numel():
            assert_rule(name, got, r64, low)


def test_varlen_gradcheck_float64():
    q, k, v, cu_q, cu_k = varlen_inputs(torch.float64, [2, 4], [3, 5], d=4)
    slopes = torch.rand(2, 4)

    def f(q, k, v):
        torch.manual_seed(1)
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, 0.2, causal=True,
                                      window_size=(2, -1), alibi_slopes=slopes, softcap=2.0)

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("packing", ["qkv", "kv"])
def test_varlen_packed_equal_unpacked(packing):
    lens = [3, 5, 1]
    q, k, v, cu, _ = varlen_inputs(torch.float32, lens, lens, hk=4 if packing == "qkv" else 2)
    dout = randn(*q.shape, seed=5)
    want = flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    if packing == "qkv":
        qkv = torch.stack((q, k, v), 1).detach().requires_grad_()
        got = flash_attn_varlen_qkvpacked_func(qkv, cu, 5, causal=True)
        grads = torch.autograd.grad(got, qkv, dout)[0].unbind(1)
    else:
        q2 = q.detach().clone().requires_grad_()
        kv = torch.stack((k, v), 1).detach().requires_grad_()
        got = flash_attn_varlen_kvpacked_func(q2, kv, cu, cu, 5, 5, causal=True)
        dq, dkv = torch.autograd.grad(got, (q2, kv), dout)
        grads = (dq,) + dkv.unbind(1)
    assert torch.equal(got, want)
    for a, b in zip(grads, want_grads):
        assert torch.equal(a, b)


def paged(k, lens, page, seed=0):
    """k (total, Hkv, D) packed as pages (num_blocks, page, Hkv, D) in shuffled order, and the
    block_table of each sequence (unused table entries and pages hold garbage)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = max(-(-n // page) for n in lens)
    nblocks = per_seq * len(lens) + 2
    order = torch.randperm(nblocks, generator=g, dtype=torch.int32)
    table = order[:per_seq * len(lens)].reshape(len(lens), per_seq)
    pages = torch.randn(nblocks, page, *k.shape[1:], generator=g).to(k.dtype)
    start = 0
    for b, n in enumerate(lens):
        for i in range(n):
            pages[table[b, i // page], i % page] = k[start + i].detach()
        start += n
    return pages, table


def test_varlen_paged_kv_equals_packed_with_gradients():
    lens_q, lens_k = [2, 4, 3], [5, 8, 1]
    q, k, v, cu_q, cu_k = varlen_inputs(torch.float32, lens_q, lens_k)
    kp, table = paged(k, lens_k, page=3, seed=1)
    vp, table_v = paged(v, lens_k, page=3, seed=1)
    assert torch.equal(table, table_v)
    kp.requires_grad_(), vp.requires_grad_()
    slopes = torch.rand(4) * 0.3
    want = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 8, causal=True, alibi_slopes=slopes)
    got = flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 4, 8, causal=True, alibi_slopes=slopes,
                                 block_table=table)
    assert torch.equal(got, want)
    dout = randn(*q.shape, seed=3)
    dk, dv = torch.autograd.grad(want, (k, v), dout)
    dkp, dvp = torch.autograd.grad(got, (kp, vp), dout)
    dk_paged, _ = paged(dk, lens_k, page=3, seed=1)
    dv_paged, _ = paged(dv, lens_k, page=3, seed=1)
    used = torch.zeros(kp.shape[0], 3, dtype=torch.bool)
    for b, n in enumerate(lens_k):
        for i in range(n):
            used[table[b, i // 3], i % 3] = True
    torch.testing.assert_close(dkp[used], dk_paged[used], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(dvp[used], dv_paged[used], atol=1e-6, rtol=1e-6)
    assert not dkp[~used].any() and not dvp[~used].any()


# ----------------------------------------------------------------------------- KV cache


def rope_ref(x, cos, sin, pos, interleaved):
    """Rotary embedding as complex multiplication, in float64: x (N, H, D), pos (N,)."""
    rd = 2 * cos.shape[1]
    x = x.double()
    rot = x[..., :rd]
    pairs = (rot.unflatten(-1, (rd // 2, 2)) if interleaved
             else torch.stack(rot.chunk(2, -1), -1))
    z = torch.view_as_complex(pairs.contiguous())
    z = z * torch.polar(torch.ones(()).double(), torch.atan2(sin.double(), cos.double())[pos])[:, None]
    r = torch.view_as_real(z)
    r = r.flatten(-2) if interleaved else torch.cat(r.unbind(-1), -1)
    return torch.cat((r, x[..., rd:]), -1)


def kvcache_ref(dtype, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                causal=False, window_size=(-1, -1), alibi_slopes=None, softcap=0.0,
                rotary_interleaved=True):
    """Plain torch: the caches after the update, and out, lse computed in dtype."""
    kc, vc = k_cache.clone(), v_cache.clone()
    batch, nq = q.shape[:2]
    n = 0 if k is None else k.shape[1]
    page = kc.shape[1]

    def where(b, p):  # cache location of token p of sequence b
        if block_table is not None:
            return block_table[b, p // page].item(), p % page
        return (b if cache_batch_idx is None else cache_batch_idx[b].item()), p

    outs, lses = [], []
    for b in range(batch):
        s = kc.shape[1] if cache_seqlens is None else int(
            cache_seqlens if isinstance(cache_seqlens, int) else cache_seqlens[b])
        for t in range(n):
            kt = k[b, t]
            if rotary_cos is not None:
                kt = rope_ref(k[b, t:t + 1], rotary_cos, rotary_sin, torch.tensor([s + t]),
                              rotary_interleaved)[0]
            kc[where(b, s + t)] = kt.to(kc.dtype)
            vc[where(b, s + t)] = v[b, t]
        lp = 0 if cache_leftpad is None else cache_leftpad[b].item()
        keys = torch.stack([kc[where(b, p)] for p in range(lp, s + n)]) if s + n > lp else \
            kc.new_zeros(0, *kc.shape[2:])
        vals = torch.stack([vc[where(b, p)] for p in range(lp, s + n)]) if s + n > lp else \
            vc.new_zeros(0, *vc.shape[2:])
        qb = q[b]
        if rotary_cos is not None:
            local = causal or tuple(window_size) != (-1, -1)
            pos = torch.arange(s, s + nq) if local else torch.full((nq,), s)
            qb = rope_ref(qb, rotary_cos, rotary_sin, pos, rotary_interleaved).to(q.dtype)
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 \
            else alibi_slopes[b]
        o, lse = torch_attn(qb[None].to(dtype), keys[None].to(dtype), vals[None].to(dtype),
                            causal=causal, window=tuple(window_size), alibi_slopes=slopes,
                            softcap=softcap)
        outs.append(o[0])
        lses.append(lse[0])
    return kc, vc, torch.stack(outs), torch.stack(lses)


KV_CASES = {
    "decode one token GQA causal": dict(new=1, causal=True),
    "three tokens rotary interleaved": dict(new=3, nq=3, rotary=True, causal=True),
    "rotary not interleaved, not causal": dict(new=2, nq=2, rotary=True, interleaved=False),
    "rotary window, more queries than new tokens": dict(new=1, nq=3, rotary=True,
                                                        window_size=(3, 0)),
    "leftpad batch_idx alibi softcap": dict(new=2, nq=2, leftpad=True, batch_idx=True,
                                            alibi=True, softcap=2.0, causal=True),
    "paged rotary leftpad": dict(new=2, nq=2, paged=True, rotary=True, leftpad=True, causal=True),
    "paged no new keys": dict(new=0, nq=2, paged=True, causal=True, seqlens_int=True),
    "no new keys, whole cache": dict(new=0, nq=1, whole=True),
    "transposed cache leftpad rotary": dict(new=1, nq=1, leftpad=True, rotary=True,
                                            causal=True, transposed=True),
    "transposed cache batch_idx": dict(new=2, nq=2, batch_idx=True, transposed=True),
    # a sequence's left padding past its cached keys: a new key lies before it, unread
    "leftpad past the cached keys": dict(new=2, nq=2, leftpad="past", causal=True),
    "paged leftpad past the cached keys": dict(new=2, nq=2, leftpad="past", paged=True),
    # every sequence writes at one offset
    "one offset rotary": dict(new=2, nq=2, rotary=True, causal=True, seqlens_int=True),
    "one offset, batch_idx in order, transposed": dict(new=1, batch_idx="in order",
                                                       equal=True, transposed=True),
}


def make_kvcache(case, dtype):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)
    batch, h, hk, d, cap = 2, 4, 2, 16, 12
    nq, n = case.get("nq", 1), case["new"]
    q = r(batch, nq, h, d)
    kw = dict(causal=case.get("causal", False), window_size=case.get("window_size", (-1, -1)),
              softcap=case.get("softcap", 0.0))
    rows = batch * 2 if case.get("batch_idx") else batch
    if case.get("paged"):
        page = 4
        nblocks = 3 * batch + 1
        k_cache, v_cache = r(nblocks, page, hk, d), r(nblocks, page, hk, d)
        kw["block_table"] = torch.randperm(nblocks, generator=g, dtype=torch.int32)[
            :3 * batch].reshape(batch, 3)
    elif case.get("transposed"):    # transformers' (batch, nheads_k, seqlen, headdim) memory
        k_cache, v_cache = r(rows, hk, cap, d).transpose(1, 2), r(rows, hk, cap, d).transpose(1, 2)
    else:
        k_cache, v_cache = r(rows, cap, hk, d), r(rows, cap, hk, d)
    if n:
        kw["k"], kw["v"] = r(batch, n, hk, d), r(batch, n, hk, d)
    if not case.get("whole"):
        seqlens = torch.tensor([5, 5 if case.get("equal") else 9 - n], dtype=torch.int32)
        kw["cache_seqlens"] = 5 if case.get("seqlens_int") else seqlens
    if case.get("leftpad"):
        kw["cache_leftpad"] = torch.tensor([6 if case["leftpad"] == "past" else 2, 0],
                                           dtype=torch.int32)
    if case.get("batch_idx"):
        kw["cache_batch_idx"] = torch.tensor([0, 1] if case["batch_idx"] == "in order"
                                             else [3, 1], dtype=torch.int32)
    if case.get("alibi"):
        kw["alibi_slopes"] = torch.rand(batch, h, generator=g) * 0.5
    if case.get("rotary"):
        angle = torch.rand(cap, 6, generator=g) * 2 * math.pi  # rotary_dim 12 < headdim
        kw["rotary_cos"], kw["rotary_sin"] = angle.cos().to(dtype), angle.sin().to(dtype)
        kw["rotary_interleaved"] = case.get("interleaved", True)
    return q, k_cache, v_cache, kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(KV_CASES), ids=list(KV_CASES))
def test_kvcache_against_torch(case, dtype):
    if dtype == torch.bfloat16 and case not in ("three tokens rotary interleaved",
                                                "paged rotary leftpad"):
        pytest.skip("bfloat16 on two representative cases only (time)")
    q, k_cache, v_cache, kw = make_kvcache(KV_CASES[case], dtype)
    kc64, vc64, out64, lse64 = kvcache_ref(torch.float64, q, k_cache, v_cache, **kw)
    _, _, out_low, lse_low = kvcache_ref(dtype, q, k_cache, v_cache, **kw)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kw)
    # The caches were written in place, exactly where and as the reference writes.
    tol = dict(atol=0, rtol=0) if "rotary_cos" not in kw else {}
    torch.testing.assert_close(k_cache, kc64, **tol)
    assert torch.equal(v_cache, vc64)
    assert out.shape == q.shape and out.dtype == dtype and lse.dtype == torch.float32
    assert_rule("out", out, out64, out_low)
    assert_rule("lse", lse, lse64, lse_low)


def test_kvcache_rotary_table_ends_at_the_new_keys_where_no_mask_places_queries():
    """Neither causal nor windowed, every query is rotated at cache_seqlens (FlashAttention-2):
    a table to the last new key's position is enough, however many queries; with a mask the
    queries sit at the new tokens' positions and need the rows past it."""
    q, k_cache, v_cache, kw = make_kvcache(KV_CASES["rotary window, more queries than new "
                                                    "tokens"], torch.float32)
    kw.update(window_size=(-1, -1), cache_seqlens=torch.tensor([5, 8], dtype=torch.int32))
    short = dict(kw, rotary_cos=kw["rotary_cos"][:9], rotary_sin=kw["rotary_sin"][:9])
    want = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), **kw)
    assert torch.equal(flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), **short),
                       want)
    with pytest.raises(ValueError, match="'rotary_cos' has 9 positions; these tokens need 11"):
        flash_attn_with_kvcache(q, k_cache, v_cache, **dict(short, causal=True))
    # no new keys: the queries' row at cache_seqlens is still read (an IndexError, before)
    none = dict(kw, k=kw["k"][:, :0], v=kw["v"][:, :0], rotary_cos=kw["rotary_cos"][:8],
                rotary_sin=kw["rotary_sin"][:8])
    with pytest.raises(ValueError, match="'rotary_cos' has 8 positions; these tokens need 9"):
        flash_attn_with_kvcache(q, k_cache, v_cache, **none)


def test_kvcache_reads_the_cache_in_place():
    q, k_cache, v_cache, kw = make_kvcache(KV_CASES["decode one token GQA causal"],
                                           torch.float32)
    orchard_ops.reset_stats()
    flash_attn_with_kvcache(q, k_cache, v_cache, device="cpu", num_splits=4, **kw)
    assert orchard_ops.stats()["staged_buffers"] == 0


def test_kvcache_reads_a_transposed_cache_in_place():
    """A cache seen through a transpose, as transformers' are, left-padded: read where it
    lies (flattening it would copy the whole cache at every call), with the contiguous
    cache's result."""
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator().manual_seed(3)
    k_cache = torch.randn(3, 2, 4096, 16, generator=g).transpose(1, 2)
    v_cache = torch.randn(3, 2, 4096, 16, generator=g).transpose(1, 2)
    q = torch.randn(3, 1, 4, 16, generator=g)
    kw = dict(cache_seqlens=torch.tensor([4096, 100, 3000], dtype=torch.int32),
              cache_leftpad=torch.tensor([7, 0, 2999], dtype=torch.int32), causal=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    assert allocated < k_cache.numel() * 4 / 100, "torch allocated %d bytes" % allocated
    want = flash_attn_with_kvcache(q, k_cache.contiguous(), v_cache.contiguous(), **kw)
    assert torch.equal(out, want)


def test_kvcache_inputs_in_the_cache_are_read_before_the_write():
    """New keys and values that are views of the slots they are written to, and queries that
    are a view of written slots, give what copies of them give: read as they were before the
    call wrote the cache."""
    g = torch.Generator().manual_seed(4)
    k_cache, v_cache = (torch.randn(2, 16, 2, 8, generator=g) for _ in range(2))
    kw = dict(cache_seqlens=torch.tensor([4, 5], dtype=torch.int32), causal=True)
    before = k_cache.numpy().copy(), v_cache.clone()
    copies = k_cache.clone(), v_cache.clone()
    k, v = k_cache[:, 3:6], v_cache[:, 3:6]            # written to [4, 7) and [5, 8)
    q = k_cache[:, 5:8, :1].expand(2, 3, 4, 8)
    want = flash_attn_with_kvcache(q.clone(), *copies, k.clone(), v.clone(), **kw)
    got = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
    assert torch.equal(got, want)
    assert torch.equal(k_cache, copies[0]) and torch.equal(v_cache, copies[1])
    # a view made elsewhere, over the same memory with a storage of its own: its queries were
    # read after the write
    array, v_cache = before
    q = torch.from_numpy(array[:, 5:8, :1]).expand(2, 3, 4, 8)
    got = flash_attn_with_kvcache(q, torch.from_numpy(array), v_cache, torch.from_numpy(
        array[:, 3:6]), v_cache[:, 3:6], **kw)
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------- bad input


def dense_qkv(**shapes):
    s = dict(q=(1, 4, 2, 8), k=(1, 5, 2, 8), v=(1, 5, 2, 8))
    s.update(shapes)
    return [torch.randn(*s[n]) for n in ("q", "k", "v")]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_bad_dense_input_names_the_argument():
    q, k, v = dense_qkv()
    bad = [
        (TypeError, "'q'", lambda: flash_attn_func([1.0], k, v)),
        (TypeError, "'q'", lambda: flash_attn_func(q.int(), k, v)),
        (TypeError, "'k'", lambda: flash_attn_func(q, k.half(), v)),
        (ValueError, "'q'", lambda: flash_attn_func(q[0], k, v)),
        (ValueError, "'k' .*: dimension 3 is 4, the other arguments make it 8",
         lambda: flash_attn_func(*dense_qkv(k=(1, 5, 2, 4)))),
        (ValueError, "'k' .*: dimension 0 is 2, the other arguments make it 1",
         lambda: flash_attn_func(*dense_qkv(k=(2, 5, 2, 8), v=(2, 5, 2, 8)))),
        (ValueError, "'v'", lambda: flash_attn_func(*dense_qkv(v=(1, 6, 2, 8)))),
        (ValueError, "'k'", lambda: flash_attn_func(*dense_qkv(q=(1, 4, 3, 8)))),
        (ValueError, "'q' has 0 heads", lambda: flash_attn_func(*dense_qkv(
            q=(1, 4, 0, 8), k=(1, 5, 0, 8), v=(1, 5, 0, 8)))),
        # (k's heads divide 0: an empty result had passed the fast check)
        (ValueError, "'q' has 0 heads", lambda: flash_attn_func(*dense_qkv(q=(1, 4, 0, 8)))),
        (ValueError, "'q'", lambda: flash_attn_func(*dense_qkv(q=(1, 4, 2, 300),
                                                               k=(1, 5, 2, 300),
                                                               v=(1, 5, 2, 8)))),
        (ValueError, "'q'", lambda: flash_attn_func(q.to("meta"), k, v)),
        # past 2**32 - 1 rows (a stride-0 view costs one row): named as the caller's seqlen
        (ValueError, "'q' has seqlen 4294967296",
         lambda: flash_attn_func(q[:, :1].expand(1, 2**32, 2, 8), k, v)),
        (ValueError, "'k' has seqlen 4294967296", lambda: flash_attn_func(
            q, k[:, :1].expand(1, 2**32, 2, 8), v[:, :1].expand(1, 2**32, 2, 8))),
        (ValueError, "'v'", lambda: flash_attn_func(q, k, v.to_sparse())),
        # a nested tensor of the default layout is strided too, but has no sizes
        (ValueError, "'q' is a nested", lambda: flash_attn_func(
            torch.nested.nested_tensor([q[0], q[0, :3]]), k, v)),
        (TypeError, "'window_size'", lambda: flash_attn_func(q, k, v, window_size=(0.5, 0))),
        # a bool is no bound, as orchard_ops says (True had read as 1), checked once or cached
        *[(TypeError, "'window_size' must be a pair of ints, got \\(True, 1\\)",
           lambda: flash_attn_func(q, k, v, window_size=(True, 1))) for _ in range(2)],
        (TypeError, "'window_size'", lambda: flash_attn_func(q, k, v, window_size=3)),
        (ValueError, "'dropout_p'", lambda: flash_attn_func(q, k, v, dropout_p=1.0)),
        (ValueError, "'alibi_slopes'",
         lambda: flash_attn_func(q, k, v, alibi_slopes=torch.rand(3))),
        (TypeError, "'alibi_slopes'",
         lambda: flash_attn_func(q, k, v, alibi_slopes=torch.ones(2, dtype=torch.bool))),
        (TypeError, "'alibi_slopes'",
         lambda: flash_attn_func(q, k, v, alibi_slopes=torch.ones(2, dtype=torch.complex64))),
        (TypeError, "'softcap'", lambda: flash_attn_func(q, k, v, softcap="x")),
        (ValueError, "'softcap'", lambda: flash_attn_func(q, k, v, softcap=math.inf)),
        # finite in float64, not in float32 (the kernels' type here): named by the caller's
        # names, not orchard_ops' ('scale')
        (ValueError, "flash_attn_func: 'softcap' must be finite in float32",
         lambda: flash_attn_func(q, k, v, softcap=1e39)),
        (ValueError, "flash_attn_func: 'softmax_scale' must be finite in float32",
         lambda: flash_attn_func(q, k, v, softmax_scale=-1e39)),
        # 1 / softcap overflows the kernels' type (a score of 0 had become NaN)
        *[(ValueError, "flash_attn_func: 'softcap' is too small for float32.*2.94e-39",
           lambda cap=cap: flash_attn_func(q, k, v, softcap=cap))
          for cap in (2.9e-39, 2.9387361e-39)],    # (the second, once rounded to float32)
        (ValueError, "flash_attn_func: 'softcap' is too small for float64.*5.57e-309",
         lambda: flash_attn_func(q.double(), k.double(), v.double(), softcap=5e-309)),
        (ValueError, "flash_attn_func: 'alibi_slopes' must be finite in float32",
         lambda: flash_attn_func(q, k, v, alibi_slopes=torch.tensor([1e39, 1], dtype=float))),
        *[(ValueError, "flash_attn_func: 'alibi_slopes' must be finite", lambda dtype=dtype:
           flash_attn_func(q, k, v, alibi_slopes=torch.tensor([math.inf, 1], dtype=dtype)))
          for dtype in (torch.float16, torch.bfloat16, torch.float32)],
        (ValueError, "flash_attn_func: 'alibi_slopes' must be finite", lambda: flash_attn_func(
            q.double(), k.double(), v.double(), alibi_slopes=torch.tensor([math.inf, 1]))),
        (TypeError, "'dropout_p'", lambda: flash_attn_func(q, k, v, dropout_p="0.1")),
        (TypeError, "'window_size'", lambda: flash_attn_func(q, k, v, window_size="12")),
        (TypeError, "'window_size'", lambda: flash_attn_func(q, k, v, window_size=(1.7, 0))),
        (ValueError, "flash_attn_func: 'softmax_scale'",
         lambda: flash_attn_func(q, k, v, softmax_scale=float("nan"))),
        (ValueError, "flash_attn_func: 'device'", lambda: flash_attn_func(q, k, v, device="cuda")),
        (TypeError, "flash_attn_func: 'device'", lambda: flash_attn_func(q, k, v, device=0)),
        (ValueError, "'qkv'", lambda: flash_attn_qkvpacked_func(torch.randn(1, 4, 2, 2, 8))),
        (ValueError, "'kv'", lambda: flash_attn_kvpacked_func(q, torch.randn(1, 5, 3, 2, 8))),
        # a packed argument named as passed, with its own shape and layout
        (ValueError, r"'kv' must be \(batch_size, seqlen_k, 2, nheads_k, headdim\), got shape "
                     r"\(1, 5, 2, 2, 9\): dimension 4 is 9",
         lambda: flash_attn_kvpacked_func(q, torch.randn(1, 5, 2, 2, 9))),
        (ValueError, "'kv' has 3 heads, which must divide the 2 heads of q",
         lambda: flash_attn_kvpacked_func(q, torch.randn(1, 5, 2, 3, 8))),
        # k's heads are checked before v's shape follows them, as in FlashAttention-2: a k of 3
        # heads is named, not a v of q's 2
        (ValueError, "'k' has 3 heads, which must divide the 2 heads of q",
         lambda: flash_attn_func(q, torch.randn(1, 5, 3, 8), v)),
        (ValueError, "'k' has 3 heads, which must divide the 2 heads of q",
         lambda: flash_attn_varlen_func(q[0], torch.randn(5, 3, 8), v[0],
                                        *[torch.tensor([0, 4], dtype=torch.int32)] * 2, 4, 4)),
        (ValueError, "'k' has 3 heads, which must divide the 2 heads of q",
         lambda: flash_attn_varlen_func(q[0], torch.randn(2, 4, 3, 8), torch.randn(2, 4, 2, 8),
                                        *[torch.tensor([0, 4], dtype=torch.int32)] * 2, 4, 4,
                                        block_table=torch.tensor([[1]], dtype=torch.int32))),
        (ValueError, "'k_cache' has 3 heads, which must divide the 2 heads of q",
         lambda: flash_attn_with_kvcache(q, torch.randn(1, 8, 3, 8), torch.randn(1, 8, 2, 8))),
        (ValueError, "'qkv' has 0 heads", lambda: flash_attn_qkvpacked_func(
            torch.randn(1, 4, 3, 0, 8))),
        (ValueError, "'qkv' has headdim 300", lambda: flash_attn_varlen_qkvpacked_func(
            torch.randn(4, 3, 2, 300), torch.tensor([0, 4], dtype=torch.int32), 4)),
        (ValueError, "'kv' has 3 heads", lambda: flash_attn_varlen_kvpacked_func(
            q[0], torch.randn(4, 2, 3, 8), *[torch.tensor([0, 4], dtype=torch.int32)] * 2, 4, 4)),
        # (read by truthiness: a tensor's was torch's "ambiguous" error, a string true)
        (TypeError, "flash_attn_func: 'return_attn_probs' must be a bool, got tensor",
         lambda: flash_attn_func(q, k, v, return_attn_probs=torch.tensor([1, 2]))),
        (TypeError, "flash_attn_varlen_qkvpacked_func: 'return_attn_probs' must be a bool, "
                    "got 'no'", lambda: flash_attn_varlen_qkvpacked_func(
            torch.randn(4, 3, 2, 8), torch.tensor([0, 4], dtype=torch.int32), 4,
            return_attn_probs="no")),
    ]
    for error, name, call in bad:
        with pytest.raises(error, match=name):
            call()
    # the options a model repeats are checked once and kept: a value equal to a kept one, of a
    # type orchard refuses, is still refused
    flash_attn_func(q, k, v, causal=True, window_size=(2, 2))
    for error, name, call in [
            (TypeError, "'causal' must be a bool, got 1.0",
             lambda: flash_attn_func(q, k, v, causal=1.0, window_size=(2, 2))),
            (TypeError, "'window_size' must be a pair of ints",
             lambda: flash_attn_func(q, k, v, causal=True, window_size=(2.0, 2.0))),
            (TypeError, "'dropout_p' must be a number, got None",
             lambda: flash_attn_func(q, k, v, causal=True, window_size=(2, 2), dropout_p=None))]:
        with pytest.raises(error, match=name):
            call()


def test_bad_varlen_input_names_the_argument():
    q, k, v, cu_q, cu_k = varlen_inputs(torch.float32, [2, 3], [3, 4])
    q, k, v = q.detach(), k.detach(), v.detach()
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)
    kp, table = paged(k, [3, 4], page=2)
    vp, _ = paged(v, [3, 4], page=2)
    bad = [
        (TypeError, "'cu_seqlens_q'", lambda: flash_attn_varlen_func(
            q, k, v, cu_q.long(), cu_k, 3, 4)),
        (ValueError, "'cu_seqlens_q'", lambda: flash_attn_varlen_func(
            q, k, v, i32(0, 3, 2, 5), i32(0, 3, 3, 7), 3, 4)),
        (ValueError, "'cu_seqlens_k'", lambda: flash_attn_varlen_func(
            q, k, v, cu_q, i32(0, 3, 8), 3, 5)),      # past the 7 keys
        (ValueError, "'cu_seqlens_k'", lambda: flash_attn_varlen_func(
            q, k, v, cu_q, i32(0, 7), 3, 7)),
        (ValueError, "'q'", lambda: flash_attn_varlen_func(q[None], k, v, cu_q, cu_k, 3, 4)),
        (ValueError, "'k'", lambda: flash_attn_varlen_func(q, k[:, :1].expand(7, 3, 16),
                                                           v[:, :1].expand(7, 3, 16),
                                                           cu_q, cu_k, 3, 4)),
        (ValueError, "flash_attn_varlen_func: 'max_seqlen_q' must be at least 3",
         lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 4)),
        (TypeError, "flash_attn_varlen_func: 'max_seqlen_k' must be an int",
         lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4.0)),
        (TypeError, "'max_seqlen_k'", lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, True)),
        (TypeError, "'max_seqlen_k' must be an int, got tensor\\(4\\.\\)",
         lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, torch.tensor(4.0))),
        (TypeError, "'max_seqlen_q'", lambda: flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, torch.tensor([3, 3]), 4)),
        (ValueError, "flash_attn_varlen_qkvpacked_func: 'max_seqlen' must be at least 3",
         lambda: flash_attn_varlen_qkvpacked_func(torch.stack((q, q, q), 1), cu_q, 2)),
        (TypeError, "'block_table'", lambda: flash_attn_varlen_func(
            q, kp, vp, cu_q, cu_k, 3, 4, block_table=table.long())),
        (ValueError, "'block_table'", lambda: flash_attn_varlen_func(
            q, kp, vp, cu_q, cu_k, 3, 4, block_table=table + 100)),
        (ValueError, "'cu_seqlens_k'", lambda: flash_attn_varlen_func(
            q, kp, vp, cu_q, i32(0, 3, 9), 3, 6, block_table=table)),
        (ValueError, "'cu_seqlens'", lambda: flash_attn_varlen_qkvpacked_func(
            torch.stack((q, q, q), 1), i32(0, 2, 6), 3)),
        (ValueError, "'cu_seqlens_q' must have batch_size \\+ 1 entries, got none",
         lambda: flash_attn_varlen_func(q[:0], k[:0], v[:0], i32(), i32(), 0, 0)),
        (ValueError, "flash_attn_varlen_func: 'k' must be .* num_blocks and page_block_size >= 1",
         lambda: flash_attn_varlen_func(q, kp[:0], vp[:0], cu_q, cu_k, 3, 4, block_table=table)),
    ]
    for error, name, call in bad:
        with pytest.raises(error, match=name):
            call()


def test_varlen_max_seqlen_of_one_integer_element_as_fa2():
    """FlashAttention-2's int parameters take anything with __index__: transformers 4.44-4.47
    passed max_seqlen as a 0-d tensor (position_ids.max() + 1)."""
    q, k, v, cu_q, cu_k = varlen_inputs(torch.float32, [2, 3], [3, 4])
    want = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4)
    got = flash_attn_varlen_func(q, k, v, cu_q, cu_k, torch.tensor(3), torch.tensor([4]))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="'max_seqlen_k' must be at least 4"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, torch.tensor(3, dtype=torch.int32))


def test_bad_kvcache_input_names_the_argument_and_writes_nothing():
    q, k_cache, v_cache, kw = make_kvcache(KV_CASES["three tokens rotary interleaved"],
                                           torch.float32)
    pq, pk_cache, pv_cache, pkw = make_kvcache(KV_CASES["paged rotary leftpad"], torch.float32)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)
    drop = lambda d, *names: {n: a for n, a in d.items() if n not in names}
    bad = [
        (ValueError, "'cache_seqlens'", dict(kw, cache_seqlens=i32(5, 10))),
        (ValueError, "'cache_seqlens'", dict(kw, cache_seqlens=i32(-1, 2))),
        (TypeError, "'cache_seqlens'", dict(kw, cache_seqlens=kw["cache_seqlens"].long())),
        (TypeError, "'cache_seqlens'", dict(kw, cache_seqlens=True)),    # not the int 1
        # ints past any tensor's (an OverflowError from torch.full, naming nothing, before)
        (ValueError, "'cache_seqlens' 1180591620717411303424", dict(kw, cache_seqlens=2**70)),
        (ValueError, "'cache_seqlens' -1180591620717411303424", dict(kw, cache_seqlens=-2**70)),
        (TypeError, "'rotary_interleaved' must be a bool", dict(kw, rotary_interleaved="no")),
        (TypeError, "'return_softmax_lse' must be a bool", dict(kw, return_softmax_lse="no")),
        (ValueError, "'cache_seqlens'", drop(kw, "cache_seqlens")),
        (ValueError, "'v'", drop(kw, "v")),
        (ValueError, "'k'", dict(kw, k=kw["k"][:, :, :1])),
        (TypeError, "'k'", dict(kw, k=kw["k"].double())),
        (ValueError, "'rotary_cos'", dict(kw, rotary_cos=kw["rotary_cos"][:6],
                                          rotary_sin=kw["rotary_sin"][:6])),
        (ValueError, "'rotary_sin'", drop(kw, "rotary_sin")),
        (ValueError, "'cache_batch_idx'", dict(kw, cache_batch_idx=i32(0, 2))),
        (ValueError, "'cache_leftpad'", dict(kw, cache_leftpad=i32(0, 11))),
        (TypeError, "'window_size'", dict(kw, window_size=(0, 1.5))),
        (ValueError, "'alibi_slopes'", dict(kw, alibi_slopes=torch.rand(3, 4))),
        (ValueError, "with_kvcache: 'alibi_slopes' must be finite",
         dict(kw, alibi_slopes=torch.tensor([0.5, math.nan, 1, 1]))),
        # the options orchard_ops checks too: checked before the cache is written
        (ValueError, "'softmax_scale'", dict(kw, softmax_scale=float("nan"))),
        (ValueError, "'softcap'", dict(kw, softcap=float("nan"))),
        (ValueError, "'softmax_scale' must be finite in float32", dict(kw, softmax_scale=1e39)),
        (ValueError, "'softcap' must be finite in float32", dict(kw, softcap=1e39)),
        (ValueError, "'softcap' is too small for float32", dict(kw, softcap=1e-300)),
        (ValueError, "'alibi_slopes' must be finite in float32",
         dict(kw, alibi_slopes=torch.tensor([0.5, 1e39, 1, 1], dtype=float))),
        *[(ValueError, "with_kvcache: 'alibi_slopes' must be finite",
           dict(kw, alibi_slopes=torch.tensor([0.5, math.inf, 1, 1], dtype=dtype)))
          for dtype in (torch.float16, torch.bfloat16)],
        (ValueError, "'device'", dict(kw, device="cuda")),
        (TypeError, "'device'", dict(kw, device=0)),
        (TypeError, "'num_splits'", dict(kw, num_splits="x")),
    ]
    huge = lambda t: t[:1, :1].expand(t.shape[0], 2**32, *t.shape[2:])
    for error, name, call in [
            (ValueError, "'k_cache' has seqlen_cache 4294967296", lambda: flash_attn_with_kvcache(
                q, huge(k_cache), huge(v_cache), cache_seqlens=1)),
            (ValueError, r"'block_table' gives a sequence room for \d+ keys",    # pages of 2**31
             lambda: flash_attn_with_kvcache(
                 pq, huge(pk_cache)[:, :2**31], huge(pv_cache)[:, :2**31],
                 **drop(pkw, "k", "v", "rotary_cos", "rotary_sin"))),
            (ValueError, "'q' has seqlen 4294967296", lambda: flash_attn_with_kvcache(
                huge(q), k_cache, v_cache, cache_seqlens=1)),
            (ValueError, "'k_cache' has 3 heads, which must divide the 4 heads of q",
             lambda: flash_attn_with_kvcache(torch.randn(2, 1, 4, 16), torch.randn(2, 8, 3, 16),
                                             torch.randn(2, 8, 3, 16))),
            (ValueError, "'v_cache' has headdim 300", lambda: flash_attn_with_kvcache(
                torch.randn(2, 1, 4, 16), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 300)))]:
        with pytest.raises(error, match=name):
            call()
    for error, name, args in bad:
        before = k_cache.clone(), v_cache.clone()
        with pytest.raises(error, match=name):
            flash_attn_with_kvcache(q, k_cache, v_cache, **args)
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), name
    # caches that cannot be written: refused before the other is written
    with torch.inference_mode():
        frozen = v_cache.clone()
    for name, k_arg, v_arg in (("'v_cache' is an inference tensor", k_cache, frozen),
                               ("'k_cache' is an expanded view", k_cache[:1].expand_as(k_cache),
                                v_cache)):
        before = k_cache.clone(), v_cache.clone()
        with pytest.raises(ValueError, match=name):
            flash_attn_with_kvcache(q, k_arg, v_arg, **kw)
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), name
    # an empty batch's cache has no rows to share, whatever its strides (NumPy's are 0)
    empty = torch.from_numpy(np.zeros((0,) + tuple(k_cache.shape[1:]), np.float32))
    assert flash_attn_with_kvcache(q[:0], empty, empty.clone(), kw["k"][:0], kw["v"][:0],
                                   cache_seqlens=i32()).shape == (0,) + tuple(q.shape[1:])
    with pytest.raises(ValueError, match="'k_cache'"):
        flash_attn_with_kvcache(q, k_cache.to("meta"), v_cache, **drop(kw, "k", "v", "rotary_cos",
                                                                     "rotary_sin"))
    with pytest.raises(ValueError, match="'rotary_cos'"):
        flash_attn_with_kvcache(q, k_cache, v_cache, **drop(kw, "k", "v"))
    with pytest.raises(ValueError, match="'k_cache' must be .* page_block_size >= 1, got \\(0,"):
        flash_attn_with_kvcache(pq, pk_cache[:0], pv_cache[:0], **pkw)
    with pytest.raises(ValueError, match="'k_cache' has batch_size_cache 1"):
        flash_attn_with_kvcache(q, k_cache[:1], v_cache[:1], **drop(kw, "k", "v", "rotary_cos",
                                                                      "rotary_sin"))
    paged_bad = [
        (ValueError, "'block_table'", dict(pkw, block_table=pkw["block_table"] + 100)),
        # sequence 1's 7 + 2 keys fill its three pages of 4: a third that is no page is refused
        # (by orchard_ops, which then writes the new keys; the message is this function's)
        (ValueError, r"flash_attn_with_kvcache: 'block_table' row 1 lists pages \[\d+, \d+, -1\]"
                     r", outside \[0, 7\)",
         dict(pkw, block_table=torch.cat([pkw["block_table"][:, :2], i32(0, -1)[:, None]], 1))),
        (TypeError, "'block_table'", dict(pkw, block_table=pkw["block_table"].long())),
        (ValueError, "'cache_seqlens'", dict(pkw, cache_seqlens=i32(5, 11))),
        (ValueError, "'cache_batch_idx'", dict(pkw, cache_batch_idx=i32(0, 1))),
        (ValueError, "'v_cache'", dict(pkw, v_cache=pv_cache[:, :2])),
        (ValueError, "'k_cache'", dict(pkw, k_cache=pk_cache[:, :0], v_cache=pv_cache[:, :0])),
    ]
    for error, name, args in paged_bad:
        before = pk_cache.clone(), pv_cache.clone()
        args.setdefault("v_cache", pv_cache)
        args.setdefault("k_cache", pk_cache)
        with pytest.raises(error, match=name):
            flash_attn_with_kvcache(pq, **args)
        assert torch.equal(pk_cache, before[0]) and torch.equal(pv_cache, before[1]), name


def widened(table, width):
    """table with garbage columns up to `width` entries a row (no sequence reads them)."""
    return torch.cat([table, torch.full((table.shape[0], width - table.shape[1]), -7,
                                        dtype=table.dtype)], 1)


@pytest.mark.parametrize("width", [3, 600], ids=["narrow", "wide"])   # <= 1024 entries, more
def test_unused_block_table_entries_may_hold_anything(width):
    """As in FlashAttention-2, only the entries of block_table that hold a sequence's keys
    are read: the others may name no page, in flash_attn_with_kvcache and in
    flash_attn_varlen_func read in place or gathered (with gradients); a used entry that
    names no page is refused, naming its row, in a small table and in a large one."""
    q, k_cache, v_cache, kw = make_kvcache(KV_CASES["paged rotary leftpad"], torch.float32)
    want = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), **kw)
    table = widened(kw["block_table"], width)
    table[0, 2] = -5        # sequence 0's 5 + 2 keys fill two pages of 4
    bad = widened(kw["block_table"], width)
    bad[1, 2] = 7           # sequence 1's 7 + 2 keys fill three; there are 7 pages
    before = k_cache.clone()
    # new keys written in the call, or none (the same keys read)
    read_only = {n: a for n, a in kw.items() if n not in ("k", "v", "rotary_cos", "rotary_sin")}
    read_only["cache_seqlens"] = kw["cache_seqlens"] + 2
    for args in (kw, read_only):
        with pytest.raises(ValueError, match=r"flash_attn_with_kvcache: 'block_table' row 1 "
                                             r"lists pages \[\d+, \d+, 7\], outside \[0, 7\)"):
            flash_attn_with_kvcache(q, k_cache, v_cache, **dict(args, block_table=bad))
        assert torch.equal(k_cache, before)
    assert torch.equal(flash_attn_with_kvcache(q, k_cache, v_cache, **dict(kw, block_table=table)),
                       want)
    kp, vp = k_cache.requires_grad_(), v_cache.clone().requires_grad_()
    cu_q, cu_k = (torch.tensor(x, dtype=torch.int32) for x in ([0, 2, 4], [0, 7, 16]))
    outs = []
    for past in (None, 10**6, -1):
        table = widened(kw["block_table"], width)
        if past is not None:
            table[0, 2] = past
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                outs.append(flash_attn_varlen_func(q.flatten(0, 1), kp, vp, cu_q, cu_k, 2, 9,
                                                   causal=True, block_table=table))
            with pytest.raises(ValueError, match="'block_table' row 1 lists pages"):
                flash_attn_varlen_func(q.flatten(0, 1), kp, vp, cu_q, cu_k, 2, 9, causal=True,
                                       block_table=bad)
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), "entries past the keys were read"
    assert [o.requires_grad for o in outs] == [False, True] * 3


@pytest.mark.parametrize("case", ["three tokens rotary interleaved", "paged rotary leftpad",
                                  "transposed cache batch_idx"])
def test_kvcache_resolves_negated_reads_and_refuses_a_negated_cache(case):
    """q and the new keys and values as lazily negated views (x.conj().imag; DLPack drops the
    bit) are resolved, as torch's kernels resolve them (orchard_ops' refusal had come through,
    naming flash_attn_varlen_fwd()); a cache so viewed, which the call writes, is refused
    naming it, before anything is written."""
    q, k_cache, v_cache, kw = make_kvcache(KV_CASES[case], torch.float32)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = flash_attn_with_kvcache(q, want_k, want_v, **kw)
    negated = lambda t: t.neg()._neg_view()     # t's values, negative bit set
    got_k, got_v = k_cache.clone(), v_cache.clone()
    got = flash_attn_with_kvcache(negated(q), got_k, got_v,
                                  **dict(kw, k=negated(kw["k"]), v=negated(kw["v"])))
    assert torch.equal(got, want) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    for name in ("k_cache", "v_cache"):
        caches = dict(k_cache=k_cache.clone(), v_cache=v_cache.clone())
        caches[name] = negated(caches[name])
        with pytest.raises(ValueError, match="flash_attn_with_kvcache: '%s' is a lazily negated "
                                             "view" % name):
            flash_attn_with_kvcache(q, **caches, **kw)
        assert torch.equal(caches["k_cache"], k_cache) and torch.equal(caches["v_cache"], v_cache)


def test_paged_varlen_resolves_negated_views():
    """flash_attn_varlen_func over pages (read in place, not through autograd) resolves
    negated views as the other paths do (orchard_ops' refusal had come through there)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 16, generator=g)
    pages = torch.randn(6, 4, 2, 16, generator=g), torch.randn(6, 4, 2, 16, generator=g)
    table = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
    cu_q, cu_k = (torch.tensor(x, dtype=torch.int32) for x in ([0, 2, 5], [0, 7, 15]))
    want = flash_attn_varlen_func(q, *pages, cu_q, cu_k, 3, 8, causal=True, block_table=table)
    negated = lambda t: t.neg()._neg_view()     # t's values, negative bit set
    got = flash_attn_varlen_func(negated(q), *map(negated, pages), cu_q, cu_k, 3, 8,
                                 causal=True, block_table=table)
    assert torch.equal(got, want)


def test_block_table_entries_before_the_left_padding_may_hold_anything():
    """Pages wholly before a sequence's left padding hold none of the keys read or written:
    their entries may name no page (as orchard_ops reads them), whether the call writes the
    new keys, this function writes them (a cache strided in its last dimension) or none come;
    a refusal of something else keeps its own message."""
    q, k_cache, v_cache, kw = make_kvcache(KV_CASES["paged rotary leftpad"], torch.float32)
    kw = dict(kw, cache_leftpad=torch.tensor([5, 0], dtype=torch.int32))  # row 0: keys 5 to 7
    want = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), **kw)
    table = kw["block_table"].clone()
    table[0, 0] = -3        # keys 0 to 3 of sequence 0
    strided = lambda t: torch.stack([t, t], -1)[..., 0]
    for cache in (torch.clone, strided):
        got = flash_attn_with_kvcache(q, cache(k_cache), cache(v_cache),
                                      **dict(kw, block_table=table))
        assert torch.equal(got, want)
    plain = {n: a for n, a in kw.items() if n not in ("k", "v", "rotary_cos", "rotary_sin")}
    flash_attn_with_kvcache(q, k_cache, v_cache, **dict(plain, block_table=table))
    with pytest.raises(ValueError, match="'alibi_slopes' must be \\(nheads,\\)"):
        flash_attn_with_kvcache(q, k_cache, v_cache, alibi_slopes=torch.ones(3),
                                **dict(plain, block_table=table))


def test_alibi_slopes_of_any_real_dtype_with_or_without_grad():
    """SPEC: alibi_slopes of any real dtype; a slopes Parameter (requires_grad) is read as
    values, as FlashAttention-2 does (no gradient reaches them)."""
    q, k, v = dense_qkv()
    slopes = torch.tensor([0.5, 0.25])
    ref = flash_attn_func(q, k, v, alibi_slopes=slopes)
    for other in (slopes.bfloat16(), slopes.double(), slopes.half(),
                  torch.nn.Parameter(slopes.clone())):
        torch.testing.assert_close(flash_attn_func(q, k, v, alibi_slopes=other), ref)
    ints = torch.tensor([1, 2], dtype=torch.int32)
    torch.testing.assert_close(flash_attn_func(q, k, v, alibi_slopes=ints),
                               flash_attn_func(q, k, v, alibi_slopes=ints.float()))


def test_sequences_without_keys_return_probs():
    """A sequence with no keys: out 0, lse -inf, and an S_dmask with no columns for it."""
    q = torch.randn(1, 3, 2, 8)
    out, lse, probs = flash_attn_func(q, torch.randn(1, 0, 2, 8), torch.randn(1, 0, 2, 8),
                                      dropout_p=0.1, return_attn_probs=True)
    assert probs.shape == (1, 2, 3, 0) and not out.any() and (lse == -math.inf).all()
    cq, ck = (torch.tensor(c, dtype=torch.int32) for c in ([0, 2, 4], [0, 3, 3]))
    out, lse, probs = flash_attn_varlen_func(torch.randn(4, 2, 8), torch.randn(3, 2, 8),
                                             torch.randn(3, 2, 8), cq, ck, 2, 3,
                                             dropout_p=0.1, return_attn_probs=True)
    assert probs.shape == (2, 2, 2, 3) and not probs[1].any() and not out[2:].any()
    assert (lse[:, 2:] == -math.inf).all() and torch.isfinite(lse[:, :2]).all()
    # max_seqlen_q/k left to orchard (None): the probabilities are as wide as the longest
    for given in ((None, None), (2, None), (None, 3)):
        _, _, taken = flash_attn_varlen_func(torch.randn(4, 2, 8), torch.randn(3, 2, 8),
                                             torch.randn(3, 2, 8), cq, ck, *given,
                                             dropout_p=0.1, return_attn_probs=True)
        assert taken.shape == (2, 2, 2, 3), given


def test_attn_probs_without_dropout_are_empty_as_fa2():
    """FlashAttention-2 returns S_dmask only with dropout (an empty tensor without), so
    return_attn_probs=True is a free way to softmax_lse; orchard builds no N x N array then."""
    q, k, v, _ = make_dense(dict(causal=True), torch.bfloat16)
    out, lse, S = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert S.shape == (0,) and S.dtype == torch.bfloat16 and not S.requires_grad
    assert torch.equal(out, flash_attn_func(q, k, v, causal=True))
    lens = [3, 5]
    q, k, v, cu_q, cu_k = varlen_inputs(torch.float32, lens, lens)
    out, lse, S = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, return_attn_probs=True)
    assert S.shape == (0,) and lse.shape == (4, 8)


def test_varlen_tokens_past_the_last_sequence_are_padding(device):
    """As FlashAttention-2, cu_seqlens may end before the last token (static-shape buffers):
    those rows take no part; their out is 0 (FlashAttention-2 leaves it unwritten), lse -inf
    and gradient 0, and the rest is the call without them."""
    q, k, v, cu_q, cu_k = varlen_inputs(torch.float32, [5, 3, 4], [4, 5, 3])
    cu_q, cu_k = cu_q[:3], cu_k[:3]      # sequences 0 and 1; the last 4 and 3 rows are padding
    torch.manual_seed(5)
    out, lse, S = flash_attn_varlen_func(q, k, v, cu_q, cu_k, None, None, causal=True,
                                         dropout_p=0.2, return_attn_probs=True, device=device)
    assert S.shape == (2, 4, 5, 5)
    torch.manual_seed(5)
    want, want_lse, want_S = flash_attn_varlen_func(q[:8], k[:9], v[:9], cu_q, cu_k, None, None,
                                                    causal=True, dropout_p=0.2,
                                                    return_attn_probs=True, device=device)
    assert torch.equal(out[:8], want) and torch.equal(lse[:, :8], want_lse)
    assert torch.equal(S, want_S)
    assert not out[8:].any() and (lse[:, 8:] == -math.inf).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert not dq[8:].any() and not dk[9:].any() and not dv[9:].any() and dq[:8].any()
    qkv = torch.stack((q, q, q), 1).detach()
    packed = flash_attn_varlen_qkvpacked_func(qkv, cu_q, None, device=device)
    assert packed.shape == (12, 4, 16) and not packed[8:].any()


def test_a_negative_window_bound_is_unbounded():
    """As FlashAttention-2, any negative bound is none (-1 is the convention): (-5, 0) is
    causal, (0, -2) sees every later key."""
    q, k, v = (randn(1, 6, 2, 8, seed=s) for s in range(3))
    for given, same in (((-5, 0), (-1, 0)), ((0, -2), (0, -1)), ((-3, -7), (-1, -1))):
        assert torch.equal(flash_attn_func(q, k, v, window_size=given),
                           flash_attn_func(q, k, v, window_size=same))


def test_varlen_tokens_before_the_first_sequence_are_padding(device):
    """cu_seqlens may start after the first token too (FlashAttention-2 reads sequence b from
    row cu_seqlens[b]: a window of a larger packed buffer): the rows before it are padding as
    those past the end are; with pages only cu_seqlens_k's differences count."""
    q, k, v, _, _ = varlen_inputs(torch.float32, [2, 5, 3], [3, 4, 5])
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)
    cu_q, cu_k = i32(2, 7, 10), i32(3, 7, 10)      # key rows 0-2 and 10-11 are padding
    torch.manual_seed(7)
    out, lse, S = flash_attn_varlen_func(q, k, v, cu_q, cu_k, None, None, causal=True,
                                         dropout_p=0.2, return_attn_probs=True, device=device)
    torch.manual_seed(7)
    want, want_lse, want_S = flash_attn_varlen_func(q[2:], k[3:10], v[3:10], cu_q - 2, cu_k - 3,
                                                    None, None, causal=True, dropout_p=0.2,
                                                    return_attn_probs=True, device=device)
    assert torch.equal(out[2:], want) and torch.equal(lse[:, 2:], want_lse)
    assert torch.equal(S, want_S)
    assert not out[:2].any() and (lse[:, :2] == -math.inf).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert not dq[:2].any() and not dk[:3].any() and not dk[10:].any() and not dv[:3].any()
    assert dq[2:].any() and dk[3:10].any()
    # pages: sequence 1's keys in page 0, sequence 2's in page 1
    pages = torch.stack([x.detach()[a:a + 4] for x in (k, v) for a in (3, 7)]).unflatten(0, (2, 2))
    plain = flash_attn_varlen_func(q.detach(), k.detach(), v.detach(), cu_q, cu_k, None, None,
                                   causal=True, device=device)
    paged = flash_attn_varlen_func(q.detach(), pages[0], pages[1], cu_q, cu_k, None, None,
                                   causal=True, block_table=i32(0, 1)[:, None], device=device)
    torch.testing.assert_close(paged, plain)
    with pytest.raises(ValueError, match="'cu_seqlens_q' must start at 0 or after"):
        flash_attn_varlen_func(q, k, v, i32(-1, 3), cu_k[:2], None, None)


def test_kvcache_empty_batch_and_no_queries():
    """batch 0 and seqlen_q 0 return empty results (as flash_attn_func does); with no queries
    the new keys are still written."""
    out, lse = flash_attn_with_kvcache(torch.randn(0, 1, 2, 8), torch.randn(0, 5, 2, 8),
                                       torch.randn(0, 5, 2, 8), return_softmax_lse=True)
    assert out.shape == (0, 1, 2, 8) and lse.shape == (0, 2, 1)
    k_cache, v_cache = torch.zeros(1, 5, 2, 8), torch.zeros(1, 5, 2, 8)
    out = flash_attn_with_kvcache(torch.randn(1, 0, 2, 8), k_cache, v_cache,
                                  torch.ones(1, 1, 2, 8), torch.ones(1, 1, 2, 8), cache_seqlens=3)
    assert out.shape == (1, 0, 2, 8) and k_cache[0, 3].eq(1).all() and v_cache[0, 3].eq(1).all()
    # the same in pages (a call over no queries once failed there, after the write)
    pages, table = torch.zeros(4, 2, 2, 8), torch.tensor([[2, 0, 3]], dtype=torch.int32)
    out = flash_attn_with_kvcache(torch.randn(1, 0, 2, 8), pages, pages.clone(),
                                  torch.ones(1, 1, 2, 8), torch.ones(1, 1, 2, 8), cache_seqlens=3,
                                  block_table=table)
    assert out.shape == (1, 0, 2, 8) and pages[0, 1].eq(1).all() and pages.sum() == 16
    # a cache of no rows, contiguous or seen through a transpose: no keys, zeros
    for empty in (torch.randn(3, 0, 2, 8), torch.randn(3, 2, 0, 8).transpose(1, 2)):
        out = flash_attn_with_kvcache(torch.randn(3, 1, 2, 8), empty, empty, cache_seqlens=0)
        assert out.shape == (3, 1, 2, 8) and not out.any()


def test_varlen_empty_batch(device):
    """cu_seqlens [0] (no sequences) gives empty results, gradients included, as the dense
    functions do with batch 0."""
    none = torch.zeros(1, dtype=torch.int32)
    q = torch.randn(0, 2, 8, requires_grad=True)
    out, lse, probs = flash_attn_varlen_func(q, q, q, none, none, None, None, causal=True,
                                             dropout_p=0.1, return_attn_probs=True,
                                             device=device)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0) and probs.shape == (0, 2, 0, 0)
    out.sum().backward()
    assert q.grad.shape == (0, 2, 8)


def test_outputs_are_contiguous():
    """README: outputs are contiguous, whatever the inputs' layout."""
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    qt = torch.randn(4, 10, 16).transpose(0, 1)
    assert flash_attn_varlen_func(qt, qt, qt, cu, cu, 6, 6).is_contiguous()
    q, k, v = (torch.randn(2, 6, 4, 16).transpose(1, 2).transpose(1, 2) for _ in range(3))
    out, lse, _ = flash_attn_func(q[:, ::2], k, v, return_attn_probs=True)
    assert out.is_contiguous() and lse.is_contiguous()
    out, lse = flash_attn_with_kvcache(torch.randn(2, 3, 4, 16), torch.randn(2, 20, 2, 16),
                                       torch.randn(2, 20, 2, 16), cache_seqlens=5,
                                       return_softmax_lse=True)
    assert out.is_contiguous() and lse.is_contiguous()


# ----------------------------------------------------------------------------- bert_padding


def test_bert_padding_round_trip_and_varlen_as_fa2_users_call_it():
    """unpad_input / pad_input as FlashAttention-2's bert_padding: batch-major token order,
    int32 cu_seqlens, the longest sequence, the used counts; padding then unpadding a varlen
    call equals each sequence run alone, and gradients reach only the real tokens."""
    from orchard.bert_padding import index_first_axis, pad_input, unpad_input

    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 1, 0, 0]], dtype=torch.int64)
    unused = torch.tensor([[0, 0, 0, 1, 0], [0] * 5, [0] * 5])
    x = randn(3, 2, 5, 8).transpose(1, 2).requires_grad_()     # a strided (B, N, H, D) view
    tokens, idx, cu, longest, used = unpad_input(x, mask)
    assert idx.tolist() == [0, 1, 2, 6, 7, 8, 9, 10, 12] and cu.dtype == torch.int32
    assert cu.tolist() == [0, 3, 7, 9] and longest == 4 and used.tolist() == [3, 4, 2]
    assert torch.equal(tokens, index_first_axis(x.reshape(15, 2, 8), idx))
    _, idx_u, cu_u, longest_u, used_u = unpad_input(x, mask, unused)
    assert cu_u.tolist() == [0, 4, 8, 10] and longest_u == 4 and used_u.tolist() == [3, 4, 2]
    assert 3 in idx_u.tolist()
    back = pad_input(tokens, idx, 3, 5)
    assert torch.equal(back, x * mask[..., None, None])
    q, k, v = (randn(3, 5, 2, 8, seed=s).requires_grad_() for s in (1, 2, 3))
    (qu, iq, cq, mq, _), (ku, _, ck, mk, _) = unpad_input(q, mask), unpad_input(k, mask)
    out = pad_input(flash_attn_varlen_func(qu, ku, unpad_input(v, mask)[0], cq, ck, mq, mk,
                                           causal=True), iq, 3, 5)
    for b in range(3):
        keep = mask[b].bool()
        alone = flash_attn_func(q[b:b + 1, keep], k[b:b + 1, keep], v[b:b + 1, keep],
                                causal=True)
        torch.testing.assert_close(out[b, keep], alone[0])
        assert not out[b, ~keep].any()
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert not dq[~mask.bool()].any() and dq[mask.bool()].abs().sum() > 0


def test_unpad_input_for_concatenated_sequences_as_fa2_users_call_it():
    """Rows holding several sequences end to end, their lengths listed first in each row of
    attention_mask_in_length: the varlen call over them equals each sequence run alone."""
    from orchard.bert_padding import pad_input, unpad_input_for_concatenated_sequences

    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0], [1, 1, 4, 0, 0, 0]])
    q, k, v = (randn(3, 6, 2, 8, seed=s) for s in (1, 2, 3))
    qu, idx, cu, longest = unpad_input_for_concatenated_sequences(q, lengths)
    assert idx.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 12, 13, 14, 15, 16, 17]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 9, 10, 11, 15] and longest == 4
    ku, vu = (unpad_input_for_concatenated_sequences(t, lengths)[0] for t in (k, v))
    out = pad_input(flash_attn_varlen_func(qu, ku, vu, cu, cu, longest, longest, causal=True),
                    idx, 3, 6)
    for b, row in enumerate(lengths.tolist()):
        start = 0
        for n in filter(None, row):
            alone = flash_attn_func(*(t[b:b + 1, start:start + n] for t in (q, k, v)),
                                    causal=True)
            torch.testing.assert_close(out[b, start:start + n], alone[0])
            start += n
        assert not out[b, start:].any()
    # lengths that cannot be (negative, or past the row) would give tokens and cu_seqlens
    # that disagree
    for bad in ([[4, 3, 0, 0, 0, 0]] * 3, [[2, 3, 0, 0, 0, 0], [-1, 3, 0, 0, 0, 0], [6] + [0] * 5]):
        with pytest.raises(ValueError, match=r"'attention_mask_in_length' row (0|1) holds "
                                             r"lengths \[(4, 3|-1, 3), 0, 0, 0, 0\]"):
            unpad_input_for_concatenated_sequences(q, torch.tensor(bad))


@pytest.mark.parametrize("option", ["cu_seqlens", "alibi_slopes"])
def test_options_written_in_place_before_the_backward_raise_as_inputs_do(option):
    # FlashAttention-2 saves cu_seqlens for its backward: a buffer refilled for the next batch
    # before this one's backward raises, rather than giving the gradients of other sequences
    q, k, v = (randn(8, 2, 16, seed=s).requires_grad_() for s in range(3))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    slopes = torch.tensor([0.5, 0.25])
    out = flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, alibi_slopes=slopes)
    (cu if option == "cu_seqlens" else slopes).add_(1 if option == "cu_seqlens" else 0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_kvcache_write_is_seen_by_autograd_and_reaches_strided_caches():
    """The new keys written by orchard_ops' call bump the caches' version counters, as
    torch's writes do: a backward that saved the cache refuses to run on the new values. A
    cache not contiguous in its last dimension, or not aligned (read through a copy), is
    written by torch first, with the same result."""
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(2, 8, 2, 16, generator=g) for _ in range(2))
    q, k, v = (torch.randn(2, 1, h, 16, generator=g) for h in (4, 2, 2))
    seqlens = torch.tensor([3, 6], dtype=torch.int32)
    w = torch.ones(2, 8, 2, 16, requires_grad=True)
    loss = (w * k_cache).sum()      # saves k_cache for backward
    versions = k_cache._version, v_cache._version
    want = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
    assert k_cache._version > versions[0] and v_cache._version > versions[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    wide = [torch.randn(2, 8, 2, 32, generator=g) for _ in range(2)]
    strided = [t[..., ::2] for t in wide]
    for t, c in zip(strided, (k_cache, v_cache)):
        t[:, :3], t[1, 3:6] = c[:, :3], c[1, 3:6]
    # and so is one whose elements are not aligned (torch.frombuffer at an odd offset)
    raw = [torch.frombuffer(bytearray(c.numel() * 4 + 1), dtype=torch.float32, offset=1,
                            count=c.numel()).view(c.shape) for c in (k_cache, v_cache)]
    assert raw[0].data_ptr() % 4 == 1
    for kind in (strided, raw):
        for t, c in zip(kind, (k_cache, v_cache)):
            t[:, :3], t[1, 3:6] = c[:, :3], c[1, 3:6]
        got = flash_attn_with_kvcache(q, *kind, k, v, cache_seqlens=seqlens)
        assert torch.equal(got, want)
        for t, c in zip(kind, (k_cache, v_cache)):
            assert torch.equal(t[0, :4], c[0, :4]) and torch.equal(t[1, :7], c[1, :7])
