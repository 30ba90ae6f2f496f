"""Saving, in a checkpointed scan body, the result of an operation whose derivative reads
its own result (`tanh`, `exp`, `logistic`, ...).

JAX differentiates `tanh(x)` by a rule that reads tanh's result. A checkpoint policy saves
only named values (`checkpoint_name`, applied to that result), and the rule reads the
unnamed result, so JAX ran the operation again in the backward, and all it needs: an RNN
cell whose cut saved its tanh output had both its matmuls run again (1.29x the fused
step's FLOPs at budget 1 on an H100). Bound here as a `custom_jvp` whose derivative reads
the named result, the saved value is the one the backward reads.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.extend.core.primitives as P
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import JaxprEqn, Primitive

from aotgrad._jax_internals import bind_eqn

__all__ = ["DERIVATIVES", "bind_named"]

# (input, its named result, input tangent) -> result tangent: JAX's own rules, reading the
# result given.
DERIVATIVES: dict[Primitive, Callable[[Any, Any, Any], Any]] = {
    P.exp_p: lambda x, y, t: t * y,
    P.tanh_p: lambda x, y, t: t * (1 - y * y),
    P.logistic_p: lambda x, y, t: t * (y * (1 - y)),
    P.sqrt_p: lambda x, y, t: t * (0.5 / y),
    P.rsqrt_p: lambda x, y, t: t * (-0.5 * y / x),
    P.tan_p: lambda x, y, t: t * (1 + y * y),
}


def bind_named(eqn: JaxprEqn, x: Any, name: str) -> Any:
    """`eqn` (one of `DERIVATIVES`) applied to `x`, its result named `name`, differentiated
    from the named result."""
    derivative = DERIVATIVES[eqn.primitive]

    def named(x: Any) -> Any:
        return checkpoint_name(bind_eqn(eqn, [x])[0], name)

    @jax.custom_jvp
    def f(x: Any) -> Any:
        return named(x)

    @f.defjvp
    def f_jvp(primals: tuple, tangents: tuple) -> tuple:
        (x,), (t,) = primals, tangents
        y = named(x)  # not f(x): a policy sees a name only outside the custom_jvp call
        return y, derivative(x, y, t)
    return f(x)
