"""The step's programs as XLA runs them, and how XLA reads each value there: what the peak
estimate (`peak.py`) and the traffic estimate (`traffic.py`) both follow.

Which programs: a call run as it comes (eagerly) runs the forward and the backward as two
programs, the saved values arguments of the whole backward. A step traced under
`jax.jit` (`JointGraph.staged`) is one program, the forward then the backward. The
equations run in the order the programs are emitted: the backward's recomputation just
before its first use where `schedule.tie` holds it there, and at the backward's start
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
from typing import Callable, Sequence

from jax.extend.core import JaxprEqn, Var

from aotgrad._jax_internals import primitives as I
from aotgrad.partition import schedule
from aotgrad.partition.graph import JointGraph, live_eqns
from aotgrad.partition.rules import Kind, duplicated
from aotgrad.partition.shards import per_device_bytes

__all__ = ["FUSED", "Program", "Programs", "Reads", "Value", "programs", "reads"]

FUSED = (Kind.CHEAP, Kind.MOVE)  # equations XLA fuses into their readers
_READ_FUSED = FUSED + (Kind.REDUCE,)  # readers a single elementwise producer fuses into

Value = tuple[Var, int]  # a variable as bound by one equation (its index; -1: an argument)


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of the step: its equations in the order XLA runs them, its arguments
    and its outputs."""
    eqns: list[JaxprEqn]
    args: list[Var]
    outs: list
    early: range = range(0)  # the backward's untied recomputation moved to its start (a GPU's: `reads`)


@dataclasses.dataclass(frozen=True)
class Programs:
    """The step's programs (`runs`: one for a jitted step, the forward and the backward for
    an eager call), each value's bytes on one device (`shards.per_device_bytes`), and which
    equations XLA computes again in each fusing reader."""
    runs: tuple[Program, ...]
    size: Callable[[Var], int]
    recomputed_in_readers: Callable[[JaxprEqn], bool]


def programs(graph: JointGraph, saved: Sequence[Var], backward_order: Sequence[int]) -> Programs:
    """The programs that save `saved` (joint values, inputs among them); `backward_order`:
    the backward's equations (joint indices) in emitted order."""
    inputs = set(graph.inputs)
    consts = set(graph.closed.jaxpr.constvars)
    activations = [v for v in saved if v not in inputs]
    fwd_idx, _ = live_eqns(graph.eqns, list(graph.outputs) + activations, inputs | consts)
    forward = [graph.eqns[i] for i in fwd_idx]
    backward, moved = _untied_first(graph, [graph.eqns[i] for i in backward_order])
    platform = None if graph.device is None else graph.device.platform
    if platform != "gpu":  # measured on XLA:GPU only (`reads`): elsewhere nothing moved counts
        moved = 0
    args, cotangents = list(graph.inputs), list(graph.cotangents)
    outs, grads = list(graph.outputs), list(graph.grads)
    if graph.staged:  # one program: the saved values are its temporaries
        runs = (Program(forward + backward, args + cotangents, outs + grads,
                        range(len(forward), len(forward) + moved)),)
    else:  # the saved values are the forward's outputs and the backward's arguments
        runs = (Program(forward, args, outs + activations),
                Program(backward, list(saved) + cotangents, grads, range(moved)))
    return Programs(runs, per_device_bytes(graph), functools.partial(duplicated, platform=platform))


def _untied_first(graph: JointGraph, eqns: list[JaxprEqn]) -> tuple[list[JaxprEqn], int]:
    """The backward's equations as XLA runs them: recomputation that no group ties to a
    cotangent moves to the start (with what it reads, when that is untied too); and how
    many moved."""
    tied = {i for g in schedule.plan(eqns, graph.backward) for i in range(g.start, g.stop)}
    early: list[JaxprEqn] = []
    late: list[JaxprEqn] = []
    made_late: set[Var] = set()  # an equation reading these stays late too
    for i, e in enumerate(eqns):
        ins = [v for v in e.invars if isinstance(v, Var)]
        if i not in tied and not graph.is_backward_eqn(e) and not any(v in made_late for v in ins):
            early.append(e)
        else:
            late.append(e)
            made_late.update(e.outvars)
    return early + late, len(early)


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


def reads(eqns: list[JaxprEqn], kinds: list[Kind],
          recomputed_in_readers: Callable[[JaxprEqn], bool], early: range = range(0)) -> Reads:
    """Follows `eqns` in order as XLA fuses them: a value read by one fusing reader (an
    elementwise equation or a reduction) is computed there, not written; a second reader
    makes it written. A value whose equation XLA computes again in each fusing reader
    (`recomputed_in_readers`) is read through: its operands are read there instead. A
    `split`'s operand is read with its parts (and their views): XLA fuses a part into its
    readers, which read the operand there. Elementwise recomputation moved to the
    backward's start (`early`) but fused into a later reader is computed there: its
    operands are read there too, if something else holds them until then."""
    bound: dict[Var, int] = {}  # each variable's binding in force
    operands: list[list[Value]] = []
    last: dict[Value, int] = {}
    written: set[Value] = set()
    readers: dict[Value, set[int]] = {}
    copied = [recomputed_in_readers(e) for e in eqns]

    def read(u: Value, i: int, fuses: bool) -> None:
        j = u[1]
        if u in kept_by:  # a split's operand, read through its part
            written.add(kept_by[u])
            last[kept_by[u]] = i
            readers.setdefault(kept_by[u], set()).add(i)
        if fuses and u in last and u not in written and j >= 0 and copied[j]:
            for w in operands[j]:  # computed again inside reader i, from its operands
                read(w, i, True)
        else:
            if not fuses or u in last:  # a second reader: XLA writes it
                written.add(u)
            readers.setdefault(u, set()).add(i)
        last[u] = i  # equations are read in order: i is the latest reader yet

    kept_by: dict[Value, Value] = {}  # a split's parts (and their views): its operand
    for i, e in enumerate(eqns):
        ins = [(v, bound.get(v, -1)) for v in e.invars if isinstance(v, Var)]
        operands.append(list(dict.fromkeys(ins)))
        for u in ins:
            read(u, i, kinds[i] in _READ_FUSED)
        bound.update((v, i) for v in e.outvars if isinstance(v, Var))
        if e.primitive is I.split_p and ins:
            kept_by.update(((v, i), ins[0]) for v in e.outvars)
        elif e.primitive in schedule.VIEWS and ins and ins[0] in kept_by:
            kept_by[(e.outvars[0], i)] = kept_by[ins[0]]
    r = Reads(operands, last, written, readers)
    _computed_where_read(eqns, kinds, early, r)
    return r


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
