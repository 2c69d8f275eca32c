"""orchard.hf: transformers models with attn_implementation="orchard" against the same models
(same weights) on transformers' own attention: sdpa, or eager where sdpa lacks the feature
(softcap). Tiny random models built from configs, no downloads. orchard_ops.stats() shows
that orchard computed the attention; a mask orchard cannot compute warns and falls back.
"""
import contextlib
import copy
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import orchard_ops  # noqa: E402
import orchard.hf as hf  # noqa: E402
from orchard.hf_causal_lm import checkpointing_name  # noqa: E402
from orchard.reference import ref_fwd  # noqa: E402
from orchard.torch import _seed  # noqa: E402
from test_py_support import run_python  # noqa: E402
from transformers import (  # noqa: E402
    Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config,
    GPT2LMHeadModel, GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM,
    MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, masking_utils)

VOCAB = 97
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=128)
# name: (model class, config, transformers' attention to compare with). Windows of 4 tokens
# and a softcap of 0.5 are small enough to change every sequence used here.
MODELS = {
    "llama-mha": (LlamaForCausalLM, LlamaConfig(num_key_value_heads=4, **SMALL), "sdpa"),
    "llama-gqa": (LlamaForCausalLM, LlamaConfig(num_key_value_heads=2, **SMALL), "sdpa"),
    "mistral-window": (MistralForCausalLM, MistralConfig(
        num_key_value_heads=2, sliding_window=4, **SMALL), "sdpa"),
    "qwen2-window": (Qwen2ForCausalLM, Qwen2Config(    # layer 0 full, layer 1 windowed
        num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=1,
        **SMALL), "sdpa"),
    "gemma2-softcap": (Gemma2ForCausalLM, Gemma2Config(
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
        attn_logit_softcapping=0.5, **SMALL), "eager"),
    "gpt2": (GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                         n_positions=128, bos_token_id=1, eos_token_id=2),
             "sdpa"),
}
LAYERS = 2


def build(name, impl, dtype=torch.float32, **changes):
    cls, config, _ = MODELS[name]
    config = copy.deepcopy(config)     # transformers records the attention in the config
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation=impl, dtype=dtype).eval()


def pair(name, dtype=torch.float32, **changes):
    """(reference model, orchard model) with the same weights."""
    ref = build(name, MODELS[name][2], dtype, **changes)
    model = build(name, "orchard", dtype, **changes)
    model.load_state_dict(ref.state_dict())
    return ref, model


def checkpointing_enable(model, reentrant):
    """Gradient checkpointing on, by the name this transformers gives it."""
    getattr(model, checkpointing_name(model) + "_enable")({"use_reentrant": reentrant})


def skip_where_attention_is_the_models_own(config):
    """Skips where this transformers computes the model's attention in its own code (Falcon's
    before its move to the attention interface: 5.20 among them), which orchard refuses as such."""
    reason = hf.unsupported_reason(config) or ""
    if "computes its attention in its own code" in reason:
        pytest.skip("this transformers' " + reason.split(",")[0])


def tokens(batch, n, seed=1):
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def padding(kind, batch=3, n=12):
    mask = torch.ones(batch, n, dtype=torch.long)
    if kind == "left":
        mask[0, :5] = 0
        mask[2, :2] = 0
    elif kind == "right":
        mask[0, 7:] = 0
        mask[1, 10:] = 0
    elif kind == "gaps":
        mask[0, 3:6] = 0
        mask[2, :2] = 0
        mask[2, 8:10] = 0
    return mask


def forward_backward(model, real, **inputs):
    """Logits at the real tokens, every parameter's gradient of a weighted sum of them, and
    orchard's counters of that forward and backward."""
    model.zero_grad()
    orchard_ops.reset_stats()
    logits = model(**inputs).logits
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    (logits * weights * real[..., None]).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return logits[real.bool()].detach(), grads, orchard_ops.stats()


def assert_close(a, b, tol=2e-5):
    """Agreement relative to b's scale: float32 orchard and torch differ by ~1e-7 here."""
    scale = max(1.0, b.abs().max().item())
    assert (a - b).abs().max().item() <= tol * scale


def assert_same_results(got, want):
    logits, grads, _ = got
    ref_logits, ref_grads, _ = want
    assert_close(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for name in grads:
        assert_close(grads[name], ref_grads[name])


@pytest.fixture
def no_fallback():
    """Any fallback warning fails the test: orchard must compute every call."""
    hf._warned.clear()      # a reason warned before would not warn again
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="orchard.hf")
        yield


@pytest.fixture
def fresh_warnings():
    """Fallback warnings are once per reason per process: forget those already given."""
    hf._warned.clear()
    yield
    hf._warned.clear()


# ----------------------------------------------------------------------------- registration


def test_register_is_idempotent_and_makes_the_name_valid():
    hf.register()
    hf.register()
    assert transformers.AttentionInterface._global_mapping["orchard"] is hf.attention_forward
    assert masking_utils.AttentionMaskInterface._global_mapping["orchard"] is hf.attention_mask
    assert build("llama-gqa", "orchard").config._attn_implementation == "orchard"


def test_orchard_imports_without_transformers():
    script = ("import sys\n"
              "sys.modules['transformers'] = None\n"
              "import orchard, orchard.flash_attn\n"
              "try:\n"
              "    import orchard.hf\n"
              "except ImportError as e:\n"
              "    print(e)\n")
    result = run_python(["-c", script])
    assert result.returncode == 0, result.stderr
    assert "pip install '.[hf]' in orchard's source tree" in result.stdout


@pytest.mark.parametrize("package, says", [
    # a dependency of its own missing, or its own check of one: the cause
    ("import orchard_missing_dependency", "orchard.hf: transformers failed to import: No "
     "module named 'orchard_missing_dependency'"),
    ("raise ImportError('needs tokenizers>=9')",
     "orchard.hf: transformers failed to import: needs tokenizers>=9"),
    # one without what orchard imports (transformers 4.x): the version to install
    ("", "orchard.hf needs transformers 5.x (pip install '.[hf]' in orchard's source tree)")])
def test_a_transformers_that_fails_to_import_is_named_as_such(tmp_path, package, says):
    """An installed transformers whose own imports fail (a missing dependency, a local file
    shadowing one) is reported with its cause, not as a transformers to install; by
    orchard.hf and by --hf-config's loader, which names the file."""
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text(package + "\n")
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama"}')
    script = ("import sys\n"
              "sys.path.insert(0, %r)\n"
              "from orchard.hf_causal_lm import HFModelError, load_hf_config\n"
              "try:\n"
              "    import orchard.hf\n"
              "except ImportError as e:\n"
              "    print(e)\n"
              "try:\n"
              "    load_hf_config(%r)\n"
              "except HFModelError as e:\n"
              "    print(e)\n" % (str(tmp_path), str(config)))
    result = run_python(["-c", script])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [says, "%s: %s" % (config, says)], result.stdout


# ----------------------------------------------------------------------------- results


@pytest.mark.parametrize("pad", ["none", "left", "right"])
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_gradients_match(name, pad, no_fallback):
    ref, model = pair(name)
    real = padding(pad)
    inputs = dict(input_ids=tokens(3, 12), attention_mask=real)
    got = forward_backward(model, real, **inputs)
    assert_same_results(got, forward_backward(ref, real, **inputs))
    stats = got[2]
    assert stats["fwd_calls"] == LAYERS and stats["bwd_calls"] == LAYERS


@pytest.mark.parametrize("name", list(MODELS))
def test_inference_with_left_padding(name, no_fallback):
    """Without gradients, left padding is read in place (one varlen call over the cache's rows,
    flash_attn_with_kvcache's cache_leftpad) instead of unpadded."""
    ref, model = pair(name)
    real = padding("left")
    inputs = dict(input_ids=tokens(3, 12), attention_mask=real)
    orchard_ops.reset_stats()
    with torch.no_grad():
        got = model(**inputs).logits
        assert orchard_ops.stats()["fwd_calls"] == LAYERS
        assert_close(got[real.bool()], ref(**inputs).logits[real.bool()])


@pytest.mark.parametrize("name", ["llama-gqa", "gpt2"])
def test_padding_between_real_tokens(name, no_fallback):
    """Without a window, any padding mask unpads onto varlen: causal order is kept."""
    ref, model = pair(name)
    real = padding("gaps")
    inputs = dict(input_ids=tokens(3, 12), attention_mask=real)
    got = forward_backward(model, real, **inputs)
    assert_same_results(got, forward_backward(ref, real, **inputs))
    assert got[2]["fwd_calls"] == LAYERS


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window", "gemma2-softcap"])
def test_packed_sequences(name, no_fallback):
    """Sequences packed in rows, marked by position_ids restarting at 0 (no cache, as in
    training): each attends only to itself, as if it ran alone."""
    ref, model = pair(name)
    ids = tokens(2, 12)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6],
                              [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]])
    real = torch.ones(2, 12)
    inputs = dict(input_ids=ids, position_ids=positions, use_cache=False)
    got = forward_backward(model, real, **inputs)
    assert_same_results(got, forward_backward(ref, real, **inputs))
    assert got[2]["fwd_calls"] == LAYERS
    logits = got[0].view(2, 12, -1)
    with torch.no_grad():
        alone = model(input_ids=ids[:1, 5:], use_cache=False).logits
        # the same packing given as FlashAttention-style cu_seq_lens keywords (which need
        # no use_cache=False)
        cu = torch.tensor([0, 5, 12, 15, 24], dtype=torch.int32)
        flat = model(input_ids=ids.view(1, 24), position_ids=positions.view(1, 24),
                     cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9).logits
    assert_close(alone[0], logits[0, 5:])
    assert_close(flat.view(2, 12, -1), logits)
    # cu_seq_lens that leave tokens of the batch out (the second row here) are refused: its
    # tokens were taken as padding, outputs 0, silently
    for short in ([0, 5, 12], [3, 5, 12, 15, 24]):
        with pytest.raises(ValueError, match=r"'cu_seq_lens_q' must run from 0 to the batch's "
                                             r"24 tokens .*, got \[%d, " % short[0]):
            model(input_ids=ids.view(1, 24), position_ids=positions.view(1, 24),
                  cu_seq_lens_q=torch.tensor(short, dtype=torch.int32),
                  cu_seq_lens_k=torch.tensor(short, dtype=torch.int32), max_length_q=9,
                  max_length_k=9)
    # a max_length below the longest sequence (9), named as passed
    for side, lengths in (("q", (8, 9)), ("k", (9, 4))):
        with pytest.raises(ValueError, match=r"orchard.hf: 'max_length_%s' must be at least 9, "
                                             r"the longest sequence of 'cu_seq_lens_%s', got "
                                             r"%d" % (side, side, min(lengths))):
            model(input_ids=ids.view(1, 24), position_ids=positions.view(1, 24),
                  cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=lengths[0],
                  max_length_k=lengths[1])
    # offsets that decrease are refused as such, whatever the lengths given
    with pytest.raises(ValueError, match="'cu_seqlens_q' .*never decrease"):
        backwards = torch.tensor([0, 15, 12, 24], dtype=torch.int32)
        model(input_ids=ids.view(1, 24), position_ids=positions.view(1, 24),
              cu_seq_lens_q=backwards, cu_seq_lens_k=cu, max_length_q=12, max_length_k=9)


@pytest.mark.parametrize("reentrant, saved", [(True, "kept"), (True, "copied"),
                                              (False, "kept")])
def test_packed_sequences_under_gradient_checkpointing(reentrant, saved, no_fallback):
    """A reentrant checkpoint recomputes each layer on detached copies of its arguments (GPT-2
    passes its mask positionally), and a saved tensors hook that copies them (save_on_cpu) on
    copies in other memory: without orchard's marks. The packed ids were read as a padding
    mask there, gradients off by up to 82 %, silently."""
    ref, model = pair("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    for m in (ref, model):
        m.train()       # (transformers checkpoints in training only)
        checkpointing_enable(m, reentrant)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]])
    real = torch.ones(1, 16)
    inputs = dict(input_ids=tokens(1, 16), position_ids=positions, use_cache=False)
    hooks = (torch.autograd.graph.saved_tensors_hooks(torch.clone, lambda t: t)
             if saved == "copied" else contextlib.nullcontext())
    with hooks:
        got = forward_backward(model, real, **inputs)
    assert_same_results(got, forward_backward(ref, real, **inputs))
    assert got[2]["bwd_calls"] == LAYERS


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_generate_matches(name, cache, no_fallback):
    """Left-padded prompts, then one decode step per token over transformers' KV cache
    (past the sliding windows): the same tokens as the reference attention."""
    ref, model = pair(name)
    ids, real = tokens(3, 6), padding("left", 3, 6)
    kw = dict(attention_mask=real, max_new_tokens=10, do_sample=False, pad_token_id=0,
              cache_implementation="static" if cache == "static" else None)
    want = ref.generate(ids, **kw)
    orchard_ops.reset_stats()
    got = model.generate(ids, **kw)
    stats = orchard_ops.stats()
    assert torch.equal(got, want)
    # the prefill and 9 decode steps: one call per layer, or one per row while left padding
    # is in the keys (it is read in place, row by row)
    assert 10 * LAYERS <= stats["fwd_calls"] <= 10 * LAYERS * 3
    assert stats["decode_calls"] >= 9 * LAYERS


def test_bfloat16_model_runs_and_roughly_matches(no_fallback):
    ref, model = pair("llama-gqa", torch.bfloat16)
    real = padding("left")
    inputs = dict(input_ids=tokens(3, 12), attention_mask=real)
    logits, grads, stats = forward_backward(model, real, **inputs)
    ref_logits, ref_grads, _ = forward_backward(ref, real, **inputs)
    assert logits.dtype == torch.bfloat16 and stats["bwd_calls"] == LAYERS
    assert_close(logits.float(), ref_logits.float(), tol=3e-2)
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_autocast_bfloat16_runs_on_orchard(no_fallback):
    """Under CPU autocast Llama's rotary embedding leaves q and k in float32 and v in
    bfloat16: orchard computes them in the autocast dtype, as the sdpa model does."""
    ref, model = pair("llama-gqa")
    real = padding("right")
    inputs = dict(input_ids=tokens(3, 12), attention_mask=real)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, grads, stats = forward_backward(model, real, **inputs)
        ref_logits, _, _ = forward_backward(ref, real, **inputs)
    assert stats["fwd_calls"] == LAYERS and stats["bwd_calls"] == LAYERS
    assert_close(logits.float(), ref_logits.float(), tol=3e-2)
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_autocast_computes_float32_inputs_in_its_dtype():
    """q, k and v all in float32 under autocast (a model whose layer norm feeds them): orchard
    computes in the autocast dtype, as sdpa does (autocast casts its inputs) and transformers'
    FlashAttention-2 integration does; without autocast, in float32."""
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (torch.randn(2, 4, 9, 16) for _ in range(3))
    for autocast in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, _ = hf.attention_forward(module, q, k, v, None, scaling=0.25)
            want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                    scale=0.25)
        assert out.dtype == want.dtype == (torch.bfloat16 if autocast else torch.float32)
        assert_close(out.float(), want.transpose(1, 2).float(), tol=2e-2 if autocast else 1e-5)


def test_attention_dropout_against_the_reference():
    """Dropout in training: the attention function with the model's dropout equals the
    float64 reference with orchard's keep-mask of the call's seed."""
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(2, 4, 9, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, 11, 16, dtype=torch.float64), torch.randn(2, 2, 11, 16,
                                                                         dtype=torch.float64)
    torch.manual_seed(5)
    seed = _seed(0.3)
    torch.manual_seed(5)
    out, weights = hf.attention_forward(module, q, k, v, None, dropout=0.3, scaling=0.2)
    want, _ = ref_fwd(q.numpy(), k.numpy(), v.numpy(), scale=0.2, dropout_p=0.3, causal=True,
                      seed=seed)
    assert weights is None
    np.testing.assert_allclose(out.numpy(), want.transpose(0, 2, 1, 3), atol=1e-12)


def test_training_mode_applies_dropout(no_fallback):
    model = build("llama-gqa", "orchard", attention_dropout=0.5)
    ids = tokens(2, 12)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        model.train()
        torch.manual_seed(1)
        dropped = model(input_ids=ids).logits
        torch.manual_seed(1)
        again = model(input_ids=ids).logits
    assert torch.equal(dropped, again) and not torch.allclose(dropped, plain, atol=1e-3)


# ----------------------------------------------------------------------------- fallbacks


def test_a_callers_4d_mask_falls_back_to_sdpa(fresh_warnings):
    ref, model = pair("llama-gqa")
    mask = torch.ones(12, 12, dtype=torch.bool).tril()
    mask[5:, :5] = False        # a block pattern: no padding, causal or window expresses it
    mask = mask.expand(2, 1, 12, 12)
    ids = tokens(2, 12)
    orchard_ops.reset_stats()
    with pytest.warns(UserWarning, match="4-D attention mask passed by the caller") as record:
        got = model(input_ids=ids, attention_mask=mask).logits
    assert len(record) == 1 and orchard_ops.stats()["fwd_calls"] == 0
    assert_close(got, ref(input_ids=ids, attention_mask=mask).logits)


def test_an_unknown_mask_pattern_falls_back_to_sdpa(fresh_warnings):
    """Gemma 3's bidirectional attention widens the causal mask with an or_mask_function."""
    config = Gemma3TextConfig(num_key_value_heads=2, head_dim=16, sliding_window=4,
                              use_bidirectional_attention=True, **SMALL)
    MODELS["gemma3-bidirectional"] = (Gemma3ForCausalLM, config, "sdpa")
    try:
        ref, model = pair("gemma3-bidirectional")
    finally:
        del MODELS["gemma3-bidirectional"]
    ids = tokens(2, 12)
    with pytest.warns(UserWarning, match="or_mask_function"):
        got = model(input_ids=ids).logits
    assert_close(got, ref(input_ids=ids).logits)


def later_keys_overlay():
    def inner(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx >= q_idx
    return inner


def test_an_unknown_mask_is_named_by_its_factories():
    """The fallback's warning names a composed mask by its parts' factories (it said
    "and_masks.<locals>.and_mask" for ModernBERT's local layers)."""
    from transformers import masking_utils as mu
    fn = mu.and_masks(later_keys_overlay(), mu.causal_mask_function)
    with pytest.raises(hf._Unsupported, match=r"\(and_masks\(later_keys_overlay, "
                                              r"causal_mask_function\)\)"):
        hf._packed_ids(fn)


def bert_pair():
    """(sdpa BERT, orchard BERT) with the same weights, no dropout."""
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    ref = BertModel(config).eval()
    model = copy.deepcopy(ref)
    model.set_attn_implementation("orchard")
    return ref, model


def hidden_and_grads(model, ids, mask):
    """Every position's last hidden state and every parameter's gradient of a weighted sum
    of the real ones, and orchard's counters."""
    model.zero_grad()
    orchard_ops.reset_stats()
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    real = torch.ones(ids.shape) if mask is None else mask
    (out * weights * real[..., None]).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, orchard_ops.stats()


@pytest.mark.parametrize("kind", [None, "none", "right", "left", "gaps"])
def test_an_encoder_runs_on_orchard_with_or_without_padding(kind, no_fallback):
    """An encoder's bidirectional mask: none where nothing is padded (the layers are not
    causal), else every query over its row's real keys, padded queries too, as sdpa (they
    fell back to sdpa until the sixty-second session)."""
    ref, model = bert_pair()
    ids = tokens(3, 12)
    mask = None if kind is None else padding(kind)
    got, want = hidden_and_grads(model, ids, mask), hidden_and_grads(ref, ids, mask)
    assert got[2]["fwd_calls"] == 2 and got[2]["bwd_calls"] == 2
    assert_close(got[0], want[0])       # every position, padded ones included
    for name in want[1]:
        assert_close(got[1][name], want[1][name])


def test_a_bidirectional_mask_under_a_reentrant_checkpoint_runs_on_orchard(no_fallback):
    """A reentrant checkpoint recomputes each layer on a detached copy of its mask: read as
    the same (batch, 1, 1, keys) key padding."""
    ref, model = bert_pair()
    ids, mask = tokens(3, 12), padding("gaps")
    for m in (ref, model):
        m.train()
        checkpointing_enable(m, True)
    got, want = hidden_and_grads(model, ids, mask), hidden_and_grads(ref, ids, mask)
    assert got[2]["fwd_calls"] == 4 and got[2]["bwd_calls"] == 2   # the layers again
    for name in want[1]:
        assert_close(got[1][name], want[1][name])


def test_a_callers_key_padding_mask_is_read_as_sdpa_reads_it(fresh_warnings):
    """A caller's (batch, 1, 1, keys) bool mask on a causal model: every query over the marked
    keys, not causal (sdpa applies the mask alone); one of another width falls back, where
    sdpa refuses it."""
    ref, model = pair("llama-gqa")
    ids = tokens(2, 12)
    mask = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    mask[0, ..., 8:] = False
    mask[1, ..., :3] = False
    orchard_ops.reset_stats()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="orchard.hf")
        got = model(input_ids=ids, attention_mask=mask).logits
    assert orchard_ops.stats()["fwd_calls"] == LAYERS
    assert_close(got, ref(input_ids=ids, attention_mask=mask).logits)
    with pytest.warns(UserWarning, match="4-D attention mask"), pytest.raises(RuntimeError):
        model(input_ids=ids, attention_mask=mask[..., :9])


def test_a_vision_encoder_without_a_mask_runs_on_orchard(no_fallback):
    from transformers import ViTConfig, ViTModel
    torch.manual_seed(0)
    ref = ViTModel(ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=128, image_size=32, patch_size=8)).eval()
    model = copy.deepcopy(ref)
    model.set_attn_implementation("orchard")
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    orchard_ops.reset_stats()
    got = model(pixel_values=pixels).last_hidden_state
    assert orchard_ops.stats()["fwd_calls"] == 2
    assert_close(got, ref(pixel_values=pixels).last_hidden_state)


def test_cross_attention_over_padded_encoder_states_runs_on_orchard(no_fallback):
    """BART: the encoder's bidirectional mask and the decoder's cross-attention one (decoder
    queries over the encoder's real tokens) on orchard, logits and greedy tokens as sdpa's."""
    from transformers import BartConfig, BartForConditionalGeneration
    torch.manual_seed(0)
    ref = BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=64)).eval()
    model = copy.deepcopy(ref)
    model.set_attn_implementation("orchard")
    ids, mask = tokens(3, 12), padding("right")
    decoder_ids = tokens(3, 5, seed=3)
    orchard_ops.reset_stats()
    got = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    assert orchard_ops.stats()["fwd_calls"] == 6      # encoder, decoder self and cross
    assert_close(got, ref(input_ids=ids, attention_mask=mask,
                          decoder_input_ids=decoder_ids).logits)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, num_beams=1)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


@pytest.mark.parametrize("model_type, extra", [
    # keeps its window on the layer and does not pass it on
    ("qwen2_moe", dict(moe_intermediate_size=32, shared_expert_intermediate_size=32,
                       num_experts=4, num_experts_per_tok=2, use_sliding_window=True,
                       layer_types=["sliding_attention"] * 2)),
    # its full-attention layers keep none: they warned of several windows
    ("qwen2_moe", dict(moe_intermediate_size=32, shared_expert_intermediate_size=32,
                       num_experts=4, num_experts_per_tok=2, use_sliding_window=True,
                       layer_types=["sliding_attention", "full_attention"])),
    # neither passes nor keeps it: only its mask has it
    ("phimoe", dict(num_local_experts=4, num_experts_per_tok=2)),
])
def test_a_window_the_layer_does_not_pass_is_applied(model_type, extra, no_fallback):
    """Such layers ran full causal attention on orchard (their masks, which orchard's mask
    function leaves out, held the window), 0.4 off sdpa, without a word."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(model_type, sliding_window=4, num_key_value_heads=2, **SMALL,
                                  **extra)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model = copy.deepcopy(ref)
    model.set_attn_implementation("orchard")
    # a model whose first forward is packed (padding-free training): PhiMoE's packed masks
    # recorded no window, and it trained without one, 0.39 off sdpa, without a word
    packed = dict(input_ids=tokens(2, 16), use_cache=False, position_ids=torch.tensor(
        [list(range(16)), list(range(5)) + list(range(11))]))
    first = copy.deepcopy(ref)
    first.set_attn_implementation("orchard")
    assert_close(first(**packed).logits, ref(**packed).logits)
    orchard_ops.reset_stats()
    ids = tokens(2, 16)
    assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert orchard_ops.stats()["fwd_calls"] == 2


def test_a_full_layer_that_passes_no_window_keeps_none():
    """Exaone 4 keeps its model's window on every layer and passes sliding_window=None for
    its full-attention ones: those ran with the window on orchard (0.2-0.5 off sdpa, without
    a word) while a None passed was read as none passed."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("exaone4", sliding_window=4, num_key_value_heads=2, **SMALL,
                                  layer_types=["full_attention", "sliding_attention"])
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model = copy.deepcopy(ref)
    model.set_attn_implementation("orchard")
    ids = tokens(2, 16)
    assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_a_window_the_layer_keeps_as_a_property():
    """A layer's own window is read without nn.Module's __getattr__ (whose AttributeError for
    the layers without one cost 3 us a call), whether an attribute or a property."""
    class Kept(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sliding_window = 64

    class Property(torch.nn.Module):
        sliding_window = property(lambda self: 128)

    assert hf._window_for(Kept(), True) == 64
    assert hf._window_for(Property(), True) == 128
    assert hf._window_for(torch.nn.Module(), True) is None


@pytest.mark.parametrize("model_type, sizes, why", [
    # computes its attention in its own code; its causal LM has no base model in MODEL_MAPPING
    ("trocr", dict(d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128),
     "TrOCRForCausalLM computes its attention in its own code"),
    # decoder self-attention causal only through its mask: orchard ran it non-causally
    ("bigbird_pegasus", dict(d_model=64, encoder_layers=1, decoder_layers=2,
                             encoder_attention_heads=4, decoder_attention_heads=4,
                             encoder_ffn_dim=128, decoder_ffn_dim=128),
     "transformers marks BigBirdPegasusModel as not supporting FlashAttention-2"),
    # a dynamic mask built on the causal one, which orchard's mask function leaves out
    ("doge", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
     "transformers marks DogeModel as not supporting FlashAttention-2"),
    # adds its ALiBi bias to the 4-D mask it builds: orchard's 2-D one made it non-causal
    # (batch 1, padded) or failed inside the model
    ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True),
     "FalconConfig with alibi=True adds its ALiBi position bias to the attention mask"),
])
def test_models_flash_attention_2_does_not_serve_are_refused(model_type, sizes, why):
    """Each of these ran on "orchard" with later tokens leaking into earlier positions, without
    a word: orchard reads masks as transformers' FlashAttention-2 integration does, so it
    refuses what that integration refuses."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, **sizes)
    if "in its own code" not in why:   # older 5.x refuse some of these for that reason
        skip_where_attention_is_the_models_own(config)
    assert why in hf.unsupported_reason(config)
    # refused as the model is built, as transformers refuses flash_attention_2
    with pytest.raises(ValueError, match="orchard.hf: " + why):
        AutoModelForCausalLM.from_config(config, attn_implementation="orchard")
    # and by the first forward of a model switched to orchard after its checks
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.config._attn_implementation = "orchard"
    with pytest.raises(ValueError, match="orchard.hf: " + why):
        model(input_ids=tokens(2, 12))


@pytest.mark.parametrize("model_type, sizes, why", [
    ("gpt_neo", dict(hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global"], 2]]),
     "GPTNeoModel computes its attention in its own code"),
    ("data2vec-vision", dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                             intermediate_size=128, image_size=32, patch_size=8),
     "Data2VecVisionModel computes its attention in its own code"),
])
def test_models_that_look_their_attention_up_by_name_are_refused_as_they_are_built(
        model_type, sizes, why):
    """These models look their attention classes up by implementation as they are built: they
    failed inside transformers (KeyError: 'orchard')."""
    from transformers import AutoConfig, AutoModel
    with pytest.raises(ValueError, match="orchard.hf: " + why):
        AutoModel.from_config(AutoConfig.for_model(model_type, **sizes),
                              attn_implementation="orchard")


def test_layers_causal_only_through_their_masks_fall_back(fresh_warnings):
    """PegasusX's decoder self-attention, and Gemma's layers with use_bidirectional_attention
    (PaliGemma's text model), are built non-causal under the causal masks their models make:
    orchard, taking causality from the layer, let later tokens into earlier positions, with
    no word. Their masks now fall back, and the calls give the reference's results."""
    from transformers import AutoConfig, AutoModelForCausalLM, PegasusXConfig
    from transformers import PegasusXForConditionalGeneration
    torch.manual_seed(0)
    pegasus = PegasusXForConditionalGeneration(PegasusXConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=64, pad_token_id=0,
        decoder_start_token_id=0, eos_token_id=1)).eval()
    gemma = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gemma", num_key_value_heads=2, head_dim=16, use_bidirectional_attention=True,
        **SMALL), attn_implementation="eager").eval()
    ids, mask = tokens(3, 12), padding("left")
    for ref, inputs, real, why in (
            (pegasus, dict(input_ids=tokens(3, 10, seed=3), decoder_input_ids=ids),
             torch.ones_like(mask), "PegasusX's decoder self-attention is causal only through "
             "its mask"),
            (gemma, dict(input_ids=ids, attention_mask=mask), mask,
             "layers built non-causal \\(use_bidirectional_attention=True\\) under causal "
             "masks")):
        model = copy.deepcopy(ref)
        model.set_attn_implementation("orchard")
        with pytest.warns(UserWarning, match=why):
            got = model(**inputs).logits
        assert_close(got[real.bool()], ref(**inputs).logits[real.bool()])


def test_layers_causal_only_under_their_own_masks_fall_back(fresh_warnings):
    """Moonshine's decoder layers pass is_causal=False whenever given a mask (sdpa's, causal
    itself), AIMv2's and VideoPrism's text layers are built non-causal under the causal masks
    their models make: with orchard's masks (the padding alone) later tokens reached earlier
    positions, silently. They fall back now, and give the reference's results."""
    from transformers import (Aimv2TextConfig, Aimv2TextModel, MoonshineConfig,
                              MoonshineForConditionalGeneration, VideoPrismTextConfig,
                              VideoPrismTextModel)
    torch.manual_seed(0)
    moonshine = MoonshineForConditionalGeneration(MoonshineConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, encoder_num_hidden_layers=1,
        decoder_num_hidden_layers=1, encoder_num_attention_heads=4,
        decoder_num_attention_heads=4, encoder_num_key_value_heads=4,
        decoder_num_key_value_heads=4, pad_token_id=0, decoder_start_token_id=1,
        bos_token_id=1, eos_token_id=2)).eval()
    # (two layers: VideoPrism pools a position it appends, which sees every key either way)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=32, eos_token_id=VOCAB - 1)
    ids, mask = tokens(2, 12), torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    for ref, inputs, name in (
            (moonshine, dict(input_values=torch.randn(2, 2000), decoder_input_ids=ids,
                             decoder_attention_mask=mask), "Moonshine"),
            (Aimv2TextModel(Aimv2TextConfig(**text)).eval(), dict(input_ids=ids,
                                                                   attention_mask=mask), "Aimv2Text"),
            (VideoPrismTextModel(VideoPrismTextConfig(**text)).eval(),
             dict(input_ids=ids, attention_mask=mask), "VideoPrismText")):
        model = copy.deepcopy(ref)
        model.set_attn_implementation("orchard")
        with pytest.warns(UserWarning, match=name + "'s decoder self-attention"):
            got = model(**inputs)
        want = ref(**inputs)
        if name == "Moonshine":
            assert_close(got.logits[mask.bool()], want.logits[mask.bool()])
        else:   # (VideoPrism appends a position: the pooled outputs)
            assert_close(got.pooler_output, want.pooler_output)


def test_a_3d_attention_mask_is_a_value_error():
    """A (batch, 1, positions) mask: a ValueError naming it (a TypeError from inside orchard's
    mask function before; sdpa raises an IndexError)."""
    model = build("llama-gqa", "orchard")
    mask = torch.ones(2, 1, 12, dtype=torch.long)
    with pytest.raises(ValueError, match="'attention_mask' of shape \\(2, 1, 12\\): a padding "
                                         "mask is \\(batch, positions\\)"):
        model(tokens(2, 12), attention_mask=mask)


def test_a_sub_model_of_a_refused_model_is_refused():
    """T5Gemma2's layers hold its sub-models' configs, which transformers maps to no model
    class: the refusal of T5Gemma2Model (_supports_flash_attn = False) never reached them, and
    the forward failed inside transformers (torch.cat over orchard's None mask)."""
    from transformers import (T5Gemma2Config, T5Gemma2DecoderConfig, T5Gemma2EncoderConfig,
                              T5Gemma2ForConditionalGeneration, T5Gemma2TextConfig)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = T5Gemma2Config(encoder=T5Gemma2EncoderConfig(text_config=T5Gemma2TextConfig(
        **text)), decoder=T5Gemma2DecoderConfig(**text))
    why = "belongs to a model that orchard cannot run: transformers marks T5Gemma2Model"
    assert why in hf.unsupported_reason(config.decoder)
    model = T5Gemma2ForConditionalGeneration._from_config(
        config, attn_implementation="eager").eval()
    model.config._attn_implementation = "orchard"   # (built with it, it is refused there)
    with pytest.raises(ValueError, match="orchard.hf: T5Gemma2TextConfig " + why):
        model(input_ids=tokens(2, 8), decoder_input_ids=tokens(2, 4))
    assert hf.unsupported_reason(LlamaConfig()) is None


def test_unsupported_reason_of_a_config_with_several_model_classes():
    """MODEL_MAPPING gives Funnel's config two classes: unsupported_reason raised an
    AttributeError on the tuple."""
    from transformers import FunnelConfig
    assert "FunnelModel computes its attention in its own code" in hf.unsupported_reason(
        FunnelConfig())


def test_a_layer_whose_masks_had_several_windows_says_which_it_takes(fresh_warnings):
    """A layer that passes no window, whose model's masks had several (Moshi: generate()'s
    static cache made sliding ones, its own forward causal ones), took none without a word."""
    class Attention(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config

    layer = Attention(LlamaConfig(**SMALL))
    hf._record_window(layer.config, 4)
    assert hf._window_for(layer, True) == 4
    hf._record_window(layer.config, None)
    with pytest.warns(UserWarning, match="Attention passes no sliding window and its model's "
                                         "masks had several \\(4, None\\)"):
        assert hf._window_for(layer, True) is None


def test_falcon_without_alibi_runs_on_orchard(no_fallback):
    from transformers import FalconConfig, FalconForCausalLM
    config = FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4)
    skip_where_attention_is_the_models_own(config)
    MODELS["falcon"] = (FalconForCausalLM, config, "sdpa")
    try:
        ref, model = pair("falcon")
    finally:
        del MODELS["falcon"]
    ids, mask = tokens(3, 12), padding("left")
    real = mask.bool()
    assert_close(model(input_ids=ids, attention_mask=mask).logits[real],
                 ref(input_ids=ids, attention_mask=mask).logits[real])


def test_gemma4_kv_shared_layers_cut_masks_so_padding_falls_back(fresh_warnings):
    """Gemma 4's text model cuts every mask to the positions it keeps (generate()'s last one)
    before its KV-shared layers, indexing them as 4-D tensors unless the attention is
    FlashAttention: orchard's 2-D masks failed there (IndexError) in any padded forward and
    over a static cache. Those masks now fall back to sdpa, named; without one the model
    runs on orchard."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    MODELS["gemma4-kv-shared"] = (Gemma4ForCausalLM, Gemma4TextConfig(
        num_key_value_heads=2, head_dim=16, global_head_dim=16, sliding_window=4,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=16, layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2, **dict(SMALL, num_hidden_layers=4)), "sdpa")
    try:
        ref, model = pair("gemma4-kv-shared")
    finally:
        del MODELS["gemma4-kv-shared"]
    if hf._cut_reason(model.config) is None:
        pytest.skip("this transformers' Gemma 4 cuts no masks before its KV-shared layers "
                    "(5.20 among them)")
    ids, mask = tokens(3, 12), padding("left")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="orchard.hf")
        for keep in (0, 3):     # 3: the KV-shared layers see the last 3 queries, on orchard
            orchard_ops.reset_stats()
            assert_close(model(input_ids=ids, logits_to_keep=keep).logits,
                         ref(input_ids=ids, logits_to_keep=keep).logits)
            assert orchard_ops.stats()["fwd_calls"] == 4
    real = mask.bool()
    with pytest.warns(UserWarning, match="Gemma4TextModel cuts its masks"):
        got = model(input_ids=ids, attention_mask=mask).logits[real]
    assert_close(got, ref(input_ids=ids, attention_mask=mask).logits[real])
    # the cut masks' layers named the same reason (their masks are new tensors, unmarked)
    assert not any("passed by the caller" in reason for reason in hf._warned)
    for kw in (dict(attention_mask=mask), dict(cache_implementation="static")):
        want = ref.generate(ids, max_new_tokens=4, do_sample=False, **kw)
        orchard_ops.reset_stats()
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False, **kw), want)
        # a decode step's single query cuts nothing: its 2-D mask runs on orchard (and, over
        # the static cache, the prefill's sliding layers, whose masks are None)
        assert orchard_ops.stats()["fwd_calls"] >= 3 * 4, kw


def test_a_model_outside_the_attention_interface_is_refused():
    """Bloom computes its attention in its own code: "orchard" would never reach it, and the
    mask function's None (causal) would leave it unmasked, so it is refused as it is built, and
    its forward is an error; BioGPT, which calls the interface without the flag that says so,
    runs on orchard."""
    from transformers import BioGptConfig, BioGptForCausalLM, BloomConfig, BloomForCausalLM
    config = BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)
    why = "BloomModel computes its attention in its own code"
    with pytest.raises(ValueError, match=why):
        BloomForCausalLM._from_config(config, attn_implementation="orchard")
    bloom = BloomForCausalLM._from_config(config, attn_implementation="eager").eval()
    bloom.config._attn_implementation = "orchard"
    with pytest.raises(ValueError, match=why):
        bloom(input_ids=tokens(1, 8))
    assert hf.computes_attention_itself(bloom.config) == "BloomModel"
    assert hf.unsupported_reason(LlamaConfig()) is None

    config = BioGptConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=128)
    assert hf.computes_attention_itself(config) is None
    torch.manual_seed(0)
    ref = BioGptForCausalLM(config).eval()
    model = copy.deepcopy(ref)
    model.set_attn_implementation("orchard")
    orchard_ops.reset_stats()
    ids = tokens(2, 8)
    assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert orchard_ops.stats()["fwd_calls"] > 0


def test_output_attentions_says_no_weights_come(fresh_warnings):
    """output_attentions=True returned no weights without a word (sdpa and flash_attention_2
    say so once); the outputs are orchard's all the same."""
    ref, model = pair("llama-gqa")
    ids = tokens(2, 8)
    with pytest.warns(UserWarning, match="output_attentions=True: orchard never forms"):
        got = model(input_ids=ids, output_attentions=True)
    assert not any(a is not None for a in got.attentions)
    assert_close(got.logits, ref(input_ids=ids).logits)


def test_softcap_falls_back_to_eager(fresh_warnings):
    ref, model = pair("gemma2-softcap")
    mask = torch.ones(12, 12, dtype=torch.bool).tril()
    mask[5:, :5] = False
    mask = mask.expand(2, 1, 12, 12)
    ids = tokens(2, 12)
    with pytest.warns(UserWarning, match="eager attention"):
        got = model(input_ids=ids, attention_mask=mask).logits
    want = ref(input_ids=ids, attention_mask=torch.zeros(mask.shape).masked_fill(
        ~mask, torch.finfo(torch.float32).min)).logits
    assert_close(got, want)


def test_a_window_over_padding_gaps_falls_back(fresh_warnings):
    """orchard's window counts real tokens, transformers' counts positions: with padding
    between real tokens they differ, so sdpa computes it."""
    ref, model = pair("mistral-window")
    real = padding("none")
    real[0, 4:7] = 0
    inputs = dict(input_ids=tokens(3, 12), attention_mask=real)
    with pytest.warns(UserWarning, match="padding between real tokens"):
        got = model(**inputs).logits
    assert_close(got[real.bool()], ref(**inputs).logits[real.bool()])


def sinks_pair():
    """(eager, orchard) gpt-oss models with the same weights: a learned sink per head (s_aux),
    which sdpa lacks and the model's eager attention has, sinks made to matter (they start at
    zero)."""
    config = GptOssConfig(num_key_value_heads=2, head_dim=16, num_local_experts=2,
                          num_experts_per_tok=1, sliding_window=4, **SMALL)
    MODELS["gpt-oss"] = (GptOssForCausalLM, config, "eager")
    try:
        ref, model = pair("gpt-oss")
    finally:
        del MODELS["gpt-oss"]
    with torch.no_grad():
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks)
    ref.load_state_dict(model.state_dict())
    return ref, model


def test_attention_sinks_fall_back_to_eager(fresh_warnings):
    """gpt-oss's sinks: on the model's eager attention."""
    ref, model = sinks_pair()
    ids = tokens(2, 12)
    with pytest.warns(UserWarning, match="attention sinks"):
        got = model(input_ids=ids).logits
    assert_close(got, ref(input_ids=ids).logits)


def test_a_head_dim_above_orchards_falls_back(fresh_warnings):
    """head_dim 288 > 256: sdpa computes it, on the padding, causal mask orchard was given."""
    ref, model = pair("llama-gqa", head_dim=288)
    real = padding("left")
    inputs = dict(input_ids=tokens(3, 12), attention_mask=real)
    with pytest.warns(UserWarning, match="head dimension 288"):
        got = model(**inputs).logits
    assert_close(got[real.bool()], ref(**inputs).logits[real.bool()])


def test_a_2d_mask_that_fits_no_reading_is_an_error():
    module = torch.nn.Module()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="'attention_mask' of shape \\(1, 3\\)"):
        hf.attention_forward(module, q, q, q, torch.ones(1, 3, dtype=torch.bool))


def test_the_mask_function_reads_transformers_masks():
    causal = masking_utils.causal_mask_function
    assert hf.attention_mask(2, 5, 5, mask_function=causal) is None
    # a decode step over a static cache of 16 rows, 6 of them written (the cache's length a
    # tensor, as transformers' StaticLayer gives it): the real tokens among the written keys,
    # the cache's length kept, the written count left a tensor
    real = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    for offset in (5, torch.tensor(5)):
        got = hf.attention_mask(2, 1, 16, q_offset=offset, mask_function=causal,
                                attention_mask=real)
        assert got.shape == (2, 16) and torch.equal(got[:, :6], real) and not got[:, 6:].any()
        assert torch.equal(torch.as_tensor(got.orchard_written), torch.tensor(6))
        # generate() makes it in advance, and the model passes it here again
        again = hf.attention_mask(2, 1, 16, q_offset=offset, mask_function=causal,
                                  attention_mask=got)
        assert torch.equal(again, got)
    window = masking_utils.sliding_window_causal_mask_function(3)
    assert hf.attention_mask(2, 5, 5, mask_function=window, attention_mask=real[:, 1:]) is None
    chunked = masking_utils.chunked_causal_mask_function(2, torch.zeros(2, dtype=torch.long))
    got = hf.attention_mask(2, 5, 5, mask_function=chunked)
    assert got.shape == (2, 1, 5, 5) and "chunked attention" in got.orchard_fallback


def test_a_forward_reads_its_padding_mask_once():
    """The mask function reads its padding mask once, where it is made (_Plan: left padding or
    not, each row's padding, gaps, the real keys' and queries' indices), and the layers read
    the plan, never the mask again (compiled, a graph break where the mask is made, none in a
    layer); given back to the mask function (already cut) it gives a new mask and plan, so
    nothing lands on the caller's tensor; a caller's own mask is read at every call. The
    results: attention over each row's real tokens, read in place for left padding without
    gradients, unpadded otherwise."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 4, 8, generator=g) for _ in range(3))
    module = torch.nn.Module()
    for rows, fits, gaps in (([[0, 0, 1, 1], [1, 1, 1, 1]], True, False),
                             ([[1, 1, 0, 0], [1, 1, 1, 1]], False, False),
                             ([[1, 0, 1, 1], [0, 1, 1, 1]], False, True)):
        real = torch.tensor(rows, dtype=torch.bool)
        mask = hf.attention_mask(2, 4, 4, attention_mask=real)
        plan = mask.orchard_plan
        assert mask is not real and not hasattr(real, "orchard_plan")
        assert (plan.width, plan.fits, plan.gaps) == (4, fits, gaps)
        assert plan.leftpad.tolist() == [4 - sum(r) for r in rows]
        assert plan.keys.cu_seqlens.tolist() == [0, sum(rows[0]), sum(rows[0]) + sum(rows[1])]
        again = hf.attention_mask(2, 4, 4, attention_mask=mask)
        assert again is not mask and torch.equal(again, mask)
        with torch.no_grad():
            first, _ = hf.attention_forward(module, q, k, v, mask)
            callers, _ = hf.attention_forward(module, q, k, v, real)
            # a call of fewer queries (the last two) reads the mask, not the plan of four
            fewer, _ = hf.attention_forward(module, q[:, :, 2:], k, v, mask)
            assert torch.equal(fewer, hf.attention_forward(module, q[:, :, 2:], k, v, real)[0])
            mask.zero_()      # the plan, not the mask, is read
            second, _ = hf.attention_forward(module, q, k, v, mask)
        assert torch.equal(first, second) and torch.equal(first, callers)
        grads = [t.clone().requires_grad_(True) for t in (q, k, v)]
        trained, _ = hf.attention_forward(module, *grads, mask)
        assert torch.equal(trained.detach(), first)
        for b, row in enumerate(rows):
            keys = torch.tensor(row, dtype=torch.bool)
            seen = keys[None, :] & torch.ones(4, 4, dtype=torch.bool).tril()
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[b], k[b], v[b], attn_mask=seen)
            assert_close(first[b, keys], ref.transpose(0, 1)[keys])


def test_llama_benchmark_runs_at_tiny_size():
    """benchmarks/hf_llama.py (the README's figure) at a tiny size: it runs, every attention
    call of the orchard model's step is on orchard, and it prints its table."""
    result = run_python(["benchmarks/hf_llama.py", "--batch", "1", "--seq", "16", "--layers",
                         "1", "--hidden", "32", "--vocab", "64", "--rounds", "1"])
    assert result.returncode == 0, result.stderr
    assert "ms per step" in result.stdout and "orchard / sdpa speed" in result.stdout
