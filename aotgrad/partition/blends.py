"""Blends: cuts between two neighbouring rungs of the budget's ladder (`budget.py`), where
the ladder's own candidates leave a wide step.

Neighbouring rungs A (the lower estimated peak) and B differ in a run of layers: a price
flips a few values at a time. `between` saves what B saves before a layer point and what
A saves from it on (the rest at the highest price), bisecting the points inside that run.
Where none of those is kept (B no cheaper per layer than A), `past` blends A with the top.
A scan body is one layer (`in_body`): A's values with some of B's extra ones.

A byte budget's own gap (`Ladder.near`), which `plan.fit` checks by compiling, goes finer
(`finer`): where two neighbouring cuts of the gap differ inside one layer, it also saves
what the lower saves with the higher's extra values less its largest ones. One value can
hold most of a layer's step: GPT-2 small's attention probabilities (403 MB per device
on 8 H100s with FSDP, of the 450 MB between two plans compiled at 13.57 and 14.02 GB).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from aotgrad.partition.boundaries import layer_points

if TYPE_CHECKING:
    from aotgrad.partition.budget import Choice
    from aotgrad.partition.min_cut import Cut, Problem

__all__ = ["between", "finer", "in_body", "past"]

# Two cuts differing in at most this many values differ inside one layer (a GPT layer
# saves 10-20 values); each blend of theirs is one more min cut to solve.
LAYER_VALUES = 24

Weigh = Callable[["Cut"], "Choice"]  # a cut as a weighed candidate (`budget._choice`)
Solve = Callable[[np.ndarray], "Cut"]  # the cut with the values at these positions free to save


def between(problem: Problem, kept: list[Choice], free: np.ndarray, weigh: Weigh, solve: Solve,
            step: float, same: float) -> list[Choice]:
    """Cuts between neighbouring cuts A and B of `kept` (B the higher) whose estimated peaks
    differ by more than `step`: before a layer point s the values B saves free to save, from
    s on those A saves. The points inside the run where A and B differ are bisected: the
    blend at the middle one is weighed, each half split again while its ends' peaks differ
    by more than `step`. Only blends estimated inside (A, B), not about as high as either
    (within `same`), are kept: the ladder's own cuts stay (tests/test_blends.py). `free`:
    the layer boundaries (`boundaries.py`)."""
    starts = np.asarray([int(g[0]) for g in layer_points(problem, free)][1:] if len(free) else [], np.int64)
    if not len(starts) or len(kept) < 2:
        return []
    out: list[Choice] = []
    for a, b in zip(kept, kept[1:]):
        pa, pb = a.cut.positions, b.cut.positions
        differ = np.setxor1d(pa, pb)
        if not len(differ):
            continue
        points = starts[(starts > differ[0]) & (starts <= differ[-1])]
        inside = (a.peak * (1 + same), b.peak * (1 - same))
        spans = [(0, len(points), a.peak, b.peak)]  # points[lo:hi] lie between cuts peaking at low and high
        while spans:
            lo, hi, low, high = spans.pop()
            if lo >= hi or high <= low * (1 + step):
                continue
            mid = (lo + hi) // 2
            s = points[mid]
            c = weigh(solve(np.concatenate([pb[pb < s], pa[pa >= s]])))
            if inside[0] < c.peak < inside[1]:
                out.append(c)
            peak = min(max(c.peak, low), high)
            spans += [(lo, mid, low, peak), (mid + 1, hi, peak, high)]
    return out


def past(problem: Problem, kept: list[Choice], free: np.ndarray, weigh: Weigh, solve: Solve,
         step: float, same: float) -> list[Choice]:
    """Blends of A with the top (`kept[-1]`) wherever A and the rung above it, B, not the
    top, still differ by more than `step` (`between` found nothing kept between them). B can
    be a cut that saves other values in each layer than the top does and is no cheaper
    than A, so that no blend of the two is either: on a pre-norm stack with no embedding,
    B saved the softmax's exponentials and quotients where A (the matmul outputs) saved
    its scores, and moved 6.6% more bytes than A, compiled, at 1.54x its peak. Blended
    with the top instead, each layer's step trades peak for bytes as the top does. Only
    where the device ranks cuts by their step's traffic: a blend's per-value costs are
    nearly its ends' layer by layer, so ranked by those, its own blends do not skip a gap.
    (On XLA:CPU, blended with the top too, a 3-layer GPT got levels whose compiled peaks
    did not rise with the estimate, and `plan.fit` missed a cheaper plan that fitted:
    tests/test_plan.py.)"""
    top = kept[-1]
    if top.step is None:
        return []  # not ranked by traffic (`budget._choice`): by per-value costs, which blend layer by layer
    out: list[Choice] = []
    for a, b in zip(kept, kept[1:-1]):
        if b.peak > a.peak * (1 + step):
            out += between(problem, [a, top], free, weigh, solve, step, same)
    return out


def finer(problem: Problem, low: Choice, high: Choice, free: np.ndarray, weigh: Weigh, solve: Solve,
          step: float) -> list[Choice]:
    """Cuts estimated strictly between `low` and `high`: their blends at layer points
    (`between`), then, for each two neighbours among those cuts whose peaks differ by more
    than `step` and whose saved values differ in at most `LAYER_VALUES`, the lower's saved
    values with the higher's extra ones less the j largest, for every j (`_value_blends`)."""
    found = between(problem, [low, high], free, weigh, solve, step, 0.0)
    out = list(found)
    chain = sorted([low, *found, high], key=lambda c: c.peak)
    for a, b in zip(chain, chain[1:]):
        if _apart_in_one_layer(a, b, step):
            out += [c for c in _value_blends(problem, a, b, weigh, solve) if low.peak < c.peak < high.peak]
    return out


def in_body(problem: Problem, kept: list[Choice], free: np.ndarray, weigh: Weigh, solve: Solve,
            step: float, same: float) -> list[Choice]:
    """Cuts strictly between neighbouring rungs A and B of a scan body's ladder (one layer:
    no layer points to blend at) whose saved bytes differ by more than `step` and whose
    saved values differ in at most `LAYER_VALUES`: A's saved values with B's extra ones
    less the j largest, and with only the j largest, for every j. (A scanned GPT-2 small's
    body saved 48 MiB, then 192: the rung above adds three matmul outputs, 96, 72 and 24 MiB.)
    `free` and `same` are `between`'s: a body has no layer points, and only blends strictly
    between their rungs are kept."""
    out: list[Choice] = []
    for a, b in zip(kept, kept[1:]):
        if _apart_in_one_layer(a, b, step):
            out += [c for c in _value_blends(problem, a, b, weigh, solve, largest_alone=True)
                    if a.peak < c.peak < b.peak]
    return out


def _apart_in_one_layer(a: Choice, b: Choice, step: float) -> bool:
    """B's peak is more than `step` above A's, and their saved values differ in at most
    `LAYER_VALUES`: inside one layer."""
    return b.peak > a.peak * (1 + step) and len(np.setxor1d(a.cut.positions, b.cut.positions)) <= LAYER_VALUES


def _value_blends(problem: Problem, a: Choice, b: Choice, weigh: Weigh, solve: Solve,
                  largest_alone: bool = False) -> list[Choice]:
    """A's saved values with B's extra ones less the j largest, for every j (and with only
    the j largest: `largest_alone`), each solved and weighed."""
    pa = a.cut.positions
    extra = np.setdiff1d(b.cut.positions, pa)
    extra = extra[np.argsort(-problem.nbytes[extra], kind="stable")]  # largest first
    subsets = [extra[j:] for j in range(1, len(extra))]
    if largest_alone:
        subsets += [extra[:j] for j in range(1, len(extra))]
    return [weigh(solve(np.union1d(pa, s))) for s in subsets]
