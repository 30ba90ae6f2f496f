"""A scan's levels for a budget: its body's own ladder while each iteration saves its cut,
and below that the carry checkpointed every k-th iteration, the backward recomputing each
segment of k iterations from its checkpoint (nested remat, k up to about sqrt(n))."""
from __future__ import annotations

import dataclasses
import math

from aotgrad.partition.budget_value import Budget, Bytes

__all__ = ["ScanSchedule", "scan_schedule"]


@dataclasses.dataclass(frozen=True)
class ScanSchedule:
    """How one scan is differentiated: its body cut at `body_budget`, and the carry
    checkpointed every `every` iterations (1: the body's cut is saved every iteration)."""
    body_budget: float
    every: int


def scan_schedule(length: int, carry: int, per_iteration: tuple[int, int], sliced: int,
                  budget: Budget) -> ScanSchedule:
    """The schedule of a scan of `length` iterations at `budget`.

    `carry`: bytes of one iteration's carry; `per_iteration`: bytes one iteration saves
    under its body's cut at body budgets 0 and 1 (the carry included); `sliced`: bytes of
    one iteration's slices of `xs` and `ys`. The levels, from most to least saved bytes:

    - every = 1: `length` x the body's bytes, for each body budget (its own ladder);
    - every = k > 1: ceil(length / k) carries. The backward recomputes one segment at a
      time, so about ceil(length / k) x carry + k x (body bytes at budget 0) are live,
      plus the segment's slices of `xs` / `ys` and their cotangents (2 k x `sliced`,
      copied in and out of the segment; the stacked layer weights of a scanned model).
      k grows only while that estimate of the peak falls (k up to about sqrt(length)),
      so saved bytes and the peak both fall as the budget does. A k that does not divide
      `length` leaves a shorter last segment, which copies `xs` and `ys` once more (length
      x `sliced`: an RNN of 256 steps peaked 1.6x higher every 5th step than every 4th).

    The budget spans these levels in bytes, as `within_budget` spans a ladder: the limit
    is B0 + budget x (B1 - B0), or the budget itself if it is `Bytes`; every = 1 is preferred whenever it fits (no extra
    forward), else the smallest k that fits.
    """
    r0, r1 = per_iteration

    def peak(k: int, whole: bool = False) -> int:  # whole: as if k divided length
        if k == 1:
            return length * r0 + 2 * sliced
        copies = 0 if whole or length % k == 0 else length * sliced
        return math.ceil(length / k) * carry + k * (r0 + 2 * sliced) + copies

    def body_budget(limit: float) -> float:  # the body's own ladder, saving `limit` in all
        return 1.0 if r1 <= r0 else min(max((limit / length - r0) / (r1 - r0), 0.0), 1.0)

    segments = [1]
    for k in range(2, length + 1):  # while the peak estimate falls, each new saved level
        if peak(k, whole=True) >= peak(segments[-1]):
            break
        if math.ceil(length / k) < math.ceil(length / segments[-1]) and peak(k) < peak(segments[-1]):
            segments.append(k)
    if len(segments) == 1:  # segments would not lower the peak: the body's own ladder
        return ScanSchedule(body_budget(budget.n) if isinstance(budget, Bytes) else budget, 1)
    b0 = math.ceil(length / segments[-1]) * carry
    limit = float(budget.n) if isinstance(budget, Bytes) else b0 + budget * max(length * r1 - b0, 0)
    if length * r0 <= limit:
        return ScanSchedule(body_budget(limit), 1)
    # A byte budget below every level gets the lowest; the step's estimate then says so.
    return ScanSchedule(0.0, next((k for k in segments[1:] if math.ceil(length / k) * carry <= limit),
                                  segments[-1]))
