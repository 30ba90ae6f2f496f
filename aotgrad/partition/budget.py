"""`activation_memory_budget`: trading recomputation for saved bytes.

At budget 1 the min-cut saves its runtime-optimal set (B1 bytes); at budget 0 only
inputs, and values of equations that must never run twice, are saved (B0 bytes). In
between, the saved bytes may not exceed B0 + budget x (B1 - B0).

A knapsack over individual values would ignore that recomputing one value changes what
else must be saved (its inputs). Instead, memory is priced: each saved byte costs an
extra `price` on top of the bytes-moved model, compute-bound equations may be
recomputed at their FLOP cost, and the cut is solved again for a ladder of prices. Each
solution is the cheapest (in recompute + traffic) for its saved bytes. Greedy cuts fill
the gaps pricing skips. The chosen cut is the cheapest candidate that fits the budget;
because the candidates do not depend on the budget, saved bytes are monotone in it.

A scan extends its body's ladder below "save only the carries" (`scan_schedule`): the
carry is saved every k-th iteration and the backward recomputes each segment of k
iterations from its checkpoint (nested remat, k up to about sqrt(n)).
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np
from jax.extend.core import Var

from aotgrad.partition.rules import Kind

if TYPE_CHECKING:  # min_cut imports scan, which imports scan_schedule from here
    from aotgrad.partition.min_cut import Cut, Problem

__all__ = ["GREEDY_STEPS", "PRICES", "ScanSchedule", "ladder", "scan_schedule", "within_budget"]

# Extra cost per saved byte, in the cost model's units (a byte moved costs 1 or 2).
PRICES = tuple(2.0 ** k for k in range(-4, 13))
GREEDY_STEPS = 24  # at most this many greedy cuts (more values are forbidden per step on big graphs)


def ladder(problem: Problem, relaxed: np.ndarray) -> list[Cut]:
    """Candidate cuts: the full cut, the priced cuts, the greedy cuts, and last the cut
    that saves only what can never be recomputed. `relaxed`: recompute costs with
    compute-bound equations allowed."""
    full = problem.full_cut()
    cuts = [full]
    cuts += [problem.solve(problem.save_costs + price * problem.nbytes, relaxed) for price in PRICES]
    cuts += _greedy(problem, full, relaxed)
    unsafe = np.asarray([np.inf if k is Kind.UNSAFE else 0.0 for k in problem.kinds])
    cuts.append(problem.solve(problem.nbytes, unsafe))
    return cuts


def _greedy(problem: Problem, start: Cut, relaxed: np.ndarray) -> list[Cut]:
    """Pricing finds the convex hull of (bytes, cost) and skips points between (when
    several layers cost the same, all flip at one price). These fill the gaps: from the
    full cut, repeatedly forbid saving the compute-bound values that free the most bytes
    per unit of recompute cost, and solve again."""
    position = problem.position
    save = problem.save_costs.copy()
    cuts, cut = [], start
    for _ in range(GREEDY_STEPS):
        costly = [position[v] for v in cut.saved if v in position
                  and problem.kind_of_value(position[v]) is Kind.COSTLY]
        if not costly:
            break
        ratio = {k: problem.nbytes[k] / max(relaxed[problem.producer[k]], 1.0) for k in costly}
        ranked = sorted(costly, key=lambda k: (-ratio[k], k))
        save[ranked[:max(1, len(ranked) // GREEDY_STEPS)]] = np.inf
        cut = problem.solve(save, relaxed)
        cuts.append(cut)
    return cuts


def _runtime_cost(cut: Cut, relaxed: np.ndarray) -> float:
    """Traffic for saving plus the cost of every recomputed equation."""
    problem = cut.problem
    saved = [problem.position[v] for v in cut.saved if v in problem.position]
    return float(problem.save_costs[saved].sum() + relaxed[list(cut.recomputed)].sum())


def within_budget(problem: Problem, budget: float) -> dict[Var, str]:
    """The cheapest ladder cut whose saved activation bytes fit the budget."""
    relaxed = problem.recompute_costs(allow_costly=True)
    cuts = ladder(problem, relaxed)
    b1, b0 = cuts[0].activation_bytes, cuts[-1].activation_bytes
    limit = b0 + budget * max(b1 - b0, 0)
    fitting = [c for c in cuts if c.activation_bytes <= limit] or [cuts[-1]]
    best = min(fitting, key=lambda c: (_runtime_cost(c, relaxed), -c.activation_bytes))
    return best.reasons(f"budget {budget:g}: fits in {limit:,.0f} bytes, cheapest to keep",
                        costly_banned=False)


@dataclasses.dataclass(frozen=True)
class ScanSchedule:
    """How one scan is differentiated: its body cut at `body_budget`, and the carry
    checkpointed every `every` iterations (1: the body's cut is saved every iteration)."""
    body_budget: float
    every: int


def scan_schedule(length: int, carry: int, per_iteration: tuple[int, int], sliced: int,
                  budget: float) -> ScanSchedule:
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
      so saved bytes and the peak both fall as the budget does.

    The budget spans these levels in bytes, as `within_budget` spans a ladder: the limit
    is B0 + budget x (B1 - B0); every = 1 is preferred whenever it fits (no extra
    forward), else the smallest k that fits.
    """
    r0, r1 = per_iteration

    def peak(k: int) -> int:
        return length * r0 + 2 * sliced if k == 1 else math.ceil(length / k) * carry + k * (r0 + 2 * sliced)

    segments = [1]
    for k in range(2, length + 1):  # while the peak estimate falls, each new saved level
        if peak(k) >= peak(segments[-1]):
            break
        if math.ceil(length / k) < math.ceil(length / segments[-1]):
            segments.append(k)
    if len(segments) == 1:  # segments would not lower the peak: the body's own ladder
        return ScanSchedule(budget, 1)
    b0 = math.ceil(length / segments[-1]) * carry
    limit = b0 + budget * max(length * r1 - b0, 0)
    if length * r0 <= limit:
        body = 1.0 if r1 <= r0 else min(max((limit / length - r0) / (r1 - r0), 0.0), 1.0)
        return ScanSchedule(body, 1)
    return ScanSchedule(0.0, next(k for k in segments[1:] if math.ceil(length / k) * carry <= limit))
