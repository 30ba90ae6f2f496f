"""The planning-time results (docs/results/planning_time/*.json, one file per jax version,
written by `python -m benchmarks.planning_time --out`), as the results page shows them."""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Mapping, Sequence

from benchmarks.results_files import RESULTS_DIR, ROOT, ResultsError, read_json

__all__ = ["GOAL", "PLANNING_DIR", "PlanningRun", "load_planning", "planning_section"]

PLANNING_DIR = RESULTS_DIR / "planning_time"
GOAL = 3.0  # aotgrad's lowering within this of the plain step's, at every budget and depth


@dataclasses.dataclass(frozen=True)
class PlanningRun:
    """One planning-time file: each row's aotgrad and plain CPU seconds by (layers, budget)."""
    file: str
    date: str
    jax: str
    repeats: int
    sizes: Mapping[str, Any]
    rows: tuple[tuple[int, float, float, float], ...]  # (layers, budget, plain s, aotgrad s)
    machine: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    command: str | None = None
    commit: str | None = None


def load_planning(directory: pathlib.Path = PLANNING_DIR, root: pathlib.Path = ROOT) -> list[PlanningRun]:
    """Every planning-time file in `directory`, by jax version (none: an empty list)."""
    runs = [_load(p, root) for p in sorted(directory.glob("*.json"))]
    return sorted(runs, key=lambda r: tuple(int(part) if part.isdigit() else 0 for part in r.jax.split(".")))


def _load(path: pathlib.Path, root: pathlib.Path) -> PlanningRun:
    shown, data = read_json(path, root)
    try:
        rows = tuple((int(r["layers"]), float(r["budget"]), float(r["plain_cpu_s"]), float(r["aotgrad_cpu_s"]))
                     for r in data["rows"])
        versions = data.get("versions") or {}
        return PlanningRun(shown, str(data["date"]), str(data["jax"]), int(data["repeats"]), dict(data["sizes"]),
                           rows, dict(data.get("machine") or {}), data.get("command"), versions.get("commit"))
    except (KeyError, TypeError, ValueError) as e:
        raise ResultsError(f"{shown}: not a planning-time file (python -m benchmarks.planning_time --out): "
                           f"{type(e).__name__} {e}") from None


def planning_section(runs: Sequence[PlanningRun]) -> list[str]:
    """The page's planning-time section: per jax version, one row per depth, one column per
    budget, each cell aotgrad's seconds and its ratio to the plain step's."""
    if not runs:
        return []
    sizes = ", ".join(f"{k} {v}" for k, v in runs[0].sizes.items())
    out = ["## Planning time", "",
           "Lowering `jax.jit(jax.value_and_grad(aotgrad.compile(f)))` against the plain "
           "`jax.jit(jax.value_and_grad(f))`, back to back in one process, for unrolled GPTs of tiny width "
           f"({sizes}: the graph, not arithmetic, is what costs); medians of interleaved runs, CPU seconds of "
           "the process, each lowering followed by a full garbage collection charged to it. A cell is aotgrad's "
           f"seconds and its ratio to the plain step's (the goal: at most {GOAL:g}x at every budget and depth). "
           "`python -m benchmarks.planning_time --out docs/results/planning_time/jax<version>.json`.", ""]
    for run in runs:
        out += [f"### jax {run.jax}", "", f"From `{run.file}`: {run.date[:10]}, medians of {run.repeats}"
                + (f", {run.machine.get('cpu_count')}-core {run.machine.get('cpu_model')}" if run.machine else "")
                + (f", aotgrad at {run.commit}" if run.commit else "") + "."
                + (f" Command: `{run.command}`." if run.command else ""), ""]
        budgets = list(dict.fromkeys(b for _, b, _, _ in run.rows))
        cells = {(layers, b): (plain, ours) for layers, b, plain, ours in run.rows}
        out += ["| layers | plain step | " + " | ".join(f"budget {b:g}" for b in budgets) + " |",
                "|---:|---:|" + "---:|" * len(budgets)]
        for layers in dict.fromkeys(layers for layers, _, _, _ in run.rows):
            plains = [cells[layers, b][0] for b in budgets if (layers, b) in cells]
            low, high = min(plains), max(plains)
            plain = f"{low:.2f} s" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f} s"
            row = [f"{cells[layers, b][1]:.2f} s ({cells[layers, b][1] / cells[layers, b][0]:.1f}x)"
                   if (layers, b) in cells else "" for b in budgets]
            out.append(f"| {layers} | {plain} | " + " | ".join(row) + " |")
        worst = max(ours / plain for _, _, plain, ours in run.rows)
        out += ["", f"At most {worst:.2f}x the plain step" + (" (over the goal)." if worst > GOAL else "."), ""]
    return out
