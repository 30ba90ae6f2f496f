"""Presenting results: the terminal table, the JSON file, the optional plot."""
from __future__ import annotations

import dataclasses
import json
import os
import textwrap
from typing import Any, Sequence

from benchmarks.columns import SUITE_COLUMNS, by_workload, suite_refs
from benchmarks.records import Row

__all__ = ["format_table", "legend_lines", "plot", "write_json"]

PLOT_HINT = "pip install -e '.[bench]' to get the plot"
WIDTH = 120  # the terminal table's width: columns beyond it wrap into another panel
GAP = 2  # spaces between columns
INDENT = "  "  # a strategy under its workload


def _panels(widths: Sequence[int], key: int, width: int) -> list[list[int]]:
    """The columns of each panel: as many as fit `width` beside the key column, in order."""
    panels: list[list[int]] = [[]]
    used = key
    for i, w in enumerate(widths):
        if panels[-1] and used + GAP + w > width:
            panels.append([])
            used = key
        panels[-1].append(i)
        used += GAP + w
    return panels


def format_table(rows: Sequence[Row], width: int = WIDTH) -> str:
    """The rows grouped by workload, under a two-line header; columns that do not fit
    `width` beside the strategy go to a second panel (a third...), which repeats the
    strategies. A legend for every column follows, then the rows' notes."""
    groups, refs = by_workload(rows), suite_refs(rows)
    cells = {id(r): [c.cell(r, refs(r)) for c in SUITE_COLUMNS] if r.ok else [] for r in rows}
    depth = max(len(c.head) for c in SUITE_COLUMNS)
    heads = [("",) * (depth - len(c.head)) + c.head for c in SUITE_COLUMNS]
    widths = [max([len(h) for h in head] + [len(v[i]) for v in cells.values() if v])
              for i, head in enumerate(heads)]
    key = max([len("strategy")] + [len(INDENT + r.strategy) for r in rows])
    out: list[str] = []
    for n, panel in enumerate(_panels(widths, key, width)):
        if n:
            out.append("")
        for line in range(depth):
            label = "strategy" if line == depth - 1 else ""
            out.append((label.ljust(key) + "".join(" " * GAP + heads[i][line].rjust(widths[i])
                                                    for i in panel)).rstrip())
        out.append("-" * key + "".join(" " * GAP + "-" * widths[i] for i in panel))
        for workload, mine in groups.items():
            out.append(workload)
            for r in mine:
                name = (INDENT + r.strategy).ljust(key)
                if not r.ok:
                    out.append(name + " " * GAP + ("FAILED: " + (r.error or "") if n == 0 else "FAILED"))
                    continue
                out.append(name + "".join(" " * GAP + cells[id(r)][i].rjust(widths[i]) for i in panel))
    out += ["", *legend_lines(width)]
    notes = [f"  {r.workload} / {r.strategy}: {n}" for r in rows for n in r.notes]
    if notes:
        out += ["", "notes:", *notes]
    return "\n".join(out)


def legend_lines(width: int = WIDTH) -> list[str]:
    """What each column of the table is, wrapped to `width`."""
    out = ["columns:"]
    for c in SUITE_COLUMNS:
        out += textwrap.wrap(f"{c.name}: {c.legend}.", width, initial_indent="  ", subsequent_indent="    ")
    return out


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        d = {f.name: _jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if hasattr(x, "iqr"):
            d["iqr"] = x.iqr
        if hasattr(x, "peak"):
            d["peak"] = x.peak
        if isinstance(x, Row):
            d["ok"] = x.ok
        return d
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(_jsonable(payload), fh, indent=2)
        fh.write("\n")


def plot_available() -> bool:
    """Whether matplotlib can be imported (checked before a run that asks for a plot)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(path: str, rows: Sequence[Row]) -> str:
    """Step peak memory (XLA) vs step time, one panel per workload, one marker per
    strategy: the memory/time trade-off each strategy offers (lower left is better).
    Returns a one-line message (written file, or how to get matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return PLOT_HINT
    points = [r for r in rows if r.ok and r.memory is not None and r.memory.peak and r.step is not None]
    workloads = list(dict.fromkeys(r.workload for r in points))
    if not workloads:
        return "nothing to plot: no row has both a peak memory and a step time"
    strategies = list(dict.fromkeys(r.strategy for r in points))
    markers = "osD^vP*X<>"
    cols = min(3, len(workloads))
    nrows = -(-len(workloads) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, wl in zip(axes.flat, workloads):
        mine = [r for r in points if r.workload == wl]
        times = [r.step.median * 1e3 for r in mine if r.step is not None]
        if times and max(times) / max(min(times), 1e-9) > 20:
            ax.set_yscale("log")
        for r in mine:
            k = strategies.index(r.strategy)
            assert r.memory is not None and r.memory.peak is not None and r.step is not None
            ax.errorbar(r.memory.peak / 1e6, r.step.median * 1e3,
                        yerr=[[r.step.median * 1e3 - r.step.q1 * 1e3], [r.step.q3 * 1e3 - r.step.median * 1e3]],
                        fmt=markers[k % len(markers)], color=f"C{k % 10}", label=r.strategy, capsize=3)
        ax.set_title(wl, fontsize=10)
        ax.set_xlabel("step peak memory (MB, XLA)")
        ax.set_ylabel("step time (ms, median, IQR)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(workloads):]:
        ax.axis("off")
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(len(handles), 4), frameon=False)
    fig.tight_layout(rect=(0, 0.04 * (1 + len(handles) // 4), 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote plot {path}"
