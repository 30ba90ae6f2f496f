"""The "min_cut" strategy: the cheapest saved set, as a minimum s-t cut of the joint graph.

The flow network has one node per forward equation (e) and one per forward value (v):

    source --recompute cost--> e --save cost--> v --inf--> (equations reading v) ...
                                                v --inf--> sink   (if the backward reads v)

A node on the source side is computed in the forward; an equation on the sink side is
recomputed in the backward. Cutting `e -> v` saves v; cutting `source -> e` recomputes e.
Inputs are not nodes: they are free to save as themselves. Rules and costs live in
`rules.py` and `costs.py`; the memory budget in `budget.py`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax.extend.core.primitives as P
import numpy as np
from jax.extend.core import JaxprEqn, Var

from aotgrad.partition import costs
from aotgrad.partition.budget_value import FUSED_REASON, Budget, is_fused_plan
from aotgrad.partition.flow import INF, Network
from aotgrad.partition.fusion import deps
from aotgrad.partition.graph import JointGraph
from aotgrad.partition.rules import FLOAT_EQUALITY, Kind, kind_of
from aotgrad.partition.scan import is_cut_scan

__all__ = ["Cut", "Problem", "min_cut"]

_FINITE_TOTAL = 2 ** 28  # finite capacities are scaled to sum to at most this
# Equations XLA emits as a bitcast of their operand's buffer (row-major layouts): a reshape
# of an input is a view of an array held the whole step, so recomputing it writes nothing.
_VIEWS = frozenset({P.reshape_p, P.squeeze_p})


@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
    """The forward half of a joint graph as a flow network, without capacities."""
    graph: JointGraph
    eqns: tuple[int, ...]  # joint-graph indices of forward, input-dependent equations
    kinds: tuple[Kind, ...]  # the rule of each
    values: tuple[Var, ...]  # the values they produce
    producer: np.ndarray  # for each value, its equation's position in `eqns`
    edges: tuple[np.ndarray, np.ndarray]  # (value position, equation position): v is read by e
    needed: np.ndarray  # value positions the backward reads
    written: np.ndarray  # per value: written to memory in the forward anyway (bool)
    operands: np.ndarray  # value positions a backward matmul (or other opaque equation) reads
    operands_cost: bool  # a recomputed one is written to memory and read back in the backward
    # Per value: bytes a row-normalization kernel reads again if the value is saved (0: none)
    row_reads: np.ndarray

    @classmethod
    def priced(cls, graph: JointGraph, stacked: bool = False) -> "Problem":
        """The problem as "min_cut" prices it for the graph's device: a recomputed value a
        backward matmul reads is charged its write and read where the device says so, but
        not in a scan body (`stacked`), whose saved values are written into their stacks
        anyway."""
        device = graph.device
        return cls.of(graph, device is not None and device.matmul_operands_cost and not stacked,
                      device is not None and device.row_reductions_fuse)

    @classmethod
    def of(cls, graph: JointGraph, operands_cost: bool = False, rows_fuse: bool = False) -> "Problem":
        """`operands_cost`: recomputing a value a backward matmul reads costs its write and
        read there (the device's `matmul_operands_cost`). `rows_fuse`: the device runs a row
        normalization as one kernel, and saving a value inside it costs one more read of
        its input (`_row_reads`). Recomputation is priced for the graph's device
        (`costs.recompute_cost`)."""
        dependent = graph.input_dependent
        eqns, kinds, values, producer = [], [], [], []
        position: dict[Var, int] = {}
        needed = set()
        operands = set()  # forward values a backward matmul reads
        widened: set[Var] = set()  # values computed from 16-bit floats widened to 32 bits
        views = set(graph.inputs)  # inputs and their reshapes: held all step, never written again
        for i, eqn in enumerate(graph.eqns):
            if graph.is_backward_eqn(eqn):  # its forward inputs must be available there
                needed.update(position[v] for v in _vars(eqn.invars) if v in position)
                if kind_of(eqn) in (Kind.COSTLY, Kind.UNSAFE):
                    operands.update(position[v] for v in _vars(eqn.invars) if v in position and v not in views)
                continue
            if eqn.primitive in _VIEWS and eqn.invars[0] in views:  # e.g. a scan's stacked weights in segments
                views.update(_vars(eqn.outvars))
            if _from_widened(eqn, widened):
                widened.update(_vars(eqn.outvars))
            if not any(v in dependent for v in _vars(eqn.outvars)):
                continue
            eqns.append(i)
            unsafe_test = eqn.primitive in FLOAT_EQUALITY and any(v in widened for v in _vars(eqn.invars))
            kinds.append(Kind.UNSAFE if unsafe_test or is_cut_scan(eqn) else kind_of(eqn))
            for v in _vars(eqn.outvars):
                position[v] = len(values)
                values.append(v)
                producer.append(len(eqns) - 1)
        needed.update(position[v] for v in _vars(graph.grads) if v in position)
        reads_v, reads_e = [], []
        written = np.zeros(len(values), bool)
        for e, i in enumerate(eqns):
            for v in _vars(graph.eqns[i].invars):
                if v in position:
                    reads_v.append(position[v])
                    reads_e.append(e)
                    if kinds[e] in (Kind.COSTLY, Kind.UNSAFE) and v not in views:
                        written[position[v]] = True  # a matmul operand is materialized
        for k in range(len(values)):
            if kinds[producer[k]] not in (Kind.CHEAP, Kind.MOVE):
                written[k] = True
        for v in _vars(graph.outputs):
            if v in position:
                written[position[v]] = True
        row_reads = _row_reads(graph, eqns, kinds, values) if rows_fuse else np.zeros(len(values))
        return cls(graph, tuple(eqns), tuple(kinds), tuple(values), np.asarray(producer, np.int64),
                   (np.asarray(reads_v, np.int64), np.asarray(reads_e, np.int64)),
                   np.asarray(sorted(needed), np.int64), written, np.asarray(sorted(operands), np.int64),
                   operands_cost, row_reads)

    @functools.cached_property
    def crossing(self) -> "Problem":
        """The graph priced by what crosses between programs run apart: a saved value's bytes
        (twice where saving it is a write of its own), whatever the device. A device's
        pricing of the traffic around a recomputed matmul operand or a row normalization
        (`priced`) is for one program, where saved values are freed as the backward reads
        them; apart they are all held until the backward returns. GPT-2 small on an H100
        saved 16.3 GB priced for its traffic, 9.5 GB priced so."""
        return self if not (self.operands_cost or self.row_reads.any()) else Problem.of(self.graph)

    @functools.cached_property
    def position(self) -> dict[Var, int]:
        """Each forward value's position in `values`."""
        return {v: k for k, v in enumerate(self.values)}

    @functools.cached_property
    def eqn_position(self) -> np.ndarray:
        """Per joint equation, its position in `eqns` (-1: not one of them)."""
        out = np.full(len(self.graph.eqns), -1, np.int64)
        out[np.asarray(self.eqns, np.int64)] = np.arange(len(self.eqns))
        return out

    @functools.cached_property
    def value_ids(self) -> np.ndarray:
        """Each forward value's number in the graph's `fusion.Deps`."""
        return deps(self.graph).numbers(self.values)

    def kind_of_value(self, k: int) -> Kind:
        """The rule of the equation that produces value `k`."""
        return self.kinds[self.producer[k]]

    @functools.cached_property
    def nbytes(self) -> np.ndarray:
        return np.asarray([costs.nbytes(v.aval) for v in self.values], np.float64)

    @functools.cached_property
    def save_costs(self) -> np.ndarray:
        return np.asarray([costs.save_cost(v.aval, bool(w))
                           for v, w in zip(self.values, self.written, strict=True)], np.float64) + self.row_reads

    def recompute_costs(self, allow_costly: bool) -> np.ndarray:
        """Per equation; compute-bound equations are infinite unless `allow_costly`."""
        out = []
        for i, kind in zip(self.eqns, self.kinds, strict=True):
            if kind is Kind.COSTLY and not allow_costly:
                out.append(np.inf)
            else:
                out.append(costs.recompute_cost(self.graph.eqns[i], kind, self.graph.device))
        out = np.asarray(out, np.float64)
        if self.operands_cost:  # its producer's recomputation also writes it and reads it back
            np.add.at(out, self.producer[self.operands], 2 * self.nbytes[self.operands])
        return out

    def cheapest_cut(self) -> "Cut":
        """The cut that moves the fewest bytes by the cost model: compute-bound equations are
        never recomputed, others where that is cheaper than saving."""
        return self.solve(self.save_costs, self.recompute_costs(allow_costly=False))

    def fused_cut(self) -> "Cut":
        """The fused step's plan: every forward value the backward reads is saved; only the
        user's `jax.checkpoint` regions are recomputed, as `jax.vjp` recomputes them."""
        costs = self.recompute_costs(allow_costly=False)
        checkpointed = [self.graph.eqns[i].primitive is P.remat_p for i in self.eqns]
        return self.solve(self.save_costs, np.where(checkpointed, costs, np.inf))

    def top_cut(self, stacked: bool) -> "Cut":
        """Budget 1's cut: the cheapest for where the programs run.

        In a step traced under `jax.jit` (`JointGraph.staged`, outside scans), the fused
        step's: XLA compiles forward and backward as one program and frees each value after
        its last reader, and a recomputation must wait for its cotangent (`schedule.py`),
        which splits XLA's fusions, so every cut that recomputes moved more bytes than the
        fused step on every compiler measured (XLA:CPU 3.5-18% on five real models, XLA:GPU
        10% on a GPT) even where the model prices it cheaper.

        Where the programs run apart (`fwd_and_bwd`, an eager `jax.grad`, an export), every
        saved value crosses from one program to the other and is held between them: the
        cheapest cut priced by what crosses (`crossing`), which recomputes cheap elementwise
        work rather than save it, never saving more bytes than the fused step's plan
        (`jax.vjp`'s). In a scan body (`stacked`), where a saved value is written into its
        stack, the cheapest cut: it moved fewer bytes than the fused step there
        (docs/benchmarks.md)."""
        if self.graph.staged and not stacked:
            return self.fused_cut()
        if stacked:
            return self.cheapest_cut()
        cheapest = self.crossing.cheapest_cut()
        fused = self.fused_cut()
        return cheapest if cheapest.activation_bytes <= fused.activation_bytes else fused

    def top_reasons(self, top: "Cut", stacked: bool) -> dict[Var, str]:
        """Budget 1's saved values (`top`, what `top_cut(stacked)` gave), each with its reason."""
        return top.reasons(FUSED_REASON) if self.graph.staged and not stacked else top.reasons()

    @functools.cached_property
    def network(self) -> Network:
        """The flow network (laid out once): source -> equation (its recompute cost), equation
        -> each value it makes (the value's save cost), value -> each equation reading it and
        each value the backward reads -> sink (both infinite)."""
        n_e, n_v = len(self.eqns), len(self.values)
        enode = 2 + np.arange(n_e)
        vnode = 2 + n_e + np.arange(n_v)
        rows = np.concatenate([np.zeros(n_e, np.int64), enode[self.producer], vnode[self.edges[0]],
                               vnode[self.needed]])
        cols = np.concatenate([enode, vnode, enode[self.edges[1]], np.ones(len(self.needed), np.int64)])
        return Network(rows, cols, 2 + n_e + n_v)

    def solve(self, save: np.ndarray, recompute: np.ndarray) -> "Cut":
        """The minimum cut for these capacities (per value, per equation; inf allowed)."""
        n_e = len(self.eqns)
        caps = _to_int(np.concatenate([recompute, save, np.full(len(self.edges[0]) + len(self.needed), np.inf)]))
        reachable = self.network.source_side(caps)
        saved = reachable[2:2 + n_e][self.producer] & ~reachable[2 + n_e:]
        return Cut(self, frozenset(self.values[k] for k in np.flatnonzero(saved)))


def _to_int(c: np.ndarray) -> np.ndarray:
    finite = np.isfinite(c)
    scale = max(1.0, float(c[finite].sum()) / _FINITE_TOTAL)
    out = np.full(c.shape, INF, np.int64)
    out[finite] = np.ceil(c[finite] / scale)
    return out


_HALF = frozenset(np.dtype(d) for d in ("float16", "bfloat16"))
_WIDE = frozenset(np.dtype(d) for d in ("float32", "float64"))


def _from_widened(eqn: JaxprEqn, widened: set[Var]) -> bool:
    """Whether `eqn`'s outputs are computed from a 16-bit float widened to float32 or more
    (a cast up, a matmul accumulating in float32). Such a value may differ from its
    recomputation: XLA may skip the 16-bit rounding before the widening in the forward, but
    a recomputation starts from the saved, rounded value."""
    ins = _vars(eqn.invars)
    if any(v in widened for v in ins):
        return True
    return any(getattr(v.aval, "dtype", None) in _HALF for v in ins) and \
        any(getattr(v.aval, "dtype", None) in _WIDE for v in _vars(eqn.outvars))


def _row_reads(graph: JointGraph, eqns: list[int], kinds: list[Kind], values: list[Var]) -> np.ndarray:
    """Per value: the bytes of the row a last-axis reduction reads, if the value is that
    reduction's result or computed from it by fusible equations while still smaller than
    the row (a softmax's max and sum, a layer norm's mean and scale). XLA:GPU fuses the
    normalization into one kernel only while none of these must be written out; saving
    one splits it into kernels that each read the row again."""
    row: dict[Var, Var] = {}  # a value inside a normalization -> the row it reduces
    out = np.zeros(len(values))
    k = 0
    for i, kind in zip(eqns, kinds, strict=True):
        eqn = graph.eqns[i]
        rows: list[Var] = []
        if kind is Kind.REDUCE and costs.over_last_axis(eqn) and isinstance(eqn.invars[0], Var):
            rows = [eqn.invars[0]]
        elif kind in (Kind.CHEAP, Kind.MOVE):
            rows = [row[v] for v in _vars(eqn.invars) if v in row]
        source = max(rows, key=lambda r: r.aval.size, default=None)
        for v in _vars(eqn.outvars):
            if source is not None and v.aval.size < source.aval.size:  # still per row
                row[v] = source
                out[k] = costs.nbytes(source.aval)
            k += 1
    return out


def _vars(atoms: object) -> list[Var]:
    return [v for v in atoms if isinstance(v, Var)]


@dataclasses.dataclass(frozen=True, eq=False)
class Cut:
    """A saved set: forward values the forward program writes for the backward."""
    problem: Problem
    cut: frozenset[Var]  # as cut, before pruning

    @functools.cached_property
    def _live(self) -> np.ndarray:
        """The backward's equations (`backward_eqns`), as an array."""
        d = deps(self.problem.graph)  # inputs, cotangents and constants: nothing makes them
        return d.live(self.problem.graph.grads, d.numbers(self.cut), keep_effects=True)

    @functools.cached_property
    def backward_eqns(self) -> list[int]:
        """Joint-graph indices of the equations the backward runs, cut at saved values."""
        return self._live.tolist()

    @functools.cached_property
    def saved(self) -> tuple[Var, ...]:
        """Cut values and inputs the backward actually reads, after dead-code elimination."""
        graph = self.problem.graph
        d = deps(graph)
        read = np.zeros(len(d.ids), bool)
        read[d.numbers(graph.grads)] = True
        read[d.read[np.isin(d.readers, self._live)]] = True
        inputs = [v for v in graph.inputs if read[d.ids[v]]]
        in_cut = np.zeros(len(d.ids), bool)
        in_cut[d.numbers(self.cut)] = True
        values = self.problem.value_ids
        return tuple(inputs + [self.problem.values[k] for k in np.flatnonzero(in_cut[values] & read[values])])

    @functools.cached_property
    def positions(self) -> np.ndarray:
        """Positions (in `problem.values`) of the saved forward values, sorted: inputs have none."""
        position = self.problem.position
        return np.asarray(sorted(position[v] for v in self.saved if v in position), np.int64)

    @functools.cached_property
    def activation_bytes(self) -> int:
        inputs = set(self.problem.graph.inputs)
        return sum(costs.nbytes(v.aval) for v in self.saved if v not in inputs)

    @functools.cached_property
    def recomputed(self) -> tuple[int, ...]:
        """Positions (in `problem.eqns`) of the forward equations the backward runs again."""
        position = self.problem.eqn_position[self._live]
        return tuple(position[position >= 0].tolist())

    def reasons(self, why_cheaper: str = "cheaper to save than to recompute",
                costly_banned: bool = True) -> dict[Var, str]:
        """Each saved value with the reason it is saved: `why_cheaper` for values the cost
        model chose to save, "banned" for values of equations that are never recomputed
        (compute-bound ones only when `costly_banned`)."""
        problem = self.problem
        graph = problem.graph
        inputs = set(graph.inputs)
        out = {}
        for v in self.saved:
            if v in inputs:
                out[v] = "input: saved as itself, free"
                continue
            primitive = graph.eqns[graph.producer[v]].primitive
            prim = primitive.name
            kind = problem.kind_of_value(problem.position[v])
            if kind is Kind.UNSAFE and is_cut_scan(graph.eqns[graph.producer[v]]):
                out[v] = ("banned: a scan cut inside its body is not run twice (the budget applies "
                          "inside it: per iteration, or to carries saved every k-th iteration)")
            elif kind is Kind.UNSAFE and primitive in FLOAT_EQUALITY:
                out[v] = (f"banned: {prim} of values widened from 16 bits is never run twice "
                          f"(a recomputed operand may round differently)")
            elif kind is Kind.UNSAFE:
                out[v] = f"banned: {prim} is never run twice"
            elif kind is Kind.COSTLY and costly_banned:
                out[v] = f"banned: {prim} is compute-bound, not recomputed"
            else:
                out[v] = why_cheaper
        return out


def min_cut(graph: JointGraph, budget: Budget = 1.0, stacked: bool = False) -> dict[Var, str]:
    """The "min_cut" strategy: the cheapest saved set in bytes moved; with a budget below
    1 or in bytes, a lower step peak at the least recompute cost (see `budget.py`).
    `stacked`: the graph is a scan body, whose saved set is held once per iteration."""
    problem = Problem.priced(graph, stacked)
    if is_fused_plan(budget):
        return problem.top_reasons(problem.top_cut(stacked), stacked)
    from aotgrad.partition.budget import within_budget
    return within_budget(problem, budget, stacked)
