"""Whole models with non-array leaves (equinox modules with function fields), the
`python_scalars` convention, and compiled methods."""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad

eqx = pytest.importorskip("equinox")


def _loss(model, x, scale):
    return jnp.mean(jax.vmap(model)(x) ** 2) * scale


def _mlp(activation=jax.nn.gelu):
    return eqx.nn.MLP(4, 2, 16, 2, activation=activation, key=jax.random.key(0))


X = jax.random.normal(jax.random.key(1), (8, 4))


def _assert_trees_close(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got, want)


@pytest.mark.parametrize("python_scalars", ["traced", "static"])
@pytest.mark.parametrize("outer_jit", [False, True], ids=["eager", "filter_jit"])
def test_equinox_model_passed_whole(python_scalars, outer_jit):
    compiled = aotgrad.compile(_loss, python_scalars=python_scalars)
    wrap = eqx.filter_jit if outer_jit else (lambda f: f)
    want = wrap(eqx.filter_value_and_grad(_loss))(_mlp(), X, 2.0)
    got = wrap(eqx.filter_value_and_grad(compiled))(_mlp(), X, 2.0)
    _assert_trees_close(got, want)
    # Another activation (a static leaf) is another program, not a stale one.
    want = wrap(eqx.filter_value_and_grad(_loss))(_mlp(jax.nn.tanh), X, 2.0)
    _assert_trees_close(wrap(eqx.filter_value_and_grad(compiled))(_mlp(jax.nn.tanh), X, 2.0), want)


def test_python_scalars_traced_or_static():
    traced = aotgrad.compile(_loss)
    static = aotgrad.compile(_loss, python_scalars="static")
    for scale in (2.0, 3.0, 2.0):
        for f in (traced, static):
            np.testing.assert_allclose(f(_mlp(), X, scale), _loss(_mlp(), X, scale), rtol=1e-6)
    assert traced.cache_info().entries == 1  # as jax.jit: a weakly typed traced scalar
    assert static.cache_info().entries == 2  # as eqx.filter_jit: each value is its own program
    with pytest.raises(ValueError, match=r"python_scalars must be one of \['traced', 'static'\]; got 'yes'"):
        aotgrad.compile(_loss, python_scalars="yes")


def test_fwd_and_bwd_gives_none_for_static_leaves():
    fwd, bwd = aotgrad.fwd_and_bwd(aotgrad.compile(_loss), argnums=0)
    out, saved = fwd(_mlp(), X, 2.0)
    grads = bwd(saved, jnp.ones_like(out))
    want = eqx.filter_grad(_loss)(_mlp(), X, 2.0)
    _assert_trees_close(grads, want)


def test_unhashable_leaf_is_keyed_by_identity_with_one_note(caplog):
    class Table:  # unhashable: defines __eq__ without __hash__
        def __init__(self, k):
            self.k = k

        def __eq__(self, other):
            return isinstance(other, Table) and other.k == self.k

        __hash__ = None

    f = aotgrad.compile(lambda p, x: x * p["table"].k)
    a, b = Table(2.0), Table(3.0)
    with aotgrad.config.patch(log_recompiles=True), caplog.at_level(logging.WARNING, "aotgrad"):
        np.testing.assert_allclose(f({"table": a}, jnp.ones(2)), [2.0, 2.0])
        np.testing.assert_allclose(f({"table": b}, jnp.ones(2)), [3.0, 3.0])
        f({"table": a}, jnp.ones(2))
    notes = [r.getMessage() for r in caplog.records if "keyed on the object's identity" in r.getMessage()]
    assert len(notes) == 1 and "argument p['table']" in notes[0]
    assert f.cache_info().entries == 2 and f.cache_info().hits == 1


class Scaled:
    def __init__(self, k):
        self.k = k

    @aotgrad.compile
    def loss(self, w, x):
        return jnp.sum((x @ w) ** 2) * self.k


@dataclasses.dataclass(frozen=True)
class Frozen:
    k: float

    @aotgrad.compile
    def loss(self, w, x):
        return jnp.sum((x @ w) ** 2) * self.k


class EqxScaled(eqx.Module):
    w: jax.Array
    activation: object = jax.nn.tanh

    @aotgrad.compile
    def loss(self, x):
        return jnp.sum(self.activation(x @ self.w))


def test_methods_bind_self():
    w = jnp.ones((4, 3)) * 0.1
    for k in (2.0, 5.0):  # two instances with different attributes: two programs
        got = jax.value_and_grad(Scaled(k).loss)(w, X)
        want = jax.value_and_grad(lambda w, x: jnp.sum((x @ w) ** 2) * k)(w, X)
        _assert_trees_close(got, want)
    assert Scaled.loss.cache_info().entries == 2
    # Equal hashable instances share one; different ones do not.
    assert float(Frozen(2.0).loss(w, X)) == pytest.approx(float(Frozen(2.0).loss(w, X)))
    np.testing.assert_allclose(Frozen(3.0).loss(w, X), 3.0 * jnp.sum((X @ w) ** 2), rtol=1e-6)
    assert Frozen.loss.cache_info().entries == 2
    # A pytree `self` is traced: gradients reach its arrays.
    model = EqxScaled(w)
    _assert_trees_close(eqx.filter_grad(lambda m, x: m.loss(x))(model, X),
                        eqx.filter_grad(lambda m, x: jnp.sum(m.activation(x @ m.w)))(model, X))


class _Reshaper(eqx.Module):
    """An int field used as a shape and a bool used in control flow: configuration, static
    under `eqx.filter_jit`."""
    w: jax.Array
    n: int = 4
    negate: bool = False
    name: str = "reshaper"

    def __call__(self, x):
        y = (x.reshape(self.n, -1) @ self.w).sum()
        return -y if self.negate else y


def _reshaper(**kw):
    return _Reshaper(jnp.arange(6.0).reshape(2, 3) / 6, **kw)


@pytest.mark.parametrize("outer", ["eager", "filter_jit"])
def test_equinox_scalar_fields_are_static_by_default(outer):
    """As under eqx.filter_jit: without it the int field is traced and reshape fails."""
    compiled = aotgrad.compile(lambda m, x: m(x))
    wrap = eqx.filter_jit if outer == "filter_jit" else (lambda f: f)
    x = jnp.arange(8.0)
    for kw in ({}, {"negate": True}, {"n": 2}):
        m = _reshaper(**kw) if kw.get("n") != 2 else _Reshaper(jnp.ones((4, 3)), n=2)
        got = wrap(eqx.filter_value_and_grad(compiled))(m, x)
        want = eqx.filter_value_and_grad(lambda m, x: m(x))(m, x)
        _assert_trees_close(got, want)


def test_a_module_method_as_the_loss():
    m = _reshaper(negate=True)
    x = jnp.arange(8.0)
    got = jax.grad(aotgrad.compile(lambda w, x: dataclasses.replace(m, w=w)(x)))(m.w, x)
    _assert_trees_close(got, jax.grad(lambda w, x: dataclasses.replace(m, w=w)(x))(m.w, x))
    compiled_method = aotgrad.compile(_Reshaper.__call__)
    _assert_trees_close(eqx.filter_grad(compiled_method)(m, x), eqx.filter_grad(_Reshaper.__call__)(m, x))


def test_plain_python_scalars_keep_jax_jit_rule_and_the_error_names_them():
    def f(x, n, flag):
        y = x.reshape(n, -1).sum()
        return y if flag else -y
    with pytest.raises(TypeError, match=r"Python scalar arguments are traced .*: n \(int 4\), flag \(bool True\)"
                                        r".*python_scalars=\"static\""):
        jax.grad(aotgrad.compile(f))(jnp.ones(8), 4, True)
    got = jax.grad(aotgrad.compile(f, static_argnums=(1, 2)))(jnp.ones(8), 4, False)
    np.testing.assert_allclose(got, -jnp.ones(8))
