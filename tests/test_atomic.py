"""orchard.atomic.write_atomically: the old file or the new one, never half; the permissions
of a new file (0666 less the umask), or those of the file replaced."""
import os
import stat

import pytest

from orchard.atomic import write_atomically


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_a_new_file_gets_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        write_atomically(str(tmp_path / "new.json"), lambda f: f.write(b"{}"))
    finally:
        os.umask(old)
    assert mode(tmp_path / "new.json") == 0o666 & ~umask
    assert (tmp_path / "new.json").read_bytes() == b"{}"


def test_a_replaced_file_keeps_its_permissions(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    write_atomically(str(path), lambda f: f.write(b"new"))
    assert path.read_bytes() == b"new" and mode(path) == 0o640


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"old")

    def fail(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(str(path), fail)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["checkpoint.pt"]


def test_a_link_is_written_through(tmp_path):
    target = tmp_path / "data" / "tokens.json"
    target.parent.mkdir()
    target.write_bytes(b"old")
    link = tmp_path / "tokens.json"
    link.symlink_to(target)
    write_atomically(str(link), lambda f: f.write(b"new"))
    assert link.is_symlink() and target.read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path)) == ["data", "tokens.json"]


def test_a_fifo_is_written_in_place_not_replaced(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)     # so the writer's open returns
    try:
        write_atomically(str(fifo), lambda f: f.write(b"through"))
        assert os.read(reader, 100) == b"through"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and os.listdir(tmp_path) == ["pipe"]

