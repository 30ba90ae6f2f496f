"""`fwd_and_bwd`: separate forward and backward functions over the same entries and
program pairs as calls, with the gradients regrouped per argument and the cotangent checked."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.tree_util import keystr, tree_flatten, tree_flatten_with_path, tree_structure, tree_unflatten

from aotgrad.api.function import AOTFunction
from aotgrad.api.function import compile as aot_compile
from aotgrad.entry import Entry
from aotgrad.runtime import Pair, Saved
from aotgrad.signature import (ArrayImpl, Static, argnum_positions, aval_key, key_text, leaf_key, normalize_argnums,
                               static_leaves)

__all__ = ["fwd_and_bwd"]


def fwd_and_bwd(fn: Callable, argnums: int | Sequence[int] = 0,
                has_aux: bool = False) -> tuple[Callable, Callable]:
    """Separate forward and backward functions, with the contract of `jax.fwd_and_bwd`.

    `fwd(*args) -> (out, saved)` (or `(out, saved, aux)` with `has_aux`);
    `bwd(saved, ct) -> grads` for the arguments in `argnums` (a single value when `argnums`
    is an int). `saved` is a pytree of `jax.Array`s: count it, move it, offload it.
    """
    f = fn if isinstance(fn, AOTFunction) else aot_compile(fn)
    nums, single = normalize_argnums(f"aotgrad.fwd_and_bwd({f.name})", argnums)
    if not nums:
        raise ValueError("aotgrad.fwd_and_bwd: argnums must name at least one argument.")

    token = object()  # identifies this fwd_and_bwd in the entries and pairs it uses

    def fwd(*args: Any) -> tuple[Any, ...]:
        entry, inputs = f.entries.resolve(args, {})
        pair = entry.plans.get(token)
        if pair is None:
            pair, layout = _plan(f.name, entry, len(args), nums, has_aux)
            entry.plans[token] = pair
            pair.layouts[token] = layout
        outs, saved = pair.run_forward(inputs, entry.in_force())
        out = tree_unflatten(entry.fwd.out_tree, outs)
        return (out[0], saved, out[1]) if has_aux else (out, saved)

    def bwd(saved: Saved, ct: Any) -> Any:
        if not isinstance(saved, Saved):
            raise TypeError(f"aotgrad.fwd_and_bwd({f.name}): bwd expects the `saved` returned by "
                            f"its fwd; got {type(saved).__name__}.")
        pair = saved.pair
        layout = pair.layouts.get(token)
        if layout is None:
            raise ValueError(
                f"aotgrad.fwd_and_bwd({f.name}): `saved` was produced by another forward "
                f"({saved.pair.owner!r}, or another fwd_and_bwd / argnums); pass the `saved` "
                f"returned by this fwd_and_bwd's own fwd.")
        grads = pair.run_backward(saved, _check_cotangent(f.name, pair, layout, ct))
        if layout.contiguous:  # every leaf has a gradient, in order: regroup by slicing
            per_arg = [tree_unflatten(tree, grads[s:e]) for tree, s, e in layout.contiguous]
        else:
            per_arg = [tree_unflatten(tree, [grads[k] if isinstance(k, int) else k for k in picks])
                       for tree, picks in layout.args]
        if layout.has_static:  # non-array leaves get None, as in eqx.filter_grad
            per_arg = [jax.tree.map(lambda x: None if isinstance(x, Static) else x, a,
                                    is_leaf=lambda x: isinstance(x, Static)) for a in per_arg]
        return per_arg[0] if single else tuple(per_arg)

    return fwd, bwd


def _plan(name: str, entry: Entry, n_args: int, nums: tuple[int, ...],
          has_aux: bool) -> tuple[Pair, "_GradLayout"]:
    """The program pair and gradient layout for one signature of a fwd_and_bwd."""
    perturbed = entry.perturbed_for(argnum_positions(f"aotgrad.fwd_and_bwd({name})", nums, n_args))
    has_ct = entry.default_has_ct()
    out_tree = entry.fwd.out_tree
    if has_aux:
        children = out_tree.children()
        if len(children) != 2:
            raise TypeError(f"aotgrad.fwd_and_bwd({name}, has_aux=True): the function must return "
                            f"a pair (output, aux); it returned a pytree of structure {out_tree}.")
        out_tree = children[0]
        has_ct = has_ct[:out_tree.num_leaves] + (False,) * (len(has_ct) - out_tree.num_leaves)
    pair = entry.pair(perturbed, has_ct)
    return pair, _GradLayout.of(entry, pair, nums, n_args, out_tree)


@dataclasses.dataclass(frozen=True)
class _GradLayout:
    """How the backward's outputs regroup into one pytree per differentiated argument, and
    what the output cotangent must look like."""
    args: tuple[tuple[Any, tuple[Any, ...]], ...]  # per argnum: (treedef, picks); a pick is an
    # index into the backward's outputs, or a float0 zero for a leaf without a gradient
    out_tree: Any  # structure of the differentiated output (without aux)
    out_paths: tuple[str, ...]  # readable path of each output leaf
    ct_keys: tuple[Any, ...]  # leaf_key of each output leaf
    contiguous: tuple[tuple[Any, int, int], ...] | None  # (treedef, start, end) when every
    # pick is an index and the picks are 0, 1, 2, ... in order
    has_static: bool  # an argument tree holds `Static` markers (non-array leaves)

    @property
    def single_ct(self) -> bool:
        return self.out_tree.num_leaves == 1 and self.out_tree.num_nodes == 1

    @classmethod
    def of(cls, entry: Entry, pair: Pair, nums: tuple[int, ...], n_args: int,
           out_tree: Any) -> "_GradLayout":
        n = len(entry.fwd.consts)
        dyn_args, _ = tree_unflatten(entry.in_tree, [0] * entry.in_tree.num_leaves)
        grad_index = {i: k for k, i in enumerate(i for i, p in enumerate(pair.perturbed) if p)}
        args = []
        for i in nums:
            pos = i % n_args
            if pos not in entry.arg_positions:
                raise ValueError(f"aotgrad.fwd_and_bwd({entry.owner}): argnums includes {i}, a "
                                 f"static argument; only array arguments can be differentiated.")
            leaves = [n + j for j, p in enumerate(entry.leaf_args) if p == pos]
            picks = tuple(grad_index[j] if j in grad_index
                          else np.zeros(pair.in_avals[j].shape, jax.dtypes.float0) for j in leaves)
            args.append((tree_structure(dyn_args[entry.arg_positions.index(pos)]), picks))
        dummy = tree_unflatten(out_tree, [0] * out_tree.num_leaves)
        paths = tuple(keystr(p) for p, _ in tree_flatten_with_path(dummy)[0])
        keys = tuple(aval_key(a) for a in entry.fwd.out_avals[:out_tree.num_leaves])
        flat = [k for _, picks in args for k in picks]
        contiguous = None
        if all(isinstance(k, int) for k in flat) and flat == list(range(len(flat))):
            bounds = itertools.accumulate(len(picks) for _, picks in args)
            contiguous = tuple((tree, end - len(picks), end)
                               for (tree, picks), end in zip(args, bounds, strict=True))
        has_static = any(static_leaves(tree_unflatten(tree, [0] * tree.num_leaves)) for tree, _ in args)
        return cls(tuple(args), out_tree, paths, keys, contiguous, has_static)


def _check_cotangent(name: str, pair: Pair, layout: _GradLayout, ct: Any) -> list[Any]:
    """Validates `ct` against the output; returns the cotangents of outputs that take one."""
    if layout.single_ct and type(ct) is ArrayImpl and pair.has_ct[0] and leaf_key(ct) == layout.ct_keys[0]:
        return (ct,)  # the common case: one array output
    leaves, tree = tree_flatten(ct)
    if tree != layout.out_tree:
        raise ValueError(f"aotgrad.fwd_and_bwd({name}): the cotangent has structure {tree}; "
                         f"expected the output's structure {layout.out_tree}.")
    if all(pair.has_ct) and tuple(map(leaf_key, leaves)) == layout.ct_keys:
        return leaves  # the common case, checked at once
    cts = []
    for j, (leaf, take) in enumerate(zip(leaves, pair.has_ct)):
        if not take:
            continue
        got, want = leaf_key(leaf), layout.ct_keys[j]
        if got != want:
            if got[:2] == want[:2] or (got[0] == want[0] and got[2]):  # weak scalar: take its value
                leaf = jax.numpy.asarray(leaf, want[1])
            else:
                raise ValueError(
                    f"aotgrad.fwd_and_bwd({name}): the cotangent at ct{layout.out_paths[j]} is "
                    f"{key_text(got)}; expected {key_text(want)}, the shape and dtype of the "
                    f"output of the forward that produced `saved`.")
        cts.append(leaf)
    return cts
