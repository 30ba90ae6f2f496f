"""The step's programs as XLA runs them, and how XLA reads each value there: what the peak
estimate (`peak.py`) and the traffic estimate (`traffic.py`) both follow.

Which programs: a call run as it comes (eagerly) runs the forward and the backward as two
programs, the saved values arguments of the whole backward. A step traced under
`jax.jit` (`JointGraph.staged`) is one program, the forward then the backward. The
equations run in the order the programs are emitted: the backward's recomputation just
before its first use where `ties.tie` holds it there, and at the backward's start
where nothing does (XLA starts independent work early).

How each value is read (`reads`): an elementwise value read by one elementwise equation
or one reduction fuses into it and is not written to memory; a second reader makes XLA
write it (XLA:CPU keeps a batch norm's centred input, say, for its backward). XLA:GPU
computes cheap elementwise work again in each reader instead (`rules.duplicated`): its
operands are read there. A `split`'s parts (and their reshapes) are read through: XLA
fuses a part into its readers, which read the split's operand there. On a GPU, the
elementwise part of the recomputation moved to the backward's start is computed in its
later readers, and what it reads lives until then (an 8-layer MLP: estimated as freed
at the start, the last layer's saved pre-activation made budget 0 take a cut that peaked
1.18x `nothing_saveable`'s on an H100).
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import AbstractSet, Callable, Iterable, Sequence

import numpy as np
import scipy.sparse
from jax.extend.core import JaxprEqn, Var
from scipy.sparse.csgraph import breadth_first_order

from aotgrad._jax_internals import primitives as I
from aotgrad.partition import order, schedule
from aotgrad.partition.graph import JointGraph
from aotgrad.partition.rules import Kind, duplicated, kind_of
from aotgrad.partition.shards import per_device_bytes

__all__ = ["FUSED", "READ_FUSED", "Deps", "Program", "Programs", "Reads", "Row", "Value", "deps", "held", "programs",
           "reads", "rows"]

FUSED = (Kind.CHEAP, Kind.MOVE)  # equations XLA fuses into their readers
READ_FUSED = FUSED + (Kind.REDUCE,)  # readers a single elementwise producer fuses into

Value = tuple[Var, int]  # a variable as bound by one equation (its index; -1: an argument)
# What `reads` and the estimates need of one equation, worked out once per graph: its
# variable operands, its variable results, its rule, and whether XLA computes it again in
# each fusing reader (`rules.duplicated`).
Row = tuple[tuple[Var, ...], tuple[Var, ...], Kind, bool]


def rows(eqns: Sequence[JaxprEqn], recomputed_in_readers: Callable[[JaxprEqn], bool],
         kinds: Sequence[Kind] | None = None) -> list[Row]:
    """Each equation's `Row` (its rule from `kinds` if given)."""
    return [(tuple(v for v in e.invars if isinstance(v, Var)), tuple(v for v in e.outvars if isinstance(v, Var)),
             kind_of(e) if kinds is None else kinds[i], recomputed_in_readers(e)) for i, e in enumerate(eqns)]


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of the step: its equations in the order XLA runs them, its arguments
    and its outputs."""
    eqns: list[JaxprEqn]
    args: list[Var]
    outs: list
    early: range = range(0)  # the backward's untied recomputation moved to its start (a GPU's: `reads`)
    rows: list[Row] | None = None  # each equation's `Row`, if known
    index: list[int] | None = None  # each equation's index in the joint graph, if known

    def table(self, recomputed_in_readers: Callable[[JaxprEqn], bool]) -> list[Row]:
        return self.rows if self.rows is not None else rows(self.eqns, recomputed_in_readers)


@dataclasses.dataclass(frozen=True)
class Programs:
    """The step's programs (`runs`: one for a jitted step, the forward and the backward for
    an eager call), each value's bytes on one device (`shards.per_device_bytes`), and which
    equations XLA computes again in each fusing reader."""
    runs: tuple[Program, ...]
    size: Callable[[Var], int]
    recomputed_in_readers: Callable[[JaxprEqn], bool]
    graph: JointGraph | None = None  # the joint graph the runs' `index` is into


class Deps:
    """Which joint equations read which values, as arrays: `graph.live_eqns` for the many
    saved sets a budget weighs on one graph, each a breadth-first search in scipy rather
    than a pass over every equation in Python."""

    def __init__(self, graph: JointGraph) -> None:
        self.ids: dict[Var, int] = {}  # every variable's number
        for v in (*graph.closed.jaxpr.constvars, *graph.closed.jaxpr.invars):
            self.ids.setdefault(v, len(self.ids))
        made_by, readers, read = [], [], []
        for i, e in enumerate(graph.eqns):
            for v in e.invars:
                if isinstance(v, Var):
                    readers.append(i)
                    read.append(self.ids.setdefault(v, len(self.ids)))
            for v in e.outvars:
                if isinstance(v, Var):
                    made_by.append((self.ids.setdefault(v, len(self.ids)), i))
        self.n = len(graph.eqns)
        self.producer = np.full(len(self.ids), -1, np.int64)  # per variable; -1: none
        for k, i in made_by:
            self.producer[k] = i
        self.readers = np.asarray(readers, np.int64)  # per read: the reading equation
        self.read = np.asarray(read, np.int64)  # per read: the variable read
        self.always = np.asarray([i for i, e in enumerate(graph.eqns)
                                  if e.effects and graph.is_backward_eqn(e)], np.int64)
        self.outputs = tuple(graph.outputs)  # the step's forward outputs (`forward`)

    def numbers(self, values: Iterable) -> np.ndarray:
        return np.asarray([self.ids[v] for v in values if isinstance(v, Var)], np.int64)

    @functools.cached_property
    def _outputs_live(self) -> tuple[list[int], np.ndarray]:
        """The equations the graph's outputs need, and per variable whether one makes it."""
        found = self.live(self.outputs, np.zeros(0, np.int64))
        made = np.zeros(self.n + 1, bool)  # per equation (the last entry: none)
        made[found] = True
        return found.tolist(), made[self.producer]

    def forward(self, values: Sequence) -> list[int]:
        """`live(outputs + values)` from the inputs: the outputs' equations are found once
        per graph, and are all it is where they make every value too."""
        found, made = self._outputs_live
        if made[self.numbers(values)].all():  # their equations' ancestors are among the outputs'
            return list(found)
        return self.live([*self.outputs, *values], np.zeros(0, np.int64)).tolist()

    def live(self, roots: Iterable, available: np.ndarray, keep_effects: bool = False) -> np.ndarray:
        """The sorted equation indices needed to compute `roots`, stopping at the variables
        numbered `available` (whole graph inputs need not be listed: nothing makes them);
        with `keep_effects`, the backward's effectful equations too (`Cut.backward_eqns`)."""
        stop = np.zeros(len(self.ids), bool)
        stop[available] = True
        root_ids = self.numbers(roots)
        starts = self.producer[root_ids[~stop[root_ids]]]
        starts = starts[starts >= 0]
        if keep_effects:
            starts = np.concatenate([starts, self.always])
        edge = (self.producer[self.read] >= 0) & ~stop[self.read]
        rows = np.concatenate([self.readers[edge], np.full(len(starts), self.n)])
        cols = np.concatenate([self.producer[self.read[edge]], starts])
        adj = scipy.sparse.csr_matrix((np.ones(len(rows), np.int8), (rows, cols)), shape=(self.n + 1,) * 2)
        found = breadth_first_order(adj, self.n, directed=True, return_predecessors=False)
        return np.sort(found[found < self.n])


@dataclasses.dataclass(frozen=True)
class Table:
    """What the estimates read of each joint equation (by index), worked out once per graph."""
    rows: list[Row]
    backward: list[bool]  # reads a cotangent-dependent value (`JointGraph.is_backward_eqn`)
    size: Callable[[Var], int]  # bytes on one device (`shards.per_device_bytes`), remembered


_DEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def deps(graph: JointGraph) -> Deps:
    """The graph's `Deps`, built once."""
    if graph not in _DEPS:
        _DEPS[graph] = Deps(graph)
    return _DEPS[graph]


def table(graph: JointGraph) -> Table:
    """The graph's `Table`, built once."""
    if graph not in _TABLES:
        size = per_device_bytes(graph)
        sizes = {v: size(v) for v in deps(graph).ids}
        _TABLES[graph] = Table(rows(graph.eqns, _duplicated(graph)), [graph.is_backward_eqn(e) for e in graph.eqns],
                               lambda v: sizes[v] if v in sizes else size(v))
    return _TABLES[graph]


def _duplicated(graph: JointGraph) -> Callable[[JaxprEqn], bool]:
    return functools.partial(duplicated, platform=None if graph.device is None else graph.device.platform)


def programs(graph: JointGraph, saved: Sequence[Var], backward_order: Sequence[int],
             waiting: AbstractSet[int] | None = None) -> Programs:
    """The programs that save `saved` (joint values, inputs among them); `backward_order`:
    the backward's equations (joint indices) in emitted order; `waiting`: the positions
    there of recomputation tied to a cotangent (`order.ordered`), found with
    `schedule.plan` if not given."""
    inputs = set(graph.inputs)
    activations = [v for v in saved if v not in inputs]
    fwd_idx = deps(graph).forward(activations)
    if waiting is None:
        groups = schedule.plan([graph.eqns[i] for i in backward_order], graph.backward)
        waiting = {p for g in groups for p in range(g.start, g.stop)}
    bwd_idx, moved = _untied_first(graph, list(backward_order), waiting)
    platform = None if graph.device is None else graph.device.platform
    if platform != "gpu":  # measured on XLA:GPU only (`reads`): elsewhere nothing moved counts
        moved = 0
    args, cotangents = list(graph.inputs), list(graph.cotangents)
    outs, grads = list(graph.outputs), list(graph.grads)
    t, eqns = table(graph), graph.eqns

    def run(idx: list[int], *rest: object) -> Program:
        return Program(list(map(eqns.__getitem__, idx)), *rest,  # type: ignore[arg-type]
                       rows=list(map(t.rows.__getitem__, idx)), index=idx)

    if graph.staged:  # one program: the saved values are its temporaries
        runs = (run(fwd_idx + bwd_idx, args + cotangents, outs + grads,
                    range(len(fwd_idx), len(fwd_idx) + moved)),)
    else:  # the saved values are the forward's outputs and the backward's arguments
        runs = (run(fwd_idx, args, outs + activations),
                run(bwd_idx, list(saved) + cotangents, grads, range(moved)))
    return Programs(runs, t.size, _duplicated(graph), graph)


def _untied_first(graph: JointGraph, idx: list[int], waiting: AbstractSet[int]) -> tuple[list[int], int]:
    """The backward's equations (joint indices) as XLA runs them: recomputation that no
    group ties to a cotangent (`waiting`: positions in `idx`) moves to the start (with what
    it reads, when that is untied too); and how many moved."""
    lk = order.links(graph)
    at = np.asarray(idx, np.int64)
    early = np.zeros(len(at), bool)
    operands = lk.forward_operands
    made_late: set[int] = set()  # recomputation reading what these make stays late too
    for n in np.flatnonzero(~lk.is_backward[at]).tolist():  # (forward equations never read the backward's)
        i = idx[n]
        if n not in waiting and made_late.isdisjoint(operands[i]):
            early[n] = True
        else:
            made_late.add(i)
    return at[early].tolist() + at[~early].tolist(), int(early.sum())


@dataclasses.dataclass(frozen=True)
class Reads:
    """How XLA reads a program's values (`reads`): each equation's operands (once each;
    with those of moved recomputation computed in it), each value's last reader, the values
    it writes to memory, and which equations read each value from memory or as fused into
    them (moved recomputation's reads stay with it: where it is computed changes only how
    long its operands live)."""
    operands: list[list[Value]]
    last: dict[Value, int]
    written: set[Value]
    readers: dict[Value, set[int]]


def reads(eqns: list[JaxprEqn], kinds: list[Kind], recomputed_in_readers: Callable[[JaxprEqn], bool],
          early: range = range(0), table: list[Row] | None = None) -> Reads:
    """Follows `eqns` in order as XLA fuses them: a value read by one fusing reader (an
    elementwise equation or a reduction) is computed there, not written; a second reader
    makes it written. A value whose equation XLA computes again in each fusing reader
    (`recomputed_in_readers`) is read through: its operands are read there instead. A
    `split`'s operand is read with its parts (and their views): XLA fuses a part into its
    readers, which read the operand there. Elementwise recomputation moved to the
    backward's start (`early`) but fused into a later reader is computed there: its
    operands are read there too, if something else holds them until then. `table`: the
    equations' `Row`s, if known (else worked out here)."""
    if table is None:
        table = rows(eqns, recomputed_in_readers, kinds)
    bound: dict[Var, int] = {}  # each variable's binding in force
    operands: list[list[Value]] = []
    last: dict[Value, int] = {}
    written: set[Value] = set()
    readers: dict[Value, set[int]] = {}

    def read(u: Value, i: int, fuses: bool) -> None:
        j = u[1]
        if u in kept_by:  # a split's operand, read through its part
            written.add(kept_by[u])
            last[kept_by[u]] = i
            readers.setdefault(kept_by[u], set()).add(i)
        if fuses and u in last and u not in written and j >= 0 and table[j][3]:
            for w in operands[j]:  # computed again inside reader i, from its operands
                read(w, i, True)
        else:
            if not fuses or u in last:  # a second reader: XLA writes it
                written.add(u)
            readers.setdefault(u, set()).add(i)
        last[u] = i  # equations are read in order: i is the latest reader yet

    kept_by: dict[Value, Value] = {}  # a split's parts (and their views): its operand
    for i, e in enumerate(eqns):
        invars, outvars, kind, _ = table[i]
        ins = [(v, bound.get(v, -1)) for v in invars]
        operands.append(list(dict.fromkeys(ins)) if len(ins) > 1 else ins)
        fuses = kind in READ_FUSED
        for u in ins:
            if u in kept_by or (fuses and u[1] >= 0 and table[u[1]][3]):
                read(u, i, fuses)
                continue
            if not fuses or u in last:  # as `read` does, inline: the common case
                written.add(u)
            if u in readers:
                readers[u].add(i)
            else:
                readers[u] = {i}
            last[u] = i
        for v in outvars:
            bound[v] = i
        if e.primitive is I.split_p and ins:
            kept_by.update(((v, i), ins[0]) for v in e.outvars)
        elif e.primitive in schedule.VIEWS and ins and ins[0] in kept_by:
            kept_by[(e.outvars[0], i)] = kept_by[ins[0]]
    del read  # it refers to itself: a reference cycle, which would outlive the call
    r = Reads(operands, last, written, readers)
    _computed_where_read(eqns, kinds, early, r)
    return r


def held(graph: JointGraph, idx: Sequence[int]) -> set[Var]:
    """The values a program of the joint equations `idx` (in order) holds in memory: the
    results of equations XLA does not fuse into their readers, and the values it writes
    (`reads`)."""
    t = table(graph)
    run = [t.rows[i] for i in idx]
    r = reads([graph.eqns[i] for i in idx], [row[2] for row in run], _duplicated(graph), table=run)
    return {v for v, _ in r.written} | {v for row in run if row[2] not in FUSED for v in row[1]}


def _computed_where_read(eqns: list[JaxprEqn], kinds: list[Kind], early: range, r: Reads) -> None:
    """Recomputation moved to the backward's start (`early`) that fuses into a later reader
    is computed in that reader (or in the reader that one fuses into): an operand that
    something else holds in memory anyway (a second reader) lives until then, and its
    buffer is free for that reader's result."""
    if not len(early):
        return

    def fused(u: Value) -> bool:  # computed inside its reader, not written
        return u[1] >= 0 and kinds[u[1]] in FUSED and u in r.last and u not in r.written

    at: dict[Value, int] = {}  # a fused value: the equation that computes it
    reach: dict[Value, int] = {}  # a fused value that moved recomputation reads: where that is computed
    for j in range(len(eqns) - 1, -1, -1):
        for u in [(v, j) for v in eqns[j].outvars if isinstance(v, Var)]:
            if not fused(u):
                continue
            i = r.last[u]  # its one reader
            at[u] = max([at[(v, i)] for v in eqns[i].outvars if (v, i) in at], default=i)
            t = at[u] if j in early and at[u] not in early else reach.get(u)
            for w in r.operands[j] if t is not None else ():
                if fused(w):  # computed there too, from its own operands
                    reach[w] = max(reach.get(w, t), t)
                elif len(r.readers.get(w, ())) > 1 and r.last.get(w, j) < t:
                    r.last[w] = t
                    r.operands[t].append(w)
