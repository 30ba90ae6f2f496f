"""How the joint graph is split: strategies choose the saved set, `split` builds programs.

A strategy is a function `(JointGraph, budget) -> {value: reason}` (budget: a fraction, or
`Bytes`); `register_partitioner` makes it a valid `aotgrad.config.partitioner` choice.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Callable, Mapping

from jax.extend.core import Var

from aotgrad.partition import shards
from aotgrad.partition.budget_value import Budget
from aotgrad.partition.vjp import save_what_backward_reads
from aotgrad.partition.graph import JointGraph
from aotgrad.partition.min_cut import min_cut
from aotgrad.partition.scan import BodyTrace, partition_scans
from aotgrad.partition.split import Program, Split, split, without_cotangents

__all__ = ["PARTITIONERS", "JointGraph", "Program", "Registration", "Split", "partition", "partitioners",
           "plans_staged", "register_partitioner", "scan_rules", "split", "without_cotangents"]

# (graph, activation_memory_budget) -> {saved value: reason}
Strategy = Callable[[JointGraph, Budget], dict[Var, str]]

_REGISTERED: dict[str, Strategy] = {
    "vjp": save_what_backward_reads,
    "min_cut": min_cut,
}
# Strategies that also cut inside scan bodies (`partition.scan`), called there as
# (body graph, budget, stacked=True); the others leave a scan's residuals as
# `jax.vjp` keeps them.
_CUTS_SCAN_BODIES: set[str] = {"min_cut"}

# Read-only views: `register_partitioner` is the one way in.
PARTITIONERS: Mapping[str, Strategy] = types.MappingProxyType(_REGISTERED)


@dataclasses.dataclass(frozen=True)
class Registration:
    """A registered partitioner; `remove()` unregisters it."""
    name: str

    def remove(self) -> None:
        _REGISTERED.pop(self.name, None)
        _CUTS_SCAN_BODIES.discard(self.name)


def register_partitioner(name: str, strategy: Strategy, *, cuts_scan_bodies: bool = False) -> Registration:
    """Makes `strategy` the partitioner `name` (`aotgrad.config.partitioner=name`).
    `strategy(graph, budget)` returns the saved forward values, each with a reason; with
    `cuts_scan_bodies` it is also called on each scan body as `strategy(body, budget, True)`."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"aotgrad.register_partitioner: name must be an identifier string; got {name!r}.")
    if name in _REGISTERED:
        raise ValueError(f"aotgrad.register_partitioner: {name!r} is already registered "
                         f"(registered: {list(_REGISTERED)}).")
    if not callable(strategy):
        raise TypeError(f"aotgrad.register_partitioner: strategy must be callable "
                        f"(graph, budget) -> {{value: reason}}; got {strategy!r}.")
    _REGISTERED[name] = strategy
    if cuts_scan_bodies:
        _CUTS_SCAN_BODIES.add(name)
    return Registration(name)


def partitioners() -> tuple[str, ...]:
    """The registered partitioners' names, in registration order."""
    return tuple(_REGISTERED)


def plans_staged(strategy: str, budget: Budget) -> bool:
    """Whether `strategy` at `budget` may plan a step traced under `jax.jit` (one program,
    `JointGraph.staged`) otherwise than one run eagerly (two programs). "vjp" never does;
    "min_cut" always does (budget 1: the fused step's plan under jit, the cheapest cut
    apart; below 1 or in bytes it weighs the step's estimated peak, which differs); a
    registered strategy may read `graph.staged`, so it is asked for both."""
    return strategy != "vjp"


def partition(graph: JointGraph, strategy: str, budget: Budget = 1.0) -> Split:
    return split(graph, PARTITIONERS[strategy](graph, budget))


def scan_rules(strategy: str, budget: Budget, trace_body: BodyTrace,
               splits: dict[Var, shards.Split] | None = None) -> dict | None:
    """Rules that cut each scan body with `strategy` before the joint graph is traced;
    `trace_body` traces a body's joint graph (`trace.trace_body_joint`); `splits`: the
    evaluated program's values split over the devices (`shards.of_eqns`)."""
    if strategy not in _CUTS_SCAN_BODIES:
        return None
    return partition_scans(PARTITIONERS[strategy], budget, trace_body, splits)
