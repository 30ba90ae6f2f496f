"""The backward's order, worked out on index lists built once per graph: a budget orders
the backward of every candidate saved set (`split.recompute_late`) and finds which of its
recomputation waits for a cotangent (`schedule.plan`'s groups), tens of times on one
graph. Per saved set that is one depth-first pass over the backward's equation indices,
not passes over the equations' variables: the recomputation that waits is read off the
order as it is made (`ordered`).
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Sequence

import numpy as np
from jax.extend.core import Var

from aotgrad.partition import schedule
from aotgrad.partition.graph import JointGraph
from aotgrad.partition.rules import MATMULS

__all__ = ["Backward", "Links", "links", "ordered", "recompute_late"]


class Links:
    """Per joint equation (by index): the producers of its variable operands (and of those
    computed in the forward), the equations that read its results, whether it is a backward equation
    (`JointGraph.is_backward_eqn`), a view (`schedule.VIEWS`) or a matmul."""

    def __init__(self, graph: JointGraph) -> None:
        self._graph = weakref.ref(graph)  # not kept alive by its own entry in `_LINKS`
        producer = graph.producer
        self.operands: list[tuple[int, ...]] = [
            tuple(producer.get(v, -1) for v in e.invars if isinstance(v, Var)) for e in graph.eqns]
        readers: list[list[int]] = [[] for _ in graph.eqns]
        for i, ops in enumerate(self.operands):
            for p in ops:
                if p >= 0:
                    readers[p].append(i)
        self.readers = [tuple(r) for r in readers]
        backward = graph.backward
        self.backward = [any(isinstance(v, Var) and v in backward for v in e.invars) for e in graph.eqns]
        # The producers of each equation's forward operands: all a backward recomputes.
        self.forward_operands = [tuple(p for p in ops if p >= 0 and not self.backward[p]) for ops in self.operands]
        self.views = [e.primitive in schedule.VIEWS for e in graph.eqns]
        self.matmuls = [e.primitive in MATMULS for e in graph.eqns]
        self.is_backward = np.asarray(self.backward, bool)  # `backward`, to select with
        # `forward_operands` laid out one after another (equation i's: flat[ptr[i]:ptr[i + 1]]).
        self.operand_ptr = np.cumsum([0] + [len(ops) for ops in self.forward_operands])
        self.operand_flat = np.asarray([p for ops in self.forward_operands for p in ops], np.int64)
        self.backward_matmuls = self.is_backward & np.asarray(self.matmuls, bool)
        # Per backward equation: the runs of recomputation emitted before it for earlier
        # saved sets (`_late`), each with the equations it emits and those they read.
        self.runs: dict[int, list[tuple[list[int], frozenset[int], frozenset[int]]]] = {}

    @functools.cached_property
    def waits(self) -> dict[int, int]:
        """Per backward equation C: the equation computing the value a group whose first
        consumer is C waits for (`schedule._latest_backward_input`, then
        `schedule._smallest_source`), -1 if none. The same in every order
        `recompute_late` gives: there the backward's own equations keep their joint order,
        so the latest-computed backward operand is the latest in the joint graph."""
        graph = self._graph()
        assert graph is not None  # the graph is alive while its `Links` are used
        eqns, producer, backward = graph.eqns, graph.producer, graph.backward
        out = {}
        for c, is_bwd in enumerate(self.backward):
            if not is_bwd:
                continue
            after = schedule._latest_backward_input(eqns[c], producer, backward)
            if after is not None:
                after, _ = schedule._smallest_source(after, eqns, producer, backward)
            out[c] = -1 if after is None else producer[after]
        return out


_LINKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def links(graph: JointGraph) -> Links:
    """The graph's `Links`, built once."""
    if graph not in _LINKS:
        _LINKS[graph] = Links(graph)
    return _LINKS[graph]


@dataclasses.dataclass(frozen=True)
class Backward:
    """A backward in `recompute_late`'s order (joint indices), and the positions in it of
    the recomputation that waits for a cotangent on one device: the members of
    `schedule.plan(its equations, graph.backward)`'s groups."""
    order: list[int]
    waiting: frozenset[int]


def recompute_late(graph: JointGraph, idx: Sequence[int]) -> list[int]:
    """Orders the backward's equations (joint indices `idx`): its own (cotangent-dependent)
    equations in joint order, each recomputed forward equation just before its first use,
    so recomputed values do not live longer than they must."""
    return _late(links(graph), idx)[0]


def ordered(graph: JointGraph, idx: Sequence[int]) -> Backward:
    """`recompute_late`'s order, and which of its recomputation waits. The recomputation
    emitted just before a backward equation C is what `schedule.plan` groups under C: C is
    the first backward equation to need it (the backward's own equations keep their joint
    order, and what an earlier one needed was emitted before it), and it is contiguous."""
    lk = links(graph)
    order, runs = _late(lk, idx)
    return Backward(order, _waiting(lk, order, runs))


def _late(lk: Links, idx: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """`recompute_late`'s order, and the runs of recomputation emitted just before a
    backward equation: positions [start, stop), the equation at stop."""
    at = np.asarray(idx, np.int64)
    own = lk.is_backward[at]
    operands = lk.forward_operands
    recomputed = at[~own]
    pending = set(recomputed.tolist())  # recomputed, not emitted yet
    # Backward equations that read nothing recomputed (as the backward starts, so never)
    # go straight into the order; the others are looked at one by one.
    marked = np.zeros(len(lk.backward), bool)
    marked[recomputed] = True
    seen = np.concatenate([[0], np.cumsum(marked[lk.operand_flat])])
    own_idx = at[own]
    own_list = own_idx.tolist()
    order: list[int] = []
    runs: list[tuple[int, int]] = []
    done = 0  # own_list[:done] is in the order
    for k in np.flatnonzero(seen[lk.operand_ptr[own_idx + 1]] > seen[lk.operand_ptr[own_idx]]).tolist():
        order += own_list[done:k]
        done = k + 1
        i = own_list[k]
        if pending.isdisjoint(operands[i]):  # emitted already
            order.append(i)
            continue
        start = len(order)
        for run, emitted, read in lk.runs.get(i, ()):
            if pending.isdisjoint(read) and pending.issuperset(emitted):  # the search would repeat it
                order += run
                pending.difference_update(emitted)
                break
        else:
            _emit(i, operands, pending, order)
            _remember(lk, i, order[start:], operands)
        runs.append((start, len(order) - 1))
    order += own_list[done:]
    if pending:  # recomputed values returned directly as gradients
        for i in idx:
            if i in pending:
                _emit(i, operands, pending, order)
    return order, runs


def _emit(root: int, operands: list[tuple[int, ...]], pending: set[int], order: list[int]) -> None:
    """Emits `root` after the `pending` equations it reads, depth first (iterative: graphs
    can be deep), each operand's before the next's from the last operand back. On the
    stack, ~i (negative) marks equation i as ready to emit: its operands are out."""
    stack = [root]
    while stack:
        i = stack.pop()
        if i < 0:
            pending.discard(~i)
            order.append(~i)
        elif i == root or i in pending:  # else emitted since it was pushed
            stack.append(~i)
            stack.extend([p for p in operands[i] if p in pending])


def _remember(lk: Links, root: int, run: list[int], operands: list[tuple[int, ...]]) -> None:
    """Keeps the run `_emit` made before `root` (`root` last) for later saved sets: the
    same search finds it again wherever the equations it emitted are pending and none of
    the others it read is (it reads the pending state of nothing else)."""
    emitted = frozenset(run[:-1])
    read = frozenset().union(*[operands[j] for j in run]) - emitted
    lk.runs.setdefault(root, []).append((run, emitted, read))


def _waiting(lk: Links, order: list[int], runs: list[tuple[int, int]]) -> frozenset[int]:
    """The runs of recomputation that wait, as `schedule.plan` keeps its groups: one with a
    value to wait for, computed after the loss head (`schedule._head`) and before the run,
    and not only views."""
    if not runs:
        return frozenset()
    at = np.asarray(order, np.int64)
    position = np.full(len(lk.backward), -1, np.int64)  # per joint equation; -1: not in `order`
    position[at] = np.arange(len(at))
    heads = np.flatnonzero(lk.backward_matmuls[at])
    head = int(heads[0]) if len(heads) else 0
    waits, views = lk.waits, lk.views
    out: set[int] = set()
    for start, stop in runs:
        w = waits[order[stop]]
        if w < 0 or not head <= position[w] < start:
            continue
        if all(views[order[p]] for p in range(start, stop)):
            continue  # a view: free to run early (`schedule.plan`)
        out.update(range(start, stop))
    return frozenset(out)
