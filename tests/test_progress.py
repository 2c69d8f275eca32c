"""orchard.progress: a tqdm bar with rate and ETA on a terminal, plain lines elsewhere."""
import io

from orchard.progress import Progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_a_bar_with_rate_and_eta():
    stream = Terminal()
    bar = Progress(4, "training", unit="steps", stream=stream)
    for done in range(1, 5):
        bar.update(done, "loss 1.000")
    bar.close()
    text = stream.getvalue()
    assert "\r" in text and "training" in text and "4/4" in text and "100%" in text
    assert "steps/s" in text and "<" in text and "loss 1.000" in text   # rate, ETA, note


def test_elsewhere_plain_lines_and_one_at_the_end():
    stream = io.StringIO()
    bar = Progress(3, "reading", unit="files", every=0.0, stream=stream)
    for done in range(1, 4):
        bar.update(done)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in stream.getvalue()
    assert lines[-1].startswith("reading: 3/3 files (100%), ") and "files/s, eta 0:00" in lines[-1]
    # every=None: the caller reports (the trainer's log lines); disabled (--quiet): nothing
    for stream, kwargs in ((io.StringIO(), {"every": None}), (Terminal(), {"enabled": False})):
        silent = Progress(3, "x", stream=stream, **kwargs)
        silent.update(3)
        silent.close()
        assert stream.getvalue() == ""


def test_work_that_ends_in_an_error_leaves_no_line():
    """close(report=False): the error that follows is the only line (orchard-prepare of
    binary files alone)."""
    plain = io.StringIO()
    bar = Progress(3, "reading", unit="files", stream=plain)
    bar.update(3)
    bar.close(report=False)
    assert plain.getvalue() == ""
    terminal = Terminal()
    bar = Progress(3, "reading", unit="files", stream=terminal)
    bar.update(3)
    bar.close(report=False)
    text = terminal.getvalue()
    assert "reading" in text and "\n" not in text and text.endswith(" \r")   # drawn, cleared
