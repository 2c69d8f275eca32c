"""PyTorch integration: orchard attention as an autograd Function, and routing of a model's
scaled_dot_product_attention calls to it.

orchard_ops reads and writes host memory, so this works on CPU tensors. Its kernels take
float16/32/64; bfloat16 tensors are computed through float32 and the results cast back.
"""
import collections
import functools
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import orchard_ops

_NATIVE_DTYPES = (torch.float16, torch.float32, torch.float64)
_ROUTABLE_DTYPES = _NATIVE_DTYPES + (torch.bfloat16,)
_MAX_HEAD_DIM = orchard_ops.build_info()["max_head_dim"]


def _compute_dtype(dtype):
    return dtype if dtype in _NATIVE_DTYPES else torch.float32


def _host(t, dtype):
    # orchard_ops reads torch CPU tensors in place through NumPy's view of them; that view
    # exists only for tensors outside autograd, hence detach().
    return t.detach().to(dtype)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, dropout_p, scale, device):
        cdtype = _compute_dtype(q.dtype)
        seed = 0
        if dropout_p > 0.0:
            # Drawn from torch's default generator, so torch.manual_seed reproduces the mask.
            seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
        qc, kc, vc = (_host(t, cdtype) for t in (q, k, v))
        out, lse = orchard_ops.flash_attn_fwd(qc, kc, vc, scale, dropout_p, causal, seed=seed,
                                              device=device)
        out, lse = torch.from_numpy(out), torch.from_numpy(lse)
        ctx.save_for_backward(qc, kc, vc, out, lse)
        ctx.options = (scale, dropout_p, causal, seed, device)
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        qc, kc, vc, out, lse = ctx.saved_tensors
        scale, dropout_p, causal, seed, device = ctx.options
        grads = orchard_ops.flash_attn_bwd(_host(dout, qc.dtype), qc, kc, vc, out, lse, scale,
                                           dropout_p, causal, seed=seed, device=device)
        dq, dk, dv = (torch.from_numpy(g).to(dt) for g, dt in zip(grads, ctx.dtypes))
        return dq, dk, dv, None, None, None, None


def flash_attention(q, k, v, causal=False, dropout_p=0.0, scale=None, *, device=None):
    """softmax(scale * q k^T [+ causal mask]) v with dropout, forward and backward by orchard.

    q (..., Nq, D), k (..., Nk, D), v (..., Nk, Dv); 4-D (B, H, N, D) inputs may have fewer
    key/value heads (GQA). causal is bottom-right aligned (FlashAttention >= 2.1); for Nq == Nk
    it is the usual causal mask. scale defaults to 1/sqrt(D). device is an orchard device id
    (None: orchard_ops.default_device()).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError("'%s' must be a torch.Tensor, got %s" % (name, type(t).__name__))
        if t.device.type != "cpu":
            raise ValueError("'%s' is on %s: orchard reads host memory, pass CPU tensors"
                             % (name, t.device))
        if t.dtype not in _ROUTABLE_DTYPES:
            raise TypeError("'%s' has dtype %s; orchard takes float16, bfloat16, float32 and "
                            "float64" % (name, t.dtype))
    out, _ = _FlashAttention.apply(q, k, v, bool(causal), float(dropout_p), scale, device)
    return out


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False):
    # The signature of torch.nn.functional.scaled_dot_product_attention, to bind its calls.
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _why_not_routable(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """None when orchard computes exactly what torch would; else the reason it cannot."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "not tensors"
    if attn_mask is not None:
        return "attn_mask"
    if any(t.device.type != "cpu" or t.layout != torch.strided or t.is_nested for t in tensors):
        return "not a dense CPU tensor"
    if q.dtype not in _ROUTABLE_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
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
    return None


class AttentionRouter(TorchFunctionMode):
    """While active, scaled_dot_product_attention calls that orchard can compute go to it.

    routed counts the calls orchard computed; left_to_torch counts the others by reason.
    """

    def __init__(self, device=None):
        super().__init__()
        self.device = device
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
                return flash_attention(q, k, v, causal=is_causal, dropout_p=dropout_p,
                                       scale=scale, device=self.device)
            self.left_to_torch[reason] += 1
        return func(*args, **kwargs)

    def active(self):
        return getattr(self._depth, "n", 0) > 0

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


def _routed(forward, router):
    @functools.wraps(forward)
    def routed_forward(*args, **kwargs):
        if router.active():
            return forward(*args, **kwargs)
        with router:
            return forward(*args, **kwargs)
    return routed_forward


def patch_model(model, device=None):
    """Route model's scaled_dot_product_attention calls to orchard; returns the router.

    Every submodule's forward is wrapped, not only the model's, so that activation
    checkpointing, which re-runs a block inside backward, recomputes through orchard too.
    The routing is per model and per thread: other models and threads are not affected.
    unpatch_model(model) undoes it.
    """
    if getattr(model, "orchard_router", None) is not None:
        return model.orchard_router
    router = AttentionRouter(device)
    for module in model.modules():
        module.forward = _routed(module.forward, router)
    model.orchard_router = router
    return router


def unpatch_model(model):
    for module in model.modules():
        module.__dict__.pop("forward", None)
    model.__dict__.pop("orchard_router", None)
