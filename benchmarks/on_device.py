"""The real step on this machine's accelerator: allocator peak and median step time for
every strategy of the compile-only target tables (fused, `jax.checkpoint` on each layer
under each policy, aotgrad at several budgets), beside XLA's own numbers for the same
programs on the real device.

    python -m benchmarks.on_device --suite config/gpu.toml --workloads gpt

Each strategy's step is `jax.jit(jax.value_and_grad(loss))`, built as `benchmarks.targets`
builds it for a compile-only target (`--strategies` may also name `autocast:bf16`,
`autocast:fp16`, optionally `@<budget>`: traced under `aotgrad.autocast` with this backend's
table; a hand-written 16-bit workload such as `gpt_bf16` is run with `fused`, and autocast
on it is not run, with a message). Two numbers need care:
- allocator peak: the device allocator's `peak_bytes_in_use` only grows within a process,
  so each strategy runs in a process of its own (inputs placed, step compiled, run a few
  times, peak read; minus the bytes in use before the first step: the parameters and the
  batch). It is the allocator's view of the same quantity as the targets' activation peak
  (outputs + scratch), so the two can be compared row by row;
- step time: every strategy compiled in one process (the processes above fill XLA's
  persistent compilation cache, so this costs tracing only), then timed in interleaved
  rounds (`benchmarks.measure.interleaved`); medians. With --together, every workload's
  strategies in the same rounds: autocast on `gpt` against the hand-written `gpt_bf16`.
Progress goes to stderr, the table to stdout, everything to the JSON file (--out).
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("suite", "config/gpu.toml", "Suite file (TOML) naming the workloads and their sizes.")
flags.DEFINE_list("workloads", ["gpt"], "Workloads of the suite to run (globs allowed).")
flags.DEFINE_list("strategies", None, "Strategies (default: those of the compile-only target tables).")
flags.DEFINE_integer("steps", 10, "Steps each strategy's own process runs (after two warm-up steps).")
flags.DEFINE_integer("rounds", 10, "Interleaved timing rounds (0: report only each process's own median).")
flags.DEFINE_bool("together", False, "Time every workload's strategies in the same interleaved rounds (else each "
                  "workload's apart): to compare autocast on a model with its hand-written 16-bit version "
                  "(`gpt` with `gpt_bf16`).")
flags.DEFINE_string("out", "benchmarks/results/on_device.json", "Where to write the JSON results.")
flags.DEFINE_string("child", None, "Internal: run one strategy of one workload, given as JSON.")


@dataclasses.dataclass(frozen=True)
class DeviceRow:
    workload: str
    strategy: str
    allocator_peak: int | None  # bytes over those in use before the first step
    inputs: int | None  # bytes of the parameters and the batch
    xla_peak: int | None  # memory_analysis() of the step on this device, arguments included
    bytes_accessed: float | None
    flops: float | None
    own_median_s: float | None  # the strategy's own process, `steps` steps
    interleaved_median_s: float | None = None
    compile_seconds: float | None = None
    error: str | None = None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _block(x: Any) -> Any:
    import jax
    return jax.block_until_ready(x)


def _compiled_step(strategy: str, w: Any) -> Any:
    import jax

    from benchmarks.targets import compile_step
    return compile_step(strategy, w, w.params, w.batch, jax.default_backend())  # autocast: this backend's table


def _child(spec: dict) -> dict:
    """One strategy in this process: its allocator peak, XLA's numbers, its own median."""
    import jax
    from aotgrad.planning.measure import counted_cost
    from aotgrad.devices import profile_of
    from benchmarks.measure import time_steps
    from benchmarks.strategies import xla_peak
    from benchmarks.workloads import build
    device = jax.devices()[0]
    w = build(spec["workload"], spec["kind"], spec["sizes"])
    _block((w.params, w.batch))
    before = device.memory_stats() or {}
    t0 = time.perf_counter()
    compiled = _compiled_step(spec["strategy"], w)
    compile_s = time.perf_counter() - t0
    step = lambda: compiled(w.params, w.batch)  # noqa: E731
    time_steps(step, _block, 2)  # warm-up; no step's outputs are alive while the next one runs
    times = [time_steps(step, _block, 1) for _ in range(spec["steps"])]
    after = device.memory_stats() or {}
    m = compiled.memory_analysis()
    cost = counted_cost(compiled)
    in_use = before.get("bytes_in_use")
    peak = after.get("peak_bytes_in_use")
    return {"allocator_peak": None if peak is None or in_use is None else peak - in_use,
            "in_use_before_step": in_use, "inputs": w.param_bytes + w.batch_bytes,
            "profile": profile_of(jax.tree.leaves((w.params, w.batch))).name,
            "peak_before_step": before.get("peak_bytes_in_use"),
            "xla_peak": None if m is None else xla_peak(m),
            "bytes_accessed": cost.get("bytes accessed"), "flops": cost.get("flops"),
            "own_median_s": statistics.median(times), "compile_seconds": compile_s,
            "device_kind": device.device_kind, "jax": jax.__version__}


_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Unreachable|Interrupt|Exit)\b")


def _exception_line(stderr: str) -> str:
    """The line naming the exception that ended a child (JAX appends a note after it)."""
    lines = stderr.strip().splitlines() or ["(no output)"]
    return next((ln for ln in reversed(lines) if _EXCEPTION.match(ln)), lines[-1])


def _run_child(spec: dict, env: dict) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.on_device", f"--child={json.dumps(spec)}"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": f"exit {p.returncode}: {_exception_line(p.stderr)}"}
    return json.loads(lines[-1])


def _interleaved(pairs: Sequence[tuple[Any, str]], rounds: int) -> dict[tuple[str, str], float]:
    """Median step time of each (workload, strategy) pair, all timed in the same
    interleaved rounds; keyed by (workload name, strategy)."""
    from benchmarks.measure import interleaved, time_steps
    steps = {}
    for workload, s in pairs:
        try:
            compiled = _compiled_step(s, workload)
        except Exception as e:  # reported by its own process already
            log(f"  {workload.name} / {s}: not timed ({type(e).__name__})")
            continue
        step = (lambda c, w: lambda: c(w.params, w.batch))(compiled, workload)
        _block(step())
        steps[(workload.name, s)] = step
    samples = interleaved({k: functools.partial(time_steps, f, _block, 1) for k, f in steps.items()}, rounds)
    return {k: statistics.median(xs) for k, xs in samples.items()}


def format_rows(rows: Sequence[DeviceRow], header: str) -> str:
    """The table; where an autocast row's model has a hand-written 16-bit version among the
    rows (`gpt_bf16` for `gpt`'s `autocast:bf16`), two more columns: its allocator peak and
    step time over that model's fused step's (compare times timed together: --together)."""
    from benchmarks.columns import AUTOCAST, hand_workload
    fused = {r.workload: r for r in rows if r.strategy == "fused"}
    hand = {id(r): fused.get(hand_workload(r.workload, r.strategy)) for r in rows if r.strategy.startswith(AUTOCAST)}
    mixed = any(hand.values())
    wide = max([10, *(len(r.workload) for r in rows)])
    lines = [header, "", f"{'workload':{wide}s} {'strategy':42s} {'alloc GB':>8s} {'vs fused':>8s} {'XLA GB':>7s} "
                         f"{'ms':>7s} {'vs fused':>8s} {'own ms':>7s} {'GB moved':>8s} {'GFLOP':>8s}"
                         + (f" {'alloc/hand':>10s} {'ms/hand':>8s}" if mixed else "")]

    def num(x: float | None, scale: float, fmt: str = ".2f") -> str:
        return "-" if x is None else format(x / scale, fmt)

    def ratio(a: float | None, b: float | None, digits: int = 2) -> str:
        return f"{a / b:.{digits}f}x" if a is not None and b else "-"
    for r in rows:
        if r.error:
            lines.append(f"{r.workload:{wide}s} {r.strategy:42s} failed: {r.error}")
            continue
        base = fused.get(r.workload)
        xla_act = None if r.xla_peak is None or r.inputs is None else r.xla_peak - r.inputs
        lines.append(f"{r.workload:{wide}s} {r.strategy:42s} {num(r.allocator_peak, 1e9):>8s} "
                     f"{ratio(r.allocator_peak, base and base.allocator_peak):>8s} {num(xla_act, 1e9):>7s} "
                     f"{num(r.interleaved_median_s, 1e-3, '.1f'):>7s} "
                     f"{ratio(r.interleaved_median_s, base and base.interleaved_median_s):>8s} "
                     f"{num(r.own_median_s, 1e-3, '.1f'):>7s} {num(r.bytes_accessed, 1e9):>8s} "
                     f"{num(r.flops, 1e9, '.0f'):>8s}"
                     + (f" {ratio(r.allocator_peak, h and h.allocator_peak, 3):>10s} "
                        f"{ratio(r.interleaved_median_s, h and h.interleaved_median_s, 3):>8s}"
                        if mixed and (h := hand.get(id(r))) is not None else ""))
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    del argv
    if FLAGS.child:  # the parent's environment: preallocation off, its compilation cache
        print(json.dumps(_child(json.loads(FLAGS.child))), flush=True)
        return
    from benchmarks import suite as suite_mod
    from benchmarks.strategies import applicable
    from benchmarks.targets import select_target_strategies
    from benchmarks.workloads import build
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if not cache:  # one for this run's processes, removed when it ends
        cache = tempfile.mkdtemp(prefix="aotgrad_xla_cache_")
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
    # Preallocation off: the processes share the device.
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    os.environ.update(env)
    suite = suite_mod.load(FLAGS.suite)
    specs, messages = suite_mod.select_workloads(suite.workloads, FLAGS.workloads)
    strategies, errors = select_target_strategies(FLAGS.strategies)
    if messages or errors:  # a pattern that matches nothing: nothing it meant would be run
        for m in messages + errors:
            print(f"benchmarks.on_device: {m}", file=sys.stderr)
        sys.exit(2)
    rows: list[DeviceRow] = []
    info: dict = {"messages": []}
    found: dict[str, list[tuple[str, dict]]] = {}  # workload -> (strategy, its own process's result)
    groups = [specs] if FLAGS.together else [[spec] for spec in specs]  # timed in the same rounds
    for group in groups:
        for spec in group:
            found[spec.name] = []
            names, skipped = applicable(spec.name, strategies, spec.sizes)
            if skipped is not None:
                log(skipped)
                info["messages"].append(skipped)
            for s in names:
                log(f"{spec.name} / {s}: own process")
                r = _run_child({"workload": spec.name, "kind": spec.kind, "sizes": spec.sizes, "strategy": s,
                                "steps": FLAGS.steps}, env)
                info.update({k: r[k] for k in ("device_kind", "jax", "profile") if k in r})
                log(f"  {r}")
                found[spec.name].append((s, r))
                _write(rows + [_row(w, s, r, {}) for w in found for s, r in found[w]], info)  # partial results
        medians: dict[tuple[str, str], float] = {}
        if FLAGS.rounds:
            import jax
            jax.config.update("jax_compilation_cache_dir", cache)
            log(f"{', '.join(spec.name for spec in group)}: interleaved timing, {FLAGS.rounds} rounds")
            built = {spec.name: build(spec.name, spec.kind, spec.sizes) for spec in group}
            medians = _interleaved([(built[spec.name], s) for spec in group for s, r in found[spec.name]
                                    if "error" not in r], FLAGS.rounds)
        rows += [_row(spec.name, s, r, medians) for spec in group for s, r in found.pop(spec.name)]
        _write(rows, info)
    header = (f"Real step on {info.get('device_kind', '?')} (jax {info.get('jax', '?')}; aotgrad's device profile: "
              f"{info.get('profile', '?')}): allocator peak over the bytes in use before the step, "
              f"XLA's activation peak on this device, interleaved median step time ({FLAGS.rounds} rounds), "
              f"the strategy's own median ({FLAGS.steps} steps), HLO bytes and FLOPs")
    print(format_rows(rows, header))


def _row(workload: str, strategy: str, r: dict, medians: dict[tuple[str, str], float]) -> DeviceRow:
    return DeviceRow(workload, strategy, r.get("allocator_peak"), r.get("inputs"), r.get("xla_peak"),
                     r.get("bytes_accessed"), r.get("flops"), r.get("own_median_s"), medians.get((workload, strategy)),
                     r.get("compile_seconds"), r.get("error"))


def _write(rows: Sequence[DeviceRow], info: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump({"info": info, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
