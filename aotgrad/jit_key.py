"""Which aotgrad state is part of JAX's jit cache key.

An enclosing `jax.jit` traces a compiled function once and then replays the trace; for
`config.patch(...)` or `autocast(...)` to reach it, the state that changes programs must
be in `jax.jit`'s own cache key, as JAX's context settings (`jax.default_matmul_precision`)
are. aotgrad's state lives in `contextvars` (per thread and asyncio task); this module
mirrors it into three JAX context states, which JAX keeps per thread:

- the keyed option defaults (global: `aotgrad.config.x = v`),
- the keyed options of the `config.patch` overrides in force (per thread),
- the autocast state (per thread),
- the backward hooks of every compiled function (global: `hooks.Hooks`).

Options that change no program (`log_recompiles`, ...) are left out, so they never
retrace. The mirror is written when a context is entered or left; `check` finds the rare
case where the two disagree (a context entered in another asyncio task or copied into
another thread with `contextvars.Context.run`).
"""
from __future__ import annotations

from typing import Any, Sequence

from aotgrad._jax_internals import Tracer, jit_key_state

__all__ = ["check", "mirrored", "set_autocast", "set_autocast_default", "set_defaults", "set_hooks", "set_overrides"]

_DEFAULTS = jit_key_state("aotgrad_config_defaults", ())
_OVERRIDES = jit_key_state("aotgrad_config_overrides", ())
_AUTOCAST = jit_key_state("aotgrad_autocast", None)
_HOOKS = jit_key_state("aotgrad_hooks", ())


def set_defaults(keyed: tuple[tuple[str, Any], ...]) -> None:
    """The keyed options' global defaults changed."""
    _DEFAULTS.set_global(keyed)


def set_overrides(keyed: tuple[tuple[str, Any], ...]) -> None:
    """The keyed options among this context's `config.patch` overrides."""
    _OVERRIDES.set_local(keyed)


def set_hooks(hooks: tuple[tuple[int, tuple[Any, ...]], ...]) -> None:
    """The hooks in force, per compiled function (hooks compare by identity)."""
    _HOOKS.set_global(hooks)


def set_autocast(state: Any) -> None:
    """This context's `AutocastState`."""
    _AUTOCAST.set_local(state)


def set_autocast_default(state: Any) -> None:
    """The autocast state outside every context."""
    _AUTOCAST.set_global(state)


def mirrored() -> tuple[Any, Any]:
    """The mirrored overrides and autocast state of this thread, as `check` compares them."""
    return _OVERRIDES.value, _AUTOCAST.value


def check(overrides: tuple[tuple[str, Any], ...], autocast: Any, leaves: Sequence[Any], name: str) -> None:
    """Compares the mirror with the context's own state before a call reads it. Eagerly a
    difference is repaired; under a trace the enclosing `jax.jit` has already been keyed on
    the thread's state, so the call is refused rather than cached under the wrong key."""
    if _OVERRIDES.value == overrides and _AUTOCAST.value == autocast:
        return
    _OVERRIDES.set_local(overrides)
    _AUTOCAST.set_local(autocast)
    if any(isinstance(x, Tracer) for x in leaves):
        raise RuntimeError(
            f"aotgrad.compile({name}): the aotgrad.config.patch / aotgrad.autocast state of this "
            f"contextvars context differs from the one this thread last entered (a context "
            f"entered in another asyncio task, or a context copied into this thread), so an "
            f"enclosing jax.jit was keyed on the wrong state. Enter config.patch / autocast in "
            f"the thread or task that calls the jitted function.")
