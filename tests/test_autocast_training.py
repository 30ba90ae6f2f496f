"""A short training run with optax: bf16 autocast tracks float32; float16 with dynamic
loss scaling does not diverge. Plus the loss scale's own rules."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad

optax = pytest.importorskip("optax")  # in the `test` extra

STEPS = 300


def _loss(params, x, y):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    h = jax.nn.gelu(h @ params["w2"] + params["b2"])
    return jnp.mean((h @ params["w3"] - y) ** 2)


def _data():
    kx, kt, *kp = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(kx, (STEPS, 32, 16))
    teacher = jax.random.normal(kt, (16, 4)) / 4.0
    y = jnp.tanh(x @ teacher * 2.0)
    params = {"w1": jax.random.normal(kp[0], (16, 64)) / 4.0, "b1": jnp.zeros(64),
              "w2": jax.random.normal(kp[1], (64, 64)) / 8.0, "b2": jnp.zeros(64),
              "w3": jax.random.normal(kp[2], (64, 4)) / 8.0}
    return params, x, y


def _train(context, loss_scale=None):
    """Losses of STEPS Adam steps; `context()` is entered while the step is traced."""
    params, xs, ys = _data()
    opt = optax.adam(1e-2)
    cf = aotgrad.compile(_loss)

    def step(carry, batch):
        params, state, scale = carry
        with context():
            if scale is None:
                loss, grads = jax.value_and_grad(cf)(params, *batch)
            else:
                loss, grads = jax.value_and_grad(lambda p: scale.scale(cf(p, *batch)))(params)
                loss, grads = loss / scale.loss_scale, scale.unscale(grads)
        updates, new_state = opt.update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        if scale is not None:  # skip non-finite steps, adjust the scale
            finite = aotgrad.all_finite(grads)
            new_params, new_state = aotgrad.select_tree(finite, (new_params, new_state), (params, state))
            scale = scale.adjust(finite)
        return (new_params, new_state, scale), loss

    (_, _, scale), losses = jax.jit(lambda c: jax.lax.scan(step, c, (xs, ys)))(
        (params, opt.init(params), loss_scale))
    return np.asarray(losses, np.float64), scale


def test_bf16_tracks_float32_and_fp16_with_loss_scaling_does_not_diverge():
    import contextlib
    f32, _ = _train(contextlib.nullcontext)
    bf16, _ = _train(lambda: aotgrad.autocast("cpu", dtype=jnp.bfloat16))
    fp16, scale = _train(lambda: aotgrad.autocast("gpu", dtype=jnp.float16),
                         aotgrad.DynamicLossScale(period=50))
    assert f32[-20:].mean() < 0.2 * f32[:5].mean()  # it learns
    # Stated tolerance: the loss curves (smoothed over 20 steps) stay within 5% of float32
    # (measured: about 1% for bf16, 2% for fp16).
    smooth = lambda a: np.convolve(a, np.ones(20) / 20, mode="valid")  # noqa: E731
    assert np.max(np.abs(smooth(bf16) - smooth(f32)) / smooth(f32)) < 0.05
    finite = fp16[np.isfinite(fp16)]
    assert len(finite) >= STEPS - 20  # a few skipped steps at the start at most
    assert finite[-20:].mean() < 0.2 * finite[:5].mean()
    assert np.max(np.abs(smooth(fp16) - smooth(f32)) / smooth(f32)) < 0.05
    assert float(scale.loss_scale) >= 1.0


def test_dynamic_loss_scale_rules():
    s = aotgrad.DynamicLossScale(loss_scale=jnp.float32(8.0), period=2, min_loss_scale=2.0)
    assert float(s.scale(jnp.float16(3.0))) == 24.0 and s.scale(jnp.float16(3.0)).dtype == jnp.float16
    assert float(s.unscale({"g": jnp.float32(24.0)})["g"]) == 3.0
    adjust = jax.jit(lambda s, f: s.adjust(f))
    s1 = adjust(s, jnp.bool_(True))
    assert (float(s1.loss_scale), int(s1.counter)) == (8.0, 1)
    s2 = adjust(s1, jnp.bool_(True))
    assert (float(s2.loss_scale), int(s2.counter)) == (16.0, 0)  # grown after `period` finite steps
    s3 = adjust(s2, jnp.bool_(False))
    assert (float(s3.loss_scale), int(s3.counter)) == (8.0, 0)
    s4 = adjust(adjust(s3, jnp.bool_(False)), jnp.bool_(False))
    assert float(s4.loss_scale) == 2.0  # never below the floor
    assert not bool(aotgrad.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    assert bool(aotgrad.all_finite([jnp.ones(2)]))
    picked = aotgrad.select_tree(jnp.bool_(False), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})
    np.testing.assert_array_equal(picked["a"], jnp.zeros(2))
    with pytest.raises(ValueError, match="period must be an integer >= 1; got 0"):
        aotgrad.DynamicLossScale(period=0)
    with pytest.raises(ValueError, match="factor must be a number > 1"):
        aotgrad.DynamicLossScale(factor=1)
