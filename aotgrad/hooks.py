"""Backward hooks: user functions traced into the backward program.

- `register_prehook(fn)`: `fn(cotangent) -> cotangent | None`, at the start of the backward;
- `register_hook(fn)`: `fn(grads, cotangent) -> grads | None`, at its end;
- `register_hook(fn, per_leaf=True)`: `fn(grad, path) -> grad | None` for each gradient
  leaf, placed right after the backward equation that makes that leaf's gradient final;
- `grad_hook(x, fn)`: in the model code, the cotangent arriving at `x` becomes `fn(ct)`.

A compiled function's hooks are a tuple of `Hook` records, replaced (never mutated) on each
change. A forward hands the tuple in force to its backward (in `Saved`), and the backward
keeps one program per tuple: changing hooks builds a backward program only, and removing a
hook finds the earlier one again. Every hook in force, over all functions, is mirrored into
JAX's jit cache key (`jit_key.set_hooks`), so an enclosing `jax.jit` traces again.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, Var
from jax.tree_util import keystr, tree_flatten, tree_flatten_with_path, tree_structure, tree_unflatten

from aotgrad import jit_key
from aotgrad.interpret import eval_jaxpr
from aotgrad.signature import Static

__all__ = ["ArgLayout", "Hook", "HookHandle", "Hooks", "InForce", "grad_hook", "with_hooks"]

PREHOOK, HOOK, LEAF = "prehook", "hook", "per-leaf hook"

_all_lock = threading.RLock()  # re-entrant: a collected `Hooks` may leave while it is held
_all: dict[int, tuple["Hook", ...]] = {}  # id(Hooks) -> its hooks, for the jit key


@dataclasses.dataclass(frozen=True, eq=False)
class Hook:
    """One registered hook (compared by identity: registering the same function twice
    makes two hooks)."""
    fn: Callable[..., Any]
    kind: str  # PREHOOK, HOOK or LEAF

    @property
    def name(self) -> str:
        return f"{self.kind} {getattr(self.fn, '__qualname__', None) or repr(self.fn)}"


class HookHandle:
    """Returned by `register_prehook` / `register_hook`: `.remove()` removes the hook (a
    second call does nothing); as a context manager, it removes the hook on exit."""

    def __init__(self, hooks: "Hooks", hook: Hook) -> None:
        self._hooks = hooks
        self.hook = hook

    def remove(self) -> None:
        self._hooks.remove(self.hook)

    def __enter__(self) -> "HookHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


class Hooks:
    """The hooks of one compiled function, in registration order."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.current: tuple[Hook, ...] = ()
        self._lock = threading.Lock()

    def add(self, fn: Callable[..., Any], kind: str) -> HookHandle:
        if not callable(fn):
            raise TypeError(f"aotgrad.compile({self.owner}).register_{'prehook' if kind == PREHOOK else 'hook'}: "
                            f"expects a callable; got {type(fn).__name__} ({fn!r}).")
        hook = Hook(fn, kind)
        with self._lock:
            self._set(self.current + (hook,))
        return HookHandle(self, hook)

    def remove(self, hook: Hook) -> None:
        with self._lock:
            self._set(tuple(h for h in self.current if h is not hook))

    def _set(self, hooks: tuple[Hook, ...]) -> None:
        self.current = hooks
        with _all_lock:
            if hooks:
                _all[id(self)] = hooks
            else:
                _all.pop(id(self), None)
            _publish()

    def __del__(self) -> None:  # a dropped function's hooks leave the jit key
        if self.current and _publish is not None:  # (at interpreter exit globals are gone)
            with _all_lock:
                _all.pop(id(self), None)
                _publish()


def _publish() -> None:
    """Mirrors every function's hooks into JAX's jit key (under `_all_lock`)."""
    jit_key.set_hooks(tuple(sorted(_all.items())))


@dataclasses.dataclass(frozen=True, eq=False)
class ArgLayout:
    """How one entry's flat inputs map to the function's arguments (made once per entry)."""
    owner: str
    n_consts: int  # closed-over values come first among the inputs
    in_tree: Any  # of (dynamic args, dynamic kwargs), with `Static` markers
    arg_positions: tuple[int, ...]  # position among all positional arguments of each dynamic one
    n_args: int  # positional arguments of the call
    paths: tuple[str, ...]  # readable path of each argument leaf
    out_tree: Any


@dataclasses.dataclass(frozen=True)
class InForce:
    """The hooks a forward ran under, handed to its backward (static data of `Saved`)."""
    hooks: tuple[Hook, ...]
    layout: ArgLayout


def with_hooks(backward: Callable[..., list[Any]], jaxpr: ClosedJaxpr | None, in_force: InForce,
               perturbed: Sequence[bool], has_ct: Sequence[bool]) -> Callable[..., list[Any]]:
    """The backward `(saved..., cts...) -> grads` with the hooks traced in.

    Arguments:
        backward: the backward function (returns the gradients, then any other values, such
            as anomaly codes, which are passed through).
        jaxpr: the backward jaxpr, evaluated equation by equation so that per-leaf hooks
            follow the equation that finalizes their leaf; None: `backward` is called and
            per-leaf hooks run at the end.
        in_force: the hooks and the argument layout.
        perturbed: which inputs (closed-over values, then argument leaves) get gradients.
        has_ct: which outputs take a cotangent.
    """
    layout = in_force.layout
    pre = [h for h in in_force.hooks if h.kind == PREHOOK]
    post = [h for h in in_force.hooks if h.kind != PREHOOK]
    # Per-leaf hooks registered before every whole-gradient hook run as leaves finish;
    # the others, in registration order, after the backward.
    n_early = next((i for i, h in enumerate(post) if h.kind != LEAF), len(post))
    early, late = post[:n_early], post[n_early:]
    grad_inputs = [i for i, p in enumerate(perturbed) if p]
    closed = [i for i in grad_inputs if i < layout.n_consts]
    if closed and post:
        raise ValueError(
            f"aotgrad.compile({layout.owner}): hooks on the gradients see the function's "
            f"arguments, but this call differentiates {len(closed)} value(s) the function closes "
            f"over (a tracer of an enclosing transform). Pass them as arguments, or remove the hooks.")
    paths = [layout.paths[i - layout.n_consts] for i in grad_inputs]
    n_cts = sum(has_ct)
    who = f"aotgrad.compile({layout.owner})"

    def run(*args: Any) -> list[Any]:
        saved, cts = list(args[:len(args) - n_cts]), list(args[len(args) - n_cts:])
        ct_tree = _ct_tree(layout, has_ct, cts)
        for hook in pre:
            ct_tree = _checked(hook, hook.fn(ct_tree), ct_tree, who, "ct")
        cts = tree_flatten(ct_tree)[0]
        if early and jaxpr is not None:
            results = _eval_with_leaf_hooks(jaxpr, [*saved, *cts], early, paths, who)
        else:
            results = list(backward(*saved, *cts))
            results[:len(paths)] = [_apply_leaf(early, g, p, who) for g, p in zip(results, paths)]
        grads, extra = results[:len(paths)], results[len(paths):]
        for hook in late:
            if hook.kind == LEAF:
                grads = [_apply_leaf([hook], g, p, who) for g, p in zip(grads, paths)]
            else:
                grads = _apply_whole(hook, grads, ct_tree, layout, perturbed, who)
        return [*grads, *extra]

    return run


def _ct_tree(layout: ArgLayout, has_ct: Sequence[bool], cts: Sequence[Any]) -> Any:
    """The output cotangent in the output's structure; None where an output takes none."""
    it = iter(cts)
    return tree_unflatten(layout.out_tree, [next(it) if c else None for c in has_ct])


def _eval_with_leaf_hooks(jaxpr: ClosedJaxpr, args: list[Any], hooks: list[Hook], paths: list[str],
                          who: str) -> list[Any]:
    """Evaluates the backward jaxpr; each gradient leaf goes through `hooks` right after the
    equation that defines it (gradients defined by no equation: before the first)."""
    outvars = jaxpr.jaxpr.outvars
    waiting: dict[Var, list[int]] = {}
    for k, v in enumerate(outvars):
        if isinstance(v, Var):
            waiting.setdefault(v, []).append(k)
    produced = {v for eqn in jaxpr.jaxpr.eqns for v in eqn.outvars if isinstance(v, Var)}
    hooked: dict[int, Any] = {}
    env = dict(zip(jaxpr.jaxpr.constvars, jaxpr.consts))
    env.update(zip(jaxpr.jaxpr.invars, args))
    for k, v in enumerate(outvars):  # literals, inputs and constants are final at once
        if isinstance(v, Literal) or v not in produced:
            hooked[k] = _apply_leaf(hooks, v.val if isinstance(v, Literal) else env[v], paths[k], who)

    def emit(eqn: Any, invals: list, outvals: list) -> None:
        for v, val in zip(eqn.outvars, outvals):
            for k in waiting.get(v, ()) if isinstance(v, Var) else ():
                hooked[k] = _apply_leaf(hooks, val, paths[k], who)

    results = eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, args, on_eqn=emit)
    return [hooked.get(k, r) for k, r in enumerate(results)]


def _apply_leaf(hooks: Sequence[Hook], grad: Any, path: str, who: str) -> Any:
    for hook in hooks:
        grad = _checked(hook, hook.fn(grad, path), grad, who, path)
    return grad


def _apply_whole(hook: Hook, grads: list[Any], ct_tree: Any, layout: ArgLayout,
                 perturbed: Sequence[bool], who: str) -> list[Any]:
    """Regroups the flat gradients into one entry per positional argument (None for an
    argument without gradients, None leaves inside one partly differentiated), calls the
    hook, and flattens its result back."""
    n = layout.n_consts
    it = iter(grads)
    leaves = [next(it) if p else None for p in perturbed]
    args, kwargs = tree_unflatten(layout.in_tree, leaves[n:])
    kw_grads = [k for k, v in kwargs.items() if any(x is not None and not isinstance(x, Static)
                                                   for x in jax.tree.leaves(v, is_leaf=_is_static))]
    if kw_grads:
        raise ValueError(
            f"{who}: {hook.name} receives one gradient per positional "
            f"argument, but this call differentiates keyword argument(s) {kw_grads}. Pass them "
            f"positionally.")
    per_arg: list[Any] = [None] * layout.n_args
    for pos, a in zip(layout.arg_positions, args):
        a = jax.tree.map(lambda x: None if isinstance(x, Static) else x, a, is_leaf=_is_static)
        per_arg[pos] = a if jax.tree.leaves(a) else None
    given = tuple(per_arg)
    got = _checked(hook, hook.fn(given, ct_tree), given, who, "grads")
    return jax.tree.leaves(got)  # the structure of `given`: its leaves are the gradients, in order


def _is_static(x: Any) -> bool:
    return isinstance(x, Static)


def _checked(hook: Hook, got: Any, given: Any, who: str, root: str) -> Any:
    """`got` when it matches `given` leaf by leaf (structure, shape, dtype); `given` when
    the hook returned None; else an error naming the hook and the leaf."""
    if got is None:
        return given
    want_tree, got_tree = tree_structure(given), tree_structure(got)
    if want_tree != got_tree:
        raise ValueError(f"{who}: {hook.name} returned a value of structure "
                         f"{got_tree}; expected the structure of its input {want_tree} (or None).")
    for (path, g), w in zip(tree_flatten_with_path(got)[0], tree_flatten(given)[0]):
        gs, gd = np.shape(g), jax.numpy.result_type(g)
        if gs != np.shape(w) or gd != jax.numpy.result_type(w):
            raise ValueError(
                f"{who}: {hook.name} returned {np.dtype(gd).name}{list(gs)} at "
                f"{root}{keystr(path) if root in ('ct', 'grads') else ''}; expected "
                f"{np.dtype(jax.numpy.result_type(w)).name}{list(np.shape(w))}, as its input.")
    return got


# ----------------------------------------------------------------------------- grad_hook

def grad_hook(x: Any, fn: Callable[[Any], Any]) -> Any:
    """Returns `x` unchanged; in the backward, the cotangent arriving at `x` is replaced by
    `fn(cotangent)` (a tensor hook). Works in an `aotgrad.compile`d function and under plain
    `jax.grad` alike; the partitioner sees an identity (nothing is saved for it).

    Arguments:
        x: an array or a pytree of arrays.
        fn: `fn(cotangent) -> cotangent | None`, with the structure, shapes and dtypes of `x`
            (None keeps the cotangent). It must not close over traced values.
    """
    hook = Hook(fn, "grad_hook")

    @jax.custom_vjp
    def identity(x: Any) -> Any:
        return x

    def fwd(x: Any) -> tuple[Any, None]:
        return x, None

    def bwd(_: None, ct: Any) -> tuple[Any]:
        return (_checked(hook, fn(ct), ct, "aotgrad.grad_hook", "ct"),)

    identity.defvjp(fwd, bwd)
    return identity(x)
