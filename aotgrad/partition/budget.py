"""`activation_memory_budget`: trading recomputation for a lower step peak.

Budget 1 plans for where the programs run (`Problem.top_cut`, see there why): in a step
under `jax.jit` the fused step's plan (outside scans nothing is recomputed, so the step
moves what `jax.jit(jax.value_and_grad(f))` moves); where they run apart the cheapest cut.
Below 1 the budget spans the step's peak memory, as estimated before compiling
(`peak.py`): P1 is the estimated peak of the cut that moves the fewest bytes by the cost
model (`Problem.cheapest_cut`; where the programs run apart, budget 1's plan, so no rung
saves more than it), P0 the lowest among the candidates, and a budget b < 1
takes the cheapest candidate whose estimated peak is at most P0 + b x (P1 - P0). So a
budget just below 1 is the cheapest cut where it is the only candidate (P0 = P1: small
graphs), else the candidate just below it; the cheapest cut itself is then reached by a
byte budget only. It recomputes cheap work and waits for its cotangent (`schedule.py`)
for a lower peak, at a cost in bytes the model does not see.

The candidates:
- A knapsack over individual values would ignore that recomputing one value changes what
  else must be saved (its inputs). Instead, memory is priced: each saved byte costs an
  extra `price` on top of the bytes-moved model, compute-bound equations may be
  recomputed at their FLOP cost, and the cut is solved again for a ladder of prices. Each
  solution is the cheapest (in recompute + traffic) for its saved bytes. Greedy cuts fill
  the gaps pricing skips, and the cut that saves only what can never be recomputed ends it.
- Saving fewer bytes does not by itself lower the peak: with nothing saved, the backward
  recomputes the whole forward before its first step and holds every layer's internals
  until their turn. So the priced cuts are solved once more with the layer boundaries
  (`boundaries.py`) free to save, which lets the backward recompute one layer at a time,
  and at the highest price with only every second layer point free (a block's input, not
  also its middle: fewer checkpoints, a whole block recomputed at once).
- The cuts with every second point free once more with the loss head free to save too
  (`boundaries.head`), on devices where that was measured to pay
  (`DeviceProfile.keeps_loss_head`: GPUs): each block checkpointed once, the logits kept,
  as `jax.checkpoint` on each layer leaves them (docs/partitioner.md, "loss head").
- The shapes of the checkpoint policies: every matmul output (`dots_saveable`) or those
  without batch dimensions (`dots_with_no_batch_dims_saveable`) free to save, with no
  layer point, every one or every second free beside them (`policy_points`), each with
  and without the loss head: the rest of each layer is recomputed from them. Pricing
  alone never finds these: they save more bytes than the cuts of the same cost.
- Blends fill what is left between them (`blends.py`): where two neighbouring kept cuts'
  estimated peaks differ by more than `BLEND_STEP`, the layers before a layer point saved
  as the higher one saves them and the rest as the lower one does (docs/partitioner.md).
  A scan body is one layer: there the lower one's values with some of the higher one's.

A budget in bytes (`Bytes`, "12GB") is the limit itself: the cheapest candidate whose
estimated step peak is at most that many bytes, its gap of the ladder blended finer
(`Ladder.near`); if none is, `BudgetUnreachable` names the lowest estimated peak. Peaks
are per device: a sharded step's values count at their size on one device (`shards.py`).

Only candidates cheaper to run than every candidate with a lower estimated peak, and saving
no fewer bytes, are kept (`choices`): estimated peak, saved bytes and speed rise with the
budget. Cheaper: by the min cut's per-value costs, or where the device says so
(`DeviceProfile.ranks_by_traffic`: GPUs) by the bytes the whole step is estimated to move
(`traffic.py`: a saved value read by several kernels costs each read).

A scan extends its body's ladder below "save only the carries" (`scan_levels`): the carry
saved every k-th iteration, each segment of k recomputed from it (k up to about sqrt(n)).
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import TYPE_CHECKING, Callable

import jax.extend.core.primitives as P
import numpy as np
from jax.extend.core import Var

from aotgrad.collector import collector_paused
from aotgrad.errors import BudgetUnreachable
from aotgrad.partition.budget_value import Budget, Bytes
from aotgrad.partition import blends
from aotgrad.partition.boundaries import boundaries, head, layer_points
from aotgrad.partition.fusion import Programs, programs
from aotgrad.partition.order import ordered
from aotgrad.partition.peak import estimate
from aotgrad.partition.rules import MATMULS, Kind
from aotgrad.partition.traffic import traffic as step_traffic

if TYPE_CHECKING:  # min_cut imports this module where it meets a budget
    from aotgrad.partition.min_cut import Cut, Problem

__all__ = ["GREEDY_STEPS", "PRICES", "Choice", "Ladder", "choices", "kept_of", "ladder", "ladder_of", "matmul_outputs",
           "policy_points", "step_programs", "within_budget"]


# Extra cost per saved byte, in the cost model's units (a byte moved costs 1 or 2).
PRICES = tuple(2.0 ** k for k in range(-4, 13))
# Estimated peaks this close (relative) count as equal: the cheaper cut wins (a transformer
# block's cut estimated 1.7% lower, recomputing 1.8x as much, peaked 3.7% higher in XLA).
SAME_PEAK = 0.02
# Estimated traffic this close (relative) counts as equal: the per-value costs decide. (GPT-2
# small, one H100: a cut estimated 0.3% cheaper than its neighbour moved 1.1% more bytes.)
SAME_TRAFFIC = 0.005
# At most this many greedy cuts (more values are forbidden per step on big graphs). With 24,
# twice the cuts to solve and estimate, every ladder kept on the suites' models was the same.
GREEDY_STEPS = 12
# Neighbouring kept cuts whose estimated peaks differ by more than this ratio are blended
# (`blends.between`), each gap split again while its ends still do. Gaps stay where no blend is
# cheaper than the cut below it (GPT-2 small on an H100: 8.45 to 10.09 GB estimated).
BLEND_STEP = 0.04
# A byte budget's gap of the ladder is blended down to this (`Ladder.near`): nearer its limit.
FINE_STEP = 0.01
COARSER_POINTS = (2,)  # layer points kept free besides every one: every second


def ladder(problem: Problem, relaxed: np.ndarray) -> list[Cut]:
    """Candidate cuts: the cheapest cut, the priced cuts, the greedy cuts, and last the cut
    that saves only what can never be recomputed. `relaxed`: recompute costs with
    compute-bound equations allowed."""
    cheapest = problem.cheapest_cut()
    cuts = [cheapest]
    cuts += _priced(problem, relaxed)
    cuts += _greedy(problem, cheapest, relaxed)
    unsafe = np.asarray([np.inf if k is Kind.UNSAFE else 0.0 for k in problem.kinds])
    cuts.append(problem.solve(problem.nbytes, unsafe))
    return cuts


def _greedy(problem: Problem, start: Cut, relaxed: np.ndarray) -> list[Cut]:
    """Pricing finds the convex hull of (bytes, cost) and skips points between (when
    several layers cost the same, all flip at one price). These fill the gaps: from the
    cheapest cut, repeatedly forbid saving the compute-bound values that free the most bytes
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


def _runtime_cost(problem: Problem, cut: Cut, relaxed: np.ndarray) -> float:
    """Traffic for saving plus the cost of every recomputed equation, priced by `problem`
    (budget 1's cut run apart is solved on `Problem.crossing`: the same values, other prices)."""
    return float(problem.save_costs[cut.positions].sum() + relaxed[list(cut.recomputed)].sum())


def _priced(problem: Problem, relaxed: np.ndarray, free: np.ndarray | None = None,
            prices: tuple[float, ...] = PRICES) -> list[Cut]:
    """One cut per price: each saved byte costs `price` more; values at the positions
    `free` are free to save."""
    cuts = []
    for price in prices:
        save = problem.save_costs + price * problem.nbytes
        if free is not None:
            save[free] = 0.0
        cuts.append(problem.solve(save, relaxed))
    return cuts


def _with_boundaries(problem: Problem, relaxed: np.ndarray, stacked: bool = False,
                     free: np.ndarray | None = None) -> list[Cut]:
    """The priced cuts again, with the layer boundaries free to save: the backward then
    recomputes one layer at a time from its input (see `boundaries.py`). Then with only
    every second layer point free (`COARSER_POINTS`), at the highest price (these serve
    the lowest peaks): fewer checkpoints, more recomputed at once. Those last again with
    the loss head free too, where the device keeps it and `stacked` is False (a scan
    body's saved values stay for every iteration; it has no loss head). `free`: the layer
    boundaries, if known."""
    free = boundaries(problem) if free is None else free
    if not len(free):
        return []
    cuts = _priced(problem, relaxed, free)
    points = layer_points(problem, free)
    spaced = [np.concatenate(points[phase::every]) for every in COARSER_POINTS
              if len(points) >= 2 * every for phase in range(every)]
    for points_free in spaced:
        cuts += _priced(problem, relaxed, points_free, PRICES[-1:])
    device = problem.graph.device
    keeps_head = not stacked and device is not None and device.keeps_loss_head
    loss_head = head(problem, free) if keeps_head else free[:0]
    if len(loss_head):  # the coarsest cuts again, the loss head free to save
        for points_free in spaced or [free]:
            cuts += _priced(problem, relaxed, np.concatenate([points_free, loss_head]), PRICES[-1:])
    heads = [free[:0], loss_head] if len(loss_head) else [free[:0]]
    for dots in matmul_outputs(problem):  # the shapes of the checkpoint policies (above)
        for points_free in policy_points(free, spaced):
            for kept_head in heads:
                cuts += _priced(problem, relaxed, np.concatenate([points_free, dots, kept_head]), PRICES[-1:])
    return cuts


def policy_points(free: np.ndarray, spaced: list[np.ndarray]) -> list[np.ndarray]:
    """The layer points free to save beside the matmul outputs in the policies' shapes:
    none (the policy's own shape: what a matmul output does not give is recomputed from
    the layer's input, saved at its price, or in a scan body carried), every point, every
    second point. (With every point free, a scanned GPT-2 small's body saved its residual
    stream beside the projection it is recomputed from: 1.046x the no-batch policy's peak.)"""
    return [free[:0], free, *spaced]


def matmul_outputs(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the matmul and convolution outputs, and of the matmul outputs without
    batch dimensions: what `dots_saveable` and `dots_with_no_batch_dims_saveable` save."""
    every, unbatched = [], []
    for k, e in enumerate(problem.producer):
        eqn = problem.graph.eqns[problem.eqns[e]]
        if eqn.primitive in MATMULS:
            every.append(k)
            if eqn.primitive is P.dot_general_p and not eqn.params["dimension_numbers"][1][0]:
                unbatched.append(k)
    return np.asarray(every, np.int64), np.asarray(unbatched, np.int64)


def step_programs(cut: Cut) -> Programs:
    """The step's programs when `cut` is saved, its recomputation emitted late."""
    backward = ordered(cut.problem.graph, cut.backward_eqns)
    return programs(cut.problem.graph, cut.saved, backward.order, backward.waiting)


@dataclasses.dataclass(frozen=True)
class Choice:
    """A candidate cut with what the budget weighs: the step's estimated peak, its cost by
    the min cut's per-value costs, its estimated traffic where the device ranks by it."""
    cut: Cut
    peak: int
    cost: float
    step: Programs | None = None  # given where the device ranks by traffic

    @property
    def saved(self) -> int:
        return self.cut.activation_bytes

    @functools.cached_property
    def traffic(self) -> float | None:  # when first compared: most candidates never are
        return None if self.step is None else step_traffic(self.step)

    def cheaper_than(self, other: Choice) -> bool:
        """By the step's traffic where both have one, their per-value costs deciding
        between traffic estimates this close (`SAME_TRAFFIC`); else by the costs."""
        mine, theirs = self.traffic, other.traffic
        if mine is not None and theirs is not None and abs(mine - theirs) > SAME_TRAFFIC * theirs:
            return mine < theirs
        return self.cost < other.cost


def _estimated(problem: Problem, cuts: list[Cut], relaxed: np.ndarray, stacked: bool,
               seen: dict[frozenset, Choice]) -> list[Choice]:
    """The distinct cuts among `cuts` not in `seen` (saved sets, updated), as `Choice`s."""
    out = []
    for cut in cuts:
        if frozenset(cut.saved) not in seen:
            out.append(_choice(problem, cut, relaxed, stacked, seen))
    return out


def _choice(problem: Problem, cut: Cut, relaxed: np.ndarray, stacked: bool, seen: dict[frozenset, Choice]) -> Choice:
    """`cut` as a `Choice`, estimated once per saved set (`seen`, updated)."""
    key = frozenset(cut.saved)
    if key not in seen:
        by_traffic = problem.graph.device is not None and problem.graph.device.ranks_by_traffic
        step = None if stacked else step_programs(cut)
        peak = cut.activation_bytes if stacked else estimate(step)
        seen[key] = Choice(cut, peak, _runtime_cost(problem, cut, relaxed), step if by_traffic else None)
    return seen[key]


def choices(problem: Problem, stacked: bool = False, near: float | None = None) -> list[Choice]:
    """The candidates a budget chooses from (of `ladder_of`'s), by estimated peak from lowest
    to highest (the top last: `ladder_of`): each cheaper to run and saving no fewer bytes than
    the one before, so that the step's peak, the saved bytes and the speed all rise with
    the budget. The top is always kept. Where two neighbours' peaks lie far apart,
    blends of the two fill the gap (`blends.between`; `in_body`). `stacked`: the graph is a scan body. Its
    saved values are stacked over the iterations and outweigh one iteration's working set,
    so there the saved bytes stand for the peak, and the scan's own schedule
    (`scan_levels.scan_schedule`) is built on them too. `near`: a byte budget's limit, whose
    gap is blended finely (`Ladder.near`)."""
    steps = ladder_of(problem, stacked)
    return steps.kept if near is None else steps.near(near)


@dataclasses.dataclass(frozen=True)
class Ladder:
    """The candidates weighed on one graph (`found`), the ladder kept of them, and `fill`:
    the blends strictly between kept rungs i and i + 1 (`blends.finer`, to `FINE_STEP`),
    each gap once (None: a scan body)."""
    found: list[Choice]
    kept: list[Choice]
    fill: Callable[[int], list[Choice]] | None

    def near(self, limit: float) -> list[Choice]:
        """The kept ladder, the gap `limit` falls in filled (`fill`) for a byte budget, which
        `plan.fit` checks by compiling: finer than the estimate's ~2% noise (`SAME_PEAK`) that
        a fraction's steps keep. Each rung stays cheaper than the one below."""
        steps = self.kept
        i = sum(1 for c in steps if c.peak <= limit) - 1
        if self.fill is None or not 0 <= i < len(steps) - 1:
            return steps
        low, high = steps[i], steps[i + 1]
        chain = [low]
        for c in sorted(self.fill(i), key=lambda c: (c.peak, c.cost)):
            if c.peak > chain[-1].peak and c.cheaper_than(chain[-1]) and chain[-1].saved <= c.saved <= high.saved \
                    and high.cheaper_than(c):
                chain.append(c)
        return steps[:i] + chain + steps[i + 1:]


def ladder_of(problem: Problem, stacked: bool = False) -> Ladder:
    """`_ladder_of`'s ladder, built once per problem: each budget weighed on one problem
    (`within_budget`, a byte budget's levels) chooses from the same candidates."""
    built = _LADDERS.setdefault(problem, {})
    if stacked not in built:
        built[stacked] = _ladder_of(problem, stacked)
    return built[stacked]


# Per problem (a new one per graph weighed), its ladders by `stacked`: dropped with it.
_LADDERS: weakref.WeakKeyDictionary[Problem, dict[bool, Ladder]] = weakref.WeakKeyDictionary()


def _ladder_of(problem: Problem, stacked: bool) -> Ladder:
    """The candidates (`ladder`, `_with_boundaries`, blends: `blends.in_body` in a scan body), each
    with its estimated step peak (saved bytes for a scan body: `stacked`) and cost, and
    the ladder kept of them. The first candidate tops the ladder (`kept_of`): the cheapest
    cut, or where the programs run apart budget 1's plan (`Problem.top_cut`), which a
    device's traffic pricing makes save less than the cheapest cut: every saved value is
    held to the backward's end there, and a rung saving more peaked above budget 1."""
    relaxed = problem.recompute_costs(allow_costly=True)
    free = boundaries(problem)
    seen: dict[frozenset, Choice] = {}  # by saved set: each estimated once, the blends' too
    top = [] if stacked or problem.graph.staged else [problem.top_cut(stacked)]  # apart: the ladder's top
    found = _estimated(problem, top + ladder(problem, relaxed) + _with_boundaries(problem, relaxed, stacked, free),
                       relaxed, stacked, seen)
    weigh = lambda cut: _choice(problem, cut, relaxed, stacked, seen)  # noqa: E731
    solve = lambda positions: _priced(problem, relaxed, positions, PRICES[-1:])[0]  # noqa: E731
    kept = kept_of(found)
    # Neighbours' blends, then the gaps left blended with the top; in a scan body, inside its one layer.
    for fill in (blends.in_body,) if stacked else (blends.between, blends.past):
        made = fill(problem, kept, free, weigh, solve, BLEND_STEP, SAME_PEAK)
        known = {id(c) for c in found}  # a blend may be a cut found before, or found twice
        if more := list({id(c): c for c in made if id(c) not in known}.values()):
            found, kept = found + more, kept_of(found + more)
    if stacked:
        return Ladder(found, kept, None)
    return Ladder(found, kept, functools.cache(lambda i: blends.finer(problem, kept[i], kept[i + 1], free, weigh,
                                                                      solve, FINE_STEP)))


def kept_of(found: list[Choice]) -> list[Choice]:
    """The ladder `choices` keeps of the candidates `ladder_of` found (its top first)."""
    top, *rest = found
    kept: list[Choice] = []
    floor = 0.0  # the lowest peak among candidates about as low as kept[-1]'s
    for c in sorted(rest, key=lambda c: (c.peak, c.cost, -c.saved)):
        if c.peak >= top.peak * (1 - SAME_PEAK):
            continue  # no lower than the top's, for more work
        if kept and c.peak <= floor * (1 + SAME_PEAK):  # about the same peak: the cheaper one
            before = kept[-2].saved if len(kept) > 1 else 0
            if c.cheaper_than(kept[-1]) and c.saved >= before:
                kept[-1] = c
        elif not kept or (c.cheaper_than(kept[-1]) and c.saved >= kept[-1].saved):
            kept.append(c)
            floor = c.peak
    while kept and kept[-1].saved > top.saved:
        kept.pop()
    return kept + [top]


def within_budget(problem: Problem, budget: Budget, stacked: bool = False) -> dict[Var, str]:
    """The cheapest candidate whose estimated step peak fits the budget: the limit is
    P0 + budget x (P1 - P0), P1 the cheapest cut's estimated peak, P0 the lowest (saved
    bytes for a scan body: `stacked`), or the budget itself if it is `Bytes`."""
    what = "saves" if stacked else "estimated step peak" + (" per device" if problem.graph.devices > 1 else "")
    if isinstance(budget, Bytes) and not stacked:  # budget 1's plan, if it fits
        if estimate(step_programs(top := problem.top_cut(stacked))) <= budget.n:
            return problem.top_reasons(top, stacked)
    with collector_paused():
        steps = choices(problem, stacked, budget.n if isinstance(budget, Bytes) else None)
    low, high = steps[0].peak, steps[-1].peak
    if isinstance(budget, Bytes):
        if low > budget.n:
            raise BudgetUnreachable(budget.n, low)
        limit = float(budget.n)
    else:
        limit = low + budget * (high - low)
    best = [c for c in steps if c.peak <= limit][-1]
    label = budget if isinstance(budget, Bytes) else f"{budget:g}"
    return best.cut.reasons(f"budget {label}: {what} {best.peak:,} bytes, within "
                            f"{limit:,.0f}; cheapest to keep", costly_banned=False)
