"""PyTorch integration: orchard attention as an autograd Function, and routing of a model's
scaled_dot_product_attention calls to it.

orchard_ops reads and writes host memory, so this works on CPU tensors of float16, bfloat16,
float32 and float64: it reads them in place (DLPack) and returns its results as tensors, with
no copy either way. _attention is the one path from torch to orchard_ops; orchard.flash_attn
uses it too. While torch records a graph (torch.compile, a torch dispatch mode: _recording),
that path is orchard.attention_op's custom ops, one graph node each way.
"""
import collections
import contextlib
import inspect
import math
import numbers
import sys
import threading

import numpy

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch._C._functorch import peek_interpreter_stack
from torch.overrides import TorchFunctionMode

import orchard_ops
from orchard import attention_op
from orchard.attention_op import _Options, ops_call

_ROUTABLE_DTYPES = (torch.float16, torch.float32, torch.float64, torch.bfloat16)
_MAX_HEAD_DIM = orchard_ops.build_info()["max_head_dim"]


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _largest_option(dtype):
    """The largest magnitude orchard_ops takes for a scale, softcap or ALiBi slope at operands
    of dtype: its kernels compute in float32 for every dtype but float64."""
    return sys.float_info.max if dtype == torch.float64 else _FLOAT32_MAX


def _recording():
    """Whether torch records a graph of its operations: torch.compile traces, or a torch
    dispatch mode is active (make_fx, torch.export, a fake tensor mode, a user's mode). orchard
    is then its custom op (orchard.attention_op), a node of the graph: its kernels, called
    directly, would run unseen, and the graph would hold this call's result as a constant."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def _tracing():
    """Whether torch traces with tensors whose values cannot be read where orchard's checks
    would read them (torch.compile, make_fx, fake tensors, torch.export): the checks are then
    the graph's, when it runs. A dispatch mode over real tensors (FlopCounterMode, a user's)
    records but does not trace: orchard checks values there as in eager mode."""
    return (torch.compiler.is_compiling()
            or any(torch._C._get_dispatch_mode(key) is not None
                   for key in (torch._C._TorchDispatchModeKey.FAKE,
                               torch._C._TorchDispatchModeKey.PROXY)))


def _seed(dropout_p):
    """The dropout seed of one call, drawn from torch's default generator so that
    torch.manual_seed reproduces the mask."""
    if dropout_p == 0.0:
        return 0
    seed = torch.randint(0, 2**63 - 1, (), dtype=torch.int64)
    # recorded, the draw stays in the graph (int() would break it or make it a constant;
    # orchard.attention_op reads it)
    return seed if _recording() else int(seed)


def _transform_in_use(*tensors):
    """What keeps orchard from these tensors, or None: a torch.func transform (vmap, grad,
    jacrev, jvp), whose tensors are wrappers with no memory of their own, or forward-mode AD,
    whose tangents orchard's kernels would drop (a jvp of 0, silently)."""
    if peek_interpreter_stack() is not None:
        return "a torch.func transform (vmap, grad, jacrev, jvp)"
    if forward_ad._current_level >= 0 and any(
            forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        return "forward-mode AD (dual tensors)"
    return None


def _refuse_transforms(*tensors):
    why = _transform_in_use(*tensors)
    if why:
        attention_op.refuse(why)


def _forward(q, k, v, opts, **new):
    """(out, lse) by orchard_ops without autograd's bookkeeping; while torch records, its
    custom op (differentiable: one graph node each way, the gradient's included). new:
    k_new and v_new, written into k and v by the call; never given while torch records (the
    callers write them there: a graph would not see orchard's write)."""
    if not torch.compiler.is_compiling():   # (Dynamo handles torch.func itself)
        _refuse_transforms(q, k, v, *new.values())     # (the new keys' tangents too)
    if _recording():
        return attention_op.traced(q, k, v, opts)
    return ops_call(orchard_ops.flash_attn_fwd, orchard_ops.flash_attn_varlen_fwd, opts, q, k, v,
                    **new)


class _FlashAttention(torch.autograd.Function):
    """(out, lse) of orchard attention with every option of _Options; lse has no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, opts):
        # _attention has refused transforms before apply: the call itself, not _forward
        out, lse = ops_call(orchard_ops.flash_attn_fwd, orchard_ops.flash_attn_varlen_fwd, opts,
                            q, k, v)
        # the options' tensors (cu_seqlens, slopes) are saved too: written in place before the
        # backward, they raise as q, k and v do (the backward read the new offsets, silently);
        # so is a dropout seed, as a tensor, which compiled autograd reads without guarding on
        # its value (an int: a recompile at every step)
        if opts.seed:
            opts = opts._replace(seed=torch.tensor(opts.seed))
        ctx.tensor_options = [f for f, x in zip(opts._fields, opts) if isinstance(x, torch.Tensor)]
        ctx.save_for_backward(q, k, v, out, lse, *(getattr(opts, f) for f in ctx.tensor_options))
        ctx.opts = opts._replace(**dict.fromkeys(ctx.tensor_options))
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        attention_op.refuse_second_derivative()
        attention_op.refuse_batched(dout)
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        opts = ctx.opts._replace(**dict(zip(ctx.tensor_options, tensors)))
        # autograd may hand a lazily negated view (the gradient through a complex conj),
        # which DLPack does not carry: resolved here, as the user cannot
        dout = dout.resolve_neg()
        if torch.compiler.is_compiling():   # compiled autograd traces this backward
            dq, dk, dv = torch.ops.orchard.attention_bwd(dout, q, k, v, out, lse,
                                                         *attention_op._op_arguments(opts))
        else:
            dq, dk, dv = ops_call(orchard_ops.flash_attn_bwd, orchard_ops.flash_attn_varlen_bwd,
                                  opts._replace(seed=int(opts.seed)), dout, q, k, v, out, lse)
        return dq, dk, dv, None


def _attention(q, k, v, opts):
    """(out, lse) by orchard, differentiable in q, k, v: the one way from torch to orchard_ops."""
    if torch.jit.is_tracing():  # a trace would hold this call's result as a constant
        raise RuntimeError("orchard attention cannot be traced by torch.jit.trace: its kernels "
                           "run outside torch's graph, so the trace would replay this call's "
                           "result for every input; use torch.compile or eager mode")
    # a lazily negated view (x.conj().imag), which DLPack does not carry, is resolved as
    # torch's kernels resolve it (orchard_ops would refuse it)
    q, k, v = q.resolve_neg(), k.resolve_neg(), v.resolve_neg()
    if (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
            and not _recording()):
        _refuse_transforms(q, k, v)     # before apply, which fails on them in torch's words
        return _FlashAttention.apply(q, k, v, opts)
    # No graph to record: autograd's bookkeeping (about 7 us a call) is skipped.
    return _forward(q, k, v, opts)


def _dropout_keep(q_shape, k_shape, dropout_p, seed):
    """orchard's keep-mask (bool tensor q_shape[:-2] + (Nq, Nk)) for these shapes and seed (an
    int, or a tensor drawn in a traced graph)."""
    if not isinstance(seed, torch.Tensor):
        seed = torch.tensor(seed, dtype=torch.int64)
    return torch.ops.orchard.dropout_mask(list(q_shape), list(k_shape), dropout_p, seed)


def _fail(fn, name, why, error=ValueError):
    raise error("%s: '%s' %s" % (fn, name, why))


def _number(fn, name, x):
    """x, a real number (Python's or NumPy's), as a float; else TypeError naming it."""
    if type(x) is float:    # the common case, first: the ABC checks take 0.7 us more
        return x
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        _fail(fn, name, "must be a number, got %r" % (x,), TypeError)
    return float(x)


def _flag(fn, name, x):
    """x, a bool (Python's or NumPy's, or the int 0 or 1), as a bool; else TypeError naming it
    (truthiness would read the string "False" as true)."""
    if x is True or x is False:
        return x
    if not (isinstance(x, (bool, numpy.bool_)) or (isinstance(x, numbers.Integral)
                                                    and x in (0, 1))):
        _fail(fn, name, "must be a bool, got %r" % (x,), TypeError)
    return bool(x)


def _check_device(fn, device):
    """TypeError/ValueError naming fn's 'device' unless orchard_ops resolves it (not the
    kernel call's name, which its own check would give)."""
    # traced, orchard_ops checks the device when the graph runs (the C call would break it)
    if device is not None and not torch.compiler.is_compiling():
        try:
            orchard_ops.resolve_device(device)
        except (TypeError, ValueError) as e:
            raise type(e)("%s: %s" % (fn, str(e).replace("resolve_device(): ", ""))) from None


def _check_tensors(fn, **tensors):
    """TypeError/ValueError naming the argument unless every value is a dense CPU tensor of
    one floating dtype that orchard computes."""
    dtype = None
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError("%s: '%s' must be a torch.Tensor, got %s" % (fn, name, type(t).__name__))
        if not t.is_cpu or t.layout != torch.strided or t.is_nested:
            raise ValueError("%s: '%s' is a %s%s tensor on %s: orchard reads host memory, pass "
                             "dense CPU tensors" % (fn, name, "nested " if t.is_nested else "",
                                                    t.layout, t.device))
        if dtype is None:
            if t.dtype not in _ROUTABLE_DTYPES:
                raise TypeError("%s: '%s' has dtype %s; orchard takes float16, bfloat16, "
                                "float32 and float64" % (fn, name, t.dtype))
            dtype = t.dtype
        elif t.dtype != dtype:
            raise TypeError("%s: '%s' has dtype %s, '%s' has %s: pass one dtype"
                            % (fn, name, t.dtype, next(iter(tensors)), dtype))


def flash_attention(q, k, v, causal=False, dropout_p=0.0, scale=None, *, device=None):
    """softmax(scale * q k^T [+ causal mask]) v with dropout, forward and backward by orchard.

    q (..., Nq, D), k (..., Nk, D), v (..., Nk, Dv); 4-D (B, H, N, D) inputs may have fewer
    key/value heads (GQA). causal is bottom-right aligned (FlashAttention >= 2.1); for Nq == Nk
    it is the usual causal mask. scale defaults to 1/sqrt(D). device is an orchard device id
    (None: orchard_ops.default_device()).
    """
    _check_tensors("flash_attention", q=q, k=k, v=v)
    dropout_p = _number("flash_attention", "dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        _fail("flash_attention", "dropout_p", "must be in [0, 1), got %r" % (dropout_p,))
    if scale is not None:   # (orchard_ops would read a 0-d tensor's value, dropping its gradient)
        scale = _number("flash_attention", "scale", scale)
    _check_device("flash_attention", device)
    opts = _Options(scale=scale, dropout_p=dropout_p, causal=_flag("flash_attention", "causal",
                                                                   causal),
                    seed=_seed(dropout_p), device=device)
    return _attention(q, k, v, opts)[0]


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False):
    # The signature of torch.nn.functional.scaled_dot_product_attention, to bind its calls.
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _autocast_target():
    """The dtype torch's CPU autocast runs scaled_dot_product_attention in, or None."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def _cast_by_autocast(t, target):
    """Whether CPU autocast to target casts t: a CPU floating-point tensor other than float64."""
    return (target is not None and isinstance(t, torch.Tensor) and t.device.type == "cpu"
            and t.is_floating_point() and t.dtype != torch.float64)


def _as_autocast(*tensors):
    """The tensors as torch's CPU autocast hands them to scaled_dot_product_attention, which it
    runs in the lower precision (a differentiable cast: float32 leaves get float32 gradients);
    as they are without autocast."""
    target = _autocast_target()
    return tuple(t.to(target) if _cast_by_autocast(t, target) else t for t in tensors)


def _own_handling(tensors):
    """Whether a tensor is of a subclass that handles torch's functions or operators itself
    (its __torch_function__, or a wrapper's __torch_dispatch__): its attention is its own.
    Traced, tensors are torch's fake and functional ones, which orchard's custom op takes."""
    return not _recording() and any(
        type(t) is not torch.Tensor
        and (type(t).__torch_function__ is not torch._C._disabled_torch_function_impl
             or type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__)
        for t in tensors)


def _why_not_routable(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """None when orchard computes exactly what torch would; else the reason it cannot."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "not tensors"
    if _own_handling(tensors):
        return "a tensor subclass"
    if attn_mask is not None:
        return "attn_mask"
    if any(t.device.type != "cpu" or t.layout != torch.strided or t.is_nested for t in tensors):
        return "not a dense CPU tensor"
    target = _autocast_target()     # the dtypes torch would compute in: autocast casts below
    dtypes = {target if _cast_by_autocast(t, target) else t.dtype for t in tensors}
    if len(dtypes) > 1 or next(iter(dtypes)) not in _ROUTABLE_DTYPES:
        return "dtype"
    if q.dim() < 2 or k.dim() != q.dim() or v.dim() != q.dim():
        return "rank"
    if not (1 <= q.shape[-1] <= _MAX_HEAD_DIM and 1 <= v.shape[-1] <= _MAX_HEAD_DIM):
        return "head dimension"
    if k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2]:
        return "shapes"
    same_batch = q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
    gqa = (enable_gqa and q.dim() == 4 and k.shape[:2] == v.shape[:2]
           and k.shape[0] == q.shape[0] and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0)
    if not (same_batch or gqa):
        return "broadcast or head counts"
    # torch's is_causal is top-left aligned, orchard's bottom-right; they agree when Nq == Nk.
    if is_causal and q.shape[-2] != k.shape[-2]:
        return "is_causal with Nq != Nk"
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        return "dropout_p"
    # (float: NumPy would compare a float32 scale in float32, warning of float64's maximum)
    if scale is not None and (isinstance(scale, bool) or not (
            isinstance(scale, numbers.Real)
            and abs(float(scale)) <= _largest_option(dtypes.pop()))):
        return "scale"      # orchard refuses it; torch computes something
    return _traced_or_transform(q, k, v)


def _traced_or_transform(q, k, v):
    """_transform_in_use, except while torch.compile traces: then orchard is a custom op
    (orchard.attention_op), which torch's own rules cover (vmap by its per-sample fallback),
    and tracing itself would read as a transform."""
    return None if torch.compiler.is_compiling() else _transform_in_use(q, k, v)


class AttentionRouter(TorchFunctionMode):
    """While active, scaled_dot_product_attention calls that orchard can compute go to it.

    routed counts the calls orchard computed; left_to_torch counts the others by reason.
    """

    def __init__(self, device=None):
        super().__init__()
        self.device = device
        # set by unpatch_model: a wrapper of this router that another wrapper still holds
        # (accelerate's hooks wrap a patched forward) calls the forward it wrapped
        self.unpatched = False
        self.routed = 0
        self.left_to_torch = collections.Counter()
        self._depth = threading.local()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_arguments(*args, **kwargs)
            reason = _why_not_routable(q, k, v, mask, dropout_p, is_causal, scale, gqa)
            if reason is None:
                self.routed += 1
                # autocast acts below this mode, in the dispatcher: cast as it would (a call
                # left to torch gets the arguments as they were, and autocast casts them)
                q, k, v = _as_autocast(q, k, v)
                # (a bool dropout_p, which torch takes as a number, is one here too)
                return flash_attention(q, k, v, causal=is_causal, dropout_p=float(dropout_p),
                                       scale=scale, device=self.device)
            self.left_to_torch[reason] += 1
        return func(*args, **kwargs)

    def active(self):
        return getattr(self._depth, "n", 0) > 0

    def __getstate__(self):     # a copy or a pickle starts inactive in every thread
        return {k: v for k, v in self.__dict__.items() if k != "_depth"}

    def __setstate__(self, state):
        self.__dict__.update(state, _depth=threading.local())

    def __enter__(self):
        self._depth.n = getattr(self._depth, "n", 0) + 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth.n -= 1
        return super().__exit__(*exc)

    def summary(self):
        rest = ", ".join("%d %s" % (n, why) for why, n in sorted(self.left_to_torch.items()))
        return "attention calls routed to orchard: %d; left to torch: %s" % (
            self.routed, rest or "none")


def _why_not_mha(mha, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal):
    """None when orchard can compute this nn.MultiheadAttention call as torch would; else why
    not, in words a user can act on."""
    if need_weights:
        return ("need_weights=True asks for the N x N attention weights, which orchard never "
                "forms (pass need_weights=False)")
    if key_padding_mask is not None:
        return "key_padding_mask (orchard takes no masks)"
    if attn_mask is not None and not is_causal:
        return "attn_mask (orchard takes no masks; a causal one is routed with is_causal=True)"
    if is_causal and attn_mask is None:     # torch refuses it: its is_causal is only a hint
        return "is_causal=True without attn_mask"
    if mha.bias_k is not None or mha.add_zero_attn:
        return "add_bias_kv or add_zero_attn"
    tensors = (query, key, value)
    if _own_handling(tensors):
        return "a tensor subclass"
    if any(t.device.type != "cpu" or t.layout != torch.strided or t.is_nested for t in tensors):
        return "not a dense CPU tensor"
    if (query.dtype not in _ROUTABLE_DTYPES or any(t.dtype != query.dtype for t in tensors)
            or mha.out_proj.weight.dtype != query.dtype and _autocast_target() is None):
        return "dtype"
    if query.dim() not in (2, 3):
        return "rank"
    batch = 0 if mha.batch_first or query.dim() == 2 else 1
    if not (key.dim() == value.dim() == query.dim() and key.shape[:-1] == value.shape[:-1]
            and (query.dim() == 2 or query.shape[batch] == key.shape[batch])
            and (query.shape[-1], key.shape[-1], value.shape[-1])
            == (mha.embed_dim, mha.kdim, mha.vdim)):
        return "shapes (torch's forward says what is wrong)"
    if mha.head_dim > _MAX_HEAD_DIM:
        return "head dimension"
    length = lambda t: t.shape[0 if t.dim() == 3 and not mha.batch_first else -2]
    if is_causal and length(query) != length(key):
        return "is_causal with Nq != Nk"
    return _traced_or_transform(query, key, value)


def _mha_attention(mha, query, key, value, causal, device):
    """nn.MultiheadAttention's computation with orchard's attention in the middle: the input
    projections, attention per head, the output projection; torch's layouts in and out."""
    batched = query.dim() == 3
    if not batched:
        query, key, value = (t.unsqueeze(0) for t in (query, key, value))
    elif not mha.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    if mha._qkv_same_embed_dim:
        weights = mha.in_proj_weight.chunk(3)
    else:
        weights = (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
    biases = (None,) * 3 if mha.in_proj_bias is None else mha.in_proj_bias.chunk(3)
    heads = []
    for x, w, b in zip((query, key, value), weights, biases):
        y = F.linear(x, w, b)
        heads.append(y.view(y.shape[0], y.shape[1], mha.num_heads, mha.head_dim).transpose(1, 2))
    out = flash_attention(*heads, causal=causal,
                          dropout_p=mha.dropout if mha.training else 0.0, device=device)
    out = out.transpose(1, 2).reshape(query.shape[0], query.shape[1], mha.embed_dim)
    out = F.linear(out, mha.out_proj.weight, mha.out_proj.bias)
    if not batched:
        return out.squeeze(0)
    return out if mha.batch_first else out.transpose(0, 1)


class _RoutedForward:
    """A module's forward while patch_model routes it: the forward it had (its class's, or one
    set on the instance before, kept for unpatch_model) run with the router active; for an
    nn.MultiheadAttention (and so the Transformer layers built on it), whose attention torch
    computes inside F.multi_head_attention_forward where a TorchFunctionMode cannot see the
    scaled_dot_product_attention call, the attention computed by orchard where it can, or left
    to torch with the module's name and the reason. An object, not a closure, so that
    copy.deepcopy and pickle of a patched model work and a copy runs on its own weights."""

    def __init__(self, module, name, router, previous):
        self.module, self.name, self.router, self.previous = module, name, router, previous

    def original(self, *args, **kwargs):
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    @property
    def __code__(self):     # what torch.export reads off a root module's forward
        forward = self.previous or type(self.module).forward
        return getattr(forward, "func", forward).__code__   # a partial's (accelerate's hooks)

    @property
    def __signature__(self):    # what transformers and Trainer read off model.forward
        if self.previous is not None:
            return inspect.signature(self.previous)
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def __call__(self, *args, **kwargs):
        if self.router.unpatched:
            return self.original(*args, **kwargs)
        if isinstance(self.module, _FAST_PATHS) and any(
                isinstance(a, torch.Tensor) and a.is_nested for a in (*args, *kwargs.values())):
            # orchard reads no nested tensor, and these modules take them only on their fast
            # paths, which any TorchFunctionMode (the router) turns off
            with self.router_off():
                return self.original(*args, **kwargs)
        # nn.MultiheadAttention's own forward only: a subclass's or an instance's (a hook's)
        # forward computes something else (torch.ao's quantizable MHA, a scaled output), and
        # ran as stock MHA, silently
        stock = (self.previous is None
                 and type(self.module).forward is torch.nn.MultiheadAttention.forward)
        forward = self.mha if stock else self.original
        if self.router.active():
            return forward(*args, **kwargs)
        with self.router:
            return forward(*args, **kwargs)

    def router_off(self):
        """A context without the router's mode: it is popped where it is active and the
        innermost mode (another mode above it is left as it is)."""
        depth = torch._C._len_torch_function_stack()
        if (self.router.active() and depth
                and torch._C._get_function_stack_at(depth - 1) is self.router):
            return torch.overrides._pop_mode_temporarily()
        return contextlib.nullcontext()

    def mha(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
            average_attn_weights=True, is_causal=False):
        reason = _why_not_mha(self.module, query, key, value, key_padding_mask, need_weights,
                              attn_mask, is_causal)
        if reason is not None:
            self.router.left_to_torch["%s (nn.MultiheadAttention): %s" % (self.name, reason)] += 1
            return self.original(query, key, value, key_padding_mask, need_weights, attn_mask,
                                 average_attn_weights, is_causal)
        self.router.routed += 1
        return _mha_attention(self.module, query, key, value, is_causal, self.router.device), None


# The modules whose fast paths (eval mode, no gradients) take nested tensors.
_FAST_PATHS = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer,
               torch.nn.TransformerEncoder)


def _check_module(fn, model):
    if not isinstance(model, torch.nn.Module):
        _fail(fn, "model", "must be a torch.nn.Module, got %s" % type(model).__name__, TypeError)


def patch_model(model, device=None):
    """Route model's scaled_dot_product_attention calls, and the attention of its
    nn.MultiheadAttention modules (nn.TransformerEncoderLayer, ...), to orchard; returns the
    router, whose summary() names each call left to torch and why.

    Every submodule's forward is wrapped, not only the model's, so that activation
    checkpointing, which re-runs a block inside backward, recomputes through orchard too.
    The routing is per model and per thread: other models and threads are not affected.
    Patching a patched model again returns its router, on the device this call names (None:
    orchard's default). unpatch_model(model) undoes it.
    """
    _check_module("patch_model", model)
    if device is not None and not isinstance(device, str):
        _fail("patch_model", "device", "must be a str or None, got %r" % (device,), TypeError)
    try:    # any name orchard's calls take: "opencl", "opencl:NAME", as flash_attention
        if device not in (None, "auto"):    # (those follow ORCHARD_DEVICE at each call)
            orchard_ops.resolve_device(device)
    except ValueError:
        _fail("patch_model", "device", "%r is not an available device (available: %s)"
              % (device, [d["id"] for d in orchard_ops.devices()]))
    if getattr(model, "orchard_router", None) is not None:
        model.orchard_router.device = device
        return model.orchard_router
    router = AttentionRouter(device)
    for name, module in model.named_modules():
        module.forward = _RoutedForward(module, name or "the model", router,
                                        module.__dict__.get("forward"))
    model.orchard_router = router
    return router


def unpatch_model(model):
    """Undoes patch_model: each module's forward is what it was before (one set on the
    instance stays, as do the routed forwards of a submodule patched on its own, whichever
    was patched first)."""
    _check_module("unpatch_model", model)
    router = model.__dict__.pop("orchard_router", None)
    if router is not None:
        router.unpatched = True
    for module in model.modules():
        outer, routed = None, module.__dict__.get("forward")
        while (isinstance(routed, _RoutedForward) and router is not None
               and routed.router is not router):
            outer, routed = routed, routed.previous     # another model's, patched after
        if not isinstance(routed, _RoutedForward):
            continue
        if outer is not None:
            outer.previous = routed.previous
        elif routed.previous is None:
            del module.forward
        else:
            module.forward = routed.previous
