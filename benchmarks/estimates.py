"""How the step-peak and traffic estimates rank the cuts a budget weighs, against the
compiler: every candidate a budget weighs (`budget.ladder_of`, the blends too) on one
workload, lowest estimate first, with its estimated per-device peak and estimated traffic
(`partition/traffic.py`: bytes, plus FLOPs at `costs.FLOPS_PER_BYTE`), and the lowest
`--compile` of them, and those whose estimated peak is in `--band`, compiled for the target
(XLA's `memory_analysis()` peak, per device, inputs included; the bytes it moves and its
FLOPs, as the target benchmark counts them).

    JAX_PLATFORMS=cpu python -m benchmarks.estimates --target h100 --suite config/stacks.toml \\
        --workload stack_plain --sizes layers=4 --compile 6
    JAX_PLATFORMS=cpu python -m benchmarks.estimates --target h100 --workload stack_plain \\
        --sizes layers=4 --compile 0 --band 6000,7100

A row says whether the budget's ladder keeps the candidate (`budget.choices`) and marks
the one budget 0 takes; the summary says whether that one is the lowest compiled peak, the
estimate's error on each compiled row, and how many compiled pairs the traffic estimate
ranks otherwise than the compiler's bytes and FLOPs. Budget 0 misses the lowest peak exactly where
the estimate misranks the candidates the ladder chooses between: this is the check to run
on a model the estimate was not tuned on. Shapes only: nothing runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

import jax

import aotgrad
from aotgrad.partition import costs
from aotgrad.partition.budget import Choice, ladder_of, step_programs
from aotgrad.partition.graph import JointGraph
from aotgrad.partition.min_cut import Problem
from aotgrad.partition.traffic import traffic
from aotgrad.planning.measure import measure as compile_measured
from aotgrad.targets import resolve as resolve_target
from benchmarks.strategies import AOTGRAD_PREFIX
from benchmarks.suite import load, select_workloads
from benchmarks.targets import compile_step, placed_specs, step_and_context
from benchmarks.workloads import build

PARTITIONER = "estimates_bench"  # registered while `measure` runs


class _Candidates:
    """A partitioner that records the candidates of the first graph it sees and then saves
    the one picked (`pick`) on each graph it is given: a re-trace of the same step has the
    same equations in the same order, so a saved value is found again by where it is made."""

    def __init__(self) -> None:
        self.where: dict[Any, tuple[int, int]] = {}  # the first graph's values: their places
        self.all: list[Choice] = []
        self.kept: list[Choice] = []
        self.pick: Choice | None = None

    def __call__(self, graph: JointGraph, budget: Any) -> dict:
        if not self.where:
            self.where = _positions(graph)
            steps = ladder_of(Problem.priced(graph))
            self.all, self.kept = steps.found, steps.kept
        cut = (self.pick or self.all[0]).cut
        return {_value_at(graph, self.where[v]): "picked" for v in cut.saved}


def _positions(graph: JointGraph) -> dict[Any, tuple[int, int]]:
    """Each joint value's place: (-1, input index) or (equation index, output index)."""
    where = {v: (-1, i) for i, v in enumerate(graph.inputs)}
    for i, e in enumerate(graph.eqns):
        where.update({v: (i, j) for j, v in enumerate(e.outvars)})
    return where


def _value_at(graph: JointGraph, place: tuple[int, int]) -> Any:
    i, j = place
    return graph.inputs[j] if i < 0 else graph.eqns[i].outvars[j]


def measure(kind: str, name: str, sizes: dict[str, Any], target: str, devices: int = 1,
            sharding: str = "dp", compile_lowest: int = 6, log: Callable[[str], None] = print,
            band: tuple[float, float] | None = None) -> dict[str, Any]:
    """The candidates of the workload's step on the target, the lowest `compile_lowest`
    (by estimate) compiled, and those whose estimated peak is within `band` (bytes, both
    ends included); see the module's docstring."""
    w = build(name, kind, sizes)
    params, batch = placed_specs(w, resolve_target(target).mesh(devices), sharding)
    recorder = _Candidates()
    registration = aotgrad.register_partitioner(PARTITIONER, recorder)
    strategy = f"{AOTGRAD_PREFIX}{PARTITIONER}@0.5"  # a budget below 1, so that the partitioner is asked
    try:
        fn, context = step_and_context(strategy, w)
        with context():
            jax.jit(fn).trace(params, batch)
        kept = {frozenset(c.cut.saved) for c in recorder.kept}
        lowest = frozenset(recorder.kept[0].cut.saved)  # budget 0's cut
        rows = []
        for rank, c in enumerate(sorted(recorder.all, key=lambda c: (c.peak, c.cost))):
            row = {"rank": rank, "estimated_peak": c.peak, "saved_bytes": c.saved, "cost": c.cost,
                   "estimated_traffic": c.traffic if c.step is not None else traffic(step_programs(c.cut)),
                   "kept": frozenset(c.cut.saved) in kept, "budget_0": frozenset(c.cut.saved) == lowest,
                   "compiled_peak": None, "compiled_moved": None, "compiled_flops": None}
            if rank < compile_lowest or row["budget_0"] or (band is not None and band[0] <= c.peak <= band[1]):
                recorder.pick, t0 = c, time.perf_counter()
                _, m = compile_measured(lambda: compile_step(strategy, w, params, batch))
                row.update(compiled_peak=m.peak_bytes, compiled_moved=m.bytes_moved, compiled_flops=m.flops)
                log(f"{name}: candidate {rank} compiled in {time.perf_counter() - t0:.0f} s")
            rows.append(row)
    finally:
        registration.remove()
    return {"workload": name, "kind": kind, "sizes": sizes, "target": target, "devices": devices,
            "sharding": sharding, "rows": rows, "versions": {"jax": jax.__version__, "aotgrad": aotgrad.__version__}}


def summary(result: dict[str, Any]) -> list[str]:
    """Whether budget 0 took the lowest compiled peak, the estimate's error, and how the
    traffic estimate ranks the compiled candidates (`_traffic_ranking`)."""
    done = [r for r in result["rows"] if r["compiled_peak"] is not None]
    best = min(done, key=lambda r: r["compiled_peak"])
    ours = next(r for r in done if r["budget_0"])
    errors = [r["estimated_peak"] / r["compiled_peak"] - 1 for r in done]
    order = sorted(done, key=lambda r: r["compiled_peak"])
    return [f"budget 0 takes candidate {ours['rank']}: compiled {ours['compiled_peak'] / 1e9:.3f} GB, "
            f"{ours['compiled_peak'] / best['compiled_peak']:.3f}x the lowest compiled (candidate {best['rank']})",
            f"estimate / compiled - 1: {min(errors):+.1%} to {max(errors):+.1%} over {len(done)} compiled",
            "compiled order (by estimate rank): " + " ".join(str(r["rank"]) for r in order),
            _traffic_ranking(done)]


def _traffic_ranking(done: list[dict[str, Any]]) -> str:
    """How many pairs of compiled candidates the traffic estimate ranks otherwise than the
    compiler's numbers priced the same way (bytes moved, plus FLOPs at
    `costs.FLOPS_PER_BYTE`), among pairs whose compiled prices differ by more than 1%."""
    priced = [(r["estimated_traffic"], r["compiled_moved"] + r["compiled_flops"] / costs.FLOPS_PER_BYTE)
              for r in done if r["compiled_moved"] is not None and r["compiled_flops"] is not None]
    pairs = [(a, b) for i, a in enumerate(priced) for b in priced[i + 1:] if abs(a[1] / b[1] - 1) > 0.01]
    wrong = sum((a[0] < b[0]) != (a[1] < b[1]) for a, b in pairs)
    return f"traffic estimate: {wrong} of {len(pairs)} compiled pairs (prices > 1% apart) ranked the other way"


def table(result: dict[str, Any]) -> str:
    lines = ["rank  kept  budget0  estimated GB  compiled GB  est/compiled  saved MB  est traffic GB  moved GB"]
    for r in result["rows"]:
        est, c, moved = r["estimated_peak"], r["compiled_peak"], r["compiled_moved"]
        compiled, ratio = ("-", "-") if c is None else (f"{c / 1e9:.3f}", f"{est / c:.3f}")
        lines.append(f"{r['rank']:4d}  {'yes' if r['kept'] else '-':>4}  {'<-' if r['budget_0'] else '':>7}  "
                     f"{est / 1e9:12.3f}  {compiled:>11}  {ratio:>12}  {r['saved_bytes'] / 1e6:8.1f}  "
                     f"{r['estimated_traffic'] / 1e9:14.3f}  {'-' if moved is None else f'{moved / 1e9:.3f}':>8}")
    return "\n".join(lines)


def _sizes(text: str) -> dict[str, Any]:
    sizes: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        sizes[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return sizes


def _band(text: str) -> tuple[float, float]:
    """`--band LO,HI` (MB of estimated peak) in bytes."""
    lo, _, hi = text.partition(",")
    try:
        low, high = float(lo) * 1e6, float(hi) * 1e6
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI in MB (e.g. 6000,7100), found {text!r}") from None
    if low > high:
        raise argparse.ArgumentTypeError(f"expected LO <= HI, found {text!r}")
    return low, high


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="h100")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--sharding", default="dp", choices=("dp", "fsdp"))
    ap.add_argument("--suite", default="config/stacks.toml")
    ap.add_argument("--workload", required=True, help="a workload of the suite")
    ap.add_argument("--sizes", default="", help="overrides of the suite's sizes, e.g. layers=4")
    ap.add_argument("--compile", type=int, default=6, help="compile this many of the lowest estimates")
    ap.add_argument("--band", type=_band, help="also compile every candidate estimated to peak in LO,HI (MB)")
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args(argv)
    specs, _ = select_workloads(load(args.suite).workloads, [args.workload])
    if len(specs) != 1:
        ap.error(f"--workload {args.workload!r}: {len(specs)} workloads of {args.suite} match; name one")
    spec = specs[0]
    result = measure(spec.kind, spec.name, {**spec.sizes, **_sizes(args.sizes)}, args.target, args.devices,
                     args.sharding, args.compile, log=lambda s: print(s, file=sys.stderr), band=args.band)
    print(table(result))
    print("\n".join(summary(result)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
