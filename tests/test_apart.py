"""Where the forward and backward run as two programs (`aotgrad.fwd_and_bwd`, an eager
`jax.grad`, an export), every saved value crosses from one to the other and is held between
them, so budget 1 saves what crosses cheapest, never more than `jax.vjp`; inside one
`jax.jit` it stays the fused step's plan. These tests fail if the apart default falls back
to the fused plan (which saves what `jax.fwd_and_bwd` saves)."""
from __future__ import annotations

from typing import Any

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad
from aotgrad.devices import profile_named
from benchmarks.workloads import build

min_cut = importlib.import_module("aotgrad.partition.min_cut")  # the module, not the strategy

# The benchmark suite's models at sizes CI compiles in seconds.
WORKLOADS = {
    "transformer_block": {"batch": 2, "seq": 32, "d_model": 64, "heads": 4},
    "mlp": {"batch": 64, "width": 128, "depth": 3},
    "convnet": {"batch": 4, "image": 16, "channels": [8, 16], "classes": 10},
    "gpt": {"batch": 2, "seq": 32, "d_model": 64, "heads": 4, "layers": 2, "vocab": 128},
}


def _jax_activation_bytes(loss: Any, params: Any, batch: Any) -> int:
    """Bytes of `jax.fwd_and_bwd`'s residuals that are not copies of an input."""
    _, residuals = jax.fwd_and_bwd(loss, argnums=0)[0](params, batch)
    inputs = [np.asarray(x) for x in jax.tree.leaves((params, batch))]
    total = 0
    for r in jax.tree.leaves(residuals):
        r = np.asarray(r)
        if not any(r.shape == x.shape and r.dtype == x.dtype and np.array_equal(r, x) for x in inputs):
            total += r.nbytes
    return total


@pytest.fixture(scope="module", params=sorted(WORKLOADS))
def workload(request: Any) -> Any:
    return build(request.param, request.param, WORKLOADS[request.param])


def test_fwd_and_bwd_saves_a_third_of_what_jax_saves(workload: Any) -> None:
    """At the default, `aotgrad.fwd_and_bwd` keeps <= 0.35x the activation bytes of
    `jax.fwd_and_bwd` on the suite's transformer block, MLP, convnet and GPT (the fused
    step's plan kept 1.00x), and its gradients are JAX's."""
    loss, params, batch = workload.loss_fn, workload.params, workload.batch
    fwd, bwd = aotgrad.fwd_and_bwd(aotgrad.compile(loss), argnums=0)
    out, saved = fwd(params, batch)
    grads = bwd(saved, jnp.ones_like(out))
    want = jax.grad(loss)(params, batch)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(jnp.abs(w).max()))
    inputs = {id(x) for x in jax.tree.leaves((params, batch))}
    ours = sum(a.nbytes for a in saved.arrays if id(a) not in inputs)
    theirs = _jax_activation_bytes(loss, params, batch)
    assert ours <= 0.35 * theirs, (ours, theirs)


@pytest.mark.parametrize("device", ["h100", "tpu-v5e"])
def test_run_apart_on_any_device_budget_1_saves_a_third_of_what_jax_saves(workload: Any, device: str) -> None:
    """Run apart, what crosses is held whatever the device: planned for a GPU or a TPU
    (whose traffic pricing charges a recomputed matmul operand), budget 1 still keeps
    <= 0.35x `jax.fwd_and_bwd`'s activation bytes (priced for their traffic it kept
    0.36-0.48x, and GPT-2 small's two programs on an H100 peaked above its fused step)."""
    loss, params, batch = workload.loss_fn, workload.params, workload.batch
    graph = aotgrad.compile(loss).trace(params, batch).pair(0).graph
    problem = min_cut.Problem.priced(dataclasses.replace(graph, device=profile_named(device)))
    ours = problem.top_cut(stacked=False).activation_bytes
    theirs = _jax_activation_bytes(loss, params, batch)
    assert ours <= 0.35 * theirs, (ours, theirs)


def test_eager_grad_and_export_run_the_apart_plan_a_jitted_step_the_fused_one(workload: Any) -> None:
    """An eager `jax.grad` and an export get the apart plan; a step under `jax.jit` the
    fused step's (what the "vjp" strategy saves); `explain` says which."""
    loss, params, batch = workload.loss_fn, workload.params, workload.batch
    f = aotgrad.compile(loss)
    apart = aotgrad.explain(f, params, batch, argnums=0)
    jitted = aotgrad.explain(f, params, batch, argnums=0, under_jit=True)
    with aotgrad.config.patch(partitioner="vjp"):
        vjp = aotgrad.explain(aotgrad.compile(loss), params, batch, argnums=0)
    assert jitted.saved_bytes == vjp.saved_bytes
    assert apart.saved_bytes <= 0.5 * jitted.saved_bytes, (apart.saved_bytes, jitted.saved_bytes)
    assert "runs apart" in str(apart).splitlines()[0]
    assert "planned for a step under jax.jit" in str(jitted).splitlines()[0]
    exported = aotgrad.export(f, params, batch, argnums=0)
    assert aotgrad.explain(exported, params, batch).saved_bytes == apart.saved_bytes
    # The two programs' XLA peak is lower than with the fused step's plan run apart.
    assert apart.memory.peak < jitted.memory.peak, (apart.memory.peak, jitted.memory.peak)


def test_a_function_called_both_ways_builds_two_pairs_and_says_so(caplog: Any) -> None:
    """Called eagerly, then inside a `jax.jit`: two pairs (one per plan), a log line under
    `log_recompiles`, and JAX's gradients from both."""
    import logging
    w = build("mlp", "mlp", WORKLOADS["mlp"])
    f = aotgrad.compile(w.loss_fn)
    with aotgrad.config.patch(log_recompiles=True), caplog.at_level(logging.WARNING, logger="aotgrad"):
        eager = jax.grad(f)(w.params, w.batch)
        jitted = jax.jit(jax.grad(f))(w.params, w.batch)
    assert "traced under jax.jit, planned as one program" in caplog.text
    assert f.cache_info().pairs == 2
    want = jax.grad(w.loss_fn)(w.params, w.batch)
    for got in (eager, jitted):
        for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, v, rtol=1e-4, atol=1e-6)


# The 4-layer GPT the two-program peak targets are stated for (config/unrolled_peak.toml's
# gpt4_t128): its activations outweigh its parameters, as in a model worth planning.
GPT4_T128 = {"batch": 4, "seq": 128, "d_model": 256, "heads": 8, "layers": 4, "vocab": 1024}


def test_two_programs_peak_well_under_the_fused_step_on_a_4_layer_gpt() -> None:
    """Run apart, the forward's and the backward's XLA peaks stay <= 0.75x the fused
    `jax.jit(jax.value_and_grad(f))` program's at the default and <= 0.55x at budget 0
    (XLA:CPU, jax 0.10.2, 2026-11-30: 0.661x and 0.442x; the fused step's plan run apart
    peaked 1.24x)."""
    from aotgrad.xla_buffers import xla_peak
    w = build("gpt", "gpt", GPT4_T128)
    fused = xla_peak(jax.jit(jax.value_and_grad(w.loss_fn)).lower(w.params, w.batch).compile().memory_analysis())
    for budget, most in ((1.0, 0.75), (0.0, 0.55)):
        with aotgrad.config.patch(activation_memory_budget=budget):
            report = aotgrad.explain(aotgrad.compile(w.loss_fn), w.params, w.batch, argnums=0)
        assert "runs apart" in str(report).splitlines()[0]
        assert report.memory.peak <= most * fused, (budget, report.memory.peak / fused)


@pytest.mark.parametrize("kind, sizes", [
    ("gpt", {"batch": 2, "seq": 256, "d_model": 64, "heads": 4, "layers": 2, "vocab": 128}),
    ("transformer_block", {"batch": 1, "seq": 1024, "d_model": 64, "heads": 4}),
])
def test_run_apart_a_lower_budget_never_peaks_above_budget_1(monkeypatch: Any, kind: str, sizes: dict) -> None:
    """Run apart, budget 1 saves what crosses cheapest (`Problem.crossing`), and every budget
    below it takes a rung under that plan: no more saved bytes, and two programs whose XLA
    peaks do not rise as the budget falls. Priced as on an H100 (a recomputed matmul operand
    and a row normalization charged for their traffic), the ladder had been topped by the
    cut cheapest in that traffic, which saves more: there budgets 0.75 to 0 of this GPT
    peaked at 1.27x budget 1's (XLA:CPU), and the long-sequence block's at 1.25x (on a
    compile-only H100, its B16 x 1024 version's budget 0.5 at 1.24x)."""
    from aotgrad import devices
    gpu = profile_named("h100")
    priced = {"matmul_operands_cost": gpu.matmul_operands_cost, "row_reductions_fuse": gpu.row_reductions_fuse}
    monkeypatch.setattr(devices, "PROFILES", tuple(dataclasses.replace(p, **priced) for p in devices.PROFILES))
    w = build(kind, kind, sizes)
    saved, peaks = [], []
    for budget in (1.0, 0.75, 0.5, 0.0):
        with aotgrad.config.patch(activation_memory_budget=budget):
            report = aotgrad.explain(aotgrad.compile(w.loss_fn), w.params, w.batch)
        assert "runs apart" in str(report).splitlines()[0]
        saved.append(report.saved_bytes)
        peaks.append(report.memory.peak)  # the larger of the two programs' XLA peaks
    assert max(saved[1:]) <= saved[0], saved
    assert all(low <= high for high, low in zip(peaks, peaks[1:])), peaks
