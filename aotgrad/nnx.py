"""Flax NNX graph nodes (modules, `nnx.Rngs`, variables) as arguments of a compiled function.

Done as `nnx.jit` does it, with flax's own helpers (`flax.nnx.extract`): outside the call,
each graph node becomes a tree of its graph definition (static, part of the cache key) and
its state (the arrays, traced). The traced function rebuilds the nodes from the state,
runs (BatchNorm moves its statistics, Dropout advances its RNG counter) and returns, next
to the output, the value of every `Variable` it changed; after the call those values are
written back into the caller's objects. Variables that did not change are not returned,
so a module read under an enclosing trace stays untouched, as in plain nnx.

flax is imported only once a call passes a graph node, which needs flax imported already.
"""
from __future__ import annotations

import functools
import sys
import weakref
from typing import TYPE_CHECKING, Any, Callable

import jax
from jax.tree_util import keystr

from aotgrad.hooks import HOOK, LEAF, PREHOOK, Hook, Hooks
from aotgrad.signature import ArgSpec

if TYPE_CHECKING:
    from aotgrad.api import AOTFunction

__all__ = ["NnxCall", "UserView", "has_graph_nodes"]


def _is_node(x: Any) -> bool:
    from flax.nnx import graphlib, variablelib
    return graphlib.is_graph_node(x) or isinstance(x, variablelib.Variable)


def has_graph_nodes(args: tuple, kwargs: dict) -> bool:
    """Whether any argument leaf is an nnx graph node or Variable (False without flax)."""
    if "flax.nnx" not in sys.modules:
        return False
    return any(map(_is_node, jax.tree.leaves((args, kwargs), is_leaf=_is_node)))


def _graphdefs(tree: Any) -> list[tuple[str, Any]]:
    from flax.nnx import extract
    return [(keystr(path), node.graphdef) for path, node in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, extract.TreeState))[0] if isinstance(node, extract.TreeState)]


class NnxCall:
    """Calls one compiled function whose arguments hold graph nodes: the function aotgrad
    traces takes the nodes' states and returns (output, updated Variables)."""

    def __init__(self, spec: ArgSpec, fn: Callable[..., Any],
                 compile_on_states: Callable[[Callable[..., Any]], "AOTFunction"]) -> None:
        """`spec`: the compiled function's arguments; `fn`: the user's function;
        `compile_on_states`: compiles the function on states with the compiled function's
        options and hooks (`api.function` passes it)."""
        self.name = spec.fn_name
        self.spec = spec

        @functools.wraps(fn)
        def on_states(*pure_args: Any, **pure_kwargs: Any) -> Any:
            from flax.nnx import extract
            pure_args, pure_kwargs = extract.copy_var_structure((pure_args, pure_kwargs))
            current, snapshot = extract.snapshot(extract.labeled(args=pure_args, kwargs=pure_kwargs))
            args, kwargs = extract.from_tree2((pure_args, pure_kwargs))
            out = extract.to_tree2(fn(*args, **kwargs))
            extract.check_no_aliases("jit", **current, out=out, check=["out"])
            self._check_structure(pure_args, pure_kwargs, args, kwargs)
            return out, extract.get_updates(current, snapshot)

        self.inner = compile_on_states(on_states)

    def _check_structure(self, pure_args: tuple, pure_kwargs: dict, args: tuple, kwargs: dict) -> None:
        """Only Variable values are written back: a changed graph (a new attribute or
        Variable, a changed static field) would be lost, so it is an error."""
        from flax.nnx import extract
        before = _graphdefs((pure_args, pure_kwargs))
        after = _graphdefs(extract.to_tree2(extract.clear_non_graph_nodes((args, kwargs))))
        for (path, old), (_, new) in zip(before, after):
            if old != new:
                raise ValueError(
                    f"aotgrad.compile({self.name}): the function changed the structure of the graph "
                    f"node in argument {path} (an attribute or Variable added, removed or replaced, "
                    f"or a static field changed). Only Variable values are written back to the "
                    f"caller's objects; make structural changes outside the compiled function.")

    def _where(self, path: tuple) -> str:
        """``model['bn']['mean']`` for a path (args|kwargs, position|name, __state__, keys...)."""
        kind, head, *rest = path
        name = self.spec.arg_name(head.idx) if kind.name == "args" else str(head.key)
        return name + keystr(tuple(k for k in rest if getattr(k, "name", None) != "__state__"))

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        from flax.nnx import extract
        pure_args, pure_kwargs = extract.to_tree2((args, kwargs))
        variables = extract.check_no_aliases("jit", args=pure_args, kwargs=pure_kwargs)
        out, updates = self.inner(*pure_args, **pure_kwargs)
        for group in updates:
            for path, update in group:
                try:
                    variables[path].update_from_state(update)
                except Exception as e:  # e.g. a Variable of an enclosing trace's caller
                    raise ValueError(
                        f"aotgrad.compile({self.name}): cannot write the new value of the "
                        f"{type(update).__name__} at {self._where(path)} back into the caller's "
                        f"object: {e}") from e
        return extract.from_tree2(out)


class UserView:
    """A compiled function's hooks as its inner function (on states) runs them, each seeing
    what the user's function has: the cotangent of its output (not of the Variable
    updates the inner function also returns), gradients of graph nodes as `nnx.State` (as
    `nnx.grad` returns them), and leaf paths without flax's `__state__` level. Adapted
    hooks are kept per hook, so a backward program is found again for the same hooks."""

    def __init__(self, hooks: Hooks) -> None:
        self.hooks = hooks
        self._adapted: weakref.WeakKeyDictionary[Hook, Hook] = weakref.WeakKeyDictionary()

    @property
    def current(self) -> tuple[Hook, ...]:
        return tuple(self._adapt(h) for h in self.hooks.current)

    def _adapt(self, hook: Hook) -> Hook:
        adapted = self._adapted.get(hook)
        if adapted is None:
            adapted = Hook(functools.wraps(hook.fn)(_ADAPTERS[hook.kind](hook.fn)), hook.kind)
            self._adapted[hook] = adapted
        return adapted


def _prehook(fn: Callable[..., Any]) -> Callable[..., Any]:
    def on_states(ct: Any) -> Any:
        out_ct, updates_ct = ct
        new = fn(out_ct)
        return None if new is None else (new, updates_ct)
    return on_states


def _hook(fn: Callable[..., Any]) -> Callable[..., Any]:
    def on_states(grads: Any, ct: Any) -> Any:
        from flax.nnx import extract
        is_tree_state = lambda x: isinstance(x, extract.TreeState)  # noqa: E731
        as_state = jax.tree.map(lambda g: g.state if is_tree_state(g) else g, grads, is_leaf=is_tree_state)
        new = fn(as_state, ct[0])
        if new is None:
            return None
        return jax.tree.map(lambda g, n: g.replace(__state__=n) if is_tree_state(g) else n,
                            grads, new, is_leaf=lambda x: x is None or is_tree_state(x))
    return on_states


def _leaf_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
    def on_states(grad: Any, path: str) -> Any:
        return fn(grad, path.replace(".__state__", ""))
    return on_states


_ADAPTERS = {PREHOOK: _prehook, HOOK: _hook, LEAF: _leaf_hook}
