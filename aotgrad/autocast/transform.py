"""`autocast(...)(fn)` on a plain JAX function: trace it, rewrite the trace, bind the result
on the caller's values. A trace-time transform, so it composes with `jax.jit`, `jax.grad`
(whose backward differentiates the rewritten forward: its dtypes follow the forward's
casts) and `jax.vmap`."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

import jax
import numpy as np
from jax.tree_util import tree_flatten, tree_unflatten

from aotgrad._jax_internals import Tracer
from aotgrad.autocast.context import current_setting
from aotgrad.autocast.rewrite import Rewriter

if TYPE_CHECKING:
    from aotgrad.autocast.context import autocast

__all__ = ["autocast_transform"]

_SCALARS = (bool, int, float, complex, np.generic)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, Tracer, *_SCALARS))


def autocast_transform(fn: Callable, ctx: "autocast") -> Callable:
    from aotgrad.api import AOTFunction  # a compiled function reads the context when traced
    from aotgrad.autocast.context import autocast as autocast_cls

    def fresh() -> "autocast":  # one object per call: the decorated function may run on many threads
        return autocast_cls(ctx._device_arg, ctx.dtype, ctx.enabled)

    if isinstance(fn, AOTFunction):
        @functools.wraps(fn)
        def compiled(*args: Any, **kwargs: Any) -> Any:
            with fresh():
                return fn(*args, **kwargs)
        return compiled

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        leaves, tree = tree_flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]
        out_tree = []

        def flat(*dyn: Any) -> list:
            full = list(leaves)
            for i, x in zip(dynamic, dyn, strict=True):
                full[i] = x
            a, k = tree_unflatten(tree, full)
            out, t = tree_flatten(fn(*a, **k))
            out_tree.append(t)
            return out

        with fresh():
            setting = current_setting()
            closed = jax.make_jaxpr(flat)(*[leaves[i] for i in dynamic])
            outs = Rewriter().eval_closed(closed, [leaves[i] for i in dynamic], setting)
        return tree_unflatten(out_tree[0], outs)

    return wrapper
