"""Text generation from a checkpoint written by orchard-train.

Models trained on byte-level data (a vocabulary of 256: the default data and orchard-prepare's
output) take and give text; others space-separated token ids. The sampling itself
(temperature, top-k) is GPT.generate.
"""
import torch

from .checkpoint import load_checkpoint
from .device_backend import get_device_backend
from .model import GPT, GPTConfig


def load_model(checkpoint, device="auto"):
    """(model in eval mode with orchard attention on `device`, whether it is byte-level)."""
    state = load_checkpoint(checkpoint)
    model = GPT(GPTConfig.from_dict(state["model_config"]))
    model.load_state_dict(state["model"])
    model.eval()
    get_device_backend(device).setup().patch_model(model)
    return model, state["data"].get("byte_level", False)


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
