"""`aotgrad.export`: the pair of a compiled function, built through its own entry, as three
`jax.export` programs plus the call metadata and the `explain` report (without shapes)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Sequence

import jax
from jax.tree_util import tree_unflatten

from aotgrad._jax_internals import Tracer
from aotgrad.api.function import AOTFunction
from aotgrad.api.function import compile as aot_compile
from aotgrad.compilation_cache import ensure_compilation_cache
from aotgrad.config import Snapshot, config
from aotgrad.entry import Entry
from aotgrad.export.blob import ExportError, encode_static
from aotgrad.export.loaded import Exported
from aotgrad.export.programs import concrete, spec
from aotgrad.report import Report, report_of
from aotgrad.runtime import ProgramPair
from aotgrad.signature import argnum_positions
from aotgrad.trace import ForwardTrace

__all__ = ["export"]


def export(fn: Callable, *args: Any, argnums: int | Sequence[int] | None = None,
           platforms: Sequence[str] | None = None, **kwargs: Any) -> "Exported":
    """Builds the forward/backward pair of `fn(*args, **kwargs)` under the current
    `aotgrad.config` and autocast state, and exports it with `jax.export`.

    The result is called and differentiated like an `aotgrad.compile`d function, and
    `.serialize()` turns it into bytes that `aotgrad.deserialize` loads in another process,
    without `fn` or its module.

    Arguments:
        fn: an `aotgrad.compile`d function or a plain one.
        *args, **kwargs: its arguments: arrays or `jax.ShapeDtypeStruct`s (with shardings for
            a program over several devices; with `jax.export.symbolic_shape` dimensions for
            a program of any batch size). Static arguments are fixed at their values here.
        argnums: the positional arguments differentiated (as in `jax.grad`); by default
            every floating-point input. Gradients for a subset are available after loading.
        platforms: the platforms to lower for (`jax.export` names: "cpu", "cuda", "rocm",
            "tpu"); by default the one this process runs on.
    """
    ensure_compilation_cache()
    if isinstance(fn, Exported):
        raise TypeError(f"aotgrad.export: {fn!r} is already exported; serialize it instead.")
    f = fn if isinstance(fn, AOTFunction) else aot_compile(fn)
    who = f"aotgrad.export({f.name})"
    options = config.snapshot()
    _check_exportable(who, f, options)
    static, _, _ = f.spec.split(args, kwargs)
    traced = f.trace(*args, **kwargs)
    entry = traced.entry
    if any(isinstance(x, Tracer) for x in traced.inputs):
        raise ExportError(f"{who}: called under a JAX transformation (an argument or a closed-over "
                          f"value is a tracer); export outside jax.jit / jax.grad, with arrays or "
                          f"jax.ShapeDtypeStructs.")
    positions = None
    if argnums is not None:
        positions = argnum_positions(who, argnums, len(args))
    try:
        pair = traced.pair(perturbed=entry.perturbed_for(positions))
    except Exception as e:
        if any(not concrete(x.shape) for x in traced.inputs):
            raise ExportError(
                f"{who}: building the programs with symbolic dimensions failed under "
                f"partitioner={options.partitioner!r} ({type(e).__name__}: {e}). Export with concrete "
                f"shapes, or under aotgrad.config.patch(partitioner='vjp').") from e
        raise
    fwd = entry.fwd
    assert isinstance(pair, ProgramPair) and isinstance(fwd, ForwardTrace)  # a compiled function's entry
    programs = _export_programs(who, entry, pair, traced.inputs, platforms)
    spec = f.spec
    meta = {
        "name": f.name,
        "param_names": list(spec.param_names),
        "static_argnums": list(spec.static_argnums),
        "static_argnames": list(spec.static_argnames),
        "python_scalars": spec.python_scalars,
        "static": [[k, encode_static(who, k, v)] for k, v in static],
        "arg_positions": list(entry.arg_positions),
        "leaf_args": list(entry.leaf_args),
        "perturbed": list(pair.perturbed),
        "has_ct": list(pair.has_ct),
        "n_outs": pair.n_outs,
        "saved_inputs": list(pair.split.saved_inputs),
        "config": json.loads(json.dumps(options.as_dict(), default=str)),
        "autocast": None if fwd.autocast is None else dataclasses.asdict(fwd.autocast),
        "jax_version": jax.__version__,
        "report": report_meta(report_of(traced, pair, pair.timings, None, costs=False)),
    }
    return Exported(meta, programs, tuple(fwd.consts))


def _check_exportable(who: str, f: AOTFunction, options: Snapshot) -> None:
    """Options and hooks whose backward is Python code, not a program, are refused."""
    for name in ("donate_saved", "detect_anomaly"):
        if getattr(options, name):
            raise ExportError(f"{who}: aotgrad.config.{name}=True is not supported by export (its "
                              f"backward is guarded by Python code that is not exported); export "
                              f"under aotgrad.config.patch({name}=False).")
    hooks = f.hooks.current if f.hooks is not None else ()
    if hooks:
        raise ExportError(f"{who}: the function has {len(hooks)} backward hook(s) "
                          f"({', '.join(h.name for h in hooks)}); hooks are Python functions "
                          f"traced into the backward, and an export carries programs only. Remove "
                          f"them (handle.remove()) before exporting, and apply the same transformation "
                          f"to the loaded function's gradients.")


def _export_programs(who: str, entry: Entry, pair: ProgramPair, inputs: Sequence[Any],
                     platforms: Sequence[str] | None) -> dict[str, Any]:
    """The three `jax.export.Exported` programs. The forward-only one takes the pytree
    arguments ((consts...), dyn_args, dyn_kwargs), so its blob records their structure."""
    sp = pair.split
    specs = [spec(x) for x in inputs]
    n = len(entry.fwd.consts)
    out_tree, in_tree = entry.fwd.out_tree, entry.in_tree

    def forward_only(consts: tuple, dyn_args: tuple, dyn_kwargs: dict) -> Any:
        leaves = in_tree.flatten_up_to((dyn_args, dyn_kwargs))
        return tree_unflatten(out_tree, entry.forward_only(*consts, *leaves))

    def exported(fn: Any, *specs: Any) -> Any:
        return jax.export.export(fn, platforms=platforms)(*specs)

    dyn_args, dyn_kwargs = tree_unflatten(in_tree, specs[n:])
    forward = jax.jit(sp.forward_program.fn)
    programs = {"forward_only": exported(jax.jit(forward_only), tuple(specs[:n]), dyn_args, dyn_kwargs),
                "forward": exported(forward, *specs)}
    # The backward's inputs: saved activations, saved inputs, cotangents. Over several
    # devices they take the shardings the compiled forward gives them, and the gradients
    # take their inputs' shardings (as `runtime.ProgramPair` does).
    bwd_shardings: list[Any] = [None] * len(sp.backward_program.in_avals)
    grad_shardings = None
    if any(s.sharding is not None for s in specs):
        outs = forward.lower(*specs).compile().output_shardings
        acts = list(outs[pair.n_outs:])
        cts = [s for s, c in zip(outs[:pair.n_outs], pair.has_ct, strict=True) if c]
        bwd_shardings = acts + [specs[i].sharding for i in sp.saved_inputs] + cts
        grad_shardings = [specs[i].sharding for i in pair.grad_inputs]
    bwd_specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                 for a, s in zip(sp.backward_program.in_avals, bwd_shardings, strict=True)]
    backward = jax.jit(sp.backward_program.fn, out_shardings=grad_shardings)
    programs["backward"] = exported(backward, *bwd_specs)
    return programs


_SHAPE_FREE = ("dtype", "is_input", "primitive", "source", "reason")  # SavedValue fields kept


def report_meta(report: Report) -> dict[str, Any]:
    """The report, without shapes and byte counts (`explain` takes them from its arguments,
    which may bind symbolic dimensions)."""
    return {"partitioner": report.partitioner,
            "saved": [{k: getattr(s, k) for k in _SHAPE_FREE} for s in report.saved],
            "recomputed": [list(r) for r in report.recomputed],
            "timings": dataclasses.asdict(report.timings),
            "casts": {"forward": [list(c) for c in report.casts.forward],
                      "backward": [list(c) for c in report.casts.backward]}}
