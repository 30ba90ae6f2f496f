"""Landing a byte limit on the compiled peak: which `activation_memory_budget` to give
aotgrad so that the step XLA compiles peaks just under a limit.

A byte budget is met against aotgrad's estimate of the step's peak, made while tracing,
before any compiler has run: the estimate orders the candidate plans well but is off by
up to tens of percent in absolute terms (it does not model XLA's buffer assignment, and
while tracing it does not see the step's shardings, its optimizer state or the program
around the function). GPT-2 small on one H100: the byte budget "7GB" took a plan that
compiled to 4.64 GB where one that compiled to 6.96 GB fits.

The plans a byte budget chooses between are known before compiling (`levels`): the
candidates of the budget's ladder, each with its estimated peak, and budget 1's plan. A
byte budget equal to a candidate's estimate takes that candidate, and the compiled peak
rises with the candidates (nearly always: the estimate orders them). So `land` searches
the candidates by bisection for the highest one whose compiled peak fits, compiling about
log2(candidates) steps (and the next ones while a step misses the limit by under 1%:
neighbouring plans can compile alike), and names it by the shortest size in its range of
byte budgets (`setting`: "7.7GB", which a user can write). A byte budget blends the gap of
the ladder it falls in finer (`budget.Ladder.near`), so once the two plans around the limit
are compiled, the blends between them are searched the same way.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Protocol, Sequence

import jax.extend.core.primitives as P
from jax.extend.core import Jaxpr

from aotgrad.collector import collector_paused
from aotgrad.interpret import sub_jaxprs
from aotgrad.partition.budget import ladder_of, step_programs
from aotgrad.partition.graph import JointGraph
from aotgrad.partition.min_cut import Problem
from aotgrad.partition.peak import estimate

__all__ = ["Landing", "Levels", "has_scan", "land", "setting"]


class Step(Protocol):
    """A compiled step: its per-device peak (None: the compiler did not say)."""
    peak_bytes: int | None


@dataclasses.dataclass(frozen=True)
class Landing:
    """The settings `land` compiled, in order, each with its step."""
    tried: tuple[tuple[str, Step], ...]


class Levels:
    """The estimated peaks a byte budget chooses between on one graph, at a limit
    (`Levels(graph)(limit)`), lowest first: the ladder's candidates, the gap the limit falls
    in blended finer (`budget.Ladder.near`, as the byte budget weighs it), and budget 1's
    plan, which a byte budget takes when it admits its estimate (`budget.within_budget`).
    The ladder is built once per graph."""

    def __init__(self, graph: JointGraph) -> None:
        problem = Problem.priced(graph)
        with collector_paused():
            self._ladder = ladder_of(problem)
        self._highest = estimate(step_programs(problem.top_cut(stacked=False)))  # as `within_budget` weighs it

    def __call__(self, limit: int) -> list[int]:
        with collector_paused():
            steps = self._ladder.near(limit)
        return sorted({c.peak for c in steps if c.peak < self._highest}) + [self._highest]  # then budget 1's plan


def has_scan(jaxpr: Jaxpr) -> bool:
    """Whether a scan is anywhere in `jaxpr`. A scan's body is cut at the budget before the
    step's graph is traced, so only then do the levels depend on the limit they are traced at."""
    return any(e.primitive is P.scan_p or any(map(has_scan, sub_jaxprs(e))) for e in jaxpr.eqns)


# A step that misses the limit by at most this share may sit on a plateau of compiled peaks
# (`land`). On a 3-layer GPT on XLA:CPU five neighbouring plans compiled to 688-691 KB.
PLATEAU = 0.01
_UNITS = (("GB", 10 ** 9), ("MB", 10 ** 6), ("KB", 10 ** 3), ("B", 1))


def setting(low: int, high: float) -> str:
    """The shortest byte size in [low, high) ("7.7GB" rather than 7,712,345,678 bytes), in
    the largest unit not above `low`."""
    unit, scale = next((u, s) for u, s in _UNITS if low >= s or s == 1)
    for digits in range(0, 10):
        value = math.ceil(low * 10 ** digits / scale) / 10 ** digits
        if value * scale < high or scale == 1:
            return f"{value:.{digits}f}{unit}"
    return f"{low}B"


def land(limit: int, peaks: Sequence[int], compile_at: Callable[[str], Step],
         finer: Callable[[int], Sequence[int]] | None = None) -> Landing:
    """Bisects the estimated `peaks` (`levels`, lowest first) for the highest one whose
    step, compiled at that byte budget by `compile_at`, peaks at most `limit`. Assumes the
    compiled peak rises with the estimate; where it does not, a fitting step is still
    found if the lowest fits. Where the compiled peaks level off (neighbouring plans that
    XLA places alike), the step just above the highest that fits may miss the limit by a
    hair while a higher one fits and moves fewer bytes: while the step above misses by at
    most `PLATEAU`, the next is tried too.

    `finer(p)`: the levels with the gap the estimate `p` falls in blended finer (`Levels`).
    The estimate is off the compiled peak (on 8 H100s with FSDP by ~0.6 GB), so the gap of
    the limit's own estimate need not be the one its compiled peak falls in: once the two
    levels around the limit are known by compiling, the levels `finer` finds between them
    are searched too."""
    tried: list[tuple[str, Step]] = []
    fits, over = _search(limit, peaks, compile_at, tried)
    if finer is not None and 0 <= fits and fits + 1 == over < len(peaks):
        inner = [p for p in finer(peaks[fits]) if peaks[fits] < p < peaks[over]]
        if inner:
            _search(limit, [peaks[fits], *inner, peaks[over]], compile_at, tried, known=(0, len(inner) + 1))
    return Landing(tuple(tried))


def _search(limit: int, peaks: Sequence[int], compile_at: Callable[[str], Step], tried: list[tuple[str, Step]],
            known: tuple[int, int] | None = None) -> tuple[int, int]:
    """`land`'s bisection over `peaks`, the steps compiled appended to `tried`: the highest
    index that fits and the lowest above it that does not (-1 and len(peaks) where none is
    known; the same where the compiler does not say its peak). `known`: those two already."""
    compiled: dict[int, int | None] = {}  # per index tried, its compiled peak

    def fits_at(k: int) -> bool | None:
        high = peaks[k + 1] if k + 1 < len(peaks) else math.inf
        text = setting(peaks[k], high)
        step = compile_at(text)
        tried.append((text, step))
        compiled[k] = step.peak_bytes
        return None if step.peak_bytes is None else step.peak_bytes <= limit

    start = sum(1 for p in peaks if p <= limit) - 1  # what the byte budget `limit` takes
    fits, over = known or (-1, len(peaks))  # highest index known to fit, lowest known not to
    k = min(max(start, fits + 1), over - 1)
    while fits + 1 < over:
        fit = fits_at(k)
        if fit is None:
            return -1, len(peaks)  # the compiler does not say its peak: nothing to land on
        if fit:
            fits = k
        else:
            over = k
        k = (fits + over) // 2
    bracket = fits, over
    while over + 1 < len(peaks) and compiled.get(over, math.inf) <= limit * (1 + PLATEAU):
        over += 1  # it missed by a hair: the next may fit
        if fits_at(over) is None:
            break
    return bracket
