"""Typed, validated options, read at trace time.

Every option has a global default (set by assignment, ``aotgrad.config.x = v``,
or by the environment variable ``AOTGRAD_<NAME>`` at import) and may be overridden
for the current thread / context with ``aotgrad.config.patch(**overrides)``.
Options marked ``keyed`` change the programs aotgrad builds, so their values are
part of every compiled function's cache key.
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import os
import threading
from typing import Any, Callable, Iterator, Literal, Mapping, Union

import numpy as np

from aotgrad import jit_key
# the one autocast validator
from aotgrad.autocast.context import (AutocastArgs, check_table_dtype, parse_device_type, parse_dtype,
                                      parse_promotion)
from aotgrad.errors import ConfigError
from aotgrad.partition import PARTITIONERS  # the registry decides what is valid
from aotgrad.partition.budget_value import Bytes, parse_bytes

__all__ = ["BackwardAutocast", "Config", "ConfigError", "Snapshot", "budget_from_text", "config"]


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    default: Any
    parse: Callable[[Any], Any]  # validates and normalizes; raises ConfigError
    from_env: Callable[[str], Any]  # environment string -> raw value for `parse`
    doc: str
    keyed: bool  # part of the cache key: it changes the programs built


# ----------------------------------------------------------------------------- parsers

def _choice(name: str, choices: Callable[[], tuple[str, ...]]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        valid = choices()
        if not isinstance(value, str) or value not in valid:
            raise ConfigError(f"aotgrad.config.{name} must be one of {list(valid)}; got {value!r}.")
        return value
    return parse


def _positive_int(name: str) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ConfigError(f"aotgrad.config.{name} must be an integer >= 1; got {value!r}.")
        return int(value)
    return parse


def _budget(value: Any) -> float | Bytes:
    """A fraction in [0, 1], or a byte size per device: an int above 1 or a string with a
    unit ("12GB", "512 MiB", "1.5e9B"). 0 and 1 are fractions."""
    name = "aotgrad.config.activation_memory_budget"
    if isinstance(value, Bytes):
        return value
    integer = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if isinstance(value, str) or (integer and value not in (0, 1)):
        try:
            return Bytes(parse_bytes(value))
        except ValueError as e:
            raise ConfigError(f"{name}: {e}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"{name} must be a fraction in [0, 1] or a byte size per device (an int, "
                          f"or a string such as '12GB' or '512MiB'); got {value!r}.")
    return float(value)


def budget_from_text(text: str) -> Any:
    """`activation_memory_budget` written as text (an environment variable, a benchmark
    strategy's name), for `_budget` to check as it checks the value passed in Python: an
    integer is an int (0 and 1 fractions, above 1 bytes), a whole number written otherwise
    ("1e9") a size as the string is, any other number a fraction, else a size with a unit."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return text
    return text if number > 1 and number.is_integer() else number


def _bool(name: str) -> Callable[[Any], bool]:
    def parse(value: Any) -> bool:
        if not isinstance(value, (bool, np.bool_)):
            raise ConfigError(f"aotgrad.config.{name} must be True or False; got {value!r}.")
        return bool(value)
    return parse


def _env_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    return text  # type: ignore[return-value]  # `parse` reports it


def _optional_path(name: str) -> Callable[[Any], str | None]:
    def parse(value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, (str, os.PathLike)):
            raise ConfigError(f"aotgrad.config.{name} must be a directory path or None; got {value!r}.")
        return os.fspath(value)
    return parse


AUTOCAST_KEYS = ("device_type", "dtype", "enabled", "promotion")
# The value of `backward_pass_autocast`: a mode, or nested autocast contexts (their
# arguments checked once, here).
BackwardAutocast = Union[Literal["same_as_forward", "off"], tuple[AutocastArgs, ...]]


def _autocast_args(value: Any, where: str) -> AutocastArgs:
    """One dict of autocast keyword arguments, checked (or arguments checked already: an
    option's value set again)."""
    if isinstance(value, AutocastArgs):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a dict of autocast arguments; got {value!r}.")
    unknown = sorted(set(value) - set(AUTOCAST_KEYS))
    if unknown:
        raise ConfigError(f"{where} has unknown keys {unknown}; valid keys are {list(AUTOCAST_KEYS)}.")
    try:
        device = value.get("device_type")
        device = None if device is None else parse_device_type(device, f"{where}['device_type']")
        dtype = parse_dtype(value.get("dtype"), f"{where}['dtype']")
        promotion = parse_promotion(value.get("promotion"), f"{where}['promotion']")
        if device is not None and dtype is not None:
            check_table_dtype(device, dtype, where)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    enabled = value.get("enabled", True)
    if not isinstance(enabled, (bool, np.bool_)):
        raise ConfigError(f"{where}['enabled'] must be True or False; got {enabled!r}.")
    return AutocastArgs(device, dtype, bool(enabled), promotion)


def _backward_pass_autocast(value: Any) -> BackwardAutocast:
    where = "aotgrad.config.backward_pass_autocast"
    if isinstance(value, str):
        if value not in ("same_as_forward", "off"):
            raise ConfigError(
                f"{where} must be 'same_as_forward', 'off', a dict of autocast arguments "
                f"or a list of such dicts; got {value!r}.")
        return value  # type: ignore[return-value]  # one of the two literals
    if isinstance(value, Mapping):
        return (_autocast_args(value, where),)
    if isinstance(value, (list, tuple)) and value:
        return tuple(_autocast_args(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise ConfigError(
        f"{where} must be 'same_as_forward', 'off', a dict of autocast arguments "
        f"or a non-empty list of such dicts; got {value!r}.")


def _env_json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _partitioner_names() -> tuple[str, ...]:
    return tuple(PARTITIONERS)


_OPTIONS: dict[str, Option] = {o.name: o for o in (
    Option("partitioner", "min_cut", _choice("partitioner", _partitioner_names), str,
           "Strategy that chooses which forward values the backward reads from memory.", keyed=True),
    Option("activation_memory_budget", 1.0, _budget, budget_from_text,
           "1: the fused step's plan (the min_cut partitioner recomputes nothing outside scans, "
           "so a jitted step costs what jax.jit(jax.value_and_grad(f)) costs). Below 1, where "
           "the step peak may lie, between the lowest it estimates (0: matmuls recomputed, "
           "layer boundaries saved) and that of its cheapest cut (just below 1: cheap work "
           "recomputed; run apart, budget 1's plan); it takes the cheapest cut within. Or a "
           "byte size per device (an int above 1, or '12GB', '512MiB'): the cheapest cut whose "
           "estimated step peak on one device fits.",
           keyed=True),
    Option("backward_pass_autocast", "same_as_forward", _backward_pass_autocast, _env_json_or_text,
           "Autocast context the backward program is built under: 'same_as_forward', 'off', "
           "a dict of autocast arguments, or a list of dicts applied as nested contexts.", keyed=True),
    Option("donate_saved", False, _bool("donate_saved"), _env_bool,
           "The backward program takes ownership of the saved activations (XLA donation) and "
           "releases them; a second backward on the same saved values is an error.", keyed=True),
    Option("detect_anomaly", False, _bool("detect_anomaly"), _env_bool,
           "Build backward programs that check every value for NaN/Inf; when a gradient is not "
           "finite, raise naming the forward operation (and source line) whose derivative "
           "produced it. Keyed: off, programs carry no check.", keyed=True),
    Option("cache_size_limit", 64, _positive_int("cache_size_limit"), int,
           "Compiled entries kept per function; past it the least recently used is evicted.", keyed=False),
    Option("log_recompiles", False, _bool("log_recompiles"), _env_bool,
           "Log (logger 'aotgrad') why a call missed the cache.", keyed=False),
    Option("debug_dir", None, _optional_path("debug_dir"), str,
           "Directory to dump each compilation's forward/backward jaxprs and lowered text.", keyed=False),
    Option("compilation_cache_dir", None, _optional_path("compilation_cache_dir"), str,
           "Directory of JAX's persistent compilation cache (process-wide), for every program "
           "however small: a restarted process loads compiled programs instead of compiling.",
           keyed=False),
)}


# ----------------------------------------------------------------------------- state

@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The effective value of every option at one moment (`config.snapshot()`), each
    parsed: one typed field per option, in the order of `_OPTIONS`."""
    partitioner: str
    activation_memory_budget: float | Bytes
    backward_pass_autocast: BackwardAutocast
    donate_saved: bool
    detect_anomaly: bool
    cache_size_limit: int
    log_recompiles: bool
    debug_dir: str | None
    compilation_cache_dir: str | None

    @functools.cached_property
    def key(self) -> tuple[tuple[str, Any], ...]:
        """The options that change programs, as (name, value) pairs: part of every cache key."""
        return tuple((name, getattr(self, name)) for name, opt in _OPTIONS.items() if opt.keyed)

    def as_dict(self) -> dict[str, Any]:
        """Every option by name, nested autocast contexts as (name, value) pairs: what an
        export's metadata records."""
        return {name: _plain(getattr(self, name)) for name in _OPTIONS}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, AutocastArgs):
        return tuple(sorted(dataclasses.asdict(value).items()))
    return value


@functools.lru_cache(maxsize=256)
def keyed_only(pairs: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    """The (name, value) pairs of options that change programs."""
    return tuple((n, v) for n, v in pairs if _OPTIONS[n].keyed)


def _unknown(name: str) -> ConfigError:
    return ConfigError(f"aotgrad.config has no option {name!r}; valid options are {sorted(_OPTIONS)}.")


def _validate(name: str, value: Any) -> Any:
    if name not in _OPTIONS:
        raise _unknown(name)
    return _OPTIONS[name].parse(value)


class Config:
    """``aotgrad.config``: read an option as an attribute, set a global default by assignment,
    override it for a block with :meth:`patch`."""

    _lock = threading.Lock()

    def __init__(self) -> None:
        defaults = {}
        for name, opt in _OPTIONS.items():
            env = os.environ.get(f"AOTGRAD_{name.upper()}")
            raw = opt.default if env is None else opt.from_env(env)
            try:
                defaults[name] = opt.parse(raw)
            except ConfigError as e:
                raise ConfigError(f"environment variable AOTGRAD_{name.upper()}={env!r}: {e}") from None
        object.__setattr__(self, "_defaults", defaults)
        object.__setattr__(self, "_version", 0)
        object.__setattr__(self, "_overrides", contextvars.ContextVar("aotgrad_config_overrides", default=()))
        object.__setattr__(self, "_snapshots", {})
        Snapshot(**defaults)  # every option has its typed field
        jit_key.set_defaults(keyed_only(tuple(defaults.items())))

    def keyed_overrides(self) -> tuple[tuple[str, Any], ...]:
        """The options patched in the current context that change programs, innermost last."""
        overrides = self._overrides.get()
        return keyed_only(overrides) if overrides else ()

    def state(self) -> tuple[int, tuple[tuple[str, Any], ...]]:
        """What `snapshot` is cached on: the defaults' version and this context's overrides."""
        return self._version, self._overrides.get()

    def snapshot(self) -> Snapshot:
        """The effective options for the current context (cheap: cached per state)."""
        overrides = self._overrides.get()
        state = (self._version, overrides)
        snap = self._snapshots.get(state)
        if snap is None:
            merged = dict(self._defaults)
            merged.update(state[1])
            snap = Snapshot(**merged)
            if len(self._snapshots) > 256:
                self._snapshots.clear()
            self._snapshots[state] = snap
        return snap

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in _OPTIONS:
            raise _unknown(name)
        for key, value in reversed(self._overrides.get()):
            if key == name:
                return value
        return self._defaults[name]

    def __setattr__(self, name: str, value: Any) -> None:
        parsed = _validate(name, value)
        with self._lock:
            self._defaults[name] = parsed
            object.__setattr__(self, "_version", self._version + 1)
            jit_key.set_defaults(keyed_only(tuple(self._defaults.items())))

    def patch(self, **overrides: Any) -> "_Patch":
        """Overrides options inside a ``with`` block or a decorated function.

        Restores the previous values exactly on exit (also on exceptions), nests, and is
        local to the current thread / ``contextvars`` context.
        """
        return _Patch(self, tuple((n, _validate(n, v)) for n, v in overrides.items()))

    def options(self) -> dict[str, str]:
        """Every option name with its documentation."""
        return {name: opt.doc for name, opt in _OPTIONS.items()}

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(_OPTIONS))

    def __repr__(self) -> str:
        snap = self.snapshot()
        body = ", ".join(f"{n}={getattr(snap, n)!r}" for n in _OPTIONS)
        return f"aotgrad.config({body})"


class _Patch:
    """Context manager and decorator returned by :meth:`Config.patch`."""

    def __init__(self, cfg: Config, overrides: tuple[tuple[str, Any], ...]) -> None:
        self._cfg = cfg
        self._overrides = overrides
        self._tokens: list[contextvars.Token] = []  # a stack: the same object may be re-entered

    def __enter__(self) -> Config:
        var = self._cfg._overrides
        self._tokens.append(var.set(var.get() + self._overrides))
        jit_key.set_overrides(keyed_only(var.get()))
        return self._cfg

    def __exit__(self, *exc: object) -> None:
        self._cfg._overrides.reset(self._tokens.pop())
        jit_key.set_overrides(keyed_only(self._cfg._overrides.get()))

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with _Patch(self._cfg, self._overrides):
                return fn(*args, **kwargs)
        return wrapper

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self._overrides)


config = Config()
