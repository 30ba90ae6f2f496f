"""Which autocast setting is in force: the per-thread state the `autocast` context manager
(`autocast.transform`) enters, and the name-scope markers that record it on traced
equations.

The state lives in a `contextvars.ContextVar`, so each thread (and each asyncio task)
has its own. While a context is entered it also enters a `jax.named_scope` marker; every
equation traced inside carries the marker in its name stack, and JAX keeps name stacks
through differentiation, so a backward equation can tell which setting its forward
equation ran under (see `setting_of`).
"""
from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from aotgrad import jit_key
from aotgrad._jax_internals import name_scopes

__all__ = ["DEFAULT_DTYPES", "DEVICE_TYPES", "DTYPES", "MARKERS", "PROMOTIONS", "STATE", "AutocastArgs", "AutocastState",
           "Setting", "check_table_dtype", "current_setting", "current_state", "parse_device_type", "parse_dtype", "parse_promotion",
           "setting_inside", "setting_of"]

DEVICE_TYPES = ("cpu", "gpu", "tpu")
DEVICE_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
DTYPES = ("float16", "bfloat16")
DEFAULT_DTYPES = {"cpu": "bfloat16", "gpu": "float16", "tpu": "bfloat16"}
# How an op whose floating inputs disagree is promoted (docs/autocast.md, "Promotion"):
# "jax": float32 inputs of the function, constants and what is computed from them alone follow
# the 16-bit values they meet (as a Flax layer's `dtype=` casts its parameters); float32 made
# by the fp32 policy, or by an explicit cast up, still wins. "torch": float32 always wins.
PROMOTIONS = ("jax", "torch")


@dataclasses.dataclass(frozen=True)
class Setting:
    """What casting is in force: the policy table of `device_type`, lowering to `dtype`."""
    device_type: str
    dtype: str  # "float16" or "bfloat16"
    promotion: str = "jax"  # one of PROMOTIONS

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(getattr(jax.numpy, self.dtype))

    @property
    def marker(self) -> str:
        suffix = "" if self.promotion == "jax" else f",{self.promotion}"
        return f"autocast[{self.device_type},{self.dtype}{suffix}]"

    def __str__(self) -> str:
        suffix = "" if self.promotion == "jax" else f", promotion={self.promotion!r}"
        return f"autocast({self.device_type!r}, dtype={self.dtype}{suffix})"


OFF_MARKER = "autocast[off]"
# Every marker a name stack can carry, and the setting it stands for (None: disabled).
MARKERS: dict[str, Setting | None] = {OFF_MARKER: None}
MARKERS.update({Setting(d, t, p).marker: Setting(d, t, p) for d in DEVICE_TYPES for t in DTYPES for p in PROMOTIONS})


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """The thread's autocast state: the innermost context, and the dtype last chosen for
    each device type (what `dtype=None` inherits)."""
    setting: Setting | None = None  # None: no casting
    dtypes: tuple[tuple[str, str], ...] = ()  # (device_type, dtype) chosen by enclosing contexts
    promotion: str = "jax"  # chosen by the innermost context that named one

    def dtype_for(self, device_type: str) -> str:
        return dict(self.dtypes).get(device_type, DEFAULT_DTYPES[device_type])

    def enter(self, device_type: str, dtype: str | None, enabled: bool,
              promotion: str | None = None) -> "AutocastState":
        """The state inside a context `autocast(device_type, dtype, enabled, promotion)`;
        `dtype` and `promotion` None inherit the enclosing contexts'."""
        chosen = dtype or self.dtype_for(device_type)
        check_table_dtype(device_type, chosen)
        dtypes = tuple(sorted({**dict(self.dtypes), device_type: chosen}.items()))
        promotion = promotion or self.promotion
        return AutocastState(Setting(device_type, chosen, promotion) if enabled else None, dtypes, promotion)


# The thread's state; only the `autocast` context (`autocast.transform`) sets it.
STATE: contextvars.ContextVar[AutocastState] = contextvars.ContextVar("aotgrad_autocast", default=AutocastState())
jit_key.set_autocast_default(AutocastState())  # an enclosing jax.jit is keyed on the state


def current_state() -> AutocastState:
    return STATE.get()


def current_setting() -> Setting | None:
    """The casting in force on this thread (None: autocast is off)."""
    return STATE.get().setting


def setting_of(eqn: Any, default: Setting | None) -> Setting | None:
    """The setting an equation was traced under: the innermost autocast marker in its name
    stack, else `default` (the setting of the enclosing trace)."""
    for scope in reversed(name_scopes(eqn)):
        if scope in MARKERS:
            return MARKERS[scope]
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


def check_table_dtype(device_type: str, dtype: str, who: str = "aotgrad.autocast") -> None:
    """float16 is refused under the cpu table: it leaves exp, log, softmax, norms and sums in
    their input's type (PyTorch's cpu lists), which bfloat16's range survives and float16's
    (largest value 65504, exp(11.1)) does not. The gpu table keeps them in float32; a table
    only decides the casts, so it serves float16 programs on any device."""
    if device_type == "cpu" and dtype == "float16":
        raise ValueError(f"{who}: float16 is not supported under the cpu table: it keeps exp, log, softmax and "
                         f"sums in their input's type, where float16 overflows; use dtype=jnp.bfloat16, or "
                         f"device_type='gpu' (its table keeps them in float32, on any device).")


def parse_promotion(promotion: Any, who: str = "aotgrad.autocast") -> str | None:
    """The one check of an autocast promotion rule: `None` (inherit) or one of PROMOTIONS."""
    if promotion is None or (isinstance(promotion, str) and promotion in PROMOTIONS):
        return promotion
    raise ValueError(f"{who}: promotion must be one of {list(PROMOTIONS)} (or None to inherit the enclosing "
                     f"context's, else 'jax'); got {promotion!r}.")


@dataclasses.dataclass(frozen=True)
class AutocastArgs:
    """The checked arguments of one `autocast(device_type, dtype, enabled)` context, as
    `config.backward_pass_autocast` holds them (validated once, by `parse_device_type` and
    `parse_dtype`)."""
    device_type: str | None = None  # None: the default backend, found when entered
    dtype: str | None = None  # None: the enclosing context's dtype for the device, else its default
    enabled: bool = True
    promotion: str | None = None  # None: the enclosing context's, else "jax"


def setting_inside(contexts: Sequence[AutocastArgs]) -> Setting | None:
    """The setting inside these nested contexts, entered in order from a fresh state."""
    state = AutocastState()
    for c in contexts:
        state = state.enter(c.device_type or parse_device_type(None), c.dtype, c.enabled, c.promotion)
    return state.setting
