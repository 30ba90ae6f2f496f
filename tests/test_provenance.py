"""Sequence numbers: each equation of the forward and backward programs names the forward
operation it comes from (its position in the forward trace, and the user's line), in the
jaxprs, in the compiled HLO's `op_name`, in `explain`'s backward-cost table and in
anomaly mode. The expected numbers are positions in `jax.make_jaxpr`'s own trace of the
function; the expected lines are this file's."""
from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad

M, K, N = 64, 256, 128


def _line(fn, text: str) -> str:
    """`test_provenance.py:<line>` of the line of `fn` containing `text`."""
    lines, start = inspect.getsourcelines(fn)
    (offset,) = [i for i, line in enumerate(lines) if text in line]
    return f"test_provenance.py:{start + offset}"


def _seq(fn, primitive: str, *args) -> int:
    """The position of the (only) `primitive` equation in JAX's own trace of `fn`."""
    (k,) = [k for k, e in enumerate(jax.make_jaxpr(fn)(*args).eqns) if e.primitive.name == primitive]
    return k


def _explain(fn, *args, **options):
    with aotgrad.config.patch(**options):
        return aotgrad.explain(fn, *args)


def _origin(eqn):
    from aotgrad.provenance import origin
    o = origin(eqn)
    return None if o is None else (o.seq, o.primitive, o.line)


def mlp(w, x):
    h = x @ w
    t = jnp.tanh(h)
    return jnp.sum(t * t)


W = jnp.ones((K, N)) / K
X = jnp.linspace(-1.0, 1.0, M * K).reshape(M, K)


def test_numbers_in_trace_order():
    report = _explain(mlp, W, X, partitioner="vjp")
    want = {(k, e.primitive.name) for k, e in enumerate(jax.make_jaxpr(mlp)(W, X).eqns)}
    origins = [_origin(e) for e in report.forward_jaxpr.jaxpr.eqns]
    assert {(seq, prim) for seq, prim, _ in origins} == want  # every forward equation, numbered
    seqs = [seq for seq, _, _ in origins]
    assert seqs == sorted(seqs)  # the forward program runs in trace order
    assert (_seq(mlp, "dot_general", W, X), "dot_general", _line(mlp, "x @ w")) in origins
    assert (_seq(mlp, "tanh", W, X), "tanh", _line(mlp, "jnp.tanh")) in origins


@pytest.mark.parametrize("partitioner", ["vjp", "min_cut"])
def test_backward_matmul_maps_to_the_forward_matmul(partitioner):
    # min_cut just below budget 1: the cheapest cut, which recomputes tanh
    report = _explain(mlp, W, X, partitioner=partitioner,
                      activation_memory_budget=0.99 if partitioner == "min_cut" else 1.0)
    matmul = (_seq(mlp, "dot_general", W, X), "dot_general", _line(mlp, "x @ w"))
    tanh = (_seq(mlp, "tanh", W, X), "tanh", _line(mlp, "jnp.tanh"))
    by_prim: dict[str, set] = {}
    for eqn in report.backward_jaxpr.jaxpr.eqns:
        by_prim.setdefault(eqn.primitive.name, set()).add(_origin(eqn))
    assert by_prim["dot_general"] == {matmul}  # both gradient matmuls come from `x @ w`
    # The derivative of tanh (min_cut recomputes tanh itself in the backward): tanh's number.
    assert tanh in by_prim["mul"]
    if partitioner == "min_cut":
        assert by_prim["tanh"] == {tanh}


def test_hlo_op_name_carries_number_and_line():
    compiled = aotgrad.compile(mlp).lower(W, X).compile()
    backward = compiled.backward.as_text()
    scope = f"#{_seq(mlp, 'dot_general', W, X)} dot_general at {_line(mlp, 'x @ w')}"
    dots = [line for line in backward.splitlines() if re.search(r"= f32\[[\d,]+\]\{[\d,]+\} dot\(", line)]
    assert len(dots) == 2
    for line in dots:  # the two gradient matmuls name the forward matmul and its line
        assert f'op_name="jit(backward)/transpose(jvp({scope}))/' in line
    assert f"jvp({scope})" in compiled.forward.as_text()


def test_explain_ranks_the_heavy_op_first():
    report = aotgrad.explain(mlp, W, X)
    top = report.backward_by_op[0]
    assert str(top) == f"backward of #{_seq(mlp, 'dot_general', W, X)} dot_general at {_line(mlp, 'x @ w')}"
    # Two gradient matmuls of 2*M*K*N FLOPs each (the cost model counts ~1 per element elsewhere).
    assert top.flops == pytest.approx(4 * M * K * N, rel=0.01)
    assert top.recomputed == 0
    # Every backward equation is counted once.
    assert sum(c.equations for c in report.backward_by_op) == len(report.backward_jaxpr.jaxpr.eqns)
    text = str(report)
    assert "backward cost by forward operation" in text
    assert f"#{_seq(mlp, 'dot_general', W, X)} dot_general at {_line(mlp, 'x @ w')}" in text


@jax.jit
def _inner(a):
    return jnp.sin(a) * 2.0


def nested(w, x):
    h = _inner(x @ w)
    c, ys = jax.lax.scan(lambda c, _: (jnp.cos(c) * c, c), h, None, length=3)
    return jnp.sum(c) + jnp.sum(ys)


def test_nested_equations_carry_the_enclosing_number():
    report = _explain(nested, W, X, partitioner="vjp")
    call = (_seq(nested, "jit", W, X), "jit", _line(nested, "_inner(x @ w)"))
    scan = (_seq(nested, "scan", W, X), "scan", _line(nested, "jax.lax.scan"))
    forward = {e.primitive.name: _origin(e) for e in report.forward_jaxpr.jaxpr.eqns}
    assert forward["sin"] == forward["cos"] == call  # the inlined jit's body and its derivative
    backward = {(e.primitive.name, _origin(e)) for e in report.backward_jaxpr.jaxpr.eqns}
    assert ("scan", scan) in backward
    assert ("mul", call) in backward  # the cotangent through sin: times cos, times 2
    with aotgrad.config.patch(partitioner="vjp"):
        compiled = aotgrad.compile(nested).lower(W, X).compile()
    seq, prim, line = scan
    assert f"transpose(jvp(#{seq} {prim} at {line}))/" in compiled.backward.as_text()


def test_numbers_survive_backward_autocast():
    with aotgrad.autocast("cpu", dtype=jnp.bfloat16):
        report = _explain(mlp, W, X, backward_pass_autocast="same_as_forward")
    dots = [e for e in report.backward_jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2 and all(e.invars[0].aval.dtype == jnp.bfloat16 for e in dots)
    line = _line(mlp, "x @ w")
    assert {_origin(e)[1:] for e in dots} == {("dot_general", line)}


def masked_log(x):
    safe = jnp.where(x > 0, jnp.log(x), 0.0)
    return jnp.sum(safe * 2.0)


def test_anomaly_names_the_sequence_number():
    x = jnp.array([1.0, 0.0, 2.0])
    with aotgrad.config.patch(detect_anomaly=True):
        with pytest.raises(FloatingPointError) as info:
            jax.grad(aotgrad.compile(masked_log))(x)
    message = str(info.value)
    assert "the forward operation `log` at " in message and f"{_line(masked_log, 'jnp.log')}:" in message
    assert f"(sequence number #{_seq(masked_log, 'log', x)})." in message


def test_gradients_unchanged():
    got = jax.grad(aotgrad.compile(nested), argnums=(0, 1))(W, X)
    want = jax.grad(nested, argnums=(0, 1))(W, X)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4), got, want)
