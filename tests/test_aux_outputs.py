"""Auxiliary outputs (`has_aux`): their cotangents are symbolic zeros, and the backward
must cost no more than the same step without them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad

X = jnp.linspace(-1.0, 1.0, 24).reshape(4, 6)


def assert_trees_close(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a, b)


def _stats_loss(w, x):
    h = jax.nn.relu(x @ w)
    y = jnp.tanh(h @ w)
    return jnp.sum(y ** 2), {"mean": jnp.mean(h, 0), "var": jnp.var(y @ w, 0), "h": h}


def _backward_matmuls(step, *args) -> int:
    jaxpr = jax.make_jaxpr(step)(*args).jaxpr
    backward = [e for e in jaxpr.eqns if e.primitive.name in ("jit", "pjit")][-1]
    return str(backward.params["jaxpr"]).count("dot_general")


def test_aux_outputs_cost_the_backward_nothing():
    # An aux output (batch statistics) computed from activations: its zero cotangent must
    # not flow back through the matmuls. Before, the backward computed with it (and with
    # the recomputation tied to it): 9 matmuls where the step without aux has 5.
    w = jax.random.normal(jax.random.key(2), (6, 6)) * 0.3
    f = aotgrad.compile(_stats_loss)
    without_aux = aotgrad.compile(lambda w, x: _stats_loss(w, x)[0])
    assert _backward_matmuls(jax.value_and_grad(f, has_aux=True), w, X) \
        == _backward_matmuls(jax.value_and_grad(without_aux), w, X)
    (out, aux), g = jax.jit(jax.value_and_grad(f, has_aux=True))(w, X)
    (want, want_aux), want_g = jax.value_and_grad(_stats_loss, has_aux=True)(w, X)
    assert_trees_close((out, aux, g), (want, want_aux, want_g))


@pytest.mark.parametrize("budget", [0.0, 0.5])
def test_aux_backward_is_smaller_than_the_full_one_at_any_budget(budget):
    # Below budget 1 the saved set may differ from the no-aux step's (the joint graph has
    # the aux outputs' backward), but the aux backward never does the aux paths' work.
    w = jax.random.normal(jax.random.key(2), (6, 6)) * 0.3
    f = aotgrad.compile(_stats_loss)

    def every_cotangent(w, x):
        out, pullback = jax.vjp(f, w, x)
        return pullback(jax.tree.map(jnp.ones_like, out))

    with aotgrad.config.patch(activation_memory_budget=budget):
        aux_only = _backward_matmuls(jax.value_and_grad(f, has_aux=True), w, X)
        assert aux_only < _backward_matmuls(every_cotangent, w, X)
        (out, aux), g = jax.jit(jax.value_and_grad(f, has_aux=True))(w, X)
    (want, want_aux), want_g = jax.value_and_grad(_stats_loss, has_aux=True)(w, X)
    assert_trees_close((out, aux, g), (want, want_aux, want_g))


def test_known_zero_follows_what_each_primitive_does_with_zero():
    from aotgrad.partition.zeros import known_zero

    def f(z, a):
        product = z * a
        total = product + a
        finite = jnp.isfinite(z)  # no rule: never known zero (it is True at zero)
        kept, ys = jax.lax.scan(lambda c, x: (c * 2.0, c + x), z, a)
        grown, seen = jax.lax.scan(lambda c, x: (c + x, c), z, a)
        called = jax.jit(lambda u: jnp.sum(u @ jnp.ones((3, 2)), 0))(z.reshape(1, 3))
        return product, total, finite, kept, ys, grown, seen, called

    jaxpr = jax.make_jaxpr(f)(jnp.zeros(3), jnp.ones(3)).jaxpr
    zero = known_zero(jaxpr.eqns, [jaxpr.invars[0]])
    assert [v in zero for v in jaxpr.outvars] == [True, False, False, True, False, False, False, True]
