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
"""
from __future__ import annotations

import numpy as np
from jax.extend.core import Var

from aotgrad.partition.min_cut import Cut, Problem
from aotgrad.partition.rules import Kind

__all__ = ["GREEDY_STEPS", "PRICES", "ladder", "within_budget"]

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
