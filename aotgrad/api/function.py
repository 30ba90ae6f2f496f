"""`compile` (the decorator) and the `AOTFunction` it makes: a call resolved to its cache
entry, traced on a miss, then run by the runtime."""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import warnings
from typing import Any, Callable, NamedTuple, Sequence

import jax
from jax.tree_util import tree_unflatten

from aotgrad._jax_internals import Tracer
from aotgrad import jit_key
from aotgrad.api.stages import Lowered
from aotgrad.autocast.context import current_setting, current_state
from aotgrad.compilation_cache import ensure_compilation_cache
from aotgrad.config import Snapshot, config
from aotgrad.hooks import HOOK, LEAF, PREHOOK, ArgLayout, HookHandle, Hooks
from aotgrad.nnx import NnxCall, has_graph_nodes
from aotgrad.pipeline import trace_forward
from aotgrad.runtime import Entry
from aotgrad.signature import (ArgSpec, CallKey, Static, describe_key_change, key_distance, leaf_key, leaf_paths,
                               normalize_argnums, static_leaves, unwrap_static)

__all__ = ["AOTFunction", "CacheInfo", "compile"]

logger = logging.getLogger("aotgrad")

_FORWARD_MODE_HINT = (
    "aotgrad.compile({name}) is reverse-mode only: its backward is a separately compiled "
    "program, so forward-mode autodiff (jax.jvp, jax.jacfwd, jax.linearize) cannot pass "
    "through it. Use jax.grad / jax.vjp / jax.jacrev on the compiled function, or call the "
    "undecorated function under forward mode.")


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """What one compiled function holds: signatures (entries), program pairs, and backward
    programs (a pair has one per set of hooks and of gradient shardings it ran with)."""
    entries: int
    pairs: int
    hits: int
    misses: int
    backwards: int = 0


class _Call(NamedTuple):
    """One call, resolved: the entry and its flat inputs."""
    entry: Entry
    inputs: tuple[Any, ...]  # (consts..., leaves...)


class AOTFunction:
    """A function compiled ahead of time into forward and backward XLA programs.

    Calling it outside autodiff runs a forward-only program; under `jax.grad`, `jax.vjp`
    or `jax.jacrev` it runs a forward program that also returns saved values, then a
    backward program. Programs are built once per signature (argument structure, shapes,
    dtypes, static arguments, and the options in `aotgrad.config` that change programs).
    """
    reads_autocast_when_traced = True  # `autocast(...)(f)` enters the context around the call

    def __init__(self, fn: Callable, *, static_argnums: int | Sequence[int] = (),
                 static_argnames: str | Sequence[str] = (),
                 donate_argnums: int | Sequence[int] = (), python_scalars: str = "traced") -> None:
        if not callable(fn):
            raise TypeError(f"aotgrad.compile expects a callable; got {type(fn).__name__} ({fn!r}).")
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._spec = ArgSpec.of(fn, static_argnums, static_argnames, python_scalars)
        self._donate, _ = normalize_argnums(f"aotgrad.compile({self._spec.fn_name})", donate_argnums,
                                            "donate_argnums", "positions of the arguments whose buffers may be reused")
        clash = set(self._donate) & set(self._spec.static_argnums)
        if clash:
            raise ValueError(f"aotgrad.compile({self._spec.fn_name}): arguments {sorted(clash)} are in "
                             f"both donate_argnums and static_argnums; a static argument cannot be donated.")
        self._cache: collections.OrderedDict[CallKey, Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._last_key: CallKey | None = None
        self._warned_eviction = False
        self._noted_identity = False
        self._hits = self._misses = 0
        self._nnx: Any = None  # an `nnx.NnxCall`, made on the first call with flax graph
        # nodes among the arguments; False for the function an NnxCall traces (its Variables are leaves)
        self._hooks = Hooks(self._spec.fn_name)

    @property
    def name(self) -> str:
        return self._spec.fn_name

    # ---------------------------------------------------------------- calling

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._nnx is not False and has_graph_nodes(args, kwargs):
            if self._nnx is None:
                self._nnx = NnxCall(self, AOTFunction)
            return self._nnx(args, kwargs)
        call = self._resolve(args, kwargs)
        entry = call.entry
        if not any(isinstance(x, Tracer) for x in call.inputs):
            outs = entry.forward_only(*call.inputs)  # concrete inputs: nothing to differentiate
        else:
            try:
                outs = entry.call(*call.inputs)
            except TypeError as e:
                if "forward-mode" in str(e):
                    raise TypeError(_FORWARD_MODE_HINT.format(name=self.name)) from e
                raise
        return tree_unflatten(entry.fwd.out_tree, outs)

    def _resolve(self, args: tuple, kwargs: dict) -> _Call:
        static, dyn_args, dyn_kwargs = self._spec.split(args, kwargs)
        leaves, in_tree = self._spec.flatten(dyn_args, dyn_kwargs)
        snapshot = config.snapshot()
        jit_key.check(config.keyed_overrides(), current_state(), leaves, self.name)
        key = CallKey(static, in_tree, tuple(map(leaf_key, leaves)), snapshot.key, current_setting())
        entry = self._cache.get(key)  # hit path without the lock: dict reads are atomic
        if entry is not None:
            try:
                self._cache.move_to_end(key)
            except KeyError:  # evicted by another thread meanwhile; still valid for this call
                pass
            self._hits += 1
            self._last_key = key
        else:
            entry = self._build(key, snapshot, len(args), leaves)
        return _Call(entry, (*entry.fwd.consts, *leaves))

    def _build(self, key: CallKey, snapshot: Snapshot, n_args: int, leaves: list) -> Entry:
        """Cache miss: traces the forward and stores a new entry."""
        ensure_compilation_cache()
        with self._lock:
            self._misses += 1
            last = self._last_key
            cached = list(self._cache)
        if snapshot.log_recompiles and last is not None:
            # Blame the difference from the nearest cached key (fewest differing fields).
            nearest = min(reversed(cached), key=lambda k: key_distance(k, key), default=last)
            logger.warning("aotgrad: compiling %s again: %s", self.name,
                           "; ".join(describe_key_change(self._spec, nearest, key)))
        static, in_tree = key.static, key.in_tree
        self._note_identity_keys(key, snapshot)

        def flat_fn(*flat: Any) -> Any:
            dyn_args, dyn_kwargs = unwrap_static(tree_unflatten(in_tree, flat))
            a, k = self._spec.merge(static, dyn_args, dyn_kwargs)
            return self._fn(*a, **k)

        try:
            fwd = trace_forward(flat_fn, self.name, tuple(map(jax.typeof, leaves)), key.autocast)
        except (jax.errors.ConcretizationTypeError, TypeError) as e:
            raise self._traced_scalar_error(e, in_tree, leaves) from e
        arg_positions = tuple(i for i in range(n_args) if i not in self._spec.static_argnums
                              and (i - n_args) not in self._spec.static_argnums)
        layout = ArgLayout(self.name, len(fwd.consts), in_tree, arg_positions, n_args,
                           tuple(leaf_paths(self._spec, in_tree)), fwd.out_tree)
        entry = Entry(self.name, fwd, in_tree, arg_positions, snapshot, self._donate, self._hooks, layout)
        if any(isinstance(c, Tracer) for c in fwd.consts):
            return entry  # closes over an enclosing transform's tracers: valid for this call only
        with self._lock:
            self._cache[key] = entry
            self._last_key = key
            limit = snapshot.cache_size_limit
            while len(self._cache) > limit:
                self._cache.popitem(last=False)
                if not self._warned_eviction:
                    self._warned_eviction = True
                    warnings.warn(
                        f"aotgrad.compile({self.name}) has compiled for more than "
                        f"cache_size_limit={limit} signatures; evicting the least recently used. "
                        f"Set aotgrad.config.log_recompiles = True to see why calls miss the cache, "
                        f"or raise aotgrad.config.cache_size_limit.", stacklevel=5)
        return entry

    def _traced_scalar_error(self, error: Exception, in_tree: Any, leaves: list) -> Exception:
        """`error` itself, or, when the trace needed a concrete value and Python scalars were
        traced (`jax.jit`'s rule), a TypeError that names them and `python_scalars`."""
        concrete = isinstance(error, jax.errors.ConcretizationTypeError) or "concrete" in str(error)
        paths = leaf_paths(self._spec, in_tree)
        scalars = [f"{p} ({type(x).__name__} {x!r})" for p, x in zip(paths, leaves, strict=True)
                   if isinstance(x, (bool, int, float, complex))]
        if not (concrete and scalars):
            return error
        return TypeError(
            f"aotgrad.compile({self.name}): tracing needed a concrete value, and these Python scalar "
            f"arguments are traced (as jax.jit traces them): {', '.join(scalars)}. If one of them sets a "
            f"shape, an axis or control flow, pass it as a static argument (static_argnums / "
            f"static_argnames), or use aotgrad.compile(..., python_scalars=\"static\") to make every "
            f"Python scalar static (as eqx.filter_jit does). JAX said: {type(error).__name__}: "
            f"{str(error).splitlines()[0]}")

    def _note_identity_keys(self, key: CallKey, snapshot: Snapshot) -> None:
        """Once per function, with `log_recompiles`: which static values are unhashable and
        therefore keyed by identity."""
        if self._noted_identity or not snapshot.log_recompiles:
            return
        tree = tree_unflatten(key.in_tree, [0] * key.in_tree.num_leaves)
        found = [f"argument {self._spec.arg_name(k) if isinstance(k, int) else k}" for k, v in key.static
                 if isinstance(v, Static)]
        found += [f"argument {path}" for path, (_, v) in
                  zip(leaf_paths(self._spec, key.in_tree, static=True), static_leaves(tree), strict=True)
                  if v.by_identity]
        if found:
            self._noted_identity = True
            logger.warning("aotgrad: %s: %s not hashable, so the cache is keyed on the object's "
                           "identity: passing another object, even an equal one, compiles again.",
                           self.name, ", ".join(found) + (" is" if len(found) == 1 else " are"))

    # ---------------------------------------------------------------- hooks

    def register_prehook(self, fn: Callable[[Any], Any]) -> HookHandle:
        """Adds a hook on the output cotangent, traced into the start of the backward program.

        Hooks run in registration order, in every backward whose forward ran while they were
        registered (under `jax.grad`, `jax.vjp`, `fwd_and_bwd`, inside `jax.jit`). Adding or
        removing one builds a backward program only; removing it finds the earlier one again.

        Arguments:
            fn: `fn(cotangent) -> cotangent | None`. `cotangent` has the structure of the
                function's output, with None at outputs that take no cotangent (integer
                outputs, `has_aux` auxiliaries); the result must match it leaf for leaf in
                shape and dtype (None keeps it).

        Returns a handle whose `.remove()` removes the hook.
        """
        return self._hooks.add(fn, PREHOOK)

    def register_hook(self, fn: Callable[..., Any], per_leaf: bool = False) -> HookHandle:
        """Adds a hook on the gradients, traced into the backward program.

        Arguments:
            fn: with `per_leaf=False`, `fn(grads, cotangent) -> grads | None`, run at the end
                of the backward: `grads` is a tuple with one entry per positional argument
                (the argument's pytree of gradients; None for an argument not differentiated,
                and None leaves in one partly differentiated), `cotangent` as the prehooks
                left it. With `per_leaf=True`, `fn(grad, path) -> grad | None` for each
                gradient leaf (`path` reads e.g. ``params['w']``), run as soon as that leaf's
                gradient is final in the backward program: the leaf last used latest in the
                forward first, so a collective in the hook (a `psum` under `shard_map`)
                overlaps the rest of the backward. Per-leaf hooks registered after a
                whole-gradient hook run after it, at the end. Results must match their
                input in structure, shape and dtype (None keeps it).
            per_leaf: call `fn` once per gradient leaf, as described.

        Returns a handle whose `.remove()` removes the hook.
        """
        return self._hooks.add(fn, LEAF if per_leaf else HOOK)

    # ---------------------------------------------------------------- ahead of time

    def lower(self, *args: Any, **kwargs: Any) -> "Lowered":
        """Lowers the forward and backward programs for these arguments (arrays or
        `jax.ShapeDtypeStruct`s), differentiating every floating-point input."""
        call = self._resolve(args, kwargs)
        pair = call.entry.pair(call.entry.perturbed_for(None), call.entry.default_has_ct())
        lowered_f, lowered_b, timings = pair.lower(call.inputs)
        return Lowered(self.name, pair, lowered_f, lowered_b, timings)

    def resolved(self, args: tuple, kwargs: dict) -> tuple[_Call, list[str]]:
        """For `aotgrad.explain`: the cache entry and flat inputs of a call (built on a
        miss), and the pytree path of each argument leaf."""
        call = self._resolve(args, kwargs)
        return call, leaf_paths(self._spec, call.entry.in_tree)

    def cache_info(self) -> CacheInfo:
        """Entries (call signatures), program pairs, hits and misses of this function's cache."""
        with self._lock:
            pairs = [p for e in self._cache.values() for p in e.pairs.values()]
            backwards = sum(len(p.run_backward.programs) for p in pairs)
            return CacheInfo(len(self._cache), len(pairs), self._hits, self._misses, backwards)

    def clear_cache(self) -> None:
        """Drops every compiled entry of this function; the next call traces again."""
        with self._lock:
            self._cache.clear()
            self._last_key = None

    def __repr__(self) -> str:
        return f"aotgrad.compile({self.name})"

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        # Decorating a method: bind `self` as the first argument. A plain object is a
        # non-array leaf, hence static (keyed by hash, else identity); a pytree `self`
        # (an equinox module) has its arrays traced like any argument.
        return self if obj is None else functools.partial(self, obj)


def compile(fn: Callable | None = None, *, static_argnums: int | Sequence[int] = (),
            static_argnames: str | Sequence[str] = (),
            donate_argnums: int | Sequence[int] = (), python_scalars: str = "traced") -> Any:
    """Compiles `fn` ahead of time into separate forward and backward XLA programs.

    Usable bare (``@aotgrad.compile``) or with arguments
    (``@aotgrad.compile(static_argnums=1)``).

    Arguments are pytrees. Their array leaves (and, as in `jax.jit`, Python scalars) are
    traced; every other leaf (a function, a string, an arbitrary object) is static: part of
    the cache key by hash, else by identity. So a whole model (an equinox module with an
    activation function field) can be passed as is. On a method, `self` is bound as the
    first argument under the same rule.

    Arguments:
        fn: a function of arrays (and pytrees of arrays) written with `jax.numpy` / `jax.lax`.
        static_argnums: positional arguments that are configuration, not arrays (keyed by
            hash, else by identity).
        static_argnames: keyword arguments that are configuration.
        donate_argnums: positional arguments whose buffers the forward-only program may reuse.
        python_scalars: "traced" (default, as `jax.jit`) or "static" (as `eqx.filter_jit`:
            Python bool/int/float/complex leaves are part of the cache key).
    """
    def wrap(f: Callable) -> AOTFunction:
        return AOTFunction(f, static_argnums=static_argnums, static_argnames=static_argnames,
                           donate_argnums=donate_argnums, python_scalars=python_scalars)
    return wrap if fn is None else wrap(fn)
