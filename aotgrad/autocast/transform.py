"""The `autocast` context manager / decorator. As a decorator on a plain JAX function
(`autocast(...)(fn)`): trace it, rewrite the trace, bind the result on the caller's values. A trace-time transform, so it composes with `jax.jit`, `jax.grad`
(whose backward differentiates the rewritten forward: its dtypes follow the forward's
casts) and `jax.vmap`."""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable

import jax
import numpy as np
from jax.tree_util import tree_flatten, tree_unflatten

from aotgrad import jit_key
from aotgrad._jax_internals import Tracer
from aotgrad.autocast.context import (DEFAULT_DTYPES, OFF_MARKER, STATE, AutocastState, check_table_dtype,
                                      current_setting, parse_device_type, parse_dtype, parse_promotion)
from aotgrad.autocast.rewrite import Rewriter

__all__ = ["autocast", "autocast_transform"]

_SCALARS = (bool, int, float, complex, np.generic)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, Tracer, *_SCALARS))


def autocast_transform(fn: Callable, ctx: "autocast") -> Callable:
    def fresh() -> "autocast":  # one object per call: the decorated function may run on many threads
        return autocast(ctx._device_arg, ctx.dtype, ctx.enabled, promotion=ctx.promotion)

    if getattr(type(fn), "reads_autocast_when_traced", False):  # `api.AOTFunction`: it reads the context
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


# ----------------------------------------------------------------------------- the context

class autocast:
    """Per-op mixed precision: matmuls and convolutions in 16 bits, numerically sensitive
    ops in float32, mixed inputs promoted, following the policy table of `device_type`.

    As a context manager it applies to `aotgrad.compile`d functions traced inside it (the
    setting is part of their cache key). As a decorator on a plain JAX function it is a
    trace-time transform, usable under `jax.jit`, `jax.grad` and `jax.vmap`. Nesting:
    the inner context wins; leaving a context restores the outer state exactly. The
    state is per thread.

    Arguments:
        device_type: "cpu", "gpu" (aliases "cuda", "rocm") or "tpu": selects the policy
            table (it does not move data). None: the default backend.
        dtype: `jnp.float16` or `jnp.bfloat16`. None: the enclosing context's dtype for
            this device type, else the device default (gpu float16, cpu and tpu bfloat16).
        enabled: False turns casting off inside the context.
        promotion: how an op whose floating inputs disagree is typed. "jax": the function's
            float32 inputs (parameters, data), constants and values computed from them alone
            follow the 16-bit values they meet, as a Flax layer's `dtype=` casts its
            parameters (`x @ w + b` stays 16-bit, and so does a residual stream); float32
            made by the fp32 policy or by an explicit cast still wins. "torch": float32
            always wins, as in `torch.autocast`. None: the enclosing context's, else "jax".
    """

    def __init__(self, device_type: str | None = None, dtype: Any = None, enabled: bool = True, *,
                 promotion: str | None = None) -> None:
        if not isinstance(enabled, (bool, np.bool_)):
            raise TypeError(f"aotgrad.autocast: enabled must be True or False; got {enabled!r}.")
        self._device_arg = device_type
        self.dtype = parse_dtype(dtype)
        if device_type is not None:  # fail early on a bad name or combination
            check_table_dtype(parse_device_type(device_type), self.dtype or DEFAULT_DTYPES[parse_device_type(device_type)])
        self.enabled = bool(enabled)
        self.promotion = parse_promotion(promotion)
        self._stack: list[tuple[contextvars.Token, contextlib.ExitStack]] = []

    @property
    def device_type(self) -> str:
        return parse_device_type(self._device_arg)

    def __enter__(self) -> AutocastState:
        state = STATE.get().enter(self.device_type, self.dtype, self.enabled, self.promotion)
        token = STATE.set(state)
        scope = contextlib.ExitStack()
        scope.enter_context(jax.named_scope(state.setting.marker if state.setting else OFF_MARKER))
        self._stack.append((token, scope))
        jit_key.set_autocast(state)
        return state

    def __exit__(self, *exc: object) -> None:
        token, scope = self._stack.pop()
        scope.close()
        STATE.reset(token)
        jit_key.set_autocast(STATE.get())

    def __call__(self, fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"aotgrad.autocast(...) decorates a callable; got {type(fn).__name__} ({fn!r}).")
        return autocast_transform(fn, self)

    def __repr__(self) -> str:
        return (f"aotgrad.autocast(device_type={self._device_arg!r}, dtype={self.dtype}, "
                f"enabled={self.enabled}, promotion={self.promotion!r})")

