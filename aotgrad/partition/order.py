"""The backward's order, worked out on index lists built once per graph: a budget orders
the backward of every candidate saved set (`split.recompute_late`) and finds which of its
recomputation waits for a cotangent (`schedule.plan`'s groups), tens of times on one
graph. Per saved set these are passes over the backward's equation indices only, not over
the equations' variables.
"""
from __future__ import annotations

import functools
import weakref
from typing import Sequence

from jax.extend.core import Var

from aotgrad.partition import schedule
from aotgrad.partition.graph import JointGraph
from aotgrad.partition.rules import MATMULS

__all__ = ["Links", "links", "recompute_late", "tied"]


class Links:
    """Per joint equation (by index): the producers of its variable operands (and of those
    computed in the forward), the equations that read its results, whether it is a backward equation
    (`JointGraph.is_backward_eqn`), a view (`schedule.VIEWS`) or a matmul."""

    def __init__(self, graph: JointGraph) -> None:
        self.graph = graph
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

    @functools.cached_property
    def waits(self) -> dict[int, int]:
        """Per backward equation C: the equation computing the value a group whose first
        consumer is C waits for (`schedule._latest_backward_input`, then
        `schedule._smallest_source`), -1 if none. The same in every order
        `recompute_late` gives: there the backward's own equations keep their joint order,
        so the latest-computed backward operand is the latest in the joint graph."""
        graph = self.graph
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


def recompute_late(graph: JointGraph, idx: Sequence[int]) -> list[int]:
    """Orders the backward's equations (joint indices `idx`): its own (cotangent-dependent)
    equations in joint order, each recomputed forward equation just before its first use,
    so recomputed values do not live longer than they must."""
    lk = links(graph)
    backward, operands = lk.backward, lk.forward_operands
    pending = {i for i in idx if not backward[i]}  # recomputed, not emitted yet
    order: list[int] = []
    for i in idx:
        if backward[i]:
            if operands[i] and pending and any(p in pending for p in operands[i]):
                _emit(i, operands, pending, order)
            else:  # nothing to recompute first
                order.append(i)
    for i in idx:  # recomputed values returned directly as gradients
        if i in pending:
            _emit(i, operands, pending, order)
    return order


def _emit(root: int, operands: list[tuple[int, ...]], pending: set[int], order: list[int]) -> None:
    """Emits `root` after the `pending` equations it reads, depth first (iterative: graphs
    can be deep), each operand's before the next's from the last operand back."""
    stack = [(root, False)]
    while stack:
        i, ready = stack.pop()
        if ready:
            pending.discard(i)
            order.append(i)
        elif i == root or i in pending:  # else emitted since it was pushed
            stack.append((i, True))
            stack.extend((p, False) for p in operands[i] if p in pending)


def tied(graph: JointGraph, order: Sequence[int]) -> set[int]:
    """The positions in `order` (a backward in `recompute_late`'s order, joint indices) of
    the recomputed equations that wait for a cotangent on one device: the members of
    `schedule.plan(order's equations, graph.backward)`'s groups, found as it finds them."""
    lk = links(graph)
    backward, readers, waits = lk.backward, lk.readers, lk.waits
    n = len(order)
    position = [-1] * len(backward)  # per joint equation; -1: not in `order`
    for p, j in enumerate(order):
        position[j] = p
    first = [n] * n  # the first backward equation needing each (n: none)
    members: dict[int, list[int]] = {}
    for p in range(n - 1, -1, -1):
        j = order[p]
        if backward[j]:
            continue
        best = n
        for r in readers[j]:
            q = position[r]
            if q >= 0:
                f = q if backward[r] else first[q]
                if f < best:
                    best = f
        if best < n:
            first[p] = best
            members.setdefault(best, []).append(p)
    head = next((p for p, j in enumerate(order) if backward[j] and lk.matmuls[j]), 0)  # `schedule._head`
    out: set[int] = set()
    for c, group in members.items():
        start, stop = group[-1], group[0] + 1  # found from the end: descending
        w = waits[order[c]]
        if w < 0 or not head <= position[w] < start or stop - start != len(group):
            continue
        if all(lk.views[order[p]] for p in group):
            continue  # a view: free to run early (`schedule.plan`)
        out.update(range(start, stop))
    return out
