"""Evaluating jaxpr equations by re-binding them, the way new programs are built.

aotgrad never assembles `Jaxpr` objects by hand: it selects equations and re-traces
them (`jax.make_jaxpr` / `jax.jit`), so every type stays exact across JAX versions. One
evaluator serves every such re-trace: the inlined joint graph, the programs `split`
emits, the checked backward of anomaly mode, and the autocast rewrite.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax.extend.core.primitives as P
from jax.extend.core import Jaxpr, JaxprEqn, Literal, Primitive, Var

from aotgrad._jax_internals import bind_eqn, eqn_context, is_jaxpr, open_jaxpr

__all__ = ["CALL_BODIES", "INLINE_RULES", "Rule", "body_of", "eval_jaxpr", "inlining", "read", "sub_jaxprs"]

Rule = Callable[[JaxprEqn, list], list]  # (equation, input values) -> output values


def read(env: dict, atom: Any) -> Any:
    return atom.val if isinstance(atom, Literal) else env[atom]


def eval_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any],
               rules: Mapping[Primitive, Rule] | None = None,
               on_eqn: Callable[[JaxprEqn, list, list], None] | None = None, *,
               before_eqn: Callable[[int, dict], None] | None = None, bind: Rule = bind_eqn,
               invars: Sequence[Var] | None = None,
               eqns: Sequence[JaxprEqn] | None = None, outvars: Sequence[Any] | None = None) -> list[Any]:
    """Evaluates `jaxpr` on `args` by re-binding its equations; returns its outputs.

    Arguments:
        jaxpr, consts, args: the jaxpr, values of its constvars, values of its invars.
        rules: primitive -> `Rule` replacing `bind` for that primitive (e.g. inlining calls).
        on_eqn: called after each equation with (equation, input values, output values).
        before_eqn: called before the i-th equation with (i, the environment), which it
            may update (the backward's scheduling ties do).
        bind: how an equation with no rule is evaluated (default: re-bound as it is).
        invars, eqns, outvars: evaluate a selection instead (`args` are the values of
            `invars`; `eqns` in order; the values of `outvars` returned), as `split` does.
    """
    env: dict = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars if invars is None else invars, args, strict=True))
    rules = rules or {}
    for i, eqn in enumerate(jaxpr.eqns if eqns is None else eqns):
        if before_eqn is not None:
            before_eqn(i, env)
        invals = [read(env, v) for v in eqn.invars]
        outvals = rules.get(eqn.primitive, bind)(eqn, invals)
        for v, val in zip(eqn.outvars, outvals, strict=True):
            if isinstance(v, Var):  # DropVar results are discarded
                env[v] = val
        if on_eqn is not None:
            on_eqn(eqn, invals, outvals)
    return [read(env, v) for v in (jaxpr.outvars if outvars is None else outvars)]


def sub_jaxprs(eqn: Any, skip: frozenset[str] = frozenset()) -> list[Jaxpr]:
    """The jaxprs in an equation's parameters (bodies of calls, scan, cond branches, ...),
    found by type whatever the primitive; parameters named in `skip` are left out."""
    found: list[Jaxpr] = []
    for name, value in eqn.params.items():
        if name in skip:
            continue
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if is_jaxpr(item):
                found.append(open_jaxpr(item)[0])
    return found


# Calls whose body can be evaluated in place: the parameter holding the body.
CALL_BODIES: dict[Primitive, str] = {P.jit_p: "jaxpr", P.closed_call_p: "call_jaxpr", P.call_p: "call_jaxpr"}


def body_of(eqn: JaxprEqn, param: str) -> tuple[Jaxpr, Sequence[Any]]:
    """The body jaxpr held in `eqn.params[param]`, and its consts."""
    return open_jaxpr(eqn.params[param])


def inlining(extra: Mapping[Primitive, Rule]) -> dict[Primitive, Rule]:
    """Rules that evaluate calls' bodies in place, so the partitioner sees every primitive,
    with `extra` at every depth. The body's equations keep the call's name stack (autocast
    markers, sequence numbers)."""
    rules: dict[Primitive, Rule] = dict(extra)

    def inline(param: str) -> Rule:
        def rule(eqn: JaxprEqn, invals: list) -> list:
            with eqn_context(eqn):
                return eval_jaxpr(*body_of(eqn, param), invals, rules)
        return rule
    rules.update({prim: inline(param) for prim, param in CALL_BODIES.items()})
    return rules


INLINE_RULES: dict[Primitive, Rule] = inlining({})
