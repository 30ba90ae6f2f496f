"""Real model families (benchmarks/real_models.py) at tiny sizes: a few AdamW steps with the
loss as is and with `aotgrad.compile(loss)` give the same losses, parameters, optimizer
moments and model state. The reference is each family's own plain training (Flax NNX under
`nnx.jit`, linen under `jax.pmap` and `jax.jit`, Equinox under `eqx.filter_jit`, JAX with a
`jax.custom_vjp` attention). Each case runs the benchmark's own per-model path (one timing
round of one step), so the runner, its peaks and its table row are checked too."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad

pytest.importorskip("optax")
pytest.importorskip("flax")
pytest.importorskip("equinox")

from benchmarks import real_jax, real_models as rm  # noqa: E402

STEPS = 3

# What a difference in each model would point to (in aotgrad):
CATCHES = {
    # nnx graph nodes as arguments (split, traced state, Variables written back), RMSNorm
    # and rotary embeddings, `jax.nn.dot_product_attention`'s derivative.
    "gemma_nnx": "nnx modules through nnx.value_and_grad; dot_product_attention",
    # the aux output (new batch statistics) returned with the loss, and BatchNorm's pmean
    # over the pmap axis inside the compiled function: wrong statistics or an unbound axis.
    "resnet_linen_pmap": "has_aux state under jax.pmap; collectives in the loss",
    # nn.scan's lifted scan over stacked layer parameters: a body cut that drops a carry.
    "decoder_linen_scan": "a scan over layers",
    # static int fields of an eqx.Module: traced, the patch and head reshapes cannot run.
    "vit_equinox": "static Python ints inside an eqx.Module",
    # a custom_vjp whose forward is a scan and whose backward recomputes blockwise:
    # residuals or the nondiff block size mishandled.
    "gpt_flash_custom_vjp": "a custom_vjp attention with a scan inside",
}


@pytest.mark.parametrize("name", list(rm.MODELS))
def test_trains_identically(name: str) -> None:
    """Losses, parameters, Adam's moments, step count and BatchNorm statistics. A gradient
    wrong by a constant factor barely moves Adam's steps (nor the losses): the first moment,
    part of the compared state, is what catches it (1% off fails every model here)."""
    assert name in CATCHES
    result = rm.run_model(name, rm.TINY[name], steps=STEPS, repeats=1, min_sample_seconds=0.0)
    assert result.error is None, result.error
    assert result.comparison is not None and result.losses is not None
    assert result.comparison.identical, result.comparison.first_mismatch
    plain = result.losses["plain"]
    assert len(plain) == STEPS and plain[-1] < plain[0]  # the reference trains
    # XLA's peak of each step, read through the family's jit; the table row has every column.
    assert result.peak is not None and all(p and p > 0 for p in result.peak.values()), result.peak_note
    row = rm.format_table([result]).splitlines()[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == name and cells[2].startswith("yes"), row
    assert cells[3].endswith(" ms)") and cells[4].endswith(" s)") and cells[5].endswith(" MB)"), row


def _qkv(t: int = 8, d: int = 4) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(3), 3)
    return tuple(jax.random.normal(k, (2, 2, t, d), jnp.float32) for k in keys)


def test_flash_attention_matches_plain_attention() -> None:
    """The benchmark's custom_vjp attention is attention: value and its own backward
    against JAX's derivative of the plain causal softmax attention."""
    q, k, v = _qkv()
    ct = jax.random.normal(jax.random.key(4), q.shape)

    def value_and_grads(attention):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(attention(*a) * ct), argnums=(0, 1, 2)))(q, k, v)

    got, got_grads = value_and_grads(lambda *a: real_jax.flash_attention(*a, 4))
    want, want_grads = value_and_grads(real_jax.reference_attention)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_custom_backward_is_the_one_used() -> None:
    """aotgrad differentiates a custom_vjp by its rule, not by its forward: a rule that
    doubles the cotangents gives doubled gradients under aotgrad as under JAX."""
    @jax.custom_vjp
    def attention(q, k, v):
        return real_jax.flash_attention(q, k, v, 4)

    def fwd(q, k, v):
        return real_jax._flash_fwd(q, k, v, 4)

    def bwd(residuals, ct):
        return tuple(2 * g for g in real_jax._flash_bwd(4, residuals, ct))

    attention.defvjp(fwd, bwd)

    def loss(q, k, v):
        return jnp.sum(jnp.sin(attention(q, k, v)))

    q, k, v = _qkv()
    grads = lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)  # noqa: E731
    want, got = grads(loss), grads(aotgrad.compile(loss))
    true = grads(lambda *a: jnp.sum(jnp.sin(real_jax.reference_attention(*a))))
    for g, w, t in zip(got, want, true, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g, 2 * t, rtol=1e-4, atol=1e-5)
