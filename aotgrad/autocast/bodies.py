"""How autocast rewrites the bodies of calls, loops, branches and custom-derivative
functions (`STRUCTURAL`, keyed by primitive), and which values are built from literals alone
(`constant_vars`). Each rule gets the `Rewriter` (`autocast.rewrite`) that evaluates the body:
control flow keeps its carries and branch outputs in their declared dtypes; `custom_vjp`
functions keep their declared inputs, outputs and residuals, so a user's backward receives
exactly the types it was written for. A body's fresh inputs are wide where the values they
stand for are (`Rewriter.inherit`), and its results' wideness is carried out (`mark_wide`).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
import jax.extend.core.primitives as P
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Primitive, Var

from aotgrad._jax_internals import bind_eqn, eqn_context, scan_params, wrap_like
from aotgrad.autocast.context import Setting
from aotgrad.interpret import CALL_BODIES, body_of

if TYPE_CHECKING:
    from aotgrad.autocast.rewrite import Rewriter

__all__ = ["STRUCTURAL", "constant_flags", "constant_vars"]


def _aval(x: Any) -> Any:
    return jax.typeof(x)


_F32 = np.dtype(np.float32)
_HALF = frozenset(np.dtype(d) for d in (jax.numpy.float16, jax.numpy.bfloat16))


def constant_flags(eqn: JaxprEqn, constant: set[Var]) -> list[bool]:
    """Which inputs of `eqn` are built from literals alone."""
    return [isinstance(v, Literal) or v in constant for v in eqn.invars]


# (rewriter, equation, input values, setting, which inputs are constant) -> output values
Rule = Callable[["Rewriter", JaxprEqn, list, "Setting | None", Sequence[bool]], list]


def _inline(param: str) -> Rule:
    """Calls (`jit`, `closed_call`): the body is evaluated in place, under the call's scopes."""
    def rule(rw: Rewriter, eqn: JaxprEqn, invals: list, setting: Setting | None,
             constant: Sequence[bool]) -> list:
        with eqn_context(eqn):
            return rw.eval_jaxpr(*body_of(eqn, param), invals, setting, constant)
    return rule


def _remat(rw: Rewriter, eqn: JaxprEqn, invals: list, setting: Setting | None,
           constant: Sequence[bool]) -> list:
    p = eqn.params
    wide: list[bool] = []

    def body(*xs: Any) -> list:
        rw.inherit(xs, invals)
        outs = rw.eval_jaxpr(p["jaxpr"], (), xs, setting, constant)
        wide[:] = [rw.is_wide(o) for o in outs]
        return outs
    with eqn_context(eqn):
        outs = list(jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])(*invals))
    rw.mark_wide(outs, wide)
    return outs


def _scan(rw: Rewriter, eqn: JaxprEqn, invals: list, setting: Setting | None,
          constant: Sequence[bool]) -> list:
    p = scan_params(eqn)
    nc, ncar = p.n_consts, p.n_carry
    consts, init, xs = invals[:nc], invals[p.carries], invals[nc + ncar:]
    dtypes = [v.aval.dtype for v in eqn.invars[p.carries]]
    wide: list[bool] = []
    returned: list[Any] = []  # the carries' dtypes as the body returns them

    def step(carry: list, x: list) -> tuple[list, list]:
        rw.inherit([*carry, *x], [*init, *xs])  # (consts are the outer values themselves)
        outs = rw.eval_closed(p.body, [*consts, *carry, *x], setting)
        wide[:] = [rw.is_wide(o) for o in outs]
        returned[:] = [_aval(o).dtype for o in outs[:ncar]]
        return [rw.restore(c, d) for c, d in zip(outs[:ncar], dtypes, strict=True)], outs[ncar:]

    def scan(carry: list, xs: list) -> tuple[list, list]:
        return lax.scan(step, [rw.restore(c, d) for c, d in zip(carry, dtypes, strict=True)], xs,
                        length=p.length, reverse=p.reverse, unroll=p.unroll)

    if setting is not None and setting.promotion == "jax" and rw.follow:
        # A float32 carry that is not wide and that the body returns in 16 bits is carried
        # in 16 bits (a residual stream, a hidden state): cast up between iterations, it
        # would be saved for the backward in float32 at every step.
        counts = rw.counts.copy()
        jax.eval_shape(scan, init, xs)  # a trial trace: what the body returns
        rw.counts = counts
        dtypes = [r if d == _F32 and r in _HALF and not w and not rw.is_wide(x) else d
                  for d, r, w, x in zip(dtypes, returned, wide[:ncar], init, strict=True)]
    with eqn_context(eqn):
        carry, ys = scan(init, xs)
    rw.mark_wide([*carry, *ys], wide)
    return [*carry, *ys]


def _while(rw: Rewriter, eqn: JaxprEqn, invals: list, setting: Setting | None,
           constant: Sequence[bool]) -> list:
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
    dtypes = [v.aval.dtype for v in eqn.invars[cn + bn:]]

    def cond(carry: list) -> Any:
        return rw.eval_closed(p["cond_jaxpr"], [*cconsts, *carry], setting)[0]

    wide: list[bool] = []

    def body(carry: list) -> list:
        rw.inherit(carry, init)
        outs = rw.eval_closed(p["body_jaxpr"], [*bconsts, *carry], setting)
        wide[:] = [rw.is_wide(o) for o in outs]
        return [rw.restore(c, d) for c, d in zip(outs, dtypes, strict=True)]

    with eqn_context(eqn):
        outs = list(lax.while_loop(cond, body, [rw.restore(c, d) for c, d in zip(init, dtypes, strict=True)]))
    rw.mark_wide(outs, wide)
    return outs


def _cond(rw: Rewriter, eqn: JaxprEqn, invals: list, setting: Setting | None,
          constant: Sequence[bool]) -> list:
    index, ops = invals[0], invals[1:]
    dtypes = [v.aval.dtype for v in eqn.outvars]

    wide = [False] * len(dtypes)

    def branch(closed: ClosedJaxpr, *xs: Any) -> list:
        rw.inherit(xs, ops)
        outs = rw.eval_closed(closed, xs, setting)
        wide[:] = [w or rw.is_wide(o) for w, o in zip(wide, outs, strict=True)]  # wide in any branch
        return [rw.restore(o, d) for o, d in zip(outs, dtypes, strict=True)]

    with eqn_context(eqn):
        outs = list(lax.switch(index, [functools.partial(branch, b) for b in eqn.params["branches"]], *ops))
    rw.mark_wide(outs, wide)
    return outs


def _custom_jvp(rw: Rewriter, eqn: JaxprEqn, invals: list, setting: Setting | None,
                constant: Sequence[bool]) -> list:
    """The function and its JVP rule are both rewritten (under differentiation JAX runs the
    rule, not the function), re-traced at the inputs' new types."""
    p = eqn.params
    in_avals = [_aval(x).strip_weak_type() for x in invals]
    wide: list[bool] = []

    def function(*xs: Any) -> list:
        rw.inherit(xs, invals)
        outs = rw.eval_closed(p["call_jaxpr"], xs, setting)
        wide[:] = [rw.is_wide(o) for o in outs]
        return outs
    call = jax.make_jaxpr(function)(*in_avals)
    out_dtypes = [a.dtype for a in call.out_avals]
    primal_avals = in_avals[p["num_consts"]:]
    old_jvp = p["jvp_jaxpr_fun"]

    def jvp_jaxpr_fun(*zeros: bool) -> tuple[Any, Any, Any]:
        jaxpr, consts, out_zeros = old_jvp.call_wrapped(*zeros)
        tangent_avals = [a.to_tangent_aval() for a, z in zip(primal_avals, zeros, strict=True) if not z]
        tangent_dtypes = [d for d, z in zip(out_dtypes, out_zeros, strict=True) if not z]

        def run(*args: Any) -> list:
            outs = rw.eval_jaxpr(jaxpr, consts, args, setting)
            primals, tangents = outs[:len(out_dtypes)], outs[len(out_dtypes):]
            return ([rw.restore(o, d) for o, d in zip(primals, out_dtypes, strict=True)]
                    + [rw.restore(t, d) for t, d in zip(tangents, tangent_dtypes, strict=True)])

        new = jax.make_jaxpr(run)(*primal_avals, *tangent_avals)
        return new.jaxpr, new.consts, out_zeros

    params = {**p, "call_jaxpr": call, "jvp_jaxpr_fun": wrap_like(jvp_jaxpr_fun, old_jvp)}
    outs = bind_eqn(eqn.replace(params=params), invals)
    rw.mark_wide(outs, wide)
    return outs


def _custom_vjp(rw: Rewriter, eqn: JaxprEqn, invals: list, setting: Setting | None,
                constant: Sequence[bool]) -> list:
    """The function and its forward rule are rewritten inside declared boundaries (inputs,
    outputs, residuals); the user's backward is traced later, as part of the backward."""
    p = eqn.params
    invals = [rw.restore(x, v.aval.dtype) for x, v in zip(invals, eqn.invars, strict=True)]

    def bounded(jaxpr: Jaxpr, consts: Sequence[Any]) -> ClosedJaxpr:
        dtypes = [v.aval.dtype for v in jaxpr.outvars]

        def run(*xs: Any) -> list:
            return [rw.restore(o, d) for o, d in zip(rw.eval_jaxpr(jaxpr, consts, xs, setting), dtypes, strict=True)]
        return jax.make_jaxpr(run)(*[v.aval for v in jaxpr.invars])

    old_fwd = p["fwd_jaxpr_thunk"]

    def fwd_jaxpr_thunk(*nonzeros: bool) -> tuple[Any, Any]:
        new = bounded(*old_fwd.call_wrapped(*nonzeros))
        return new.jaxpr, new.consts

    params = {**p, "call_jaxpr": bounded(p["call_jaxpr"].jaxpr, p["call_jaxpr"].consts),
              "fwd_jaxpr_thunk": wrap_like(fwd_jaxpr_thunk, old_fwd)}
    return bind_eqn(eqn.replace(params=params), invals)


# Calls whose body is evaluated in place: their outputs are constant as the body's are, so
# a helper's values promote the same whether or not it is wrapped in `jax.jit`.
_IN_PLACE = {**CALL_BODIES, P.remat_p: "jaxpr"}


def constant_vars(jaxpr: Jaxpr, constant_args: Sequence[bool] = ()) -> set[Var]:
    """The values of `jaxpr` built from literals alone (`jnp.where(p, x, 0.0)`'s zeros), given
    which arguments are. They follow the other operands in promotion, like the weakly typed
    scalars they came from. Computed from the jaxpr alone, before any rewriting."""
    constant = {v for v, c in zip(jaxpr.invars, constant_args) if c}
    for eqn in jaxpr.eqns:
        if eqn.effects:
            continue
        flags = constant_flags(eqn, constant)
        if eqn.primitive in _IN_PLACE:
            body, _ = body_of(eqn, _IN_PLACE[eqn.primitive])
            inner = constant_vars(body, flags)
            outs = [isinstance(o, Literal) or o in inner for o in body.outvars]
        else:
            outs = [all(flags)] * len(eqn.outvars)
        constant.update(v for v, c in zip(eqn.outvars, outs, strict=True) if c and isinstance(v, Var))
    return constant


STRUCTURAL: dict[Primitive, Rule] = {
    **{prim: _inline(param) for prim, param in CALL_BODIES.items()},
    P.remat_p: _remat, P.scan_p: _scan, P.while_p: _while, P.cond_p: _cond,
    P.custom_jvp_call_p: _custom_jvp, P.custom_vjp_call_p: _custom_vjp,
}
