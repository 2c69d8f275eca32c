"""Generation with the KV cache: the same greedy tokens and logits as recomputing every step,
past the model's context too; decode steps on orchard, reading the cache in place."""
import pytest

torch = pytest.importorskip("torch")

import orchard_ops  # noqa: E402
from orchard.generation import (Detokenizer, decode, describe_training, generate,  # noqa: E402
                                generate_ids)
from orchard.model import GPT, GPTConfig, KVCache  # noqa: E402
from orchard.torch import patch_model  # noqa: E402
from test_py_support import run_python  # noqa: E402


@pytest.fixture(scope="module")
def model():
    """A random GPT of context 32 with attention on orchard. Weights of std 0.3 (not GPT-2's
    0.02) make its greedy choices varied and decided by clear margins (the top two logits
    differ by > 0.02, float32 rounding by ~1e-6), so equal tokens are a real comparison."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, context=32, n_layer=2, n_head=4, n_kv_head=2,
                          n_embd=32)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    patch_model(model, device="cpu")
    return model


@pytest.mark.parametrize("prompt, new", [(5, 10), (11, 60), (40, 5), (1, 1)])
def test_greedy_tokens_with_and_without_cache_agree(model, prompt, new):
    # 60 new tokens run the window past the context of 32 (re-prefill every step); a prompt
    # of 40 is longer than the context from the start.
    ids = torch.randint(0, 256, (prompt,), generator=torch.Generator().manual_seed(prompt))
    ids = ids.tolist()
    cached = generate(model, ids, new, temperature=0)
    recomputed = generate(model, ids, new, temperature=0, use_cache=False)
    assert cached == recomputed
    assert len(cached) == len(ids) + new and cached[:len(ids)] == ids
    assert new < 5 or len(set(cached[len(ids):])) > 3   # varied tokens, not one repeated


def test_cached_logits_match_a_full_forward(model):
    idx = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(idx)
        cache = model.new_cache(1, idx.shape[1])
        steps = [model(idx[:, :5], cache=cache)[0]]
        steps += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(5, idx.shape[1])]
    assert cache.length == idx.shape[1]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)


def test_decode_steps_run_on_orchard_and_read_the_cache_in_place(model):
    router = model.orchard_router
    routed, left = router.routed, sum(router.left_to_torch.values())
    orchard_ops.reset_stats()
    generate(model, [1, 2, 3, 4, 5], 8, temperature=0)
    stats = orchard_ops.stats()
    layers = model.cfg.n_layer
    assert router.routed - routed == 8 * layers and sum(router.left_to_torch.values()) == left
    # the prefill of 5 and the 7 one-token steps all have at most 16 query rows per head
    assert stats["fwd_calls"] == stats["decode_calls"] == 8 * layers
    assert stats["staged_buffers"] == 0            # cache views go to orchard without a copy


def test_sampling_is_reproducible(model):
    ids = [7, 8, 9]
    a = generate(model, ids, 30, temperature=0.8, top_k=20, seed=3)
    assert a == generate(model, ids, 30, temperature=0.8, top_k=20, seed=3)
    assert a != generate(model, ids, 30, temperature=0.8, top_k=20, seed=4)


def test_a_temperature_too_small_to_divide_by_is_greedy():
    from orchard.generation import sample_next

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 10
    for temperature in (1e-40, 5e-324, 0):
        assert torch.equal(sample_next(logits, temperature), logits.argmax(-1, keepdim=True))


def test_cache_misuse_is_a_clear_error():
    cfg = GPTConfig(vocab_size=16, context=8, n_layer=1, n_head=2, n_kv_head=1, n_embd=8)
    model = GPT(cfg).eval()
    with pytest.raises(ValueError, match="'size' must be in \\[1, 8\\]"):
        KVCache(cfg, 1, 9)
    cache = model.new_cache(1, 4)
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="one new token per forward, got 2"):
            model(torch.zeros(1, 2, dtype=torch.long), cache=cache)
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="longer than the cache's size 4"):
            model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    assert cache.length == 4


def test_batched_greedy_generation_with_cache():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, context=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    model = GPT(cfg).eval()
    idx = torch.randint(0, 64, (3, 4))
    assert torch.equal(generate_ids(model, idx, 20, temperature=0),
                       generate_ids(model, idx, 20, temperature=0, use_cache=False))


def test_generate_speed_benchmark_runs():
    # a smoke run at a tiny size: the script works and both paths agree (no timing asserted)
    result = run_python(["benchmarks/generate_speed.py", "--prompt", "4", "--new", "6",
                         "--rounds", "1"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "with KV cache (after)" in result.stdout and "same tokens: yes" in result.stdout


def test_byte_level_text_skips_ids_past_the_bytes():
    """A byte-level model whose vocabulary the config raised past 256 can sample those ids:
    the text leaves them out instead of failing after the whole generation."""
    assert decode([104, 105, 300, 33, 256], byte_level=True) == "hi!"
    assert decode([104, 300], byte_level=False) == "104 300"



def test_a_byte_level_prompt_takes_the_bytes_the_command_line_held():
    """Bytes of a command line that are not UTF-8 reach Python as surrogate escapes: a
    byte-level model takes the bytes themselves (it refused them with Python's "surrogates
    not allowed"); a lone surrogate with no byte behind it is no text."""
    import os
    from orchard.generation import encode
    assert encode(os.fsdecode(b"a\xffb"), byte_level=True) == [0x61, 0xFF, 0x62]
    assert encode("é", byte_level=True) == [0xC3, 0xA9]
    with pytest.raises(ValueError, match="not valid text \\(a lone surrogate"):
        encode("a\ud83db", byte_level=True)


def test_text_streamed_token_by_token():
    """orchard-generate prints each token as it comes: a character whose UTF-8 bytes are
    separate tokens appears once whole, ids are separated by spaces across pieces, and the
    pieces add up to the text of all the ids."""
    text = Detokenizer(byte_level=True)
    pieces = [text([i]) for i in "é€!".encode()] + [text([], final=True)]
    assert pieces == ["", "é", "", "", "€", "!", ""]
    text = Detokenizer(byte_level=True)
    assert text([0xe2]) + text([0x82], final=True) == "\ufffd"  # a cut character, replaced
    ids = Detokenizer(byte_level=False)
    assert ids([1, 2]) + ids([]) + ids([3]) + ids([], final=True) == "1 2 3"


def test_an_overfit_checkpoint_is_not_called_barely_trained():
    """A validation loss above uniform guessing beside a low training loss is overfitting
    (it read "barely trained; expect near-random tokens")."""
    state = dict(step=500, schedule_steps=500, model_config=dict(vocab_size=256),
                 metrics=[dict(loss=1.2, val_loss=11.61)])
    assert describe_training(state) == (
        "checkpoint of step 500 of 500, validation loss 11.61 (uniform guessing: 5.55): "
        "overfit (training loss 1.20); expect its training data's fragments")
    state["metrics"] = [dict(loss=5.4, val_loss=5.6)]
    assert describe_training(state).endswith(": barely trained; expect near-random tokens")
