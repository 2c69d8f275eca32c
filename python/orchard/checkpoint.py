"""Checkpoints that survive a crash mid-write and load on any device.

A checkpoint is written atomically (orchard.atomic): a reader sees either the previous
checkpoint or the new one, never half of one. Tensors are saved from CPU and loaded to CPU
(map_location), so a checkpoint carries no device; the trainer moves things where it needs.
"""
import contextlib
import os

import torch

from .atomic import write_atomically
from .config import ConfigError, first_line


class _Writes:
    """A file's write(), keeping the OSError it raised: torch.save's zip writer reports a
    failed write (a full disk) as a RuntimeError ("unexpected pos") that names no cause."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self):
        self.f.flush()


def save_checkpoint(state, path):
    def save(f):
        writes = _Writes(f)
        try:
            torch.save(state, writes)
        except RuntimeError:
            if writes.error is not None:
                raise writes.error from None
            raise
    write_atomically(path, save)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: missing, not a checkpoint, or damaged."""


def checkpoint_path(path):
    """A checkpoint file, or the checkpoint.pt of a training output folder."""
    return os.path.join(path, "checkpoint.pt") if os.path.isdir(path) else path


# What every checkpoint of this format holds (orchard.trainer.Trainer.state_dict).
FORMAT = 1
KEYS = ("model", "optimizer", "step", "seed", "config", "model_config", "data", "metrics", "rng")


def load_checkpoint(path):
    path = checkpoint_path(path)
    try:
        # weights_only: a checkpoint is data (tensors, numbers, strings), never code to run.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise CheckpointError("%s: cannot read the checkpoint: %s" % (path, exc.strerror)) from None
    except Exception as exc:  # torch reports a damaged file with many types and long advice
        raise CheckpointError("%s: not a readable orchard checkpoint (torch.load raised %s)"
                              % (path, type(exc).__name__)) from None
    problem = _problem(state)
    if problem:
        raise CheckpointError("%s: not an orchard checkpoint of format %d (an orchard-train "
                              "checkpoint.pt): %s" % (path, FORMAT, problem))
    return state


def _problem(state):
    """What keeps a loaded object from being a checkpoint (a state dict, a tensor or a
    transformers weights file loads too), or None."""
    missing = [k for k in KEYS if k not in state] if isinstance(state, dict) else list(KEYS)
    if missing:
        return "it lacks %s" % ", ".join(missing)
    if state.get("format") != FORMAT:
        return "its format is %r" % (state.get("format"),)
    if not (isinstance(state["step"], int) and state["step"] >= 0):
        return "its step is %r, not a step count" % (state["step"],)
    return None


@contextlib.contextmanager
def checkpoint_contents(path):
    """What a checkpoint's contents raise while a model is built and loaded from them (weights
    of other shapes, a model config of other types, an hf_config that is not JSON) as one
    CheckpointError naming the file; the checks of load_checkpoint see only the keys."""
    try:
        yield
    except (ConfigError, CheckpointError):     # they name their source already
        raise
    except (RuntimeError, TypeError, ValueError, KeyError, ZeroDivisionError) as exc:
        why = first_line(exc)
        raise CheckpointError("%s: its contents do not make a model (%s: %s)"
                              % (path, type(exc).__name__, why)) from None
