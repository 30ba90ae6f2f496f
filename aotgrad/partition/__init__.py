"""How the joint graph is split: strategies choose the saved set, `split` builds programs.

A strategy is a function `(JointGraph, budget) -> {value: reason}`; register it in PARTITIONERS
and it becomes a valid `aotgrad.config.partitioner` choice.
"""
from __future__ import annotations

from typing import Callable

from jax.extend.core import Var

from aotgrad.partition.default import save_what_backward_reads
from aotgrad.partition.graph import JointGraph
from aotgrad.partition.min_cut import min_cut
from aotgrad.partition.split import Split, split

__all__ = ["PARTITIONERS", "JointGraph", "Split", "partition", "split"]

# (graph, activation_memory_budget) -> {saved value: reason}
Strategy = Callable[[JointGraph, float], dict[Var, str]]

PARTITIONERS: dict[str, Strategy] = {
    "default": save_what_backward_reads,
    "min_cut": min_cut,
}


def partition(graph: JointGraph, strategy: str, budget: float = 1.0) -> Split:
    return split(graph, PARTITIONERS[strategy](graph, budget))
