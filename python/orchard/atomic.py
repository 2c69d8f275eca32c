"""Files replaced atomically: checkpoints, metrics, prepared data.

The new content goes to a temporary file in the same folder, is flushed to disk (fsync) and
renamed over the old file: rename is atomic, so a reader (or the next run after a crash or a
power loss) sees either the previous file or the new one, never half of one. The file gets the
permissions of any new file (0666 less the umask), or keeps those of the file it replaces.
A symbolic link's target is replaced, not the link (as a shell's `>` writes through it); a
device, FIFO or socket (a named pipe) cannot be replaced and is written in place, and so are the
process's standard output and error (`/dev/stdout`, `/dev/stderr`, or the file one is redirected
to): through them, so that a shell's `>>` appends and its `>` keeps the file it opened.
"""
import contextlib
import errno
import glob
import os
import secrets
import signal
import stat
import sys
import threading


def _temporary(name, part):
    """The name of a temporary file of a write to `name` in its folder."""
    return ".%s.%s.tmp" % (name, part)


def temporary_name(name):
    """The name of the temporary file a write to `name` makes first (the longest it gives a
    file in that folder)."""
    return _temporary(name, "0" * 16)   # (as secrets.token_hex(8) below)


def leftovers(path):
    """The temporary files of writes to `path` that never finished (a killed process's): only
    for a caller that knows no write to it is under way."""
    folder, name = os.path.split(os.path.abspath(path))
    return glob.glob(os.path.join(glob.escape(folder), _temporary(glob.escape(name), "*")))


def _names_descriptor(path, fd):
    try:
        return os.path.samestat(os.stat(path), os.fstat(fd))
    except OSError:     # no such file, or no such descriptor
        return False


def is_stdout(path):
    """Whether path names this process's standard output (file descriptor 1): `/dev/stdout`,
    or the file it is redirected to."""
    return _names_descriptor(path, 1)


def _standard_stream(path):
    """The descriptor (1 or 2) of the standard output or error that path names, and its
    Python stream, or None. Not a stream that is None: its descriptor, closed, may hold any
    file opened since. A console script started with stdout or stderr closed holds /dev/null
    there (its stream marked orchard_closed): named as /dev/null, that is neither."""
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        if stream is None or not _names_descriptor(path, fd):
            continue
        if getattr(stream, "orchard_closed", False) and os.path.abspath(path) == os.devnull:
            continue
        return fd, stream
    return None


def written_in_place(path):
    """Whether path is a device or FIFO (/dev/null), which write_atomically writes itself,
    never replacing it by a file."""
    return os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path)


def replaced_file(path):
    """The file write_atomically replaces for path (a link's target), or None where it writes
    path itself (a standard stream, a device or FIFO). OSError (ELOOP) for a link that loops:
    the rename would replace the link."""
    if _standard_stream(path) is not None or written_in_place(path):
        return None
    target = os.path.realpath(path)
    if os.path.islink(target):
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
    return target


@contextlib.contextmanager
def _terminate_cleans_up():
    """SIGTERM, where it would end the process at once (its default action), raises
    SystemExit(143) meanwhile instead, so that the temporary file is removed (a killed
    orchard-prepare left hundreds of megabytes of it)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL):
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def write_atomically(path, write):
    """Calls write(f) on a temporary file beside `path`, syncs it and renames it over `path`."""
    standard = _standard_stream(path)
    if standard is not None:
        # (opened again by its name, a redirected stdout's or stderr's file would be truncated,
        # or replaced: the shell's appended-to log lost, its `>` file left unlinked)
        fd, stream = standard
        if getattr(stream, "orchard_closed", False):
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        for text in (sys.stdout, sys.stderr):   # (both: they may share the file)
            if text is not None:
                text.flush()
        with os.fdopen(os.dup(fd), "wb") as f:
            write(f)
        return
    if written_in_place(path):
        with open(path, "wb") as f:
            write(f)
        return
    # the folder named is made, not a link's target's: a shell's `>` through a link to a
    # folder that is not there fails, and it had been made, wherever the link pointed
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    path = replaced_file(path)
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, _temporary(os.path.basename(path), secrets.token_hex(8)))
    with _terminate_cleans_up():
        # os.open applies the umask to 0o666, as open() does (tempfile.mkstemp makes 0o600
        # files)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                if os.path.exists(path):
                    os.fchmod(f.fileno(), stat.S_IMODE(os.stat(path).st_mode))
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            # (gone already where an interrupt came just after the rename)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    # The rename itself lives in the folder's metadata: sync it too, or a power loss could
    # bring back the old name.
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class WriteErrors:
    """A file's write() and flush(), keeping what they raised (error): where a caller sees
    another exception than the write's (torch.save's zip writer reports a full disk as a
    RuntimeError that names no cause), or must tell a failed write from other errors."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except BaseException as exc:
            self.error = exc
            raise

    def flush(self):
        try:
            self.f.flush()
        except BaseException as exc:
            self.error = exc
            raise
