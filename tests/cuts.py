"""Joint graphs of small functions, and min_cut's cheapest cut of them, for tests that
check the cut itself (budget 1 is the fused step's plan; the cheapest cut is a candidate
below it)."""
from __future__ import annotations

import importlib
from typing import Any

import aotgrad
from aotgrad.partition.split import Split, split
from aotgrad.trace import trace_joint

__all__ = ["cheapest", "joint_graph"]


def joint_graph(fn: Any, *args: Any, argnums: Any = None) -> Any:
    """The joint graph aotgrad builds for `fn(*args)`, the arguments at `argnums`
    differentiated (None: every float input)."""
    traced = aotgrad.compile(fn).trace(*args)
    return trace_joint(traced.entry.fwd, traced.perturbed(argnums), traced.entry.default_has_ct())


def cheapest(graph: Any) -> Split:
    """The split of min_cut's cheapest cut (fewest bytes by the cost model)."""
    min_cut = importlib.import_module("aotgrad.partition.min_cut")
    return split(graph, min_cut.Problem.of(graph).cheapest_cut().reasons())
