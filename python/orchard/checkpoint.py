"""Checkpoints that survive a crash mid-write and load on any device.

A checkpoint is written atomically (orchard.atomic): a reader sees either the previous
checkpoint or the new one, never half of one. Tensors are saved from CPU and loaded to CPU
(map_location), so a checkpoint carries no device; the trainer moves things where it needs.
"""
import contextlib
import numbers
import os
import zipfile

import torch

from .atomic import WriteErrors, write_atomically
from .config import ConfigError, first_line
from .data import file_problem
from .device_backend import DeviceBackend
from .hf_causal_lm import parameter_count


def save_checkpoint(state, path):
    # torch.save's zip writer reports a failed write (a full disk) as a RuntimeError
    # ("unexpected pos") that names no cause, and a Ctrl-C that lands in a write (a second
    # one, while the first one's checkpoint is saved) so too: the write's own is raised
    def save(f):
        writes = WriteErrors(f)
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
    problem = file_problem(path, "checkpoint")   # (/dev/zero was read without end)
    if problem:
        raise CheckpointError("%s: %s" % (path, problem))
    damaged = _damaged_part(path)
    if damaged:
        raise CheckpointError("%s: damaged: its part %s does not match the checksum it was "
                              "written with (the file changed after orchard-train wrote it)"
                              % (path, damaged))
    try:
        # a zip archive's first bytes (torch.load's own test; a zip cut short still has them,
        # and torch.load says what is wrong with it): torch.load's words for a text file or a
        # plain pickle are a KeyError and warnings
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"
    except OSError as exc:
        raise CheckpointError("%s: cannot read the checkpoint: %s" % (path, exc.strerror)) from None
    if not zipped:
        raise CheckpointError("%s: not a readable orchard checkpoint (not a zip archive, as "
                              "torch.save writes checkpoints)" % path)
    try:
        # weights_only: a checkpoint is data (tensors, numbers, strings), never code
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch reports a damaged file with many types and long advice
        # (an archive cut short is an OSError, EINVAL, read as the file's: "cannot read the
        # checkpoint: Invalid argument")
        raise CheckpointError("%s: not a readable orchard checkpoint, cut short or damaged "
                              "(torch.load raised %s)" % (path, type(exc).__name__)) from None
    problem = _problem(state)
    if problem:
        raise CheckpointError("%s: not an orchard checkpoint of format %d (an orchard-train "
                              "checkpoint.pt): %s" % (path, FORMAT, problem))
    return state


def _damaged_part(path):
    """The name of a part of a checkpoint (a zip archive, as torch.save writes) whose CRC-32
    does not match its bytes, or None; torch.load does not check them, and a flipped bit in a
    weight would load unnoticed."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError):     # torch.load says what is wrong
        return None


def _is_int(x, least):
    """Whether x is an int from least to 2**63 - 1 (what torch's seeds and counts hold)."""
    return isinstance(x, int) and not isinstance(x, bool) and least <= x < 2**63


def _is_record(m):
    """A metrics record (Trainer.history): a step and its loss, maybe a validation loss."""
    # (the trainer keeps a diverged loss as NaN; only metrics.jsonl writes it as null)
    number = lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool)
    return (isinstance(m, dict) and _is_int(m.get("step"), 0) and "loss" in m
            and number(m["loss"]) and ("val_loss" not in m or number(m["val_loss"])))


def _problem(state):
    """What keeps a loaded object from being a checkpoint (a state dict, a tensor or a
    transformers weights file loads too, or a checkpoint whose fields were edited), or None."""
    missing = [k for k in KEYS if k not in state] if isinstance(state, dict) else list(KEYS)
    if missing:
        return "it lacks %s" % ", ".join(missing)
    if state.get("format") != FORMAT:
        return "its format is %r" % (state.get("format"),)
    if not _is_int(state["step"], 0):
        return "its step is %r, not a step count" % (state["step"],)
    planned = state.get("schedule_steps")
    if planned is not None and not _is_int(planned, 1):
        return "its schedule_steps is %r, not a step count" % (planned,)
    if not _is_int(state["seed"], -2**63):
        return "its seed is %r, not an integer" % (state["seed"],)
    for key in ("model", "config", "model_config", "data", "rng"):
        if not isinstance(state[key], dict):
            return "its %s is a %s, not a dict" % (key, type(state[key]).__name__)
    if not isinstance(state["metrics"], list):
        return "its metrics are a %s, not a list" % type(state["metrics"]).__name__
    bad = [m for m in state["metrics"] if not _is_record(m)]
    if bad:
        return "its metrics hold %r, not a step's record of its loss" % (bad[0],)
    return None


def check_model_size(model_cfg, weights, source, hf_config=None):
    """CheckpointError where a checkpoint's model config (model_cfg, validated), or its
    transformers config (hf_config, JSON; model_cfg is then not read), makes more parameters
    than its weights hold: a config edited by hand, whose model is built before the weights are
    compared (n_layer 10**12 built layers until the system ran out of memory)."""
    # each tensor once: the tied embedding is listed twice (wte, lm_head), one storage
    held = sum(t.numel() for t in {(t.data_ptr(), t.numel()): t for t in weights.values()
                                   if isinstance(t, torch.Tensor)}.values())
    if hf_config is None:
        wanted, what = DeviceBackend.count_parameters(model_cfg), "model_config"
    else:   # (counted on the meta device; None: a model that cannot be built there)
        wanted, what = parameter_count(hf_config, source) or 0, "hf_config"
    if wanted > held:
        raise CheckpointError("%s: its %s makes a model of at least %d parameters, more than "
                              "the %d values its weights hold: an edited or damaged checkpoint"
                              % (source, what, wanted, held))


def _optimizer_problem(optimizer):
    """What in the AdamW state loaded into optimizer does not fit it, or None."""
    def real(x, least=0.0):
        if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_complex():
            x = x.item()    # (AdamW keeps its step count as a one-element tensor)
        return (isinstance(x, numbers.Real) and not isinstance(x, bool)
                and least <= x < float("inf"))

    for g, group in enumerate(optimizer.param_groups):
        betas = group.get("betas")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(real(b) and b < 1 for b in betas)):
            return "group %d's betas are %r, not two numbers in [0, 1)" % (g, betas)
        for key in ("lr", "eps", "weight_decay"):
            if not real(group.get(key)):
                return "group %d's %s is %r, not a number >= 0" % (g, key, group.get(key))
        for p in group["params"]:
            for name, value in optimizer.state.get(p, {}).items():
                if name == "step":
                    if not real(value):
                        return "a step count of %r" % (value,)
                elif not (isinstance(value, torch.Tensor) and value.shape == p.shape
                          and value.dtype.is_floating_point):
                    return "%s of %s for a parameter of shape %s" % (
                        name, "shape %s, %s," % (tuple(value.shape), value.dtype)
                        if isinstance(value, torch.Tensor) else type(value).__name__,
                        tuple(p.shape))
    return None


def check_optimizer_state(optimizer, source):
    """CheckpointError where the AdamW state a checkpoint gave optimizer does not fit it (torch's
    load_state_dict checks only how many parameters each group holds): edited so, a moment of
    another shape or betas past 1 ended the first step in a traceback."""
    problem = _optimizer_problem(optimizer)
    if problem:
        raise CheckpointError("%s: its optimizer state holds %s: an edited or damaged "
                              "checkpoint" % (source, problem))


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
