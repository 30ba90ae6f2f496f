"""Evaluating jaxpr equations by re-binding them, the way new programs are built.

aotgrad never assembles `Jaxpr` objects by hand: it selects equations and re-traces
them (`jax.make_jaxpr` / `jax.jit`), so every type stays exact across JAX versions.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var

from aotgrad._jax_internals import bind_eqn as bind

__all__ = ["Env", "INLINE_RULES", "eval_eqns", "eval_jaxpr", "read"]

Env = dict  # Var -> value


def read(env: Env, atom: Any) -> Any:
    return atom.val if isinstance(atom, Literal) else env[atom]


def eval_eqns(eqns: Iterable[JaxprEqn], env: Env,
              rules: dict[Any, Callable[[JaxprEqn, list], list]] | None = None) -> Env:
    """Evaluates `eqns` in order, reading and writing `env`. `rules` maps a primitive to a
    function `(eqn, invals) -> outvals` that replaces binding it (e.g. inlining calls)."""
    rules = rules or {}
    for eqn in eqns:
        invals = [read(env, v) for v in eqn.invars]
        rule = rules.get(eqn.primitive)
        outvals = rule(eqn, invals) if rule else bind(eqn, invals)
        for v, val in zip(eqn.outvars, outvals):
            if isinstance(v, Var):  # DropVar results are discarded
                env[v] = val
    return env


def eval_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any],
               rules: dict[Any, Callable[[JaxprEqn, list], list]] | None = None) -> list[Any]:
    env: Env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    eval_eqns(jaxpr.eqns, env, rules)
    return [read(env, v) for v in jaxpr.outvars]


# Calls whose bodies are evaluated in place, so the partitioner sees every primitive.
def _inline_closed(param: str) -> Callable[[JaxprEqn, list], list]:
    def rule(eqn: JaxprEqn, invals: list) -> list:
        body = eqn.params[param]
        if isinstance(body, ClosedJaxpr):
            return eval_jaxpr(body.jaxpr, body.consts, invals, INLINE_RULES)
        return eval_jaxpr(body, (), invals, INLINE_RULES)
    return rule


def _inline_rules() -> dict[Any, Callable[[JaxprEqn, list], list]]:
    import jax.extend.core.primitives as prims
    rules = {}
    for prim, param in ((prims.jit_p, "jaxpr"), (prims.closed_call_p, "call_jaxpr"),
                        (prims.call_p, "call_jaxpr")):
        rules[prim] = _inline_closed(param)
    return rules


INLINE_RULES = _inline_rules()
