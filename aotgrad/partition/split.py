"""Splitting the joint graph into a forward and a backward program, given a saved set.

A strategy only decides *what to save*; this module builds the programs:
- forward:  inputs -> (outputs, saved activations)
- backward: (saved activations, saved inputs, cotangents) -> input cotangents
Anything the backward needs that is neither saved nor a cotangent is recomputed there,
from saved values, so a saved set must cut every path from the inputs to the backward.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
from jax.extend.core import ClosedJaxpr, Var, jaxpr_as_fun

from aotgrad.interpret import eval_jaxpr
from aotgrad.partition import fusion, schedule, ties
from aotgrad.partition.order import links, recompute_late  # recompute_late re-exported: the backward's order
from aotgrad.partition.graph import JointGraph, live_eqns
from aotgrad.partition.zeros import known_zero, zeros_like

__all__ = ["Program", "Split", "named", "recompute_late", "split", "without_cotangents"]


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """One program of a split as a function of its inputs, which re-binds the joint
    equations it selects; traced to a closed jaxpr (`closed`) only when first asked for.
    A step traced under `jax.jit` traces the function into the step once (the runtime
    jits `fn`), rather than once here and again from the jaxpr."""
    fn: Callable[..., list[Any]]
    in_avals: tuple[Any, ...]

    @functools.cached_property
    def closed(self) -> ClosedJaxpr:
        return jax.make_jaxpr(self.fn)(*self.in_avals)

    @classmethod
    def of(cls, closed: ClosedJaxpr, name: str) -> Program:
        """A program given as a closed jaxpr (a rewritten one)."""
        program = cls(named(jaxpr_as_fun(closed), name), tuple(closed.in_avals))
        program.__dict__["closed"] = closed  # already traced
        return program


def named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`fn` under `name`, which its program and XLA's op names are named after
    (`jit(backward)/...`)."""
    fn.__name__ = fn.__qualname__ = name
    return fn


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    forward_program: Program  # inputs -> outputs + saved activations
    backward_program: Program  # saved activations + saved inputs + cotangents -> grads
    activations: tuple[Var, ...]  # joint-graph values the forward saves, in order
    saved_inputs: tuple[int, ...]  # positions (among inputs) of inputs the backward reads
    reasons: tuple[str, ...]  # why each activation, then each saved input, was saved
    recomputed: tuple[tuple[str, int], ...]  # primitives recomputed in the backward, with counts
    producers: tuple[Any, ...]  # the joint equation that produced each activation
    recompute_groups: int = 0  # groups of recomputed equations that wait for their cotangent

    @property
    def forward(self) -> ClosedJaxpr:
        """The forward program's jaxpr (traced when first asked for)."""
        return self.forward_program.closed

    @property
    def backward(self) -> ClosedJaxpr:
        """The backward program's jaxpr (traced when first asked for)."""
        return self.backward_program.closed

    @property
    def n_cotangents(self) -> int:
        """How many of the backward's inputs are cotangents (its last ones)."""
        return len(self.backward_program.in_avals) - len(self.activations) - len(self.saved_inputs)

    def saved(self, graph: JointGraph) -> dict[Var, str]:
        """The saved set this split was built from: each saved joint value, with its reason."""
        values = [*self.activations, *(graph.inputs[i] for i in self.saved_inputs)]
        return dict(zip(values, self.reasons, strict=True))


def split(graph: JointGraph, saved: dict[Var, str], absent: Sequence[Var] = ()) -> Split:
    """Builds both programs. `saved` maps each saved joint value to the reason it is saved.
    `absent`: cotangents known to be zero (`zeros`): they are not inputs of the backward,
    which leaves out every equation that only they reach."""
    jaxpr = graph.closed.jaxpr
    consts = set(jaxpr.constvars)
    input_pos = {v: i for i, v in enumerate(graph.inputs)}
    bad = [v for v in saved if v in graph.backward]
    if bad:
        raise ValueError(f"partitioner error: cannot save cotangent-dependent values {bad}")
    saved_inputs = tuple(sorted(input_pos[v] for v in saved if v in input_pos))
    activations = tuple(v for v in _in_order(graph, saved) if v not in input_pos)

    # Backward: everything the gradients need, cut at saved values, cotangents and zeros.
    zero = known_zero(graph.eqns, absent) if absent else frozenset()
    bwd_available = set(saved) | set(graph.cotangents) | consts | zero
    bwd_idx, free = live_eqns(graph.eqns, graph.grads, bwd_available,
                              keep=lambda e: bool(e.effects) and graph.is_backward_eqn(e))
    if free:
        raise ValueError(f"partitioner error: the backward reads unsaved forward values {sorted(map(str, free))}")
    recomputed = collections.Counter(
        graph.eqns[i].primitive.name for i in bwd_idx if not graph.is_backward_eqn(graph.eqns[i]))

    # Forward: the outputs and the saved activations, from the inputs.
    fwd_idx, free = live_eqns(graph.eqns, list(graph.outputs) + list(activations),
                              set(graph.inputs) | consts,
                              keep=lambda e: bool(e.effects) and not graph.is_backward_eqn(e))
    assert not free and not any(graph.is_backward_eqn(graph.eqns[i]) for i in fwd_idx)

    fwd_in = list(graph.inputs)
    bwd_in = list(activations) + [graph.inputs[i] for i in saved_inputs] + [
        v for v in graph.cotangents if v not in zero]
    forward = _emit(graph, "forward", fwd_idx, fwd_in, list(graph.outputs) + list(activations))
    order = recompute_late(graph, bwd_idx)
    groups = schedule.plan([graph.eqns[i] for i in order], graph.backward - zero, graph.devices,
                           step_inputs=frozenset(graph.inputs), early=_early(graph, fwd_idx, order))
    backward = _emit(graph, "backward", order, bwd_in, list(graph.grads),
                     before_eqn=ties.tie(groups, ties.tie_by_data()),
                     zeros=_zeros_read(graph, order, zero))
    reasons = tuple(saved[v] for v in activations) + tuple(saved[graph.inputs[i]] for i in saved_inputs)
    producers = tuple(graph.eqns[graph.producer[v]] for v in activations)
    recomputing = sum(g.stop > g.start for g in groups)  # a loop's wait recomputes nothing
    return Split(forward, backward, activations, saved_inputs, reasons,
                 tuple(sorted(recomputed.items())), producers, recomputing)


def _early(graph: JointGraph, fwd_idx: Sequence[int], order: Sequence[int]) -> frozenset[Var]:
    """The backward's recomputed values that the forward holds in memory (`fusion.held`)
    where both are one program (a jitted step): `schedule.plan`'s `early`. Where they run
    as two programs, none: XLA cannot compute anything of the backward's with the forward."""
    backward = links(graph).is_backward
    recomputed = [i for i in order if not backward[i]]
    if not graph.staged or not recomputed:
        return frozenset()
    held = fusion.held(graph, fwd_idx)
    return frozenset(v for i in recomputed for v in graph.eqns[i].outvars if v in held)


def _zeros_read(graph: JointGraph, order: Sequence[int], zero: frozenset[Var]) -> list[Var]:
    """The known-zero values the backward's equations or its gradients read (given as zeros)."""
    if not zero:
        return []
    read = {v for i in order for v in graph.eqns[i].invars if isinstance(v, Var)}
    read.update(v for v in graph.grads if isinstance(v, Var))
    return [v for v in zero if v in read]


def without_cotangents(graph: JointGraph, sp: Split, present: Sequence[bool]) -> Split:
    """`sp` with a backward that takes only the cotangents marked present (the others are
    zero, e.g. auxiliary outputs'); the forward and the saved set are unchanged."""
    absent = [v for v, p in zip(graph.cotangents, present, strict=True) if not p]
    return split(graph, sp.saved(graph), absent)


def _in_order(graph: JointGraph, values: Sequence[Var]) -> list[Var]:
    """Values in the order they are produced (inputs first): a stable, readable order."""
    rank = {v: -len(graph.inputs) + i for i, v in enumerate(graph.inputs)}
    return sorted(values, key=lambda v: rank.get(v, graph.producer.get(v, 0)))


def _emit(graph: JointGraph, name: str, idx: list[int], invars: list[Var], outvars: list,
          before_eqn: Callable[[int, dict], None] | None = None, zeros: Sequence[Var] = ()) -> Program:
    """The program re-binding the selected joint equations; `zeros` are values known to
    be zero, given as zeros."""
    jaxpr = graph.closed.jaxpr
    eqns = [jaxpr.eqns[i] for i in idx]

    def program(*args: Any) -> list[Any]:
        filled = [*args, *(zeros_like(v.aval) for v in zeros)]
        return eval_jaxpr(jaxpr, graph.closed.consts, filled, invars=[*invars, *zeros], eqns=eqns,
                          outvars=outvars, before_eqn=before_eqn)

    return Program(named(program, name), tuple(v.aval for v in invars))
