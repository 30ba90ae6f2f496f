"""An estimate of a saved set's step peak on one device, for choosing between cuts before
compiling (each value counted at its size on one device: `shards.py`).

A program's peak is estimated as XLA's `memory_analysis()` adds it up: its arguments and
outputs, plus the largest total of temporaries live at once, running the equations in
the order the program is emitted: the backward's recomputation just before its first use
where `schedule.tie` holds it there, and at the backward's start where nothing does (XLA
starts independent work early). A temporary is counted only if XLA would write it to
memory: not an elementwise value read by one elementwise equation or one reduction, which
fuses into it (a value with two readers is written: XLA:CPU keeps a batch norm's centred
input, say, for its backward; XLA:GPU computes cheap elementwise work again in each reader
instead, keeping its operand: `rules.duplicated`), and not beside an operand whose buffer
it takes: an elementwise result writes over a same-sized operand read for the last time, a
scatter or an update in place over its first operand. A `split`'s operand lives as long as
its parts (and their reshapes): XLA fuses a part into its readers, which read the operand
there (8 H100s, GPT-2 medium with sharded parameters: a cut that saved each layer's q, k
and v held the qkv projection beside them: 13952.82 MB of activations, where the estimate
without it was 11274.8 MB for the whole step).

Which programs: a call run as it comes (eagerly) runs the forward and the backward as two
programs, and the step's peak is the larger of theirs, the saved values arguments of the
whole backward. A step traced under `jax.jit` (`JointGraph.staged`) is one program, the
forward then the backward, where each saved value is freed after its last reader.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable, Sequence

from jax.extend.core import JaxprEqn, Var

from aotgrad._jax_internals import primitives as I
from aotgrad.partition import costs, schedule
from aotgrad.partition.graph import JointGraph, live_eqns
from aotgrad.partition.rules import IN_PLACE, Kind, duplicated, kind_of
from aotgrad.partition.shards import per_device_bytes

__all__ = ["estimate"]

_FUSED = (Kind.CHEAP, Kind.MOVE)
_READ_FUSED = _FUSED + (Kind.REDUCE,)  # readers a single elementwise producer fuses into

Value = tuple[Var, int]  # a variable as bound by one equation (its index; -1: an argument)


def estimate(graph: JointGraph, saved: Iterable[Var], backward_order: Sequence[int]) -> int:
    """The estimated step peak of the programs that save `saved` (joint values, inputs
    among them); `backward_order`: the backward's equations (joint indices) in emitted
    order."""
    saved = list(saved)
    inputs = set(graph.inputs)
    consts = set(graph.closed.jaxpr.constvars)
    activations = [v for v in saved if v not in inputs]
    fwd_idx, _ = live_eqns(graph.eqns, list(graph.outputs) + activations, inputs | consts)
    forward = [graph.eqns[i] for i in fwd_idx]
    backward = _untied_first(graph, [graph.eqns[i] for i in backward_order])
    size = per_device_bytes(graph)
    platform = None if graph.device is None else graph.device.platform
    copied = functools.partial(duplicated, platform=platform)
    if graph.staged:
        return _program_peak(forward + backward, list(graph.inputs) + list(graph.cotangents),
                             list(graph.outputs) + list(graph.grads), size, copied)
    return max(_program_peak(forward, list(graph.inputs), list(graph.outputs) + activations, size, copied),
               _program_peak(backward, saved + list(graph.cotangents), list(graph.grads), size, copied))


def _untied_first(graph: JointGraph, eqns: list[JaxprEqn]) -> list[JaxprEqn]:
    """The backward's equations as XLA runs them: recomputation that no group ties to a
    cotangent moves to the start (with what it reads, when that is untied too)."""
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
    return early + late


def _program_peak(eqns: list[JaxprEqn], args: list[Var], outs: list,
                  size: Callable[[Var], int] = lambda v: costs.nbytes(v.aval),
                  recomputed_in_readers: Callable[[JaxprEqn], bool] = lambda e: False) -> int:
    """Arguments + outputs + the most temporaries live at once, running `eqns` in order.
    A value whose equation XLA computes again in each fusing reader
    (`recomputed_in_readers`, `rules.duplicated`) is not written for a second one: its
    operands are read there instead, and live until then.
    A result takes the buffer of an operand read for the last time by the same equation
    where XLA reuses it: an elementwise result of the operand's size (a fused loop writes
    over its input), an update in place (`IN_PLACE`) over its first operand. A variable
    bound twice (a forward value the backward recomputes, in one program) is two buffers.
    `size`: a value's bytes (on one device: `shards.per_device_bytes`)."""
    arg_set = set(args)
    out_set = {v for v in outs if isinstance(v, Var)}
    fixed = sum(size(v) for v in arg_set) + sum(size(v) for v in out_set - arg_set)
    kinds = [kind_of(e) for e in eqns]
    bound: dict[Var, int] = {}  # each variable's binding in force
    reads: list[list[Value]] = []  # each equation's operands, once each
    last: dict[Value, int] = {}
    written: set[Value] = set()
    copied = [recomputed_in_readers(e) for e in eqns]

    def read(u: Value, i: int, fuses: bool) -> None:
        j = u[1]
        if u in kept_by:  # a split's operand, read through its part (above)
            written.add(kept_by[u])
            last[kept_by[u]] = i
        if fuses and u in last and u not in written and j >= 0 and copied[j]:
            for w in reads[j]:  # computed again inside reader i, from its operands
                read(w, i, True)
        elif not fuses or u in last:  # a second reader: XLA writes it
            written.add(u)
        last[u] = i  # equations are read in order: i is the latest reader yet

    kept_by: dict[Value, Value] = {}  # a split's parts (and their views): its operand
    for i, e in enumerate(eqns):
        ins = [(v, bound.get(v, -1)) for v in e.invars if isinstance(v, Var)]
        reads.append(list(dict.fromkeys(ins)))
        for u in ins:
            read(u, i, kinds[i] in _READ_FUSED)
        bound.update((v, i) for v in e.outvars if isinstance(v, Var))
        if e.primitive is I.split_p and ins:
            kept_by.update(((v, i), ins[0]) for v in e.outvars)
        elif e.primitive in schedule.VIEWS and ins and ins[0] in kept_by:
            kept_by[(e.outvars[0], i)] = kept_by[ins[0]]
    held: dict[Value, int] = {}  # temporaries in memory: their bytes
    frees: dict[int, list[Value]] = {}
    live = peak = 0
    for i, e in enumerate(eqns):
        made_fuses = kinds[i] in _FUSED
        dying = [u for u in reads[i] if u in held and last[u] == i]
        reusable = _reusable(e, kinds[i], dying)
        for v in e.outvars:
            if not isinstance(v, Var) or v in out_set or v in arg_set:
                continue
            made = (v, i)
            if made_fuses and made not in written:
                continue
            b = size(v)
            taken = next((u for u in reusable if held[u] == b), None)
            if taken is not None:  # the operand's buffer, no longer freed at i
                reusable.remove(taken)
                frees[i].remove(taken)
                del held[taken]
            else:
                live += b
            held[made] = b
            frees.setdefault(last.get(made, i), []).append(made)  # after its last reader, or at once
        peak = max(peak, live)
        for u in frees.pop(i, ()):
            live -= held.pop(u)
    return fixed + peak


def _reusable(eqn: JaxprEqn, kind: Kind, dying: list[Value]) -> list[Value]:
    """The operands read for the last time by `eqn` whose buffers its result may take."""
    if eqn.primitive in IN_PLACE:
        return [u for u in dying if u[0] is eqn.invars[0]]
    return dying if kind is Kind.CHEAP else []
