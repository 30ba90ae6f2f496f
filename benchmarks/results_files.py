"""Reading the committed results files (docs/results/*.json) back into their records.

Each file is the JSON `python -m benchmarks.run --out ...` wrote: a suite's run, or a
compile-only target's (`--target`). A file that is missing, not JSON, or lacks a field its
records need is an error that names it and the field; two files of the same suite and
target are an error too (the page shows one run of each: the latest, committed over the
one before).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Mapping

from benchmarks.measure import Stats
from benchmarks.overhead import OverheadRow
from benchmarks.records import Row
from benchmarks.strategies import BuildSeconds, ProgramMemory, SavedBytes
from benchmarks.targets import TargetRow

__all__ = ["RESULTS_DIR", "ResultsError", "Run", "load_dir", "load_run", "read_json"]

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "docs" / "results"

# What a record's JSON holds besides its fields: properties `report.write_json` adds.
_DERIVED = {Row: {"ok"}, Stats: {"iqr"}, ProgramMemory: {"peak"}, TargetRow: set(), OverheadRow: set(),
            SavedBytes: set(), BuildSeconds: set()}
_NESTED: dict[type, dict[str, type]] = {
    Row: {"step": Stats, "saved": SavedBytes, "memory": ProgramMemory, "build": BuildSeconds},
    OverheadRow: {"per_call": Stats}}


class ResultsError(ValueError):
    """A results file that cannot be read as the run it should be (the message names it)."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One results file: a suite's run (`rows`, `overhead`) or a target's (`target_rows`)."""
    file: str  # the path from the repository root (or as given)
    name: str  # the file's stem: how docs name the run in their markers
    key: str  # the suite and target: no two files may share it
    title: str
    date: str
    command: str
    machine: Mapping[str, Any]
    versions: Mapping[str, Any]
    seconds: float | None = None  # the whole run (a suite's)
    rows: tuple[Row, ...] = ()
    overhead: tuple[OverheadRow, ...] = ()
    target_rows: tuple[TargetRow, ...] = ()
    messages: tuple[str, ...] = ()

    @property
    def is_target(self) -> bool:
        return bool(self.target_rows)


def _record(cls: type, d: Any, where: str) -> Any:
    """`cls` from its JSON object; nested records by `_NESTED`; lists become tuples."""
    if not isinstance(d, dict):
        raise ResultsError(f"{where}: expected an object for {cls.__name__}, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(d) - set(fields) - _DERIVED[cls]
    if unknown:
        raise ResultsError(f"{where}: unknown fields {sorted(unknown)} for {cls.__name__}")
    kwargs = {}
    for name, f in fields.items():
        if name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ResultsError(f"{where}: {cls.__name__} lacks the field {name!r}")
            continue
        value, nested = d[name], _NESTED.get(cls, {}).get(name)
        if nested is not None and value is not None:
            value = _record(nested, value, f"{where}.{name}")
        kwargs[name] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


def _field(d: Mapping[str, Any], name: str, where: str) -> Any:
    if name not in d:
        raise ResultsError(f"{where}: no {name!r} field")
    return d[name]


def read_json(path: pathlib.Path, root: pathlib.Path = ROOT) -> tuple[str, dict[str, Any]]:
    """A results file's path as errors show it (from `root`), and its JSON object."""
    shown = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ResultsError(f"{shown}: no such results file") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ResultsError(f"{shown}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ResultsError(f"{shown}: expected a JSON object")
    return shown, data


def load_run(path: pathlib.Path, root: pathlib.Path = ROOT) -> Run:
    """The run a results file holds."""
    shown, data = read_json(path, root)
    common = {name: _field(data, name, shown) for name in ("date", "command", "machine", "versions")}
    rows = _field(data, "rows", shown)
    if not isinstance(rows, list) or not rows:
        raise ResultsError(f"{shown}: 'rows' is empty or not a list")
    if "target" in data:
        target, devices, sharding, suite = (_field(data, n, shown) for n in ("target", "devices", "sharding", "suite"))
        key = f"target {target} x{devices} {sharding}, suite {suite}"
        return Run(shown, path.stem, key, f"Compile-only {target} x{devices} ({sharding}), suite `{suite}`",
                   **common, target_rows=tuple(_record(TargetRow, r, f"{shown}: rows[{i}]")
                                               for i, r in enumerate(rows)),
                   messages=tuple(data.get("messages") or ()))
    suite = _field(_field(data, "suite", shown), "path", f"{shown}: suite")
    backend = _field(data, "backend", shown)
    overhead = data.get("overhead") or {}
    where = common["machine"].get("accelerator") or backend  # "1 x NVIDIA H200" where the run names it
    return Run(shown, path.stem, f"suite {suite} on {backend}", f"Suite `{suite}` on {where}", **common,
               seconds=_field(data, "total_seconds", shown),
               rows=tuple(_record(Row, r, f"{shown}: rows[{i}]") for i, r in enumerate(rows)),
               overhead=tuple(_record(OverheadRow, r, f"{shown}: overhead.rows[{i}]")
                              for i, r in enumerate(overhead.get("rows") or ())),
               messages=tuple(data.get("messages") or ()))


def load_dir(directory: pathlib.Path = RESULTS_DIR, root: pathlib.Path = ROOT) -> list[Run]:
    """Every results file in `directory`, suites first, each group by name."""
    files = sorted(directory.glob("*.json"))
    if not files:
        raise ResultsError(f"{directory}: no results files (*.json)")
    runs = [load_run(p, root) for p in files]
    seen: dict[str, Run] = {}
    for r in runs:
        if r.key in seen:
            raise ResultsError(f"{seen[r.key].file} and {r.file} are both runs of {r.key}: keep the latest only")
        seen[r.key] = r
    return sorted(runs, key=lambda r: (r.is_target, r.name))
