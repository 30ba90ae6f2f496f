"""`activation_memory_budget`: trading recomputation for saved bytes.

At budget 1 the min-cut saves its runtime-optimal set (B1 bytes); at budget 0 only
inputs, and values of equations that must never run twice, are saved (B0 bytes). In
between, the saved bytes may not exceed B0 + budget x (B1 - B0).

A knapsack over individual values would ignore that recomputing one value changes what
else must be saved (its inputs). Instead, memory is priced: each saved byte costs an
extra `price` on top of the bytes-moved model, compute-bound equations may be
recomputed at their FLOP cost, and the cut is solved again for a ladder of prices. Each
solution is the cheapest (in recompute + traffic) for its saved bytes; the chosen one is
the cheapest that fits the budget. Choosing from one fixed ladder makes saved bytes
monotone in the budget by construction.
"""
from __future__ import annotations

import numpy as np
from jax.extend.core import Var

from aotgrad.partition.min_cut import Cut, Problem
from aotgrad.partition.rules import Kind

__all__ = ["PRICES", "ladder", "within_budget"]

# Extra cost per saved byte, in the cost model's units (a byte moved costs 1 or 2).
PRICES = tuple(2.0 ** k for k in range(-4, 13))


def ladder(problem: Problem) -> list[Cut]:
    """Candidate cuts from most to least saved bytes: the full cut, the priced cuts,
    and the cut that saves only what can never be recomputed."""
    relaxed = problem.recompute_costs(allow_costly=True)
    cuts = [problem.full_cut()]
    cuts += [problem.solve(problem.save_costs + price * problem.nbytes, relaxed) for price in PRICES]
    unsafe = np.asarray([np.inf if k is Kind.UNSAFE else 0.0 for k in problem.kinds])
    cuts.append(problem.solve(problem.nbytes, unsafe))
    return cuts


def _runtime_cost(cut: Cut, relaxed: np.ndarray) -> float:
    """Traffic for saving plus the cost of every recomputed equation."""
    problem = cut.problem
    position = {v: k for k, v in enumerate(problem.values)}
    saved = [position[v] for v in cut.saved if v in position]
    return float(problem.save_costs[saved].sum() + relaxed[list(cut.recomputed)].sum())


def within_budget(problem: Problem, budget: float) -> dict[Var, str]:
    """The cheapest ladder cut whose saved activation bytes fit the budget."""
    cuts = ladder(problem)
    b1, b0 = cuts[0].activation_bytes, cuts[-1].activation_bytes
    limit = b0 + budget * max(b1 - b0, 0)
    relaxed = problem.recompute_costs(allow_costly=True)
    fitting = [c for c in cuts if c.activation_bytes <= limit] or [cuts[-1]]
    best = min(fitting, key=lambda c: (_runtime_cost(c, relaxed), -c.activation_bytes))
    return best.reasons(f"budget {budget:g}: fits in {limit:,.0f} bytes, cheapest to keep",
                        costly_banned=False)
