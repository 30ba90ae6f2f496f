"""The benchmark workloads and peers are what aotgrad's memory and speed claims rest on:
the scanned GPT must be the same model as the unrolled one, and a `jax.checkpoint`
strategy must change only what is saved, never the values."""
from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from benchmarks.strategies import CHECKPOINT_STRATEGIES, ProgramMemory, prepare
from benchmarks.workloads import build

GPT = dict(batch=2, seq=8, d_model=16, heads=2, layers=3, vocab=32)
VIT = dict(batch=2, image=8, patch=4, d_model=16, heads=2, layers=2, classes=3)


def _close(a, b, tol: float = 1e-5) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def test_scanned_gpt_is_the_unrolled_gpt() -> None:
    unrolled = build("gpt", "gpt", GPT)
    scanned = build("gpt_scan", "gpt_scan", GPT)
    # Same seed: the same parameters, stacked on a leading layer axis.
    _close(jax.tree.map(lambda *xs: np.stack(xs), *unrolled.params["blocks"]), scanned.params["blocks"], 0)
    # jitted: one XLA program each (eagerly, every op of the unrolled model compiles alone)
    loss_u, grads_u = jax.jit(jax.value_and_grad(unrolled.loss_fn))(unrolled.params, unrolled.batch)
    loss_s, grads_s = jax.jit(jax.value_and_grad(scanned.loss_fn))(scanned.params, scanned.batch)
    _close(loss_u, loss_s)
    _close(jax.tree.map(lambda *xs: np.stack(xs), *grads_u["blocks"]), grads_s["blocks"])
    assert "scan" in str(jax.make_jaxpr(scanned.loss_fn)(scanned.params, scanned.batch))


@pytest.mark.parametrize("kind,sizes", [
    ("gpt", GPT), ("gpt_scan", GPT), ("mlp", dict(batch=4, width=8, depth=2)),
    ("transformer_block", dict(batch=2, seq=8, d_model=16, heads=2)), ("vit", VIT),
    ("convnet", dict(batch=2, image=8, channels=[4, 8], classes=3)),
    ("rnn", dict(batch=2, seq=4, d_in=3, hidden=5)),
])
def test_layer_remat_changes_what_is_saved_not_the_values(kind: str, sizes: dict) -> None:
    plain = build(kind, kind, sizes)
    remat = build(kind, kind, sizes, remat=functools.partial(
        jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable))
    assert "remat" in str(jax.make_jaxpr(remat.loss_fn)(remat.params, remat.batch)), \
        "remat= must wrap the model's layers"
    _close(jax.jit(jax.grad(plain.loss_fn))(plain.params, plain.batch),
           jax.jit(jax.grad(remat.loss_fn))(plain.params, plain.batch))


def test_the_vit_attends_both_ways() -> None:
    """Without positions, a ViT with bidirectional attention and average pooling does not
    depend on the order of its patches: swapping two changes no loss. Under a causal mask
    (a GPT's block) it would."""
    w = build("vit", "vit", VIT)
    assert w.params["pos"].shape == ((8 // 4) ** 2, 16)
    params = dict(w.params, pos=np.zeros_like(w.params["pos"]))
    images = np.asarray(w.batch["images"])
    swapped = images.copy()
    swapped[:, :4, :4], swapped[:, 4:, 4:] = images[:, 4:, 4:], images[:, :4, :4]
    loss = jax.jit(w.loss_fn)
    _close(loss(params, w.batch), loss(params, dict(w.batch, images=swapped)))
    assert abs(float(loss(w.params, w.batch)) - float(loss(w.params, dict(w.batch, images=swapped)))) > 1e-6


def test_checkpoint_strategies_lower_the_peak_of_a_scanned_model() -> None:
    w = build("gpt_scan", "gpt_scan", dict(GPT, batch=4, seq=32, layers=4))
    fused = prepare("fused", w)
    reference = fused.grads  # jax.jit(jax.value_and_grad(loss)): JAX without any checkpoint
    peaks = {}
    for name in CHECKPOINT_STRATEGIES:
        p = prepare(name, w)
        _close(p.grads, reference)
        assert p.memory.backward_peak is None and p.saved is None  # one program
        peaks[name] = p.memory.peak
    # Nothing saved per layer: XLA's peak is below the fused program's (deterministic).
    assert peaks["checkpoint:nothing_saveable"] < fused.memory.peak
    # min_cut at budget 0 saves only the carries, as nothing_saveable does: in one jit its
    # step is no larger (464,740 against 464,804 bytes; 1% allowed for other XLA versions).
    # One more value of the carry's size saved per iteration adds 32 KB (7%). As two
    # programs it is larger: the head's saved values are the backward's arguments.
    ours = prepare("aotgrad:min_cut@0", w)
    _close(ours.grads, reference)
    assert ours.memory.jitted_peak <= 1.01 * peaks["checkpoint:nothing_saveable"], (ours.memory, peaks)


def test_program_memory_peak_is_the_larger_program() -> None:
    assert ProgramMemory(1, 10, 2, 30).peak == 30
    assert ProgramMemory(1, 10).peak == 10
    assert ProgramMemory(None, None).peak is None
