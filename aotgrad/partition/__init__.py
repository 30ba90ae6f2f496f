"""How the joint graph is split: strategies choose the saved set, `split` builds programs.

A strategy is a function `(JointGraph, budget) -> {value: reason}` (budget: a fraction, or
`Bytes`); register it in PARTITIONERS
and it becomes a valid `aotgrad.config.partitioner` choice.
"""
from __future__ import annotations

from typing import Callable

from jax.extend.core import Var

from aotgrad.partition.budget import Budget
from aotgrad.partition.vjp import save_what_backward_reads
from aotgrad.partition.graph import JointGraph
from aotgrad.partition.min_cut import min_cut
from aotgrad.partition.scan import partition_scans
from aotgrad.partition.split import Split, split

__all__ = ["PARTITIONERS", "SCAN_BODY_CUTS", "JointGraph", "Split", "partition", "scan_rules", "split"]

# (graph, activation_memory_budget) -> {saved value: reason}
Strategy = Callable[[JointGraph, Budget], dict[Var, str]]

PARTITIONERS: dict[str, Strategy] = {
    "vjp": save_what_backward_reads,
    "min_cut": min_cut,
}


# Strategies that also cut inside scan bodies (`partition.scan`), called there as
# (body graph, budget, stacked=True); the others leave a scan's residuals as
# `jax.vjp` keeps them.
SCAN_BODY_CUTS = frozenset({"min_cut"})


def partition(graph: JointGraph, strategy: str, budget: Budget = 1.0) -> Split:
    return split(graph, PARTITIONERS[strategy](graph, budget))


def scan_rules(strategy: str, budget: Budget) -> dict | None:
    """Rules that cut each scan body with `strategy` before the joint graph is traced."""
    if strategy not in SCAN_BODY_CUTS:
        return None
    return partition_scans(PARTITIONERS[strategy], budget)
