"""Text generation from a checkpoint written by orchard-train.

Models trained on byte-level data (a vocabulary of 256: the default data and orchard-prepare's
output) take and give text; others space-separated token ids. The sampling itself
(temperature, top-k) is GPT.generate.
"""
import math

import torch

from .checkpoint import load_checkpoint
from .device_backend import get_device_backend
from .model import GPT, GPTConfig


def load_model(checkpoint, device="auto"):
    """(model in eval mode with orchard attention on `device`, whether it is byte-level);
    checkpoint is a path (file or output folder) or a checkpoint already loaded."""
    state = checkpoint if isinstance(checkpoint, dict) else load_checkpoint(checkpoint)
    model = GPT(GPTConfig.from_dict(state["model_config"]))
    model.load_state_dict(state["model"])
    model.eval()
    get_device_backend(device).setup().patch_model(model)
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
    if byte_level:
        return bytes(ids).decode("utf-8", errors="replace")
    return " ".join(map(str, ids))


def generate(model, ids, max_new_tokens, temperature=0.8, top_k=40, seed=0):
    """The prompt's ids followed by max_new_tokens sampled ones."""
    generator = torch.Generator().manual_seed(seed)
    return model.generate(torch.tensor([ids]), max_new_tokens, temperature, top_k,
                          generator=generator)[0].tolist()
