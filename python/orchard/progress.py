"""Progress of long work (training, data preparation, benchmarks, tuning) on stderr.

On a terminal it is a tqdm bar with rate and ETA, redrawn in place; elsewhere (CI logs, files)
a plain line every `every` seconds and one at the end, since a redrawn bar would fill a log
with carriage returns. every=None leaves the plain lines to the caller (the trainer's
periodic log lines are its report).
"""
import sys
import time


class Progress:
    def __init__(self, total, desc, unit="it", start=0, every=30.0, stream=None, enabled=True):
        self.total, self.desc, self.unit, self.start, self.every = total, desc, unit, start, every
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.bar = None
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc=desc, unit=unit, file=self.stream,
                            dynamic_ncols=True)
        self.t0 = self.last_line = time.perf_counter()
        self.done, self.note = start, ""

    def update(self, done, text=""):
        """`done` of `total` finished; text is a short note (a loss, the item at hand)."""
        self.done, self.note = done, text
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            if text:
                self.bar.set_postfix_str(text, refresh=False)
        elif self.enabled and self.every is not None:
            now = time.perf_counter()
            if now - self.last_line >= self.every and done < self.total:   # close() ends
                self.last_line = now
                self.write(self.line(now))

    def write(self, text):
        self.stream.write(text + "\n")
        self.stream.flush()

    def line(self, now):
        """The plain progress line, with the latest note."""
        elapsed = now - self.t0
        rate = (self.done - self.start) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        return "%s: %d/%d %s (%.0f%%), %.2f %s/s, eta %d:%02d" % (
            self.desc, self.done, self.total, self.unit, 100 * self.done / max(1, self.total),
            rate, self.unit, eta // 60, eta % 60) + (" " + self.note if self.note else "")

    def close(self, report=True):
        """The bar left on the terminal, or the final plain line written; report=False, for
        work that ends in an error, clears the bar and writes nothing, so that the error is the
        only line left."""
        if self.bar is not None:
            self.bar.leave = report
            self.bar.close()
        elif report and self.enabled and self.every is not None:
            self.write(self.line(time.perf_counter()))
