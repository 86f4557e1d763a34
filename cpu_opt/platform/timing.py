"""Interleaved timing: the one way cpu_opt compares backends, in ``calibrate``, ``autotune`` and the
benchmarks (``bench/runner.py`` re-exports :func:`measure`).

On a shared machine absolute times drift by tens of percent between runs, so candidates are timed
round-robin in one process (the order rotates each round, so none always runs first or right after
another's cache damage) and compared by their medians.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable


@dataclass
class Stats:
    median: float   # seconds
    q25: float
    q75: float
    min: float
    runs: int

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median."""
        return (self.q75 - self.q25) / self.median if self.median else 0.0


def _stats(samples: list[float]) -> Stats:
    s = sorted(samples)
    qs = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
    return Stats(median=statistics.median(s), q25=qs[0], q75=qs[2], min=s[0], runs=len(s))


def measure(fns: dict[str, Callable[[], object]], *, warmup: int = 3, repeats: int = 15,
            inner: int = 1, max_seconds: float | None = None) -> dict[str, Stats]:
    """Time each callable ``repeats`` times, interleaved (round-robin, rotating the start), after
    ``warmup`` calls each. ``inner`` calls are timed together and divided (for very short calls).
    ``max_seconds`` stops adding rounds once exceeded (at least 3 rounds are kept)."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    samples: dict[str, list[float]] = {n: [] for n in names}
    t_start = time.perf_counter()
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            f = fns[n]
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            samples[n].append((time.perf_counter() - t0) / inner)
        if max_seconds is not None and r >= 2 and time.perf_counter() - t_start > max_seconds:
            break
    return {n: _stats(v) for n, v in samples.items()}
