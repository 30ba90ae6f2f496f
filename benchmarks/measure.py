"""Timing: interleaved (round-robin) samples, so that machine noise — other processes,
thermal and frequency changes — falls on every contender alike, and robust statistics."""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Mapping, Sequence

__all__ = ["Stats", "interleaved", "steps_for", "summarize", "time_steps"]

Sampler = Callable[[], float]  # takes one timing sample; returns seconds per step


@dataclasses.dataclass(frozen=True)
class Stats:
    """Seconds per step over the samples: median, quartiles, extremes."""
    median: float
    q1: float
    q3: float
    min: float
    max: float
    samples: int

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1


def summarize(samples: Sequence[float]) -> Stats:
    xs = sorted(samples)
    if not xs:
        raise ValueError("no samples")
    if len(xs) == 1:
        q1 = q3 = xs[0]
    else:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return Stats(statistics.median(xs), q1, q3, xs[0], xs[-1], len(xs))


def time_steps(step: Callable[[], object], block: Callable[[object], object], n: int) -> float:
    """Runs `step` n times, waiting for each result; returns seconds per step."""
    t0 = time.perf_counter()
    for _ in range(n):
        block(step())
    return (time.perf_counter() - t0) / n


def steps_for(seconds_per_step: float, min_sample_seconds: float, cap: int = 1000) -> int:
    """How many steps make one sample last at least `min_sample_seconds`."""
    if seconds_per_step <= 0:
        return cap
    return max(1, min(cap, math.ceil(min_sample_seconds / seconds_per_step)))


def interleaved(samplers: Mapping[str, Sampler], repeats: int,
                on_round: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """`repeats` rounds; each round takes one sample of every sampler, starting each
    round one position later so no contender always runs first (or right after a given
    other one)."""
    names = list(samplers)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            out[name].append(samplers[name]())
        if on_round is not None:
            on_round(r)
    return out
