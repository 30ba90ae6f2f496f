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

Beside the tables, one rule applies under every table: a summing reduction (`ACCUMULATING`)
whose input is still float16 or bfloat16 after its policy accumulates in float32 and
returns the 16-bit type (`accumulate_fp32`), as `jnp.sum` does.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Union

import jax.extend.core.primitives as P

from aotgrad.autocast.context import parse_device_type

__all__ = ["ACCUMULATE_FP32", "ACCUMULATING", "FP32", "LOWER", "POLICIES", "PROMOTE", "TABLES", "Rule",
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
_MATMULS = {P.dot_general_p: LOWER, P.conv_general_dilated_p: LOWER}

def _gpu_lists() -> dict[Any, Rule]:
    """PyTorch's CUDA lists; the tpu table starts from them too (XLA's lists are close)."""
    return {
        **_MATMULS,
        **{p: FP32 for p in (P.exp_p, P.expm1_p, P.log_p, P.log1p_p, P.pow_p, P.rsqrt_p, P.acos_p, P.asin_p,
                             P.cosh_p, P.sinh_p, P.tan_p, P.erf_inv_p,
                             # fp32 accumulators: softmax, norms, losses, logsumexp are built from these
                             P.reduce_sum_p, P.reduce_prod_p, P.cumsum_p, P.cumprod_p)},
        P.integer_pow_p: _reciprocal_pow,
        **_PROMOTE,
    }


_CPU: dict[Any, Rule] = {
    **_MATMULS,
    **{p: FP32 for p in (P.fft_p, P.cholesky_p, P.qr_p, P.svd_p, P.eig_p, P.eigh_p, P.lu_p,
                         P.triangular_solve_p, P.householder_product_p, P.reduce_prod_p)},
    **_PROMOTE,
}

# The tables, public and extensible: see `register`. Each device type has its own table:
# tpu starts from the gpu lists but does not follow later changes to gpu's (register a
# policy for each device type it should apply to).
TABLES: dict[str, dict[Any, Rule]] = {"gpu": _gpu_lists(), "cpu": _CPU, "tpu": _gpu_lists()}


def table(device_type: str) -> Mapping[Any, Rule]:
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


def policy_for(device_type: str, primitive: Any, params: Mapping[str, Any]) -> str | None:
    """The policy of one equation under `device_type`'s table (None: no entry)."""
    rule = TABLES[device_type].get(primitive)
    return rule(params) if callable(rule) else rule
