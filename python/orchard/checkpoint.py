"""Checkpoints (and the metrics beside them) that survive a crash mid-write; checkpoints load
on any device.

A checkpoint (or metrics file) is written to a temporary file in the same folder, flushed to
disk (fsync) and renamed over the old one: rename is atomic, so a reader sees either the
previous file or the new one, never half of one. Tensors are saved from CPU and loaded to CPU
(map_location), so a checkpoint carries no device; the trainer moves things where it needs.
"""
import os
import tempfile

import torch


def write_atomically(path, write):
    """Calls write(f) on a temporary file beside `path`, syncs it and renames it over `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp",
                               dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    # The rename itself lives in the folder's metadata: sync it too, or a power loss could
    # bring back the old name.
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(state, path):
    write_atomically(path, lambda f: torch.save(state, f))


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: missing, not a checkpoint, or damaged."""


def checkpoint_path(path):
    """A checkpoint file, or the checkpoint.pt of a training output folder."""
    return os.path.join(path, "checkpoint.pt") if os.path.isdir(path) else path


def load_checkpoint(path):
    path = checkpoint_path(path)
    try:
        # weights_only: a checkpoint is data (tensors, numbers, strings), never code to run.
        return torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise CheckpointError("%s: cannot read the checkpoint: %s" % (path, exc.strerror)) from None
    except Exception as exc:  # torch reports a damaged file with many types and long advice
        raise CheckpointError("%s: not a readable orchard checkpoint (torch.load raised %s)"
                              % (path, type(exc).__name__)) from None
