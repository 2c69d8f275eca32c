"""A dependency-free progress bar for the trainer.

On a terminal it redraws one line in place; elsewhere (CI logs, files) it draws nothing and
the trainer's periodic log lines are the progress report.
"""
import sys
import time


class ProgressBar:
    def __init__(self, total, start=0, stream=None, width=24):
        self.total, self.start, self.width = total, start, width
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.t0 = time.perf_counter()

    def update(self, step, text=""):
        if not self.enabled:
            return
        done = step / max(1, self.total)
        filled = int(self.width * done)
        elapsed = time.perf_counter() - self.t0
        rate = (step - self.start) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - step) / rate if rate > 0 else 0.0
        self.stream.write("\r\033[K%d/%d |%s%s| %3.0f%% %s eta %d:%02d" % (
            step, self.total, "#" * filled, "." * (self.width - filled), 100 * done, text,
            eta // 60, eta % 60))
        self.stream.flush()

    def close(self):
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
