"""Which autocast setting is in force: the `autocast` context manager / decorator, its
per-thread state, and the name-scope markers that record it on traced equations.

The state lives in a `contextvars.ContextVar`, so each thread (and each asyncio task)
has its own. While a context is entered it also enters a `jax.named_scope` marker; every
equation traced inside carries the marker in its name stack, and JAX keeps name stacks
through differentiation, so a backward equation can tell which setting its forward
equation ran under (see `setting_of`).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from aotgrad import jit_key
from aotgrad._jax_internals import name_scopes

__all__ = ["DEFAULT_DTYPES", "DEVICE_TYPES", "DTYPES", "AutocastState", "Setting", "autocast",
           "current_setting", "current_state", "parse_device_type", "parse_dtype", "setting_from_kwargs",
           "setting_of"]

DEVICE_TYPES = ("cpu", "gpu", "tpu")
DEVICE_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
DTYPES = ("float16", "bfloat16")
DEFAULT_DTYPES = {"cpu": "bfloat16", "gpu": "float16", "tpu": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class Setting:
    """What casting is in force: the policy table of `device_type`, lowering to `dtype`."""
    device_type: str
    dtype: str  # "float16" or "bfloat16"

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(getattr(jax.numpy, self.dtype))

    @property
    def marker(self) -> str:
        return f"autocast[{self.device_type},{self.dtype}]"

    def __str__(self) -> str:
        return f"autocast({self.device_type!r}, dtype={self.dtype})"


OFF_MARKER = "autocast[off]"
# Every marker a name stack can carry, and the setting it stands for (None: disabled).
_MARKERS: dict[str, Setting | None] = {OFF_MARKER: None}
_MARKERS.update({Setting(d, t).marker: Setting(d, t) for d in DEVICE_TYPES for t in DTYPES})


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """The thread's autocast state: the innermost context, and the dtype last chosen for
    each device type (what `dtype=None` inherits)."""
    setting: Setting | None = None  # None: no casting
    dtypes: tuple[tuple[str, str], ...] = ()  # (device_type, dtype) chosen by enclosing contexts

    def dtype_for(self, device_type: str) -> str:
        return dict(self.dtypes).get(device_type, DEFAULT_DTYPES[device_type])

    def enter(self, device_type: str, dtype: str | None, enabled: bool) -> "AutocastState":
        """The state inside a context `autocast(device_type, dtype, enabled)`."""
        chosen = dtype or self.dtype_for(device_type)
        dtypes = tuple(sorted({**dict(self.dtypes), device_type: chosen}.items()))
        return AutocastState(Setting(device_type, chosen) if enabled else None, dtypes)


_STATE: contextvars.ContextVar[AutocastState] = contextvars.ContextVar("aotgrad_autocast",
                                                                       default=AutocastState())
jit_key.set_autocast_default(AutocastState())  # an enclosing jax.jit is keyed on the state


def current_state() -> AutocastState:
    return _STATE.get()


def current_setting() -> Setting | None:
    """The casting in force on this thread (None: autocast is off)."""
    return _STATE.get().setting


def setting_of(eqn: Any, default: Setting | None) -> Setting | None:
    """The setting an equation was traced under: the innermost autocast marker in its name
    stack, else `default` (the setting of the enclosing trace)."""
    for scope in reversed(name_scopes(eqn)):
        if scope in _MARKERS:
            return _MARKERS[scope]
    return default


# ----------------------------------------------------------------------------- validation

def parse_device_type(device_type: Any, who: str = "aotgrad.autocast", allow_none: bool = True) -> str:
    """The one check of an autocast device type (the context, `config.backward_pass_autocast`
    and the policy tables all use it): `None` -> the default backend (where `allow_none`);
    an alias ("cuda", "rocm") -> "gpu"; anything else must be a device type."""
    if device_type is None and allow_none:
        backend = jax.default_backend()
        return DEVICE_ALIASES.get(backend, backend if backend in DEVICE_TYPES else "cpu")
    if isinstance(device_type, str):
        name = DEVICE_ALIASES.get(device_type, device_type)
        if name in DEVICE_TYPES:
            return name
    aliases = " or ".join(repr(a) for a in DEVICE_ALIASES)
    default = ", or None for the default backend" if allow_none else ""
    raise ValueError(f"{who}: device_type must be one of {list(DEVICE_TYPES)} ({aliases}: aliases of "
                     f"'gpu'){default}; got {device_type!r}.")


def parse_dtype(dtype: Any, who: str = "aotgrad.autocast") -> str | None:
    """The one check of an autocast dtype: `None`, or the name of float16 / bfloat16
    (accepts dtypes, scalar types and names)."""
    if dtype is None:
        return None
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name in DTYPES:
        return name
    raise ValueError(f"{who}: dtype must be jnp.float16 or jnp.bfloat16 (or None to inherit the enclosing "
                     f"context's dtype for the device, else the device default); got {dtype!r}.")


def setting_from_kwargs(contexts: tuple[tuple[tuple[str, Any], ...], ...]) -> Setting | None:
    """The setting inside nested contexts given as keyword arguments (as in
    `config.backward_pass_autocast`), entered in order from a fresh state."""
    state = AutocastState()
    for kwargs in contexts:
        kw = dict(kwargs)
        state = state.enter(parse_device_type(kw.get("device_type")), parse_dtype(kw.get("dtype")),
                            bool(kw.get("enabled", True)))
    return state.setting


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
    """

    def __init__(self, device_type: str | None = None, dtype: Any = None, enabled: bool = True) -> None:
        if not isinstance(enabled, (bool, np.bool_)):
            raise TypeError(f"aotgrad.autocast: enabled must be True or False; got {enabled!r}.")
        self._device_arg = device_type
        if device_type is not None:
            parse_device_type(device_type)  # fail early on a bad name
        self.dtype = parse_dtype(dtype)
        self.enabled = bool(enabled)
        self._stack: list[tuple[contextvars.Token, contextlib.ExitStack]] = []

    @property
    def device_type(self) -> str:
        return parse_device_type(self._device_arg)

    def __enter__(self) -> AutocastState:
        state = _STATE.get().enter(self.device_type, self.dtype, self.enabled)
        token = _STATE.set(state)
        scope = contextlib.ExitStack()
        scope.enter_context(jax.named_scope(state.setting.marker if state.setting else OFF_MARKER))
        self._stack.append((token, scope))
        jit_key.set_autocast(state)
        return state

    def __exit__(self, *exc: object) -> None:
        token, scope = self._stack.pop()
        scope.close()
        _STATE.reset(token)
        jit_key.set_autocast(_STATE.get())

    def __call__(self, fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"aotgrad.autocast(...) decorates a callable; got {type(fn).__name__} ({fn!r}).")
        from aotgrad.autocast.transform import autocast_transform  # the transform needs the rewrite
        return autocast_transform(fn, self)

    def __repr__(self) -> str:
        return (f"aotgrad.autocast(device_type={self._device_arg!r}, dtype={self.dtype}, "
                f"enabled={self.enabled})")

