"""The steps that build a program pair, in order: trace the forward (rewritten under the
autocast setting in force), trace the joint graph (scan bodies cut first), partition it,
and rewrite the backward under `config.backward_pass_autocast`. The passes below
(`partition`, `autocast`) know nothing of each other; this module runs them in turn."""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

from aotgrad.autocast.context import Setting, setting_inside, setting_of
from aotgrad.autocast.rewrite import CastCounts, has_markers, rewrite_backward, rewrite_closed
from aotgrad.collector import collector_paused
from aotgrad.config import BackwardAutocast, Snapshot
from aotgrad.devices import DeviceProfile, profile_of
from aotgrad.errors import BudgetUnreachable
from aotgrad.partition import JointGraph, Program, Split, partition, scan_rules, shards
from aotgrad.trace import ForwardTrace, input_layout, trace_body_joint, trace_joint
from aotgrad.trace import trace_forward as _trace

__all__ = ["Built", "autocast_backward", "build", "trace_forward"]


def trace_forward(flat_fn: Callable[..., Any], fn_name: str, avals: Sequence[Any],
                  autocast: Setting | None = None) -> ForwardTrace:
    """`trace.trace_forward`, rewritten under `autocast` (or under the autocast contexts
    inside the function), so the forward-only program and the joint graph both see the
    casts."""
    def rewrite(closed: Any) -> tuple[Any, tuple[tuple[str, int], ...]]:
        if autocast is not None or has_markers(closed.jaxpr):
            return rewrite_closed(closed, avals, autocast)
        return closed, ()
    return _trace(flat_fn, fn_name, avals, rewrite, autocast)


def autocast_backward(split: Split, fwd: ForwardTrace, mode: BackwardAutocast) -> tuple[Split, CastCounts]:
    """The split with its backward program rewritten under `config.backward_pass_autocast`
    (`mode`): "off" leaves it as traced (its dtypes follow the forward's casts);
    "same_as_forward" rewrites each cotangent-dependent equation under the setting its
    forward equation ran under (its autocast marker, else the forward's setting); nested
    contexts (a tuple of `AutocastArgs`) rewrite all of them under one setting.

    Only the backward program changes: the partitioner chose the saved set, so the forward
    program is the same in every mode, and forward values the backward recomputes are
    re-bound unchanged: the forward's own equations.
    """
    match mode:
        case "off":
            return split, CastCounts(fwd.casts)
        case "same_as_forward":
            # The backward's equations carry their forward equations' markers: a forward
            # without any has a backward without any (and it is not traced to ask).
            if fwd.autocast is None and not has_markers(fwd.jaxpr.jaxpr):
                return split, CastCounts(fwd.casts)
            choose = lambda eqn: setting_of(eqn, fwd.autocast)  # noqa: E731
        case tuple():
            fixed = setting_inside(mode)
            choose = lambda eqn: fixed  # noqa: E731
    backward, casts = rewrite_backward(split.backward, split.n_cotangents, choose)
    return dataclasses.replace(split, backward_program=Program.of(backward, "backward")), CastCounts(fwd.casts, casts)


def _scan_rules(strategy: str, budget: Any, device: DeviceProfile, fwd: ForwardTrace,
                perturbed: tuple[bool, ...]) -> dict | None:
    """The rules that cut scans at `budget`, their bodies priced for the step's device and
    weighed per device (`shards`: which of the forward's values are split over them)."""
    devices, inputs = input_layout(fwd.in_avals, perturbed)
    jaxpr = fwd.jaxpr.jaxpr
    splits = shards.of_eqns(jaxpr.eqns, [*jaxpr.constvars, *jaxpr.invars], inputs)
    return scan_rules(strategy, budget, functools.partial(trace_body_joint, device=device, devices=devices), splits)


def _other_scan_levels(unreachable: BudgetUnreachable, fwd: ForwardTrace, perturbed: tuple[bool, ...],
                       has_ct: tuple[bool, ...], strategy: str, budget: Any,
                       device: DeviceProfile, staged: bool) -> tuple[JointGraph, Split]:
    """A byte budget no plan met with the scans cut at that budget: the scans took their
    share before the rest of the step was planned. Each scan at its lowest, then at its
    highest level, may still fit; else the error names the smallest peak of all three."""
    smallest = unreachable.smallest
    for level in (0.0, 1.0):
        rules = _scan_rules(strategy, level, device, fwd, perturbed)
        if rules is None:
            break
        graph = trace_joint(fwd, perturbed, has_ct, rules, device, staged)
        try:
            return graph, partition(graph, strategy, budget)
        except BudgetUnreachable as e:
            smallest = min(smallest, e.smallest)
    raise BudgetUnreachable(unreachable.budget, smallest) from None


@dataclasses.dataclass(frozen=True)
class Built:
    """What `build` made for one program pair."""
    graph: JointGraph
    split: Split  # with the backward rewritten under backward_pass_autocast
    casts: CastCounts
    trace_s: float  # seconds tracing (the joint graph and the backward's rewrite)
    partition_s: float  # seconds partitioning
    autocast: Callable[[Split], Split]  # rewrites another split's backward the same way


def build(fwd: ForwardTrace, perturbed: tuple[bool, ...], has_ct: tuple[bool, ...],
          options: Snapshot, staged: bool = False) -> Built:
    """The joint graph of `fwd` for this choice of differentiated inputs and cotangents,
    partitioned by the options' strategy and budget, its backward autocast; `staged`: the
    forward and backward run as one program (traced under `jax.jit`), which the partitioner
    plans for. The cycle collector is held off meanwhile (`collector`)."""
    with collector_paused():
        return _build(fwd, perturbed, has_ct, options, staged)


def _build(fwd: ForwardTrace, perturbed: tuple[bool, ...], has_ct: tuple[bool, ...],
           options: Snapshot, staged: bool) -> Built:
    t0 = time.perf_counter()
    strategy, budget = options.partitioner, options.activation_memory_budget
    device = profile_of(fwd.in_avals)  # the arguments' devices: a compile-only target's too
    graph = trace_joint(fwd, perturbed, has_ct, _scan_rules(strategy, budget, device, fwd, perturbed), device, staged)
    t1 = time.perf_counter()
    try:
        sp = partition(graph, strategy, budget)
    except BudgetUnreachable as e:
        graph, sp = _other_scan_levels(e, fwd, perturbed, has_ct, strategy, budget, device, staged)
    t2 = time.perf_counter()
    mode = options.backward_pass_autocast
    sp, casts = autocast_backward(sp, fwd, mode)
    t3 = time.perf_counter()
    return Built(graph, sp, casts, t1 - t0 + t3 - t2, t2 - t1,
                 lambda variant: autocast_backward(variant, fwd, mode)[0])
