"""The cost model: bytes moved between memory and compute, and FLOPs for compute-bound work.

- Saving a value costs a read in the backward, plus a write in the forward unless the
  value is written to memory anyway (the output of a matmul, a reduction, a forward
  output, or the operand of a matmul).
- Recomputing an equation costs, per rule kind (see `rules.py`): a small compute charge
  per output byte for fusible ops, about one output write for data movement, a re-read
  of the inputs for reductions, hashing for random bits, and FLOPs for compute-bound
  work (only when a memory budget allows it).
- Where the device runs a reduction over the last axis in one kernel with its
  elementwise neighbours (`DeviceProfile.row_reductions_fuse`: XLA:GPU), recomputing one
  costs compute like a fusible op, not a re-read of its input; and saving a value inside
  such a kernel (its max or sum) costs a read of its row (`min_cut._row_reads`).
- A transcendental function's recomputation costs the device's time for it where its
  profile knows it (`DeviceProfile.transcendentals`: a GPU's special-function units).
Inputs are free: the caller holds them anyway. A derived copy of an input (a cast or
transpose of a weight) is a real cost and is normally recomputed instead.
"""
from __future__ import annotations

import math
from typing import Any

import jax.extend.core.primitives as P
import numpy as np
from jax.extend.core import Primitive

from aotgrad._jax_internals import primitives as I
from aotgrad.devices import DeviceProfile
from aotgrad.partition.rules import Kind, sub_jaxprs

__all__ = ["FLOPS_PER_BYTE", "flops", "nbytes", "over_last_axis", "recompute_cost", "save_cost"]

CHEAP_PER_BYTE = 1 / 16  # a fused elementwise op: a little compute, no extra traffic
# Transcendental functions cost tens of instructions per element: recomputing one costs
# about as much time as moving its output once more on a CPU. A device that says how fast
# it computes them (`DeviceProfile.transcendentals`: a GPU's special-function units) is
# charged that time instead.
TRANSCENDENTAL_PER_BYTE = 1.0
TRANSCENDENTAL: frozenset[Primitive] = frozenset({
    P.exp_p, P.exp2_p, P.expm1_p, P.log_p, P.log1p_p, P.tanh_p, P.logistic_p, P.erf_p, P.erfc_p, P.erf_inv_p,
    P.sin_p, P.cos_p, P.tan_p, P.asin_p, P.acos_p, P.atan_p, P.atan2_p, P.sinh_p, P.cosh_p, P.asinh_p,
    P.acosh_p, P.atanh_p, P.pow_p, P.lgamma_p, P.digamma_p,
    # jnp.log2 is one primitive since jax 0.11 (before: log and a division)
    *(p for p in (I.log2_p,) if p is not None)})
MOVE_PER_BYTE = 0.5  # a copy into a new layout, often fused into its consumer
RANDOM_PER_BYTE = 4.0  # counter-based hashing: tens of integer ops per 32-bit word
FLOPS_PER_BYTE = 16.0  # machine balance: FLOPs that cost as much time as moving one byte
WHILE_TRIPS = 100  # assumed trip count of a while loop, whose count is unknown


def nbytes(aval: Any) -> int:
    if not hasattr(aval, "shape"):
        return 0
    return math.prod(aval.shape) * _itemsize(aval.dtype)


def _itemsize(dtype: Any) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys)
        return int(getattr(dtype, "itemsize", 8))


def save_cost(aval: Any, written_anyway: bool) -> float:
    """Bytes moved to save a value: a backward read, and a forward write unless the
    value is written to memory anyway."""
    b = nbytes(aval)
    return float(b if written_anyway else 2 * b)


def recompute_cost(eqn: Any, kind: Kind, device: DeviceProfile | None = None) -> float:
    """Byte-equivalent cost of running `eqn` again in the backward on `device` (None: not
    known); inf if it must not be."""
    out = sum(nbytes(v.aval) for v in eqn.outvars)
    if kind is Kind.CHEAP:
        per_byte = _transcendental_cost(eqn, device) if eqn.primitive in TRANSCENDENTAL else CHEAP_PER_BYTE
        return per_byte * out
    if kind is Kind.MOVE:
        return MOVE_PER_BYTE * out
    if kind is Kind.REDUCE:
        read = float(sum(nbytes(v.aval) for v in eqn.invars))
        fused = device is not None and device.row_reductions_fuse and over_last_axis(eqn)
        return CHEAP_PER_BYTE * read if fused else read
    if kind is Kind.RANDOM:
        return RANDOM_PER_BYTE * out
    if kind is Kind.COSTLY:
        return flops(eqn) / FLOPS_PER_BYTE + out
    return math.inf


def _transcendental_cost(eqn: Any, device: DeviceProfile | None) -> float:
    """Per output byte: the device's time for one result, where it is known."""
    known = device.transcendental_cost(_itemsize(eqn.outvars[0].aval.dtype)) if device is not None else None
    return TRANSCENDENTAL_PER_BYTE if known is None else max(CHEAP_PER_BYTE, known)


def over_last_axis(eqn: Any) -> bool:
    """A reduction over its operand's last axis only (a softmax's, a layer norm's)."""
    axes = eqn.params.get("axes")
    rank = len(getattr(eqn.invars[0].aval, "shape", ()))
    return axes is not None and rank > 0 and tuple(axes) == (rank - 1,)


def flops(eqn: Any) -> float:
    """Estimated floating-point operations of one equation."""
    prim = eqn.primitive
    out_elems = sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
    if prim is P.dot_general_p:
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs_shape = eqn.invars[0].aval.shape
        return 2.0 * out_elems * math.prod(lhs_shape[d] for d in contract)
    if prim is P.conv_general_dilated_p:
        rhs = eqn.invars[1].aval.shape
        spec = eqn.params["dimension_numbers"].rhs_spec  # (out feature, in feature, spatial...)
        window = math.prod(rhs[d] for d in spec[2:])
        return 2.0 * out_elems * window * rhs[spec[1]]
    if prim in (P.sort_p, P.top_k_p):
        n = max(eqn.invars[0].aval.shape[-1:] or (1,))
        return out_elems * max(1.0, math.log2(max(n, 2)))
    bodies = sub_jaxprs(eqn)
    if bodies:
        body = max(sum(flops(e) for e in j.eqns) for j in bodies)  # cond: the costlier branch
        if prim is P.scan_p:
            return body * eqn.params["length"]
        if prim is P.while_p:
            return body * WHILE_TRIPS
        return body
    return float(out_elems)
