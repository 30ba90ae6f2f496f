"""`checkpoint_name` in a compiled function: outside the user's own `jax.checkpoint` regions
it is planned as if absent (XLA computes nothing for it; as equations of their own, names
made a GPU's estimates write values XLA:GPU computes in their readers, and the cut price a
name apart from its value); inside a region, its policy still decides what JAX saves."""
from __future__ import annotations

import dataclasses

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import aotgrad
from aotgrad.devices import profile_named
from aotgrad.interpret import sub_jaxprs
from aotgrad.partition import budget
from aotgrad.partition.min_cut import Problem

D, T, B = 32, 64, 4


def _attention_mlp(named: bool):
    name = checkpoint_name if named else (lambda x, _: x)

    @jax.jit  # a nested jit: its body is inlined into the joint graph, and its names dropped there too
    def softmax(s):
        m = name(s - s.max(-1, keepdims=True), "centred")
        e = name(jnp.exp(m), "exp")
        return name(e / e.sum(-1, keepdims=True), "probs")

    def loss(p, x):
        for layer in range(2):
            q, k, v = (name(x @ p[f"w{c}{layer}"], c) for c in "qkv")
            probs = softmax(name(jnp.einsum("btd,bsd->bts", q, k) / 8.0, "scores"))
            x = name(x + jnp.einsum("bts,bsd->btd", probs, v) @ p[f"wo{layer}"], "mid")
            x = name(x + jnp.tanh(x @ p[f"w1{layer}"]) @ p[f"w2{layer}"], "out")
        return jnp.sum(x * x)
    return loss


def _params() -> dict:
    shapes = {"wq": (D, D), "wk": (D, D), "wv": (D, D), "wo": (D, D), "w1": (D, 4 * D), "w2": (4 * D, D)}
    keys = iter(jax.random.split(jax.random.key(0), 12))
    return {f"{c}{layer}": jax.random.normal(next(keys), shape) / np.sqrt(shape[0])
            for layer in range(2) for c, shape in shapes.items()}


def _ladder(loss, params, x) -> list[tuple[int, float | None]]:
    graph = aotgrad.compile(loss).trace(params, x).pair(0, under_jit=True).graph
    graph = dataclasses.replace(graph, device=profile_named("h100"))
    return [(c.peak, c.traffic) for c in budget.choices(Problem.priced(graph))]


def test_names_outside_checkpoint_regions_leave_the_plans_as_they_are():
    """The same model with and without names, planned for an H100: every candidate the
    budgets choose from has the same estimated peak and bytes moved. (With the names kept
    as equations, the cheapest cut's estimate was 12% higher and the ladder other plans.)"""
    params, x = _params(), jax.random.normal(jax.random.key(1), (B, T, D))
    plain = _ladder(_attention_mlp(False), params, x)
    assert len(plain) > 3
    assert _ladder(_attention_mlp(True), params, x) == plain


@pytest.mark.parametrize("budget_value", [1.0, 0.0])
def test_a_named_model_gets_jaxs_gradients(budget_value: float):
    params, x = _params(), jax.random.normal(jax.random.key(1), (B, T, D))
    loss = _attention_mlp(True)
    want = jax.jit(jax.grad(loss))(params, x)
    with aotgrad.config.patch(activation_memory_budget=budget_value):
        got = jax.jit(jax.grad(aotgrad.compile(loss)))(params, x)
    for k in want:  # float32 rounding of gradients up to ~100
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5 * float(jnp.abs(want[k]).max()), err_msg=k)


def _matmuls(jaxpr) -> int:
    return sum((e.primitive is P.dot_general_p) + sum(map(_matmuls, sub_jaxprs(e))) for e in jaxpr.eqns)


def _region_step_matmuls(policy, through_aotgrad: bool) -> int:
    def loss(w, x):
        h = checkpoint_name(x @ w, "a")
        return jnp.sum(jnp.sin(jnp.sin(h) @ w))
    region = jax.checkpoint(loss, policy=policy)
    fn = aotgrad.compile(region) if through_aotgrad else region
    w, x = jnp.ones((16, 16)) / 16, jnp.ones((4, 16))
    return _matmuls(jax.make_jaxpr(jax.grad(fn))(w, x).jaxpr)


def test_names_inside_a_users_checkpoint_still_choose_what_jax_saves():
    """Inside `jax.checkpoint(policy=save_only_these_names("a"))` the name is kept: the
    step's matmuls are those of JAX's own step under each policy, and the two differ
    (dropped there, the named one would be recomputed as under `nothing_saveable`)."""
    names = jax.checkpoint_policies.save_only_these_names("a")
    nothing = jax.checkpoint_policies.nothing_saveable
    saving, recomputing = (_region_step_matmuls(p, True) for p in (names, nothing))
    assert saving == _region_step_matmuls(names, False)
    assert recomputing == _region_step_matmuls(nothing, False)
    assert saving < recomputing


def test_the_steps_joint_graph_holds_no_names_and_a_named_scan_gets_jaxs_gradients():
    def loss(w, xs):
        def body(c, x):
            return checkpoint_name(jnp.tanh(c @ w + x), "h"), None
        c, _ = jax.lax.scan(body, jnp.zeros((4, 8)), xs)
        return jnp.sum(checkpoint_name(c, "last") ** 2)
    w, xs = jnp.eye(8), jnp.ones((5, 4, 8))
    graph = aotgrad.compile(loss).trace(w, xs).pair(0, under_jit=True).graph
    assert not any(e.primitive is P.name_p for e in graph.eqns)
    with aotgrad.config.patch(activation_memory_budget=0.5):
        got = jax.jit(jax.grad(aotgrad.compile(loss)))(w, xs)
    np.testing.assert_allclose(got, jax.grad(loss)(w, xs), rtol=1e-5, atol=1e-6)
