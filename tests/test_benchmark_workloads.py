"""The benchmark workloads and peers are what aotgrad's memory and speed claims rest on:
the scanned GPT must be the same model as the unrolled one, and a `jax.checkpoint`
strategy must change only what is saved, never the values."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
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
    ("stack", dict(batch=2, seq=8, d_model=16, heads=2, layers=2)),
    ("stack", dict(batch=2, seq=8, d_model=16, heads=2, layers=2, norm="rms", mlp="swiglu", rotary=True,
                   causal=True)),
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


# ----------------------------------------------------------------------------- hand-written 16-bit models

HAND = [("gpt", GPT), ("gpt_scan", GPT), ("vit", VIT)]
BF16 = "bfloat16"


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (scan, jit, checkpoint, custom_jvp bodies)."""
    for e in jaxpr.eqns:
        yield e
        for sub in _subjaxprs(e):
            yield from _eqns(sub)


def _subjaxprs(e):
    for p in e.params.values():
        for q in p if isinstance(p, (tuple, list)) else [p]:
            if hasattr(q, "jaxpr") and hasattr(q.jaxpr, "eqns"):  # ClosedJaxpr
                yield q.jaxpr
            elif hasattr(q, "eqns"):
                yield q


def _dtypes(e, which: str) -> list[str]:
    return [str(v.aval.dtype) for v in getattr(e, which) if hasattr(v.aval, "dtype")]


def _jaxpr(w, fn=None):
    return jax.make_jaxpr(fn or w.loss_fn)(w.params, w.batch).jaxpr


@pytest.mark.parametrize("kind,sizes", HAND)
def test_a_hand_written_bf16_model_is_the_float32_model(kind: str, sizes: dict) -> None:
    """The same parameters (float32 masters, same seed) and batch; the loss in float32 and
    within 1% of the float32 model's (observed: 0.004-0.25%); float32 gradients within 10%
    normwise of the float32 model's (observed 2-4%: a few bfloat16 ulps, 0.4% each, through
    the layers). A lost layer, mask or scale would be far outside both."""
    from benchmarks.strategies import max_relative_error
    f32 = build(kind, kind, sizes)
    bf16 = build(f"{kind}_bf16", kind, dict(sizes, dtype=BF16))
    _close(bf16.params, f32.params, 0)
    _close(bf16.batch, f32.batch, 0)
    step = lambda w: jax.jit(jax.value_and_grad(w.loss_fn))(w.params, w.batch)  # noqa: E731
    (loss32, grads32), (loss16, grads16) = step(f32), step(bf16)
    assert loss16.dtype == np.float32
    assert abs(float(loss16) - float(loss32)) <= 1e-2 * abs(float(loss32)), (float(loss16), float(loss32))
    assert {g.dtype for g in jax.tree.leaves(grads16)} == {np.dtype(np.float32)}
    assert max_relative_error(grads16, grads32) < 0.1
    assert max_relative_error(grads32, grads32) == 0.0


@pytest.mark.parametrize("kind,sizes", HAND)
def test_a_hand_written_bf16_model_computes_in_bf16_where_a_careful_user_does(kind: str, sizes: dict) -> None:
    """Every matmul takes bfloat16 operands; the causal mask is applied to bfloat16 scores;
    the residual stream (each block's output, the scan's carry) is bfloat16; the softmax's
    and the loss's `exp` and the layer norms' `rsqrt` are float32. The float32 model has
    no cast at all."""
    w = build(kind, kind, dict(sizes, dtype=BF16))
    eqns = list(_eqns(_jaxpr(w)))
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert dots and all(_dtypes(e, "invars") == [BF16, BF16] for e in dots), [_dtypes(e, "invars") for e in dots]
    for name in ("exp", "rsqrt"):
        found = [e for e in eqns if e.primitive.name == name]
        assert found and all(_dtypes(e, "invars") == ["float32"] for e in found), name
    masks = [e for e in eqns if e.primitive.name == "select_n" and len(e.outvars[0].aval.shape) == 4]
    assert [_dtypes(e, "outvars") for e in masks] == ([] if kind == "vit" else [[BF16]] * len(masks)) and \
        (kind == "vit" or masks), "the causal mask is applied to the bfloat16 scores (no float32 constant)"
    d_model = sizes["d_model"]
    if kind == "gpt_scan":
        scan, = [e for e in eqns if e.primitive.name == "scan"]  # its only output: the carry (no ys)
        assert [str(v.aval.dtype) for v in scan.outvars] == [BF16], scan.outvars
    else:  # each block, wrapped as a layer: its output is the residual stream
        remat = build(kind, kind, dict(sizes, dtype=BF16), remat=jax.checkpoint)
        blocks = [e for e in _eqns(_jaxpr(remat)) if e.primitive.name in ("checkpoint", "remat2", "remat")]
        assert len(blocks) == sizes["layers"]
        assert all([(v.aval.shape[-1], str(v.aval.dtype)) for v in e.outvars] == [(d_model, BF16)] for e in blocks)
    f32 = [build(kind, kind, sizes), build(kind, kind, dict(sizes, dtype="float32"))]
    for m in f32:
        eqns32 = list(_eqns(_jaxpr(m)))
        assert not [e for e in eqns32 if e.primitive.name == "convert_element_type"]
        assert all(_dtypes(e, "invars") == ["float32", "float32"] for e in eqns32 if e.primitive.name == "dot_general")


def test_a_dtype_a_model_is_not_written_in_is_an_error() -> None:
    with pytest.raises(ValueError, match="'float64'.*'float32', 'bfloat16', 'float16'"):
        build("gpt", "gpt", dict(GPT, dtype="float64"))


FLAX = dict(batch=2, seq=8, d_model=16, heads=2, layers=2, vocab=32)


@pytest.mark.parametrize("kind", ["gemma_nnx", "decoder_linen_scan"])
def test_the_flax_decoders_as_workloads_in_float32_and_bf16(kind: str) -> None:
    """The Flax decoders of the real-model benchmarks as workloads: the float32 one is the
    model the real-model tests train (its loss at the same parameters and batch); the
    bfloat16 one (Flax's dtype=) keeps float32 parameters and gradients, its loss within
    1% and its gradients within 10% of float32's, every matmul's operands bfloat16, the
    softmax, the loss and the norms' statistics in float32."""
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    from benchmarks import real_flax
    from benchmarks.strategies import max_relative_error
    f32 = build(kind, kind, FLAX)
    bf16 = build(f"{kind}_bf16", kind, dict(FLAX, dtype=BF16))
    model = getattr(real_flax, kind)(**FLAX)
    state = model.init()
    trained_as = model.loss(*state[:1], state[-1]) if kind == "gemma_nnx" else model.loss(state[0], state[-1])
    _close(jax.jit(f32.loss_fn)(f32.params, f32.batch), trained_as, 1e-6)
    step = lambda w: jax.jit(jax.value_and_grad(w.loss_fn))(w.params, w.batch)  # noqa: E731
    (loss32, grads32), (loss16, grads16) = step(f32), step(bf16)
    assert loss16.dtype == np.float32 and abs(float(loss16) - float(loss32)) <= 1e-2 * abs(float(loss32))
    assert {g.dtype for g in jax.tree.leaves(grads16)} == {np.dtype(np.float32)}
    assert max_relative_error(grads16, grads32) < 0.1
    eqns = list(_eqns(_jaxpr(bf16)))
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert dots and all(_dtypes(e, "invars") == [BF16, BF16] for e in dots)
    for name in ("exp", "rsqrt"):  # the attention's softmax, the loss; the norms' statistics
        found = [e for e in eqns if e.primitive.name == name]
        assert found and all(_dtypes(e, "invars") == ["float32"] for e in found), name
    with pytest.raises(ValueError, match="jax.checkpoint"):
        build(kind, kind, FLAX, remat=jax.checkpoint)


def test_a_stack_with_the_gpts_choices_is_the_gpts_block() -> None:
    """`stack` with one fused qkv projection with biases, LayerNorm, GELU and a causal mask
    is the GPT's block (`workloads._block`, written with einsum over (batch, seq, heads,
    dim)), given the same weights: the transposed-heads attention is the same attention."""
    from benchmarks.workloads import _block
    w = build("s", "stack", dict(batch=2, seq=8, d_model=16, heads=4, layers=1, qkv="fused", bias=True,
                                 causal=True))
    p = w.params["blocks"][0]
    gpt_params = {"ln1": p["norm1"], "qkv": p["qkv"], "proj": p["out"], "ln2": p["norm2"], "fc1": p["up"],
                  "fc2": p["down"]}
    want = jnp.mean(jnp.square(_block(gpt_params, w.batch["x"], heads=4) - w.batch["y"]))
    _close(w.loss_fn(w.params, w.batch), want)
