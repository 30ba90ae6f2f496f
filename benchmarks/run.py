"""Runs a benchmark suite: every (workload, strategy) pair, timed in interleaved rounds.

    python -m benchmarks.run                                  # config/cpu.toml
    python -m benchmarks.run --workloads=transformer_block --strategies='fused,aotgrad:*'
    python -m benchmarks.run --suite=config/gpu.toml --repeats=20 --plot=benchmarks/results/latest.png
    python -m benchmarks.run --peers                          # add the PyTorch peers when installed

Progress goes to stderr; the comparison table to stdout; everything to the JSON file.
Strategy names: `fused`, `jax_fwd_and_bwd`, `aotgrad:<partitioner>` for every name in
`aotgrad.partitioners()` (suites say `aotgrad:*`), `aotgrad:<partitioner>@<budget>`,
`checkpoint:<policy>`, `autocast:bf16` / `autocast:fp16` (also `@<budget>`; with --target
too), and with --peers `torch_eager` and `torch_aot_min_cut` (--strategies filters them too:
add `torch_*` to keep them).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import os
import shlex
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jax
from absl import app, flags
from absl import logging as absl_logging

from benchmarks import overhead as overhead_mod
from benchmarks import peers_torch, report, suite as suite_mod
from benchmarks.measure import interleaved, steps_for, summarize, time_steps
from benchmarks.records import Row, machine_info, now, versions
from benchmarks.strategies import (AOTGRAD_PREFIX, Prepared, applicable, expand, first_line, max_relative_error,
                                  narrow, prepare)
from benchmarks.targets import select_target_strategies
from benchmarks.workloads import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SUITE = "config/cpu.toml"
DEFAULT_OUT = "benchmarks/results/latest.json"
OVERHEAD_ROW = "call_overhead"  # the name --workloads uses for the call-overhead section
PEER = "jax_fwd_and_bwd"

FLAGS = flags.FLAGS
flags.DEFINE_string("suite", DEFAULT_SUITE, "Suite file (TOML), e.g. config/cpu.toml, config/gpu.toml.")
flags.DEFINE_list("workloads", None, f"Only these workloads (names in the suite; '{OVERHEAD_ROW}' "
                  "is the call-overhead section). Globs allowed.")
flags.DEFINE_list("strategies", None, "Only these strategies, e.g. 'fused,aotgrad:*'. Globs allowed.")
flags.DEFINE_integer("repeats", None, "Interleaved timing rounds per workload (overrides the suite).")
flags.DEFINE_string("out", DEFAULT_OUT, "Where to write the JSON results (with --target, by default "
                    "benchmarks/results/target_<target>_x<devices>_<sharding>.json).")
flags.DEFINE_string("plot", None, "Write a PNG plot (step peak memory vs step time) here; needs matplotlib.")
flags.DEFINE_string("target", None, "Compile every strategy for a compile-only accelerator instead of running "
                    "on this machine: 'h100' or 'a100' (need the gpu-target extra) or 'tpu-v5e' (needs jax[tpu]); "
                    "prints per-device peak, bytes accessed, FLOPs and compile time.")
flags.DEFINE_integer("devices", 1, "With --target: devices of the target's topology.")
flags.DEFINE_enum("sharding", "dp", ["dp", "fsdp"], "With --target and --devices > 1: data parallel (params "
                  "replicated) or FSDP (params sharded too).")
flags.DEFINE_bool("peers", False, "Include the PyTorch peers (torch_eager, torch_aot_min_cut) when "
                  "torch is importable.")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _resolve(path: str, default: str) -> str:
    """Relative paths are taken from the current directory, and — when that is not the
    repository root and the path is the default — from the repository root."""
    if os.path.isabs(path) or os.path.exists(path) or path != default:
        return path
    return os.path.join(ROOT, path)


# ----------------------------------------------------------------------------- selection

class PatternError(ValueError):
    """A `--workloads` or `--strategies` pattern that matches nothing (a typo, or a name this
    suite or target does not have): the run would time nothing, so it is refused."""


def select_strategies(suite: suite_mod.Suite, only: Sequence[str] | None,
                      peers: bool) -> tuple[list[str], list[str], list[str]]:
    """The strategies to run; notes (a suite strategy not available here, peers not
    installed); and one error per `--strategies` pattern that matched nothing."""
    names, notes = expand(list(suite.strategies))
    if peers:
        why = peers_torch.available()
        if why is None:
            names.extend(peers_torch.NAMES)
        else:
            notes.append(why)
    if not only:
        return names, notes, []
    names, errors = narrow(names, only, lambda pat: expand([pat]))
    return names, notes, errors


def select_workloads(suite: suite_mod.Suite, only: Sequence[str] | None
                     ) -> tuple[list[suite_mod.WorkloadSpec], bool, list[str]]:
    """(workloads, include the call-overhead section, one error per `--workloads` pattern
    that matched nothing)."""
    with_overhead = suite.overhead is not None
    specs, errors = suite_mod.select_workloads(suite.workloads, only, [OVERHEAD_ROW] if with_overhead else [])
    if only:
        with_overhead = with_overhead and any(fnmatch.fnmatchcase(OVERHEAD_ROW, p) for p in only)
    return specs, with_overhead, errors


# ----------------------------------------------------------------------------- one workload

def _prepare(name: str, w: Any, memory: bool) -> Prepared:
    if name in peers_torch.NAMES:
        return peers_torch.prepare_torch(w, name)
    return prepare(name, w, memory)


def estimate_step_seconds(p: Prepared, budget: float = 0.1, max_steps: int = 64) -> float:
    """Seconds per step, from doubling runs until one lasts `budget` seconds."""
    with p.context():
        n, per_step = 1, time_steps(p.step, p.block, 1)
        while per_step * n < budget and n < max_steps:
            n *= 2
            per_step = time_steps(p.step, p.block, n)
    return per_step


def run_workload(spec: suite_mod.WorkloadSpec, strategies: Sequence[str], repeats: int,
                 min_sample_seconds: float, memory: bool, tag: str, messages: list[str] | None = None) -> list[Row]:
    """Every strategy on one workload, timed in interleaved rounds. A pair `applicable`
    refuses (autocast on a model written in 16 bits by hand) has no row: it is logged and
    appended to `messages`."""
    t0 = time.perf_counter()
    strategies, skipped = applicable(spec.name, strategies, spec.sizes)
    if skipped is not None:
        log(f"{tag} {skipped}")
        if messages is not None:
            messages.append(skipped)
    sizes = ", ".join(f"{k}={v}" for k, v in spec.sizes.items())
    log(f"{tag} {spec.name}: building {spec.kind}({sizes})")
    try:
        w = build(spec.name, spec.kind, spec.sizes)
        reference = jax.block_until_ready(jax.jit(jax.grad(w.loss_fn))(w.params, w.batch))
    except Exception as e:
        msg = f"workload {spec.name} could not be built: {first_line(e)}"
        log(f"{tag} {msg}")
        return [Row(spec.name, s, error=msg) for s in strategies]

    rows: dict[str, Row] = {}
    ready: dict[str, Prepared] = {}
    for s in strategies:
        t = time.perf_counter()
        try:
            ready[s] = _prepare(s, w, memory)
        except Exception as e:
            msg = first_line(e)
            log(f"{tag} {spec.name} / {s}: FAILED while building: {msg} (continuing)")
            rows[s] = Row(spec.name, s, error=f"build: {msg}")
            continue
        log(f"{tag} {spec.name} / {s}: ready in {time.perf_counter() - t:.2f}s "
            f"(first step {ready[s].first_step_s:.2f}s)")

    # Every strategy runs the same number of steps per sample: enough for a sample of
    # the median strategy to last min_sample_seconds.
    estimates: dict[str, float] = {}
    errors: dict[str, str] = {}
    for s, p in list(ready.items()):
        try:
            estimates[s] = estimate_step_seconds(p)
        except Exception as e:
            errors[s] = first_line(e)
    n_steps = steps_for(statistics.median(estimates.values()), min_sample_seconds) if estimates else 1
    steps = {s: n_steps for s in estimates}

    def sampler(s: str) -> Callable[[], float]:
        p, n = ready[s], steps[s]

        def sample() -> float:
            if s in errors:
                return float("nan")
            try:
                with p.context():
                    return time_steps(p.step, p.block, n)
            except Exception as e:
                errors[s] = first_line(e)
                return float("nan")
        return sample

    timed = [s for s in ready if s in steps]
    log(f"{tag} {spec.name}: timing {len(timed)} strategies, {repeats} interleaved rounds of "
        f"{n_steps} steps each")
    samples = interleaved({s: sampler(s) for s in timed}, repeats)

    for s, p in ready.items():
        if s in errors:
            log(f"{tag} {spec.name} / {s}: FAILED while timing: {errors[s]} (continuing)")
            rows[s] = Row(spec.name, s, error=f"timing: {errors[s]}")
            continue
        try:
            err: float | None = max_relative_error(p.grads, reference)
        except Exception as e:
            err = None
            p = dataclasses.replace(p, notes=p.notes + (f"gradient check failed: {first_line(e)}",))
        rows[s] = Row(spec.name, s, step=summarize(samples[s]), steps_per_sample=steps[s],
                      saved=p.saved, memory=p.memory, build=p.build, first_step_s=p.first_step_s,
                      grad_error=err, notes=p.notes)
    medians = {s: r.step.median for s, r in rows.items() if r.ok and r.step is not None}
    out = []
    for s in strategies:
        r = rows[s]
        if r.ok and r.step is not None:
            r = dataclasses.replace(
                r, ratio_vs_jax=r.step.median / medians[PEER] if PEER in medians else None,
                ratio_vs_fused=r.step.median / medians["fused"] if "fused" in medians else None)
        out.append(r)
    log(f"{tag} {spec.name}: done in {time.perf_counter() - t0:.1f}s")
    return out


# ----------------------------------------------------------------------------- a whole run

@dataclasses.dataclass(frozen=True)
class RunResult:
    suite: suite_mod.Suite
    strategies: tuple[str, ...]
    messages: tuple[str, ...]  # suite strategies not available here, peers not available, ...
    rows: tuple[Row, ...]
    overhead: tuple[overhead_mod.OverheadRow, ...]
    started: str  # local date and time the run began (ISO 8601)
    seconds: float
    load_before: tuple[float, float, float] | None  # os.getloadavg(): other work on the machine
    load_after: tuple[float, float, float] | None


def _loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def run_suite(suite: suite_mod.Suite, *, workloads: Sequence[str] | None = None,
              strategies: Sequence[str] | None = None, repeats: int | None = None,
              peers: bool = False, done: Callable[[RunResult], None] | None = None) -> RunResult:
    """Runs `suite` (optionally filtered); progress and failures go to stderr. `done`: called
    after each workload but the last with the run so far (a message says it is partial)."""
    t_start, started = time.perf_counter(), now()
    load_before = _loadavg()
    names, messages, errors = select_strategies(suite, strategies, peers)
    specs, with_overhead, more = select_workloads(suite, workloads)
    if errors + more:
        raise PatternError("\n".join(errors + more))
    for m in messages:
        log(m)
    log(f"suite {suite.path}: {len(specs)} workloads x {len(names)} strategies ({', '.join(names)}); "
        f"backend {jax.default_backend()}, {os.cpu_count()} CPUs")

    rows: list[Row] = []

    def so_far(notes: Sequence[str], overhead: Sequence[overhead_mod.OverheadRow] = ()) -> RunResult:
        return RunResult(suite, tuple(names), tuple(notes), tuple(rows), tuple(overhead), started,
                         time.perf_counter() - t_start, load_before, _loadavg())

    for i, spec in enumerate(specs, 1):
        rows += run_workload(spec, names, repeats or spec.repeats, suite.min_sample_seconds,
                             suite.memory_analysis, f"[{i}/{len(specs)}]", messages)
        if done is not None and i < len(specs):
            done(so_far([*messages, f"partial: {i} of {len(specs)} workloads run"]))

    overhead_rows: list[overhead_mod.OverheadRow] = []
    # Call overhead: one row per partitioner (budgets and donate_saved do not change its call path).
    aot = [s[len(AOTGRAD_PREFIX):] for s in names if s.startswith(AOTGRAD_PREFIX) and "@" not in s and "+" not in s]
    if with_overhead and suite.overhead is not None:
        if aot:
            try:
                overhead_rows = overhead_mod.run_overhead(suite.overhead, aot, log)
            except Exception as e:
                log(f"{OVERHEAD_ROW}: FAILED: {first_line(e)} (continuing)")
        else:
            log(f"{OVERHEAD_ROW}: skipped (no aotgrad strategy selected)")
    return so_far(messages, overhead_rows)


def to_json(result: RunResult, command: str) -> dict[str, Any]:
    """The JSON document: the run, the machine, the versions, every row."""
    return {
        "schema": 1,
        "date": result.started,
        "command": command,
        "suite": {"path": result.suite.path, "description": result.suite.description,
                  "min_sample_seconds": result.suite.min_sample_seconds},
        "machine": {**machine_info(), "loadavg_before": result.load_before, "loadavg_after": result.load_after},
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "versions": versions(),
        "partitioners": [s[len(AOTGRAD_PREFIX):] for s in result.strategies if s.startswith(AOTGRAD_PREFIX)],
        "strategies": result.strategies,
        "messages": result.messages,
        "rows": result.rows,
        "overhead": None if not result.overhead else {
            "spec": result.suite.overhead, "target_ratio": overhead_mod.TARGET_RATIO, "rows": result.overhead},
        "total_seconds": result.seconds,
    }


def format_result(result: RunResult) -> str:
    """The stdout report: header, comparison table, call overhead, failures, total time."""
    lines = [f"aotgrad benchmarks - {result.started} - suite {result.suite.path} - backend "
             f"{jax.default_backend()}, {os.cpu_count()} CPUs"]
    if result.load_before is not None:
        lines.append(f"load average (1 min) before/after: {result.load_before[0]:.2f} / "
                     f"{result.load_after[0] if result.load_after else float('nan'):.2f}")
    lines.append("")
    if result.rows:
        lines.append(report.format_table(result.rows))
    if result.overhead and result.suite.overhead is not None:
        lines += ["", overhead_mod.format_rows(result.overhead, result.suite.overhead)]
    failed = [r for r in result.rows if not r.ok]
    if failed:
        lines.append(f"\n{len(failed)} (workload, strategy) pairs failed; see the rows marked FAILED.")
    lines.append(f"\ntotal {result.seconds:.1f}s")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main

def main(argv: Sequence[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)  # no "Unable to initialize backend 'tpu'" line
    if FLAGS.plot and not report.plot_available():
        log(f"note: --plot needs matplotlib ({report.PLOT_HINT}); this run writes no plot.")
        FLAGS.plot = None
    misplaced = _misplaced_flags()
    if misplaced:
        return _refuse([misplaced])
    suite_path = _resolve(FLAGS.suite, DEFAULT_SUITE)
    try:
        suite = suite_mod.load(suite_path)
    except suite_mod.SuiteError as e:
        return _refuse([str(e)])
    if FLAGS.target:
        return _run_target(suite)
    if FLAGS.repeats is not None and FLAGS.repeats < 1:
        return _refuse(["--repeats must be >= 1"])
    out = FLAGS.out if FLAGS.out != DEFAULT_OUT else _resolve_out()
    try:  # the file is written after each workload too: a run stopped partway keeps what it ran
        result = run_suite(suite, workloads=FLAGS.workloads, strategies=FLAGS.strategies, repeats=FLAGS.repeats,
                           peers=FLAGS.peers, done=lambda partial: report.write_json(out, to_json(partial, _command())))
    except PatternError as e:
        return _refuse(str(e).splitlines())
    print(format_result(result), flush=True)
    report.write_json(out, to_json(result, _command()))
    log(f"wrote {out}")
    if FLAGS.plot:
        log(report.plot(FLAGS.plot, result.rows))
    return 0


def _misplaced_flags() -> str | None:
    """Flags given where they do not apply: the target's topology without --target, timing
    and peers with it (nothing runs there)."""
    if FLAGS.target:
        given = [f"--{n}" for n in ("repeats", "peers") if FLAGS[n].present]
        return f"{' and '.join(given)}: not with --target (each strategy is compiled, none runs)" if given else None
    given = [f"--{n}" for n in ("devices", "sharding") if FLAGS[n].present]
    return f"{' and '.join(given)}: only with --target (the topology compiled for)" if given else None


def _refuse(errors: Sequence[str]) -> int:
    """Logs each error and returns the exit status of a command line that is refused."""
    for e in errors:
        log(f"error: {e}")
    return 2


def _run_target(suite: suite_mod.Suite) -> int:
    from benchmarks import targets
    targets.use_cpu_for_arrays()
    specs, _, errors = select_workloads(suite, FLAGS.workloads)
    strategies, more = select_target_strategies(FLAGS.strategies)
    if errors + more:
        return _refuse(errors + more)
    messages: list[str] = []
    try:
        rows = targets.run_target(FLAGS.target, [(w.name, w.kind, w.sizes) for w in specs], devices=FLAGS.devices,
                                  sharding=FLAGS.sharding, strategies=strategies, log=log, messages=messages)
    except (RuntimeError, ValueError) as e:
        return _refuse([str(e)])
    header = (f"aotgrad compile-only target {FLAGS.target} x{FLAGS.devices} ({FLAGS.sharding}) - "
              f"{time.strftime('%Y-%m-%d')} - jax {jax.__version__} - suite {FLAGS.suite}; per device; "
              f"act = peak minus params and batch")
    print(targets.format_rows(rows, header), flush=True)
    out = FLAGS.out if FLAGS["out"].present else _resolve_out(
        f"benchmarks/results/target_{FLAGS.target}_x{FLAGS.devices}_{FLAGS.sharding}.json")
    report.write_json(out, {"schema": 1, "date": now(), "command": _command(), "target": FLAGS.target,
                            "devices": FLAGS.devices, "sharding": FLAGS.sharding, "suite": FLAGS.suite,
                            "machine": machine_info(), "versions": versions(), "messages": messages,
                            "rows": rows})
    log(f"wrote {out}")
    if FLAGS.plot:
        log(targets.plot(FLAGS.plot, rows))
    return 0


def _resolve_out(default: str = DEFAULT_OUT) -> str:
    return default if os.path.isdir(os.path.dirname(default)) else os.path.join(ROOT, default)


def _command() -> str:
    """The command line, quoted so that it runs as given (`--strategies 'checkpoint:*'`)."""
    return shlex.join(["python", "-m", "benchmarks.run", *sys.argv[1:]])


HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def run() -> None:
    try:
        app.run(lambda argv: sys.exit(main(argv)))
    except SystemExit as e:  # absl exits 1 after printing the help it was asked for
        if e.code == 1 and any(a in HELP_FLAGS for a in sys.argv[1:]):
            raise SystemExit(0) from None
        raise


if __name__ == "__main__":
    run()
