"""orchard.torch: the autograd Function and the routing of a model's SDPA calls."""
import math

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from orchard.model import GPT, GPTConfig  # noqa: E402
import orchard.torch  # noqa: E402
import orchard_ops  # noqa: E402
from orchard.torch import AttentionRouter, flash_attention, patch_model, unpatch_model  # noqa: E402


class SDPAModule(torch.nn.Module):
    """A model whose forward is one scaled_dot_product_attention call."""

    def __init__(self, **sdpa_kwargs):
        super().__init__()
        self.sdpa_kwargs = sdpa_kwargs

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **self.sdpa_kwargs)


def qkv(shape_q, shape_kv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_()
    return make(shape_q), make(shape_kv), make(shape_kv)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64(causal):
    q, k, v = qkv((2, 4, 7, 8), (2, 2, 9, 8))  # GQA, Nq != Nk
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attention(q, k, v, causal=causal, scale=0.3), (q, k, v))


def test_gradcheck_with_dropout():
    q, k, v = qkv((1, 2, 6, 4), (1, 2, 6, 4))

    def f(q, k, v):
        torch.manual_seed(7)  # the same mask on every evaluation
        return flash_attention(q, k, v, causal=True, dropout_p=0.25)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_matches_torch_sdpa():
    q, k, v = qkv((2, 4, 33, 16), (2, 4, 33, 16), torch.float32)
    ours = flash_attention(q, k, v, causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    g1 = torch.autograd.grad(ours.sum(), (q, k, v))
    g2 = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_dropout_follows_torch_manual_seed():
    q, k, v = qkv((1, 2, 16, 8), (1, 2, 16, 8), torch.float32)
    runs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        runs.append(flash_attention(q, k, v, dropout_p=0.5))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_bfloat16_tensors():
    q, k, v = qkv((1, 2, 16, 8), (1, 2, 16, 8), torch.bfloat16)
    out = flash_attention(q, k, v, causal=True)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and q.grad.dtype == torch.bfloat16
    ref = flash_attention(*(t.detach().float() for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_rejects_what_it_cannot_compute():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match="'k'"):
        flash_attention(q, q.to(torch.int32), q)
    with pytest.raises(TypeError):
        flash_attention(q, [1], q)
    # truthiness would read "False" as causal; a string is no probability
    for causal in ("False", 2, None):
        with pytest.raises(TypeError, match="'causal' must be a bool, got %r" % (causal,)):
            flash_attention(q, q, q, causal=causal)
    with pytest.raises(TypeError, match="'dropout_p' must be a number, got '0.5'"):
        flash_attention(q, q, q, dropout_p="0.5")
    with pytest.raises(ValueError, match=r"flash_attention: 'dropout_p' must be in \[0, 1\)"):
        flash_attention(q, q, q, dropout_p=1.0)
    import numpy as np
    for causal in (np.bool_(True), 1):
        torch.testing.assert_close(flash_attention(q, q, q, causal=causal),
                                   flash_attention(q, q, q, causal=True), atol=0, rtol=0)


def test_lazily_negated_tensors_are_resolved_as_torch_resolves_them():
    """torch's DLPack export drops a tensor's negative bit (a view such as z.conj().imag):
    orchard_ops refuses one (read as it lies, its values would have the wrong sign); the torch
    layer resolves it, as torch's kernels do (it had passed the refusal on, naming
    flash_attn_fwd()), gradients included."""
    z = torch.randn(1, 2, 5, 4, dtype=torch.complex64)
    q, k = z.conj().imag, torch.randn(1, 2, 5, 4)
    assert q.is_neg()
    with pytest.raises(ValueError, match="'q' is a torch tensor with its negative bit set.*"
                                         "resolve_neg"):
        orchard_ops.flash_attn_fwd(q, k, k)
    torch.testing.assert_close(flash_attention(q, k, k),
                               F.scaled_dot_product_attention(q.resolve_neg(), k, k))
    k = k.requires_grad_()
    grads = [torch.autograd.grad(f(k._neg_view(), k, k).square().sum(), k)[0]
             for f in (flash_attention, F.scaled_dot_product_attention)]
    torch.testing.assert_close(*grads)


def test_second_derivatives_are_refused_not_wrong():
    """A backward with create_graph=True (a gradient penalty) raises: its gradients would
    have no graph, and the second derivative would silently miss orchard's part."""
    q, k, v = qkv((1, 2, 3, 4), (1, 2, 3, 4))
    out = flash_attention(q, k, v)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    out = flash_attention(q, k, v)
    torch.autograd.grad(out.sum(), q)       # first derivatives as usual


def test_patching_again_switches_the_device_and_bad_devices_are_refused_at_once():
    from conftest import OPENCL_IDS

    model = torch.nn.Module()
    router = patch_model(model)
    for device in OPENCL_IDS[:1] + ["cpu", None]:
        assert patch_model(model, device=device) is router and router.device == device
    with pytest.raises(ValueError, match="patch_model: 'device' 'opencl:99' is not an "
                                         "available device"):
        patch_model(torch.nn.Module(), device="opencl:99")
    with pytest.raises(TypeError, match="patch_model: 'device' must be a str"):
        patch_model(model, device=0)
    assert router.device is None
    unpatch_model(model)
    for fn in (patch_model, unpatch_model):
        with pytest.raises(TypeError, match="%s: 'model' must be a torch.nn.Module, got "
                                            "NoneType" % fn.__name__):
            fn(None)


def test_patch_model_takes_every_device_name_flash_attention_takes():
    from conftest import OPENCL_IDS

    if not OPENCL_IDS:
        pytest.skip("no OpenCL device")
    name = [d for d in orchard_ops.devices() if d["id"] == OPENCL_IDS[0]][0]["name"]
    q, k, v = qkv((1, 2, 5, 8), (1, 2, 5, 8), torch.float32)
    model = SDPAModule()
    for device in ("opencl", "opencl:" + name.split()[0]):
        router = patch_model(model, device=device)
        torch.testing.assert_close(model(q, k, v), flash_attention(q, k, v, device=device))
        assert router.device == device
    assert router.routed == 2
    unpatch_model(model)


def test_a_tensor_scale_is_refused_not_read_without_its_gradient():
    q, k, v = qkv((1, 2, 4, 8), (1, 2, 4, 8))
    scale = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    for bad in (scale, torch.tensor(True)):
        with pytest.raises(TypeError, match="flash_attention: 'scale' must be a number"):
            flash_attention(q, k, v, scale=bad)


def test_a_bad_device_is_named_by_flash_attention():
    """(it was named by the kernel call, flash_attn_fwd())"""
    q, k, v = qkv((1, 2, 4, 8), (1, 2, 4, 8))
    with pytest.raises(ValueError, match="^flash_attention: 'device' 'opencl:99' is not an "):
        flash_attention(q, k, v, device="opencl:99")
    with pytest.raises(TypeError, match="^flash_attention: 'device' must be a str"):
        flash_attention(q, k, v, device=0)


def test_router_computes_lazily_negated_tensors_and_numpy_scales_without_warnings():
    import warnings

    import numpy as np

    model = SDPAModule(scale=np.float32(0.3))
    router = patch_model(model)
    q = torch.randn(1, 2, 4, 8, dtype=torch.complex128).conj().imag     # negative bit set
    k, v = torch.randn(2, 1, 2, 4, 8, dtype=torch.float64)
    assert q.is_neg()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model(q, k, v)
    assert router.routed == 1
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.3))
    unpatch_model(model)


def test_router_takes_a_bool_dropout_p_as_torch_does():
    """torch reads dropout_p=False as 0.0; routed, it was a TypeError from flash_attention."""
    model = SDPAModule(dropout_p=False)
    router = patch_model(model)
    q, k, v = qkv((1, 2, 4, 8), (1, 2, 4, 8))
    torch.testing.assert_close(model(q, k, v), F.scaled_dot_product_attention(q, k, v))
    assert router.routed == 1
    unpatch_model(model)


def test_unpatching_a_forward_wrapped_after_patching_leaves_its_calls_to_torch():
    import functools

    model = SDPAModule()
    router = patch_model(model)
    model._old_forward = model.forward      # as accelerate's hooks wrap a forward
    model.forward = functools.partial(lambda m, *a: m._old_forward(*a), model)
    q, k, v = qkv((1, 2, 4, 8), (1, 2, 4, 8))
    model(q, k, v)
    unpatch_model(model)
    model(q, k, v)
    assert router.routed == 1


def test_a_lazily_negated_gradient_is_taken():
    """The gradient through a complex conjugate reaches the backward as a view with its
    negative bit set, which DLPack cannot carry: resolved, and the gradients are torch's."""
    q = torch.randn(1, 1, 4, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 1, 4, 8, dtype=torch.complex128)
    grads = []
    for attend in (flash_attention, F.scaled_dot_product_attention):
        out = attend(q, q, q)
        (torch.complex(torch.zeros_like(out), out).conj() * w).real.sum().backward()
        grads.append(q.grad)
        q.grad = None
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # torch.jit.trace's own
def test_jit_trace_is_refused():
    """A trace would replay the traced call's output for every input (orchard's results
    enter torch as constants), so tracing raises instead."""
    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return flash_attention(q, k, v, causal=True)

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="cannot be traced by torch.jit.trace"):
        torch.jit.trace(M(), (q, q, q))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # torch.func's first use of jit
def test_func_transforms_and_forward_ad_are_refused_and_routed_to_torch():
    """Under vmap, grad, jvp or with dual tensors orchard cannot read the tensors (or would
    drop their tangents, a jvp of 0): NotImplementedError, as torch's attention gives for
    forward AD; a patched model falls back to torch there."""
    import torch.autograd.forward_ad as fwad
    from orchard.flash_attn import flash_attn_func

    q = torch.randn(3, 2, 5, 8)
    attend = lambda x: flash_attention(x, x, x)
    for call in (lambda: torch.vmap(attend)(q), lambda: torch.func.grad(
                     lambda x: attend(x).sum())(q), lambda: torch.func.jvp(attend, (q,), (q,)),
                 lambda: torch.func.jacrev(attend)(q[:1, :1, :2, :2]),
                 lambda: torch.vmap(lambda x: flash_attn_func(x, x, x))(q[:, None])):
        with pytest.raises(NotImplementedError, match="torch.func transform"):
            call()
    with fwad.dual_level():
        dual = fwad.make_dual(q, torch.ones_like(q))
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            flash_attention(dual, dual, dual)
        torch.testing.assert_close(flash_attention(q, q, q), F.scaled_dot_product_attention(
            q, q, q))     # no tangent: orchard runs
        # new keys or values with tangents, which orchard_ops' call writes into the cache:
        # refused before the write (their tangents had been dropped, a jvp of 0)
        from orchard.flash_attn import flash_attn_with_kvcache
        cache, new = torch.zeros(1, 6, 2, 8), torch.randn(1, 1, 2, 8)
        for k, v in ((fwad.make_dual(new, torch.ones_like(new)), new),
                     (new, fwad.make_dual(new, torch.ones_like(new)))):
            with pytest.raises(NotImplementedError, match="forward-mode AD"):
                flash_attn_with_kvcache(new, cache, cache.clone(), k, v, cache_seqlens=3)
            assert not cache.any()

    class M(torch.nn.Module):
        def forward(self, x):
            return F.scaled_dot_product_attention(x, x, x)

    model = M()
    router = patch_model(model)
    torch.testing.assert_close(torch.vmap(model)(q), F.scaled_dot_product_attention(q, q, q))
    assert router.left_to_torch["a torch.func transform (vmap, grad, jacrev, jvp)"] == 1
    unpatch_model(model)


def tiny_gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=64, context=24, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg))


def loss_and_grads(model, x):
    model.zero_grad()
    logits, loss = model(x, x)
    loss.backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_patched_model_matches_unpatched(checkpointing):
    model = tiny_gpt()
    model.grad_checkpointing = checkpointing
    x = torch.randint(0, 64, (3, 24), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = loss_and_grads(model, x)
    router = patch_model(model)
    logits, grads = loss_and_grads(model, x)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
    # Two layers forward, and again in backward when checkpointing recomputes them.
    assert router.routed == (4 if checkpointing else 2)
    assert not router.left_to_torch
    unpatch_model(model)
    loss_and_grads(model, x)
    assert router.routed == (4 if checkpointing else 2)


def test_routing_leaves_other_semantics_to_torch():
    class Mixed(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return (F.scaled_dot_product_attention(q, k, v, is_causal=True),
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                    F.scaled_dot_product_attention(q, k[:, :, :5], v[:, :, :5], is_causal=True),
                    F.scaled_dot_product_attention(q, k, v, scale=0.5, dropout_p=0.0),
                    F.scaled_dot_product_attention(q, k, v, scale=math.inf),
                    # finite, but not in float32, the kernels' type: orchard would refuse it
                    F.scaled_dot_product_attention(q, k, v, scale=1e39))

    q, k, v = qkv((1, 2, 8, 4), (1, 2, 8, 4), torch.float32)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    model = Mixed()
    expected = model(q, k, v, mask)
    router = patch_model(model)
    for got, want in zip(model(q, k, v, mask), expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert router.routed == 2
    assert router.left_to_torch == {"attn_mask": 1, "is_causal with Nq != Nk": 1, "scale": 2}
    assert "routed to orchard: 2" in router.summary()
    # Outside the patched model, torch's own function runs.
    F.scaled_dot_product_attention(q, k, v)
    assert router.routed == 2


def test_routed_calls_under_autocast_take_its_dtype_as_torch_does():
    """Under CPU autocast torch runs scaled_dot_product_attention in the lower precision,
    casting its inputs in the dispatcher, below the router: a routed call is cast alike, so
    float32 inputs (a layer norm's output), and q, k in float32 with v in bfloat16 (rotary
    embeddings), give what torch gives, in bfloat16, with float32 gradients for float32
    leaves; float64, which autocast leaves alone, stays float64."""
    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    model = Attend()
    router = patch_model(model)
    for dtypes in ((torch.float32,) * 3, (torch.float32, torch.float32, torch.bfloat16),
                   (torch.float64,) * 3):
        leaves = [t.to(d).detach().requires_grad_() for t, d in
                  zip(qkv((2, 4, 16, 8), (2, 4, 16, 8), seed=3), dtypes)]
        results = []
        for run in (model, Attend()):       # routed, then torch's own
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = run(*leaves)
            out.float().square().sum().backward()
            results.append((out, [t.grad.clone() for t in leaves]))
            for t in leaves:
                t.grad = None
        (out, grads), (want, want_grads) = results
        assert out.dtype == want.dtype == (torch.float64 if dtypes[0] == torch.float64
                                           else torch.bfloat16), dtypes
        tol = 1e-10 if out.dtype == torch.float64 else 2e-2
        torch.testing.assert_close(out, want, atol=tol, rtol=tol)
        for g, w, t in zip(grads, want_grads, leaves):
            assert g.dtype == t.dtype
            torch.testing.assert_close(g, w, atol=10 * tol, rtol=10 * tol)
    assert router.routed == 3 and not router.left_to_torch


def test_calls_left_to_torch_under_autocast_are_not_cast_by_the_router(monkeypatch):
    """A call the router leaves to torch (a mask) reaches torch as it came, and autocast casts
    it there: the router makes no copy of its own to throw away."""
    casts = []
    real = orchard.torch._as_autocast
    monkeypatch.setattr(orchard.torch, "_as_autocast", lambda *t: casts.append(t) or real(*t))
    q, k, v = qkv((1, 2, 8, 4), (1, 2, 8, 4), torch.float32, seed=4)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    with AttentionRouter() as router, torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        routed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == routed.dtype == torch.bfloat16
    assert router.left_to_torch == {"attn_mask": 1} and router.routed == 1 and len(casts) == 1


def test_patched_model_trains_with_dropout_reproducibly():
    def run():
        model = tiny_gpt(dropout=0.1)
        patch_model(model)
        torch.manual_seed(5)
        x = torch.randint(0, 64, (2, 24))
        return loss_and_grads(model, x)[0]

    torch.testing.assert_close(run(), run(), atol=0, rtol=0)


def forward_and_grads(module, *inputs, **kwargs):
    """The module's output and the gradients of a loss on it in its inputs and parameters."""
    inputs = [t.detach().requires_grad_() for t in inputs]
    out = module(*inputs, **kwargs)
    out = out[0] if isinstance(module, torch.nn.MultiheadAttention) else out
    return out, torch.autograd.grad(out.square().sum(), inputs + list(module.parameters()))


@pytest.mark.parametrize("batch_first, lengths", [(True, (2, 10)), (False, (10, 2)),
                                                  (True, (10,))])
@pytest.mark.parametrize("kv_dims", [(32, 32), (16, 24)])   # packed, separate in-projections
def test_multihead_attention_is_routed_and_matches_torch(batch_first, lengths, kv_dims):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=batch_first, kdim=kv_dims[0],
                                      vdim=kv_dims[1]).double()
    q, k, v = (torch.randn(*lengths, dim, dtype=torch.float64) for dim in (32,) + kv_dims)
    want = forward_and_grads(mha, q, k, v, need_weights=False)
    router = patch_model(mha)
    got = forward_and_grads(mha, q, k, v, need_weights=False)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert router.routed == 1 and not router.left_to_torch


def test_multihead_attention_calls_orchard_cannot_compute_are_named_in_the_summary():
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 6, 16)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    want = [mha(x, x, x)[0], mha(x, x, x, key_padding_mask=padding, need_weights=False)[0]]
    router = patch_model(mha)
    got = [mha(x, x, x)[0], mha(x, x, x, key_padding_mask=padding, need_weights=False)[0]]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert router.routed == 0
    summary = router.summary()
    assert "the model (nn.MultiheadAttention): need_weights=True" in summary
    assert "pass need_weights=False" in summary
    assert "the model (nn.MultiheadAttention): key_padding_mask" in summary
    # torch refuses is_causal without the mask it hints at: so does the patched module
    with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
        mha(x, x, x, is_causal=True, need_weights=False)
    assert "is_causal=True without attn_mask" in router.summary()


def test_patched_model_copies_pickles_and_unpatches_cleanly():
    """copy.deepcopy (an EMA or teacher copy) and pickle (torch.save of a whole model) of a
    patched model give a model that is still routed and computes with its own weights;
    unpatch_model gives back a forward the user had set on a module before patching."""
    import copy
    import io
    import inspect

    torch.manual_seed(0)
    encoder = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2,
        enable_nested_tensor=False)
    x = torch.randn(2, 10, 32)
    router = patch_model(encoder)
    want = encoder(x)
    twin = copy.deepcopy(encoder)
    torch.testing.assert_close(twin(x), want, atol=0, rtol=0)
    assert twin.orchard_router is not router and twin.orchard_router.routed == router.routed + 2
    for p in twin.parameters():
        p.data.zero_()
    assert not torch.allclose(twin(x), want)    # its own weights, not the original's
    torch.testing.assert_close(encoder(x), want, atol=0, rtol=0)
    buf = io.BytesIO()
    torch.save(encoder, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    torch.testing.assert_close(loaded(x), want, atol=0, rtol=0)
    assert loaded.orchard_router.routed == router.routed + 2
    # the signature transformers and Trainer read off forward is the module's own
    assert list(inspect.signature(encoder.forward).parameters)[0] == "src"

    layer = torch.nn.Linear(4, 4)
    own = layer.forward
    layer.forward = lambda t: own(t) * 0 + 42
    model = torch.nn.Sequential(layer)
    patch_model(model)
    assert float(model(torch.randn(1, 4))[0, 0].detach()) == 42
    unpatch_model(model)
    assert float(model(torch.randn(1, 4))[0, 0].detach()) == 42 and "forward" in layer.__dict__
    assert "forward" not in model.__dict__


@pytest.mark.parametrize("causal", [False, True])
def test_transformer_encoder_layers_are_routed_in_training_and_inference(causal):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).double()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    kw = {"mask": torch.nn.Transformer.generate_square_subsequent_mask(
        12, dtype=torch.float64), "is_causal": True} if causal else {}
    want = forward_and_grads(encoder, x, **kw)
    encoder.eval()
    with torch.no_grad():
        want_eval = encoder(x, **kw)
    encoder.train()
    router = patch_model(encoder)
    torch.testing.assert_close(forward_and_grads(encoder, x, **kw), want, atol=1e-12,
                               rtol=1e-12)
    encoder.eval()
    with torch.no_grad():      # torch's fused inference path would bypass the module
        torch.testing.assert_close(encoder(x, **kw), want_eval, atol=1e-12, rtol=1e-12)
    assert router.routed == 4 and not router.left_to_torch, router.summary()


def test_only_stock_multihead_attention_is_computed_as_stock():
    """A subclass's forward (torch.ao's quantizable MHA computes with its own projections) or
    one set on the instance before patching (an accelerate-style hook) runs as it is, its
    scaled_dot_product_attention calls routed; both ran as stock nn.MultiheadAttention,
    silently."""
    import copy
    import functools

    class Doubled(torch.nn.MultiheadAttention):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)[0] * 2, None

    def hooked(mha, *args, **kwargs):
        return torch.ones(2, 3, 8), None

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8)
    instance = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    instance.forward = functools.partial(hooked, instance)
    for module in (Doubled(8, 2, batch_first=True), instance,
                   torch.ao.nn.quantizable.MultiheadAttention(8, 2, batch_first=True)):
        want = copy.deepcopy(module).eval()(x, x, x)[0]
        patch_model(module.eval(), device="cpu")
        with torch.no_grad():
            assert torch.equal(module(x, x, x)[0], want), type(module).__name__


def test_a_batched_backward_is_refused_clearly():
    """autograd.grad(is_grads_batched=True) and a vectorized jacobian run the backward under
    vmap, whose gradients have no memory: a NotImplementedError saying so (it was
    flash_attn_bwd's "cannot be viewed as an array")."""
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    out = flash_attention(q, q, q)
    with pytest.raises(NotImplementedError, match="batched backward"):
        torch.autograd.grad(out, q, torch.randn(3, *out.shape), is_grads_batched=True)


def test_a_bool_scale_is_left_to_torch():
    """torch reads scale=True as 1.0; orchard refuses bools, so the router leaves it to torch
    (it routed the call, which then raised)."""
    class Attend(torch.nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, scale=True)

    q = torch.randn(1, 2, 4, 8)
    model = Attend()
    router = patch_model(model, device="cpu")
    torch.testing.assert_close(model(q), F.scaled_dot_product_attention(q, q, q, scale=1.0))
    assert router.routed == 0


class Halved(torch.Tensor):
    """A tensor subclass with its own attention: half of torch's."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out / 2 if func is F.scaled_dot_product_attention else out


def test_tensor_subclasses_keep_their_own_attention():
    """A subclass that handles torch's functions itself (its __torch_function__), or a wrapper
    subclass (its __torch_dispatch__: TwoTensor), is left to torch: the router computed the
    first as a plain tensor (a plain result, without the subclass's own change, silently) and
    failed on the second ("has no memory")."""
    from torch.testing._internal.two_tensor import TwoTensor

    class Attend(torch.nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q)

    x = torch.randn(1, 2, 4, 8)
    model = Attend()
    want = [model(x.as_subclass(Halved)), model(TwoTensor(x, x * 2))]
    router = patch_model(model, device="cpu")
    got = [model(x.as_subclass(Halved)), model(TwoTensor(x, x * 2))]
    for g, w in zip(got, want):
        assert type(g) is type(w)
        torch.testing.assert_close(g, w)
    assert router.routed == 0 and router.left_to_torch["a tensor subclass"] == 2
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    y = torch.randn(2, 3, 8).as_subclass(Halved)
    want = mha(y, y, y, need_weights=False)[0]
    router = patch_model(mha)
    torch.testing.assert_close(mha(y, y, y, need_weights=False)[0], want)
    assert router.routed == 0


def test_nested_tensors_take_torch_fast_paths():
    """nn.MultiheadAttention and nn.TransformerEncoderLayer take nested tensors in eval mode
    without gradients, on fast paths the router's TorchFunctionMode turned off: patched, they
    raised "does not support NestedTensor outside of its fast path"."""
    torch.manual_seed(0)
    nested = torch.nested.nested_tensor([torch.randn(5, 16), torch.randn(3, 16)])
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    model = torch.nn.Sequential(layer)
    with torch.no_grad():
        want = [mha(nested, nested, nested, need_weights=False)[0], model(nested)]
        patch_model(mha)
        patch_model(model)
        got = [mha(nested, nested, nested, need_weights=False)[0], model(nested)]
    for g, w in zip(got, want):
        assert g.is_nested
        torch.testing.assert_close(g.to_padded_tensor(0.0), w.to_padded_tensor(0.0),
                                   atol=0, rtol=0)


def test_unpatching_a_model_leaves_a_submodule_patched_on_its_own():
    """patch_model(model), patch_model(model.sub), unpatch_model(model): the submodule stays
    on its own router (unpatch_model put the model's routed forward back on it, and counted
    its calls there)."""
    class Attend(torch.nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q)

    model = torch.nn.Sequential(Attend(), Attend())
    x = torch.randn(1, 2, 4, 8)
    outer, inner = patch_model(model), patch_model(model[1])
    model(x)
    assert (outer.routed, inner.routed) == (1, 1)
    unpatch_model(model)
    model(x)
    assert (outer.routed, inner.routed) == (1, 2)
    assert model[1].forward.router is inner and model[1].forward.previous is None
    assert "forward" not in vars(model[0])


def test_multihead_attention_bad_input_gets_torch_messages():
    """Input nn.MultiheadAttention refuses (other embedding sizes, batches or dtypes) is left
    to its forward, whose message says what is wrong (routed, it failed in a reshape or a
    matrix product)."""
    mha = torch.nn.MultiheadAttention(16, 2, kdim=5, vdim=5)
    x, kv = torch.randn(7, 2, 16), torch.randn(7, 2, 5)
    cases = [((torch.randn(7, 2, 12), kv, kv), "embedding dimension of 16"),
             ((x, torch.randn(7, 2, 6), kv), "key weights shape"),
             ((x, torch.randn(7, 8, 5), torch.randn(7, 8, 5)), None),
             ((x.double(), kv.double(), kv.double()), None)]
    want = []
    for args, _ in cases:
        with pytest.raises((AssertionError, RuntimeError)) as error:
            mha(*args, need_weights=False)
        want.append(str(error.value))
    patch_model(mha)
    for (args, words), message in zip(cases, want):
        with pytest.raises((AssertionError, RuntimeError)) as error:
            mha(*args, need_weights=False)
        assert str(error.value) == message and (words is None or words in message)
