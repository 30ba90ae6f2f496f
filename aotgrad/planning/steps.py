"""The training step `plan` compiles, from the user's loss and arguments.

The loss is `fn(params, *batch, **kwargs)`. The step differentiates it with respect to the
floating-point array leaves of `params` (integer leaves, such as a step count or a random
key, are passed along undifferentiated; a Flax NNX module's `nnx.Param` state is
differentiated, its other state passed along), and is

- without an optimizer: `jax.jit(jax.value_and_grad(loss))`;
- with an optax `GradientTransformation`: the same, then `optimizer.update` and
  `optax.apply_updates`, returning the loss, the new parameters and the new optimizer
  state, jitted with the parameters and the optimizer state donated (as a training loop
  that replaces them does), so its peak is the whole training step's.

`loss` is `fn` itself (the fused step) or `aotgrad.compile` of it (under a budget).
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from aotgrad.planning.place import Placed, is_array

__all__ = ["Step", "is_nnx_module", "join", "optimizer_specs", "split_inexact"]


def is_nnx_module(x: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")  # no import: a model of this kind has loaded it already
    return nnx is not None and isinstance(x, nnx.Module)


def _inexact(x: Any) -> bool:
    return x is not None and jnp.issubdtype(x.dtype, jnp.inexact)


def split_inexact(tree: Any) -> tuple[Any, Any]:
    """(floating leaves, other leaves) of `tree`, each with None at the other's places."""
    return (jax.tree.map(lambda x: x if _inexact(x) else None, tree),
            jax.tree.map(lambda x: None if _inexact(x) else x, tree))


def join(diff: Any, other: Any) -> Any:
    """The inverse of `split_inexact`."""
    return jax.tree.map(lambda a, b: b if a is None else a, diff, other, is_leaf=lambda x: x is None)


class Step:
    """How a user's loss and arguments become the step's function and its arguments."""

    def __init__(self, fn: Callable[..., Any], params: Placed, rest: Sequence[Placed], kwargs: Placed,
                 unwrap: Callable[[Any], Any] | None = None, optimizer: Any = None,
                 opt_state: Placed | None = None) -> None:
        self.fn, self.params, self.rest, self.kwargs = fn, params, rest, kwargs
        self.unwrap = unwrap or (lambda p: p)  # NNX: the module from its split state
        self.optimizer, self.opt_state = optimizer, opt_state
        if unwrap is None:
            self.diff, self.other = split_inexact(params.dynamic)
        else:  # (Param state, other state): only the Params are differentiated
            diff, other = split_inexact(params.dynamic[0])
            self.diff, self.other = (diff, None), (other, params.dynamic[1])

    def loss(self, diff: Any, other: Any, rest: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        first = self.unwrap(self.params.merge(join(diff, other)))
        args = [p.merge(a) for p, a in zip(self.rest, rest, strict=True)]
        return self.fn(first, *args, **self.kwargs.merge(kwargs))

    def arguments(self) -> tuple[Any, ...]:
        rest = tuple(p.dynamic for p in self.rest)
        if self.optimizer is None:
            return self.diff, self.other, rest, self.kwargs.dynamic
        return self.diff, self.other, self.opt_state.dynamic, rest, self.kwargs.dynamic

    def jitted(self, loss: Callable[..., Any]) -> Any:
        """`jax.jit` of the step around `loss` (the user's loss or aotgrad's compiled one)."""
        grad = jax.value_and_grad(loss)
        if self.optimizer is None:
            return jax.jit(grad)
        import optax
        optimizer = self.optimizer

        def train_step(diff: Any, other: Any, opt_state: Any, rest: Any, kwargs: Any) -> Any:
            value, grads = grad(diff, other, rest, kwargs)
            updates, opt_state = optimizer.update(grads, opt_state, diff)
            return value, optax.apply_updates(diff, updates), opt_state
        return jax.jit(train_step, donate_argnums=(0, 2))


def optimizer_specs(opt_state: Any, diff: Any) -> Any:
    """The optimizer state's PartitionSpecs: a part shaped as the parameters (Adam's moments)
    split as they are, everything else (counts) replicated."""
    structure, shapes = jax.tree.structure(diff), [a.shape for a in jax.tree.leaves(diff)]

    def like_params(x: Any) -> bool:
        return jax.tree.structure(x) == structure and [getattr(a, "shape", None) for a in jax.tree.leaves(x)] == shapes
    specs = jax.tree.map(lambda x: x.sharding.spec, diff)
    return jax.tree.map(lambda x: specs if like_params(x) else (PartitionSpec() if is_array(x) else None),
                        opt_state, is_leaf=like_params)
