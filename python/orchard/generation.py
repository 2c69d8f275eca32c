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
import codecs
import logging
import math

import torch
import torch.nn.functional as F

from .checkpoint import (CheckpointError, check_model_size, checkpoint_contents, checkpoint_path,
                         load_checkpoint)
from .config import validate
from .device_backend import get_device_backend
from .hf_causal_lm import attention_device_note, build_model

log = logging.getLogger("orchard")


def load_model(checkpoint, device="auto", source=None):
    """(model in eval mode with orchard attention on `device`, whether it is byte-level);
    checkpoint is a path (file or output folder) or a checkpoint already loaded (from source,
    the path its errors name)."""
    if not isinstance(checkpoint, dict):
        source, checkpoint = checkpoint_path(checkpoint), load_checkpoint(checkpoint)
    state = checkpoint
    with checkpoint_contents(source or "the checkpoint"):
        hf_config, model_cfg = state.get("hf_config"), None
        if hf_config is None:      # as --resume checks it (a NaN dropout, ...)
            model_cfg = validate({"model": state["model_config"]},
                                 source or "the checkpoint")["model"]
        check_model_size(model_cfg, state["model"], source or "the checkpoint", hf_config)
        model = build_model(state["model_config"], hf_config,
                            checkpoint=source or "the checkpoint")
        model.load_state_dict(state["model"])
    bad = [name for name, x in model.state_dict().items()
           if x.is_floating_point() and not torch.isfinite(x).all()]
    if bad:     # a run that diverged: its samples would be meaningless (or fail in multinomial)
        raise CheckpointError("%s: its weights are not finite (NaN or inf in %d tensors, e.g. "
                              "%s): the run that wrote it diverged" % (source or "the checkpoint",
                                                                       len(bad), bad[0]))
    model.eval()
    backend = get_device_backend(device).setup()
    note = attention_device_note(backend.device)   # (orchard.hf passes no device)
    if hf_config is None:
        backend.patch_model(model)
    elif note:
        log.warning("%s", note)
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
    if loss > uniform and "val_loss" in last and last["loss"] < 0.75 * uniform:
        # trained, but its sequences predict the validation ones worse than guessing
        return text + (": overfit (training loss %.2f); expect its training data's fragments"
                       % last["loss"])
    if loss > 0.75 * uniform:
        return text + ": barely trained; expect near-random tokens"
    if loss > 0.45 * uniform:
        return text + (": an early model; expect the data's characters and short fragments, "
                       "not coherent text")
    return text


def encode(prompt, byte_level):
    """Token ids of a prompt; ValueError if it is empty or not token ids."""
    if byte_level:
        try:
            # the bytes themselves where the command line held some that are not UTF-8 (in
            # the str as surrogate escapes, os.fsdecode's): bytes are this model's tokens
            ids = list(prompt.encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError:      # other lone surrogates: no bytes stand behind them
            raise ValueError("not valid text (a lone surrogate, which is no character), got %r"
                             % prompt) from None
    else:
        # ASCII digits only: int() also reads "1_000" and other scripts' digits
        words = prompt.split()
        ids = [int(t) for t in words if t.isascii() and t.isdigit()]
        if len(ids) != len(words):
            raise ValueError("the model is not byte-level: the prompt must be space-separated "
                             "token ids, got %r" % prompt)
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


class Detokenizer:
    """Text of token ids as they come, piece by piece: byte-level ids through an incremental
    UTF-8 decoder (a character whose bytes span several tokens appears once, whole; ids past
    the 256 bytes, which a larger vocabulary can still sample, are left out), others as
    space-separated ids."""

    def __init__(self, byte_level):
        self.byte_level = byte_level
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.started = False

    def __call__(self, ids, final=False):
        """The text that ids add (final: the last piece, flushing a partial character)."""
        if self.byte_level:
            return self.utf8.decode(bytes(i for i in ids if i < 256), final)
        text = (" " if self.started and ids else "") + " ".join(map(str, ids))
        self.started = self.started or bool(ids)
        return text


def decode(ids, byte_level):
    return Detokenizer(byte_level)(ids, final=True)


class NonFiniteLogits(ValueError):
    """The model's logits hold NaN or +inf (or a row is all -inf): its weights, finite as they
    may be, overflow in its forward, as those of a run that diverged do."""


def sample_next(logits, temperature, top_k=None, generator=None):
    """(batch, 1) token ids from logits (batch, vocab): the most likely for temperature <= 0
    (or one so small that logits / temperature overflow), else sampled at that temperature
    among the top_k most likely (all for None or 0)."""
    scaled = logits / temperature if temperature > 0 else None
    if scaled is None or (torch.isfinite(logits) & ~torch.isfinite(scaled)).any():
        return logits.argmax(-1, keepdim=True)
    logits = scaled
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, -1), 1, generator=generator)


@torch.no_grad()
def sample_steps(model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None,
                 use_cache=True):
    """Yields the max_new_tokens tokens (batch, 1) sampled after idx (batch, n), one a step.
    use_cache=False recomputes every step from scratch (the reference the cache must match; see
    the module docstring)."""
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
        last = logits[:, -1]
        if (last.isnan() | (last == math.inf)).any() or (last == -math.inf).all(-1).any():
            raise NonFiniteLogits("the model's logits at token %d are not finite: its weights "
                                  "overflow, as those of a run that diverged do" % (step + 1))
        token = sample_next(last, temperature, top_k, generator)
        idx = torch.cat([idx, token], 1)
        yield token


def generate_ids(model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None,
                 use_cache=True):
    """idx (batch, n) followed by max_new_tokens sampled tokens (sample_steps)."""
    return torch.cat([idx, *sample_steps(model, idx, max_new_tokens, temperature, top_k,
                                         generator, use_cache)], 1)


def stream(model, ids, max_new_tokens, temperature=0.8, top_k=40, seed=0, use_cache=True):
    """Yields the max_new_tokens ids sampled after the prompt's ids, one at a time."""
    generator = torch.Generator().manual_seed(seed)
    for token in sample_steps(model, torch.tensor([ids]), max_new_tokens, temperature, top_k,
                              generator, use_cache):
        yield token.item()


def generate(model, ids, max_new_tokens, temperature=0.8, top_k=40, seed=0, use_cache=True):
    """The prompt's ids followed by max_new_tokens sampled ones."""
    return ids + list(stream(model, ids, max_new_tokens, temperature, top_k, seed, use_cache))
