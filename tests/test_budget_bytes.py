"""`activation_memory_budget` as a byte size: parsing, and the plan it picks.

The reference for gradients is `jax.grad` of the plain function; for memory, XLA's own
`memory_analysis()` of the two programs (`Report.memory`) and the fractional budgets'
plans, which a byte budget must reproduce at its ends."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad


@pytest.mark.parametrize("value, expected", [
    ("12GB", 12 * 10 ** 9), ("512MiB", 512 * 2 ** 20), ("1.5GB", 1_500_000_000), (" 2 kb ", 2000),
    ("64B", 64), ("3e6B", 3_000_000), ("1024", 1024), (4096, 4096), (np.int64(4096), 4096), (2, 2),
])
def test_byte_sizes_are_parsed(value, expected):
    with aotgrad.config.patch(activation_memory_budget=value):
        assert aotgrad.config.activation_memory_budget.n == expected


@pytest.mark.parametrize("value", [0, 1, 0.25, np.float32(0.5)])
def test_zero_one_and_floats_in_between_are_fractions(value):
    with aotgrad.config.patch(activation_memory_budget=value):
        assert aotgrad.config.activation_memory_budget == float(value)


@pytest.mark.parametrize("value, message", [
    (-5, "must not be negative; got -5"),
    ("-1GB", "a byte size is a number with a unit"),
    ("12XB", r"a byte size is a number with a unit \(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB\).*'12XB'"),
    ("GB", "a byte size is a number with a unit"),
    ("1.0000000001KB", r"'1.0000000001KB' is not a whole number of bytes"),
    ("0.5B", "is not a whole number of bytes"),
    (1.5, r"must be a fraction in \[0, 1\] or a byte size per device .*got 1.5"),
    (1.2e10, r"must be a fraction in \[0, 1\] or a byte size.*got 12000000000.0"),
    (True, "must be a fraction"),
    (None, "must be a fraction"),
])
def test_bad_byte_sizes_name_the_option(value, message):
    with pytest.raises(aotgrad.ConfigError, match=r"aotgrad.config.activation_memory_budget"):
        aotgrad.config.patch(activation_memory_budget=value)
    with pytest.raises(aotgrad.ConfigError, match=message):
        aotgrad.config.activation_memory_budget = value


def _mlp(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.sum(x ** 2)


@pytest.fixture(scope="module")
def mlp_args():
    keys = jax.random.split(jax.random.key(0), 7)
    ws = [jax.random.normal(k, (256, 256)) / 16 for k in keys[:6]]
    return ws, jax.random.normal(keys[6], (512, 256))


def _plan(budget, ws, x):
    f = aotgrad.compile(_mlp)
    with aotgrad.config.patch(activation_memory_budget=budget):
        report = aotgrad.explain(f, ws, x)
        grads = jax.grad(f)(ws, x)
    return report, grads


def test_a_byte_budget_spans_the_fractional_plans(mlp_args):
    """A budget above every plan's peak is budget 1's plan; the error for one below names
    the smallest peak, and that number as the budget plans a peak as low as budget 0's (by
    XLA's count). In between, saved bytes and XLA's step peak fall with the budget, and
    every plan's gradients are JAX's."""
    ws, x = mlp_args
    want = jax.grad(_mlp)(ws, x)
    full, zero = _plan(1.0, ws, x)[0], _plan(0.0, ws, x)[0]
    assert full.saved_bytes > zero.saved_bytes  # the MLP has room to trade
    assert _plan(10 ** 12, ws, x)[0].saved == full.saved

    with pytest.raises(aotgrad.BudgetUnreachable, match=r"smallest step peak aotgrad can plan .* about [\d,]+ bytes") as e:
        _plan("1KB", ws, x)
    smallest = e.value.smallest
    assert e.value.budget == 1000 and isinstance(e.value, aotgrad.ConfigError)

    def step_peak(r):
        return max(r.memory.forward_peak, r.memory.backward_peak)

    saved, peaks = [], []
    for scale in (1.0, 1.05, 1.1, 1.2, 1.4, 2.0):
        report, grads = _plan(int(smallest * scale), ws, x)
        for g, w in zip(grads, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6 * float(jnp.abs(w).max()))
        saved.append(report.saved_bytes)
        peaks.append(step_peak(report))
    assert saved == sorted(saved) and peaks == sorted(peaks), (saved, peaks)
    assert peaks[0] <= step_peak(zero) and saved[-1] == full.saved_bytes, (peaks, step_peak(zero))


def test_the_vjp_partitioner_rejects_a_byte_budget():
    with aotgrad.config.patch(partitioner="vjp", activation_memory_budget="1GB"):
        with pytest.raises(aotgrad.ConfigError, match="activation_memory_budget=1,000,000,000 bytes needs a "
                                                       "partitioner that can recompute"):
            jax.grad(aotgrad.compile(lambda x: jnp.sum(jnp.sin(x))))(jnp.ones(3))


def test_a_byte_budget_on_a_scan():
    """A scanned MLP: the error's smallest peak is one a budget can ask for (the scans'
    levels are tried, not only the one the budget first gave them), gradients are JAX's."""
    def f(ws, x):
        def layer(h, w):
            return jnp.tanh(h @ w), None
        return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)

    ws = jax.random.normal(jax.random.key(1), (16, 64, 64)) / 8
    x = jax.random.normal(jax.random.key(2), (128, 64))
    want = jax.grad(f)(ws, x)
    g = aotgrad.compile(f)
    with pytest.raises(aotgrad.BudgetUnreachable) as e:
        with aotgrad.config.patch(activation_memory_budget=1000):
            jax.grad(g)(ws, x)
    for scale in (1.0, 100.0):
        with aotgrad.config.patch(activation_memory_budget=int(e.value.smallest * scale)):
            np.testing.assert_allclose(jax.grad(g)(ws, x), want, rtol=2e-5, atol=2e-6 * float(jnp.abs(want).max()))
