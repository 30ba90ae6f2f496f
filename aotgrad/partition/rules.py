"""Which primitives may be recomputed in the backward, and at what kind of cost.

One rule per primitive, keyed by the `Primitive` object (a misspelt entry fails at import);
every primitive `jax.extend.core.primitives` exports on a supported JAX version has one (a
test enforces it). A primitive met without a rule (a library's own) falls back to `COSTLY`
(never recomputed unless a memory budget asks for it): a warning says so once per process,
and `aotgrad.explain` lists it (`Report.fallback_rules`). Register your own with `register`.

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
import warnings
from typing import Any, Iterable

import jax.extend.core.primitives as P
from jax.extend.core import Primitive, Var

from aotgrad._jax_internals import jax_primitives
from aotgrad._jax_internals import primitives as I
from aotgrad.interpret import sub_jaxprs

__all__ = ["FALLBACK", "FLOAT_EQUALITY", "IN_PLACE", "MATMULS", "Kind", "RULES", "duplicated", "kind_of", "register",
           "sub_jaxprs", "without_rule"]


class Kind(enum.Enum):
    CHEAP = "cheap"
    MOVE = "move"
    REDUCE = "reduce"
    RANDOM = "random"
    COSTLY = "costly"
    UNSAFE = "unsafe"


_CHEAP = (
    P.abs_p, P.acos_p, P.acosh_p, P.add_p, P.add_jaxvals_p, P.and_p, P.asin_p, P.asinh_p, P.atan_p, P.atan2_p,
    P.atanh_p, P.bitcast_convert_type_p, P.broadcast_in_dim_p, P.cbrt_p, P.ceil_p, P.clamp_p, P.clz_p,
    P.complex_p, P.conj_p, P.convert_element_type_p, P.copy_p, P.cos_p, P.cosh_p, P.digamma_p, P.div_p,
    P.eq_p, P.erf_p, P.erf_inv_p, P.erfc_p, P.exp_p, P.exp2_p, P.expm1_p, P.floor_p, P.ge_p, P.gt_p,
    P.imag_p, P.integer_pow_p, P.iota_p, P.is_finite_p, P.le_p, P.lgamma_p, P.log_p, P.log1p_p,
    P.logistic_p, P.lt_p, P.max_p, P.min_p, P.mul_p, P.ne_p, P.neg_p, P.nextafter_p, P.not_p, P.or_p,
    P.polygamma_p, P.population_count_p, P.pow_p, P.real_p, P.reduce_precision_p, P.rem_p, P.reshape_p,
    P.round_p, P.rsqrt_p, P.select_n_p, P.shift_left_p, P.shift_right_arithmetic_p,
    P.shift_right_logical_p, P.sign_p, P.sin_p, P.sinh_p, P.slice_p, P.sqrt_p, P.square_p, P.squeeze_p,
    P.stop_gradient_p, P.sub_p, P.tan_p, P.tanh_p, P.xor_p, P.sharding_constraint_p, I.pvary_p,
    P.name_p,
    P.igamma_p, P.igammac_p, P.igamma_grad_a_p, P.bessel_i0e_p, P.bessel_i1e_p, P.zeta_p,
    P.regularized_incomplete_beta_p, P.eq_to_p, P.le_to_p, P.lt_to_p, P.empty2_p,
    I.one_minus_square_p, I.log2_p, I.polynomial_p,
)
_MOVE = (
    P.transpose_p, P.rev_p, P.concatenate_p, P.pad_p, P.gather_p, P.dynamic_slice_p,
    P.dynamic_update_slice_p, I.split_p, P.select_and_gather_add_p,
)
_REDUCE = (
    P.reduce_sum_p, P.reduce_max_p, P.reduce_min_p, P.reduce_prod_p, P.reduce_and_p, P.reduce_or_p,
    P.reduce_xor_p, P.argmax_p, P.argmin_p, P.cumsum_p, P.cumprod_p, P.cummax_p, P.cummin_p,
    P.cumlogsumexp_p, P.reduce_window_sum_p, P.reduce_window_max_p, P.reduce_window_min_p, P.reduce_window_p,
    P.reduce_p,
)
# Keyed, so recomputing reproduces the bits (`rng_uniform`, which is stateful, is UNSAFE).
_RANDOM = (P.random_bits_p, P.random_seed_p, I.random_wrap_p, I.random_unwrap_p, P.random_fold_in_p,
           P.random_split_p, P.threefry2x32_p, P.random_gamma_p, P.rng_bit_generator_p)
# Matmuls and convolutions: the compute-bound work a checkpoint policy saves, and what
# reads its operands from memory.
MATMULS: frozenset[Primitive] = frozenset({P.dot_general_p, P.conv_general_dilated_p})
_COSTLY = (
    *MATMULS, P.sort_p, P.top_k_p, P.fft_p, P.cholesky_p, P.qr_p, P.svd_p,
    P.eig_p, P.eigh_p, P.lu_p, I.lu_pivots_to_permutation_p, P.triangular_solve_p,
    P.householder_product_p, I.geqrf_p, P.tridiagonal_p, P.tridiagonal_solve_p, P.schur_p,
    P.hessenberg_p, P.scan_p, P.while_p, P.cond_p, P.custom_lin_p,
    P.scatter_p, P.scatter_add_p, P.scatter_mul_p, P.scatter_min_p, P.scatter_max_p,
    P.select_and_scatter_add_p, P.select_and_scatter_p, P.approx_top_k_p, P.linear_solve_p,
)
_UNSAFE = (
    P.psum_p, P.pmax_p, P.pmin_p, P.all_gather_p, P.all_to_all_p, P.ragged_all_to_all_p, P.ppermute_p,
    I.reduce_scatter_p, I.pbroadcast_p, I.psum_invariant_p, I.all_gather_invariant_p, P.axis_index_p,
    I.shard_map_p, I.ffi_call_p, I.pure_callback_p, I.io_callback_p, I.debug_callback_p, P.device_put_p,
    # Tokens, mutable references and stateful random numbers: order and state matter.
    P.after_all_p, P.create_token_p, P.get_p, P.swap_p, P.rng_uniform_p,
)

# Primitives JAX does not export, by name (`_jax_internals.jax_primitives`; names absent from
# the installed version are skipped). Async halves of collectives, mutable state, effects
# and barriers are UNSAFE; calls to kernels and custom lowerings are COSTLY.
_BY_NAME: dict[str, Kind] = {
    **dict.fromkeys(("zeros_like", "mulhi", "empty", "from_edtype", "to_edtype", "platform_index",
                     "layout_constraint", "reshard", "dim_as_value", "dimension_size"), Kind.CHEAP),
    **dict.fromkeys(("stack", "unstack", "tile", "relayout"), Kind.MOVE),
    **dict.fromkeys(("philox2x32", "philox4x32", "threefry4x32", "iota_2x32_shape", "random_clone"), Kind.RANDOM),
    **dict.fromkeys((
        "scatter-sub", "ragged_dot_general", "scaled_dot", "scaled_matmul", "scaled_matmul_wrapper",
        "dot_product_attention_fwd", "dot_product_attention_bwd", "dot_product_attention_fwd_wrapper",
        "dot_product_attention_bwd_wrapper", "dot_product_attention_fp8_fwd", "dot_product_attention_fp8_bwd",
        "dot_product_attention_fp8_fwd_wrapper", "dot_product_attention_fp8_bwd_wrapper", "cudnn_fusion",
        "cholesky_update", "geqp3", "ormqr", "symmetric_product", "linear_call", "custom_partitioning",
        "custom_vmap_call", "call_exported", "custom_jvp_call_jaxpr", "remat_opt", "call_hi_primitive",
        "call_hi_primitive_linearized", "optimization_barrier", "composite", "eval_jaxpr", "core_map"),
        Kind.COSTLY),
    **dict.fromkeys((
        "accum_grad_in_ref", "addupdate", "broadcast_to", "create_linear", "empty_ref", "free_ref", "freeze",
        "new_ref", "pin", "unpin", "with_memory_space_constraint", "run_state", "box_get", "box_set", "new_box",
        "log_extend", "log_read", "new_log", "check", "debug_print", "inspect_sharding", "shape_assertion",
        "dce_sink", "stage", "tie", "unreachable",
        "all_gather_start", "all_gather_done", "all_gather_reduced", "all_gather_reduced_start",
        "all_to_all_start", "all_to_all_done", "ppermute_start", "ppermute_done", "psum_start", "psum_done",
        "psum_invariant_start", "reduce_scatter_start", "reduce_scatter_done", "pbroadcast_start",
        "pbroadcast_done", "pbroadcast_dynamic", "psend", "precv", "preduced", "unreduced_psum",
        "unreduced_psum_start", "unreduced_pmax", "unreduced_pmin", "unreduced_reduce_scatter",
        "unreduced_reduce_scatter_start", "reduced_vary_cast", "reduced_vary_cast_p", "vary_unreduced_cast",
        "vary_unreduced_cast_p"), Kind.UNSAFE),
}

# Comparisons never recomputed on values widened from 16-bit floats (see the docstring).
FLOAT_EQUALITY = frozenset({P.eq_p, P.ne_p})

# Equations whose result XLA writes over their first operand's buffer when nothing reads
# that operand afterwards (an update in place: the operand is copied first otherwise).
IN_PLACE = frozenset({P.scatter_p, P.scatter_add_p, P.scatter_mul_p, P.scatter_min_p, P.scatter_max_p,
                      P.dynamic_update_slice_p})

# Elementwise work XLA:GPU's fusion computes again inside each fusion that reads it rather
# than writing it once for its several readers: what its fusion does not count as
# expensive (arithmetic, selects, comparisons, casts, broadcasts, reshapes; and in 32- and
# 16-bit floats division, exp and square roots, which its kernels compute at the
# special-function units' rate).
_DUPLICATED_ON_GPU = frozenset({
    P.add_p, P.sub_p, P.mul_p, P.neg_p, P.max_p, P.min_p, P.abs_p, P.sign_p, P.select_n_p, P.clamp_p,
    P.convert_element_type_p, P.broadcast_in_dim_p, P.reshape_p, P.squeeze_p, P.integer_pow_p, P.square_p,
    P.eq_p, P.ne_p, P.lt_p, P.le_p, P.gt_p, P.ge_p, P.and_p, P.or_p, P.not_p, P.add_jaxvals_p,
})
_FAST_MATH_ON_GPU = frozenset({P.div_p, P.exp_p, P.sqrt_p, P.rsqrt_p})
_FAST_MATH_DTYPES = frozenset({"float32", "float16", "bfloat16"})


def duplicated(eqn: Any, platform: str | None) -> bool:
    """Whether XLA, compiling for `platform`, computes `eqn`'s result again inside each
    fusion that reads it rather than writing it once to memory: on a GPU, cheap elementwise
    work (above) with at most one operand of its result's size, the others smaller (a
    row's mean, a scale, a bias). That operand is then read where the result is, and stays
    live until its last reader: a layer norm's centred input is not kept for the backward,
    its input is. A sum of two full-size values (a residual connection) is written."""
    if platform != "gpu":
        return False
    if eqn.primitive not in _DUPLICATED_ON_GPU and not (
            eqn.primitive in _FAST_MATH_ON_GPU
            and all(str(v.aval.dtype) in _FAST_MATH_DTYPES for v in eqn.outvars)):
        return False
    size = max(v.aval.size for v in eqn.outvars)
    return len({v for v in eqn.invars if isinstance(v, Var) and v.aval.size >= size}) <= 1


# Calls are as costly as the worst equation in their body (a relu's custom_jvp_call is cheap,
# a `jax.checkpoint` of pointwise math is cheap).
CALLS = frozenset({P.custom_jvp_call_p, P.custom_vjp_call_p, P.remat_p, P.jit_p, P.closed_call_p, P.call_p})
_ORDER = (Kind.CHEAP, Kind.MOVE, Kind.REDUCE, Kind.RANDOM, Kind.COSTLY, Kind.UNSAFE)

RULES: dict[Primitive, Kind] = {}
for _kind, _prims in ((Kind.CHEAP, _CHEAP), (Kind.MOVE, _MOVE), (Kind.REDUCE, _REDUCE),
                      (Kind.RANDOM, _RANDOM), (Kind.COSTLY, _COSTLY), (Kind.UNSAFE, _UNSAFE)):
    for _prim in _prims:
        if _prim is None:  # not in this JAX version
            continue
        assert isinstance(_prim, Primitive) and _prim not in RULES, _prim  # one rule per primitive
        RULES[_prim] = _kind
for _name, _found in jax_primitives().items():
    for _prim in _found:
        if _name in _BY_NAME and _prim not in RULES and _prim not in CALLS:
            RULES[_prim] = _BY_NAME[_name]


def register(primitive: Primitive, kind: Kind) -> None:
    """Sets the recompute rule of a primitive.

    Arguments:
        primitive: a `jax.extend.core.Primitive` (e.g. `jax.extend.core.primitives.tanh_p`,
            or a primitive of your own).
        kind: a `Kind`.
    """
    if not isinstance(primitive, Primitive):
        raise TypeError(f"aotgrad.partition.rules.register: primitive must be a jax.extend.core.Primitive "
                        f"(e.g. jax.extend.core.primitives.tanh_p); got {type(primitive).__name__} "
                        f"({primitive!r}).")
    if not isinstance(kind, Kind):
        raise TypeError(f"aotgrad.partition.rules.register: kind must be an aotgrad.partition.rules.Kind; "
                        f"got {kind!r}.")
    RULES[primitive] = kind


FALLBACK = Kind.COSTLY  # the rule of a primitive with none
_WARNED: set[Primitive] = set()  # primitives already reported as falling back


def without_rule(jaxprs: Iterable[Any]) -> tuple[str, ...]:
    """Names of the primitives in `jaxprs` (and their bodies) that have no rule, sorted."""
    found: set[str] = set()

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive not in RULES and eqn.primitive not in CALLS:
                found.add(eqn.primitive.name)
            for body in sub_jaxprs(eqn):
                walk(body)
    for jaxpr in jaxprs:
        walk(jaxpr)
    return tuple(sorted(found))


def _fallback(primitive: Primitive) -> Kind:
    if primitive not in _WARNED:
        _WARNED.add(primitive)
        warnings.warn(f"aotgrad: primitive {primitive.name!r} has no recompute rule; it is treated as "
                      f"{FALLBACK.value!r} (never recomputed unless a memory budget asks). Set one with "
                      f"aotgrad.partition.rules.register.", stacklevel=2)
    return FALLBACK


def kind_of(eqn: Any) -> Kind:
    """The rule for one equation. Equations with effects, and control flow whose body holds
    an unsafe equation (a collective inside a scan), are never recomputed; a call is
    classified by its body."""
    if eqn.effects:
        return Kind.UNSAFE
    if eqn.primitive in CALLS:
        return max((kind_of(e) for j in sub_jaxprs(eqn) for e in j.eqns), key=_ORDER.index,
                   default=Kind.CHEAP)
    kind = RULES.get(eqn.primitive) or _fallback(eqn.primitive)
    if kind is Kind.COSTLY and any(kind_of(e) is Kind.UNSAFE for j in sub_jaxprs(eqn) for e in j.eqns):
        return Kind.UNSAFE
    return kind
