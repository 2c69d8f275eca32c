"""Files replaced atomically: checkpoints, metrics, prepared data.

The new content goes to a temporary file in the same folder, is flushed to disk (fsync) and
renamed over the old file: rename is atomic, so a reader (or the next run after a crash or a
power loss) sees either the previous file or the new one, never half of one.
"""
import os
import tempfile


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
