"""How a jaxpr is rewritten under autocast: an interpreter that re-binds every equation
(so every dtype stays exact), casting inputs as the device's policy table says.

Per-primitive behaviour lives in two tables: `policy.TABLES` (which casts an op gets)
and `bodies.STRUCTURAL` (how bodies of calls, loops, branches and custom-derivative
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

from aotgrad._jax_internals import bind_eqn, name_scopes
from aotgrad.autocast.bodies import STRUCTURAL, constant_flags, constant_vars
from aotgrad.autocast.context import MARKERS, Setting, setting_of
from aotgrad.autocast.counts import CastCounts as CastCounts
from aotgrad.autocast.policy import ACCUMULATE_FP32, ACCUMULATING, FP32, LOWER, POLICIES, PROMOTE, policy_for
from aotgrad.interpret import eval_jaxpr, sub_jaxprs

__all__ = ["FOLLOW", "RESTORE", "CastCounts", "Rewriter", "has_markers", "rewrite_backward"]

RESTORE = "restore"  # a cast back to a declared dtype: loop carries, branch outputs, gradients
FOLLOW = "follow"  # a float32 input or constant cast down to the 16-bit value it meets ("jax" promotion)
_ELIGIBLE = frozenset(np.dtype(d) for d in (jax.numpy.float16, jax.numpy.bfloat16, jax.numpy.float32))
_F32 = np.dtype(np.float32)
_HALF = frozenset(np.dtype(d) for d in (jax.numpy.float16, jax.numpy.bfloat16))
_MATMULS = (P.dot_general_p, P.conv_general_dilated_p)
_NO_PROMOTE = frozenset({P.sort_p})  # operands of different dtypes are legal and independent


def ordered(counts: collections.Counter) -> tuple[tuple[str, int], ...]:
    order = POLICIES + (FOLLOW, ACCUMULATE_FP32, RESTORE)
    return tuple((p, counts[p]) for p in order if counts[p])


def _aval(x: Any) -> Any:
    return jax.typeof(x)


class Rewriter:
    """Evaluates jaxprs under autocast settings, counting the casts it inserts.

    It also tracks which float32 values are *wide*: made float32 by the fp32 policy, by a
    promotion, or by an explicit cast up from 16 bits (and what is computed from them).
    Under the "jax" promotion only a wide value makes a mixed op float32; the function's
    inputs, constants and values computed from them alone follow the 16-bit operand.
    `follow=False` treats every float32 value as wide (PyTorch's promotion), as the
    backward's rewrite does: its dtypes were settled by the forward's casts.
    """

    def __init__(self, follow: bool = True) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.follow = follow
        self._wide: dict[int, Any] = {}  # id -> value (held, so the id is not reused)

    # ---------------------------------------------------------------- wide values

    def is_wide(self, x: Any) -> bool:
        return not self.follow or id(x) in self._wide

    def mark_wide(self, xs: Sequence[Any], flags: Sequence[bool] | None = None) -> None:
        """Marks the float32 values among `xs` (those whose flag is set) wide."""
        if not self.follow:
            return
        for i, x in enumerate(xs):
            if (flags is None or flags[i]) and _is_f32(x):
                self._wide[id(x)] = x

    def inherit(self, inner: Sequence[Any], outer: Sequence[Any]) -> None:
        """A body's fresh inputs are wide where the values they stand for are."""
        self.mark_wide(inner, [self.is_wide(x) for x in outer])

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
            return self.eqn(eqn, invals, setting_of(eqn, default), constant_flags(eqn, constant))
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
        # float32 results are wide when the policy, a wide input or a 16-bit input made them so
        widens = policy == FP32 or any(self.is_wide(x) or _aval_of(x, a).dtype in _HALF
                                       for x, a in zip(invals, eqn.invars, strict=True))
        vals = list(invals)
        if policy in (LOWER, FP32):
            target = setting.np_dtype if policy == LOWER else _F32
            vals = [self._to(x, atom, target, policy) if _aval_of(x, atom).dtype in _ELIGIBLE else x
                    for x, atom in zip(vals, eqn.invars, strict=True)]
        if eqn.primitive not in _NO_PROMOTE:
            vals = self._promote(eqn, vals, constant, setting)
        outs = self._bind(eqn, vals, policy, setting)
        if widens:
            self.mark_wide(outs)
        return outs

    def _bind(self, eqn: JaxprEqn, vals: list[Any], policy: str | None, setting: Setting | None) -> list[Any]:
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

    def _promote(self, eqn: JaxprEqn, vals: list[Any], constant: Sequence[bool],
                 setting: Setting | None) -> list[Any]:
        """Casts floating inputs to the join of their types; weakly typed values and
        constants follow the others, as in JAX's own promotion. Under the "jax" promotion,
        float32 values that are not wide follow the 16-bit ones too."""
        avals = [_aval_of(x, a) for x, a in zip(vals, eqn.invars, strict=True)]
        floats = [i for i, a in enumerate(avals) if jax.numpy.issubdtype(a.dtype, jax.numpy.floating)]
        if len({avals[i].dtype for i in floats}) < 2:
            return vals
        strong = [i for i in floats if not (avals[i].weak_type or isinstance(eqn.invars[i], Literal)
                                            or constant[i])]
        deciding, why = strong or floats, PROMOTE
        if setting is not None and setting.promotion == "jax":
            halves = [i for i in deciding if avals[i].dtype in _HALF]
            if halves and not any(avals[i].dtype == _F32 and self.is_wide(vals[i]) for i in deciding):
                deciding, why = halves, FOLLOW
        join = functools.reduce(jax.numpy.promote_types, [avals[i].dtype for i in deciding])
        out = list(vals)
        for i in floats:
            if avals[i].dtype != join and avals[i].dtype in _ELIGIBLE:
                cast_why = FOLLOW if why == FOLLOW and avals[i].dtype == _F32 else PROMOTE
                out[i] = self._to(vals[i], eqn.invars[i], np.dtype(join), cast_why)
        return out


def _is_f32(x: Any) -> bool:
    return hasattr(x, "dtype") and np.dtype(x.dtype) == _F32


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
    rw = Rewriter(follow=False)
    jaxpr = program.jaxpr
    constant = constant_vars(jaxpr)

    def run(*args: Any) -> list:
        backward = set(jaxpr.invars[len(jaxpr.invars) - n_cotangents:])

        def bind(eqn: JaxprEqn, invals: list) -> list:
            if not any(isinstance(v, Var) and v in backward for v in eqn.invars):
                return bind_eqn(eqn, invals)
            backward.update(v for v in eqn.outvars if isinstance(v, Var))
            return rw.eqn(eqn, invals, choose(eqn), constant_flags(eqn, constant))

        outs = eval_jaxpr(jaxpr, program.consts, args, bind=bind)
        return [rw.restore(o, v.aval.dtype) for o, v in zip(outs, jaxpr.outvars, strict=True)]

    new = jax.make_jaxpr(run)(*[v.aval for v in jaxpr.invars])
    return new, ordered(rw.counts)
