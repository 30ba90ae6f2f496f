"""The "vjp" strategy: save every forward value the backward reads, as `jax.vjp` does."""
from __future__ import annotations

from jax.extend.core import Var

from aotgrad.errors import ConfigError
from aotgrad.partition.budget_value import Budget
from aotgrad.partition.graph import JointGraph

__all__ = ["save_what_backward_reads"]


def save_what_backward_reads(graph: JointGraph, budget: Budget = 1.0) -> dict[Var, str]:
    """Saves the forward values read by backward equations or returned as gradients.
    Constants (values that depend on no input) are rebuilt in the backward instead.
    It has a single saved set, so a memory budget below 1 is an error, not ignored."""
    if budget != 1.0:
        raise ConfigError(
            f"aotgrad.config.activation_memory_budget={budget} needs a partitioner that can "
            f"recompute; partitioner='vjp' always saves what the backward reads. "
            f"Use partitioner='min_cut'.")
    saved: dict[Var, str] = {}

    def visit(v: object) -> None:
        if isinstance(v, Var) and v not in graph.backward and v in graph.input_dependent:
            saved.setdefault(v, "read by the backward")

    for eqn in graph.eqns:
        if graph.is_backward_eqn(eqn):
            for v in eqn.invars:
                visit(v)
    for v in graph.grads:
        visit(v)
    return saved
