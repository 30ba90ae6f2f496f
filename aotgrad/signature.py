"""How a call's arguments become a cache key: static/dynamic split, pytree flattening,
leaf validation, and the readable difference between two keys (for recompile logs)."""
from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import jax
import numpy as np
from jax.tree_util import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from aotgrad._jax_internals import ArrayImpl, Tracer, varying_axes

__all__ = ["ArgSpec", "CallKey", "Static", "argnum_positions", "aval_key", "check_in_range", "check_output_leaves",
           "describe_key_change", "key_distance", "key_text", "leaf_key", "leaf_paths", "normalize_argnums"]

_SCALARS = (bool, int, float, complex, np.generic)


def _is_array_like(x: Any) -> bool:
    return type(x) is ArrayImpl or isinstance(x, (jax.Array, np.ndarray, Tracer, jax.ShapeDtypeStruct, *_SCALARS))


_ARRAYS = (jax.Array, np.ndarray, np.generic, Tracer, jax.ShapeDtypeStruct)
_PY_SCALARS = (bool, int, float, complex)
PYTHON_SCALARS = ("traced", "static")


def _is_position(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def normalize_argnums(who: str, argnums: Any, name: str = "argnums",
                      what: str = "positions of the arguments to differentiate") -> tuple[tuple[int, ...], bool]:
    """The one rule for argument positions (`argnums`, `static_argnums`, `donate_argnums`):
    a Python or NumPy int, or a tuple or list of them, as a tuple of Python ints, and whether
    a single int was given (then, as in `jax.grad`, one gradient comes back, not a tuple).
    Bools are not positions. Anything else is a TypeError naming `name`, what it takes
    (`what`) and what it got. Ranges are checked where the number of arguments is known
    (`argnum_positions`)."""
    if _is_position(argnums):
        return (int(argnums),), True
    if isinstance(argnums, (tuple, list)):
        bad = [i for i in argnums if not _is_position(i)]
        if not bad:
            return tuple(int(i) for i in argnums), False
        got = f"{argnums!r}, whose element {bad[0]!r} is a {type(bad[0]).__name__}"
    else:
        got = f"{argnums!r} ({type(argnums).__name__})"
    raise TypeError(f"{who}: {name} takes an int or a sequence of ints ({what}); got {got}.")


def _out_of_range(nums: Sequence[int], n: int) -> list[int]:
    """The positions in `nums` that name none of `n` arguments (negative ones count from the end)."""
    return [i for i in nums if not -n <= i < n]


def check_in_range(who: str, name: str, nums: Sequence[int], n: int, params: Sequence[str] | None = None) -> None:
    """A ValueError naming `name` (`static_argnums`, `donate_argnums`) when a position in
    `nums` names none of `n` positional arguments: the function's parameters (`params`, where
    its signature fixes them, as `jax.jit` checks) or, where it takes *args, the call's."""
    bad = _out_of_range(nums, n)
    if bad:
        where = (f"the function has {n} positional parameters {list(params)}" if params is not None
                 else f"the call passes {n} positional arguments")
        raise ValueError(f"{who}: {name} {bad} out of range: {where}.")


def argnum_positions(who: str, argnums: Any, n_args: int) -> set[int]:
    """The positional arguments named by `argnums` (checked by `normalize_argnums`; negative
    numbers count from the end, as in `jax.grad`); a number outside the `n_args` arguments
    is a ValueError naming argnums."""
    nums, _ = normalize_argnums(who, argnums)
    bad = _out_of_range(nums, n_args)
    if bad:
        raise ValueError(f"{who}: argnums {bad} out of range for {n_args} positional arguments.")
    return {i % n_args for i in nums}


class Static:
    """A value kept out of tracing and put in the cache key: compared by (type, value) when
    hashable, else by identity (another object, even an equal one, compiles again). As a
    pytree node it has no children, so a tree holding it flattens to its traced leaves
    only, and its treedef carries the value."""
    __slots__ = ("value", "by_identity", "_key")

    def __init__(self, value: Any) -> None:
        self.value = value
        try:
            self._key: Any = (type(value), hash(value))
            self.by_identity = False
        except TypeError:
            self._key = id(value)
            self.by_identity = True

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Static) or self._key != other._key:
            return False
        if self.by_identity or other.by_identity:
            return self.value is other.value
        return type(self.value) is type(other.value) and bool(self.value == other.value)

    def __repr__(self) -> str:
        return repr(self.value)


jax.tree_util.register_pytree_node(Static, lambda s: ((), s), lambda s, _: s)


def unwrap_static(tree: Any) -> Any:
    """`tree` with every `Static` marker replaced by its value."""
    return jax.tree.map(lambda x: x.value if isinstance(x, Static) else x, tree,
                        is_leaf=lambda x: isinstance(x, Static))


def static_leaves(tree: Any) -> list[tuple[str, Static]]:
    """(readable path, marker) of every `Static` marker in `tree`."""
    flat = tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, Static))[0]
    return [(keystr(path), x) for path, x in flat if isinstance(x, Static)]


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
    with Explicit axes), plus the device and the mesh's size when the type names a device
    (a compile-only target's mesh: programs are built for it), plus the varying manual
    axes inside `shard_map`."""
    base = (aval.shape, aval.dtype, aval.weak_type)
    sharding = getattr(aval, "sharding", None)
    if sharding is not None and _EXPLICIT in getattr(sharding.mesh, "axis_types", ()):
        base += (sharding,)
    device = getattr(getattr(sharding, "mesh", None), "abstract_device", None)
    if device is not None:
        base += (device, sharding.mesh.size)
    varying = varying_axes(aval)
    return base + (varying,) if varying else base


# `aval_key` per type, worked out once: JAX interns its types (one object per distinct
# type, compared by identity), so a type is found by a cheap hash. Cleared when full.
_KEYS: dict[Any, tuple] = {}
_MAX_KEYS = 4096


def leaf_key(x: Any) -> tuple:
    """What tracing needs to know about one argument leaf; fast for concrete arrays."""
    aval = x.aval if type(x) is ArrayImpl else jax.typeof(x)
    key = _KEYS.get(aval)
    if key is None:
        if len(_KEYS) >= _MAX_KEYS:
            _KEYS.clear()
        key = _KEYS[aval] = aval_key(aval)
    return key


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
    python_scalars: str = "traced"  # or "static": Python bool/int/float/complex leaves
    fixed_arity: bool = False  # the signature is known and takes no *args: param_names are all positions

    @classmethod
    def of(cls, fn: Callable, static_argnums: int | Sequence[int],
           static_argnames: str | Sequence[str], python_scalars: str = "traced") -> "ArgSpec":
        fn_name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
        nums, _ = normalize_argnums(f"aotgrad.compile({fn_name})", static_argnums, "static_argnums",
                                    "positions of the static arguments")
        names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
        try:
            all_params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            all_params = None
        params = [p for p in all_params or () if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        param_names = tuple(p.name for p in params)
        fixed_arity = all_params is not None and all(p.kind != p.VAR_POSITIONAL for p in all_params)
        if all_params is not None:
            _check_static_names(fn_name, all_params, param_names, nums, names)
        # As jax.jit does: a static position also makes its name static, and vice versa.
        nums = tuple(sorted(set(nums) | {i for i, n in enumerate(param_names) if n in names}))
        names = tuple(sorted(set(names) | {param_names[i] for i in nums if 0 <= i < len(param_names)}))
        if python_scalars not in PYTHON_SCALARS:
            raise ValueError(f"aotgrad.compile({fn_name}): python_scalars must be one of "
                             f"{list(PYTHON_SCALARS)}; got {python_scalars!r}.")
        return cls(fn_name, nums, names, param_names, python_scalars, fixed_arity)

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
        except TypeError:  # keyed by identity
            return Static(value)
        return value

    def merge(self, static: tuple, dyn_args: Sequence, dyn_kwargs: dict) -> tuple[tuple, dict]:
        """Inverse of `split`."""
        static = tuple((k, v.value if isinstance(v, Static) else v) for k, v in static)
        pos = {k: v for k, v in static if isinstance(k, int)}
        n = len(dyn_args) + len(pos)
        it = iter(dyn_args)
        args = tuple(pos[i] if i in pos or (i - n) in pos else next(it) for i in range(n))
        kwargs = dict(dyn_kwargs)
        kwargs.update({k: v for k, v in static if isinstance(k, str)})
        return args, kwargs

    def traced(self, leaf: Any) -> bool:
        """Arrays are traced, and Python scalars unless `python_scalars="static"`."""
        return (type(leaf) is ArrayImpl or isinstance(leaf, _ARRAYS)
                or (self.python_scalars == "traced" and isinstance(leaf, _PY_SCALARS)))

    def flatten(self, dyn_args: tuple, dyn_kwargs: dict) -> tuple[list, Any]:
        """Flattens dynamic arguments into their traced leaves; every other leaf (functions,
        strings, arbitrary objects) becomes a `Static` marker in the tree structure. Python
        scalars inside an `equinox.Module` are static, as under `eqx.filter_jit`."""
        leaves, tree = tree_flatten((dyn_args, dyn_kwargs))
        for x in leaves:  # (a loop: every call takes this path)
            if type(x) is not ArrayImpl and not isinstance(x, _ARRAYS):
                break
        else:  # arrays only
            return leaves, tree
        if self.python_scalars == "traced":
            leaves, tree = tree_flatten(_module_scalars_static((dyn_args, dyn_kwargs)))
        marked = [x if self.traced(x) else Static(x) for x in leaves]
        return tree_flatten(tree_unflatten(tree, marked))


def _module_scalars_static(tree: Any) -> Any:
    """`tree` with every Python scalar inside an `equinox.Module` wrapped in `Static`: in
    Equinox a module's int, float and bool fields are configuration (sizes, flags), static
    under `eqx.filter_jit`. Nothing changes where Equinox is not imported."""
    eqx = sys.modules.get("equinox")
    if eqx is None:
        return tree

    def is_module(node: Any) -> bool:
        return isinstance(node, eqx.Module)

    def mark(node: Any) -> Any:
        if not is_module(node):
            return node
        return jax.tree.map(lambda x: Static(x) if isinstance(x, _PY_SCALARS) else x, node)
    return jax.tree.map(mark, tree, is_leaf=is_module)


def _check_static_names(fn_name: str, params: list, positional: tuple[str, ...], nums: tuple,
                        names: tuple) -> None:
    """As `jax.jit`: static_argnums must be positional parameters (unless the function takes
    *args), static_argnames parameter names (unless it takes **kwargs)."""
    kinds = {p.kind for p in params}
    if inspect.Parameter.VAR_POSITIONAL not in kinds:
        check_in_range(f"aotgrad.compile({fn_name})", "static_argnums", nums, len(positional), positional)
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        known = {p.name for p in params if p.kind != inspect.Parameter.VAR_POSITIONAL}
        bad_names = [k for k in names if k not in known]
        if bad_names:
            raise ValueError(f"aotgrad.compile({fn_name}): static_argnames {bad_names} name no parameter "
                             f"of the function; its parameters are {sorted(known)}.")


def leaf_paths(spec: ArgSpec, tree: Any, static: bool = False) -> list[str]:
    """Readable paths (``params['w']``, ``batch[0]``) of the traced leaves (with `static`:
    of the `Static` markers)."""
    dyn_args, dyn_kwargs = tree_unflatten(tree, [0] * tree.num_leaves)
    # Map positions among dynamic args back to positions among all args.
    dyn_positions = [i for i in range(len(dyn_args) + len(spec.static_argnums))
                     if i not in spec.static_argnums][:len(dyn_args)]
    paths = []
    flat = tree_flatten_with_path((dyn_args, dyn_kwargs), is_leaf=lambda x: isinstance(x, Static))[0]
    for path, leaf in flat:
        if isinstance(leaf, Static) != static:
            continue
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


def key_distance(old: CallKey, new: CallKey) -> int:
    """How many fields of two keys differ (leaves are compared one by one when the
    argument structures agree)."""
    d = int(old.autocast != new.autocast) + sum(a != b for a, b in zip(old.options, new.options, strict=True))
    d += len(set(old.static) ^ set(new.static))
    if old.in_tree != new.in_tree:
        return d + 1 + abs(len(old.leaves) - len(new.leaves))
    return d + sum(a != b for a, b in zip(old.leaves, new.leaves, strict=True))


def describe_key_change(spec: ArgSpec, old: CallKey, new: CallKey) -> list[str]:
    """Why `new` missed the cache, relative to a cached key `old` (the nearest one)."""
    reasons = []
    if old.in_tree != new.in_tree:
        olds, news = (static_leaves(tree_unflatten(k.in_tree, [0] * k.in_tree.num_leaves))
                      for k in (old, new))
        if [p for p, _ in olds] == [p for p, _ in news] and olds != news:
            paths = leaf_paths(spec, new.in_tree, static=True)
            reasons += [f"static argument leaf {path} changed: {a!r} -> {b!r}"
                        for path, (_, a), (_, b) in zip(paths, olds, news, strict=True) if a != b]
        else:
            reasons.append(f"argument structure changed: {old.in_tree} -> {new.in_tree}")
    else:
        paths = leaf_paths(spec, new.in_tree)
        for path, a, b in zip(paths, old.leaves, new.leaves, strict=True):
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
    for (name, a), (_, b) in zip(old.options, new.options, strict=True):
        if a != b:
            reasons.append(f"option aotgrad.config.{name} changed: {a!r} -> {b!r}")
    return reasons or ["no previous entry matched"]
