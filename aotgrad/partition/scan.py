"""Partitioning inside `lax.scan` bodies: the body's own joint graph gets the same cut.

A scan is one opaque equation to the graph-level cut, so by default its residuals are
whatever `jax.vjp` of the scan keeps per iteration. Before the joint graph is traced,
each scan body is cut on its own: every value in the body is named
(`checkpoint_name`), the body's joint graph (body and its VJP) is traced and cut by the
same strategy and budget, and the body is wrapped in
`jax.checkpoint(policy=save_only_these_names(<the cut>))`. JAX's scan autodiff then
stacks exactly those values (and the carries) as the scan's residuals and recomputes the
rest inside the backward scan's body. Both programs keep the scan as a scan. The
memory budget acts inside the body; the graph-level cut does not recompute a cut scan.

Below "save the cut every iteration", a budget checkpoints the carry every k-th
iteration (`scan_levels.scan_schedule`): the scan becomes a scan over segments of k
iterations, each segment a `jax.checkpoint` (saving nothing) of an inner scan of the cut
body, so the forward saves one carry per segment and the backward recomputes one segment
at a time with the body's cut (nested remat). A remainder of n mod k iterations is one
more, shorter segment.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.extend.core.primitives as P
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import ClosedJaxpr, JaxprEqn, Primitive, Var

from aotgrad._jax_internals import bind_eqn, name_scopes, scan_params
from aotgrad.interpret import Rule, eval_jaxpr, sub_jaxprs
from aotgrad.partition import costs, shards
from aotgrad.partition.budget_value import Budget
from aotgrad.partition.named_outputs import DERIVATIVES, bind_named
from aotgrad.partition.scan_levels import ScanSchedule, scan_schedule

__all__ = ["BodyCut", "BodyTrace", "is_cut_scan", "partition_scans", "segment_schedules", "uncut_scans"]

# (joint graph of a body, budget, stacked=True) -> {saved joint value: reason}
BodyCut = Callable[[Any, float, bool], dict[Var, str]]
# (body with named values, its input avals, each input's split over the devices) -> its
# joint graph (`trace.trace_body_joint`, passed in by the pipeline: tracing sits below the
# passes)
BodyTrace = Callable[[ClosedJaxpr, list, tuple], Any]

_PREFIX = "aotgrad_scan_value_"
# The name scope of a scan split into checkpointed segments (read back by `segment_schedules`).
_SCOPE = "aotgrad: "
SEGMENTS = _SCOPE + "carry saved every {every} of {length} iterations"
_SEGMENTS_AT = SEGMENTS[:SEGMENTS.index("{")]
# The name scope of a scan whose body is not cut (read back by `uncut_scans`).
UNCUT = _SCOPE + "body not cut ({why}): the budget does not act inside it"
_UNCUT_AT = UNCUT[:UNCUT.index("{")]


def partition_scans(cut: BodyCut, budget: Budget, trace_body: BodyTrace,
                    splits: dict[Var, shards.Split] | None = None) -> dict[Primitive, Rule]:
    """Evaluation rules (see `interpret.eval_jaxpr`) that re-bind every scan with its
    body cut by `cut` at `budget`; nested scans are cut the same way. `trace_body` traces
    a body's joint graph; `splits`: the values of the evaluated program split over the
    devices (`shards.of_eqns`), so a scan's levels are weighed in bytes per device (a
    batch-split carry against whole weights) as XLA's peak and a byte budget are."""
    rules: dict[Primitive, Rule] = {}
    splits = {} if splits is None else splits

    def scan_rule(eqn: JaxprEqn, invals: list) -> list:
        p = scan_params(eqn)
        body: ClosedJaxpr = p.body
        why = "it has effects" if body.jaxpr.effects else \
            "it calls a custom_vjp that sees its differentiated inputs" if _sees_perturbed(body.jaxpr) else None
        if why is not None:  # left to jax.vjp's residuals, and the report says so
            with jax.named_scope(UNCUT.format(why=why)):
                return bind_eqn(eqn, invals)
        nc, ncar = p.n_consts, p.n_carry
        ins = [splits.get(v) if isinstance(v, Var) else None for v in eqn.invars]
        body_splits = (*ins[:nc + ncar], *map(shards.sliced, ins[nc + ncar:]))
        if any(body_splits):  # a nested scan finds its operands' splits
            splits.update(shards.of_eqns(body.jaxpr.eqns, body.jaxpr.invars, body_splits))
        names, schedule = _cut_names(body, cut, budget, rules, p.length, carries=p.carries,
                                    trace_body=trace_body, splits=body_splits)

        policy = jax.checkpoint_policies.save_only_these_names(*names)
        step = jax.checkpoint(lambda *xs: _eval_named(body, xs, rules, derive_from_names=True), policy=policy)
        consts = invals[:nc]

        def scan_body(carry: list, x: list) -> tuple[list, list]:
            outs = step(*consts, *carry, *x)
            return outs[:ncar], outs[ncar:]

        options = p.scan_options
        init, xs = list(invals[nc:nc + ncar]), list(invals[nc + ncar:])
        if schedule.every == 1:
            carry, ys = jax.lax.scan(scan_body, init, xs, length=p.length, **options)
        else:
            with jax.named_scope(SEGMENTS.format(every=schedule.every, length=p.length)):
                carry, ys = _segmented(scan_body, init, xs, p.length, schedule.every, options)
        return [*carry, *ys]

    rules[P.scan_p] = scan_rule
    return rules


def _segmented(body: Callable, init: list, xs: list, length: int, every: int, options: dict) -> tuple[list, list]:
    """`lax.scan(body, init, xs, length)` as scans over segments of `every` iterations:
    each segment is checkpointed (only its incoming carry is saved) and recomputed in
    the backward. The last n mod k iterations form one shorter segment."""
    full = length - length % every
    parts = [(0, full, every), (full, length, length - full)]  # (start, stop, segment length)
    parts = [part for part in parts if part[1] > part[0]]
    if options["reverse"]:  # a reversed scan runs the last iterations first
        parts.reverse()
    carry, ys_parts = init, {}
    for start, stop, size in parts:
        count = (stop - start) // size

        @jax.checkpoint
        def segment(carry: list, x: list, size: int = size) -> tuple[list, list]:
            return jax.lax.scan(body, carry, x, length=size, **options)

        x = [a[start:stop].reshape(count, size, *a.shape[1:]) for a in xs]
        carry, ys = jax.lax.scan(segment, carry, x, length=count, reverse=options["reverse"])
        ys_parts[start] = [a.reshape(count * size, *a.shape[2:]) for a in ys]
    ordered = [ys_parts[start] for start in sorted(ys_parts)]
    return carry, [jax.numpy.concatenate(arrays) if len(arrays) > 1 else arrays[0]
                   for arrays in zip(*ordered, strict=True)]


def _eval_named(body: ClosedJaxpr, args: Any, rules: dict, derive_from_names: bool = False) -> list:
    """Evaluates `body`, naming each array its equations produce `<prefix><k>` (k: the
    value's position in the body), so a policy can save exactly the chosen ones.
    `derive_from_names`: an operation whose derivative reads its result reads the named
    one (`named_outputs`), so saving that name spares running it again (for JAX's
    differentiation; the graph the cut is made on keeps the plain operations)."""
    jaxpr = body.jaxpr
    position = {v: k for k, v in enumerate(v for e in jaxpr.eqns for v in e.outvars)}

    def named(evaluate: Rule) -> Rule:
        def rule(eqn: JaxprEqn, invals: list) -> list:
            if derive_from_names and eqn.primitive in DERIVATIVES and _nameable(eqn, eqn.outvars[0]):
                return [bind_named(eqn, invals[0], f"{_PREFIX}{position[eqn.outvars[0]]}")]
            return [checkpoint_name(val, f"{_PREFIX}{position[v]}") if _nameable(eqn, v) else val
                    for v, val in zip(eqn.outvars, evaluate(eqn, invals), strict=True)]
        return rule

    return eval_jaxpr(jaxpr, body.consts, args, {p: named(r) for p, r in rules.items()}, bind=named(bind_eqn))


def _nameable(eqn: JaxprEqn, v: Any) -> bool:
    """Numeric arrays only (PRNG keys and float0 are recomputed or carried, never named)."""
    dtype = getattr(getattr(v, "aval", None), "dtype", None)
    return (isinstance(v, Var) and not eqn.effects and eqn.primitive is not P.name_p and dtype is not None
            and (jax.numpy.issubdtype(dtype, np.number) or jax.numpy.issubdtype(dtype, np.bool_)))


def _cut_names(body: ClosedJaxpr, cut: BodyCut, budget: Budget, rules: dict, length: int,
               carries: slice, trace_body: BodyTrace,
               splits: tuple[shards.Split | None, ...]) -> tuple[tuple[str, ...], ScanSchedule]:
    """The scan's schedule at `budget`, and the names of the body values its cut saves
    per iteration. `carries`: the positions of the carries among the body's inputs;
    `splits`: each input's split over the devices. Bytes are per device
    (`shards.per_device_bytes`)."""
    avals = [v.aval for v in body.jaxpr.invars]
    named = jax.make_jaxpr(lambda *xs: _eval_named(body, xs, rules))(*avals)
    graph = trace_body(named, avals, splits)
    inputs = set(graph.inputs)
    size = shards.per_device_bytes(graph)

    def nbytes(v: Any) -> int:  # an output may be a literal
        return size(v) if isinstance(v, Var) else costs.nbytes(v.aval)

    carry = sum(map(nbytes, graph.inputs[carries]))
    sliced = sum(map(nbytes, (*graph.inputs[carries.stop:], *graph.outputs[carries.stop - carries.start:])))

    def per_iteration(saved: dict) -> int:
        return carry + sum(size(v) for v in saved if v not in inputs)

    ends = {b: cut(graph, b, True) for b in (0.0, 1.0)}
    schedule = scan_schedule(length, carry, (per_iteration(ends[0.0]), per_iteration(ends[1.0])), sliced,
                             budget)
    saved = ends[schedule.body_budget] if schedule.body_budget in ends else cut(graph, schedule.body_budget, True)
    name_of: dict[Var, str] = {}
    for eqn in graph.eqns:
        if eqn.primitive is P.name_p and eqn.params["name"].startswith(_PREFIX):
            for v in (*eqn.invars, *eqn.outvars):
                if isinstance(v, Var):
                    name_of[v] = eqn.params["name"]
    return tuple(sorted(_names_of(saved, name_of, graph))), schedule


def _names_of(saved: Any, name_of: dict[Var, str], graph: Any) -> set[str]:
    """The names a policy saves for the cut's `saved` values. A value the body's
    differentiation computes in its forward (jax 0.11 and later differentiate `tanh` by
    `one_minus_square` of its result) has no name: its nearest named ancestors are saved
    instead, and the step computes it again from them (else nothing would be saved, and
    JAX would run the whole body again: an RNN cell's matmuls too)."""
    producer = {v: e for e in graph.eqns for v in e.outvars}
    names: set[str] = set()
    todo, seen = [v for v in saved if isinstance(v, Var)], set()
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in name_of:
            names.add(name_of[v])
        elif v in producer:
            todo += [u for u in producer[v].invars if isinstance(u, Var)]
    return names


def segment_schedules(jaxpr: Any) -> tuple[str, ...]:
    """The segment schedules (`SEGMENTS` texts) of the scans in `jaxpr`, nested included,
    in program order."""
    return _scopes(jaxpr, _SEGMENTS_AT)


def uncut_scans(jaxpr: Any) -> tuple[str, ...]:
    """Why scans in `jaxpr` were left uncut (`UNCUT` texts), nested included, in program
    order."""
    return _scopes(jaxpr, _UNCUT_AT)


def _scopes(jaxpr: Any, prefix: str) -> tuple[str, ...]:
    found: dict[str, None] = {}

    def walk(j: Any) -> None:
        for eqn in j.eqns:
            found.update((s[len(_SCOPE):], None) for s in name_scopes(eqn) if s.startswith(prefix))
            for sub in sub_jaxprs(eqn):
                walk(sub)
    walk(jaxpr)
    return tuple(found)


def is_cut_scan(eqn: JaxprEqn) -> bool:
    """Whether `eqn` is a scan whose body was cut here (its residuals are the cut's). The
    graph-level cut never recomputes such a scan whole: the budget already acted inside
    its body, and a recomputed forward scan would cost a whole extra forward. A scan
    over checkpointed segments holds the cut body one level down."""
    return eqn.primitive is P.scan_p and any(map(_holds_names, sub_jaxprs(eqn)))


def _sees_perturbed(jaxpr: Any) -> bool:
    """Whether the body calls a `custom_vjp` whose forward sees which inputs are
    differentiated (`symbolic_zeros`: an aotgrad-compiled function is one), so its
    residuals may differ per pattern. Such a call, evaluated again from the body's jaxpr
    under `jax.checkpoint`, is differentiated by JAX with another pattern's residual
    structure and fails; the body is not cut (a body with effects is not either)."""
    return any((e.primitive is P.custom_vjp_call_p and e.params.get("symbolic_zeros"))
               or any(map(_sees_perturbed, sub_jaxprs(e))) for e in jaxpr.eqns)


def _holds_names(jaxpr: Any) -> bool:
    return any((e.primitive is P.name_p and e.params["name"].startswith(_PREFIX))
               or any(map(_holds_names, sub_jaxprs(e))) for e in jaxpr.eqns)
