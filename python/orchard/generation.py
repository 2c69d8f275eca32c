"""Text generation from a checkpoint written by orchard-train.

Models trained on byte-level data (a vocabulary of 256: the default data and orchard-prepare's
output) take and give text; others space-separated token ids. The model is the built-in GPT
or a transformers model (orchard.hf_causal_lm), whichever the checkpoint records.

Generation keeps a KV cache: the prompt is prefilled once, then every step feeds only the
newest token, whose attention reads the cached keys and values (on orchard, where a step's
one query row per head takes the split-KV decode path). A forward never holds more than the
model's context (its positions): once the tokens outgrow it, the window slides by one token a
step, every position moves, and no cached key stays valid, so each step then prefills the
last `context` tokens anew, exactly what generation without the cache computes.
"""
import math

import torch
import torch.nn.functional as F

from .checkpoint import load_checkpoint
from .device_backend import get_device_backend
from .hf_causal_lm import build_model


def load_model(checkpoint, device="auto"):
    """(model in eval mode with orchard attention on `device`, whether it is byte-level);
    checkpoint is a path (file or output folder) or a checkpoint already loaded."""
    state = checkpoint if isinstance(checkpoint, dict) else load_checkpoint(checkpoint)
    model = build_model(state["model_config"], state.get("hf_config"))
    model.load_state_dict(state["model"])
    model.eval()
    backend = get_device_backend(device).setup()
    if state.get("hf_config") is None:
        backend.patch_model(model)
    return model, state["data"].get("byte_level", False)


def describe_training(state):
    """One line on what a checkpoint's sample can be expected to look like: its steps, its
    last loss, and how that compares with guessing uniformly (ln of the vocabulary)."""
    step, metrics = state["step"], state.get("metrics") or []
    planned = state.get("schedule_steps")
    text = "checkpoint of step %d%s" % (step, " of %d" % planned if planned else "")
    if not metrics:
        return text + ": no loss recorded yet; expect random tokens"
    last = metrics[-1]
    loss = last.get("val_loss", last["loss"])
    uniform = math.log(state["model_config"]["vocab_size"])
    text += ", %s %.2f (uniform guessing: %.2f)" % (
        "validation loss" if "val_loss" in last else "loss", loss, uniform)
    if loss > 0.75 * uniform:
        return text + ": barely trained; expect near-random tokens"
    if loss > 0.45 * uniform:
        return text + (": an early model; expect the data's characters and short fragments, "
                       "not coherent text")
    return text


def encode(prompt, byte_level):
    """Token ids of a prompt; ValueError if it is empty or not token ids."""
    if byte_level:
        ids = list(prompt.encode("utf-8"))
    else:
        try:
            ids = [int(t) for t in prompt.split()]
        except ValueError:
            raise ValueError("the model is not byte-level: the prompt must be space-separated "
                             "token ids, got %r" % prompt) from None
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def decode(ids, byte_level):
    if byte_level:  # a vocabulary above the data's 256 bytes can still sample the other ids
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    return " ".join(map(str, ids))


def sample_next(logits, temperature, top_k=None, generator=None):
    """(batch, 1) token ids from logits (batch, vocab): the most likely for temperature <= 0,
    else sampled at that temperature among the top_k most likely (all for None or 0)."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, -1), 1, generator=generator)


@torch.no_grad()
def generate_ids(model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None,
                 use_cache=True):
    """idx (batch, n) followed by max_new_tokens sampled tokens. use_cache=False recomputes
    every step from scratch (the reference the cache must match; see the module docstring)."""
    context = model.context
    cache, filled, size = None, 0, 0
    for step in range(max_new_tokens):
        if cache is not None and filled < size:
            logits, _ = model(idx[:, -1:], cache=cache)
            filled += 1
        else:
            window = idx[:, -context:]
            if use_cache:
                # room for the window and the tokens still to feed (the last sampled one is
                # never fed), up to the context
                filled = window.shape[1]
                size = min(context, filled + max_new_tokens - step - 1)
                cache = model.new_cache(len(idx), size)
            logits, _ = model(window, cache=cache)
        idx = torch.cat([idx, sample_next(logits[:, -1], temperature, top_k, generator)], 1)
    return idx


def generate(model, ids, max_new_tokens, temperature=0.8, top_k=40, seed=0, use_cache=True):
    """The prompt's ids followed by max_new_tokens sampled ones."""
    generator = torch.Generator().manual_seed(seed)
    return generate_ids(model, torch.tensor([ids]), max_new_tokens, temperature, top_k,
                        generator, use_cache)[0].tolist()
