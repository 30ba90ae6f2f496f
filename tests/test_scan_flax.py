"""Flax scanned models (`flax.linen.scan`, `nnx.scan`) under min_cut, with dropout inside
the scanned body: values, gradients and RNG state against plain flax at budgets 0, 0.3,
0.7 and 1. A mask drawn differently in the recomputation, or a body cut that drops a
carry, makes the gradients differ from JAX's."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

BUDGETS = (0.0, 0.3, 0.7, 1.0)
B, D, L = 4, 8, 3


def _close(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-5)


def _x() -> jax.Array:
    return jax.random.normal(jax.random.key(1), (B, D))


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        z = nn.Dropout(0.3, deterministic=False)(jnp.tanh(nn.Dense(D)(h)))
        return nn.LayerNorm()(h + z), None


class LinenStack(nn.Module):
    @nn.compact
    def __call__(self, h):
        scanned = nn.scan(LinenBlock, variable_axes={"params": 0}, length=L,
                          split_rngs={"params": True, "dropout": True})
        return scanned()(h, None)[0]


def test_linen_scan_with_dropout_equals_jax() -> None:
    model, x = LinenStack(), _x()
    params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(2)}, x)

    def loss(params, x):
        return jnp.sum(jnp.sin(model.apply(params, x, rngs={"dropout": jax.random.key(5)})) * x)

    expected = jax.value_and_grad(loss)(params, x)
    saved = []
    for budget in BUDGETS:
        with aotgrad.config.patch(partitioner="min_cut", activation_memory_budget=budget):
            f = aotgrad.compile(loss)
            _close(jax.jit(jax.value_and_grad(f))(params, x), expected)
            saved.append(aotgrad.explain(f, params, x, argnums=0).saved_bytes)
    # The budget acts inside the scanned body (a scan left to jax.vjp saves the same at every budget).
    assert saved == sorted(saved) and saved[0] < saved[-1]


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, h):
        return self.norm(h + self.drop(jnp.tanh(self.linear(h))))


class NnxStack(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return NnxBlock(rngs)
        self.blocks = blocks(rngs)

    def __call__(self, h):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def step(block, h):
            return block(h)
        return step(self.blocks, h)


def _nnx_loss(model, x):
    return jnp.sum(jnp.sin(model(x)) * x)


def _nnx_step(loss_fn):
    """One gradient evaluation: value, gradients, and the dropout RNG state after it."""
    model = NnxStack(nnx.Rngs(0, dropout=1))
    value, grads = nnx.value_and_grad(loss_fn)(model, _x())
    rng = nnx.to_pure_dict(nnx.state(model, nnx.RngState))
    return (value, nnx.to_pure_dict(grads)), jax.tree.map(
        lambda a: jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a, rng)


def test_nnx_scan_with_dropout_equals_plain_nnx() -> None:
    want, want_rng = _nnx_step(_nnx_loss)
    assert (want_rng["blocks"]["drop"]["rngs"]["count"] == 1).all()  # one mask drawn per layer
    for budget in BUDGETS:
        with aotgrad.config.patch(partitioner="min_cut", activation_memory_budget=budget):
            got, got_rng = _nnx_step(aotgrad.compile(_nnx_loss))
        _close(got, want)
        jax.tree.map(np.testing.assert_array_equal, got_rng, want_rng)
