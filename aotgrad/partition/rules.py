"""Which primitives may be recomputed in the backward, and at what kind of cost.

One rule per primitive name; a primitive with no rule gets `COSTLY` (it is never
recomputed unless a memory budget asks for it). Register your own with `register`.

- CHEAP: fusible elementwise math, casts, shape changes, selects; recomputing them in a
  backward fusion costs little compute and no extra memory traffic.
- MOVE: data movement that writes a new layout (transposes, concatenations, gathers);
  recomputing costs about one read and one write of the output.
- REDUCE: reductions; recomputing costs re-reading the input (a large input with a
  small output is cheaper to save).
- RANDOM: random-bit generation. Safe to recompute in JAX (keys are explicit, so the
  bits are the same), but hashing costs compute: decided by cost.
- COSTLY: compute-bound or opaque work (matmuls, convolutions, sorts, FFTs, linear
  algebra, control flow): never recomputed at budget 1; a memory budget below 1 may
  recompute them, cheapest FLOPs first.
- UNSAFE: never recomputed at any budget: collectives (ranks that recompute
  differently deadlock), callbacks and custom calls, and every equation with effects.

One more is decided by the graph, not by the primitive (`min_cut.Problem`): an equality
test (`FLOAT_EQUALITY`) of values computed from a 16-bit float widened to float32 is never
recomputed. The derivatives of `max`, `min`, `maximum` and `clip` find where a result came
from with `eq(operand, result)`. Inside a forward fusion XLA may skip the 16-bit rounding
before a widening cast (excess precision), while the saved copy of the 16-bit value is
rounded; an operand recomputed from that copy then equals the forward's saved result
nowhere, and the gradient would be zero. So such a mask is computed once, in the forward
(and saved, one byte per element). Values computed in one type are recomputed bit for bit,
and ordering tests (`gt`, `lt`) can only flip at a near-tie, where the function has a
kink anyway.
"""
from __future__ import annotations

import enum
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr

__all__ = ["FLOAT_EQUALITY", "Kind", "RULES", "kind_of", "register", "sub_jaxprs"]


class Kind(enum.Enum):
    CHEAP = "cheap"
    MOVE = "move"
    REDUCE = "reduce"
    RANDOM = "random"
    COSTLY = "costly"
    UNSAFE = "unsafe"

    @property
    def recomputable_at_full_budget(self) -> bool:
        return self not in (Kind.COSTLY, Kind.UNSAFE)


_CHEAP = """
    abs acos acosh add add_any and asin asinh atan atan2 atanh bitcast_convert_type
    broadcast_in_dim cbrt ceil clamp clz complex conj convert_element_type copy copy_p cos
    cosh digamma div eq erf erf_inv erfc exp exp2 expand_dims expm1 floor ge gt imag
    integer_pow iota is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter
    not or polygamma population_count pow real reduce_precision rem reshape round rsqrt
    select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh slice sqrt
    square squeeze stop_gradient sub tan tanh xor sharding_constraint pvary name
    igamma igammac igamma_grad_a random_gamma_grad bessel_i0e bessel_i1e zeta regularized_incomplete_beta
"""
_MOVE = """
    transpose rev concatenate pad gather dynamic_slice dynamic_update_slice split
    select_and_gather_add
"""
_REDUCE = """
    reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin
    cumsum cumprod cummax cummin cumlogsumexp reduce_window_sum reduce_window_max
    reduce_window_min reduce_window
"""
_RANDOM = "random_bits random_seed random_wrap random_unwrap random_fold_in random_split threefry2x32"
_COSTLY = """
    dot_general conv_general_dilated sort top_k fft cholesky qr svd eig eigh lu lu_pivots_to_permutation
    triangular_solve householder_product geqrf tridiagonal tridiagonal_solve schur hessenberg
    scan while cond custom_lin
    scatter scatter-add scatter_add scatter-mul scatter_mul scatter-min scatter-max select_and_scatter_add
    select_and_scatter argsort
"""
_UNSAFE = """
    psum pmax pmin pmean all_gather all_to_all ppermute psum_scatter reduce_scatter pbroadcast
    axis_index shard_map xla_pmap custom_call ffi_call pure_callback io_callback debug_callback
    device_put
"""

# Comparisons never recomputed on values widened from 16-bit floats (see the docstring).
FLOAT_EQUALITY = frozenset({"eq", "ne"})

# Calls are as costly as the worst equation in their body (a relu's custom_jvp_call is cheap).
CALLS = frozenset("custom_jvp_call custom_vjp_call checkpoint remat jit pjit closed_call call".split())
_ORDER = (Kind.CHEAP, Kind.MOVE, Kind.REDUCE, Kind.RANDOM, Kind.COSTLY, Kind.UNSAFE)

RULES: dict[str, Kind] = {}
for _kind, _names in ((Kind.CHEAP, _CHEAP), (Kind.MOVE, _MOVE), (Kind.REDUCE, _REDUCE),
                      (Kind.RANDOM, _RANDOM), (Kind.COSTLY, _COSTLY), (Kind.UNSAFE, _UNSAFE)):
    RULES.update(dict.fromkeys(_names.split(), _kind))


def register(primitive: Any, kind: Kind) -> None:
    """Sets the recompute rule of a primitive (a `jax.extend.core.Primitive` or its name)."""
    if not isinstance(kind, Kind):
        raise TypeError(f"kind must be an aotgrad.partition.rules.Kind; got {kind!r}.")
    RULES[getattr(primitive, "name", primitive)] = kind


def kind_of(eqn: Any) -> Kind:
    """The rule for one equation. Equations with effects, and control flow whose body holds
    an unsafe equation (a collective inside a scan), are never recomputed; a call is
    classified by its body."""
    if eqn.effects:
        return Kind.UNSAFE
    if eqn.primitive.name in CALLS:
        return max((kind_of(e) for j in sub_jaxprs(eqn) for e in j.eqns), key=_ORDER.index,
                   default=Kind.CHEAP)
    kind = RULES.get(eqn.primitive.name, Kind.COSTLY)
    if kind is Kind.COSTLY and any(kind_of(e) is Kind.UNSAFE for j in sub_jaxprs(eqn) for e in j.eqns):
        return Kind.UNSAFE
    return kind


def sub_jaxprs(eqn: Any) -> list[Jaxpr]:
    """The jaxprs in an equation's parameters (bodies of scan, cond branches, ...)."""
    found: list[Jaxpr] = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, Jaxpr):
                found.append(item)
    return found
