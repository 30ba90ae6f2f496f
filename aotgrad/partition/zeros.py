"""Which values of a joint graph are zero when some cotangents are known to be zero.

Under `jax.value_and_grad(f, has_aux=True)` the auxiliary outputs get symbolic-zero
cotangents. A backward program that took them as arrays of zeros would compute with them
(a BatchNorm's statistics' cotangents flow back through every convolution), so the
backward is built without them: `split` leaves out every equation whose outputs are known
zero, and gives zeros to the few equations that still read such a value (an `add_any`
where a real cotangent meets a zero one, which XLA folds).

"Known zero" is decided per primitive, by what the primitive does with a zero (`RULES`):
a product is zero when any factor is, a sum when every term is, a reshape, transpose,
cast or slice of zero is zero, calls and scans by their bodies. A primitive with no rule
is never known zero (the analysis only loses a saving, never a value), so `is_finite` of
a zero cotangent stays what it computes. This matches JAX's symbolic zeros, which skip
the transpose of every equation that only zero cotangents reach.
"""
from __future__ import annotations

from typing import AbstractSet, Any, Callable, Iterable, Sequence

import jax
import jax.extend.core.primitives as P
import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Literal, Primitive, Var

from aotgrad._jax_internals import open_jaxpr, scan_params

__all__ = ["RULES", "known_zero", "zeros_like"]

# (equation, per input: known zero) -> per output: known zero
ZeroRule = Callable[[JaxprEqn, list[bool]], list[bool]]


def known_zero(eqns: Iterable[JaxprEqn], zeros: Iterable[Var]) -> frozenset[Var]:
    """The values `eqns` compute that are zero whenever the values `zeros` are (`zeros`
    included)."""
    found = set(zeros)
    for eqn in eqns:
        ins = [_is_zero(v, found) for v in eqn.invars]
        if not any(ins):
            continue
        rule = RULES.get(eqn.primitive)
        outs = rule(eqn, ins) if rule is not None else [False] * len(eqn.outvars)
        found.update(v for v, z in zip(eqn.outvars, outs, strict=True) if z and isinstance(v, Var))
    return frozenset(found)


def zeros_like(aval: Any) -> Any:
    """An array of zeros of this type (float0 stays a NumPy array: it has no device type)."""
    if aval.dtype == jax.dtypes.float0:
        return np.zeros(aval.shape, jax.dtypes.float0)
    return jax.numpy.zeros(aval.shape, aval.dtype)


def _is_zero(atom: object, found: AbstractSet[Var]) -> bool:
    if isinstance(atom, Literal):
        return not isinstance(atom.val, (list, tuple)) and _literal_zero(atom.val)
    return atom in found


def _literal_zero(value: object) -> bool:
    try:
        return bool((value == 0).all()) if hasattr(value, "all") else value == 0
    except (TypeError, ValueError):
        return False


def _outputs_of(jaxpr: Jaxpr, ins: Sequence[bool]) -> list[bool]:
    """Which outputs of `jaxpr` are known zero, given which inputs are."""
    if len(jaxpr.invars) != len(ins):
        return [False] * len(jaxpr.outvars)
    found = known_zero(jaxpr.eqns, [v for v, z in zip(jaxpr.invars, ins) if z])
    return [_is_zero(v, found) for v in jaxpr.outvars]


def _any(eqn: JaxprEqn, ins: list[bool]) -> list[bool]:
    """A product: zero when any factor is."""
    return [any(ins)] * len(eqn.outvars)


def _all(eqn: JaxprEqn, ins: list[bool]) -> list[bool]:
    """A sum (or a concatenation): zero when every operand is."""
    return [all(ins)] * len(eqn.outvars)


def _first(eqn: JaxprEqn, ins: list[bool]) -> list[bool]:
    """A linear map of its first operand (the others are indices, shapes or divisors)."""
    return [ins[0]] * len(eqn.outvars)


def _each(eqn: JaxprEqn, ins: list[bool]) -> list[bool]:
    """Operand i becomes output i (collectives over several operands)."""
    return list(ins) if len(ins) == len(eqn.outvars) else [False] * len(eqn.outvars)


def _cases(eqn: JaxprEqn, ins: list[bool]) -> list[bool]:
    """select_n(predicate, *cases): zero when every case is."""
    return [all(ins[1:])]


def _first_two(eqn: JaxprEqn, ins: list[bool]) -> list[bool]:
    """pad(operand, padding value); dynamic_update_slice(operand, update, *indices)."""
    return [ins[0] and ins[1]]


def _scatter_add(eqn: JaxprEqn, ins: list[bool]) -> list[bool]:
    """scatter_add(operand, indices, updates)."""
    return [ins[0] and ins[2]]


def _call(param: str) -> ZeroRule:
    def rule(eqn: JaxprEqn, ins: list[bool]) -> list[bool]:
        body = eqn.params.get(param)
        return _outputs_of(open_jaxpr(body)[0], ins) if body is not None else [False] * len(eqn.outvars)
    return rule


def _scan(eqn: JaxprEqn, ins: list[bool]) -> list[bool]:
    """A carry is zero if it starts zero and the body keeps it zero; found as a fixed
    point from "every carry that starts zero stays zero"."""
    s = scan_params(eqn)
    body = open_jaxpr(s.body)[0]
    consts, carry, xs = ins[:s.n_consts], ins[s.carries], ins[s.n_consts + s.n_carry:]
    while True:
        outs = _outputs_of(body, [*consts, *carry, *xs])
        kept = [c and o for c, o in zip(carry, outs[:s.n_carry], strict=True)]
        if kept == carry:
            return outs
        carry = kept


_PRODUCTS = (P.mul_p, P.dot_general_p, P.conv_general_dilated_p)
_SUMS = (P.add_p, P.add_jaxvals_p, P.sub_p, P.concatenate_p)
_LINEAR = (
    P.neg_p, P.reshape_p, P.broadcast_in_dim_p, P.transpose_p, P.convert_element_type_p, P.reduce_sum_p,
    P.slice_p, P.squeeze_p, P.rev_p, P.copy_p, P.reduce_precision_p, P.real_p, P.imag_p, P.conj_p,
    P.cumsum_p, P.dynamic_slice_p, P.gather_p, P.div_p, P.reduce_window_sum_p, P.sharding_constraint_p,
    P.select_and_scatter_add_p, P.stop_gradient_p,
)
_PER_OPERAND = (P.psum_p, P.all_gather_p, P.all_to_all_p, P.ppermute_p)

RULES: dict[Primitive, ZeroRule] = {
    **{p: _any for p in _PRODUCTS},
    **{p: _all for p in _SUMS},
    **{p: _first for p in _LINEAR},
    **{p: _each for p in _PER_OPERAND},
    P.select_n_p: _cases,
    P.pad_p: _first_two,
    P.dynamic_update_slice_p: _first_two,
    P.scatter_add_p: _scatter_add,
    P.scan_p: _scan,
    P.jit_p: _call("jaxpr"),
    P.closed_call_p: _call("call_jaxpr"),
    P.custom_jvp_call_p: _call("call_jaxpr"),
    P.custom_vjp_call_p: _call("call_jaxpr"),
    P.remat_p: _call("jaxpr"),
}
