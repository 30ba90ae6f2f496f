"""Smoke test of the benchmark suite (benchmarks/): a tiny suite end to end, through the
command line and in-process; suite files that parse; registry pick-up; failures that
are reported and do not stop the run; the planning-time benchmark on a 2-layer GPT. Takes
a few seconds."""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import aotgrad

ROOT = Path(__file__).resolve().parent.parent

# The command-line run: one workload, the fewest calls, so that it takes seconds even on a
# busy machine (the subprocess starts JAX and compiles every strategy once).
CLI_SUITE = """
description = "smoke"
repeats = 1
min_sample_seconds = 0.0
strategies = ["fused", "jax_fwd_and_bwd", "aotgrad:*", "aotgrad:min_cut@0.5", "aotgrad:min_cut+donate_saved",
              "aotgrad:not_a_partitioner"]

[overhead]
size = 4
calls = 2
repeats = 1

[[workloads]]
name = "tiny_mlp"
kind = "mlp"
sizes = { batch = 4, width = 8, depth = 2 }
"""


TINY_SUITE = CLI_SUITE + """
[[workloads]]
name = "tiny_block"
kind = "transformer_block"
sizes = { batch = 2, seq = 8, d_model = 16, heads = 2 }
"""


@pytest.fixture
def tiny_suite(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_SUITE)
    return path


def test_runner_cli_writes_expected_json(tmp_path: Path) -> None:
    from aotgrad.partition import PARTITIONERS
    suite = tmp_path / "cli.toml"
    suite.write_text(CLI_SUITE)
    out = tmp_path / "out.json"
    # The timeout only stops a hung run; nothing here depends on how long the run takes.
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", f"--suite={suite}", f"--out={out}",
                           f"--plot={tmp_path / 'plot.png'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not_a_partitioner" in proc.stderr and "not registered" in proc.stderr
    assert "Unable to initialize backend" not in proc.stderr
    assert "tiny_mlp" in proc.stdout and "call overhead" in proc.stdout
    assert "FAILED" not in proc.stdout + proc.stderr  # the call-overhead run took +donate_saved as a partitioner

    data = json.loads(out.read_text())
    assert data["machine"]["cpu_count"] >= 1 and data["machine"]["platform"]
    assert data["backend"] == "cpu"
    assert set(data["versions"]) >= {"jax", "jaxlib", "aotgrad"}
    expected = ["fused", "jax_fwd_and_bwd", *(f"aotgrad:{p}" for p in PARTITIONERS), "aotgrad:min_cut@0.5",
                "aotgrad:min_cut+donate_saved"]
    assert data["strategies"] == expected
    rows = {(r["workload"], r["strategy"]): r for r in data["rows"]}
    assert set(rows) == {("tiny_mlp", s) for s in expected}
    for (workload, strategy), r in rows.items():
        assert r["ok"], (workload, strategy, r["error"])
        assert r["step"]["median"] > 0 and r["step"]["min"] > 0
        assert r["first_step_s"] > 0
        assert r["grad_error"] is not None and r["grad_error"] < 1e-4
        if strategy == "fused":
            assert r["saved"] is None and r["ratio_vs_fused"] == 1.0
        else:
            assert r["saved"]["activations"] > 0
        if strategy == "jax_fwd_and_bwd":
            assert r["ratio_vs_jax"] == 1.0
        if strategy.startswith("aotgrad:"):
            b = r["build"]
            assert b["trace"] > 0 and b["compile"] > 0
        m = r["memory"]  # XLA's memory analysis: every program's peak holds at least its outputs
        assert m is not None and m["forward_peak"] > 0 and m["peak"] >= m["forward_peak"]
        assert (m["backward_peak"] is None) == (strategy == "fused")
        # The step in one jit: the fused program is its own; aotgrad's is compiled apart.
        assert (m["jitted_peak"] is None) == (strategy == "jax_fwd_and_bwd")
        if strategy == "fused":
            assert m["jitted_peak"] == m["peak"]
    overhead = {(o["mode"], o["strategy"]): o for o in data["overhead"]["rows"]}
    assert ("latency", "jax_fwd_and_bwd") in overhead
    assert all(o["per_call"]["median"] > 0 for o in overhead.values())
    assert all(overhead[("latency", s)]["ratio_vs_jax"] > 0 for s in expected[2:] if "@" not in s and "+" not in s)


def test_a_run_hands_over_what_it_has_after_each_workload(tiny_suite: Path) -> None:
    """`run_suite(done=...)` gets the run so far after each workload but the last, marked
    partial (`main` writes it to --out, so a run stopped partway keeps the workloads it ran)."""
    from benchmarks import run, suite as suite_mod
    seen = []
    result = run.run_suite(suite_mod.load(tiny_suite), workloads=["tiny_mlp", "tiny_block"],
                           strategies=["fused"], done=seen.append)
    assert len(seen) == 1 and [r.workload for r in seen[0].rows] == ["tiny_mlp"]
    assert "partial: 1 of 2 workloads run" in seen[0].messages
    assert [r.workload for r in result.rows] == ["tiny_mlp", "tiny_block"]
    assert not any(m.startswith("partial") for m in result.messages)
    json.dumps(run.to_json(seen[0], "python -m benchmarks.run"), default=str)  # what main writes


def test_new_partitioners_are_picked_up_and_failures_continue(tiny_suite: Path) -> None:
    from benchmarks import run, suite as suite_mod

    def broken(graph: object, budget: float) -> dict:
        raise RuntimeError("this partitioner always fails")

    def inputs_only(graph, budget: float) -> dict:
        return {v: "input" for v in graph.inputs}

    registrations = [aotgrad.register_partitioner("smoke_inputs", inputs_only),
                     aotgrad.register_partitioner("smoke_broken", broken)]
    try:
        suite = suite_mod.load(tiny_suite)
        result = run.run_suite(suite, workloads=["tiny_mlp"], strategies=["jax_fwd_and_bwd", "aotgrad:smoke_*"])
    finally:
        for r in registrations:
            r.remove()
    rows = {r.strategy: r for r in result.rows}
    assert set(rows) == {"jax_fwd_and_bwd", "aotgrad:smoke_inputs", "aotgrad:smoke_broken"}
    assert rows["aotgrad:smoke_inputs"].ok and rows["aotgrad:smoke_inputs"].saved.activations == 0
    assert not rows["aotgrad:smoke_broken"].ok
    assert "always fails" in rows["aotgrad:smoke_broken"].error
    assert rows["jax_fwd_and_bwd"].ok
    assert "FAILED" in run.format_result(result)
    assert not result.overhead  # filtered out by --workloads


def test_suite_files_parse_and_sizes_fit_the_builders() -> None:
    from benchmarks import suite as suite_mod
    from benchmarks.workloads import BUILDERS
    for name in ("cpu", "gpu", "gpu_x8", "tpu", "scan_budget", "held_out", "autocast", "stacks"):
        suite = suite_mod.load(ROOT / "config" / f"{name}.toml")
        assert suite.workloads and suite.strategies
        for w in suite.workloads:
            inspect.signature(BUILDERS[w.kind]).bind(0, **w.sizes)
    cpu = {w.name: w for w in suite_mod.load(ROOT / "config" / "cpu.toml").workloads}
    assert cpu["transformer_block"].sizes == {"batch": 8, "seq": 128, "d_model": 256, "heads": 8}
    # Each hand-written bfloat16 model is its float32 model's sizes in bfloat16, and the
    # mixed-precision suite's models are the GPU suite's.
    gpu, tpu, mixed = ({w.name: w for w in suite_mod.load(ROOT / "config" / f"{n}.toml").workloads}
                       for n in ("gpu", "tpu", "autocast"))
    for suite in (gpu, tpu, mixed):
        hand = [n for n in suite if n.endswith("_bf16")]
        assert hand and all((suite[n].kind, suite[n].sizes) == (suite[n[:-5]].kind, {**suite[n[:-5]].sizes,
                                                                                    "dtype": "bfloat16"})
                            for n in hand), hand
    assert {"gpt_bf16", "gpt_scan_bf16", "vit_bf16"} <= set(gpu)
    assert all((w.kind, w.sizes) == (gpu[n].kind, gpu[n].sizes) for n, w in mixed.items() if n in gpu)


def test_torch_peers_on_a_tiny_mlp() -> None:
    """Both PyTorch peers build, agree with jax.grad, and count saved activations the
    same way from the forward's outputs and from saved_tensors_hooks (no note)."""
    pytest.importorskip("torch")
    import jax

    from benchmarks import peers_torch
    from benchmarks.strategies import max_relative_error
    from benchmarks.workloads import build
    w = build("tiny_mlp", "mlp", {"batch": 4, "width": 8, "depth": 2})
    reference = jax.jit(jax.grad(w.loss_fn))(w.params, w.batch)
    for name in peers_torch.NAMES:
        p = peers_torch.prepare_torch(w, name)
        assert p.saved is not None and p.saved.activations > 0, name
        assert max_relative_error(p.grads, reference) < 1e-4, name
        assert not any("saved_tensors_hooks" in n for n in p.notes), p.notes
        p.step()


def test_help_exits_zero() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--suite" in proc.stdout + proc.stderr


def test_plot_without_matplotlib_is_reported_before_the_run(tiny_suite: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "blocked"
    (blocked / "matplotlib").mkdir(parents=True)
    (blocked / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(blocked), os.environ.get("PYTHONPATH", ""), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", f"--suite={tiny_suite}",
                           f"--out={tmp_path / 'out.json'}", f"--plot={tmp_path / 'plot.png'}",
                           "--workloads=tiny_mlp", "--strategies=fused"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("note: --plot needs matplotlib"), lines[:3]
    assert not (tmp_path / "plot.png").exists()


def test_on_device_run_reports_each_strategy_and_continues_past_failures(tmp_path: Path) -> None:
    """`benchmarks.on_device` (the real step on this machine's accelerator), here on the host:
    each strategy in its own process, then interleaved timing; a strategy that cannot be
    built (a byte budget below every plan) is a row that says why, and the others still run.
    The compilation cache it makes for its processes does not outlive it."""
    suite = tmp_path / "cli.toml"
    suite.write_text(CLI_SUITE)
    out = tmp_path / "on_device.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.on_device", f"--suite={suite}", f"--out={out}",
                           "--workloads=tiny_mlp", "--strategies=fused,aotgrad:min_cut@0,aotgrad:min_cut@1KB",
                           "--steps=1", "--rounds=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(tmp_path.glob("aotgrad_xla_cache_*"))  # its compilation cache is removed with the run
    data = json.loads(out.read_text())
    assert data["info"]["profile"] == "cpu" and data["info"]["jax"]
    rows = {r["strategy"]: r for r in data["rows"]}
    assert list(rows) == ["fused", "aotgrad:min_cut@0", "aotgrad:min_cut@1KB"]
    from benchmarks.workloads import build
    w = build("tiny_mlp", "mlp", {"batch": 4, "width": 8, "depth": 2})
    assert "1,000 bytes cannot be met" in rows["aotgrad:min_cut@1KB"]["error"]  # a budget no plan meets
    for name in ("fused", "aotgrad:min_cut@0"):
        r = rows[name]
        assert r["error"] is None
        assert r["own_median_s"] > 0 and r["interleaved_median_s"] > 0
        assert r["inputs"] == w.param_bytes + w.batch_bytes
        assert r["xla_peak"] > r["inputs"] and r["flops"] > 0
        assert r["allocator_peak"] is None or r["allocator_peak"] > 0
    assert "aotgrad:min_cut@0" in proc.stdout and "failed: " in proc.stdout


HAND_SUITE = """
description = "a model and its hand-written bfloat16 version"
[[workloads]]
name = "gpt"
kind = "gpt"
sizes = { batch = 2, seq = 8, d_model = 16, heads = 2, layers = 1, vocab = 32 }
[[workloads]]
name = "gpt_bf16"
kind = "gpt"
sizes = { batch = 2, seq = 8, d_model = 16, heads = 2, layers = 1, vocab = 32, dtype = "bfloat16" }
"""


def test_on_device_times_autocast_together_with_the_hand_written_model(tmp_path: Path) -> None:
    """`benchmarks.on_device --together`: autocast on `gpt` and the hand-written `gpt_bf16`
    timed in the same interleaved rounds, autocast's ratios to it in the table; autocast on
    the hand-written model is not run, and the file says so."""
    suite = tmp_path / "hand.toml"
    suite.write_text(HAND_SUITE)
    out = tmp_path / "on_device.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.on_device", f"--suite={suite}", f"--out={out}",
                           "--workloads=gpt,gpt_bf16", "--strategies=fused,autocast:bf16@0", "--steps=1",
                           "--rounds=1", "--together"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [(r["workload"], r["strategy"]) for r in data["rows"]] == [
        ("gpt", "fused"), ("gpt", "autocast:bf16@0"), ("gpt_bf16", "fused")]
    assert all(r["error"] is None and r["interleaved_median_s"] > 0 for r in data["rows"])
    assert [m.split(" not run: ")[0] for m in data["info"]["messages"]] == ["gpt_bf16: autocast:bf16@0"]
    assert "gpt, gpt_bf16: interleaved timing" in proc.stderr  # one group of rounds
    header, = [line for line in proc.stdout.splitlines() if line.startswith("workload")]
    autocast, = [line for line in proc.stdout.splitlines() if "autocast:bf16@0" in line]
    assert header.endswith("ms/hand") and re.search(r" \d+\.\d{3}x$", autocast), (header, autocast)


def test_async_slices_are_counted_at_the_bytes_they_move() -> None:
    """XLA:TPU copies a weight into on-chip memory in four asynchronous slices, and XLA's
    cost analysis charges each the whole weight (a synchronous slice is charged its
    output): the compile-only table also shows the bytes with each slice at its size.
    The lines are from a GPT step compiled for a TPU v5e; the slice-done and the fusion
    reading a slice are not slice-starts and count nothing."""
    from benchmarks import targets
    hlo = """
  %slice-start.1052 = ((f32[768,2304]{1,0:T(8,128)}), f32[192,2304]{1,0:T(8,128)S(1)}, s32[]{:S(2)}) slice-start(%params__blocks___0___qkv____w__.1), slice={[0:192], [0:2304]}, backend_config={"dma_priority":1}
  %slice-start = ((pred[1024,1024]{0,1:T(8,128)(4,1)}), pred[1024,256]{0,1:T(8,128)(4,1)S(1)}, s32[]{:S(2)}) slice-start(%copy-done.2), slice={[0:1024], [0:256]}
  %slice-done.1052 = f32[192,2304]{1,0:T(8,128)S(1)} slice-done(%slice-start.1052)
  %fusion.7 = f32[8,1024,2304]{2,1,0} fusion(%slice-done.1052), kind=kOutput, calls=%fused_computation.7
"""
    weight, chunk = 768 * 2304 * 4, 192 * 2304 * 4
    mask, mask_chunk = 1024 * 1024, 1024 * 256
    assert targets.async_slice_excess(hlo) == (weight - chunk) + (mask - mask_chunk)
    assert targets.async_slice_excess(hlo.replace("slice-start(", "slice(")) == 0

    row = targets.TargetRow("gpt", "fused", 10, 5, 100e9, 1e12, 1.0, slice_excess=30e9)
    assert row.bytes_moved == 70e9
    with_slices = targets.format_rows([row], "tpu")
    assert "slices as moved" in with_slices and "70.00" in with_slices
    plain = targets.format_rows([dataclasses.replace(row, slice_excess=0.0)], "h100")
    assert "slices as moved" not in plain


def test_a_strategy_names_a_budget_as_a_fraction_or_a_byte_size() -> None:
    """`aotgrad:min_cut@0.5`, `aotgrad:min_cut@2.4GB` (the cheapest plan whose estimated
    peak fits 2.4 GB) and the same in bytes, `@2400000000`; a size with an unknown unit is
    refused by the option, by name."""
    import aotgrad
    from aotgrad.errors import ConfigError
    from benchmarks.strategies import aotgrad_options
    assert aotgrad_options("min_cut@0.5")["activation_memory_budget"] == 0.5
    assert aotgrad_options("min_cut@2.4GB")["activation_memory_budget"] == "2.4GB"
    aotgrad.config.patch(**aotgrad_options("min_cut@2400000000"))  # a byte count, as the option takes an int
    with pytest.raises(ConfigError, match="activation_memory_budget"):
        with aotgrad.config.patch(**aotgrad_options("min_cut@2.4XB")):
            pass


def test_a_strategy_names_donate_saved_and_a_target_refuses_it() -> None:
    """`aotgrad:min_cut@0+donate_saved` runs the two programs with `donate_saved=True`, whose
    backward releases what it reads; a compile-only target compiles the jitted step, where
    the option changes nothing, so it refuses the name rather than report the plain step."""
    from benchmarks import targets
    from benchmarks.strategies import aotgrad_options, name_error
    from benchmarks.workloads import build
    assert aotgrad_options("min_cut@0+donate_saved") == {"partitioner": "min_cut", "activation_memory_budget": 0.0,
                                                        "donate_saved": True}
    assert "donate_saved" not in aotgrad_options("min_cut@0")
    assert name_error("aotgrad:min_cut+donate_saved") is None
    w = build("mlp", "mlp", {"batch": 8, "width": 16, "depth": 2})
    with pytest.raises(ValueError, match="donate_saved changes nothing in one jit"):
        targets.step_and_context("aotgrad:min_cut+donate_saved", w)


def test_any_budget_named_on_the_command_line_is_run_also_for_a_target() -> None:
    """`--strategies aotgrad:min_cut@0.3,aotgrad:min_cut@2.4GB` names strategies the suite and
    the target table do not list: both are run, in the order named after the listed ones; a
    size with an unknown unit is skipped with the option's own error, by name."""
    from benchmarks.run import select_target_strategies
    from benchmarks.strategies import expand
    names, messages = expand(["aotgrad:min_cut@0.3", "aotgrad:min_cut@2.4GB", "aotgrad:min_cut@2.4XB"])
    assert names == ["aotgrad:min_cut@0.3", "aotgrad:min_cut@2.4GB"]
    assert len(messages) == 1 and "2.4XB" in messages[0] and "activation_memory_budget" in messages[0]

    names, errors = select_target_strategies(["fused", "aotgrad:min_cut@0.3", "aotgrad:min_cut@2.4GB",
                                              "aotgrad:min_cut@0", "jax_fwd_and_bwd"])
    assert names == ["fused", "aotgrad:min_cut@0", "aotgrad:min_cut@0.3", "aotgrad:min_cut@2.4GB"]
    assert errors == [f"--strategies: 'jax_fwd_and_bwd' matches none of {select_target_strategies(None)[0]}"]


def test_autocast_strategies_take_a_budget_as_aotgrad_strategies_do() -> None:
    """`autocast:bf16@0.5` is bfloat16 autocast at budget 0.5, parsed by the code that parses
    `aotgrad:min_cut@0.5`'s budget; a name that names no strategy is an error that says why."""
    import jax.numpy as jnp

    from benchmarks.strategies import autocast_strategy, name_error
    spec = autocast_strategy("autocast:bf16@0.5")
    assert (spec.dtype, spec.options) == (jnp.bfloat16, {"activation_memory_budget": 0.5})
    assert autocast_strategy("autocast:fp16").options == {} and autocast_strategy("autocast:fp16").dtype == jnp.float16
    assert autocast_strategy("autocast:bf16@2.4GB").options == {"activation_memory_budget": "2.4GB"}
    assert name_error("autocast:bf16@0") is None and name_error("aotgrad:min_cut@0") is None
    for bad, why in [("autocast:fp32", "'fp32' is not one of"), ("autocast:bf16@", "no budget after '@'"),
                     ("aotgrad:min_cut@", "no budget after '@'"), ("autocast:bf16@1.5", "activation_memory_budget"),
                     ("autocast:bf16@2.4XB", "activation_memory_budget")]:
        assert why in (name_error(bad) or ""), bad
        if bad.startswith("autocast:"):
            with pytest.raises(ValueError, match=re.escape(why)):
                autocast_strategy(bad)


def test_a_target_table_takes_autocast_strategies_and_refuses_a_bad_one() -> None:
    from benchmarks.run import select_target_strategies
    names, errors = select_target_strategies(["fused", "autocast:bf16", "autocast:bf16@0.5", "autocast:*"])
    assert names == ["fused", "autocast:bf16", "autocast:bf16@0.5", "autocast:fp16"] and not errors
    names, errors = select_target_strategies(["fused", "autocast:bf32"])
    assert names == ["fused"] and len(errors) == 1 and "'autocast:bf32'" in errors[0] and "'bf32' is not one of" in errors[0]


def test_an_autocast_step_is_traced_under_the_targets_device_type_and_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--target h100` traces the aotgrad step under `aotgrad.autocast("gpu", ...)`, tpu-v5e
    under "tpu", with the budget patched in; a hand-written bfloat16 model is refused by name."""
    import contextlib

    import jax
    import jax.numpy as jnp

    from benchmarks import targets
    from benchmarks.workloads import build
    assert [targets.device_type(t) for t in ("h100", "a100", "tpu-v5e", "cpu")] == ["gpu", "gpu", "tpu", "cpu"]
    entered = []

    @contextlib.contextmanager
    def recording(device_type=None, dtype=None, enabled=True):
        entered.append((device_type, dtype, aotgrad.config.activation_memory_budget))
        yield
    monkeypatch.setattr(aotgrad, "autocast", recording)
    w = build("tiny_gpt", "gpt", dict(batch=2, seq=8, d_model=16, heads=2, layers=1, vocab=32))
    fn, context = targets.step_and_context("autocast:bf16@0", w, "gpu")
    with context():
        assert aotgrad.config.activation_memory_budget == 0
    assert entered == [("gpu", jnp.bfloat16, 0)]
    fn, context = targets.step_and_context("fused", w, "tpu")
    assert context is contextlib.nullcontext and entered == [("gpu", jnp.bfloat16, 0)]
    monkeypatch.undo()
    hand = build("tiny_gpt_bf16", "gpt", dict(w.sizes, dtype="bfloat16"))
    with pytest.raises(ValueError, match="'tiny_gpt_bf16': autocast:bf16 does not apply: the model is written in "
                                         "bfloat16 by hand"):
        targets.step_and_context("autocast:bf16", hand, "gpu")
    with pytest.raises(ValueError, match="'nope'"):
        targets.step_and_context("nope", w)
    del jax


def test_a_target_run_compiles_autocast_and_skips_it_on_a_hand_written_model_with_a_message() -> None:
    """On this machine's CPU as the target: the float32 model's fused and autocast steps and
    the hand-written bfloat16 model's fused step compile; autocast on the hand-written model
    is not compiled, and the run says so."""
    from benchmarks import targets
    sizes = dict(batch=2, seq=8, d_model=16, heads=2, layers=1, vocab=32)
    messages: list[str] = []
    rows = targets.run_target("cpu", [("gpt", "gpt", sizes), ("gpt_bf16", "gpt", dict(sizes, dtype="bfloat16"))],
                              strategies=["fused", "autocast:bf16", "autocast:bf16@0"], log=lambda _: None,
                              messages=messages)
    assert [(r.workload, r.strategy, r.error) for r in rows] == [
        ("gpt", "fused", None), ("gpt", "autocast:bf16", None), ("gpt", "autocast:bf16@0", None),
        ("gpt_bf16", "fused", None)]
    assert all(r.peak and r.bytes_accessed for r in rows)
    assert messages == ["gpt_bf16: autocast:bf16, autocast:bf16@0 not run: the model is written in bfloat16 by hand "
                        "(dtype in its sizes): the anchor autocast is measured against"]


def test_the_cpu_suite_runs_autocast_at_a_budget() -> None:
    """`autocast:bf16@0` in the suite: built and run under bfloat16 autocast at budget 0
    (what its context enters), gradients float32 and within bfloat16's error of float32."""
    import jax
    import jax.numpy as jnp

    from benchmarks.strategies import max_relative_error, prepare
    from benchmarks.workloads import build
    w = build("tiny_mlp", "mlp", {"batch": 4, "width": 8, "depth": 2})
    p = prepare("autocast:bf16@0", w, memory=False)
    with p.context():
        assert aotgrad.config.activation_memory_budget == 0
        loss, grads = jax.block_until_ready(p.step())
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    assert max_relative_error(grads, jax.jit(jax.grad(w.loss_fn))(w.params, w.batch)) < 5e-2
    assert p.notes and p.notes[0].startswith("casts: ")
    with pytest.raises(ValueError, match="does not apply"):
        prepare("autocast:bf16", build("tiny_gpt_bf16", "gpt", dict(batch=2, seq=8, d_model=16, heads=2, layers=1,
                                                                    vocab=32, dtype="bfloat16")), memory=False)


@pytest.mark.parametrize("args, named", [
    (["--workloads=nonexistent"], ["--workloads: 'nonexistent' matches none of", "'gpt'", "'call_overhead'"]),
    (["--strategies=aotgrad:mincut"], ["--strategies: 'aotgrad:mincut' matches none of", "'aotgrad:min_cut'",
                                       "'mincut' is not registered"]),
    (["--workloads=gpt,nope*", "--strategies=fused,typo"], ["'nope*' matches none", "'typo' matches none"]),
    (["--target=h100", "--strategies=fused,jax_fwd_and_bwd"], ["--strategies: 'jax_fwd_and_bwd' matches none of",
                                                               "'checkpoint:nothing_saveable'"]),
    (["--target=h100", "--strategies=fused,autocast:bf16@1.5"], ["--strategies: 'autocast:bf16@1.5' matches none",
                                                                 "activation_memory_budget"])])
def test_a_pattern_that_matches_nothing_is_an_error(args: list[str], named: list[str]) -> None:
    """A `--workloads` or `--strategies` pattern that matches nothing (a typo) would time
    nothing: exit 2 before anything is built, naming the flag, the pattern and the known names."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", *args, "--out=/nonexistent/never_written.json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert all(n in proc.stderr for n in named), proc.stderr[-2000:]
    assert "building" not in proc.stderr and not proc.stdout


@pytest.mark.parametrize("args, named", [
    (["--workloads=nonexistent"], ["--workloads: 'nonexistent' matches none of", "'gpt'"]),
    (["--strategies=fused,aotgrad:mincut"], ["--strategies: 'aotgrad:mincut' matches none of",
                                             "'mincut' is not registered"])])
def test_a_pattern_that_matches_nothing_on_the_device_is_an_error(args: list[str], named: list[str]) -> None:
    """`benchmarks.on_device` as `benchmarks.run`: a typo exits 2 before any step is built."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.on_device", "--suite=config/gpu.toml", *args,
                           "--out=/nonexistent/never_written.json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert all(n in proc.stderr for n in named), proc.stderr[-2000:]
    assert "own process" not in proc.stderr and not proc.stdout


@pytest.mark.parametrize("args, named", [(["--devices=8", "--sharding=fsdp"], "--devices and --sharding"),
                                         (["--target=h100", "--repeats=3"], "--repeats")])
def test_a_flag_that_does_not_apply_is_an_error(args: list[str], named: str) -> None:
    """`--devices`/`--sharding` without `--target` (the suite would run on this machine,
    their values ignored), and `--repeats` with it (nothing is timed): exit 2, naming them."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert named in proc.stderr and "target" in proc.stderr


def test_the_table_fits_120_columns_names_its_columns_and_marks_noise() -> None:
    from benchmarks.columns import SUITE_COLUMNS
    from benchmarks.measure import Stats
    from benchmarks.records import Row
    from benchmarks.report import format_table
    from benchmarks.strategies import ProgramMemory

    def row(strategy: str, median: float, iqr: float) -> Row:
        step = Stats(median, median - iqr / 2, median + iqr / 2, median - iqr, median + iqr, 15)
        return Row("transformer_block", strategy, step=step, ratio_vs_fused=median / 0.010,
                   memory=ProgramMemory(1, 12_000_000, 1, 13_000_000, 9_000_000))
    rows = [row("fused", 0.010, 0.0002), row("checkpoint:dots_with_no_batch_dims_saveable", 0.0101, 0.0004),
            row("aotgrad:min_cut@0.5", 0.012, 0.0002), Row("transformer_block", "aotgrad:broken", error="build: no")]
    table = format_table(rows)
    assert max(len(line) for line in table.splitlines()) <= 120
    names = [c.name for c in SUITE_COLUMNS]
    assert "peak (1 jit) / fused" in names and "peak (2 progs) / fused" in names
    legend = table[table.index("\ncolumns:"):]
    assert all(f"  {n}: " in legend for n in names)  # every column explained under the table
    lines: dict[str, str] = {}  # each strategy's line in the first panel
    for line in table.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            lines.setdefault(line.split()[0], line)
    assert "~1.01x" in lines["checkpoint:dots_with_no_batch_dims_saveable"]  # inside the noise
    assert " 1.20x" in lines["aotgrad:min_cut@0.5"] and "~" not in lines["aotgrad:min_cut@0.5"]
    assert "FAILED: build: no" in lines["aotgrad:broken"]
    assert len(format_table(rows, width=80).split("\nstrategy")) > len(table.split("\nstrategy"))  # wraps


def test_planning_time_writes_a_row_per_depth_and_budget(tmp_path: Path, capsys) -> None:
    from benchmarks import planning_time
    out = tmp_path / "planning.json"
    planning_time.main(["--layers", "2", "--budgets", "1,0", "--repeats", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["layers"], r["budget"]) for r in rows] == [(2, 1.0), (2, 0.0)]
    assert all(r["plain_s"] > 0 and r["aotgrad_s"] > 0 and r["ratio"] > 0 for r in rows)
    assert "layers budget" in capsys.readouterr().out
