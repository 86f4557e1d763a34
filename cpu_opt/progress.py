"""A one-line progress bar on stderr, for the long steps users wait on (``optimize(verbose=True)``,
``python -m cpu_opt calibrate``). Quiet unless enabled; no dependency."""
from __future__ import annotations

import sys
import time


class Progress:
    """``Progress(enabled, total, label)``; ``step(what)`` after each of ``total`` steps, then ``done()``."""

    def __init__(self, enabled: bool, total: int, label: str, width: int = 30):
        self.enabled, self.total, self.label, self.i, self.width = enabled, max(1, total), label, 0, width
        self.t0 = time.perf_counter()
        self.tty = enabled and sys.stderr.isatty()

    def step(self, what: str):
        self.i += 1
        if self.enabled and not self.tty:  # a log, not a terminal: one line per step, no carriage returns
            print(f"{self.label} {self.i}/{self.total} {what} {time.perf_counter() - self.t0:.1f}s",
                  file=sys.stderr, flush=True)
        elif self.enabled:
            filled = min(self.width, round(self.width * self.i / self.total)) if self.total > self.width else self.i
            empty = (self.width if self.total > self.width else self.total) - filled
            print(f"\r{self.label} [{'#' * filled}{'.' * empty}] {self.i}/{self.total} {what:<34.34} "
                  f"{time.perf_counter() - self.t0:5.1f}s", end="", file=sys.stderr, flush=True)

    def done(self):
        if self.tty:
            print(file=sys.stderr, flush=True)
