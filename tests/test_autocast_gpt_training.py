"""300 Adam steps of a small GPT (the benchmarks' model): bfloat16 autocast ends where float32
and the hand-written bfloat16 model end; float16 autocast with dynamic loss scaling survives
a forced overflow without an inf or NaN reaching the parameters.

Independent references: the float32 model trained with plain `jax.value_and_grad`, and the
same model written in bfloat16 by hand (`benchmarks.workloads`, `dtype="bfloat16"`), also
trained with plain JAX."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad
from benchmarks.workloads import build

optax = pytest.importorskip("optax")  # in the `test` extra

STEPS = 300
SIZES = dict(batch=16, seq=16, d_model=32, heads=2, layers=2, vocab=32)
OVERFLOW_AT = 150  # the step whose loss is multiplied by 1e6 (float16 only)


def _data() -> dict:
    """Tokens that mostly follow t -> (3t + 1) mod vocab, a quarter of them drawn at random:
    learnable, with a loss floor well above zero, so final losses compare relatively."""
    k0, k1, k2 = jax.random.split(jax.random.key(1), 3)
    b, t, v = SIZES["batch"], SIZES["seq"], SIZES["vocab"]
    first = jax.random.randint(k0, (STEPS, b), 0, v)
    noise = jax.random.randint(k1, (STEPS, b, t), 0, v)
    keep = jax.random.uniform(k2, (STEPS, b, t)) < 0.75
    cols = [first]
    for i in range(t):
        cols.append(jnp.where(keep[:, :, i], (3 * cols[-1] + 1) % v, noise[:, :, i]))
    tokens = jnp.stack(cols, axis=-1)
    return {"tokens": tokens[..., :-1], "targets": tokens[..., 1:]}


def _train(loss_fn, context=contextlib.nullcontext, loss_scale=None, boost=None):
    """Per-step losses, whether each step's gradients were finite and whether the parameters
    stayed finite after it; `context()` is entered while the step is traced."""
    params = build("gpt", "gpt", SIZES).params
    opt = optax.adam(3e-3)
    boost = jnp.ones(STEPS) if boost is None else boost

    def step(carry, xs):
        params, state, scale = carry
        batch, factor = xs
        with context():
            if scale is None:
                loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            else:
                loss, grads = jax.value_and_grad(lambda p: scale.scale(loss_fn(p, batch) * factor))(params)
                loss, grads = loss / scale.loss_scale / factor, scale.unscale(grads)
        finite = aotgrad.all_finite(grads)
        updates, new_state = opt.update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        if scale is not None:  # skip a non-finite step, adjust the scale
            new_params, new_state = aotgrad.select_tree(finite, (new_params, new_state), (params, state))
            scale = scale.adjust(finite)
        return (new_params, new_state, scale), (loss.astype(jnp.float32), finite, aotgrad.all_finite(new_params))

    (final, _, scale), (losses, finite, params_finite) = jax.jit(lambda c, xs: jax.lax.scan(step, c, xs))(
        (params, opt.init(params), loss_scale), (_data(), boost))
    return np.asarray(losses, np.float64), np.asarray(finite), np.asarray(params_finite), scale


def _final(losses: np.ndarray) -> float:
    return float(losses[-20:].mean())


@pytest.fixture(scope="module")
def float32_run():
    return _train(build("gpt", "gpt", SIZES).loss_fn)


def test_bf16_autocast_ends_where_float32_and_the_hand_written_model_end(float32_run):
    f32 = float32_run[0]
    hand = _train(build("gpt", "gpt", {**SIZES, "dtype": "bfloat16"}).loss_fn)[0]
    cf = aotgrad.compile(build("gpt", "gpt", SIZES).loss_fn)
    auto = _train(cf, lambda: aotgrad.autocast("gpu", jnp.bfloat16))[0]
    assert _final(f32) < 0.6 * f32[:5].mean()  # it learns
    # Goal: the final loss (mean of the last 20 steps) within 1% of float32's and of the
    # hand-written bfloat16 model's.
    assert abs(_final(auto) - _final(f32)) < 0.01 * _final(f32), (_final(auto), _final(f32))
    assert abs(_final(auto) - _final(hand)) < 0.01 * _final(hand), (_final(auto), _final(hand))


def test_fp16_autocast_with_loss_scaling_skips_a_forced_overflow(float32_run):
    f32 = float32_run[0]
    cf = aotgrad.compile(build("gpt", "gpt", SIZES).loss_fn)
    boost = jnp.ones(STEPS).at[OVERFLOW_AT].set(1e6)  # the scaled float16 backward overflows there
    losses, finite, params_finite, scale = _train(cf, lambda: aotgrad.autocast("gpu", jnp.float16),
                                                  aotgrad.DynamicLossScale(period=50), boost)
    assert params_finite.all()  # no inf or NaN ever reached the parameters
    assert not finite[OVERFLOW_AT]  # the overflow was seen and its step skipped
    assert finite[OVERFLOW_AT + 1:].mean() > 0.9  # and training went on
    assert float(scale.loss_scale) >= 1.0
    assert abs(_final(losses) - _final(f32)) < 0.02 * _final(f32), (_final(losses), _final(f32))
