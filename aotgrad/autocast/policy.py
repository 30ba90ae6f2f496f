"""How precision is decided: one rule table per device type, keyed by primitive.

A rule is a policy name, or a function of the equation's params returning a policy name
(or None) when the choice depends on them (`integer_pow` with a negative exponent).

- `lower_precision_fp`: every eligible floating input is cast to the autocast dtype;
- `fp32`: every eligible floating input is cast to float32;
- `promote`: every eligible floating input is cast to the join of their types
  (bfloat16 with float16 gives float32). Primitives on no list are promoted too whenever
  their floating inputs disagree, so listing a primitive as `promote` only documents it.

Eligible: float16, bfloat16 and float32 values. float64, integers, booleans, complex
numbers and PRNG keys are never cast.

Every other primitive is declared dtype-neutral (`NEUTRAL`): it runs in its inputs' type
(promoted if they disagree) under every table. Each primitive a supported JAX version
exports is in a table or in `NEUTRAL`, never silently in neither (a test enforces it):
a new primitive is placed as PyTorch places the op it corresponds to (`log2` is fp32,
like `log`).

Beside the tables, one rule applies under every table: a summing reduction (`ACCUMULATING`)
whose input is still float16 or bfloat16 after its policy accumulates in float32 and
returns the 16-bit type (`accumulate_fp32`), as `jnp.sum` does.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Union

import jax.extend.core.primitives as P
from jax.extend.core import Primitive

from aotgrad._jax_internals import jax_primitives
from aotgrad._jax_internals import primitives as I
from aotgrad.autocast.context import parse_device_type

__all__ = ["ACCUMULATE_FP32", "ACCUMULATING", "FP32", "LOWER", "NEUTRAL", "POLICIES", "PROMOTE", "TABLES", "Rule",
           "policy_for", "register", "table"]

LOWER = "lower_precision_fp"
FP32 = "fp32"
PROMOTE = "promote"
POLICIES = (LOWER, FP32, PROMOTE)
ACCUMULATE_FP32 = "accumulate_fp32"  # casts around a 16-bit summing reduction; not a table policy

# Reductions whose accumulator carries the input's precision: a 16-bit one loses the
# low bits of every term once the partial sum is large. Max/min reductions are exact.
ACCUMULATING = frozenset({P.reduce_sum_p, P.reduce_prod_p, P.cumsum_p, P.cumprod_p, P.cumlogsumexp_p,
                          P.reduce_window_sum_p})

Rule = Union[str, Callable[[Mapping[str, Any]], Union[str, None]]]


def _reciprocal_pow(params: Mapping[str, Any]) -> str | None:
    """`integer_pow` with a negative exponent is a reciprocal: fp32."""
    return FP32 if params["y"] < 0 else None


# Mixed-input ops that PyTorch lists explicitly; every n-ary primitive is promoted anyway.
_PROMOTE = {p: PROMOTE for p in (P.concatenate_p, P.scatter_p, P.scatter_add_p, P.select_n_p, P.atan2_p)}
_MATMULS = {P.dot_general_p: LOWER, P.conv_general_dilated_p: LOWER,
            **{p: LOWER for p in jax_primitives().get("ragged_dot_general", ())}}

def _gpu_lists() -> dict[Primitive, Rule]:
    """PyTorch's CUDA lists; the tpu table starts from them too (XLA's lists are close)."""
    return {
        **_MATMULS,
        **{p: FP32 for p in (P.exp_p, P.expm1_p, P.log_p, P.log1p_p, I.log2_p, P.pow_p, P.rsqrt_p, P.acos_p,
                             P.asin_p, P.cosh_p, P.sinh_p, P.tan_p, P.erf_inv_p,
                             # fp32 accumulators: softmax, norms, losses, logsumexp are built from these
                             P.reduce_sum_p, P.reduce_prod_p, P.cumsum_p, P.cumprod_p)
           if p is not None},  # (log2_p: jax >= 0.11.2)
        P.integer_pow_p: _reciprocal_pow,
        **_PROMOTE,
    }


_CPU: dict[Primitive, Rule] = {
    **_MATMULS,
    **{p: FP32 for p in (P.fft_p, P.cholesky_p, P.qr_p, P.svd_p, P.eig_p, P.eigh_p, P.lu_p,
                         P.triangular_solve_p, P.householder_product_p, P.reduce_prod_p)},
    **_PROMOTE,
}

def _present(*prims: Any) -> frozenset:
    return frozenset(p for p in prims if p is not None)  # None: not in this JAX version


# Primitives no built-in table lists: they run in their inputs' type (promoted if mixed).
NEUTRAL = _present(
    # exact or type-preserving: arithmetic, comparisons, bit and integer ops, selects
    P.abs_p, P.add_p, P.add_jaxvals_p, P.sub_p, P.mul_p, P.div_p, P.rem_p, P.neg_p, P.sign_p, P.max_p,
    P.min_p, P.clamp_p, P.floor_p, P.ceil_p, P.round_p, P.nextafter_p, P.square_p, P.sqrt_p, P.cbrt_p,
    P.eq_p, P.ne_p, P.ge_p, P.gt_p, P.le_p, P.lt_p, P.eq_to_p, P.le_to_p, P.lt_to_p, P.is_finite_p,
    P.and_p, P.or_p, P.not_p, P.xor_p, P.shift_left_p, P.shift_right_arithmetic_p, P.shift_right_logical_p,
    P.clz_p, P.population_count_p, P.complex_p, P.conj_p, P.real_p, P.imag_p,
    # pointwise math PyTorch's lists leave in the input's type
    P.sin_p, P.cos_p, P.tanh_p, P.atan_p, P.asinh_p, P.acosh_p, P.atanh_p, P.exp2_p, P.logistic_p, P.erf_p,
    P.erfc_p, P.lgamma_p, P.digamma_p, P.polygamma_p, P.igamma_p, P.igammac_p, P.igamma_grad_a_p,
    P.bessel_i0e_p, P.bessel_i1e_p, P.zeta_p, P.regularized_incomplete_beta_p,
    I.one_minus_square_p, I.polynomial_p,
    # casts, shapes and data movement
    P.convert_element_type_p, P.bitcast_convert_type_p, P.reduce_precision_p, P.copy_p, P.broadcast_in_dim_p,
    P.reshape_p, P.squeeze_p, P.transpose_p, P.rev_p, P.pad_p, P.slice_p, P.dynamic_slice_p,
    P.dynamic_update_slice_p, P.gather_p, P.iota_p, P.empty2_p, I.split_p, P.select_and_gather_add_p,
    P.scatter_mul_p, P.scatter_min_p, P.scatter_max_p, P.sharding_constraint_p, P.device_put_p,
    P.stop_gradient_p, P.name_p, I.pvary_p,
    # exact reductions and orderings
    P.reduce_max_p, P.reduce_min_p, P.reduce_and_p, P.reduce_or_p, P.reduce_xor_p, P.argmax_p, P.argmin_p,
    P.cummax_p, P.cummin_p, P.cumlogsumexp_p, P.reduce_p, P.reduce_window_p, P.reduce_window_sum_p,
    P.reduce_window_max_p, P.reduce_window_min_p, P.select_and_scatter_p, P.select_and_scatter_add_p,
    P.sort_p, P.top_k_p, P.approx_top_k_p,
    # linear algebra no table lists (PyTorch has no autocast entry for them)
    P.hessenberg_p, P.schur_p, P.tridiagonal_p, P.tridiagonal_solve_p, I.geqrf_p, I.lu_pivots_to_permutation_p,
    # calls and control flow (their bodies are rewritten equation by equation)
    P.jit_p, P.call_p, P.closed_call_p, P.custom_jvp_call_p, P.custom_vjp_call_p, P.custom_lin_p, P.remat_p,
    P.scan_p, P.while_p, P.cond_p, P.linear_solve_p, I.shard_map_p,
    # collectives, callbacks, tokens, state and random bits: values pass through unchanged
    P.psum_p, P.pmax_p, P.pmin_p, P.all_gather_p, P.all_to_all_p, P.ragged_all_to_all_p, P.ppermute_p,
    P.axis_index_p, I.reduce_scatter_p, I.pbroadcast_p, I.psum_invariant_p, I.all_gather_invariant_p,
    I.ffi_call_p, I.pure_callback_p, I.io_callback_p, I.debug_callback_p, P.after_all_p, P.create_token_p,
    P.get_p, P.swap_p, P.random_bits_p, P.random_seed_p, P.random_split_p, P.random_fold_in_p,
    P.random_gamma_p, P.threefry2x32_p, P.rng_bit_generator_p, P.rng_uniform_p, I.random_wrap_p,
    I.random_unwrap_p,
)


# Primitives JAX does not export (`_jax_internals.jax_primitives`), by name: none changes its
# inputs' precision (kernels such as attention and fp8 matmuls take the types they are given),
# except `ragged_dot_general`, a grouped matmul (in `_MATMULS`).
_NEUTRAL_BY_NAME = frozenset((
    "zeros_like", "mulhi", "empty", "from_edtype", "to_edtype", "platform_index", "layout_constraint",
    "reshard", "relayout", "dim_as_value", "dimension_size", "stack", "unstack", "tile", "philox2x32",
    "philox4x32", "threefry4x32", "iota_2x32_shape", "random_clone", "scatter-sub", "scaled_dot",
    "scaled_matmul", "scaled_matmul_wrapper", "dot_product_attention_fwd", "dot_product_attention_bwd",
    "dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper", "dot_product_attention_fp8_fwd",
    "dot_product_attention_fp8_bwd", "dot_product_attention_fp8_fwd_wrapper",
    "dot_product_attention_fp8_bwd_wrapper", "cudnn_fusion", "cholesky_update", "geqp3", "ormqr",
    "symmetric_product", "linear_call", "custom_partitioning", "custom_vmap_call", "call_exported",
    "custom_jvp_call_jaxpr", "remat_opt", "call_hi_primitive", "call_hi_primitive_linearized",
    "optimization_barrier", "composite", "eval_jaxpr", "core_map", "accum_grad_in_ref", "addupdate",
    "broadcast_to", "create_linear", "empty_ref", "free_ref", "freeze", "new_ref", "pin", "unpin",
    "with_memory_space_constraint", "run_state", "box_get", "box_set", "new_box", "log_extend", "log_read",
    "new_log", "check", "debug_print", "inspect_sharding", "shape_assertion", "dce_sink", "stage", "tie",
    "unreachable", "all_gather_start", "all_gather_done", "all_gather_reduced", "all_gather_reduced_start",
    "all_to_all_start", "all_to_all_done", "ppermute_start", "ppermute_done", "psum_start", "psum_done",
    "psum_invariant_start", "reduce_scatter_start", "reduce_scatter_done", "pbroadcast_start",
    "pbroadcast_done", "pbroadcast_dynamic", "psend", "precv", "preduced", "unreduced_psum",
    "unreduced_psum_start", "unreduced_pmax", "unreduced_pmin", "unreduced_reduce_scatter",
    "unreduced_reduce_scatter_start", "reduced_vary_cast", "reduced_vary_cast_p", "vary_unreduced_cast",
    "vary_unreduced_cast_p",
))
NEUTRAL = NEUTRAL | frozenset(p for name, found in jax_primitives().items() if name in _NEUTRAL_BY_NAME
                              for p in found)


# The tables, public and extensible: see `register`. Each device type has its own table:
# tpu starts from the gpu lists but does not follow later changes to gpu's (register a
# policy for each device type it should apply to).
TABLES: dict[str, dict[Primitive, Rule]] = {"gpu": _gpu_lists(), "cpu": _CPU, "tpu": _gpu_lists()}


def table(device_type: str) -> Mapping[Primitive, Rule]:
    """The rule table of a device type (read-only view; change it with `register`)."""
    from types import MappingProxyType
    return MappingProxyType(TABLES[parse_device_type(device_type, "aotgrad.autocast_policy_table", allow_none=False)])


def register(device_type: str, primitive: Any, policy: Rule | None) -> None:
    """Sets the autocast policy of `primitive` for `device_type`, and for it alone: the tpu
    table starts from the gpu lists but does not follow later changes to them.

    Arguments:
        device_type: "cpu", "gpu" (aliases "cuda", "rocm") or "tpu".
        primitive: a JAX primitive, e.g. `jax.extend.core.primitives.tanh_p`.
        policy: "lower_precision_fp", "fp32", "promote", a function of the equation's params
            returning one of those (or None), or None to remove the primitive's entry.
    """
    who = "aotgrad.register_autocast_policy"
    name = parse_device_type(device_type, who, allow_none=False)
    if not (hasattr(primitive, "bind") and hasattr(primitive, "name")):
        raise TypeError(f"{who}: primitive must be a JAX primitive (e.g. jax.extend.core.primitives.exp_p); "
                        f"got {type(primitive).__name__} ({primitive!r}).")
    if policy is None:
        TABLES[name].pop(primitive, None)
        return
    if not (policy in POLICIES or callable(policy)):
        raise ValueError(f"{who}: policy must be one of {list(POLICIES)}, a function of the equation's "
                         f"params, or None; got {policy!r}.")
    TABLES[name][primitive] = policy


def policy_for(device_type: str, primitive: Primitive, params: Mapping[str, Any]) -> str | None:
    """The policy of one equation under `device_type`'s table (None: no entry)."""
    rule = TABLES[device_type].get(primitive)
    return rule(params) if callable(rule) else rule
