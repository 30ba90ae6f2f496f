"""`Plan`: the rows `aotgrad.plan` compiled, and what they answer.

- `plan.fit(limit)`: the cheapest row (fewest bytes moved, within `COST_TIE`: then the highest
  peak) whose compiled per-device peak is at most `limit`, or `DoesNotFit` naming the smallest
  peak reached;
- `print(plan)`: the table (target, devices, versions; at most 100 columns);
- `plan.to_json()`: the same as a JSON-ready dict; `plan.plot(path)`: peak against bytes moved.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from aotgrad.partition.budget_value import parse_bytes
from aotgrad.planning.land import land

__all__ = ["DoesNotFit", "Plan", "Row"]

ESTIMATE_NOTE = ("est step: an estimate, not a measurement: max(bytes moved / memory bandwidth, FLOPs /\n"
                 "peak matmul FLOP/s) of the device, with no communication and no overlap lost.")


class DoesNotFit(ValueError):
    """No plan's compiled peak fits the limit; `smallest` is the smallest peak reached."""

    def __init__(self, message: str, smallest: int | None) -> None:
        super().__init__(message)
        self.smallest = smallest


@dataclasses.dataclass(frozen=True)
class Row:
    """One compiled step, per device."""
    strategy: str  # "fused" (jax.jit(jax.value_and_grad(fn))) or "aotgrad" (of aotgrad.compile(fn))
    budget: float | int | str | None  # the activation_memory_budget asked for; None for fused
    peak_bytes: int | None  # XLA's memory_analysis(): temp + arguments + outputs - aliased
    bytes_moved: float | None  # XLA's HLO cost analysis of the compiled step
    flops: float | None
    est_step_s: float | None  # an estimate from the device's bandwidth and FLOP rate
    compile_s: float

    @property
    def name(self) -> str:
        return "fused" if self.strategy == "fused" else f"aotgrad@{self.budget}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_BYTES = (("KB", 1e3), ("MB", 1e6), ("GB", 1e9), ("TB", 1e12))
_FLOPS = (("MFLOP", 1e6), ("GFLOP", 1e9), ("TFLOP", 1e12), ("PFLOP", 1e15))
_SECONDS = (("us", 1e-6), ("ms", 1e-3), ("s", 1.0))


def _unit(values: list[float | None], units: tuple[tuple[str, float], ...]) -> tuple[str, float]:
    """The largest unit in which the column's largest value is at least 1."""
    top = max((v for v in values if v), default=0)
    return next(((u, s) for u, s in reversed(units) if top >= s), units[0])


def _cost(row: Row) -> tuple[float, float, float]:
    """Cheapest first: fewest bytes moved, then fewest FLOPs, then the lower peak."""
    return (row.bytes_moved if row.bytes_moved is not None else float("inf"),
            row.flops if row.flops is not None else float("inf"), row.peak_bytes)


# Bytes moved within this share of the fewest count as the same cost. XLA's count shifts that
# much between neighbouring plans without following what they save: on a real H200, GPT-2
# small's steps peaking from 9 to 15 GB moved 107.6-110.4 GB, not falling as the peak rose, and
# a real GPU's FLOPs leave out the matmul library calls. Among equal costs the step that saves
# the most (the highest peak under the limit) recomputes the least.
COST_TIE = 0.01


def _cheapest(rows: list[Row]) -> Row:
    """`fit`'s choice among rows that fit: the highest peak among those moving at most
    `COST_TIE` more bytes than the cheapest (`_cost`)."""
    least = min(rows, key=_cost)
    if least.bytes_moved is None:
        return least
    near = [r for r in rows if r.bytes_moved is not None and r.bytes_moved <= least.bytes_moved * (1 + COST_TIE)]
    return max(near, key=lambda r: (r.peak_bytes, -r.bytes_moved))  # the first of equals: fused before aotgrad


@dataclasses.dataclass(frozen=True)
class Plan:
    target: str
    devices: int
    sharding: str
    versions: dict[str, str]
    rows: tuple[Row, ...]
    # Compiles the aotgrad step at one more budget (fit's byte budget); None: not offered.
    compile_budget: Callable[[Any], Row | None] | None = dataclasses.field(default=None, compare=False, repr=False)
    # The estimated peaks a byte budget chooses between (`land.Levels`), traced at a limit.
    levels: Callable[[int], list[int]] | None = dataclasses.field(default=None, compare=False, repr=False)
    # fit's extra rows by byte budget setting, so asking twice compiles once.
    _extra: dict[str, Row] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def fit(self, limit: int | str) -> Row:
        """The cheapest row whose compiled per-device peak is at most `limit` (bytes, or a
        size such as "70GB"): the fewest bytes moved, where rows within `COST_TIE` of each
        other count as equal and the highest peak among them is taken. Where the fused step
        does not fit, aotgrad's step is compiled at budgets searched so that its compiled
        peak lands just under `limit` (`land.py`: a budget is met against aotgrad's estimate
        of the peak, not the compiler's); the row names the `activation_memory_budget`
        (`row.budget`) that builds that step."""
        try:
            if isinstance(limit, bool) or not isinstance(limit, (int, str)):
                raise ValueError(f"a byte size is an int or a string such as '70GB'; got {limit!r}.")
            n = parse_bytes(limit)
        except ValueError as e:
            raise ValueError(f"plan.fit(limit): {e}") from None
        rows = list(self.rows)
        fits = [r for r in rows if r.peak_bytes is not None and r.peak_bytes <= n]
        fused_fits = any(r.strategy == "fused" for r in fits)
        if not fused_fits and self.compile_budget is not None and self.levels is not None:
            for _, extra in land(n, self.levels(n), self._compiled_at, finer=self.levels).tried:
                rows.append(extra)
                if extra.peak_bytes is not None and extra.peak_bytes <= n:
                    fits.append(extra)
        if not fits:
            peaks = [r for r in rows if r.peak_bytes is not None]
            best = min(peaks, key=lambda r: r.peak_bytes) if peaks else None
            reached = (f"the smallest peak reached is {best.peak_bytes:,} bytes ({best.peak_bytes / 1e9:.3g} GB, "
                       f"{best.name})" if best else "no row reports a peak")
            raise DoesNotFit(f"plan.fit({limit!r}): no step fits in {n:,} bytes per device on {self.devices} x "
                             f"{self.target}; {reached}. More devices with sharding='fsdp', a smaller batch "
                             f"per device, or a lower-precision model may.", best.peak_bytes if best else None)
        return _cheapest(fits)

    @property
    def searched(self) -> dict[str, Row]:
        """The steps `fit` compiled beyond the rows, by their byte budget setting."""
        return dict(self._extra)

    def _compiled_at(self, setting: str) -> Row:
        """The aotgrad step at the byte budget `setting`, compiled once per setting."""
        if setting not in self._extra:
            row = self.compile_budget(setting)
            assert row is not None, "a setting from the ladder's levels is never unreachable"
            self._extra[setting] = row
        return self._extra[setting]

    def to_json(self) -> dict[str, Any]:
        """JSON-ready: target, devices, sharding, versions and one object per row."""
        return {"target": self.target, "devices": self.devices, "sharding": self.sharding,
                "versions": dict(self.versions), "rows": [r.to_json() for r in self.rows]}

    def __str__(self) -> str:
        fused = next((r for r in self.rows if r.strategy == "fused"), None)
        peak_unit, peak_scale = _unit([r.peak_bytes for r in self.rows], _BYTES)
        moved_unit, moved_scale = _unit([r.bytes_moved for r in self.rows], _BYTES)
        flop_unit, flop_scale = _unit([r.flops for r in self.rows], _FLOPS)
        time_unit, time_scale = _unit([r.est_step_s for r in self.rows], _SECONDS)
        versions = ", ".join(f"{k} {v}" for k, v in self.versions.items())
        lines = [f"plan: {self.devices} x {self.target} ({self.sharding}); {versions}; per device",
                 f"{'step':<16s} {'peak ' + peak_unit:>10s} {'vs fused':>8s} {moved_unit + ' moved':>10s} "
                 f"{'vs fused':>8s} {flop_unit:>8s} {'est step ' + time_unit:>12s} {'compile s':>9s}"]

        def ratio(a: float | None, b: float | None) -> str:
            return f"{a / b:.2f}x" if a is not None and b else "-"

        def num(x: float | None, scale: float) -> str:
            return "-" if x is None else f"{x / scale:.2f}"
        for r in self.rows:
            base = fused or r
            lines.append(f"{r.name:<16.16s} {num(r.peak_bytes, peak_scale):>10s} "
                         f"{ratio(r.peak_bytes, base.peak_bytes):>8s} {num(r.bytes_moved, moved_scale):>10s} "
                         f"{ratio(r.bytes_moved, base.bytes_moved):>8s} {num(r.flops, flop_scale):>8s} "
                         f"{num(r.est_step_s, time_scale):>12s} {r.compile_s:9.1f}")
        return "\n".join(lines + [ESTIMATE_NOTE])

    def plot(self, path: str) -> str:
        """Peak against bytes moved, one point per row, the fused step marked; returns `path`."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("plan.plot needs matplotlib: pip install 'aotgrad[bench]'") from None
        fig, ax = plt.subplots(figsize=(6, 4.5))
        shown = [r for r in self.rows if r.peak_bytes is not None and r.bytes_moved is not None]
        x_unit, x_scale = _unit([r.bytes_moved for r in shown], _BYTES)
        y_unit, y_scale = _unit([r.peak_bytes for r in shown], _BYTES)
        points: dict[tuple[float, float], list[Row]] = {}  # rows that compiled to the same numbers share a point
        for r in shown:
            points.setdefault((r.bytes_moved / x_scale, r.peak_bytes / y_scale), []).append(r)
        for (x, y), rows in points.items():
            fused = any(r.strategy == "fused" for r in rows)
            ax.scatter(x, y, marker="*" if fused else "o", s=160 if fused else 40, color="C3" if fused else "C0",
                       zorder=3)
            ax.annotate(", ".join(r.name for r in rows), (x, y), xytext=(5, 5), textcoords="offset points",
                        fontsize=8)
        ax.ticklabel_format(useOffset=False)
        ax.margins(0.3)  # room for the labels
        ax.set(title=f"{self.devices} x {self.target} ({self.sharding}): the fused step is the star",
               xlabel=f"bytes moved per device ({x_unit})", ylabel=f"compiled peak per device ({y_unit})")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path
