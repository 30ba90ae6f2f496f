"""`compile` (the decorator) and the `AOTFunction` it makes: a call resolved to its entry
by the function's `Entries` (compiled: traced on a miss, `api.cache`; or an export's
loaded entry), then run by the runtime."""
from __future__ import annotations

import functools
from typing import Any, Callable, Generic, ParamSpec, Protocol, Sequence, TypeVar, overload

from jax.tree_util import tree_unflatten

from aotgrad._jax_internals import Tracer
from aotgrad.api.cache import CacheInfo, EntryCache
from aotgrad.api.stages import Lowered, Traced
from aotgrad.entry import Entry, HookSource
from aotgrad.hooks import HOOK, LEAF, PREHOOK, HookHandle, Hooks
from aotgrad.nnx import NnxCall, UserView, has_graph_nodes
from aotgrad.signature import ArgSpec, check_in_range, normalize_argnums

__all__ = ["AOTFunction", "Entries", "compile"]

P = ParamSpec("P")
R = TypeVar("R")

_FORWARD_MODE_HINT = (
    "aotgrad.compile({name}) is reverse-mode only: its backward is a separately compiled "
    "program, so forward-mode autodiff (jax.jvp, jax.jacfwd, jax.linearize) cannot pass "
    "through it. Use jax.grad / jax.vjp / jax.jacrev on the compiled function, or call the "
    "undecorated function under forward mode.")


class Entries(Protocol):
    """Where an `AOTFunction`'s calls find their entry: an `api.cache.EntryCache` (traced on
    a miss), or the one entry of a loaded export (`export.loaded.LoadedEntries`)."""
    spec: ArgSpec  # how arguments split into static and traced ones, and their names

    def resolve(self, args: tuple, kwargs: dict) -> tuple[Entry, tuple[Any, ...]]:
        """The entry of this call and its flat inputs (closed-over values, then argument
        leaves)."""

    def info(self) -> CacheInfo:
        """What is held: entries, program pairs, hits and misses."""

    def clear(self) -> None:
        """Drops what can be built again."""


class AOTFunction(Generic[P, R]):
    """A function compiled ahead of time into forward and backward XLA programs.

    Calling it outside autodiff runs a forward-only program; under `jax.grad`, `jax.vjp`
    or `jax.jacrev` it runs a forward program that also returns saved values, then a
    backward program. Programs are built once per signature (argument structure, shapes,
    dtypes, static arguments, and the options in `aotgrad.config` that change programs).
    Made by `aotgrad.compile`.
    """
    reads_autocast_when_traced = True  # `autocast(...)(f)` enters the context around the call

    def __init__(self, entries: Entries, hooks: Hooks | None = None,
                 on_graph_nodes: Callable[[], NnxCall] | None = None,
                 wrapped: Callable[P, R] | None = None) -> None:
        """`entries`: where calls find their entry; `hooks`: where `register_hook` adds hooks
        (None: it takes none); `on_graph_nodes`: makes the `nnx.NnxCall` that runs calls with
        flax graph nodes among the arguments (None: arguments are taken as they are);
        `wrapped`: the function whose name and docstring it takes."""
        if wrapped is not None:
            functools.update_wrapper(self, wrapped)
        self.entries = entries
        self.spec = entries.spec
        self.hooks = hooks
        self._on_graph_nodes = on_graph_nodes
        self._nnx: NnxCall | None = None  # made on the first call with flax graph nodes

    @property
    def name(self) -> str:
        return self.spec.fn_name

    # ---------------------------------------------------------------- calling

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._on_graph_nodes is not None and has_graph_nodes(args, kwargs):
            if self._nnx is None:
                self._nnx = self._on_graph_nodes()
            return self._nnx(args, kwargs)
        entry, inputs = self.entries.resolve(args, kwargs)
        if not any(isinstance(x, Tracer) for x in inputs):
            outs = entry.forward_only(*inputs)  # concrete inputs: nothing to differentiate
        else:
            try:
                outs = entry.call(*inputs)
            except TypeError as e:
                if "forward-mode" in str(e):
                    raise TypeError(_FORWARD_MODE_HINT.format(name=self.name)) from e
                raise
        return tree_unflatten(entry.fwd.out_tree, outs)

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
        return self._registry().add(fn, PREHOOK)

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
        return self._registry().add(fn, LEAF if per_leaf else HOOK)

    # ---------------------------------------------------------------- ahead of time

    def trace(self, *args: P.args, **kwargs: P.kwargs) -> Traced:
        """The entry of these arguments (arrays or `jax.ShapeDtypeStruct`s), traced on a
        miss, as `jax.jit(f).trace(...)`: its forward jaxpr, its program pairs (`.pair()`
        builds one), `.lower()`."""
        entry, inputs = self.entries.resolve(args, kwargs)
        return Traced(self.name, entry, inputs)

    def lower(self, *args: P.args, **kwargs: P.kwargs) -> Lowered:
        """Lowers the forward and backward programs for these arguments (arrays or
        `jax.ShapeDtypeStruct`s), differentiating every floating-point input:
        `trace(*args, **kwargs).lower()`."""
        return self.trace(*args, **kwargs).lower()

    def cache_info(self) -> CacheInfo:
        """Entries (call signatures), program pairs, hits and misses of this function's cache."""
        return self.entries.info()

    def clear_cache(self) -> None:
        """Drops every compiled entry of this function; the next call traces again."""
        self.entries.clear()

    def _registry(self) -> Hooks:
        if self.hooks is None:
            raise TypeError(f"{self!r} takes no hooks.")
        return self.hooks

    def __repr__(self) -> str:
        return f"aotgrad.compile({self.name})"

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        # Decorating a method: bind `self` as the first argument. A plain object is a
        # non-array leaf, hence static (keyed by hash, else identity); a pytree `self`
        # (an equinox module) has its arrays traced like any argument.
        return self if obj is None else functools.partial(self, obj)


@overload
def compile(fn: Callable[P, R], *, static_argnums: int | Sequence[int] = (),
            static_argnames: str | Sequence[str] = (), donate_argnums: int | Sequence[int] = (),
            python_scalars: str = "traced") -> AOTFunction[P, R]: ...


@overload
def compile(fn: None = None, *, static_argnums: int | Sequence[int] = (),
            static_argnames: str | Sequence[str] = (), donate_argnums: int | Sequence[int] = (),
            python_scalars: str = "traced") -> Callable[[Callable[P, R]], AOTFunction[P, R]]: ...


def compile(fn: Callable[P, R] | None = None, *, static_argnums: int | Sequence[int] = (),
            static_argnames: str | Sequence[str] = (), donate_argnums: int | Sequence[int] = (),
            python_scalars: str = "traced") -> AOTFunction[P, R] | Callable[[Callable[P, R]], AOTFunction[P, R]]:
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
    def wrap(f: Callable[P, R]) -> AOTFunction[P, R]:
        return _compiled(f, static_argnums, static_argnames, donate_argnums, python_scalars)
    return wrap if fn is None else wrap(fn)


def _compiled(fn: Callable[P, R], static_argnums: int | Sequence[int], static_argnames: str | Sequence[str],
              donate_argnums: int | Sequence[int], python_scalars: str,
              hooks_view: HookSource | None = None) -> AOTFunction[P, R]:
    """`fn` compiled. `hooks_view`: the hooks its backward runs, when they are another
    function's (the function an `nnx.NnxCall` traces runs its owner's, adapted); it then
    takes arguments as they are (graph nodes already split to states)."""
    if not callable(fn):
        raise TypeError(f"aotgrad.compile expects a callable; got {type(fn).__name__} ({fn!r}).")
    spec = ArgSpec.of(fn, static_argnums, static_argnames, python_scalars)
    donate, _ = normalize_argnums(f"aotgrad.compile({spec.fn_name})", donate_argnums,
                                  "donate_argnums", "positions of the arguments whose buffers may be reused")
    if spec.fixed_arity:  # else each call's positional arguments are checked (`EntryCache`)
        check_in_range(f"aotgrad.compile({spec.fn_name})", "donate_argnums", donate, len(spec.param_names),
                       spec.param_names)
    clash = set(donate) & set(spec.static_argnums)
    if clash:
        raise ValueError(f"aotgrad.compile({spec.fn_name}): arguments {sorted(clash)} are in "
                         f"both donate_argnums and static_argnums; a static argument cannot be donated.")
    hooks = Hooks(spec.fn_name)
    entries = EntryCache(fn, spec, donate, hooks if hooks_view is None else hooks_view)
    nnx = None if hooks_view is not None else functools.partial(_nnx_call, fn, spec, donate, hooks)
    return AOTFunction(entries, hooks if hooks_view is None else None, nnx, fn)


def _nnx_call(fn: Callable[..., Any], spec: ArgSpec, donate: tuple[int, ...], hooks: Hooks) -> NnxCall:
    """Calls of `fn` with flax graph nodes: its function on states is compiled with the same
    options and runs `fn`'s hooks."""
    def compile_on_states(on_states: Callable[..., Any]) -> AOTFunction:
        return _compiled(on_states, spec.static_argnums, spec.static_argnames, donate, spec.python_scalars,
                         UserView(hooks))
    return NnxCall(spec, fn, compile_on_states)
