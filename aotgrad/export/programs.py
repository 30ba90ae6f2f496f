"""An export's loaded programs as an entry: the `jax.export` forward-only program as the
entry's forward, and the exported forward and backward as `runtime.Pair`s (`LoadedPair`),
so calls, the `custom_vjp` rule and `fwd_and_bwd` run them as they run compiled ones."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding
from jax.tree_util import tree_leaves, tree_structure, tree_unflatten

from aotgrad.entry import Entry
from aotgrad.export.blob import ExportError
from aotgrad.hooks import ArgLayout
from aotgrad.runtime import Saved, Timings
from aotgrad.signature import ArgSpec, leaf_paths

__all__ = ["LoadedForward", "LoadedPair", "LoadedPrograms", "concrete", "loaded_entry", "spec", "spec_of"]


@dataclasses.dataclass(frozen=True)
class LoadedForward:
    """The loaded forward-only program, as an entry reads a forward (`entry.Forward`)."""
    consts: tuple[Any, ...]
    in_avals: tuple[Any, ...]
    out_avals: tuple[Any, ...]
    out_tree: Any
    flat: Callable[..., list[Any]]  # (consts..., argument leaves...) -> flat outputs: the program's call

    @functools.cached_property
    def jaxpr(self) -> Any:
        """Argument leaves -> flat outputs, closing over `consts`: a call of the program."""
        n = len(self.consts)
        return jax.make_jaxpr(lambda *leaves: self.flat(*self.consts, *leaves))(*self.in_avals[n:])


@dataclasses.dataclass(frozen=True)
class LoadedPrograms:
    """The exported forward and backward, as they run (jitted calls of the programs)."""
    forward: Any  # jitted: inputs -> outputs, saved activations
    backward: Any  # jitted: saved activations, saved inputs, cotangents -> gradients
    saved_inputs: tuple[int, ...]  # the inputs the backward reads
    perturbed: tuple[bool, ...]  # the inputs the export differentiates
    has_ct: tuple[bool, ...]  # the outputs whose cotangents its backward takes
    out_avals: tuple[Any, ...]


def concrete(shape: Sequence[Any]) -> bool:
    return all(isinstance(d, (int, np.integer)) for d in shape)


def spec(x: Any) -> jax.ShapeDtypeStruct:
    """The export spec of one input: its type, and its sharding when it spans devices."""
    sharding = getattr(x, "sharding", None)
    if sharding is not None and (type(sharding) is SingleDeviceSharding or len(sharding.device_set) == 1):
        sharding = None
    aval = jax.typeof(x) if not isinstance(x, jax.ShapeDtypeStruct) else x
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False),
                                sharding=sharding)


class LoadedPair:
    """The exported forward and backward, seen by one differentiation pattern (a
    `runtime.Pair`): `perturbed` and `has_ct` are subsets of those exported (cotangents the
    pattern lacks are zeros, gradients it does not ask for are dropped)."""

    def __init__(self, owner: str, programs: LoadedPrograms, perturbed: tuple[bool, ...],
                 has_ct: tuple[bool, ...], in_avals: tuple[Any, ...]) -> None:
        self.owner = owner
        self.programs = programs
        self.perturbed = perturbed
        self.has_ct = has_ct
        self.in_avals = in_avals
        self.n_outs = len(programs.out_avals)
        self.layouts: dict[object, Any] = {}
        self._keep = [p for p, q in zip(perturbed, programs.perturbed, strict=True) if q]

    def run_forward(self, inputs: Sequence[Any], hooks: Any = None) -> tuple[list[Any], Saved]:
        if hooks is not None:
            raise ExportError(f"aotgrad.Exported({self.owner}): its backward is the exported program; "
                              f"hooks cannot run in it.")
        results = self.programs.forward(*inputs)
        saved = list(results[self.n_outs:])
        saved.extend(inputs[i] for i in self.programs.saved_inputs)
        return list(results[:self.n_outs]), Saved(saved, self)

    def run_backward(self, saved: Saved, cts: Sequence[Any],
                     present: tuple[bool, ...] | None = None) -> list[Any]:
        """`present`: which of the cotangents `has_ct` names are given (the others are
        zero: the exported backward takes them all, so they are filled in)."""
        given = iter(cts)
        marks = iter(present) if present is not None else None
        full = []
        for j, (want, have) in enumerate(zip(self.programs.has_ct, self.has_ct, strict=True)):
            here = have and (marks is None or next(marks))
            if want:
                aval = self.programs.out_avals[j]
                full.append(next(given) if here else jax.numpy.zeros(aval.shape, aval.dtype))
        grads = self.programs.backward(*saved.arrays, *full)
        return [g for g, keep in zip(grads, self._keep, strict=True) if keep]

    def lower(self, inputs: Sequence[Any]) -> tuple[Any, Any, Timings]:
        """Both programs lowered for these inputs (the backward for the saved values and
        cotangents they give)."""
        results = jax.eval_shape(self.programs.forward, *inputs)
        outs = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in results[:self.n_outs]]
        specs = [*results[self.n_outs:], *(spec(inputs[i]) for i in self.programs.saved_inputs),
                 *(o for o, c in zip(outs, self.programs.has_ct, strict=True) if c)]
        return self.programs.forward.lower(*inputs), self.programs.backward.lower(*specs), Timings()


def _pair(programs: LoadedPrograms, entry: Entry, perturbed: tuple[bool, ...],
          has_ct: tuple[bool, ...], staged: bool) -> LoadedPair:
    """The loaded pair of a pattern (an `entry.PairMaker`; the exported programs serve a
    step under `jax.jit` too: `staged` is never asked for); asking for a gradient the export
    does not compute is an error that names the arguments."""
    n, paths = len(entry.fwd.consts), entry.layout.paths
    extra = [paths[i - n] for i, (p, q) in enumerate(zip(perturbed, programs.perturbed, strict=True))
             if p and not q and i >= n]
    if extra:
        have = [paths[i - n] for i, q in enumerate(programs.perturbed) if q and i >= n]
        raise ExportError(
            f"aotgrad.Exported({entry.owner}): a gradient was asked for argument(s) "
            f"{', '.join(extra)}, which the export does not differentiate (it differentiates "
            f"{', '.join(have) or 'nothing'}). Export again with argnums naming them.")
    has_ct = tuple(h and e for h, e in zip(has_ct, programs.has_ct, strict=True))
    return LoadedPair(entry.owner, programs, perturbed, has_ct, tuple(entry.fwd.in_avals))


def spec_of(meta: dict[str, Any]) -> ArgSpec:
    """The exported function's arguments (names, static ones), from its metadata."""
    return ArgSpec(meta["name"], tuple(meta["static_argnums"]), tuple(meta["static_argnames"]),
                   tuple(meta["param_names"]), meta["python_scalars"])


def loaded_entry(meta: dict[str, Any], programs: dict[str, Any], consts: tuple[Any, ...]) -> Entry:
    """The entry of the three loaded `jax.export` programs: no hooks, and the exported
    differentiation pattern by default."""
    fo = programs["forward_only"]
    consts_tree, args_tree, kwargs_tree = fo.in_tree.children()[0].children()
    in_tree = _tuple_tree(args_tree, kwargs_tree)
    arg_positions = tuple(meta["arg_positions"])
    n_args = len(arg_positions) + sum(isinstance(k, int) for k, _ in meta["static"])  # static ones too
    paths = tuple(leaf_paths(spec_of(meta), in_tree))
    layout = ArgLayout(meta["name"], len(consts), in_tree, arg_positions, n_args, paths, fo.out_tree)
    fo_args = _tuple_tree(consts_tree, args_tree, kwargs_tree)

    def flat(*inputs: Any) -> list[Any]:
        return tree_leaves(fo.call(*tree_unflatten(fo_args, inputs)))

    fwd = LoadedForward(consts, tuple(fo.in_avals), tuple(fo.out_avals), fo.out_tree, flat)
    loaded = LoadedPrograms(jax.jit(programs["forward"].call), jax.jit(programs["backward"].call),
                            tuple(meta["saved_inputs"]), tuple(meta["perturbed"]), tuple(meta["has_ct"]),
                            fwd.out_avals)
    return Entry(layout, fwd, jax.jit(flat), functools.partial(_pair, loaded), None, loaded.perturbed)


def _tuple_tree(*trees: Any) -> Any:
    """The structure of a tuple of these structures (in the default pytree registry)."""
    return tree_structure(tuple(tree_unflatten(t, [0] * t.num_leaves) for t in trees))
