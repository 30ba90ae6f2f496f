"""`aotgrad.config.detect_anomaly`: a NaN/Inf gradient names the forward operation and line."""
from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad

try:
    from tests.partition_configs import config_id, partitioner_configs
except ImportError:
    from partition_configs import config_id, partitioner_configs


def _line_of(fn, text: str) -> str:
    """`test_anomaly.py:<line>` of the line of `fn` containing `text`."""
    lines, start = inspect.getsourcelines(fn)
    (offset,) = [i for i, line in enumerate(lines) if text in line]
    return f"test_anomaly.py:{start + offset}"


def masked_log(x):
    safe = jnp.where(x > 0, jnp.log(x), 0.0)  # the gradient at 0 is 0 * inf = NaN, as in JAX
    return jnp.sum(safe * 2.0)


X = jnp.array([1.0, 0.0, 2.0])


@pytest.mark.parametrize("config", partitioner_configs(budgets=(0.0, 1.0)), ids=config_id)
def test_names_the_forward_operation_and_line(config):
    with aotgrad.config.patch(detect_anomaly=True, **config):
        with pytest.raises(FloatingPointError) as info:
            jax.grad(aotgrad.compile(masked_log))(X)
    message = str(info.value)
    assert "the backward of masked_log produced NaN in the gradient of input #0" in message
    assert "derivative of the forward operation `log`" in message
    assert _line_of(masked_log, "jnp.log") in message
    assert "backward equation" in message


def test_fwd_and_bwd_and_jit():
    with aotgrad.config.patch(detect_anomaly=True):
        fwd, bwd = aotgrad.fwd_and_bwd(masked_log)
        out, saved = fwd(X)
        with pytest.raises(FloatingPointError, match="forward operation `log`"):
            bwd(saved, jnp.ones_like(out))
        # Inside jax.jit the program checks itself when it runs (a debug callback).
        with pytest.raises(jax.errors.JaxRuntimeError, match="forward operation `log`"):
            jax.jit(jax.grad(aotgrad.compile(masked_log)))(X).block_until_ready()
        # Finite gradients pass, also with non-finite values in between.
        np.testing.assert_allclose(jax.grad(aotgrad.compile(masked_log))(X + 1.0), 2.0 / (X + 1.0), rtol=1e-6)


def test_double_where_is_clean():
    def f(x):
        safe_x = jnp.where(x > 0, x, 1.0)
        return jnp.sum(jnp.where(x > 0, jnp.log(safe_x), 0.0))
    with aotgrad.config.patch(detect_anomaly=True):
        np.testing.assert_allclose(jax.grad(aotgrad.compile(f))(X), jax.grad(f)(X))


def test_value_already_non_finite_in_the_forward():
    def f(x):
        return jnp.sum(jnp.sqrt(x))  # d sqrt at 0 is Inf: the forward computes and saves it
    with aotgrad.config.patch(detect_anomaly=True):
        with pytest.raises(FloatingPointError) as info:
            jax.grad(aotgrad.compile(f))(jnp.array([0.0, 4.0]))
    message = str(info.value)
    assert "produced Inf in the gradient of input #0" in message
    assert "forward operation `sqrt`" in message and _line_of(f, "jnp.sqrt") in message


def test_non_finite_cotangent():
    with aotgrad.config.patch(detect_anomaly=True):
        fwd, bwd = aotgrad.fwd_and_bwd(lambda x: x * 2.0)
        out, saved = fwd(X)
        with pytest.raises(FloatingPointError, match="It was already in output cotangent #0: that cotangent holds NaN"):
            bwd(saved, jnp.full(3, jnp.nan))


def test_off_by_default_and_no_check_when_off():
    f = aotgrad.compile(masked_log)
    assert aotgrad.config.detect_anomaly is False
    assert np.isnan(jax.grad(f)(X)[1])  # as JAX: no error
    assert f.cache_info().entries == 1
    (pair,) = f.trace(X).pairs.values()
    assert type(pair.run_backward) is aotgrad.runtime.Backward  # the plain one: nothing added to the hot path
    assert len(pair.backward.trace(*pair.split.backward.in_avals).out_info) == 1  # gradients only
