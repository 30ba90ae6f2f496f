"""How a step's arguments are placed on a target's devices, without any data.

Every array leaf (a `jax.Array`, a NumPy array or a `jax.ShapeDtypeStruct`) becomes a
`ShapeDtypeStruct` with a `NamedSharding` on the target's one-axis mesh ("data"); other
leaves (Python numbers, strings, functions: an Equinox module's static parts) are not
arrays the step is compiled over, and are passed to the function as they are.

Which leaves are split over the devices (`sharding=`):
- "dp" (or None): the first argument (the parameters) is replicated; every other
  argument, positional or keyword, is the batch, split on its leading axis;
- "fsdp": as "dp", and each parameter is split on its largest axis that the device count
  divides (replicated where none does: `fsdp_spec`);
- a tuple with one entry per positional argument, each a `PartitionSpec`, a
  `NamedSharding` or a pytree prefix of that argument made of them (None: replicated);
  keyword arguments are the batch, as under "dp".
A split that does not divide an axis is an error naming the leaf's path.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from aotgrad.targets import AXIS

__all__ = ["Placed", "PlacementError", "fsdp_spec", "is_array", "per_device_bytes", "place", "spec_tree"]

SHARDINGS = ("dp", "fsdp")


class PlacementError(ValueError):
    """A sharding that does not fit the arguments."""


def is_array(x: Any) -> bool:
    """An array leaf: anything with a shape and a dtype (Python numbers are not)."""
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (int, float, complex, bool))


def fsdp_spec(shape: Sequence[int], n: int) -> PartitionSpec:
    """A parameter's largest axis that `n` devices divide, split over them (replicated if none)."""
    for a in sorted(range(len(shape)), key=lambda a: -shape[a]):
        if shape[a] % n == 0 and shape[a] >= n:
            return PartitionSpec(*[(AXIS if i == a else None) for i in range(len(shape))])
    return PartitionSpec()


def _batch_spec(shape: Sequence[int], n: int) -> PartitionSpec:
    return PartitionSpec(AXIS) if n > 1 and len(shape) else PartitionSpec()


def spec_tree(sharding: Any, params: Any, rest: Sequence[Any], n: int) -> tuple[Any, list[Any]]:
    """PartitionSpecs (or None) for the parameters and each other argument, as prefixes."""
    if sharding is None or sharding == "dp":
        return PartitionSpec(), [None] * len(rest)  # None: the batch rule
    if sharding == "fsdp":
        return (jax.tree.map(lambda x: fsdp_spec(x.shape, n) if is_array(x) else None, params)
                if n > 1 else PartitionSpec()), [None] * len(rest)
    if isinstance(sharding, str):
        raise PlacementError(f"sharding must be 'dp', 'fsdp' or one PartitionSpec pytree per positional "
                             f"argument; got {sharding!r}.")
    if not isinstance(sharding, (tuple, list)) or len(sharding) != 1 + len(rest):
        raise PlacementError(f"sharding: give one entry (a PartitionSpec or a pytree prefix of them) per "
                             f"positional argument ({1 + len(rest)}); got {type(sharding).__name__} "
                             f"{sharding!r:.200}.")
    return sharding[0], [PartitionSpec() if s is None else s for s in sharding[1:]]


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, NamedSharding))


def _check(spec: Any, shape: Sequence[int], mesh: jax.sharding.Mesh, where: str) -> PartitionSpec:
    if isinstance(spec, NamedSharding):
        spec = spec.spec
    if spec is None:
        spec = PartitionSpec()
    if not isinstance(spec, PartitionSpec):
        raise PlacementError(f"sharding of {where}: expected a PartitionSpec or NamedSharding; got {spec!r}.")
    if len(spec) > len(shape):
        raise PlacementError(f"sharding of {where}: {spec} has {len(spec)} entries for shape {tuple(shape)}.")
    for axis, names in enumerate(spec):
        names = () if names is None else (names,) if isinstance(names, str) else tuple(names)
        unknown = [a for a in names if a not in mesh.shape]
        if unknown:
            raise PlacementError(f"sharding of {where}: {spec} names mesh axis {unknown[0]!r}; the target's mesh "
                                 f"has one axis, {AXIS!r}, of {mesh.size} devices.")
        ways = math.prod(mesh.shape[a] for a in names)
        if shape[axis] % ways:
            raise PlacementError(f"sharding of {where}: axis {axis} of shape {tuple(shape)} is not divisible by "
                                 f"the {ways} devices it is split over ({spec}).")
    return spec


def _path(prefix: str, path: Any) -> str:
    return prefix + jax.tree_util.keystr(path)


class Placed:
    """The arguments as `ShapeDtypeStruct`s on the mesh (`dynamic`: None at each non-array
    leaf) and how to put the non-array leaves back (`merge`)."""

    def __init__(self, tree: Any, specs: Any, mesh: jax.sharding.Mesh, where: str,
                 batch_rule: Callable[[Sequence[int], int], PartitionSpec] | None = None) -> None:
        leaves, self.treedef = jax.tree.flatten(tree)
        self.static = [None if is_array(x) else x for x in leaves]
        if batch_rule is not None:  # no specs given: the rule decides per leaf
            specs = jax.tree.map(lambda x: batch_rule(x.shape, mesh.size) if is_array(x) else None, tree)
        full = jax.tree.broadcast(specs, tree, is_leaf=_is_spec)
        spec_leaves = jax.tree.leaves(full, is_leaf=_is_spec)
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        out = []
        for x, spec, path in zip(leaves, spec_leaves, paths, strict=True):
            if not is_array(x):
                out.append(None)
                continue
            spec = _check(spec, x.shape, mesh, _path(where, path))
            out.append(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)))
        self.dynamic = self.treedef.unflatten(out)

    def merge(self, dynamic: Any) -> Any:
        """The argument with its non-array leaves back in place (`dynamic` as `self.dynamic`)."""
        values = jax.tree.leaves(dynamic, is_leaf=lambda x: x is None)  # None where a static leaf goes
        return self.treedef.unflatten([v if s is None else s for s, v in zip(self.static, values, strict=True)])


def place(params: Any, rest: Sequence[Any], kwargs: dict[str, Any], mesh: jax.sharding.Mesh,
          sharding: Any) -> tuple[Placed, list[Placed], Placed]:
    """The parameters, the other positional arguments and the keyword arguments, placed."""
    n = mesh.size
    try:
        param_specs, rest_specs = spec_tree(sharding, params, rest, n)
        placed_params = Placed(params, param_specs, mesh, "args[0]")
        placed_rest = [Placed(a, s, mesh, f"args[{i + 1}]", None if s is not None else _batch_spec)
                       for i, (a, s) in enumerate(zip(rest, rest_specs, strict=True))]
        placed_kwargs = Placed(kwargs, None, mesh, "kwargs", _batch_spec)
    except ValueError as e:  # jax.tree.broadcast: a prefix that does not match the argument
        if isinstance(e, PlacementError):
            raise
        raise PlacementError(f"sharding: {e}") from None
    return placed_params, placed_rest, placed_kwargs


def per_device_bytes(tree: Any) -> int:
    """Bytes of one device's shards of placed `ShapeDtypeStruct`s."""
    return sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize
               for s in jax.tree.leaves(tree) if s is not None)
