"""torch.compile over orchard: the custom ops orchard::attention_fwd / attention_bwd
(orchard.attention_op) checked by torch's opcheck, and whole graphs (fullgraph=True, so any
graph break fails) that match eager orchard bit for bit: the FlashAttention-2 API,
flash_attention, a patched model, a transformers model."""
import contextlib
import copy
import math

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import orchard_ops  # noqa: E402
from orchard.attention_op import _Options, _op_arguments  # noqa: E402
from orchard.flash_attn import (flash_attn_func, flash_attn_kvpacked_func,  # noqa: E402
                                flash_attn_qkvpacked_func, flash_attn_varlen_func,
                                flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                                flash_attn_with_kvcache)
from orchard.hf_causal_lm import cache_keyword  # noqa: E402
from orchard.model import GPT, GPTConfig  # noqa: E402
from orchard.torch import flash_attention, patch_model  # noqa: E402

OPENCL = [d["id"] for d in orchard_ops.devices() if d["backend"] == "opencl"]


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def run(fn, tensors, kwargs):
    """fn's outputs and the gradients of its first output (a fixed cotangent) for fresh leaves."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    out = fn(*leaves, **kwargs)
    first = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(first, [t for t in leaves if t.requires_grad],
                                randn(*first.shape, dtype=first.dtype, seed=9))
    return (tuple(out) if isinstance(out, tuple) else (out,)) + grads


def assert_same(eager, compiled):
    assert len(eager) == len(compiled)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c) and e.stride() == c.stride()


# ----------------------------------------------------------------------------- the custom ops

def op_cases():
    q, k, v = randn(2, 3, 17, 8), randn(2, 3, 20, 8, seed=1), randn(2, 3, 20, 5, seed=2)
    bnhd = randn(2, 9, 4, 16).transpose(1, 2)          # a (B, N, H, D) tensor seen as (B, H, N, D)
    gqa_kv = randn(2, 11, 2, 16, seed=3).transpose(1, 2)
    cu = torch.tensor([0, 4, 4, 13], dtype=torch.int32)
    packed = randn(13, 2, 8, dtype=torch.float64)
    return {
        "dense": ((q, k, v), _Options()),
        "3-D, one head of size 1": ((q[0, :1], k[0, :1], v[0, :1]), _Options(causal=True)),
        "(B, N, H, D) layout, GQA, causal, window, softcap, ALiBi": (
            (bnhd, gqa_kv, gqa_kv), _Options(causal=True, window=(5, 0), softcap=2.0,
                                             alibi_slopes=torch.rand(4, dtype=torch.float64))),
        "float64 varlen": ((packed, packed, packed),
                           _Options(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=9,
                                    max_seqlen_k=9)),
        "bfloat16, dropout": ((q.bfloat16(), k.bfloat16(), v.bfloat16()),
                              _Options(dropout_p=0.25, seed=torch.tensor(123456789))),
        "expanded": ((q[:1].expand(4, 3, 17, 8), k[:1].expand(4, 3, 20, 8),
                      v[:1].expand(4, 3, 20, 5)), _Options(causal=True)),
        # a last dimension not contiguous: orchard_ops copies such an operand in C order, and
        # lays its results out so; so do the custom ops
        "strided head dim": ((randn(2, 8, 17, 3).permute(0, 3, 2, 1), k, v), _Options()),
    }


@pytest.mark.parametrize("case", list(op_cases()))
def test_custom_ops_pass_torch_opcheck(case):
    """Schema, fake implementations (shapes, dtypes and strides of the real results), the
    autograd registration and AOT dispatch, forward and backward."""
    (q, k, v), opts = op_cases()[case]
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    args = tuple(_op_arguments(opts))
    torch.library.opcheck(torch.ops.orchard.attention_fwd.default, (q, k, v) + args)
    out, lse = torch.ops.orchard.attention_fwd(q, k, v, *args)
    dout = randn(*out.shape, dtype=out.dtype, seed=5)
    torch.library.opcheck(torch.ops.orchard.attention_bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse) + args)


def test_dropout_mask_op_passes_torch_opcheck():
    """orchard::dropout_mask (S_dmask's keep decisions, traced): its fake result is the real
    one's shape and dtype; the mask orchard_ops.dropout_mask draws."""
    args = ([2, 3, 17, 8], [2, 1, 20, 8], 0.25, torch.tensor(123456789))
    torch.library.opcheck(torch.ops.orchard.dropout_mask.default, args)
    want = orchard_ops.dropout_mask((2, 3, 17, 8), (2, 1, 20, 8), 0.25, 123456789)
    assert torch.equal(torch.ops.orchard.dropout_mask(*args), torch.from_numpy(want))


def test_kv_cache_call_passes_opcheck_and_has_no_backward():
    """A forward over a KV cache (flash_attn_with_kvcache's, which runs under no_grad): the
    custom op checks out without gradients; with them, backward says why it cannot run."""
    q, k, v = randn(2, 3, 2, 8), randn(2, 3, 20, 8, seed=1), randn(2, 3, 20, 8, seed=2)
    opts = _Options(causal=True, seqused_k=torch.tensor([7, 20], dtype=torch.int32),
                    leftpad_k=torch.tensor([3, 0], dtype=torch.int32))
    args = tuple(_op_arguments(opts))
    torch.library.opcheck(torch.ops.orchard.attention_fwd.default, (q, k, v) + args)
    out, _ = torch.ops.orchard.attention_fwd(q.requires_grad_(), k, v, *args)
    with pytest.raises(NotImplementedError, match=r"KV cache \(seqused_k, leftpad_k given\)"):
        out.sum().backward()


# ----------------------------------------------------------------------------- whole graphs

Q, K, V = randn(2, 33, 4, 32), randn(2, 40, 2, 32, seed=1), randn(2, 40, 2, 16, seed=2)
X = randn(3, 5, 17, 24, seed=3)
CU_Q, CU_K = (torch.tensor(cu, dtype=torch.int32) for cu in ([0, 5, 5, 12], [0, 7, 9, 16]))
PACKED = (randn(15, 4, 32), randn(18, 2, 32, seed=1), randn(18, 2, 16, seed=2), CU_Q, CU_K)
CALLS = {
    "flash_attn_func GQA causal": (flash_attn_func, (Q, K, V), dict(causal=True)),
    "flash_attn_func window softcap": (flash_attn_func, (Q, K, V),
                                       dict(window_size=(5, 3), softcap=3.0)),
    "flash_attn_func ALiBi, device": (flash_attn_func, (Q, K, V),
                                      dict(alibi_slopes=torch.rand(4), device="cpu")),
    "flash_attn_func lse": (flash_attn_func, (Q, K, V), dict(return_attn_probs=True)),
    "flash_attn_func bfloat16": (flash_attn_func, (Q.bfloat16(), K.bfloat16(), V.bfloat16()),
                                 dict(causal=True)),
    "flash_attn_qkvpacked_func": (flash_attn_qkvpacked_func, (randn(2, 20, 3, 4, 16),),
                                  dict(causal=True)),
    "flash_attn_kvpacked_func": (flash_attn_kvpacked_func, (Q, randn(2, 40, 2, 2, 32)),
                                 dict(causal=True)),
    # packed: three sequences (one empty), then rows past the last offset, padding
    "flash_attn_varlen_func GQA causal, padding rows": (
        flash_attn_varlen_func, PACKED, dict(max_seqlen_q=7, max_seqlen_k=7, causal=True)),
    "flash_attn_varlen_func, padding rows before the first offset": (
        flash_attn_varlen_func, PACKED[:3] + (CU_Q + 2, CU_K + 1),
        dict(max_seqlen_q=7, max_seqlen_k=7, causal=True)),
    "flash_attn_varlen_func lse, window, ALiBi": (
        flash_attn_varlen_func, PACKED, dict(max_seqlen_q=7, max_seqlen_k=7, window_size=(2, 1),
                                             alibi_slopes=torch.rand(4), return_attn_probs=True)),
    "flash_attn_varlen_qkvpacked_func": (flash_attn_varlen_qkvpacked_func,
                                         (randn(14, 3, 2, 16), CU_Q), dict(max_seqlen=7)),
    "flash_attn_varlen_kvpacked_func": (flash_attn_varlen_kvpacked_func,
                                        (randn(14, 2, 16), randn(16, 2, 2, 16), CU_Q, CU_K),
                                        dict(max_seqlen_q=7, max_seqlen_k=7, causal=True)),
    "flash_attention": (flash_attention, (X, X * 0.5, X.flip(-1)), dict(causal=True)),
    "flash_attention on (B, N, H, D) views": (
        flash_attention, (X.transpose(1, 2), X.transpose(1, 2), X.transpose(1, 2)), {}),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_compiled_calls_are_one_graph_and_match_eager(call):
    fn, tensors, kwargs = CALLS[call]
    eager = run(fn, tensors, kwargs)
    torch._dynamo.reset()
    assert_same(eager, run(torch.compile(fn, fullgraph=True, backend="aot_eager"), tensors,
                           kwargs))


@pytest.mark.parametrize("call", ["flash_attn_func GQA causal",
                                  "flash_attention on (B, N, H, D) views",
                                  "flash_attn_varlen_func GQA causal, padding rows"])
def test_inductor_compiled_calls_match_eager(call):
    """Inductor checks every result's size and strides against the fake implementations'."""
    fn, tensors, kwargs = CALLS[call]
    eager = run(fn, tensors, kwargs)
    torch._dynamo.reset()
    assert_same(eager, run(torch.compile(fn, fullgraph=True), tensors, kwargs))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_gradients_of_operands_read_through_copies_are_laid_out_as_eager(backend):
    """Leaves whose head dims are not contiguous: orchard_ops reads C-order copies of them
    and lays the gradients out in C order; compiled, they were in the order of the leaves'
    strides (equal values, another layout)."""
    def leaves():
        return (randn(2, 4, 33, 64)[..., ::2].transpose(1, 2).requires_grad_(),
                randn(2, 40, 4, 32, seed=1).requires_grad_(),
                randn(2, 4, 40, 32, seed=2)[..., ::2].transpose(1, 2).requires_grad_())

    def grads(fn):
        q, k, v = leaves()
        return torch.autograd.grad(fn(q, k, v).sum(), (q, k, v))

    eager = grads(flash_attn_func)
    torch._dynamo.reset()
    compiled = grads(torch.compile(flash_attn_func, fullgraph=True, backend=backend))
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c) and e.stride() == c.stride()
    assert eager[0].is_contiguous() and eager[2].is_contiguous()


def test_compiled_varlen_gradients_around_padding_rows_are_laid_out_as_eager():
    """Rows outside cu_seqlens get their zeros in the layout of the operands (a result of
    orchard_ops is laid out as its operand): eager ones were in C order, compiled ones not."""
    cu = torch.tensor([1, 5, 10], dtype=torch.int32)

    def grads(fn):
        q, k, v = (randn(2, 12, 8, seed=s).transpose(0, 1).requires_grad_() for s in range(3))
        return torch.autograd.grad(fn(q, k, v, cu, cu, 5, 5, causal=True).sum(), (q, k, v))

    eager = grads(flash_attn_varlen_func)
    torch._dynamo.reset()
    compiled = grads(torch.compile(flash_attn_varlen_func, fullgraph=True, backend="aot_eager"))
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c) and e.stride() == c.stride() == (8, 96, 1)


@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(dropout_p=0.3, softcap=2.0)],
                         ids=["causal", "dropout-softcap"])
def test_compiled_autograd_traces_an_eager_forwards_backward_whole(kwargs):
    """Compiled autograd traces the backward of an eagerly recorded call (orchard's
    autograd.Function) as one graph: the backward is the custom op there, with the forward's
    seed (the same dropout mask), a tensor, so that a step's new seed compiles nothing new; it
    broke at orchard_ops' call and at the batched check."""
    from torch._dynamo.testing import CompileCounter

    q, k, v = (randn(2, 24, 4, 32, seed=s).requires_grad_() for s in range(3))
    torch._dynamo.reset()
    counter = CompileCounter()
    for step in range(3):
        torch.manual_seed(step)
        want = torch.autograd.grad(flash_attn_func(q, k, v, **kwargs).sum(), (q, k, v))
        torch.manual_seed(step)
        out = flash_attn_func(q, k, v, **kwargs)
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend=counter,
                                                                   dynamic=False)):
            got = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert counter.frame_count == 1


@pytest.mark.skipif(not OPENCL, reason="no OpenCL device")
def test_compiled_call_on_an_opencl_device():
    torch._dynamo.reset()
    compiled = torch.compile(flash_attn_func, fullgraph=True, backend="aot_eager")
    got = run(compiled, (Q, K, V), dict(causal=True, device=OPENCL[0]))
    for g, e in zip(got, run(flash_attn_func, (Q, K, V), dict(causal=True))):
        assert (g - e).abs().max() < 1e-5


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (3, 0)])
def test_one_graph_serves_every_length_with_dynamic_shapes(window):
    """dynamic=True: the lengths (and a window's unbounded side, which is seqlen_k) stay
    symbolic, the scale and softcap too."""
    def attend(q, k, v):
        return flash_attn_func(q, k, v, softmax_scale=0.3, softcap=2.0, window_size=window)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend="aot_eager")
    for n in (5, 9, 16):
        q, k, v = (randn(1, n, 2, 8, seed=s) for s in range(3))
        assert torch.equal(compiled(q, k, v), attend(q, k, v))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_one_varlen_graph_serves_every_packing_with_dynamic_shapes():
    """The offsets are never read while tracing: one graph for every packing and total."""
    def attend(q, k, v, cu, longest):
        return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend="aot_eager")
    for total, cu in ((9, [0, 4, 9]), (12, [0, 2, 3, 10]), (16, [0, 16])):
        q, k, v = (randn(total, 2, 8, seed=s) for s in range(3))
        cu = torch.tensor(cu, dtype=torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        assert torch.equal(compiled(q, k, v, cu, longest), attend(q, k, v, cu, longest))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_bad_offsets_are_refused_when_the_compiled_graph_runs():
    """Traced, the custom op's implementation (orchard_ops for offsets that end at the last
    row) checks the offsets and the max_seqlen, as orchard.flash_attn does in eager mode."""
    q = randn(10, 2, 8)
    torch._dynamo.reset()
    compiled = torch.compile(flash_attn_varlen_func, fullgraph=True, backend="aot_eager")
    at_most = "'cu_seqlens_q' must start at 0 or after, never decrease and end at most at 10"
    for cu, longest, match in (([0, 6, 4], 6, at_most + r" \(the number of tokens\), got "
                                                 r"\[0, 6, 4\]"),
                               ([0, 4, 11], 7, at_most),
                               ([-1, 4, 10], 6, "'cu_seqlens_q' must start at 0 or after"),
                               ([0, 4, 10], 5, "'max_seqlen_q' must be an int >= 6")):
        cu = torch.tensor(cu, dtype=torch.int32)
        with pytest.raises(ValueError, match=match):
            compiled(q, q, q, cu, cu, longest, longest)
    # refused while tracing (fullgraph=True would report that as a graph break)
    compiled = torch.compile(flash_attn_varlen_func, backend="aot_eager")
    with pytest.raises(TypeError, match="'cu_seqlens_k' must be a torch.int32 tensor"):
        compiled(q, q, q, cu, cu.long(), 7, 7)
    empty = torch.zeros(0, dtype=torch.int32)
    with pytest.raises(ValueError, match="'cu_seqlens_q' must have batch_size \\+ 1 entries"):
        compiled(q, q, q, empty, empty, 1, 1)


def test_slopes_made_in_the_graph_fit_symbolic_head_counts():
    """dynamic=True: the heads are a symbol, which the slopes' fixed shape is compared with."""
    def attend(q, k, v):
        return flash_attn_func(q, k, v, alibi_slopes=torch.tensor([0.1, 0.3, 0.2, 0.5]))

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend="aot_eager")
    assert torch.equal(compiled(Q, K, V), attend(Q, K, V))


def kvcache_step(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cos, sin,
                 cache_leftpad):
    return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                   cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                                   cache_leftpad=cache_leftpad, causal=True,
                                   return_softmax_lse=True)


def kvcache_operands():
    """q (3 sequences of 2 tokens, GQA), a cache of 4 rows of 20 (the sequences in rows 2, 0,
    3, the first two left-padded), 2 new keys and values each, rotary tables."""
    return (randn(3, 2, 4, 16), randn(4, 20, 2, 16, seed=1), randn(4, 20, 2, 16, seed=2),
            randn(3, 2, 2, 16, seed=3), randn(3, 2, 2, 16, seed=4),
            torch.tensor([3, 7, 0], dtype=torch.int32), torch.tensor([2, 0, 3], dtype=torch.int32),
            randn(20, 4, seed=5).cos(), randn(20, 4, seed=6).sin(),
            torch.tensor([1, 4, 0], dtype=torch.int32))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_kvcache_step_compiles_to_one_graph_that_writes_the_cache(backend):
    """A contiguous cache: the new keys written in place, rotated, the results and the cache
    bit for bit the eager ones; the lengths' and the left padding's values stay unread, so the
    next step's lengths take the same graph."""
    q, k_cache, v_cache, *rest = kvcache_operands()
    eager = (k_cache.clone(), v_cache.clone())
    want = kvcache_step(q, *eager, *rest)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(kvcache_step, fullgraph=True, backend=backend)
    got = (k_cache.clone(), v_cache.clone())
    assert_same(want + eager, compiled(q, *got, *rest) + got)
    lengths = torch.tensor([5, 9, 2], dtype=torch.int32)
    args = rest[:2] + [lengths] + rest[3:]
    assert_same(kvcache_step(q, *eager, *args) + eager, compiled(q, *got, *args) + got)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_one_kvcache_graph_serves_every_batch_with_dynamic_shapes():
    """dynamic=True: the batch is a symbol too (no message holds it while tracing)."""
    q, k_cache, v_cache, k, v, lengths, rows, cos, sin, pads = kvcache_operands()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(kvcache_step, fullgraph=True, dynamic=True, backend="aot_eager")
    for batch in (3, 2):
        eager, got = (k_cache.clone(), v_cache.clone()), (k_cache.clone(), v_cache.clone())
        # copies, not views: a view's base size would be guarded too
        first = [t[:batch].clone() for t in (q, k, v, lengths, rows, pads)]
        args = first[1:5] + [cos, sin, first[5]]
        assert_same(kvcache_step(first[0], *eager, *args) + eager,
                    compiled(first[0], *got, *args) + got)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_bad_cache_lengths_are_refused_before_the_compiled_graph_writes():
    q, k_cache, v_cache, k, v, lengths, rows, cos, sin, pads = kvcache_operands()
    torch._dynamo.reset()
    compiled = torch.compile(kvcache_step, fullgraph=True, backend="aot_eager")
    for lengths, rows, positions, pads, match in (
            ([3, 19, 0], [2, 0, 3], 20, [0, 0, 0], "'cache_seqlens' plus the new tokens must lie"),
            ([-1, 7, 0], [2, 0, 3], 20, [0, 0, 0], "'cache_seqlens' plus the new tokens must lie"),
            ([3, 7, 0], [2, 0, 4], 20, [0, 0, 0], "'cache_batch_idx' has entries outside"),
            ([3, 7, 9], [2, 0, 3], 10, [0, 0, 0], "'rotary_cos' has fewer positions"),
            ([3, 7, 0], [2, 0, 3], 20, [0, 10, 0], "'cache_leftpad' must lie in"),
            ([3, 7, 0], [2, 0, 3], 20, [-1, 0, 0], "'cache_leftpad' must lie in")):
        cache = k_cache.clone()
        with pytest.raises(RuntimeError, match=match):
            compiled(q, cache, v_cache.clone(), k, v, torch.tensor(lengths, dtype=torch.int32),
                     torch.tensor(rows, dtype=torch.int32), cos[:positions], sin[:positions],
                     torch.tensor(pads, dtype=torch.int32))
        assert torch.equal(cache, k_cache)


def test_forward_mode_ad_is_refused_in_compiled_code_too():
    """The custom ops have no forward derivative: traced under a dual level, orchard raises
    rather than let torch give a tangent of 0."""
    q, t = randn(2, 4, 5, 16, dtype=torch.float64), randn(2, 4, 5, 16, dtype=torch.float64, seed=1)
    torch._dynamo.reset()
    jvp = torch.compile(lambda q, t: torch.func.jvp(lambda q: flash_attention(q, q, q), (q,),
                                                    (t,))[1], backend="aot_eager")
    with pytest.raises(NotImplementedError, match="forward derivative"):
        jvp(q, t)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q: flash_attention(q, q, q), backend="aot_eager")
    compiled(q)
    with torch.autograd.forward_ad.dual_level():
        with pytest.raises(NotImplementedError, match="forward derivative"):
            compiled(torch.autograd.forward_ad.make_dual(q, t))


def test_dropout_seed_is_drawn_in_the_graph_and_follows_manual_seed():
    def dropped(q, k, v):
        return flash_attn_func(q, k, v, dropout_p=0.3)

    # aot_eager draws the seed with torch's eager generator: the eager masks, bit for bit;
    # S_dmask too (return_attn_probs), whose mask is an op of its own in the graph (a graph
    # break until the sixty-second session; FlashAttention-2's traces whole)
    for fn in (dropped, flash_attn_func):
        kwargs = {} if fn is dropped else dict(dropout_p=0.3, return_attn_probs=True)
        torch.manual_seed(5)
        eager = run(fn, (Q, K, V), kwargs)
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        torch.manual_seed(5)
        assert_same(eager, run(compiled, (Q, K, V), kwargs))
        assert not torch.equal(eager[0], run(compiled, (Q, K, V), kwargs)[0])     # a new seed
    # inductor draws it with its own generator, seeded from torch's: reproducible
    torch._dynamo.reset()
    compiled = torch.compile(dropped, fullgraph=True)
    torch.manual_seed(5)
    first = run(compiled, (Q, K, V), {})
    torch.manual_seed(5)
    assert_same(first, run(compiled, (Q, K, V), {}))


def test_bad_arguments_are_refused_in_compiled_code_too():
    torch._dynamo.reset()
    compiled = torch.compile(flash_attn_func, backend="aot_eager")
    with pytest.raises(ValueError, match="'device' 'gpu:7' is not an available device"):
        compiled(Q, K, V, device="gpu:7")
    with pytest.raises(TypeError, match="'device' must be a str or None, not int"):
        compiled(Q, K, V, device=3)
    with pytest.raises(ValueError, match="'alibi_slopes' must be finite"):
        compiled(Q, K, V, alibi_slopes=torch.tensor([1.0, math.nan, 1.0, 1.0]))
    with pytest.raises(ValueError, match="'dropout_p' must be in"):
        compiled(Q, K, V, dropout_p=1.5)


def test_patched_model_compiles_to_one_graph_that_routes_to_orchard():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, context=32, n_layer=2, n_head=2, n_kv_head=2,
                          n_embd=32))
    router = patch_model(model)
    x = torch.randint(0, 64, (2, 32))
    eager = torch.autograd.grad(model(x)[0].sum(), list(model.parameters()))
    assert router.routed == 2
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for calls in (4, 6):
        got = torch.autograd.grad(compiled(x)[0].sum(), list(model.parameters()))
        assert all(torch.equal(e, g) for e, g in zip(eager, got))
        assert router.routed == calls and not router.left_to_torch


def test_patched_model_with_checkpointed_blocks_compiles_whole_with_dynamos_flag():
    """Checkpointed blocks: the router's count is a side effect, which Dynamo refuses inside
    checkpoint's subgraph (fullgraph=True fails there) unless told not to replay it in the
    backward's recomputation; then the model is one graph, its gradients eager's, and each
    forward counts its calls once (eagerly the recomputation counts them again)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, context=32, n_layer=2, n_head=2, n_kv_head=2,
                          n_embd=32))
    model.grad_checkpointing = True
    router = patch_model(model)
    x = torch.randint(0, 64, (2, 32))
    eager = torch.autograd.grad(model(x)[0].sum(), list(model.parameters()))
    assert router.routed == 4       # two layers, each recomputed in the backward
    torch._dynamo.reset()
    with pytest.raises(Exception, match="side effect"):
        torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    torch._dynamo.reset()
    flag = dict(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
    with torch._dynamo.config.patch(**flag):
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        routed = router.routed
        for step in (1, 2):
            got = torch.autograd.grad(compiled(x)[0].sum(), list(model.parameters()))
            assert all(torch.equal(e, g) for e, g in zip(eager, got))
            assert router.routed == routed + 2 * step and not router.left_to_torch


def test_make_fx_records_orchard_as_its_op():
    """make_fx traces through a torch dispatch mode, not Dynamo: orchard's kernels, called
    directly, ran unseen and the graph held the traced call's result as a constant (a second
    input got the first's output); now the graph holds orchard's op, forward and backward."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k, v):
        out = flash_attention(q, k, v, causal=True)
        return out, torch.autograd.grad(out.square().sum(), (q, k, v))

    q, k, v = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(3))
    graph = make_fx(step)(q, k, v)
    assert "orchard.attention_fwd" in graph.code and "orchard.attention_bwd" in graph.code
    q2 = torch.randn(1, 2, 6, 8, requires_grad=True)
    out, grads = graph(q2, k, v)
    want, want_grads = step(q2, k, v)
    assert torch.equal(out, want) and all(torch.equal(g, w) for g, w in zip(grads, want_grads))


@pytest.mark.parametrize("tracing_mode", ["real", "fake"])
def test_make_fx_traces_the_calls_whose_checks_read_values(tracing_mode):
    """The FlashAttention-2 calls whose eager checks read tensor values (ALiBi slopes, varlen
    offsets, a cache's lengths) leave them to orchard_ops while make_fx records, as under
    torch.compile: they had failed there (a tracing tensor's value, a data-dependent guard)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from orchard.flash_attn import flash_attn_func, flash_attn_varlen_func, \
        flash_attn_with_kvcache

    torch.manual_seed(0)
    q, slopes = torch.randn(1, 6, 4, 8), torch.rand(4)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    caches = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 4, 8)
    calls = [(lambda q, s: flash_attn_func(q, q, q, alibi_slopes=s), (q, slopes)),
             (lambda q, cu: flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4), (q, cu)),
             (lambda q, k, v: flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=5),
              (q, *caches))]
    for call, args in calls:
        graph = make_fx(call, tracing_mode=tracing_mode)(*args)
        assert "orchard.attention_fwd" in graph.code
        assert torch.equal(graph(*args), call(*args))
    # new keys written into the slot q is a view of: q read as it was (make_fx does not
    # functionalize, as torch.compile does: its graph had read q after the write)
    step = lambda k_cache, v_cache, new, slopes: flash_attn_with_kvcache(
        k_cache[:, 3:4], k_cache, v_cache, new, new, cache_seqlens=3, alibi_slopes=slopes)
    graph = make_fx(step, tracing_mode=tracing_mode)(*(c.clone() for c in caches), q[:, :1],
                                                     slopes)
    assert torch.equal(graph(*(c.clone() for c in caches), q[:, :1], slopes),
                       step(*(c.clone() for c in caches), q[:, :1], slopes))
    # the slopes' check when the graph runs, before the cache is written
    bad, k_cache = torch.tensor([1.0, float("inf"), 1.0, 1.0]), caches[0].clone()
    with pytest.raises(RuntimeError, match="'alibi_slopes' must be finite"):
        graph(k_cache, caches[1].clone(), q[:, :1], bad)
    assert torch.equal(k_cache, caches[0])


def test_a_mode_over_real_tensors_keeps_eager_checks():
    """A dispatch mode that does not trace (FlopCounterMode) leaves orchard.flash_attn's
    checks as in eager mode: ValueError naming the argument and its values, the cache
    unwritten (as the checks of a traced graph, they had let a cache of inference tensors be
    written before torch refused it)."""
    from torch.utils.flop_counter import FlopCounterMode
    from orchard.flash_attn import flash_attn_with_kvcache

    q, new = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8)
    with torch.inference_mode():
        frozen = torch.zeros(1, 6, 2, 8)
    cache = torch.zeros(1, 6, 2, 8)
    with FlopCounterMode(display=False):
        with pytest.raises(ValueError, match="'cache_seqlens' 6 plus the 1 new tokens"):
            flash_attn_with_kvcache(q, cache, cache.clone(), new, new, cache_seqlens=6)
        with pytest.raises(ValueError, match="'v_cache' is an inference tensor"):
            flash_attn_with_kvcache(q, cache, frozen, new, new, cache_seqlens=2)
    assert not cache.any()


def test_under_a_dispatch_mode_orchard_is_its_op_with_the_same_results_and_refusals():
    """A torch dispatch mode (FlopCounterMode here) takes the custom op's path: results and
    dropout masks as eager; a second derivative and torch.func transforms are refused there
    too (the op's backward gave a gradient penalty silently wrong)."""
    from torch.utils.flop_counter import FlopCounterMode
    q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    results = []
    for mode in (None, FlopCounterMode(display=False)):
        torch.manual_seed(3)
        with mode or contextlib.nullcontext():
            out = flash_attention(q, k, v, causal=True, dropout_p=0.3)
            results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
            with pytest.raises(RuntimeError, match="no second derivative"):
                torch.autograd.grad(flash_attention(q, k, v).sum(), q, create_graph=True)
            with pytest.raises(NotImplementedError, match="torch.func"):
                torch.func.vmap(flash_attention)(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_patched_model_exports_with_orchard_in_the_program():
    """torch.export (non-strict, its default) reads the root module's forward.__code__, which
    the patched forward lacked (AttributeError)."""
    class Attend(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return F.scaled_dot_product_attention(self.proj(x), x, x, is_causal=True)

    model = Attend()
    unpatched = copy.deepcopy(model)
    patch_model(model)
    x = torch.randn(2, 3, 16, 8)
    program = torch.export.export(model, (x,))
    assert "orchard.attention_fwd" in str(program.graph)
    x2 = torch.randn(2, 3, 16, 8)
    torch.testing.assert_close(program.module()(x2), unpatched(x2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("given", [(None, None), (7, None)], ids=["neither", "only-q"])
def test_varlen_export_needs_max_seqlen(given):
    """torch.export cannot read cu_seqlens' values while tracing (a data-dependent guard,
    in torch's words): without max_seqlen the call says which argument to give; with both it
    exports, and the program serves other offsets."""
    class Packed(torch.nn.Module):
        def __init__(self, max_q, max_k):
            super().__init__()
            self.max_q, self.max_k = max_q, max_k

        def forward(self, q, k, v, cu_q, cu_k):
            return flash_attn_varlen_func(q, k, v, cu_q, cu_k, self.max_q, self.max_k,
                                          causal=True)

    missing = "max_seqlen_q" if given[0] is None else "max_seqlen_k"
    with pytest.raises(ValueError, match="'%s' must be given to a call torch.export traces"
                                         % missing):
        torch.export.export(Packed(*given), PACKED)
    program = torch.export.export(Packed(7, 7), PACKED)
    other = PACKED[:3] + (torch.tensor([0, 2, 9, 15], dtype=torch.int32),
                          torch.tensor([0, 6, 12, 18], dtype=torch.int32))
    assert torch.equal(program.module()(*other), Packed(7, 7)(*other))


def test_paged_varlen_export_is_refused_naming_block_table():
    """orchard finds the pages from cu_seqlens' values, which torch.export cannot read."""
    class Paged(torch.nn.Module):
        def forward(self, q, pages, cu, table):
            return flash_attn_varlen_func(q, pages, pages, cu, cu, 8, 8, block_table=table)

    q, pages = randn(12, 2, 16), randn(4, 8, 2, 16, seed=1)
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    Paged()(q, pages, cu, table)    # eager: fine
    with pytest.raises(ValueError, match="'block_table' cannot be given to a call torch.export "
                                         "traces"):
        torch.export.export(Paged(), (q, pages, cu, table))


@pytest.mark.parametrize("width", [2, 600], ids=["narrow", "wide"])   # <= 1024 entries, more
def test_paged_calls_compile_around_their_pages(width):
    """Paged calls read their pages' numbers (a graph break, as FlashAttention-2's), in small
    and large block tables (checked in NumPy, which Dynamo would trace): compiled, the eager
    results, and a page number out of range is refused naming block_table."""
    q, pages = randn(12, 2, 16), randn(4, 8, 2, 16, seed=1)
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    table = torch.cat([torch.tensor([[2, 0], [1, 3]], dtype=torch.int32),
                       torch.full((2, width - 2), -1, dtype=torch.int32)], 1)   # unused
    bad = table.clone()
    bad[1, 0] = 4           # sequence 1's 8 keys: one page of 8
    varlen = torch.compile(lambda q, pages, table: flash_attn_varlen_func(
        q, pages, pages, cu, cu, 8, 8, causal=True, block_table=table), backend="eager")
    kvcache = torch.compile(lambda q, pages, table: flash_attn_with_kvcache(
        q, pages, pages, cache_seqlens=torch.tensor([4, 8], dtype=torch.int32),
        block_table=table, causal=True), backend="eager")
    qs = q[[3, 11]].unsqueeze(1)    # each sequence's last query
    assert torch.equal(varlen(q, pages, table), flash_attn_varlen_func(
        q, pages, pages, cu, cu, 8, 8, causal=True, block_table=table))
    assert torch.equal(kvcache(qs, pages, table), varlen(q, pages, table)[[3, 11]].unsqueeze(1))
    for call, x, refusal in ((varlen, q, r"varlen_func: 'block_table' row 1 lists pages \[4\]"),
                             (kvcache, qs, r"kvcache: 'block_table' row 1 lists pages \[4\]")):
        with pytest.raises(ValueError, match=refusal):
            call(x, pages, bad)


def tiny_llama(layers=2):
    pytest.importorskip("transformers")
    import orchard.hf  # noqa: F401  (registers "orchard")
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="orchard"))


def test_transformers_model_compiles_to_one_graph():
    """A model without a padding mask: transformers' mask function returns None for orchard,
    so nothing in the forward reads a tensor's values (a padding mask does: graph breaks there,
    as with FlashAttention-2)."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 12))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lambda ids: model(input_ids=ids).logits, fullgraph=True,
                             backend="aot_eager")
    got = compiled(ids)     # first: orchard.hf's checks of the model run inside the trace
    # (the window its masks had, recorded in the first trace, made the second call compile
    # the forward again)
    assert torch.equal(compiled(ids), got)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert torch.equal(model(input_ids=ids).logits, got)


def test_transformers_encoder_compiles_to_one_graph_with_or_without_padding():
    """An encoder (BERT): its bidirectional mask, none, all real or padded, is never read in
    the graph (each row's real keys gathered first by a stable sort): one graph,
    fullgraph=True, the eager results bit for bit."""
    pytest.importorskip("transformers")
    import orchard.hf  # noqa: F401  (registers "orchard")
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=128,
                                 attn_implementation="orchard")).eval()
    ids = torch.randint(0, 128, (3, 10))
    padded = torch.ones(3, 10, dtype=torch.long)
    padded[0, 6:] = 0
    padded[2, :3] = 0
    for mask in (None, torch.ones(3, 10, dtype=torch.long), padded):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        orchard_ops.reset_stats()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        got = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
        assert orchard_ops.stats()["fwd_calls"] == 2
        assert torch.equal(got, model(input_ids=ids, attention_mask=mask).last_hidden_state)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "padded"])
def test_transformers_encoder_decoder_compiles_cold_to_one_graph(padded):
    """BART compiled before any eager call, fullgraph: its encoder layers ran before its
    decoder's causal mask recorded the model's window (none), and Dynamo's restart of the trace
    then read what the first pass had not (SpeculationLogDivergence); non-causal layers take
    no recorded window."""
    pytest.importorskip("transformers")
    import orchard.hf  # noqa: F401  (registers "orchard")
    from transformers import BartConfig, BartModel
    torch.manual_seed(0)
    model = BartModel(BartConfig(
        vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, attn_implementation="orchard")).eval()
    ids, decoder_ids = torch.randint(0, 100, (3, 9)), torch.randint(0, 100, (3, 4))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, 6:] = 0
    kw = dict(input_ids=ids, decoder_input_ids=decoder_ids, attention_mask=mask if padded else None)
    torch._dynamo.reset()
    got = torch.compile(model, fullgraph=True, backend="aot_eager")(**kw).last_hidden_state
    assert torch.equal(got, model(**kw).last_hidden_state)


@pytest.mark.parametrize("left_padded", [False, True], ids=["no-padding", "left-padding"])
def test_transformers_static_cache_generate_compiles_once(left_padded):
    """generate() over a static cache with the model's forward compiled: the cache's length
    and the padding stay unread (orchard.hf marks the written keys in the mask, the calls
    read the cache in place), so the prefill and the decode steps take one graph each with no
    graph break and no recompile per step; the tokens are eager orchard's."""
    model = tiny_llama().eval()
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    real = torch.ones(2, 7, dtype=torch.long)
    if left_padded:
        real[0, :3] = 0
    kw = dict(attention_mask=real, max_new_tokens=6, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    want = model.generate(ids, **kw)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    orchard_ops.reset_stats()
    assert torch.equal(model.generate(ids, **kw), want)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert orchard_ops.stats()["decode_calls"] >= 5 * 2     # 5 steps, 2 layers


def test_transformers_static_cache_mask_not_left_padded_is_refused_when_compiled():
    """A mask over a static cache with padding between real tokens, which a compiled call
    cannot lay out without reading it: a RuntimeError that says what to do (eagerly the call
    unpads it, as without a cache)."""
    from transformers import StaticCache
    model = tiny_llama().eval()
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    real = torch.ones(2, 7, dtype=torch.long)
    real[1, 3] = 0

    def forward(ids, real):
        cache = StaticCache(config=model.config, max_cache_len=16)
        return model(input_ids=ids, attention_mask=real, **{cache_keyword(model): cache}).logits

    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=real).logits
        assert torch.equal(forward(ids, real), want)
        torch._dynamo.reset()
        compiled = torch.compile(forward, backend="aot_eager")
        with pytest.raises(RuntimeError, match="must be left padding"):
            compiled(ids, real)


@pytest.mark.parametrize("use_cache", [False, True])
def test_transformers_right_padding_compiles(use_cache):
    """Without a static cache, a padding mask that is not left padding: eager's logits
    (use_cache=False: a graph break where transformers' packed-sequence mask is read)."""
    model = tiny_llama().eval()
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    real = torch.ones(2, 8, dtype=torch.long)
    real[0, 5:] = 0
    real[1, 2] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=real, use_cache=use_cache).logits
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, backend="aot_eager")
        got = compiled(input_ids=ids, attention_mask=real, use_cache=use_cache).logits
    assert torch.equal(got, want)


def test_transformers_padding_mask_compiles_to_one_graph():
    """A forward of a query at every position with a padding mask, left, right or with gaps:
    compiled whole (fullgraph=True), the mask never read, each row's real tokens laid out first
    in one dense causal call (orchard.hf._sorted_attention); eager's logits on the real
    positions and eager's gradients, every layer on orchard. It broke the graph about eight
    times a layer, and from the fifth layer on Dynamo's recompile limit ran the layers
    uncompiled (a review)."""
    model = tiny_llama(3)
    ids = torch.randint(1, 128, (3, 9), generator=torch.Generator().manual_seed(1))
    real = torch.ones(3, 9, dtype=torch.long)
    real[0, :3] = 0     # left padding
    real[1, 6:] = 0     # right padding
    real[2, 4] = 0      # a gap
    labels = ids.masked_fill(real == 0, -100)
    torch._dynamo.reset()
    orchard_ops.reset_stats()
    compiled = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=real).logits
        got = compiled(input_ids=ids, attention_mask=real).logits
    assert torch.equal(got[real.bool()], want[real.bool()])
    loss = model(input_ids=ids, attention_mask=real, labels=labels).loss
    want = torch.autograd.grad(loss, list(model.parameters()))
    loss = compiled(input_ids=ids, attention_mask=real, labels=labels).loss
    for g, w in zip(torch.autograd.grad(loss, list(model.parameters())), want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
    assert orchard_ops.stats()["fwd_calls"] == 4 * 3


def test_transformers_padding_mask_over_a_cache_is_read_once_per_forward_when_compiled():
    """Queries after a (dynamic) cache with a padding mask: the mask is read where it is made,
    eagerly (one graph break a mask), never in a layer, so the breaks do not grow with the
    layers; eager's logits."""
    import copy
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    real = torch.ones(2, 9, dtype=torch.long)
    real[0, :3] = 0
    real[1, 2] = 0
    breaks = []
    for layers in (2, 6):
        model = tiny_llama(layers).eval()
        with torch.no_grad():
            cache = model(input_ids=ids[:, :6], attention_mask=real[:, :6]).past_key_values
            want = model(input_ids=ids[:, 6:], attention_mask=real,
                         past_key_values=copy.deepcopy(cache)).logits
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            compiled = torch.compile(model.forward, backend="aot_eager")
            got = compiled(input_ids=ids[:, 6:], attention_mask=real,
                           past_key_values=copy.deepcopy(cache)).logits
        assert torch.equal(got, want)
        breaks.append(sum(torch._dynamo.utils.counters["graph_break"].values()))
    assert breaks[0] == breaks[1], breaks


@pytest.mark.parametrize("packed", [False, True], ids=["one-sequence-a-row", "packed"])
def test_transformers_forward_without_a_cache_compiles_around_its_mask(packed):
    """use_cache=False (a training forward): compiled, transformers makes every mask a
    packed-sequence one, a closure Dynamo cannot read. orchard reads it eagerly (one graph
    break where the mask is made; one sequence a row is plain causal); before, Dynamo failed
    there and ran the whole forward eagerly around seven smaller graphs."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 20))
    kw = dict(use_cache=False)
    if packed:
        kw["position_ids"] = torch.cat([torch.arange(8), torch.arange(12)])[None].expand(2, -1)
    want = model(input_ids=ids, **kw).logits
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    orchard_ops.reset_stats()
    got = torch.compile(model, backend="aot_eager")(input_ids=ids, **kw).logits
    assert torch.equal(got, want)
    assert orchard_ops.stats()["fwd_calls"] == 2        # both layers on orchard
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= (5 if packed else 4)


def test_transformers_packed_position_ids_compile_without_breaks_in_the_layers():
    """Packed sequences given by position_ids alone, compiled: the layers take offsets of a
    fixed shape (the sequences' starts, then empty sequences), so a new packing neither breaks
    the graph in the layers nor compiles them again (before: a break in every layer and a
    recompile there for each new number of sequences); forward and backward the eager results
    bit for bit."""
    model = tiny_llama()
    params = list(model.parameters())

    def loss(ids, positions):
        return model(input_ids=ids, position_ids=positions, use_cache=False).logits.square().mean()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(loss, backend="aot_eager")
    graphs = []
    for lengths in ([8, 12], [3, 5, 7, 5], [20], [1, 1, 18], [4] * 5, [2, 9, 9], [1] * 20):
        ids = torch.randint(0, 128, (2, 20))
        positions = torch.cat([torch.arange(n) for n in lengths])[None].expand(2, -1)
        want = [loss(ids, positions)] + list(torch.autograd.grad(loss(ids, positions), params))
        got = [compiled(ids, positions)]
        got += list(torch.autograd.grad(compiled(ids, positions), params))
        assert all(torch.equal(w, g) for w, g in zip(want, got)), lengths
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert all("_read_mask_function" in reason for reason in breaks), list(breaks)
    # packed, then one sequence a row (plain causal: no offsets), then no new graph
    assert graphs[3:] == [graphs[2]] * 4, graphs


def tiny_window_pair(model_type, **extra):
    """(sdpa model, orchard model) of a tiny transformers model with a window of 4, the same
    weights."""
    pytest.importorskip("transformers")
    import orchard.hf  # noqa: F401  (registers "orchard")
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(model_type, sliding_window=4, num_key_value_heads=2,
                                  vocab_size=128, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  max_position_embeddings=128, **extra)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="orchard").eval()
    model.load_state_dict(ref.state_dict())
    return ref, model


def test_transformers_window_only_the_mask_holds_is_applied_when_compiled():
    """PhiMoE neither passes nor keeps its window: orchard takes the one its masks had. Its
    compiled forward without a cache wraps the window's mask in a packed-sequence one; read
    through that wrapper, the window is recorded (it was lost, and the compiled forward and
    the eager ones after it ran without a window, 0.39 off sdpa)."""
    ref, model = tiny_window_pair("phimoe", num_local_experts=4, num_experts_per_tok=2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=ids, use_cache=False).logits
        torch._dynamo.reset()
        got = torch.compile(model, backend="aot_eager")(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, want,
                                   rtol=0, atol=2e-5)


def test_transformers_windows_layers_keep_are_applied_in_every_compiled_call():
    """Qwen2-MoE keeps its window on its sliding layers (none on its full ones) and passes
    none: compiled over packed sequences, whose offsets break the graph in each layer, the
    frame compiled for the full layer served the sliding one from the second call on (0.18
    off sdpa, silently): the kept window is read so that Dynamo guards on it."""
    ref, model = tiny_window_pair("qwen2_moe", use_sliding_window=True, max_window_layers=1,
                                  moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                  num_experts=4, num_experts_per_tok=2)
    assert [getattr(layer.self_attn, "sliding_window", None)
            for layer in model.model.layers] == [4, None]
    kw = dict(input_ids=torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1)),
              position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6],
                                         [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]]),
              use_cache=False)
    torch._dynamo.reset()
    compiled = torch.compile(lambda **kw: model(**kw).logits, backend="aot_eager")
    with torch.no_grad():
        want = ref(**kw).logits
        for _ in range(2):
            torch.testing.assert_close(compiled(**kw), want, rtol=0, atol=2e-5)


def test_transformers_packed_sequences_compile_to_one_graph():
    """Packed sequences given as transformers' FlashAttention keywords (cu_seq_lens_q/k with
    max_length_q/k, as DataCollatorWithFlattening makes them): one graph, forward and
    backward, the eager results bit for bit."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 20))
    cu = torch.tensor([0, 7, 12, 20], dtype=torch.int32)
    positions = torch.cat([torch.arange(7), torch.arange(5), torch.arange(8)])[None]

    def loss(ids):
        logits = model(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu,
                       cu_seq_lens_k=cu, max_length_q=8, max_length_k=8).logits
        return logits.square().mean()

    eager = [loss(ids)] + list(torch.autograd.grad(loss(ids), list(model.parameters())))
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = [compiled(ids)] + list(torch.autograd.grad(compiled(ids), list(model.parameters())))
    assert all(torch.equal(e, g) for e, g in zip(eager, got))
