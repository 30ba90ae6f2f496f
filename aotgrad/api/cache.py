"""The entries of one compiled function: a call resolved to the entry of its signature,
traced on a miss (`EntryCache`), least recently used evicted past `cache_size_limit`."""
from __future__ import annotations

import collections
import dataclasses
import logging
import operator
import threading
import warnings
from typing import Any, Callable, Sequence

import jax
from jax.tree_util import tree_unflatten

from aotgrad import jit_key
from aotgrad._jax_internals import ArrayImpl, Tracer
from aotgrad.autocast.context import current_setting, current_state
from aotgrad.compilation_cache import ensure_compilation_cache
from aotgrad.config import Snapshot, config
from aotgrad.entry import Entry, HookSource, compiled_entry
from aotgrad.hooks import ArgLayout
from aotgrad.pipeline import trace_forward
from aotgrad.runtime import ProgramPair
from aotgrad.signature import (ArgSpec, CallKey, Static, check_in_range, describe_key_change, key_distance, leaf_key,
                               leaf_paths, static_leaves, unwrap_static)

__all__ = ["CacheInfo", "EntryCache"]

logger = logging.getLogger("aotgrad")


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """What one compiled function holds: signatures (entries), program pairs, and backward
    programs (a pair has one per set of hooks and of gradient shardings it ran with)."""
    entries: int
    pairs: int
    hits: int
    misses: int
    backwards: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class _LastCall:
    """The latest call, which the next call of a loop repeats: recognised without building
    its key, by the same static arguments and tree, leaves of the same types (one object
    per type: JAX interns them), and the same state as then: the options' (`config.state`),
    the autocast state, and their mirror in JAX's jit key (`jit_key.mirrored`). `direct`:
    its leaves were its positional arguments (arrays only, no keywords, nothing static),
    so a call of arrays of the same types repeats it before it is flattened."""
    key: CallKey
    entry: Entry
    avals: tuple[Any, ...]  # per leaf its type; None where a leaf is not a concrete array
    direct: bool
    options: tuple[Any, ...] = dataclasses.field(default_factory=config.state)
    autocast: Any = dataclasses.field(default_factory=current_state)
    mirror: tuple[Any, Any] = dataclasses.field(default_factory=jit_key.mirrored)

    def repeated_by(self, static: tuple, in_tree: Any, leaves: Sequence[Any]) -> bool:
        key = self.key
        return static == key.static and in_tree == key.in_tree and self._same(leaves)

    def repeated_directly(self, args: tuple, kwargs: dict) -> bool:
        return self.direct and not kwargs and self._same(args)

    def _same(self, leaves: Sequence[Any]) -> bool:
        if len(leaves) != len(self.avals):
            return False
        for x, aval in zip(leaves, self.avals):
            if type(x) is not ArrayImpl or x.aval is not aval:
                return False
        return (current_state() is self.autocast and config.state() == self.options
                and jit_key.mirrored() == self.mirror)  # (identical objects compare at once)


def _last_call(key: CallKey, entry: Entry, args: tuple, kwargs: dict, leaves: list) -> _LastCall:
    """The call just resolved, in the state now in force."""
    direct = not kwargs and not key.static and len(args) == len(leaves) and all(map(operator.is_, args, leaves))
    return _LastCall(key, entry, tuple(x.aval if type(x) is ArrayImpl else None for x in leaves), direct)


def _needed_concrete(error: Exception) -> bool:
    """Whether tracing failed for want of a concrete value: JAX's concretization errors, and
    the IndexError of a slice whose bound is a tracer (its message shows the tracer,
    `JitTracer(~int32[])`, on every supported JAX; an IndexError of the function's own,
    an index out of range, shows none)."""
    if isinstance(error, IndexError):
        return "Tracer(" in str(error)
    return isinstance(error, jax.errors.ConcretizationTypeError) or "concrete" in str(error)


class EntryCache:
    """The compiled entries of `fn`, one per call signature (argument structure, shapes,
    dtypes, static arguments, keyed options, autocast setting)."""

    def __init__(self, fn: Callable[..., Any], spec: ArgSpec, donate_argnums: tuple[int, ...],
                 hooks: HookSource) -> None:
        self.fn = fn
        self.spec = spec
        self.donate_argnums = donate_argnums
        self.hooks = hooks  # the function's hooks, read by its entries when a forward runs
        self.entries: collections.OrderedDict[CallKey, Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._last: _LastCall | None = None  # the latest call, which the next may repeat
        self._warned_eviction = False
        self._noted_identity = False
        self._hits = self._misses = 0

    @property
    def name(self) -> str:
        return self.spec.fn_name

    def resolve(self, args: tuple, kwargs: dict) -> tuple[Entry, tuple[Any, ...]]:
        """The entry of this call's signature (traced on a miss) and its flat inputs
        (closed-over values, then argument leaves)."""
        last = self._last  # (one read: another thread may replace it)
        if last is not None and last.repeated_directly(args, kwargs):  # a loop's calls
            self._hits += 1
            return last.entry, (*last.entry.fwd.consts, *args)
        static, dyn_args, dyn_kwargs = self.spec.split(args, kwargs)
        leaves, in_tree = self.spec.flatten(dyn_args, dyn_kwargs)
        if last is not None and last.repeated_by(static, in_tree, leaves):
            self._hits += 1
            return last.entry, (*last.entry.fwd.consts, *leaves)
        snapshot = config.snapshot()
        jit_key.check(config.keyed_overrides(), current_state(), leaves, self.name)
        key = CallKey(static, in_tree, tuple(map(leaf_key, leaves)), snapshot.key, current_setting())
        entry = self.entries.get(key)  # hit path without the lock: dict reads are atomic
        if entry is not None:
            try:
                self.entries.move_to_end(key)
            except KeyError:  # evicted by another thread meanwhile; still valid for this call
                pass
            self._hits += 1
            self._last = _last_call(key, entry, args, kwargs, leaves)
        else:
            entry = self._build(key, snapshot, args, kwargs, leaves)
        return entry, (*entry.fwd.consts, *leaves)

    def _build(self, key: CallKey, snapshot: Snapshot, args: tuple, kwargs: dict, leaves: list) -> Entry:
        """Cache miss: traces the forward and stores a new entry."""
        n_args = len(args)
        if not self.spec.fixed_arity:  # *args: the positions donated must be among this call's
            check_in_range(f"aotgrad.compile({self.name})", "donate_argnums", self.donate_argnums, n_args)
        ensure_compilation_cache()
        with self._lock:
            self._misses += 1
            last = self._last.key if self._last is not None else None
            cached = list(self.entries)
        if snapshot.log_recompiles and last is not None:
            # Blame the difference from the nearest cached key (fewest differing fields).
            nearest = min(reversed(cached), key=lambda k: key_distance(k, key), default=last)
            logger.warning("aotgrad: compiling %s again: %s", self.name,
                           "; ".join(describe_key_change(self.spec, nearest, key)))
        self._note_identity_keys(key, snapshot)
        fwd = self._trace(key, leaves)
        arg_positions = tuple(i for i in range(n_args) if i not in self.spec.static_argnums
                              and (i - n_args) not in self.spec.static_argnums)
        layout = ArgLayout(self.name, len(fwd.consts), key.in_tree, arg_positions, n_args,
                           tuple(leaf_paths(self.spec, key.in_tree)), fwd.out_tree)
        entry = compiled_entry(layout, fwd, snapshot, self.donate_argnums, self.hooks)
        if any(isinstance(c, Tracer) for c in fwd.consts):
            return entry  # closes over an enclosing transform's tracers: valid for this call only
        with self._lock:
            self.entries[key] = entry
            self._last = _last_call(key, entry, args, kwargs, leaves)
            self._evict(snapshot.cache_size_limit)
        return entry

    def _trace(self, key: CallKey, leaves: list) -> Any:
        """The forward traced for this key (`pipeline.trace_forward`)."""
        static, in_tree = key.static, key.in_tree

        def flat_fn(*flat: Any) -> Any:
            dyn_args, dyn_kwargs = unwrap_static(tree_unflatten(in_tree, flat))
            a, k = self.spec.merge(static, dyn_args, dyn_kwargs)
            return self.fn(*a, **k)

        try:
            return trace_forward(flat_fn, self.name, tuple(map(jax.typeof, leaves)), key.autocast)
        except (jax.errors.ConcretizationTypeError, TypeError, IndexError) as e:
            raise self._traced_scalar_error(e, in_tree, leaves) from e

    def _evict(self, limit: int) -> None:
        """Drops the least recently used entries past `limit` (warns once); under the lock."""
        while len(self.entries) > limit:
            self.entries.popitem(last=False)
            if not self._warned_eviction:
                self._warned_eviction = True
                warnings.warn(
                    f"aotgrad.compile({self.name}) has compiled for more than "
                    f"cache_size_limit={limit} signatures; evicting the least recently used. "
                    f"Set aotgrad.config.log_recompiles = True to see why calls miss the cache, "
                    f"or raise aotgrad.config.cache_size_limit.", stacklevel=6)

    def _traced_scalar_error(self, error: Exception, in_tree: Any, leaves: list) -> Exception:
        """`error` itself, or, when the trace needed a concrete value and Python scalars were
        traced (`jax.jit`'s rule), an error of the same kind (TypeError, or IndexError for a
        traced slice bound, `x[:, :n]`) that names them and `python_scalars`."""
        paths = leaf_paths(self.spec, in_tree)
        scalars = [f"{p} ({type(x).__name__} {x!r})" for p, x in zip(paths, leaves, strict=True)
                   if isinstance(x, (bool, int, float, complex))]
        if not (_needed_concrete(error) and scalars):
            return error
        return (IndexError if isinstance(error, IndexError) else TypeError)(
            f"aotgrad.compile({self.name}): tracing needed a concrete value, and these Python scalar "
            f"arguments are traced (as jax.jit traces them): {', '.join(scalars)}. If one of them sets a "
            f"shape, an axis, a slice bound or control flow, pass it as a static argument (static_argnums / "
            f"static_argnames), or use aotgrad.compile(..., python_scalars=\"static\") to make every "
            f"Python scalar static (as eqx.filter_jit does). JAX said: {type(error).__name__}: "
            f"{str(error).splitlines()[0]}")

    def _note_identity_keys(self, key: CallKey, snapshot: Snapshot) -> None:
        """Once per function, with `log_recompiles`: which static values are unhashable and
        therefore keyed by identity."""
        if self._noted_identity or not snapshot.log_recompiles:
            return
        tree = tree_unflatten(key.in_tree, [0] * key.in_tree.num_leaves)
        found = [f"argument {self.spec.arg_name(k) if isinstance(k, int) else k}" for k, v in key.static
                 if isinstance(v, Static)]
        found += [f"argument {path}" for path, (_, v) in
                  zip(leaf_paths(self.spec, key.in_tree, static=True), static_leaves(tree), strict=True)
                  if v.by_identity]
        if found:
            self._noted_identity = True
            logger.warning("aotgrad: %s: %s not hashable, so the cache is keyed on the object's "
                           "identity: passing another object, even an equal one, compiles again.",
                           self.name, ", ".join(found) + (" is" if len(found) == 1 else " are"))

    def info(self) -> CacheInfo:
        """Entries (call signatures), program pairs, hits and misses."""
        with self._lock:
            pairs = [p for e in self.entries.values() for p in e.pairs.values()]
            backwards = sum(len(p.run_backward.programs) for p in pairs if isinstance(p, ProgramPair))
            return CacheInfo(len(self.entries), len(pairs), self._hits, self._misses, backwards)

    def clear(self) -> None:
        """Drops every entry; the next call traces again."""
        with self._lock:
            self.entries.clear()
            self._last = None
