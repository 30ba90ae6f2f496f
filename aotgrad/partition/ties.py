"""How a group of the backward's recomputation waits (`schedule.plan`'s groups).

How a group waits depends on the platform the program is lowered for (not the host's
default backend: a step compiled for a GPU or TPU target on a CPU machine gets the GPU/TPU
mechanism). Both are staged with `jax.lax.platform_dependent`, so lowering keeps only the
one for its platform (the compiler never sees a conditional):
- GPU and TPU keep `optimization_barrier` through scheduling (as `jax.checkpoint` relies
  on): the saved values the group reads pass through one barrier with the cotangent
  (values an earlier group recomputed do not: they wait already, and a barrier would make
  XLA write them to memory). The backward reads on from the barrier's copy of the
  cotangent, as `jax.checkpoint`'s backward does: XLA drops a barrier output nothing
  reads, and the wait with it.
- XLA:CPU removes barriers before it schedules, so there (with one device) the group's
  floating-point inputs become `x - z`, with `z` a zero computed from two elements of the
  cotangent by integer operations XLA cannot fold. `x - 0.0` is `x` exactly (signed zeros
  and NaNs included). `z` ends in a reduction, which XLA does not fuse into its readers,
  so they read one scalar rather than the cotangent. With several devices that zero would
  be read across shards (a collective per group), so multi-device CPU programs get
  barriers: correct, but without the lower peak.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import Var

from aotgrad._jax_internals import bind_eqn, varying_axes
from aotgrad.interpret import read
from aotgrad.partition.schedule import Group, floating

__all__ = ["tie", "tie_by_data"]


def tie(groups: Sequence[Group], by_data: bool) -> Callable[[int, dict], None]:
    """An `eval_jaxpr(before_eqn=...)` hook: at each group's first equation its inputs are
    replaced by tied copies; after its last they are put back, so only the group waits."""
    starts = {g.start: g for g in groups}
    restore: dict[int, dict[Var, Any]] = {}
    copies: dict[Var, Any] = {}  # the last barrier's copies of the saved values it took

    def before(i: int, env: dict) -> None:
        env.update(restore.pop(i, {}))
        group = starts.get(i)
        if group is None:
            return
        carried = set(group.weights)  # read from the barrier's copy from here on: not restored
        restore[group.stop] = {v: env[v] for v in group.inputs if v not in carried}
        if group.rides:
            env.update((v, copies[v]) for v, s in zip(group.inputs, group.saved, strict=True) if s)
            return
        extra = [v for v in group.weights if v not in group.inputs]
        names = (*group.inputs, *extra)
        values, after = [env[v] for v in names], env[group.after]
        finished = [env[v] for v in group.finished]
        saved = (*group.saved, *(True for _ in extra))
        if by_data:  # the data tie where the program is lowered for a CPU, else the barrier
            tied, after, finished = _tie_per_platform(values, after, finished, saved)
        else:
            tied, after, finished = _tie_by_barrier(values, after, finished, saved)
        env.update(zip(names, tied, strict=True))
        if any(group.saved):
            copies.clear()
            copies.update((v, x) for v, x, s in zip(names, tied, saved, strict=True) if s)
        # The backward reads on from the waited-for copies: a barrier output nothing reads is
        # dropped by XLA, and with it the wait (XLA:GPU then ran every layer's
        # recomputation at the backward's start).
        env[group.after] = after
        env.update(zip(group.finished, finished, strict=True))
        for eqn in group.chain:
            outs = bind_eqn(eqn, [read(env, v) for v in eqn.invars])
            env.update((v, x) for v, x in zip(eqn.outvars, outs, strict=True) if isinstance(v, Var))
    return before


# inline=True, not INLINE_WHEN_STAGED: where JAX keeps the call until lowering (0.11 and
# later) the step also lowers faster, to the same text (48 layers: 0.3 s rather than 0.55 s).
@functools.partial(jax.jit, static_argnums=3, inline=True)
def _tie_per_platform(values: list, after: Any, finished: list, saved: tuple[bool, ...]) -> tuple[list, Any, list]:
    """The data tie where the program is lowered for a CPU, else the barrier. Through an
    inlined `jax.jit`, each kind of group (a model's layers repeat them) traces its two
    ties once, not once per group: a deep model's backward has hundreds."""
    return jax.lax.platform_dependent(values, after, finished, cpu=_tie_by_data,
                                      default=functools.partial(_tie_by_barrier, saved=saved))


def _tie_by_barrier(values: list, after: Any, finished: list,
                    saved: Sequence[bool]) -> tuple[list, Any, list]:
    """Only saved values pass through the barrier: a value an earlier group recomputed
    waits already, and a barrier on it would make XLA write it to memory between two
    fusions (on a GPU, a GPT's step moved 1.28x the fused step's bytes, 1.13x without).
    `finished` (matmul results, in memory anyway) pass through too: the group waits for them."""
    saved = [s and _tieable(x, after) for x, s in zip(values, saved, strict=True)]
    if not any(saved) and (values or not finished):  # a loop's wait ties only `finished` (`_loop_waits`)
        return list(values), after, list(finished)
    held = [x for x, s in zip(values, saved, strict=True) if s]
    waited = [_tieable(x, after) for x in finished]
    *out, after = jax.lax.optimization_barrier([*held, *(x for x, w in zip(finished, waited) if w), after])
    held, tied = iter(out[:len(held)]), iter(out[len(held):])
    return ([next(held) if s else x for x, s in zip(values, saved, strict=True)], after,
            [next(tied) if w else x for x, w in zip(finished, waited, strict=True)])


def _tieable(x: Any, after: Any) -> bool:
    """Inside `shard_map`, only a value varying over the same manual axes as the cotangent
    waits for it: JAX's barrier (and arithmetic with the cotangent) would make a
    replicated value vary, and the forward's equations re-bound on it then fail (a
    weight's `pvary` on a weight already varying)."""
    return varying_axes(x) == varying_axes(after)


def _tie_by_data(values: list, after: Any, finished: list) -> tuple[list, Any, list]:
    zero = _zero_from(after)
    return [x - zero.astype(x.dtype) if floating(x) and _tieable(x, after) else x for x in values], after, \
        list(finished)


def tie_by_data() -> bool:
    """Whether programs built now may wait through data where they are lowered for a CPU
    (`tie` stages the choice per platform). With several devices the zero would be read
    across shards: every group would add collectives, so there barriers are used, and
    XLA:CPU ignores them."""
    return jax.device_count() == 1


def _zero_from(x: Any) -> Any:
    """0.0, computed from `x`'s data so that XLA cannot fold it: for any integer b,
    min(b, 0) & max(b, 0) is 0 (one of the two is 0)."""
    first = jax.lax.reshape(x, (x.size,))[:2]
    bits = jax.lax.bitcast_convert_type(first.astype(jnp.float32), jnp.int32)
    return jnp.max(jnp.minimum(bits, 0) & jnp.maximum(bits, 0)).astype(jnp.float32)
