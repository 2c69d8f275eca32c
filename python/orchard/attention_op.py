"""One attention call from torch into orchard_ops: its options (_Options), the call itself
(ops_call), and the same call as two torch.library custom ops, which torch.compile traces as
one graph node each way (fullgraph=True works):

    orchard::attention_fwd(q, k, v, <options>) -> (out, lse)       differentiable in q, k, v
    orchard::attention_bwd(dout, q, k, v, out, lse, <options>) -> (dq, dk, dv)

<options> are _Options' fields, in its order; the schema is written from _Options, once.
Their fake implementations give what orchard_ops returns: out, dq, dk, dv in the memory axis
order of their operand (q, q, k, v), as csrc/problem.c or_new_output lays them out (C order
for an operand read through a copy), lse in C order. orchard.torch takes the custom ops only
while torch records a graph (torch.compile, or a torch dispatch mode: make_fx, torch.export,
fake tensors): in eager mode the dispatcher would add about 11 us to every call, and both
paths run ops_call, so their results are the same.
"""
import collections
import math

import torch
import torch.autograd.forward_ad as forward_ad

import orchard_ops

# Everything one attention call needs besides q, k, v. cu_seqlens_q/k (int32 tensors) select
# the packed (total, H, D) layout; otherwise tensors are (..., N, D) with optional GQA heads,
# or with seqlen_first (..., N, H, D), lse (..., H, N) either way.
# seed is an int, or while torch records a graph a 0-d int64 tensor (orchard.torch._seed).
_Options = collections.namedtuple(
    "_Options", "scale dropout_p causal window alibi_slopes softcap seed device "
                "cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k seqused_k block_table leftpad_k "
                "seqlen_first",
    defaults=(None, 0.0, False, (-1, -1), None, 0.0, 0, None, None, None, None, None, None, None,
              None, False))

# The custom ops' schema type of each option
_SCHEMA_TYPES = {"scale": "float?", "dropout_p": "float", "causal": "bool", "window": "SymInt[]",
                 "alibi_slopes": "Tensor?", "softcap": "float", "seed": "Tensor?",
                 "device": "str?", "cu_seqlens_q": "Tensor?", "cu_seqlens_k": "Tensor?",
                 "max_seqlen_q": "SymInt?", "max_seqlen_k": "SymInt?", "seqused_k": "Tensor?",
                 "block_table": "Tensor?", "leftpad_k": "Tensor?", "seqlen_first": "bool"}


def refuse(why):
    """NotImplementedError for a call under `why`, a transform or forward-mode AD."""
    raise NotImplementedError(
        "orchard attention does not run under %s: its kernels read the tensors' memory and "
        "have no batching rule or forward derivative; use torch's "
        "scaled_dot_product_attention there (patch_model falls back to it)" % why)


def refuse_second_derivative():
    """RuntimeError where a backward runs with grad mode on: under create_graph=True, which
    asks for the gradients' own graph. orchard's backward has none, and gradients without one
    would make a second derivative (a gradient penalty) silently wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError("orchard attention has no second derivative: its backward ran "
                           "with create_graph=True (a gradient of a gradient, such as a "
                           "gradient penalty); compute such terms with torch's attention")


def refuse_batched(dout):
    """NotImplementedError where a backward runs under vmap (is_grads_batched=True, a
    vectorized jacobian): a batched gradient has no memory for the kernels to read (it ended
    in flash_attn_bwd's "cannot be viewed as an array")."""
    functorch = torch._C._functorch
    # (the legacy kind, is_grads_batched's, never reaches compiled autograd, whose trace of
    # this check would break at it)
    if functorch.is_batchedtensor(dout) or (not torch.compiler.is_compiling()
                                            and functorch.is_legacy_batchedtensor(dout)):
        refuse("a batched backward (autograd.grad with is_grads_batched=True, a vectorized "
               "jacobian)")


def ops_call(dense, varlen, o, *arrays, **new):
    """dense(*arrays, ...) or, with cu_seqlens, varlen(*arrays, ...): an orchard_ops call with
    the options o; new: a forward's k_new and v_new (flash_attn_with_kvcache)."""
    # only the options that are set: fewer keywords to parse, about 1 us of a tiny call
    kw = new
    if o.window != (-1, -1):
        kw["window"] = o.window
    if o.softcap:
        kw["softcap"] = o.softcap
    if o.seed:
        kw["seed"] = o.seed
    if o.device is not None:
        kw["device"] = o.device
    if o.alibi_slopes is not None:
        kw["alibi_slopes"] = o.alibi_slopes
    # forward only (flash_attn_with_kvcache): the keys used, where they start, and pages of
    # k and v read in place
    if o.seqused_k is not None:
        kw["seqused_k"] = o.seqused_k
    if o.leftpad_k is not None:
        kw["leftpad_k"] = o.leftpad_k
    if o.block_table is not None:
        kw["block_table"] = o.block_table
    if o.seqlen_first:
        kw["seqlen_first"] = True
    if o.cu_seqlens_q is None:
        return dense(*arrays, o.scale, o.dropout_p, o.causal, **kw)

    def call(*xs, cu_q=o.cu_seqlens_q, cu_k=o.cu_seqlens_k):
        return varlen(*xs, cu_q, cu_k, o.max_seqlen_q, o.max_seqlen_k, o.scale, o.dropout_p,
                      o.causal, **kw)

    # Packed rows before cu_seqlens' first offset or past its last are padding
    # (FlashAttention-2's static-shape buffers, or a window of a larger one): orchard_ops gets
    # the rows between, the results get the padding back (out and gradients 0, lse -inf).
    # Here rather than in orchard.flash_attn, whose traced calls cannot read the offsets: the
    # custom ops' implementations run this.
    q, k = arrays[:2] if len(arrays) == 3 else arrays[1:3]
    cu_q, cu_k = o.cu_seqlens_q, o.cu_seqlens_k
    if len(cu_q) == 0 or len(cu_k) == 0:
        return call(*arrays)    # orchard_ops says what is wrong
    paged = o.block_table is not None
    q0, nq = int(cu_q[0]), int(cu_q[-1])
    k0, nk = (0, k.shape[0]) if paged else (int(cu_k[0]), int(cu_k[-1]))
    if q0 == 0 and nq == q.shape[0] and k0 == 0 and nk == k.shape[0]:
        return call(*arrays)    # nothing to cut
    for name, cu, total in (("cu_seqlens_q", cu_q, q.shape[0]),
                            ("cu_seqlens_k", cu_k, None if paged else k.shape[0])):
        # (orchard_ops, which takes no padding rows, would say "start at 0" and "end at")
        if cu[0] < 0 or total is not None and cu[-1] > total or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError("orchard attention: '%s' must start at 0 or after, never decrease "
                             "and end at most at %s (the number of tokens), got %s"
                             % (name, total, cu.tolist()))
    cut = dict(cu_q=cu_q - q0, cu_k=cu_k - k0)
    rows_q, rows_k = slice(q0, nq), slice(k0, nk)
    if len(arrays) == 3:                # forward: q, k, v -> out, lse
        out, lse = call(q[rows_q], k[rows_k], arrays[2][rows_k], **cut)
        return (_pad_rows(out, q0, q.shape[0], q),
                _pad_rows(lse, q0, q.shape[0], axis=1, value=-math.inf))
    dout, q, k, v, out, lse = arrays    # backward -> dq, dk, dv
    dq, dk, dv = call(dout[rows_q], q[rows_q], k[rows_k], v[rows_k], out[rows_q],
                      lse[:, rows_q], **cut)
    return (_pad_rows(dq, q0, q.shape[0], q), _pad_rows(dk, k0, k.shape[0], k),
            _pad_rows(dv, k0, k.shape[0], v))


def _pad_rows(x, before, n, like=None, axis=0, value=0.0):
    """x grown along axis to n, `before` new entries ahead of it and the rest after, all
    value; laid out as orchard_ops lays out a result of `like` (None: C order, lse's)."""
    shape = x.shape[:axis] + (n,) + x.shape[axis + 1:]
    grown = x.new_empty(shape) if like is None else _empty_like_layout(shape, like, x.dtype)
    grown.fill_(value).narrow(axis, before, x.shape[axis]).copy_(x)
    return grown


# ----------------------------------------------------------------------------- custom ops

_OPTIONS_SCHEMA = ", ".join("%s %s" % (_SCHEMA_TYPES[f], f) for f in _Options._fields)
torch.library.define("orchard::attention_fwd",
                     "(Tensor q, Tensor k, Tensor v, %s) -> (Tensor, Tensor)" % _OPTIONS_SCHEMA)
torch.library.define("orchard::attention_bwd",
                     "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, %s) "
                     "-> (Tensor, Tensor, Tensor)" % _OPTIONS_SCHEMA)


def _as_options(options):
    """_Options from the custom ops' arguments: the window a tuple, the seed an int."""
    o = _Options(*options)
    return o._replace(window=tuple(o.window), seed=0 if o.seed is None else int(o.seed))


def _op_arguments(opts):
    """_Options as the custom ops' arguments (seed None or a tensor)."""
    return opts._replace(seed=opts.seed if isinstance(opts.seed, torch.Tensor) else None)


def _layout_order(like):
    """The memory order of like's axes, outermost first, that orchard_ops gives an output laid
    out as like (csrc/problem.c or_new_output): the leading axes as torch's empty_like orders
    them (by stride, a smaller size inner at equal strides, an axis of stride 0 kept in place),
    the last innermost; C order where like's last axis is not contiguous (orchard_ops reads a
    C-order copy of it, and lays the output out as that copy)."""
    n = like.dim()
    if like.shape[-1] > 1 and like.stride(-1) != 1:
        return list(range(n))

    def inner_first(a, b):      # 1: b goes inside a; -1: outside; 0: either
        sa, sb = abs(like.stride(a)), abs(like.stride(b))
        if sa == 0 or sb == 0:
            return 0
        return (sa > sb) - (sa < sb) if sa != sb else int(like.shape[a] > like.shape[b])

    inward = list(range(n - 2, -1, -1))
    for i in range(1, n - 1):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = inner_first(inward[d0], inward[d1])
            if c < 0:
                break
            if c > 0:
                inward[d0], inward[d1] = inward[d1], inward[d0]
                d1 = d0
    return inward[::-1] + [n - 1]


def _empty_like_layout(shape, like, dtype):
    return torch.empty_permuted(shape, _layout_order(like), dtype=dtype, device=like.device)


def _in_layout(t, like):
    """t itself when its strides are those _empty_like_layout gives (what the traced graph
    assumes), else a copy that has them (a size-1 axis may carry other strides)."""
    strides, step = [0] * t.dim(), 1
    for axis in reversed(_layout_order(like)):     # torch's contiguous strides, permuted
        strides[axis] = step
        step *= max(t.shape[axis], 1)
    if t.stride() == tuple(strides):
        return t
    return _empty_like_layout(t.shape, like, t.dtype).copy_(t)


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.impl("orchard::attention_fwd", "cpu")
def _fwd(q, k, v, *options):
    out, lse = ops_call(orchard_ops.flash_attn_fwd, orchard_ops.flash_attn_varlen_fwd,
                        _as_options(options), q, k, v)
    return _in_layout(out, q), lse


@torch.library.register_fake("orchard::attention_fwd")
def _fwd_fake(q, k, v, *options):
    o = _Options(*options)
    out = _empty_like_layout(q.shape[:-1] + v.shape[-1:], q, q.dtype)
    if o.cu_seqlens_q is not None:
        lse_shape = (q.shape[1], q.shape[0])
    elif o.seqlen_first:
        lse_shape = q.shape[:-3] + (q.shape[-2], q.shape[-3])
    else:
        lse_shape = q.shape[:-1]
    return out, q.new_empty(lse_shape, dtype=_lse_dtype(q))


@torch.library.impl("orchard::attention_bwd", "cpu")
def _bwd(dout, q, k, v, out, lse, *options):
    grads = ops_call(orchard_ops.flash_attn_bwd, orchard_ops.flash_attn_varlen_bwd,
                     _as_options(options), dout, q, k, v, out, lse)
    return tuple(_in_layout(g, x) for g, x in zip(grads, (q, k, v)))


@torch.library.register_fake("orchard::attention_bwd")
def _bwd_fake(dout, q, k, v, out, lse, *options):
    return tuple(_empty_like_layout(x.shape, x, x.dtype) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse = output
    # tensors among the options (slopes, cu_seqlens) go through save_for_backward too
    ctx.tensor_options = [i for i, x in enumerate(options) if isinstance(x, torch.Tensor)]
    ctx.options = [None if isinstance(x, torch.Tensor) else x for x in options]
    ctx.save_for_backward(q, k, v, out, lse, *(options[i] for i in ctx.tensor_options))
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    refuse_second_derivative()
    refuse_batched(dout)
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    options = list(ctx.options)
    for i, t in zip(ctx.tensor_options, tensors):
        options[i] = t
    o = _Options(*options)
    cache = [f for f in ("seqused_k", "leftpad_k", "block_table") if getattr(o, f) is not None]
    if cache:
        # as FlashAttention-2's flash_attn_with_kvcache, which has no backward either
        raise NotImplementedError(
            "orchard attention: no backward for a call over a KV cache (%s given): its "
            "forward is for inference; run it under torch.no_grad()" % ", ".join(cache))
    dq, dk, dv = torch.ops.orchard.attention_bwd(dout, q, k, v, out, lse, *options)
    return (dq, dk, dv) + (None,) * len(options)


torch.library.register_autograd("orchard::attention_fwd", _backward, setup_context=_setup_context)


# orchard_ops.dropout_mask as an op too, so that torch.compile traces a call returning S_dmask
# whole (as FlashAttention-2's), its seed drawn in the graph (a tensor there)
torch.library.define("orchard::dropout_mask",
                     "(int[] q_shape, int[] k_shape, float dropout_p, Tensor seed) -> Tensor")


@torch.library.impl("orchard::dropout_mask", "cpu")
def _dropout_mask(q_shape, k_shape, dropout_p, seed):
    return torch.from_numpy(orchard_ops.dropout_mask(
        tuple(q_shape), tuple(k_shape), dropout_p, int(seed)))


@torch.library.register_fake("orchard::dropout_mask")
def _dropout_mask_fake(q_shape, k_shape, dropout_p, seed):
    return torch.empty(tuple(q_shape[:-1]) + (k_shape[-2],), dtype=torch.bool)


def traced(q, k, v, opts):
    """(out, lse) through orchard::attention_fwd, differentiable in q, k, v: the call that
    torch.compile records."""
    # The ops have no forward derivative, and under forward-mode AD (torch.func.jvp, dual
    # tensors) torch would give their results a tangent of 0, silently
    if forward_ad._current_level >= 0:
        refuse("forward-mode AD (torch.func.jvp, dual tensors)")
    if opts.device is not None and not isinstance(opts.device, str):    # the schema's str?
        raise TypeError("orchard attention: 'device' must be a str or None, not %s"
                        % type(opts.device).__name__)
    return torch.ops.orchard.attention_fwd(q, k, v, *_op_arguments(opts))
