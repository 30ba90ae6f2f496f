"""Presenting results: the terminal table, the JSON file, the optional plot."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

from benchmarks.records import Row
from benchmarks.strategies import ProgramMemory

__all__ = ["format_table", "plot", "write_json"]

PLOT_HINT = "pip install -e '.[bench]' to get the plot"


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _peak_pair(m: ProgramMemory | None) -> str:
    if m is None or m.backward_peak is None:
        return "-"
    return f"{_mb(m.forward_peak)}/{_mb(m.backward_peak)}"


def _cells(r: Row, fused_peak: int | None) -> list[str]:
    if not r.ok:
        return [r.workload, r.strategy, "FAILED: " + (r.error or "")]
    st = r.step
    assert st is not None
    build = "-"
    if r.build is not None:
        build = f"{r.build.trace:.2f}/{r.build.partition:.2f}/{r.build.compile:.2f}"
    peak = r.memory.peak if r.memory else None
    jitted = r.memory.jitted_peak if r.memory else None
    return [r.workload, r.strategy, f"{st.median * 1e3:.2f}", f"{st.iqr * 1e3:.2f}",
            _ratio(r.ratio_vs_jax), _ratio(r.ratio_vs_fused),
            _mb(r.saved.activations if r.saved else None), _mb(r.saved.inputs if r.saved else None),
            _mb(peak), _peak_pair(r.memory), _ratio(peak / fused_peak if peak and fused_peak else None),
            _ratio(jitted / fused_peak if jitted and fused_peak else None),
            "-" if r.first_step_s is None else f"{r.first_step_s:.2f}", build,
            "-" if r.grad_error is None else f"{r.grad_error:.1e}"]


HEADER = ["workload", "strategy", "step ms", "IQR ms", "vs jax", "vs fused", "saved MB", "in MB",
          "peak MB", "fwd/bwd peak MB", "peak vs fused", "in jit", "1st s", "tr/part/comp s", "grad err"]
RIGHT = {2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14}


def _fused_peaks(rows: Sequence[Row]) -> dict[str, int]:
    """Each workload's fused-program peak: what the other peaks are compared with."""
    return {r.workload: r.memory.peak for r in rows
            if r.ok and r.strategy == "fused" and r.memory is not None and r.memory.peak}


def format_table(rows: Sequence[Row]) -> str:
    """A fixed-width table; failed rows span the numeric columns with their message."""
    fused = _fused_peaks(rows)
    body = [_cells(r, fused.get(r.workload)) for r in rows]
    full = [HEADER] + [c for c in body if len(c) == len(HEADER)]
    widths = [max(len(c[i]) for c in full) for i in range(len(HEADER))]

    def line(cells: list[str]) -> str:
        if len(cells) != len(HEADER):
            return "  ".join([cells[0].ljust(widths[0]), cells[1].ljust(widths[1]), cells[2]])
        return "  ".join(c.rjust(w) if i in RIGHT else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    out = [line(HEADER), "  ".join("-" * w for w in widths)]
    last = None
    for r, cells in zip(rows, body, strict=True):
        if last is not None and r.workload != last:
            out.append("")
        out.append(line(cells))
        last = r.workload
    notes = [f"  {r.workload} / {r.strategy}: {n}" for r in rows for n in r.notes]
    if notes:
        out += ["", "notes:", *notes]
    return "\n".join(out)


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
