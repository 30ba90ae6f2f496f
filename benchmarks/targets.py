"""Compile-only targets: every strategy's jitted training step compiled for a GPU or TPU the
machine does not have, and XLA's own numbers for it.

`python -m benchmarks.run --target h100` (also `tpu-v5e`; `--devices 8 --sharding dp|fsdp`)
compiles `jax.jit(jax.value_and_grad(loss))` for each strategy (fused, `jax.checkpoint` on
each layer under each policy, aotgrad at several budgets; named with `--strategies`, also
`autocast:bf16` / `autocast:fp16`, optionally `@<budget>`: the aotgrad step traced under
`aotgrad.autocast(<the target's device type>, dtype=...)`) against the target's topology, with
the arguments placed on its mesh, and reports per device:
- peak: XLA's `memory_analysis()` of the step (temp + arguments + outputs - aliased), and the
  activation peak (that minus the parameters and the batch on one device);
- bytes accessed and FLOPs from XLA's HLO cost analysis of the optimized module (what step
  time followed on a real H100: ../shared/docs/gpu-targets.md); where the target's compiler
  copies weights in chunks by asynchronous slices (XLA:TPU prefetching into on-chip memory),
  also the bytes with each such slice counted as XLA counts a slice, at the bytes it moves
  (`async_slice_excess`);
- compile time (trace, lower and compile, seconds).
Nothing runs: the executables are for the target. The GPU needs the CUDA compiler plugin
(`pip install -e '.[gpu-target]'`), the TPU `libtpu` (`jax[tpu]`). The targets and their
descriptions are the package's (`aotgrad.targets`); the arguments are placed and each step
measured by the code `aotgrad.plan` uses (`aotgrad.planning.place`, `aotgrad.planning.measure`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any, Callable, Sequence

import jax

import aotgrad
from aotgrad.planning.measure import async_slice_excess, measure
from aotgrad.planning.place import per_device_bytes, place
from aotgrad.targets import resolve as resolve_target
from benchmarks.strategies import (AOTGRAD_PREFIX, AUTOCAST_PREFIX, CHECKPOINT_PREFIX, CHECKPOINT_STRATEGIES,
                                   DONATED, PARAMETERIZED, aotgrad_options, applicable, autocast_strategy,
                                   check_applies, checkpointed, expand, narrow)
from benchmarks.workloads import Workload, build

__all__ = ["TargetRow", "async_slice_excess", "compile_step", "device_type", "format_rows", "placed_specs", "plot",
           "run_target", "select_target_strategies", "step_and_context", "target_strategies"]

BUDGETS = (1.0, 0.5, 0.2, 0.0)


def target_strategies(budgets: Sequence[float] = BUDGETS) -> list[str]:
    return ["fused", *CHECKPOINT_STRATEGIES] + [f"{AOTGRAD_PREFIX}min_cut@{b:g}" for b in budgets]


@dataclasses.dataclass(frozen=True)
class TargetRow:
    workload: str
    strategy: str
    peak: int | None  # bytes per device
    activation_peak: int | None  # peak minus params and batch per device
    bytes_accessed: float | None
    flops: float | None
    compile_seconds: float
    error: str | None = None
    # Of `bytes_accessed`, what XLA's cost analysis charges asynchronous slices beyond the
    # bytes they move (`async_slice_excess`): 0 where the compiler emits none.
    slice_excess: float = 0.0

    @property
    def bytes_moved(self) -> float | None:
        """Bytes accessed with each asynchronous slice at the bytes it moves."""
        return None if self.bytes_accessed is None else self.bytes_accessed - self.slice_excess


def placed_specs(w: Workload, mesh: jax.sharding.Mesh, sharding: str) -> tuple[Any, Any]:
    """The workload's parameters and batch placed on the mesh as `aotgrad.plan` places them."""
    params, (batch,), _ = place(w.params, [w.batch], {}, mesh, sharding)
    return params.dynamic, batch.dynamic


def device_type(target: Any) -> str:
    """The autocast device type (policy table) of a target (a name `aotgrad.targets.resolve`
    takes, or a `Target`): "gpu" for a CUDA or ROCm GPU, "tpu", "cpu"."""
    platform = resolve_target(target).platform
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


def step_and_context(strategy: str, w: Workload,
                     device: str | None = None) -> tuple[Callable[..., Any], Callable[[], Any]]:
    """(the step to jit, a context to trace it under). `device`: the autocast device type of
    an `autocast:` strategy (None: the default backend's). A name no family knows is a
    ValueError naming it, as is a strategy that does not apply to the workload."""
    check_applies(strategy, w)
    if strategy == "fused":
        return jax.value_and_grad(w.loss_fn), contextlib.nullcontext
    if strategy.startswith(CHECKPOINT_PREFIX):
        return jax.value_and_grad(checkpointed(strategy, w).loss_fn), contextlib.nullcontext
    if strategy.startswith(AUTOCAST_PREFIX):
        spec = autocast_strategy(strategy)
        return jax.value_and_grad(aotgrad.compile(w.loss_fn)), lambda: spec.context(device)
    if not strategy.startswith(AOTGRAD_PREFIX):
        raise ValueError(f"strategy {strategy!r}: not one a compiled step is built for (fused, "
                         f"{CHECKPOINT_PREFIX}<policy>, {AOTGRAD_PREFIX}<partitioner>[@<budget>], "
                         f"{AUTOCAST_PREFIX}<bf16|fp16>[@<budget>])")
    options = aotgrad_options(strategy[len(AOTGRAD_PREFIX):])
    if options.get("donate_saved"):
        raise ValueError(f"strategy {strategy!r}: donate_saved changes nothing in one jit, and a target "
                         f"compiles the jitted step; name it without {DONATED}")
    return jax.value_and_grad(aotgrad.compile(w.loss_fn)), lambda: aotgrad.config.patch(**options)


def compile_step(strategy: str, w: Workload, params: Any, batch: Any, device: str | None = None) -> Any:
    """The strategy's `jax.jit(jax.value_and_grad(loss))` compiled for these arguments
    (arrays, or `ShapeDtypeStruct`s placed on a target's devices); `device`: the autocast
    device type (`device_type(target)`; None: the default backend's)."""
    fn, context = step_and_context(strategy, w, device)
    with context():
        return jax.jit(fn).lower(params, batch).compile()


def _measure(strategy: str, w: Workload, params: Any, batch: Any, device: str) -> TargetRow:
    t0 = time.perf_counter()
    try:
        _, m = measure(lambda: compile_step(strategy, w, params, batch, device))
    except Exception as e:  # a strategy that cannot be built for the target is a row that says why
        return TargetRow(w.name, strategy, None, None, None, None, time.perf_counter() - t0,
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    inputs = per_device_bytes((params, batch))
    return TargetRow(w.name, strategy, m.peak_bytes, None if m.peak_bytes is None else m.peak_bytes - inputs,
                     m.bytes_accessed, m.flops, m.compile_s, slice_excess=m.slice_excess)


def run_target(target_name: str, workloads: Sequence[tuple[str, str, dict]], *, devices: int = 1,
               sharding: str = "dp", strategies: Sequence[str] | None = None,
               log: Callable[[str], None] = print, messages: list[str] | None = None) -> list[TargetRow]:
    """Compiles every strategy of every workload `(name, kind, sizes)` for the target. A pair
    `applicable` refuses (autocast on a model written in 16 bits by hand) is not compiled:
    it is logged and appended to `messages`."""
    if sharding not in ("dp", "fsdp"):
        raise ValueError(f"--sharding must be 'dp' or 'fsdp'; got {sharding!r}")
    target = resolve_target(target_name)
    mesh = target.mesh(devices)
    rows = []
    for name, kind, sizes in workloads:
        w = build(name, kind, sizes)
        params, batch = placed_specs(w, mesh, sharding)
        names, skipped = applicable(name, strategies or target_strategies(), sizes)
        if skipped is not None:
            log(f"[{target_name} x{devices} {sharding}] {skipped}")
            if messages is not None:
                messages.append(skipped)
        for strategy in names:
            log(f"[{target_name} x{devices} {sharding}] {name} / {strategy}: compiling")
            rows.append(_measure(strategy, w, params, batch, device_type(target)))
    return rows


def format_rows(rows: Sequence[TargetRow], header: str) -> str:
    """The table; where any step has asynchronous slices (XLA:TPU), two more columns: the
    bytes with each slice at the bytes it moves, and that against the fused step's."""
    slices = any(r.slice_excess for r in rows)
    lines = [header, "", f"{'workload':12s} {'strategy':42s} {'peak MB':>9s} {'act MB':>9s} {'vs fused':>8s} "
                         f"{'GB moved':>9s} {'vs fused':>8s} {'GFLOP':>9s} {'compile s':>9s}"
                         + (f" {'GB, slices as moved':>19s} {'vs fused':>8s}" if slices else "")]
    fused = {r.workload: r for r in rows if r.strategy == "fused"}
    for r in rows:
        base = fused.get(r.workload)
        if r.error:
            lines.append(f"{r.workload:12s} {r.strategy:42s} failed: {r.error}")
            continue

        def ratio(a: float | None, b: float | None) -> str:
            return f"{a / b:.2f}x" if a is not None and b else "-"

        def num(x: float | None, scale: float) -> str:
            return "-" if x is None else f"{x / scale:.2f}"
        lines.append(f"{r.workload:12s} {r.strategy:42s} {num(r.peak, 1e6):>9s} {num(r.activation_peak, 1e6):>9s} "
                     f"{ratio(r.activation_peak, base and base.activation_peak):>8s} "
                     f"{num(r.bytes_accessed, 1e9):>9s} {ratio(r.bytes_accessed, base and base.bytes_accessed):>8s} "
                     f"{num(r.flops, 1e9):>9s} {r.compile_seconds:9.1f}"
                     + (f" {num(r.bytes_moved, 1e9):>19s} {ratio(r.bytes_moved, base and base.bytes_moved):>8s}"
                        if slices else ""))
    return "\n".join(lines)


def plot(path: str, rows: Sequence[TargetRow]) -> str:
    """Activation peak against bytes accessed, one panel per workload: the Pareto picture (a
    strategy is dominated when another is lower on both axes)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install -e '.[bench]')"
    names = list(dict.fromkeys(r.workload for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for r in rows:
            if r.workload == name and r.activation_peak is not None and r.bytes_accessed is not None:
                ax.scatter(r.bytes_accessed / 1e9, r.activation_peak / 1e6)
                ax.annotate(r.strategy.replace("aotgrad:", "").replace("checkpoint:", "ckpt:"),
                            (r.bytes_accessed / 1e9, r.activation_peak / 1e6), fontsize=7)
        ax.set(title=name, xlabel="HLO bytes accessed (GB)", ylabel="activation peak per device (MB)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"wrote {path}"


def use_cpu_for_arrays() -> None:
    """With a compiler plugin installed and no accelerator, arrays must live on the CPU."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_platforms", "cpu")


def select_target_strategies(only: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """A target table's strategies (`--target`), narrowed to `only` with any aotgrad budget
    or autocast strategy (`autocast:bf16`, `autocast:fp16@0.5`) named there, and one error per
    pattern that matched nothing (as `select_strategies`)."""
    names = target_strategies()
    if not only:
        return names, []
    return narrow(names, only, lambda pat: expand([pat]) if pat.startswith(PARAMETERIZED) else ([], []))
