"""When the backward runs its recomputation: no earlier than the cotangent that needs it.

The backward program recomputes forward values from saved ones. Those recomputations
depend only on the program's inputs, so XLA may run them all at the start of the
backward (XLA:CPU's default scheduler does: it starts independent work early). Every
recomputed value is then live at once and the backward's peak is the forward's again.
`tie` makes each group of recomputed equations wait for the cotangent that first needs
it, so layer n's forward is recomputed when the backward reaches layer n.

A group is every recomputed equation whose first (transitive) backward consumer is the
same equation C; it waits for the latest-computed backward value C reads (or the smaller
value that one is broadcast from: `_smallest_source`), unless all it does is reshape (a
view: the reshapes of a scan's stacked weights are free early, while a tie would copy the
weights). Groups come from the graph, not from annotations. The loss head's groups, which
wait for a value computed before the backward's first matmul, do not wait (`_head`).
With several devices, a group that waits through a barrier also waits for the weight
gradients computed since the last barrier that could hold large operands (`_finished`):
a weight gradient is needed only by the collective that sums it over the devices, and
XLA:GPU ran them all at the step's end, beside that collective, holding their operands
(recomputed activations, the logits' gradient, layers' cotangents) until then. (The wait
also makes each layer's collective run before the next layer's recomputation rather than
in one at the end.) Such a barrier also takes the weights (the step's inputs) that the
backward reads until the next one, and the backward reads them from its copy
(`_regathered`): with sharded parameters XLA otherwise reused the forward's gathered
weights in the backward, holding every layer's whole weights from the forward on; read
through a barrier, each is gathered again for its layer's backward, as under
`jax.checkpoint`. (8 H100s, a GPT with D=2048: 1.52 GB at budget 0.99 instead of 1.65, at
1.3% more bytes moved: the second gathers; with the parameters replicated, nothing
changes.) A loop in the backward (a scan's) waits for those weight gradients on one
device too (`_loop_waits`): run after it, one holds its operands through the whole loop.
Waiting cannot form a cycle: that value is computed before C by equations that do not
read C's group (C is its first consumer), and each weight gradient waited for comes
before the group in the backward's order. The group's members are contiguous in
`recompute_late`'s order, ending just before C.

How a group waits, by a barrier or through data, is `ties.py`'s.

Either way, a group whose saved inputs all passed through the last tie reads that tie's
copies and has none of its own (`Group.rides`): XLA fuses nothing across a barrier, and
one for each of a GELU's backward groups split it into two kernels, one writing what
the other read (an 8-layer stack saving its matmul outputs, as `dots_saveable` does:
104.9 GB moved against the policy's 100.9; 100.2 GB riding).

In a jitted step, the recomputation nothing waits for (the loss head's) is computed by
XLA once with the forward's, and so is whatever a later group recomputes from it
directly: XLA holds the forward's result until that group. So the head's recomputed
values that the forward holds in memory anyway (`early`: matmul outputs, values with
several readers) pass through a group's tie as saved values do, once the backward
has passed its first tie. The same stack recomputes its residual stream in the head
from the saved matmul outputs; read untied, each layer's normalized inputs were held
from the forward (9.19 GB against the policy's 8.76; 8.72 tied). Values the forward
fuses into their readers are not tied: a barrier would write them (tying all the
head's values raised budget 0's peak 6%). Nor are they before the first tie: what
runs there runs where the forward ends, beside the forward's values anyway (tying
there, budget 0 on that stack peaked 1.1% higher: the last layer's recomputation).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax.numpy as jnp
import jax.extend.core.primitives as P
from jax.extend.core import JaxprEqn, Var

from aotgrad.partition.costs import nbytes
from aotgrad.partition.graph import live_eqns
from aotgrad.partition.rules import MATMULS, Kind, kind_of

__all__ = ["Group", "VIEWS", "floating", "plan"]

# Equations XLA turns into views of their input (no copy): a group of only these is not tied.
VIEWS = frozenset({P.reshape_p, P.squeeze_p})
# What computes a weight gradient: a matmul (a weight's), a sum over the batch (a bias's or
# a scale's).
_CONTRACTIONS = MATMULS | {P.reduce_sum_p}
# A backward equation that loops over its body: it waits for the weight gradients before it.
_LOOPS = frozenset({P.scan_p, P.while_p})


@dataclasses.dataclass(frozen=True)
class Group:
    """Recomputed equations [start, stop) (positions in the backward's order) that wait
    for `after`, a backward value; `inputs` are the values they read from outside, `saved`
    says which of them pass through the tie as saved values do: the saved values, and the
    loss head's recomputation the forward holds (`plan`'s `early`); the others an earlier
    group recomputed after its wait."""
    start: int
    stop: int
    inputs: tuple[Var, ...]
    saved: tuple[bool, ...]
    after: Var
    # Backward equations from `after` to the value C reads, which `tie` evaluates again on
    # the waited-for copy of `after` (a broadcast of it, say).
    chain: tuple[JaxprEqn, ...] = ()
    # Weight gradients computed since the last barrier that could hold large operands:
    # with several devices the group waits for them too (`_finished`).
    finished: tuple[Var, ...] = ()
    # With several devices, the step's inputs (weights) that the backward reads from this
    # group to the next with a barrier: they pass through this one and are read from its
    # copy from here on (`_regathered`).
    weights: tuple[Var, ...] = ()
    # No barrier of its own: every saved value it reads passed through the last barrier,
    # and it reads them from that barrier's copies (`plan`).
    rides: bool = False


def plan(eqns: Sequence[JaxprEqn], backward: frozenset[Var], devices: int = 1,
         step_inputs: frozenset[Var] = frozenset(), early: frozenset[Var] = frozenset()) -> tuple[Group, ...]:
    """The groups of `eqns` (the backward's equations in order; `backward` holds the
    cotangent-dependent values) that have something to wait for. With several `devices`
    groups also wait for weight gradients (`_finished`; `step_inputs` are never freed).
    `early`: recomputed values the forward holds in memory in the same program, which a
    group after the backward's first barrier reads through its own as it does a saved
    value, unless a group recomputed them after a wait (see the module's docstring)."""
    position = {v: i for i, e in enumerate(eqns) for v in e.outvars if isinstance(v, Var)}
    is_bwd = [any(isinstance(v, Var) and v in backward for v in e.invars) for e in eqns]
    readers: list[list[int]] = [[] for _ in eqns]
    for i, e in enumerate(eqns):
        for v in e.invars:
            if isinstance(v, Var) and v in position:
                readers[position[v]].append(i)
    first: list[int | None] = [None] * len(eqns)  # the first backward equation needing eqn i
    for i in range(len(eqns) - 1, -1, -1):
        if not is_bwd[i]:
            reach = [r if is_bwd[r] else first[r] for r in readers[i]]
            first[i] = min((r for r in reach if r is not None), default=None)
    members: dict[int, list[int]] = {}
    for i, c in enumerate(first):
        if c is not None:
            members.setdefault(c, []).append(i)
    groups = []
    loops = [c for c, e in enumerate(eqns) if is_bwd[c] and e.primitive in _LOOPS]
    ends = _finished(eqns, is_bwd, readers, step_inputs, devices) if devices > 1 or loops else []
    head = _head(eqns, is_bwd)
    previous = 0
    tied: set[Var] = set()  # the saved values the last barrier took
    waited: set[int] = set()  # the members of the groups so far
    for c, group in sorted(members.items()):
        after = _latest_backward_input(eqns[c], position, backward)
        chain: list[JaxprEqn] = []
        if after is not None:
            after, chain = _smallest_source(after, eqns, position, backward)
        if after is None or position[after] >= min(group) or max(group) - min(group) + 1 != len(group):
            continue  # nothing to wait for (C reads only the program's cotangents), or not one run
        if position[after] < head:
            continue  # the loss head's: it runs first anyway (`_head`)
        if all(eqns[i].primitive in VIEWS for i in group):
            continue  # free to run early, while a tie would copy the viewed input
        inside = {v for i in group for v in eqns[i].outvars}
        inputs = tuple(dict.fromkeys(v for i in group for v in eqns[i].invars
                                     if isinstance(v, Var) and v not in inside))
        # Saved: not computed by the backward, or (once the backward has waited) held by the
        # forward and recomputed where nothing waited, which XLA computes once with the forward's.
        saved = tuple(v not in position or (bool(tied) and v in early and position[v] not in waited)
                      for v in inputs)
        finished = ()
        rides = any(saved) and {v for v, s in zip(inputs, saved) if s} <= tied
        if any(saved) and not rides:  # a barrier: with several devices it waits for the ends since the last one
            if devices > 1:
                finished = tuple(v for i in range(previous, min(group)) for v in ends[i])
                previous = min(group)
            tied = {v for v, s in zip(inputs, saved) if s}
        groups.append(Group(min(group), max(group) + 1, inputs, saved, after, tuple(chain), finished, rides=rides))
        waited.update(group)
    groups = _loop_waits(groups, loops, eqns, position, backward, ends) if loops else groups
    if devices > 1 and step_inputs:
        groups = _regathered(groups, eqns, is_bwd, step_inputs)
    return tuple(groups)


def _loop_waits(groups: list[Group], loops: list[int], eqns: Sequence[JaxprEqn], position: dict[Var, int],
                backward: frozenset[Var], ends: list[list[Var]]) -> list[Group]:
    """`groups` and, before each loop in the backward (a scan's), a barrier on its latest
    cotangent and the weight gradients (`_finished`) made since the last wait for them
    that the loop does not read (what it reads is made before it anyway, and would only
    be copied): XLA:GPU ran a tied embedding's weight gradient after a scanned GPT's
    layers' backward, holding the logits' gradient through it (B4 x 1024, vocabulary
    16000, one H100: budget 0 peaked 262 MB above `nothing_saveable`)."""
    out, previous = list(groups), 0
    for c in loops:
        previous = max([previous, *(g.start for g in out if g.finished and g.start < c)])
        made_for_loop, _ = live_eqns(list(eqns[:c]), eqns[c].invars, set())
        needed = {v for i in made_for_loop for v in eqns[i].outvars}
        finished = tuple(v for i in range(previous, c) for v in ends[i] if v not in needed)
        after = _latest_backward_input(eqns[c], position, backward)
        if finished and after is not None:
            out.append(Group(c, c, (), (), after, (), finished))
            previous = c
    return sorted(out, key=lambda g: g.start)


def _regathered(groups: list[Group], eqns: Sequence[JaxprEqn], is_bwd: list[bool],
                step_inputs: frozenset[Var]) -> list[Group]:
    """Each group with a barrier also takes the step's inputs that the backward reads
    until the next such group, and the backward reads them from its copy. With sharded
    parameters, XLA gathers a weight for the forward and, where the backward reads the
    same weight, reuses that gathered copy, holding every layer's whole weights from the
    forward to their layer's backward; a weight read through a barrier is gathered again
    where it is read, as under `jax.checkpoint` (whose barrier takes a layer's weights)."""
    barriers = [k for k, g in enumerate(groups) if any(g.saved) and not g.rides]
    out = list(groups)
    for n, k in enumerate(barriers):
        stop = groups[barriers[n + 1]].start if n + 1 < len(barriers) else len(eqns)
        weights = dict.fromkeys(v for i in range(groups[k].start, stop) if is_bwd[i] for v in eqns[i].invars
                                if isinstance(v, Var) and v in step_inputs and floating(v.aval))
        out[k] = dataclasses.replace(groups[k], weights=tuple(weights))
    return out


def _head(eqns: Sequence[JaxprEqn], is_bwd: list[bool]) -> int:
    """The position of the backward's first matmul or convolution (0 if it has none).
    A group that waits for a value computed before it recomputes the loss head, which
    the backward needs first: waiting gains nothing there, and a barrier would keep XLA
    from reusing the values the forward computed just before (the logits, their max and
    sum) and from writing the logits' gradient over them: GPT-2 small on an H100 held
    one logits-sized buffer more. A matmul, not any compute-bound equation: a
    cross-entropy's gradient is a scatter-add, part of the head."""
    return next((i for i, e in enumerate(eqns) if is_bwd[i] and e.primitive in MATMULS), 0)


def _finished(eqns: Sequence[JaxprEqn], is_bwd: list[bool], readers: list[list[int]],
              step_inputs: frozenset[Var], devices: int) -> list[list[Var]]:
    """Per equation, its outputs if it is a backward equation that may hold large
    operands if XLA runs it late: a matmul that is the last reader of a recomputed value
    (a weight gradient's, reading a recomputed activation), or a weight gradient (a
    matmul or a sum whose result reaches no later matmul: a weight's, a bias's or a
    scale's) whose operands outweigh its result on each device. A later group waits for
    them too: else XLA ran weight gradients late, next to the collective that sums them
    over the devices, and held their operands meanwhile (8 data-parallel H100s held every
    layer's recomputed attention probabilities; with sharded parameters, GPT-2 small's
    logits' gradient, 1.65 GB per device, until the tied embedding's gradient, and
    layers' cotangents until their bias gradients). A weight gradient is whole on every
    device until that collective, while the activations it reads are split over the
    devices: a wide layer's, from a few tokens per device, is the larger, and waiting
    would hold it instead. The step's inputs are never freed: they do not count."""
    ends: list[list[Var]] = [[] for _ in eqns]
    feeds_matmul = [False] * len(eqns)
    for i in range(len(eqns) - 1, -1, -1):
        feeds_matmul[i] = any(eqns[r].primitive in MATMULS or feeds_matmul[r] for r in readers[i])
    for i, e in enumerate(eqns):
        if not (is_bwd[i] and e.primitive in _CONTRACTIONS and not feeds_matmul[i]) or not _concrete(e):
            continue
        operands = sum(nbytes(v.aval) for v in e.invars if isinstance(v, Var) and v not in step_inputs)
        if operands > devices * sum(nbytes(v.aval) for v in e.outvars):
            ends[i] = _floating_outputs(e)
    for i in range(len(eqns)):
        if is_bwd[i] or not readers[i]:
            continue
        last = max(readers[i])
        # A matmul, not any compute-bound equation: a cross-entropy's gradient (a
        # scatter-add) reads the recomputed labels last, and held through the next barrier
        # it stayed beside the logits (a scanned GPT-2 small on 8 H100s: 4% higher peak).
        if is_bwd[last] and eqns[last].primitive in MATMULS:
            ends[last] = _floating_outputs(eqns[last])
    return ends


def _concrete(eqn: JaxprEqn) -> bool:
    """Whether every array `eqn` reads and makes has a known size (not an exported
    step's symbolic batch, whose sizes cannot be compared)."""
    return all(isinstance(d, int) for v in (*eqn.invars, *eqn.outvars) for d in getattr(v.aval, "shape", ()))


def _floating_outputs(eqn: JaxprEqn) -> list[Var]:
    return [v for v in eqn.outvars if isinstance(v, Var) and floating(v.aval)]


def _latest_backward_input(eqn: JaxprEqn, position: dict[Var, int],
                           backward: frozenset[Var]) -> Var | None:
    """The backward value `eqn` reads that is computed last, among those a zero can be
    read from (real floating point, not empty)."""
    made = [v for v in eqn.invars if isinstance(v, Var) and v in backward and v in position
            and floating(v.aval) and v.aval.size > 0]
    return max(made, key=position.__getitem__) if made else None


def _smallest_source(v: Var, eqns: Sequence[JaxprEqn], position: dict[Var, int],
                     backward: frozenset[Var]) -> tuple[Var, list[JaxprEqn]]:
    """What a group waits for instead of `v`: the smaller backward value `v` is computed
    from by elementwise equations and broadcasts (which XLA fuses into their reader), as
    far up as each step is smaller. A barrier's operand is written to memory: waiting for
    a cross-entropy's cotangent broadcast to the logits' shape wrote one logits-sized
    buffer more at the step's peak (GPT-2 small on an H100: 6.65 GB instead of 5.00).
    Returns it and the equations from it to `v`, in order."""
    chain: list[JaxprEqn] = []
    while kind_of(eqns[position[v]]) is Kind.CHEAP:
        up = _latest_backward_input(eqns[position[v]], position, backward)
        if up is None or up.aval.size >= v.aval.size:
            break
        chain.insert(0, eqns[position[v]])
        v = up
    return v, chain


def floating(aval: Any) -> bool:
    """A real floating-point array (not a token, not an integer or complex array)."""
    dtype = getattr(aval, "dtype", None)  # None for tokens and other non-array values
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)
