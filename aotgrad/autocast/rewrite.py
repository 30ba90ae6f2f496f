"""How a jaxpr is rewritten under autocast: an interpreter that re-binds every equation
(so every dtype stays exact), casting inputs as the device's policy table says.

Per-primitive behaviour lives in two tables: `policy.TABLES` (which casts an op gets)
and `STRUCTURAL` here (how bodies of calls, loops, branches and custom-derivative
functions are rewritten). Everything else is bound as it is, after promoting floating
inputs that now disagree. Control flow keeps its carries and branch outputs in their
declared dtypes; `custom_vjp` functions keep their declared inputs, outputs and
residuals, so a user's backward receives exactly the types it was written for.
"""
from __future__ import annotations

import collections
import functools
from typing import Any, Callable, Sequence

import jax
import jax.extend.core.primitives as P
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Primitive, Var

from aotgrad._jax_internals import bind_eqn, eqn_context, name_scopes, scan_params, wrap_like
from aotgrad.autocast.context import MARKERS, Setting, setting_of
from aotgrad.autocast.counts import CastCounts as CastCounts
from aotgrad.autocast.policy import ACCUMULATE_FP32, ACCUMULATING, FP32, LOWER, POLICIES, PROMOTE, policy_for
from aotgrad.interpret import CALL_BODIES, body_of, eval_jaxpr, sub_jaxprs

__all__ = ["RESTORE", "CastCounts", "Rewriter", "has_markers", "rewrite_backward"]

RESTORE = "restore"  # a cast back to a declared dtype: loop carries, branch outputs, gradients
_ELIGIBLE = frozenset(np.dtype(d) for d in (jax.numpy.float16, jax.numpy.bfloat16, jax.numpy.float32))
_F32 = np.dtype(np.float32)
_HALF = frozenset(np.dtype(d) for d in (jax.numpy.float16, jax.numpy.bfloat16))
_MATMULS = (P.dot_general_p, P.conv_general_dilated_p)
_NO_PROMOTE = frozenset({P.sort_p})  # operands of different dtypes are legal and independent


def ordered(counts: collections.Counter) -> tuple[tuple[str, int], ...]:
    order = POLICIES + (ACCUMULATE_FP32, RESTORE)
    return tuple((p, counts[p]) for p in order if counts[p])


def _aval(x: Any) -> Any:
    return jax.typeof(x)


class Rewriter:
    """Evaluates jaxprs under autocast settings, counting the casts it inserts."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()

    # ---------------------------------------------------------------- casting

    def cast(self, x: Any, dtype: Any, why: str) -> Any:
        dtype = np.dtype(dtype)
        if _aval(x).dtype == dtype:
            return x
        self.counts[why] += 1
        return lax.convert_element_type(x, dtype)

    def restore(self, x: Any, dtype: Any) -> Any:
        return self.cast(x, dtype, RESTORE)

    # ---------------------------------------------------------------- evaluation

    def eval_jaxpr(self, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any],
                   default: Setting | None, constant_args: Sequence[bool] = ()) -> list[Any]:
        """Evaluates `jaxpr`; each equation runs under the setting its name stack records,
        else `default`. `constant_args`: which arguments are built from literals alone."""
        constant = constant_vars(jaxpr, constant_args)

        def bind(eqn: JaxprEqn, invals: list) -> list:
            return self.eqn(eqn, invals, setting_of(eqn, default), _flags(eqn, constant))
        return eval_jaxpr(jaxpr, consts, args, bind=bind)

    def eval_closed(self, closed: ClosedJaxpr, args: Sequence[Any], default: Setting | None) -> list[Any]:
        return self.eval_jaxpr(closed.jaxpr, closed.consts, args, default)

    def eqn(self, eqn: JaxprEqn, invals: list[Any], setting: Setting | None,
            constant: Sequence[bool]) -> list[Any]:
        """One equation under `setting`; `constant[i]`: input i is built from literals alone."""
        rule = STRUCTURAL.get(eqn.primitive)
        if rule is not None:
            return rule(self, eqn, invals, setting, constant)
        if _has_body(eqn):  # a body typed for its declared inputs, and no rule for it
            return bind_eqn(eqn, [self.restore(x, v.aval.dtype) for x, v in zip(invals, eqn.invars, strict=True)])
        return self.op(eqn, invals, setting, constant)

    def op(self, eqn: JaxprEqn, invals: list[Any], setting: Setting | None,
           constant: Sequence[bool]) -> list[Any]:
        """One primitive: the policy's casts, then promotion of disagreeing floating inputs;
        a summing reduction left with a 16-bit input accumulates in float32."""
        policy = policy_for(setting.device_type, eqn.primitive, eqn.params) if setting else None
        vals = list(invals)
        if policy in (LOWER, FP32):
            target = setting.np_dtype if policy == LOWER else _F32
            vals = [self._to(x, atom, target, policy) if _aval_of(x, atom).dtype in _ELIGIBLE else x
                    for x, atom in zip(vals, eqn.invars, strict=True)]
        if eqn.primitive not in _NO_PROMOTE:
            vals = self._promote(eqn, vals, constant)
        params = _adjust_params(eqn, vals, policy, setting)
        if params is not eqn.params:
            eqn = eqn.replace(params=params)
        if eqn.primitive in _SCATTERS and any(_aval_of(x, a).dtype != a.aval.dtype
                                              for x, a in zip(vals, eqn.invars, strict=True)):
            return [_SCATTERS[eqn.primitive](*vals, **_scatter_kwargs(eqn.params))]
        if setting is not None and _accumulates_in_16_bits(eqn, vals):
            return self._accumulate_fp32(eqn, vals)
        return bind_eqn(eqn, vals)

    def _accumulate_fp32(self, eqn: JaxprEqn, vals: list[Any]) -> list[Any]:
        """A summing reduction of a 16-bit value: accumulated in float32, its result cast
        back to the 16-bit type, so the types downstream are those of the 16-bit op."""
        half = _aval_of(vals[0], eqn.invars[0]).dtype
        wide = [self._to(x, a, _F32, ACCUMULATE_FP32) for x, a in zip(vals, eqn.invars, strict=True)]
        return [self.cast(o, half, ACCUMULATE_FP32) for o in bind_eqn(eqn, wide)]

    def _to(self, x: Any, atom: Any, dtype: np.dtype, why: str) -> Any:
        if isinstance(atom, Literal):  # a constant: re-typed in place, no equation
            return np.asarray(x, dtype) if _aval_of(x, atom).dtype != dtype else x
        return self.cast(x, dtype, why)

    def _promote(self, eqn: JaxprEqn, vals: list[Any], constant: Sequence[bool]) -> list[Any]:
        """Casts floating inputs to the join of their types; weakly typed values and
        constants follow the others, as in JAX's own promotion."""
        avals = [_aval_of(x, a) for x, a in zip(vals, eqn.invars, strict=True)]
        floats = [i for i, a in enumerate(avals) if jax.numpy.issubdtype(a.dtype, jax.numpy.floating)]
        if len({avals[i].dtype for i in floats}) < 2:
            return vals
        strong = [i for i in floats if not (avals[i].weak_type or isinstance(eqn.invars[i], Literal)
                                            or constant[i])]
        join = functools.reduce(jax.numpy.promote_types, [avals[i].dtype for i in (strong or floats)])
        out = list(vals)
        for i in floats:
            if avals[i].dtype != join and avals[i].dtype in _ELIGIBLE:
                out[i] = self._to(vals[i], eqn.invars[i], np.dtype(join), PROMOTE)
        return out


def _flags(eqn: JaxprEqn, constant: set[Var]) -> list[bool]:
    """Which inputs of `eqn` are built from literals alone."""
    return [isinstance(v, Literal) or v in constant for v in eqn.invars]


def _aval_of(x: Any, atom: Any) -> Any:
    """The value's type; a literal that was not re-typed keeps the literal's (weak) type."""
    if isinstance(atom, Literal) and x is atom.val:
        return atom.aval
    return _aval(x)


def _accumulates_in_16_bits(eqn: JaxprEqn, vals: list[Any]) -> bool:
    """Whether `eqn` is a summing reduction (one operand) about to run on a 16-bit value."""
    return (eqn.primitive in ACCUMULATING and len(vals) == 1
            and _aval_of(vals[0], eqn.invars[0]).dtype in _HALF)


def _has_body(eqn: JaxprEqn) -> bool:
    return bool(sub_jaxprs(eqn, skip=frozenset({"update_jaxpr"})))  # a scatter's combiner is no body


def _adjust_params(eqn: JaxprEqn, vals: list[Any], policy: str | None, setting: Setting | None) -> dict:
    """A matmul's `preferred_element_type` follows its new input type: the autocast dtype
    under lower_precision_fp (never float32), float32 under fp32."""
    params = eqn.params
    pet = params.get("preferred_element_type")
    if eqn.primitive not in _MATMULS or pet is None or not jax.numpy.issubdtype(pet, jax.numpy.floating):
        return params
    new_in, old_in = _aval(vals[0]).dtype, eqn.invars[0].aval.dtype
    if policy in (LOWER, FP32):  # when the inputs were eligible, and so cast
        target = setting.np_dtype if policy == LOWER else _F32
        if new_in != target:
            return params
        want = target
    elif new_in != old_in and np.dtype(pet) == old_in:
        want = new_in
    else:
        return params
    return params if np.dtype(pet) == want else {**params, "preferred_element_type": np.dtype(want)}


# ----------------------------------------------------------------------------- scatter
# Scatter equations carry a combiner jaxpr typed for their declared dtypes; rebuilt
# through `lax` when their dtypes change.
_SCATTERS: dict[Primitive, Callable[..., Any]] = {
    P.scatter_p: lax.scatter, P.scatter_add_p: lax.scatter_add, P.scatter_mul_p: lax.scatter_mul,
    P.scatter_min_p: lax.scatter_min, P.scatter_max_p: lax.scatter_max,
}


def _scatter_kwargs(params: dict) -> dict:
    return {k: params[k] for k in ("dimension_numbers", "indices_are_sorted", "unique_indices", "mode")}


# ----------------------------------------------------------------------------- structural rules

# (rewriter, equation, input values, setting, which inputs are constant) -> output values
Rule = Callable[[Rewriter, JaxprEqn, list, "Setting | None", Sequence[bool]], list]


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
    body = functools.partial(rw.eval_jaxpr, p["jaxpr"], (), default=setting, constant_args=constant)
    with eqn_context(eqn):
        return list(jax.checkpoint(lambda *xs: body(xs), prevent_cse=p["prevent_cse"],
                                   policy=p["policy"])(*invals))


def _scan(rw: Rewriter, eqn: JaxprEqn, invals: list, setting: Setting | None,
          constant: Sequence[bool]) -> list:
    p = scan_params(eqn)
    nc, ncar = p.n_consts, p.n_carry
    consts, init, xs = invals[:nc], invals[p.carries], invals[nc + ncar:]
    dtypes = [v.aval.dtype for v in eqn.invars[p.carries]]

    def step(carry: list, x: list) -> tuple[list, list]:
        outs = rw.eval_closed(p.body, [*consts, *carry, *x], setting)
        return [rw.restore(c, d) for c, d in zip(outs[:ncar], dtypes, strict=True)], outs[ncar:]

    with eqn_context(eqn):
        carry, ys = lax.scan(step, [rw.restore(c, d) for c, d in zip(init, dtypes, strict=True)], xs,
                             length=p.length, reverse=p.reverse, unroll=p.unroll)
    return [*carry, *ys]


def _while(rw: Rewriter, eqn: JaxprEqn, invals: list, setting: Setting | None,
           constant: Sequence[bool]) -> list:
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
    dtypes = [v.aval.dtype for v in eqn.invars[cn + bn:]]

    def cond(carry: list) -> Any:
        return rw.eval_closed(p["cond_jaxpr"], [*cconsts, *carry], setting)[0]

    def body(carry: list) -> list:
        outs = rw.eval_closed(p["body_jaxpr"], [*bconsts, *carry], setting)
        return [rw.restore(c, d) for c, d in zip(outs, dtypes, strict=True)]

    with eqn_context(eqn):
        return list(lax.while_loop(cond, body, [rw.restore(c, d) for c, d in zip(init, dtypes, strict=True)]))


def _cond(rw: Rewriter, eqn: JaxprEqn, invals: list, setting: Setting | None,
          constant: Sequence[bool]) -> list:
    index, ops = invals[0], invals[1:]
    dtypes = [v.aval.dtype for v in eqn.outvars]

    def branch(closed: ClosedJaxpr, *xs: Any) -> list:
        return [rw.restore(o, d) for o, d in zip(rw.eval_closed(closed, xs, setting), dtypes, strict=True)]

    with eqn_context(eqn):
        return list(lax.switch(index, [functools.partial(branch, b) for b in eqn.params["branches"]], *ops))


def _custom_jvp(rw: Rewriter, eqn: JaxprEqn, invals: list, setting: Setting | None,
                constant: Sequence[bool]) -> list:
    """The function and its JVP rule are both rewritten (under differentiation JAX runs the
    rule, not the function), re-traced at the inputs' new types."""
    p = eqn.params
    in_avals = [_aval(x).strip_weak_type() for x in invals]
    call = jax.make_jaxpr(lambda *xs: rw.eval_closed(p["call_jaxpr"], xs, setting))(*in_avals)
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
    return bind_eqn(eqn.replace(params=params), invals)


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
        flags = _flags(eqn, constant)
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


# ----------------------------------------------------------------------------- entry points

def has_markers(jaxpr: Jaxpr) -> bool:
    """Whether any equation (also in bodies) was traced inside an autocast context."""
    for eqn in jaxpr.eqns:
        if any(s in MARKERS for s in name_scopes(eqn)) or any(map(has_markers, sub_jaxprs(eqn))):
            return True
    return False


def rewrite_closed(closed: ClosedJaxpr, avals: Sequence[Any],
                   setting: Setting | None) -> tuple[ClosedJaxpr, tuple[tuple[str, int], ...]]:
    """`closed` re-traced under autocast (`setting` outside any marker); its casts by policy."""
    rw = Rewriter()
    new = jax.make_jaxpr(lambda *xs: rw.eval_closed(closed, xs, setting))(*avals)
    return new, ordered(rw.counts)


def rewrite_backward(program: ClosedJaxpr, n_cotangents: int,
                     choose: Callable[[JaxprEqn], Setting | None]) -> tuple[ClosedJaxpr, tuple[tuple[str, int], ...]]:
    """Rewrites only the cotangent-dependent equations of a backward program (its last
    `n_cotangents` inputs are the cotangents), each under `choose(eqn)`. Forward values it
    recomputes are re-bound unchanged (the forward's own equations). Outputs (the input
    cotangents) keep their declared dtypes."""
    rw = Rewriter()
    jaxpr = program.jaxpr
    constant = constant_vars(jaxpr)

    def run(*args: Any) -> list:
        backward = set(jaxpr.invars[len(jaxpr.invars) - n_cotangents:])

        def bind(eqn: JaxprEqn, invals: list) -> list:
            if not any(isinstance(v, Var) and v in backward for v in eqn.invars):
                return bind_eqn(eqn, invals)
            backward.update(v for v in eqn.outvars if isinstance(v, Var))
            return rw.eqn(eqn, invals, choose(eqn), _flags(eqn, constant))

        outs = eval_jaxpr(jaxpr, program.consts, args, bind=bind)
        return [rw.restore(o, v.aval.dtype) for o, v in zip(outs, jaxpr.outvars, strict=True)]

    new = jax.make_jaxpr(run)(*[v.aval for v in jaxpr.invars])
    return new, ordered(rw.counts)
