"""Anomaly mode (`aotgrad.config.detect_anomaly`): when a backward produces a NaN or an Inf,
name the forward operation whose derivative produced it, with the user's source line.

A program pair built in anomaly mode runs a *checked* backward: the same equations, re-bound
one by one, plus one code per value (0 finite, 1 holds an Inf, 2 holds a NaN) for each
backward input, each equation and each gradient. When a gradient is not finite, the codes
locate the first equation, among those the gradient depends on, that made a non-finite value
from finite inputs. Transposed equations keep the forward equation's source info, so that
equation's source line is the user's line of the forward operation; its name stack carries
the forward operation's sequence number (`provenance`), which the report names too.

On concrete values the codes are read right after the backward. Inside an outer trace
(`jax.jit`) they are read by a `jax.debug.callback` when the program runs; the error then
reaches the caller as a `jax.errors.JaxRuntimeError` that carries the same message.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Var

from aotgrad import provenance
from aotgrad._jax_internals import Tracer, short_source_line, source_line
from aotgrad.interpret import eval_jaxpr
from aotgrad.partition.graph import reachable

if TYPE_CHECKING:
    from aotgrad.runtime import ProgramPair

__all__ = ["check", "checked"]

_KIND = {1: "Inf", 2: "NaN"}


def _code(x: Any) -> Any:
    """0: finite (or not floating), 1: holds an Inf, 2: holds a NaN."""
    if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.int8(0)
    return jnp.where(jnp.any(jnp.isnan(x)), jnp.int8(2), jnp.where(jnp.any(jnp.isinf(x)), jnp.int8(1), jnp.int8(0)))


def _worst(values: Sequence[Any]) -> Any:
    codes = [_code(v) for v in values]
    return functools.reduce(jnp.maximum, codes) if codes else jnp.int8(0)


def checked(backward: ClosedJaxpr) -> Callable[..., list[Any]]:
    """`backward` as a function returning ``[*grads, codes]``; `codes` holds one code per
    backward input, then per equation (its worst output), then per gradient."""
    jaxpr = backward.jaxpr

    def run(*args: Any) -> list[Any]:
        codes = [_code(a) for a in args]

        def record(eqn: Any, invals: list, outvals: list) -> None:
            codes.append(_worst([o for v, o in zip(eqn.outvars, outvals, strict=True) if isinstance(v, Var)]))

        grads = eval_jaxpr(jaxpr, backward.consts, args, on_eqn=record)
        codes.extend(_code(g) for g in grads)
        return [*grads, jnp.stack(codes)]

    return run


def check(pair: "ProgramPair", results: list[Any]) -> list[Any]:
    """Returns the gradients of a checked backward; raises `FloatingPointError` (or, inside
    a trace, arranges for the program to raise) when one of them is not finite."""
    *grads, codes = results
    if isinstance(codes, Tracer):
        jax.debug.callback(functools.partial(_raise_if_anomalous, pair), codes)
    else:
        _raise_if_anomalous(pair, codes)
    return grads


def _raise_if_anomalous(pair: "ProgramPair", codes: Any) -> None:
    codes = np.asarray(codes)
    jaxpr = pair.split.backward.jaxpr
    n_in, n_eqns = len(jaxpr.invars), len(jaxpr.eqns)
    grad_codes = codes[n_in + n_eqns:]
    if not grad_codes.any():
        return
    raise FloatingPointError(_report(pair, codes[:n_in], codes[n_in:n_in + n_eqns], grad_codes))


def _report(pair: "ProgramPair", in_codes: np.ndarray, eqn_codes: np.ndarray,
            grad_codes: np.ndarray) -> str:
    jaxpr = pair.split.backward.jaxpr
    eqns = jaxpr.eqns
    bad_grads = [k for k, c in enumerate(grad_codes) if c]
    kind = _KIND[int(grad_codes.max())]
    inputs = ", ".join(f"#{pair.grad_inputs[k]}" for k in bad_grads)
    head = (f"aotgrad anomaly mode: the backward of {pair.owner} produced {kind} in the gradient "
            f"of input {inputs} (inputs counted over closed-over constants, then argument leaves).")

    nonfinite = {v for v, c in zip(jaxpr.invars, in_codes, strict=True) if c}
    for eqn, c in zip(eqns, eqn_codes, strict=True):
        if c:
            nonfinite.update(v for v in eqn.outvars if isinstance(v, Var))
    # Walk back from the non-finite gradients; the earliest equation that turned finite
    # inputs into a non-finite output is where the anomaly appeared.
    needed = {jaxpr.outvars[k] for k in bad_grads if isinstance(jaxpr.outvars[k], Var)}
    origin = None
    for i in range(len(eqns) - 1, -1, -1):
        eqn = eqns[i]
        if not any(isinstance(v, Var) and v in needed for v in eqn.outvars):
            continue
        ins = [v for v in eqn.invars if isinstance(v, Var)]
        needed.update(ins)
        if eqn_codes[i] and not any(v in nonfinite for v in ins):
            origin = i
    if origin is None:
        return f"{head}\n{_input_origin(pair, jaxpr, needed, in_codes)}{_HINT}"

    eqn = eqns[origin]
    line = source_line(eqn)
    derivative = origin in _cotangent_dependent(pair, jaxpr)
    forward_ops = _forward_ops_at(pair, line)
    ops = ", ".join(f"`{p}`" for p in forward_ops) or f"`{eqn.primitive.name}`"
    role = ("which computes part of the derivative of" if derivative
            else "which recomputes, for the backward, a value of")
    return (f"{head}\nIt first appeared ({_KIND[int(eqn_codes[origin])]}) in backward equation "
            f"{origin} of {len(eqns)}:\n    {eqn}\n{role} the forward operation {ops} at {line}"
            f"{_sequence_number(eqn)}.{_HINT}")


_HINT = ("\n(aotgrad.config.detect_anomaly is on; it adds a check to every backward, "
         "turn it off when done.)")


def _input_origin(pair: "ProgramPair", jaxpr: Any, needed: set, in_codes: np.ndarray) -> str:
    """The message when a backward input (saved value or cotangent) was already non-finite."""
    n_act, n_saved_in = len(pair.split.activations), len(pair.split.saved_inputs)
    for k, (v, c) in enumerate(zip(jaxpr.invars, in_codes, strict=True)):
        if not c or v not in needed:
            continue
        what = _KIND[int(c)]
        if k < n_act:
            eqn = pair.split.producers[k]
            line = source_line(eqn)
            ops = ", ".join(f"`{p}`" for p in _forward_ops_at(pair, line))
            return (f"It was already in saved value #{k} ({what}), computed by the forward for the "
                    f"derivative of the forward operation {ops} at {line}{_sequence_number(eqn)} "
                    f"(saved from `{eqn.primitive.name}`).")
        if k < n_act + n_saved_in:
            return (f"It was already in input #{pair.split.saved_inputs[k - n_act]}, which the backward "
                    f"reads: that input holds {what}.")
        return f"It was already in output cotangent #{k - n_act - n_saved_in}: that cotangent holds {what}."
    return "No single equation could be named."


def _sequence_number(eqn: Any) -> str:
    """" (sequence number #n)" of the forward equation `eqn` comes from; for an equation
    inside that equation's body (an inlined `jit`), also what and where that equation is."""
    o = provenance.origin(eqn)
    if o is None:
        return ""
    if o.line == short_source_line(eqn):
        return f" (sequence number #{o.seq})"
    return f" (sequence number #{o.seq}: inside `{o.primitive}` at {o.line})"


def _cotangent_dependent(pair: "ProgramPair", jaxpr: Any) -> set[int]:
    """Indices of the backward equations that read a cotangent (directly or not); the
    others recompute forward values."""
    n_saved = len(pair.split.activations) + len(pair.split.saved_inputs)
    reached = reachable(jaxpr.eqns, jaxpr.invars[n_saved:])
    return {i for i, eqn in enumerate(jaxpr.eqns) if any(isinstance(v, Var) and v in reached for v in eqn.invars)}


def _forward_ops_at(pair: "ProgramPair", line: str) -> list[str]:
    """Primitives of the forward equations of the joint graph on the user's `line`."""
    graph = pair.graph
    ops: list[str] = []
    for eqn in graph.eqns:
        if not graph.is_backward_eqn(eqn) and source_line(eqn) == line and eqn.primitive.name not in ops:
            ops.append(eqn.primitive.name)
    return ops
