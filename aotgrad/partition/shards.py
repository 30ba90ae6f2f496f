"""Which values of a step are split over its devices: their size on one device.

A sharded step's activations are split over the devices (each holds its share of the
batch), while a weight is whole on each device where it is used (gathered, with sharded
parameters) and so is its gradient until the collective that sums it. XLA's peak, and a
byte budget, are per device; the joint graph's shapes are global. So the peak estimate
(`peak.py`) counts each value at its size on one device, as found here.

The split of each step input (`JointGraph.input_splits`: the axis, and over how many
devices) is propagated forward through the graph, one rule per primitive: an axis is
followed through elementwise math, broadcasts, reshapes, transposes and matmuls (a batch
or free dimension), and lost where it is summed over (a weight gradient's contraction
over the batch: whole after its collective) or where a rule cannot follow it. Where no
rule applies, an output of a split operand's rank keeps its axis where that axis keeps its
size (one more leading axis: a loop's stacked outputs, the next one). Values a split one is
built from by elementwise math (a mask broadcast to its shape) are split as it is. Where
the mesh's axes are explicit, each value's type says its sharding, and that is used. A
value not found split counts whole: where unsure, the estimate errs high.
"""
from __future__ import annotations

import math
import weakref
from typing import Callable, Sequence

import jax
import jax.extend.core.primitives as P
from jax.extend.core import JaxprEqn, Var

from aotgrad.partition import costs
from aotgrad.partition.graph import JointGraph
from aotgrad.partition.rules import IN_PLACE, Kind, kind_of

__all__ = ["Split", "input_splits", "of_eqns", "per_device_bytes", "sliced", "splits"]

Split = tuple[int, int]  # (axis, over how many devices)
Rule = Callable[[JaxprEqn, list["Split | None"]], list["Split | None"]]


def _shape(v: object) -> tuple[int, ...]:
    return tuple(getattr(getattr(v, "aval", None), "shape", ()))


def _divides(s: Split, size: int) -> bool:
    return size >= s[1] and size % s[1] == 0


def _like_operand(eqn: JaxprEqn, ins: list[Split | None]) -> list[Split | None]:
    """The fallback: an output of a split operand's rank keeps its axis where that axis
    keeps its size (elementwise math, slices and concatenations along other axes); with
    one more leading axis (a loop's stacked outputs), the next one."""
    split = [(_shape(v), s) for v, s in zip(eqn.invars, ins) if s is not None]
    out: list[Split | None] = []
    for o in eqn.outvars:
        shape = _shape(o)
        found = next(((a, n) for sh, (a, n) in split if len(sh) == len(shape) and sh[a] == shape[a]), None)
        if found is None:
            found = next(((a + 1, n) for sh, (a, n) in split if sh == shape[1:]), None)
        out.append(found)
    return out


def _broadcast(eqn: JaxprEqn, ins: list[Split | None]) -> list[Split | None]:
    s = ins[0]
    return [None if s is None else (int(eqn.params["broadcast_dimensions"][s[0]]), s[1])]


def _transpose(eqn: JaxprEqn, ins: list[Split | None]) -> list[Split | None]:
    s = ins[0]
    return [None if s is None else (tuple(eqn.params["permutation"]).index(s[0]), s[1])]


def _dropping(param: str) -> Rule:
    """The rule of equations that drop the axes their `param` names (a reduction's
    `axes`, a squeeze's `dimensions`): the split axis dropped (summed or maxed over) is
    lost, whole; else it shifts left past the dropped ones."""
    def rule(eqn: JaxprEqn, ins: list[Split | None]) -> list[Split | None]:
        s, dropped = ins[0], tuple(eqn.params[param])
        if s is None or s[0] in dropped:
            return [None] * len(eqn.outvars)
        return [(s[0] - sum(d < s[0] for d in dropped), s[1])] * len(eqn.outvars)
    return rule


def _reshape(eqn: JaxprEqn, ins: list[Split | None]) -> list[Split | None]:
    """The split axis survives where the output has an axis starting at the same element
    stride from the front (the same product of the axes before it) whose size the split
    still divides: merging (B, S) -> (B*S) or splitting (B*S) -> (B, S) keeps it."""
    s = ins[0]
    if s is None:
        return [None]
    before = math.prod(_shape(eqn.invars[0])[:s[0]])
    out = _shape(eqn.outvars[0])
    for a in range(len(out)):
        if math.prod(out[:a]) == before and _divides(s, out[a]):
            return [(a, s[1])]
    return [None]


def _dot_general(eqn: JaxprEqn, ins: list[Split | None]) -> list[Split | None]:
    """A batch or free dimension's split carries to the output (the left operand's first);
    a contracting dimension's is summed over: a partial sum, whole after its collective."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs_rank, rhs_rank = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    lhs_free = [d for d in range(lhs_rank) if d not in lc and d not in lb]
    rhs_free = [d for d in range(rhs_rank) if d not in rc and d not in rb]
    for s, batch, free, offset in ((ins[0], lb, lhs_free, len(lb)),
                                   (ins[1], rb, rhs_free, len(lb) + len(lhs_free))):
        if s is None:
            continue
        if s[0] in batch:
            return [(tuple(batch).index(s[0]), s[1])]
        if s[0] in free:
            return [(offset + free.index(s[0]), s[1])]
    return [None]


def _constraint(eqn: JaxprEqn, ins: list[Split | None]) -> list[Split | None]:
    """A sharding the program names: its first sharded axis, over as many devices as the
    mesh axes it names."""
    found = _from_spec(eqn.params.get("sharding"))
    return [found] if found is not None else _like_operand(eqn, ins)


def _from_spec(sharding: object) -> Split | None:
    spec = getattr(sharding, "spec", None)
    shape = getattr(getattr(sharding, "mesh", None), "shape", None)
    if spec is None or not shape:
        return None
    for axis, names in enumerate(spec):
        if names is None:
            continue
        names = (names,) if isinstance(names, str) else tuple(names)
        ways = math.prod(shape.get(n, 1) for n in names)
        if ways > 1:
            return axis, ways
    return None


def _explicit(sharding: object) -> bool:
    """The mesh's axes are explicit: the sharding seen while tracing is the one it has."""
    types = getattr(getattr(sharding, "mesh", None), "axis_types", ()) or ()
    return any(t == jax.sharding.AxisType.Explicit for t in types)


_RULES: dict[object, Rule] = {
    P.broadcast_in_dim_p: _broadcast,
    P.transpose_p: _transpose,
    P.reshape_p: _reshape,
    P.squeeze_p: _dropping("dimensions"),
    P.dot_general_p: _dot_general,
    P.sharding_constraint_p: _constraint,
    **dict.fromkeys((P.reduce_sum_p, P.reduce_max_p, P.reduce_min_p, P.reduce_prod_p, P.argmax_p, P.argmin_p,
                     P.reduce_and_p, P.reduce_or_p), _dropping("axes")),
}


def splits(graph: JointGraph) -> dict[Var, Split]:
    """The values split over the devices: their axis and over how many devices (`of_eqns`
    from the graph's inputs)."""
    return of_eqns(graph.eqns, graph.inputs, graph.input_splits)


def of_eqns(eqns: Sequence[JaxprEqn], inputs: Sequence[Var], input_splits: Sequence[Split | None]) -> dict[Var, Split]:
    """The values of `eqns` split over the devices, from the splits of their `inputs`.
    Followed forward from the inputs, then back from each split elementwise result to its
    operands of the same shape that are not inputs (a mask or a scalar broadcast to a split
    value's shape, a scatter's zeros: XLA splits them as their reader is), then forward
    again from those."""
    found: dict[Var, Split] = {v: s for v, s in zip(inputs, input_splits) if s is not None}
    if not found:
        return found
    _forward(eqns, found)
    inputs = set(inputs)
    for eqn in reversed(eqns):
        s = next((found[v] for v in eqn.outvars if v in found), None)
        if s is None or (kind_of(eqn) is not Kind.CHEAP and eqn.primitive not in IN_PLACE):
            continue
        shape = _shape(eqn.outvars[0])
        for v in eqn.invars:
            if isinstance(v, Var) and v not in found and v not in inputs and _shape(v) == shape:
                found[v] = s
    _forward(eqns, found)
    return found


def _forward(eqns: Sequence[JaxprEqn], found: dict[Var, Split]) -> None:
    """One pass in program order: each equation's outputs by its rule (as typed where the
    mesh's axes are explicit); values already found keep their split."""
    for eqn in eqns:
        if any(_explicit(getattr(v.aval, "sharding", None)) for v in eqn.outvars):  # as typed
            found.update((v, s) for v in eqn.outvars if (s := _from_spec(v.aval.sharding)) is not None)
            continue
        ins = [found.get(v) if isinstance(v, Var) else None for v in eqn.invars]
        if all(s is None for s in ins) and eqn.primitive is not P.sharding_constraint_p:
            continue
        rule = _RULES.get(eqn.primitive, _like_operand)
        for v, s in zip(eqn.outvars, rule(eqn, ins)):
            shape = _shape(v)
            if s is not None and isinstance(v, Var) and v not in found and s[0] < len(shape) \
                    and _divides(s, shape[s[0]]):
                found[v] = s


_found: "weakref.WeakKeyDictionary[JointGraph, dict[Var, Split]]" = weakref.WeakKeyDictionary()


def per_device_bytes(graph: JointGraph) -> Callable[[Var], int]:
    """Each value's bytes on one device (global bytes where the step is on one)."""
    if graph.devices <= 1:
        return lambda v: costs.nbytes(v.aval)
    split = _found.get(graph)
    if split is None:
        split = _found[graph] = splits(graph)

    def size(v: Var) -> int:
        s = split.get(v)
        return costs.nbytes(v.aval) // (s[1] if s else 1)
    return size


def sliced(s: Split | None) -> Split | None:
    """The split of one slice of a loop's stacked operand along its leading axis (a
    split of the leading axis itself: the slices are whole)."""
    return None if s is None or s[0] == 0 else (s[0] - 1, s[1])


def input_splits(leaves: Sequence[object], differentiated: Sequence[bool],
                 devices: int) -> tuple[Split | None, ...]:
    """Per step input, the axis split over the devices: the first its sharding names
    (visible while tracing where the mesh's axes are explicit); where none is visible
    (automatic axes: XLA decides the layout later), the leading axis of an input that is
    not differentiated (the batch), over the mesh's first axis (all the devices on a mesh
    of one axis; on a larger mesh the batch's axis is by custom the first, and guessing
    fewer devices errs high), when that divides it; else None (whole)."""
    if devices <= 1:
        return tuple(None for _ in leaves)
    out: list[Split | None] = []
    for x, diff in zip(leaves, differentiated, strict=True):
        shape = tuple(getattr(x, "shape", ()))
        sharding = getattr(x, "sharding", None)
        found = _from_spec(sharding)
        axes = getattr(getattr(sharding, "mesh", None), "shape", None)
        ways = next(iter(axes.values())) if axes else devices
        if found is None and not diff and not _explicit(sharding) and shape and ways > 1 \
                and _divides((0, ways), shape[0]):
            found = (0, ways)
        out.append(found)
    return tuple(out)
