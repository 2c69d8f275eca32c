"""What every console script shares: its argument parser, typed and range-checked argument
types, and the rule for errors.

An error in what the user gave (an argument, an environment variable, a config, data or
checkpoint file) ends the script with one line, `orchard-X: error: <what> (<the value>)`, and
exit status 2, before any work is done where it can be checked up front. --verbose or
ORCHARD_DEBUG=1 shows the full traceback instead; Ctrl-C ends with status 130.
"""
import argparse
import contextlib
import errno
import functools
import io
import logging
import math
import os
import re
import signal
import sys
import tempfile
import threading
import traceback

from ..atomic import WriteErrors, is_stdout, replaced_file, temporary_name

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(ValueError):
    """Input the user can fix; the console script prints it as one line and exits with 2."""


def _user_errors():
    # The library's own input errors. CheckpointError's module needs torch: if it was never
    # imported, no CheckpointError can have been raised.
    from ..config import ConfigError
    from ..data import DataError

    errors = (UsageError, ConfigError, DataError)
    checkpoint = sys.modules.get("orchard.checkpoint")
    return errors + ((checkpoint.CheckpointError,) if checkpoint else ())


def _build_options_error(exc):
    """The UsageError of an OpenCL program build that ORCHARD_CL_OPTIONS made fail (OpenCL
    checks build options only when it builds, so no earlier check sees them), else None."""
    from ..config import first_line

    options = os.environ.get("ORCHARD_CL_OPTIONS")
    if not options or "CL_INVALID_BUILD_OPTIONS" not in str(exc):
        return None
    return UsageError("environment variable ORCHARD_CL_OPTIONS=%r: OpenCL refused these build "
                      "options (%s)" % (options, first_line(exc)))


class _HeldRecords(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def reading(argument, value):
    """The library's error about a file the block reads (a config, the sequences) as the
    UsageError of the argument that named it; as it is where the argument was not given (value
    None: a built-in file)."""
    from ..config import ConfigError
    from ..data import DataError

    try:
        yield
    except (ConfigError, DataError) as exc:
        if value is None:
            raise
        raise UsageError("argument %s: %s" % (argument, exc)) from exc    # --verbose: both


@contextlib.contextmanager
def writing(argument, path):
    """An OSError in the block (a full disk, a device that takes no data) as the UsageError of
    the argument that named the file it writes: the checks before the work cannot see these."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, BrokenPipeError) and is_stdout(path):
            raise   # stdout's reader went away (`| head`): console_script's quiet status 1
        raise UsageError("argument %s: cannot write %r: %s"
                         % (argument, path, exc.strerror or exc)) from None


@contextlib.contextmanager
def logs_held_until_checked(logger, debug=False):
    """Holds the records `logger` (and its children) emit in the block and passes them on when
    it ends, unless it ends with an error in the user's input (and not debug): then the
    script's one error line is all it prints, not the setup's notes before it."""
    held = _HeldRecords()
    propagate = logger.propagate
    logger.addHandler(held)
    logger.propagate = False
    user_error = False
    try:
        yield
    except Exception as exc:
        user_error = isinstance(exc, _user_errors()) and not debug
        raise
    finally:
        logger.removeHandler(held)
        logger.propagate = propagate
        for record in [] if user_error else held.records:
            logger.handle(record)


def env_flag(name):
    """An on/off variable as orchard_ops reads its own: on when set to anything but empty, 0,
    false, no or off (in any case)."""
    return os.environ.get(name, "").lower() not in ("", "0", "false", "no", "off")


def debug_requested(argv):
    return env_flag("ORCHARD_DEBUG") or "--verbose" in argv


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's examples as written and adds each default once, to arguments whose
    help does not already say it ("Default: ..."; a help that only says the word, as
    generate --device's "orchard's default device", had gone without)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        # `is`, not `in`: a default of 0 equals False but is worth saying
        if (default is not None and default is not False and default is not argparse.SUPPRESS
                and action.option_strings and "default:" not in text.lower()):
            text += " Default: %(default)s."
        return text


class Parser(argparse.ArgumentParser):
    """argparse with the console scripts' error rule and the flags every script has."""

    def __init__(self, prog, description, examples=(), quiet=True, verbose_logs=None):
        epilog = "examples:\n" + "\n".join("  " + e for e in examples) if examples else None
        super().__init__(prog=prog, description=description, epilog=epilog,
                         formatter_class=_HelpFormatter)
        # values that start with a minus and a digit, lists and block pairs included
        # ("-1,8,64,64", "-64x64"), are values (argparse takes only plain negative numbers for
        # them, and "--shape -1,..." was "expected one argument", without the value): their
        # own check then names it
        self._negative_number_matcher = re.compile(r"^-\d[\d,.eExX+-]*$")
        chatter = self.add_mutually_exclusive_group()
        chatter.add_argument("--verbose", action="store_true",
                             help="Show the full traceback of an error (as ORCHARD_DEBUG=1 "
                                  "does)%s." % (", and log " + verbose_logs if verbose_logs
                                               else ""))
        if quiet:
            chatter.add_argument("--quiet", action="store_true",
                                 help="Log only warnings and errors to stderr; results still "
                                      "go to stdout.")

    def _get_values(self, action, arg_strings):
        # "--option=--": argparse (Python 3.11's at least) drops the "--" as the end of the
        # options and gives the option no value, unchecked ([]); it is the option's value
        if (arg_strings == ["--"] and action.option_strings
                and action.nargs not in (argparse.PARSER, argparse.REMAINDER)):
            values = [self._get_value(action, "--")]
            for value in values:
                self._check_value(action, value)
            return values[0] if action.nargs in (None, argparse.OPTIONAL) else values
        return super()._get_values(action, arg_strings)

    def error(self, message):
        # One line, not argparse's usage block: the message names the argument and value.
        self.exit(EXIT_USAGE, "%s: error: %s\n" % (self.prog, message))


def _typed(name, convert):
    convert.__name__ = name  # argparse names the type in its own messages
    return convert


# The largest integer a count or seed may be: torch.manual_seed's largest seed as it is, and
# what a checkpoint's and NumPy's signed 64 bits hold (a larger --max-steps ran "forever").
INT_MAX = 2 ** 63 - 1


def decimal(text):
    """The number a flag's text writes as the config files' integers (config.DECIMAL_INT): an
    int, or past int()'s 4,300 digits (and so past any bound a flag sets) an infinity of its
    sign; ValueError otherwise."""
    from ..config import DECIMAL_INT
    if not DECIMAL_INT.match(text):
        raise ValueError("not a decimal integer: %r" % text)
    if len(text.lstrip("+-0")) > 4000:
        return -math.inf if text[0] == "-" else math.inf
    return int(text)


def integer(minimum=None, maximum=INT_MAX):
    """An argparse type: an integer in minimum..maximum."""
    def parse(text):
        from ..config import shown
        try:
            value = decimal(text)
        except ValueError:
            raise argparse.ArgumentTypeError("must be an integer (got %s)" % shown(text)) \
                from None
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError("must be >= %d (got %s)" % (minimum, shown(text)))
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError("must be <= %d (got %s)" % (maximum, shown(text)))
        return value
    return _typed("integer", parse)


def number(minimum=None, maximum=None):
    """An argparse type: a finite float >= minimum and <= maximum, written as the config
    files' reals (config.DECIMAL_REAL)."""
    def parse(text):
        from ..config import DECIMAL_REAL
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is not None and not math.isfinite(value):
            raise argparse.ArgumentTypeError("must be a finite number (got %r)" % text)
        if value is None or not DECIMAL_REAL.match(text):   # as the config files' reals
            raise argparse.ArgumentTypeError("must be a number (got %r)" % text)
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError("must be >= %g (got %r)" % (minimum, text))
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError("must be <= %g (got %r)" % (maximum, text))
        return value
    return _typed("number", parse)


def shape(text):
    """An argparse type: B,H,N,D, four integers >= 1, D at most orchard's largest head dim,
    whose arrays (benchmark.ARRAYS_HELD of float32) fit in this machine's memory."""
    import orchard_ops

    from ..benchmark import ARRAYS_HELD, physical_memory

    try:
        dims = tuple(decimal(x) for x in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 4 or min(dims) < 1:
        raise argparse.ArgumentTypeError("a shape is B,H,N,D, four integers >= 1 (got %r)"
                                         % text)
    max_d = orchard_ops.build_info()["max_head_dim"]
    if dims[3] > max_d:
        raise argparse.ArgumentTypeError("D must be at most %d (got %r)" % (max_d, text))
    need, memory = 4 * ARRAYS_HELD * math.prod(dims), physical_memory()
    if need > memory:
        raise argparse.ArgumentTypeError("its arrays need %.3g GiB, more than this machine's "
                                         "%.3g GiB (got %r)" % (need / 2**30, memory / 2**30,
                                                                text))
    return dims


def path(what):
    """An argparse type: a path, not empty (an empty one would read as the current folder, or
    as no value at all); what names what it must be."""
    def parse(text):
        if not text:
            raise argparse.ArgumentTypeError("must name %s (got '')" % what)
        return text
    return _typed("path", parse)


def dotdot_problem(text):
    """Why the path text is refused for an output where a folder of it before a '..' does not
    exist, or None. The system finds no file behind such a path, where os.makedirs and
    os.path.realpath, which the writers go through, take the '..' away and reach an existing
    one: the checks for a file already there saw none, and it was replaced."""
    parts = text.split(os.sep)
    for i in range(1, len(parts)):
        folder = os.sep.join(parts[:i]) or os.sep
        if parts[i] == ".." and not os.path.isdir(folder):
            return "%s, before its '..', is not a folder" % folder
    return None


def names_a_file(text):
    """Whether the path text can name a file: not empty, nor ending as a folder's name does
    (a separator, '.' or '..')."""
    return bool(text) and not text.endswith(os.sep) and os.path.basename(text) not in (".", "..")


def output_file(text):
    """An argparse type: a file to write, in a folder that exists and takes new files (checked
    before the work whose results it will hold)."""
    folder = os.path.dirname(os.path.abspath(text))
    if not names_a_file(text) or os.path.isdir(text) or not os.path.isdir(folder):
        raise argparse.ArgumentTypeError("must be a file in an existing folder (got %r)" % text)
    problem = dotdot_problem(text)
    if problem:
        raise argparse.ArgumentTypeError("%s (got %r)" % (problem, text))
    problem = folder_problem(*written_where(text))
    if problem:
        raise argparse.ArgumentTypeError("must be a file in a folder this user can write to "
                                         "(got %r: %s)" % (text, problem))
    return text


def written_where(text):
    """(folder, name) of the file write_atomically makes for the path text: a link's target.
    ArgumentTypeError for a link that loops (the link itself would be replaced, where the
    checks for an existing file had not seen one) or that leads into no folder: like a
    shell's `>`, write_atomically makes none there."""
    try:
        target = replaced_file(text) or text
    except OSError:
        raise argparse.ArgumentTypeError("is a symbolic link that loops (got %r)" % text)
    folder = os.path.dirname(os.path.abspath(target))
    if os.path.islink(text) and not os.path.isdir(folder):
        raise argparse.ArgumentTypeError("is a symbolic link to %s, and %s is no folder (got %r)"
                                         % (target, folder, text))
    return folder, os.path.basename(target)


def folder_problem(folder, name=None):
    """Why folder (made when missing) cannot take new files, or the file `name` there, or None.
    Found by making and removing a temporary file in its nearest existing ancestor: permission
    bits alone do not say it for root or a read-only file system; and by measuring the names
    still to be made, with the temporary file each write makes first (a run's folder: its
    checkpoint's), against that file system's limits, which would refuse them only when the
    work is done."""
    existing = os.path.abspath(folder)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.exists(existing):
        return ("%s is a symbolic link whose target cannot be reached (missing, a loop, or "
                "behind a folder this user cannot search)" % existing)
    if not os.path.isdir(existing):
        return "%s is a file" % existing
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return "%s takes no new files (%s)" % (existing, exc.strerror or exc)
    written = temporary_name(name or "checkpoint.pt")
    made = [part for part in os.path.relpath(os.path.abspath(folder), existing).split(os.sep)
            if part != "."]
    checks = [("a name (%r)" % (part[:40] + "..."), len(os.fsencode(part)), "PC_NAME_MAX")
              for part in made]
    if name:
        checks.append(("a name (%r) with its temporary file's" % (name[:40] + "..."),
                       len(os.fsencode(written)), "PC_NAME_MAX"))
    checks.append(("the path", len(os.fsencode(os.path.join(os.path.abspath(folder), written)))
                   + 1, "PC_PATH_MAX"))
    for what, size, limit in checks:
        try:
            most = os.pathconf(existing, limit)
        except OSError:     # (a file system that does not say)
            continue
        if 0 < most < size:
            return "%s of %d bytes, where %s takes at most %d" % (what, size, existing, most)
    return None


def integer_list(minimum, maximum):
    """An argparse type: a comma-separated list of integers, each in minimum..maximum, each
    once."""
    def parse(text):
        try:
            items = [decimal(item) for item in text.split(",")]
        except ValueError:
            items = []
        if (not items or min(items) < minimum or max(items) > maximum
                or len(set(items)) < len(items)):
            raise argparse.ArgumentTypeError("must be a comma-separated list of integers in "
                                             "%d..%d, each once (got %r)"
                                             % (minimum, maximum, text))
        return items
    return _typed("list", parse)


def choices_list(choices):
    """An argparse type: a comma-separated list of some of `choices`, each once."""
    def parse(text):
        items = text.split(",")
        unknown = [item for item in items if item not in choices]
        if unknown or not text or len(set(items)) < len(items):
            raise argparse.ArgumentTypeError("must be a comma-separated list of %s, each once "
                                             "(got %r)" % (", ".join(choices), text))
        return items
    return _typed("list", parse)


def _resolved(text):
    """resolve_device's entry for a device argument; its error as an ArgumentTypeError."""
    from ..device_backend import resolve_device

    try:
        return resolve_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def device(text):
    """An argparse type: auto or a device orchard lists (resolve_device's forms)."""
    _resolved(text)
    return text


def devices(text):
    """An argparse type: a comma-separated list of devices (device's forms), each once; their
    ids ("opencl" and the id of the device it picks are one device, timed twice where the
    names were compared)."""
    ids = [_resolved(item)["id"] for item in text.split(",")]
    if len(set(ids)) < len(ids):
        raise argparse.ArgumentTypeError("must name each device once (got %r: %s)"
                                         % (text, ",".join(ids)))
    return ids


def check_device_environment():
    """UsageError if ORCHARD_ISA names a kernel set this CPU cannot run, ORCHARD_NUM_THREADS
    is not a thread count, an ORCHARD_CL_* variable has a value OpenCL calls refuse (devices()
    names it), ORCHARD_DEVICE names no device (device=auto would fail later), or torchrun's
    WORLD_SIZE or LOCAL_WORLD_SIZE is not a count of processes (LOCAL_WORLD_SIZE, the processes
    the memory plan shares the machine among, at most WORLD_SIZE)."""
    import orchard_ops

    from ..device_backend import process_count
    try:
        world, local = process_count("WORLD_SIZE"), process_count("LOCAL_WORLD_SIZE")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if local > world:
        raise UsageError("environment variable LOCAL_WORLD_SIZE is %d, more processes than "
                         "WORLD_SIZE's %d%s (torchrun sets both)"
                         % (local, world, "" if "WORLD_SIZE" in os.environ else ", unset"))
    try:
        listed = orchard_ops.devices()
    except ValueError as exc:   # what devices() reports: ORCHARD_ISA, ORCHARD_NUM_THREADS
        raise UsageError("environment variable %s" % exc)
    for d in listed:
        if d.get("environment_error"):     # an ORCHARD_CL_* value OpenCL calls refuse
            raise UsageError("environment variable %s" % d["environment_error"])
    name = os.environ.get("ORCHARD_DEVICE")
    if not name:
        return
    try:
        _resolved(None)
    except argparse.ArgumentTypeError:
        why = orchard_ops.opencl_unavailable() if name.lower().startswith("opencl") else None
        raise UsageError("environment variable ORCHARD_DEVICE names no available device (%r); "
                         "available: %s%s" % (name, ", ".join(d["id"] for d in listed),
                                              "; no OpenCL device: %s" % why if why else "")) \
            from None


class _WatchedStdout(WriteErrors):
    """sys.stdout in a console script: what a write or flush raised is kept, so that the
    script tells a stdout it cannot write (a full disk, an I/O error) from other OSErrors."""

    def __getattr__(self, name):
        return getattr(self.f, name)


def _devnull_at(fd):
    """/dev/null opened at descriptor fd: where fd is closed (a script started with `>&-` or
    `2>&-`), a file the script opens would take it otherwise, and what is written to fd
    (print, C code's messages) would land in that file; where fd is a stdout that failed, the
    exit's flush fails no more."""
    held = os.open(os.devnull, os.O_WRONLY)
    if held != fd:
        os.dup2(held, fd)
        os.close(held)


class _ClosedStdout(io.TextIOBase):
    """The standard output of a process started without one (`>&-`): Python gives it as None,
    which print() takes for "write nothing", silently. Writes fail here as a closed file
    descriptor's do, and /dev/null holds descriptor 1 (is_stdout() would take a file opened
    there for stdout)."""

    def __init__(self):
        _devnull_at(1)

    def write(self, text):
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    def fileno(self):
        return 1

    orchard_closed = True   # (write_atomically refuses a file named /dev/stdout then)


class _QuietStderr:
    """sys.stderr in a console script: its notes, progress and error lines are none of the
    script's results, so a stderr that cannot take them (its reader gone, `2>&1 >out | true`;
    a full disk) loses them and the work goes on. A BrokenPipeError there was taken for
    stdout's reader going away: orchard-prepare dropped its output. Started without a stderr
    (`2>&-`), /dev/null takes descriptor 2 (Python gives the stream as None, on which
    logging's setup failed and print() wrote to stdout)."""

    def __init__(self, f):
        self.orchard_closed = f is None     # (write_atomically refuses /dev/stderr then)
        if f is None:
            _devnull_at(2)
            f = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
        self.f = f

    def write(self, text):
        try:
            return self.f.write(text)
        except OSError:
            return len(text)

    def flush(self):
        try:
            self.f.flush()
        except OSError:
            pass

    def __getattr__(self, name):
        return getattr(self.f, name)


def console_script(prog, uses_devices=True):
    """Decorator of a script's main(argv): the environment is checked first, and the user's
    errors end in one line and status 2 (a traceback with --verbose or ORCHARD_DEBUG)."""
    def wrap(main):
        @functools.wraps(main)
        def run(argv=None):
            if argv is None and not isinstance(sys.stderr, _QuietStderr):
                sys.stderr = _QuietStderr(sys.stderr)
            if argv is None and sys.stdout is None:
                sys.stdout = _WatchedStdout(_ClosedStdout())
            elif argv is None and isinstance(sys.stdout, io.TextIOWrapper):
                # a sample's invalid bytes (U+FFFD) or a file name that is no UTF-8, on a
                # stdout of another encoding (latin-1), had ended in a traceback
                sys.stdout.reconfigure(errors="replace")
                sys.stdout = _WatchedStdout(sys.stdout)
            code = guarded(argv)
            if (argv is None and code > 128    # stopped by Ctrl-C (or SIGTERM: 143)
                    and threading.current_thread() is threading.main_thread()):
                # the process exits now: a second Ctrl-C would land in torch's exit handlers
                # and print a traceback there
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            return code

        def guarded(argv):
            debug = debug_requested(sys.argv[1:] if argv is None else list(argv))
            try:
                if uses_devices:
                    check_device_environment()
                return main(argv)
            except BrokenPipeError:
                # the reader of stdout went away (`| head`): not an error of ours to report;
                # stdout is pointed at /dev/null so that the exit's flush does not fail again
                _devnull_at(sys.stdout.fileno())
                return 1
            except KeyboardInterrupt:
                if debug:
                    raise
                print("%s: interrupted" % prog, file=sys.stderr)
                return EXIT_INTERRUPTED
            except OSError as exc:
                # stdout that cannot be written (a full disk, an I/O error): the one line
                # a file's write gets, and stdout pointed at /dev/null for the exit's flush
                if debug or exc is not getattr(sys.stdout, "error", None):
                    raise
                _devnull_at(sys.stdout.fileno())
                print("%s: error: cannot write to standard output: %s"
                      % (prog, exc.strerror or exc), file=sys.stderr)
                return 1
            except Exception as exc:
                from ..config import first_line, is_out_of_memory
                if is_out_of_memory(exc) and not debug:
                    # the machine's limit, not a bug to trace
                    print("%s: error: out of memory: %s"
                          % (prog, first_line(exc) or type(exc).__name__), file=sys.stderr)
                    return 1
                user = exc if isinstance(exc, _user_errors()) else _build_options_error(exc)
                if user is None:
                    raise
                if debug:   # the traceback in place of the line; the status is still 2
                    traceback.print_exc()
                else:
                    print("%s: error: %s" % (prog, user), file=sys.stderr)
                return EXIT_USAGE
        return run
    return wrap
