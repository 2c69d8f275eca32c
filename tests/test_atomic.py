"""orchard.atomic.write_atomically: the old file or the new one, never half; the permissions
of a new file (0666 less the umask), or those of the file replaced."""
import errno
import os
import stat

import pytest
from conftest import run_python

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


def test_sigterm_during_a_write_leaves_the_old_file_and_no_temporary(tmp_path):
    """SIGTERM's default action ends the process at once: during a write it ends it by
    SystemExit instead (status 143, as the signal's), after removing the temporary file (a
    terminated orchard-prepare left one, hundreds of megabytes, that nothing removed)."""
    path = tmp_path / "tokens.json"
    path.write_bytes(b"old")
    result = run_python("""
        import os, signal
        from orchard.atomic import write_atomically
        def write(f):
            f.write(b"half")
            os.kill(os.getpid(), signal.SIGTERM)
            f.write(b"never")
        write_atomically(%r, write)
        """ % str(path))
    assert result.returncode == 143, result.stderr
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["tokens.json"]


def test_a_link_is_written_through(tmp_path):
    target = tmp_path / "data" / "tokens.json"
    target.parent.mkdir()
    target.write_bytes(b"old")
    link = tmp_path / "tokens.json"
    link.symlink_to(target)
    write_atomically(str(link), lambda f: f.write(b"new"))
    assert link.is_symlink() and target.read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path)) == ["data", "tokens.json"]



def test_a_link_to_a_missing_folder_fails_as_a_shells_redirection(tmp_path):
    """Written through as by `>`: to a folder that is not there, ENOENT and nothing made (the
    folder had been made, wherever the link led); the link's own folder is made as for a
    file."""
    link = tmp_path / "tokens.json"
    link.symlink_to(tmp_path / "gone" / "deeper" / "tokens.json")
    with pytest.raises(FileNotFoundError):
        write_atomically(str(link), lambda f: f.write(b"new"))
    assert link.is_symlink() and os.listdir(tmp_path) == ["tokens.json"]
    write_atomically(str(tmp_path / "made" / "x.json"), lambda f: f.write(b"x"))
    assert (tmp_path / "made" / "x.json").read_bytes() == b"x"


def test_a_link_that_loops_is_not_replaced(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.symlink_to(b)
    b.symlink_to(a)
    with pytest.raises(OSError) as info:
        write_atomically(str(a), lambda f: f.write(b"new"))
    assert info.value.errno == errno.ELOOP
    assert a.is_symlink() and b.is_symlink() and sorted(os.listdir(tmp_path)) == ["a.json",
                                                                                   "b.json"]


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



def test_an_interrupt_just_after_the_rename_stays_an_interrupt(tmp_path, monkeypatch):
    """A Ctrl-C that lands between the rename and the folder's sync finds the temporary file
    gone (renamed): it reaches the caller as it came, not as the FileNotFoundError of removing
    that file, and the new file is in place."""
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"old")
    rename = os.replace

    def rename_then_interrupt(src, dst):
        rename(src, dst)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", rename_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_atomically(str(path), lambda f: f.write(b"new"))
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["checkpoint.pt"]


def test_a_ctrl_c_inside_a_checkpoint_write_stays_a_ctrl_c(tmp_path, monkeypatch):
    """torch.save's zip writer turns whatever a write raises into a RuntimeError ("unexpected
    pos"): a Ctrl-C that lands in a write (a second one, while the first one's checkpoint is
    saved) reaches the caller as a KeyboardInterrupt (the console scripts' "interrupted",
    status 130), the previous checkpoint in place and no temporary file left."""
    torch = pytest.importorskip("torch")
    from orchard.checkpoint import save_checkpoint

    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"the previous checkpoint")
    fdopen = os.fdopen

    class Interrupted:
        """A file whose second write is interrupted."""

        def __init__(self, f):
            self.f, self.writes = f, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.writes += 1
            if self.writes == 2:
                raise KeyboardInterrupt
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: Interrupted(fdopen(fd, mode)))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"w": torch.zeros(1000)}, str(path))
    assert path.read_bytes() == b"the previous checkpoint"
    assert os.listdir(tmp_path) == ["checkpoint.pt"]
