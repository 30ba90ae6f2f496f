"""`aotgrad.config.donate_saved`: the backward takes ownership of the saved activations."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad
from aotgrad import segments

RELEASED = "saved values were released after the first backward.*donate_saved=False"


def _mlp(p, x):
    h = jnp.tanh(x @ p["w1"])
    return jnp.sum(jnp.sin(h @ p["w2"]) ** 2)


def _args():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return ({"w1": jax.random.normal(k1, (8, 16)) * 0.3, "w2": jax.random.normal(k2, (16, 16)) * 0.3},
            jax.random.normal(k3, (16, 8)))


def _close(a, b):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), a, b)


def test_backward_releases_saved_activations_and_refuses_a_second_call():
    p, x = _args()
    with aotgrad.config.patch(donate_saved=True):
        fwd, bwd = aotgrad.fwd_and_bwd(_mlp, argnums=0)
        out, saved = fwd(p, x)
    n_act = len(saved.pair.split.activations)
    activations, inputs = saved.arrays[:n_act], saved.arrays[n_act:]
    assert activations and inputs
    grads = bwd(saved, jnp.ones_like(out))
    _close(grads, jax.grad(_mlp)(p, x))
    assert all(a.is_deleted() for a in activations)
    assert not any(a.is_deleted() for a in inputs)  # the caller's arrays are never donated
    assert not any(a.is_deleted() for a in jax.tree.leaves((p, x)))
    with pytest.raises(RuntimeError, match=RELEASED):
        bwd(saved, jnp.ones_like(out))


def test_backward_program_aliases_saved_buffers():
    """Activations of a gradient's shape and dtype are donated to XLA, which writes the
    gradient into their memory (lower peak); the others are released after the call."""
    p, x = _args()
    compiled = {}
    for donate in (False, True):
        with aotgrad.config.patch(donate_saved=donate):
            compiled[donate] = aotgrad.compile(_mlp).lower(p, x).compile()
    assert compiled[False].backward.memory_analysis().alias_size_in_bytes == 0
    assert compiled[True].backward.memory_analysis().alias_size_in_bytes > 0


def test_vjp_function_called_twice():
    p, x = _args()
    f = aotgrad.compile(_mlp)
    with aotgrad.config.patch(donate_saved=True):
        out, vjp_fn = jax.vjp(f, p, x)
    _close(vjp_fn(jnp.ones_like(out)), jax.vjp(_mlp, p, x)[1](jnp.ones_like(out)))
    with pytest.raises(RuntimeError, match=RELEASED):
        vjp_fn(jnp.ones_like(out))
    out, vjp_fn = jax.vjp(f, p, x)  # the default keeps saved values: a second call is fine
    _close(vjp_fn(jnp.ones_like(out)), vjp_fn(jnp.ones_like(out)))


def test_option_is_keyed_and_jit_is_unaffected():
    p, x = _args()
    f = aotgrad.compile(_mlp)
    step = jax.jit(jax.value_and_grad(f))
    want = jax.value_and_grad(_mlp)(p, x)
    with aotgrad.config.patch(donate_saved=True):
        _close(jax.grad(f)(p, x), want[1])
        _close(step(p, x), want)  # inside jit the programs are one XLA program: nothing to release
        _close(step(p, x), want)
    _close(jax.grad(f)(p, x), want[1])
    assert f.cache_info().entries == 2  # one signature under each setting


def test_nothing_to_release_when_only_inputs_are_saved():
    f = lambda x, w: jnp.sum(x * w)  # noqa: E731  # the backward reads only the inputs
    x, w = jnp.arange(4.0), jnp.ones(4)
    with aotgrad.config.patch(donate_saved=True):
        fwd, bwd = aotgrad.fwd_and_bwd(f, argnums=(0, 1))
        out, saved = fwd(x, w)
        first, second = bwd(saved, 1.0), bwd(saved, 1.0)
    _close(first, second)
    assert not x.is_deleted() and not w.is_deleted()


# The suite's models at sizes CI compiles in seconds, for the segmented backward (a scanned
# GPT's backward is one scan reading every saved value: nothing to cut).
SEGMENTED = {
    "gpt": {"batch": 4, "seq": 64, "d_model": 256, "heads": 8, "layers": 4, "vocab": 1024},
    "mlp": {"batch": 64, "width": 128, "depth": 4},
    "convnet": {"batch": 4, "image": 16, "channels": [8, 16], "classes": 10},
    # d_in as wide as the hidden state: the readout's saved input is then an eighth or more of
    # the saved bytes, what a segment must release (with jax >= 0.11 a scan body saving its
    # tanh output leaves the readout the only value read before the scan)
    "rnn": {"batch": 4, "seq": 16, "d_in": 32, "hidden": 32},
}


@pytest.mark.parametrize("kind", sorted(SEGMENTED))
def test_a_segmented_backward_computes_jaxs_gradients(kind):
    """The backward cut into programs (`segments.segmented`, forced here whatever it would
    peak) gives `jax.grad`'s gradients and releases every saved activation."""
    from benchmarks.workloads import build
    w = build(kind, kind, SEGMENTED[kind])
    with aotgrad.config.patch(donate_saved=True):
        f = aotgrad.compile(w.loss_fn)
        fwd, bwd = aotgrad.fwd_and_bwd(f, argnums=0)
        out, saved = fwd(w.params, w.batch)
    pair = saved.pair
    forced = segments.segmented(pair.split.backward, pair.n_activations)
    assert forced is not None and len(forced.segments) > 1
    pair.run_backward.segmented_programs[None] = forced
    _close_to_jax(bwd(saved, jnp.ones_like(out)), w)
    assert all(a.is_deleted() for a in saved.arrays[:pair.n_activations])


def test_the_backward_releases_what_it_has_read_as_it_runs():
    """Under donate_saved the suite's GPT runs its backward as several programs; saved
    activations are released before the last one starts, and XLA's memory analysis of the
    programs (each one's peak plus what is held beside it) is below the one program's:
    CPU, jax 0.10.2: 33.0 MB against 46.5 (the fused jitted step: 50.7 MB)."""
    from benchmarks.workloads import build
    w = build("gpt", "gpt", SEGMENTED["gpt"])
    with aotgrad.config.patch(donate_saved=True):
        f = aotgrad.compile(w.loss_fn)
        report = aotgrad.explain(f, w.params, w.batch, argnums=0)
        fwd, bwd = aotgrad.fwd_and_bwd(f, argnums=0)
        out, saved = fwd(w.params, w.batch)
    one = aotgrad.explain(aotgrad.compile(w.loss_fn), w.params, w.batch, argnums=0).memory
    assert report.memory.backward_programs > 1
    assert report.memory.backward_peak < 0.8 * one.backward_peak, (report.memory, one)
    assert "programs, each releasing the saved values it reads last" in str(report)
    found = saved.pair.run_backward.segmented()
    assert found is not None and len(found.segments) == report.memory.backward_programs
    activations = saved.arrays[:saved.pair.n_activations]
    deleted_before = []  # per program: which saved activations were released when it started

    def spy(program):
        def run(*args):
            deleted_before.append({k for k, a in enumerate(activations) if a.is_deleted()})
            return program(*args)
        return run
    saved.pair.run_backward.segmented_programs[None] = dataclasses.replace(
        found, segments=tuple(dataclasses.replace(s, program=spy(s.program)) for s in found.segments))
    grads = bwd(saved, jnp.ones_like(out))
    position = {v: k for k, v in enumerate(found.closed.jaxpr.invars[:len(activations)])}
    read_last = set()  # those an earlier program read for the last time: released, no others
    for seg, deleted in zip(found.segments, deleted_before, strict=True):
        assert deleted == read_last, (deleted, read_last)
        read_last |= {position[v] for v in seg.frees if v in position}
    assert len(deleted_before[-1]) > len(activations) // 2  # most released before the last program
    _close_to_jax(grads, w)


def _close_to_jax(grads, w):
    want = jax.grad(w.loss_fn)(w.params, w.batch)
    for g, v in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, v, rtol=2e-4, atol=1e-5 * float(jnp.abs(v).max()))


def test_explain_counts_what_the_donating_backward_aliases(monkeypatch):
    """Under donate_saved the one backward program writes gradients into donated saved
    values: its peak is XLA's arguments + results + scratch less the aliased bytes (as
    counted here from the compiled program's own memory analysis), not their sum."""
    monkeypatch.setattr(segments, "chosen", lambda *a, **k: None)  # one program
    ws = [jnp.full((128, 128), 0.01) for _ in range(4)]
    x = jnp.ones((128, 128))

    def f(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x ** 2)

    with aotgrad.config.patch(donate_saved=True):
        report = aotgrad.explain(aotgrad.compile(f), ws, x)
        m = aotgrad.compile(f).lower(ws, x).compile().memory_analysis()["backward"]
    assert m.alias_size_in_bytes > 0
    assert report.memory.backward_programs == 1
    assert report.memory.backward_peak == (m.argument_size_in_bytes + m.output_size_in_bytes
                                           + m.temp_size_in_bytes - m.alias_size_in_bytes)
