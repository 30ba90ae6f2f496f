"""Dynamic loss scaling for float16 training (bfloat16 does not need it).

float16 gradients underflow to zero below ~6e-8; multiplying the loss by a large scale
before differentiating keeps them representable. The scale starts high, halves when a
gradient is not finite (the step is skipped), and doubles after `period` finite steps.

    scale = aotgrad.DynamicLossScale()
    grads = jax.grad(lambda p: scale.scale(loss_fn(p, batch)))(params)
    grads = scale.unscale(grads)
    finite = aotgrad.all_finite(grads)
    scale = scale.adjust(finite)
    params = aotgrad.select_tree(finite, new_params, params)   # skip non-finite steps
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DynamicLossScale", "all_finite", "select_tree"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """A loss scale that adapts to the gradients: a pytree (its arrays are `loss_scale` and
    `counter`), so it can be carried through `jax.jit` and `lax.scan`.

    Arguments:
        loss_scale: the current scale (default 2**15).
        counter: finite steps since the scale last changed.
        period: finite steps after which the scale grows by `factor`.
        factor: how much the scale grows after `period` finite steps, and shrinks on a
            non-finite one.
        min_loss_scale: the scale never goes below this.
    """
    loss_scale: Any = dataclasses.field(default_factory=lambda: jnp.asarray(2.0 ** 15, jnp.float32))
    counter: Any = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))
    period: int = dataclasses.field(default=2000, metadata=dict(static=True))
    factor: float = dataclasses.field(default=2.0, metadata=dict(static=True))
    min_loss_scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))

    def __post_init__(self) -> None:
        if isinstance(self.period, bool) or not isinstance(self.period, (int, np.integer)) or self.period < 1:
            raise ValueError(f"DynamicLossScale: period must be an integer >= 1; got {self.period!r}.")
        if not isinstance(self.factor, (int, float)) or self.factor <= 1:
            raise ValueError(f"DynamicLossScale: factor must be a number > 1; got {self.factor!r}.")
        if not isinstance(self.min_loss_scale, (int, float)) or self.min_loss_scale <= 0:
            raise ValueError(f"DynamicLossScale: min_loss_scale must be a number > 0; "
                             f"got {self.min_loss_scale!r}.")

    def scale(self, tree: Any) -> Any:
        """`tree * loss_scale` (apply to the loss before differentiating)."""
        return jax.tree.map(lambda x: x * self.loss_scale.astype(jnp.result_type(x)), tree)

    def unscale(self, tree: Any) -> Any:
        """`tree / loss_scale`, computed in float32, returned in each leaf's dtype."""
        inv = 1.0 / self.loss_scale

        def one(x: Any) -> Any:
            x = jnp.asarray(x)
            return (x.astype(jnp.promote_types(x.dtype, jnp.float32)) * inv).astype(x.dtype)
        return jax.tree.map(one, tree)

    def adjust(self, grads_finite: Any) -> "DynamicLossScale":
        """The next scale: shrunk (and its counter reset) when `grads_finite` is False,
        grown after `period` consecutive finite steps, else unchanged."""
        grow = self.counter + 1 >= self.period
        scale = jnp.where(grads_finite,
                          jnp.where(grow, self.loss_scale * self.factor, self.loss_scale),
                          jnp.maximum(self.loss_scale / self.factor, self.min_loss_scale))
        # A scale past float32's range would turn every gradient into inf.
        scale = jnp.where(jnp.isfinite(scale), scale, self.loss_scale).astype(self.loss_scale.dtype)
        counter = jnp.where(grads_finite & ~grow, self.counter + 1, 0).astype(self.counter.dtype)
        return dataclasses.replace(self, loss_scale=scale, counter=counter)


def all_finite(tree: Any) -> jax.Array:
    """True when every element of every leaf is finite (a scalar boolean array)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


def select_tree(pred: Any, on_true: Any, on_false: Any) -> Any:
    """`on_true` where `pred`, else `on_false`, leaf by leaf (e.g. skip a non-finite step)."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
