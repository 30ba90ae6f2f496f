"""How a call's arguments become a cache key: static/dynamic split, pytree flattening,
leaf validation, and the readable difference between two keys (for recompile logs)."""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import jax
import numpy as np
from jax.tree_util import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from aotgrad._jax_internals import ArrayImpl, Tracer

__all__ = ["ArgSpec", "CallKey", "aval_key", "check_output_leaves", "describe_key_change", "key_text",
           "leaf_key", "leaf_paths"]

_SCALARS = (bool, int, float, complex, np.generic)


def _is_array_like(x: Any) -> bool:
    return type(x) is ArrayImpl or isinstance(x, (jax.Array, np.ndarray, Tracer, jax.ShapeDtypeStruct, *_SCALARS))


def _describe(x: Any) -> str:
    text = repr(x)
    return f"{type(x).__name__} ({text[:60] + '...' if len(text) > 60 else text})"


class CallKey(NamedTuple):
    """Everything that decides which programs a call needs (a tuple: cheap to hash)."""
    static: tuple[Hashable, ...]  # (position or name, value) of static arguments
    in_tree: Any  # PyTreeDef of (dynamic args, dynamic kwargs)
    leaves: tuple[tuple, ...]  # `leaf_key` of each dynamic leaf
    options: tuple[tuple[str, Any], ...]  # keyed config options
    autocast: Any = None  # the autocast setting in force (an `autocast.Setting`), None: off


_EXPLICIT = jax.sharding.AxisType.Explicit


def aval_key(aval: Any) -> tuple:
    """(shape, dtype, weak_type), plus the sharding when it is part of the type (a mesh
    with Explicit axes), plus the varying manual axes inside `shard_map`."""
    base = (aval.shape, aval.dtype, aval.weak_type)
    sharding = getattr(aval, "sharding", None)
    if sharding is not None and _EXPLICIT in getattr(sharding.mesh, "axis_types", ()):
        base += (sharding,)
    vma = getattr(aval, "vma", None)
    return base + (vma,) if vma else base


def leaf_key(x: Any) -> tuple:
    """What tracing needs to know about one argument leaf; fast for concrete arrays."""
    return aval_key(x.aval if type(x) is ArrayImpl else jax.typeof(x))


def key_text(key: tuple) -> str:
    shape, dtype, weak = key[:3]
    text = f"{'~' if weak else ''}{np.dtype(dtype).name}{list(shape)}"
    specs = [extra.spec for extra in key[3:] if hasattr(extra, "spec")]
    return text + "".join(f" sharded {spec}" for spec in specs)


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    """How one function's arguments split into static and dynamic ones."""
    fn_name: str
    static_argnums: tuple[int, ...]
    static_argnames: tuple[str, ...]
    param_names: tuple[str, ...]  # positional parameter names, for messages

    @classmethod
    def of(cls, fn: Callable, static_argnums: int | Sequence[int],
           static_argnames: str | Sequence[str]) -> "ArgSpec":
        nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
        try:
            params = [p for p in inspect.signature(fn).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            params = []
        param_names = tuple(p.name for p in params)
        # As jax.jit does: a static position also makes its name static, and vice versa.
        nums = tuple(sorted(set(nums) | {i for i, n in enumerate(param_names) if n in names}))
        names = tuple(sorted(set(names) | {param_names[i] for i in nums if 0 <= i < len(param_names)}))
        fn_name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
        return cls(fn_name, nums, names, param_names)

    def arg_name(self, i: int) -> str:
        return self.param_names[i] if i < len(self.param_names) else f"args[{i}]"

    def split(self, args: tuple, kwargs: dict) -> tuple[tuple, tuple, dict]:
        """Returns (static items, dynamic args, dynamic kwargs); static values are checked."""
        if not self.static_argnums and not self.static_argnames:
            return (), args, kwargs
        static: list[tuple[Hashable, Any]] = []
        dyn_args = []
        for i, a in enumerate(args):
            if i in self.static_argnums or (i - len(args)) in self.static_argnums:
                static.append((i, self._check_static(a, f"static_argnums={self.static_argnums} "
                                                        f"marks argument {i} ({self.arg_name(i)})")))
            else:
                dyn_args.append(a)
        dyn_kwargs = {}
        for k in sorted(kwargs):
            if k in self.static_argnames:
                static.append((k, self._check_static(kwargs[k], f"static_argnames marks {k!r}")))
            else:
                dyn_kwargs[k] = kwargs[k]
        return tuple(static), tuple(dyn_args), dyn_kwargs

    def _check_static(self, value: Any, what: str) -> Any:
        if isinstance(value, (jax.Array, np.ndarray, Tracer)):
            raise TypeError(
                f"aotgrad.compile({self.fn_name}): {what} as static, but it is an array "
                f"({_describe(value)}). Static arguments must be hashable Python values; "
                f"pass arrays as ordinary (dynamic) arguments.")
        try:
            hash(value)
        except TypeError:
            raise TypeError(
                f"aotgrad.compile({self.fn_name}): {what} as static, but its value "
                f"{_describe(value)} is not hashable. Static arguments must be hashable "
                f"(use a tuple instead of a list, a frozen dataclass instead of a dict).") from None
        return value

    def merge(self, static: tuple, dyn_args: Sequence, dyn_kwargs: dict) -> tuple[tuple, dict]:
        """Inverse of `split`."""
        pos = {k: v for k, v in static if isinstance(k, int)}
        n = len(dyn_args) + len(pos)
        it = iter(dyn_args)
        args = tuple(pos[i] if i in pos or (i - n) in pos else next(it) for i in range(n))
        kwargs = dict(dyn_kwargs)
        kwargs.update({k: v for k, v in static if isinstance(k, str)})
        return args, kwargs

    def flatten(self, dyn_args: tuple, dyn_kwargs: dict) -> tuple[list, Any]:
        """Flattens dynamic arguments; every leaf must be an array or a scalar."""
        leaves, tree = tree_flatten((dyn_args, dyn_kwargs))
        for i, leaf in enumerate(leaves):
            if not _is_array_like(leaf):
                path = leaf_paths(self, tree, dyn_args, dyn_kwargs)[i]
                raise TypeError(
                    f"aotgrad.compile({self.fn_name}): argument {path} is a {_describe(leaf)}; "
                    f"expected a jax.Array, a numpy array or a Python scalar. Mark the argument "
                    f"static (static_argnums / static_argnames) if it is configuration, or "
                    f"register its type as a pytree.")
        return leaves, tree


def leaf_paths(spec: ArgSpec, tree: Any, dyn_args: tuple | None = None,
               dyn_kwargs: dict | None = None) -> list[str]:
    """Readable paths (``params['w']``, ``batch[0]``) of the dynamic leaves."""
    if dyn_args is None:
        dyn_args, dyn_kwargs = tree_unflatten(tree, [0] * tree.num_leaves)
    # Map positions among dynamic args back to positions among all args.
    dyn_positions = [i for i in range(len(dyn_args) + len(spec.static_argnums))
                     if i not in spec.static_argnums][:len(dyn_args)]
    paths = []
    for path, _ in tree_flatten_with_path((dyn_args, dyn_kwargs))[0]:
        head, rest = path[0].idx, path[1:]
        if head == 0:
            name = spec.arg_name(dyn_positions[rest[0].idx])
        else:
            name = str(rest[0].key)
        paths.append(name + keystr(tuple(rest[1:])))
    return paths


def check_output_leaves(fn_name: str, out: Any) -> None:
    """A function must return arrays (or scalars) only."""
    flat, _ = tree_flatten_with_path(out)
    for path, leaf in flat:
        if not _is_array_like(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"aotgrad.compile({fn_name}): the function returned a {_describe(leaf)} at output "
                f"{'out' + keystr(path)}; every output leaf must be an array or a scalar.")


def describe_key_change(spec: ArgSpec, old: CallKey, new: CallKey) -> list[str]:
    """Why `new` missed the cache, relative to the most recently used key `old`."""
    reasons = []
    if old.in_tree != new.in_tree:
        reasons.append(f"argument structure changed: {old.in_tree} -> {new.in_tree}")
    else:
        paths = leaf_paths(spec, new.in_tree)
        for path, a, b in zip(paths, old.leaves, new.leaves):
            if a != b:
                reasons.append(f"argument {path} changed: {key_text(a)} -> {key_text(b)}")
    if old.static != new.static:
        old_s, new_s = dict(old.static), dict(new.static)
        for k in sorted(set(old_s) | set(new_s), key=str):
            if old_s.get(k) != new_s.get(k):
                name = spec.arg_name(k) if isinstance(k, int) else k
                reasons.append(f"static argument {name} changed: {old_s.get(k)!r} -> {new_s.get(k)!r}")
    if old.autocast != new.autocast:
        reasons.append(f"autocast changed: {old.autocast or 'off'} -> {new.autocast or 'off'}")
    for (name, a), (_, b) in zip(old.options, new.options):
        if a != b:
            reasons.append(f"option aotgrad.config.{name} changed: {a!r} -> {b!r}")
    return reasons or ["no previous entry matched"]
