"""The few JAX internals aotgrad relies on, in one place so a JAX upgrade touches one file.

- source information on equations (to re-bind an equation under the user's source line,
  and to print that line in reports);
- the traceback filter (so aotgrad's own frames never appear as "the user's line");
- the concrete array type (a fast `type(x) is ArrayImpl` check on every call; taken from
  its module, since making an array to ask its type would start the backend at import,
  before a multi-host program can call `jax.distributed.initialize`);
- name-stack scopes of equations (autocast markers) and wrapping functions as the
  params of `custom_jvp_call` / `custom_vjp_call` expect (to rewrite their rules);
- the primitives that `jax.extend.core.primitives` does not export (collectives,
  callbacks, key wrapping), which the partitioner's rule table names (`primitives`);
- re-opening the persistent compilation cache after its directory changed;
- context states in JAX's jit cache key (as `jax.default_matmul_precision` is), so an
  enclosing `jax.jit` retraces when aotgrad's program-changing state changes;
- whether the code running now is being staged into a jaxpr (`staging`: a `jax.jit` being
  traced, under any transformations), where a forward and its backward become one program;
- what differs between the supported JAX versions: how a scan equation's params describe
  its operands (`scan_params`), whether a jaxpr param is closed (`open_jaxpr`; since jax
  0.11 `ClosedJaxpr` is an alias of `Jaxpr`), and the primitives only some versions have
  (`primitives.log2_p` etc. are None where absent).
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import jax


def _version(text: str) -> tuple[int, ...]:
    """``"0.12.0.1"`` -> (0, 12, 0); ``"0.13.0rc1"``, ``"0.13.0.dev20270101"`` -> (0, 13, 0)."""
    return tuple(int(n) for n in re.findall(r"\d+", re.match(r"[\d.]*", text).group())[:3])


# The oldest JAX aotgrad is tested on (pyproject.toml's bound). Newer releases than the newest
# tested are not refused: a library that follows JAX closely should work on its release day.
MIN_JAX = (0, 10, 2)
JAX_VERSION = _version(jax.__version__)
if JAX_VERSION < MIN_JAX:
    raise ImportError(f"aotgrad needs jax >= {'.'.join(map(str, MIN_JAX))}; jax {jax.__version__} is installed "
                      f"(from {os.path.dirname(jax.__file__)}). Upgrade it: pip install -U jax jaxlib")

import jax.extend.core.primitives as P  # noqa: E402 (after the version check: older JAX may lack these)
from jax.extend.core import ClosedJaxpr, Jaxpr  # noqa: E402

from jax._src import (callback, compilation_cache, debugging, ffi, linear_util, shard_map,  # noqa: E402
                      source_info_util, traceback_util)
from jax._src import config as jax_config  # noqa: E402
from jax._src.array import ArrayImpl  # noqa: E402
from jax._src.core import Tracer, pvary_p, trace_ctx  # noqa: E402
from jax._src.interpreters.partial_eval import DynamicJaxprTrace  # noqa: E402
from jax._src.lax import lax as _lax  # noqa: E402
from jax._src.lax import linalg, parallel  # noqa: E402
from jax._src.random import prng  # noqa: E402

__all__ = ["INLINE_WHEN_STAGED", "JAX_VERSION", "MIN_JAX", "ArrayImpl", "ScanParams", "Tracer", "bind_eqn",
           "eqn_context",
           "hlo_cost", "is_jaxpr", "module_cost", "jax_primitives", "jit_key_state", "name_scopes", "open_jaxpr", "primitives", "reset_compilation_cache", "scan_params",
           "source_line", "staging", "short_source_line", "varying_axes", "wrap_like"]

# `jax.jit(..., inline=INLINE_WHEN_STAGED)`: the call, and what JAX derives from it (its
# derivatives and transposes), is inlined into the jaxpr being traced. JAX 0.10 does that for
# `inline=True`; newer releases keep such calls in the jaxpr until lowering unless asked.
INLINE_WHEN_STAGED = jax.Inline.JAX_EARLY if hasattr(jax, "Inline") else True

# Primitives missing from `jax.extend.core.primitives`, by their public names' spelling.
primitives = types.SimpleNamespace(
    pvary_p=pvary_p, split_p=_lax.split_p, geqrf_p=linalg.geqrf_p,
    lu_pivots_to_permutation_p=linalg.lu_pivots_to_permutation_p,
    pbroadcast_p=parallel.pbroadcast_p, reduce_scatter_p=parallel.reduce_scatter_p,
    psum_invariant_p=parallel.psum_invariant_p, all_gather_invariant_p=parallel.all_gather_invariant_p,
    shard_map_p=shard_map.shard_map_p, ffi_call_p=ffi.ffi_call_p,
    pure_callback_p=callback.pure_callback_p, io_callback_p=callback.io_callback_p,
    debug_callback_p=debugging.debug_callback_p,
    random_wrap_p=prng.random_wrap_p, random_unwrap_p=prng.random_unwrap_p,
    # New in jax 0.11.2 (tanh's derivative; `jnp.log2`) and by 0.12 (`jnp.polyval`, erf's derivative).
    one_minus_square_p=getattr(P, "one_minus_square_p", None), log2_p=getattr(P, "log2_p", None),
    polynomial_p=getattr(P, "polynomial_p", None),
)

traceback_util.register_exclusion(os.path.dirname(__file__))


def bind_eqn(eqn: Any, invals: Sequence[Any], call: Callable[..., Any] | None = None) -> list[Any]:
    """Binds `eqn`'s primitive on new inputs under the equation's own source info and
    context, as `jax.core.eval_jaxpr` does; returns the outputs as a list. `call`, when
    given, binds it instead (a function of the inputs that binds the same primitive)."""
    params = eqn.primitive.get_bind_params(eqn.params) if call is None else None
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params) if call is None else call(*invals)
    return list(out) if eqn.primitive.multiple_results else [out]


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes a value varies over inside `shard_map` (its type's), empty
    elsewhere; `x` a value or an abstract value."""
    aval = getattr(x, "aval", x)  # a tracer's or an array's type; an abstract value itself
    found = getattr(getattr(aval, "mat", None), "varying", None)
    if found is None:  # where the type names them directly
        found = getattr(aval, "vma", None)
    return frozenset(found or ())


def source_line(eqn: Any) -> str:
    """The user's source line that produced `eqn`, e.g. ``model.py:12:8 (mlp)``."""
    info = getattr(eqn, "source_info", None)
    if info is None:
        return "<unknown>"
    return source_info_util.summarize(info)


def short_source_line(eqn: Any) -> str:
    """The user's file (base name) and line that produced `eqn`, e.g. ``model.py:12``."""
    info = getattr(eqn, "source_info", None)
    frame = None if info is None else source_info_util.user_frame(info.traceback)
    if frame is None:
        return "<unknown>"
    return f"{os.path.basename(frame.file_name)}:{frame.start_line}"


def name_scopes(eqn: Any) -> tuple[str, ...]:
    """The `jax.named_scope` names on `eqn`'s name stack, outermost first (transforms such
    as ``jvp`` / ``transpose`` are skipped)."""
    stack = getattr(getattr(eqn, "source_info", None), "name_stack", None)
    if stack is None:
        return ()
    return tuple(s.name for s in stack.stack if isinstance(s, source_info_util.Scope))


@contextlib.contextmanager
def eqn_context(eqn: Any) -> Iterator[None]:
    """Binds made inside run under `eqn`'s source info and name stack (used when an
    equation's body is evaluated in place, so the body's equations keep its scopes)."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
        yield


def wrap_like(fn: Callable[..., Any], like: Any) -> Any:
    """`fn` wrapped the way a `custom_jvp_call` / `custom_vjp_call` param `like` is."""
    return linear_util.wrap_init(fn, debug_info=like.debug_info)


def reset_compilation_cache() -> None:
    """JAX opens its persistent cache directory once per process; this makes the next
    compilation open `jax_compilation_cache_dir` again (after aotgrad changed it)."""
    compilation_cache.reset_cache()


def jit_key_state(name: str, default: Any) -> Any:
    """A JAX context state in every jit cache key and trace context: `.value` reads it,
    `.set_global(v)` sets the default, `.set_local(v)` / `.swap_local(v)` this thread's
    value (values must be hashable). A change makes `jax.jit` trace again; a value seen
    before hits its cache again."""
    return jax_config.config_ext.Config(name, default, include_in_jit_key=True,
                                        include_in_trace_context=True)


def staging() -> bool:
    """Whether values computed now are being staged into a jaxpr (a `jax.jit`, `lax.scan` or
    `jax.checkpoint` being traced), below any transformations (`jax.vmap` inside a jit): the
    innermost trace in force, then each one it hands its work to, is a jaxpr's."""
    trace = trace_ctx.trace
    while trace is not None:
        if isinstance(trace, DynamicJaxprTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def open_jaxpr(body: Any) -> tuple[Any, Sequence[Any]]:
    """A jaxpr param as (open jaxpr, values of its constvars). Before jax 0.11 a param is a
    `ClosedJaxpr` (`.jaxpr`, `.consts`) or an open `Jaxpr`; since, every `Jaxpr` carries its
    consts (and `.jaxpr` is itself)."""
    return getattr(body, "jaxpr", body), getattr(body, "consts", ())


def is_jaxpr(value: Any) -> bool:
    """Whether a param value is a jaxpr (closed or open) in any supported version."""
    return isinstance(value, (ClosedJaxpr, Jaxpr))


@dataclass(frozen=True)
class ScanParams:
    """A scan equation's operands and options, whatever the JAX version's params look like.
    The operands are `consts + carry + xs`, the outputs `carry + ys`."""
    body: Any  # the closed body jaxpr: (consts, carry, x) -> (carry, y)
    n_consts: int
    n_carry: int
    n_xs: int
    length: int
    reverse: bool
    unroll: int | bool
    split_transpose: bool  # `lax.scan`'s `_split_transpose` (jax 0.10; absent since)

    @property
    def carries(self) -> slice:
        return slice(self.n_consts, self.n_consts + self.n_carry)

    @property
    def scan_options(self) -> dict[str, Any]:
        """Keyword arguments for `jax.lax.scan` that rebuild this scan's options."""
        return dict(reverse=self.reverse, unroll=self.unroll, _split_transpose=self.split_transpose)


def scan_params(eqn: Any) -> ScanParams:
    """Reads a `scan` equation. jax 0.10 counts its operands (`num_consts`, `num_carry`);
    since jax 0.11 they are the three parts of a flat tree (`ft_in`)."""
    p = eqn.params
    if "num_consts" in p:
        n_consts, n_carry = p["num_consts"], p["num_carry"]
        n_xs = len(eqn.invars) - n_consts - n_carry
    else:
        n_consts, n_carry, n_xs = (len(part) for part in p["ft_in"].unpack())
    return ScanParams(body=p["jaxpr"], n_consts=n_consts, n_carry=n_carry, n_xs=n_xs, length=p["length"],
                      reverse=p["reverse"], unroll=p["unroll"],
                      split_transpose=bool(p.get("_split_transpose", False)))


@functools.cache
def jax_primitives() -> dict[str, list[Any]]:
    """Every primitive JAX defines at module level in its (loaded) internal modules, by name:
    `jax.extend.core.primitives` exports only some (not `stack`, which a scan's residuals may
    use, nor collectives' async halves). The public modules a program reaches are loaded
    first. Names are not unique across modules, hence lists."""
    import importlib
    import sys
    from jax.extend.core import Primitive
    for name in ("jax.numpy", "jax.nn", "jax.random", "jax.lax", "jax.scipy.special", "jax.scipy.linalg",
                 "jax.experimental.checkify", "jax.export"):
        importlib.import_module(name)
    found: dict[str, list[Any]] = {}
    for module_name, module in sorted(sys.modules.items()):
        if module is None or not module_name.startswith("jax._src"):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Primitive) and all(value is not p for p in found.get(value.name, ())):
                found.setdefault(value.name, []).append(value)
    return found


def hlo_cost(compiled: Any, generic: bool = False) -> dict[str, float]:
    """XLA's HLO cost analysis of a compiled executable ("flops", "bytes accessed", ...).
    A compile-only GPU executable has no `cost_analysis()`: its optimized module is analysed
    with the host's CPU backend's generic cost model instead, as it is always if `generic`.
    {} where neither works."""
    cost = None if generic else compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if cost:
        return dict(cost)
    try:
        return _generic_cost(compiled.runtime_executable().hlo_modules()[0])
    except Exception:  # noqa: BLE001 (an executable with no module, a jaxlib without the call)
        return {}


def module_cost(text: str) -> dict[str, float]:
    """The generic HLO cost analysis (as `hlo_cost`'s) of a module given as HLO text (a
    computation of an optimized module made its entry). {} where it cannot be read."""
    try:
        from jaxlib import _hlo
        return _generic_cost(_hlo.hlo_module_from_text(text))
    except Exception:  # noqa: BLE001 (a jaxlib without the parser, text it does not take)
        return {}


def _generic_cost(module: Any) -> dict[str, float]:
    """The host CPU backend's generic cost analysis of an HLO module, whatever its target."""
    from jax._src import xla_bridge
    from jax._src.lib import _jax
    return dict(_jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module))
