"""Suite files: TOML (read with the standard library's tomllib) naming workloads with
their sizes, the strategies to compare and how many interleaved repeats to time.

    description = "..."
    repeats = 15                   # interleaved timing samples per (workload, strategy)
    min_sample_seconds = 0.25      # steps per sample: the median strategy's sample lasts this
    memory_analysis = true         # ask XLA for temp sizes (a few cheap extra compiles)
    strategies = ["fused", "jax_fwd_and_bwd", "aotgrad:*"]   # globs allowed

    [overhead]                     # the call-overhead benchmark (omit the table to skip)
    size = 4
    calls = 1000
    repeats = 21

    [[workloads]]
    name = "transformer_block"     # the row label
    kind = "transformer_block"     # a key of benchmarks.workloads.BUILDERS
    sizes = { batch = 8, seq = 128, d_model = 256, heads = 8 }
    repeats = 20                   # optional per-workload override
"""
from __future__ import annotations

import dataclasses
import fnmatch
import os
import tomllib
from typing import Any, Sequence

__all__ = ["OverheadSpec", "Suite", "SuiteError", "WorkloadSpec", "load", "select_workloads"]


class SuiteError(ValueError):
    """A suite file that cannot be used."""


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    name: str
    kind: str
    sizes: dict[str, Any]
    repeats: int


@dataclasses.dataclass(frozen=True)
class OverheadSpec:
    size: int = 4
    calls: int = 1000
    repeats: int = 21


@dataclasses.dataclass(frozen=True)
class Suite:
    path: str
    description: str
    repeats: int
    min_sample_seconds: float
    memory_analysis: bool
    strategies: tuple[str, ...]
    workloads: tuple[WorkloadSpec, ...]
    overhead: OverheadSpec | None


def _positive_int(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SuiteError(f"{where} must be an integer >= 1; got {value!r}")
    return value


def load(path: str | os.PathLike[str]) -> Suite:
    """Reads and validates a suite file."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise SuiteError(f"suite file {path!r} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise SuiteError(f"suite file {path!r} is not valid TOML: {e}") from None
    repeats = _positive_int(f"{path}: repeats", raw.get("repeats", 5))
    strategies = raw.get("strategies", ["fused", "jax_fwd_and_bwd", "aotgrad:*"])
    if not isinstance(strategies, list) or not all(isinstance(s, str) for s in strategies):
        raise SuiteError(f"{path}: strategies must be a list of strings; got {strategies!r}")
    workloads = []
    for i, w in enumerate(raw.get("workloads", [])):
        where = f"{path}: workloads[{i}]"
        if not isinstance(w, dict) or "kind" not in w:
            raise SuiteError(f"{where} must be a table with at least `kind`; got {w!r}")
        sizes = w.get("sizes", {})
        if not isinstance(sizes, dict):
            raise SuiteError(f"{where}.sizes must be a table; got {sizes!r}")
        workloads.append(WorkloadSpec(name=str(w.get("name", w["kind"])), kind=str(w["kind"]), sizes=dict(sizes),
                                      repeats=_positive_int(f"{where}.repeats", w.get("repeats", repeats))))
    names = [w.name for w in workloads]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SuiteError(f"{path}: workload names must be unique; repeated: {dupes}")
    overhead = None
    if "overhead" in raw:
        o = raw["overhead"]
        overhead = OverheadSpec(size=_positive_int(f"{path}: overhead.size", o.get("size", 4)),
                                calls=_positive_int(f"{path}: overhead.calls", o.get("calls", 1000)),
                                repeats=_positive_int(f"{path}: overhead.repeats", o.get("repeats", 21)))
    min_sample = raw.get("min_sample_seconds", 0.05)
    if isinstance(min_sample, bool) or not isinstance(min_sample, (int, float)) or min_sample < 0:
        raise SuiteError(f"{path}: min_sample_seconds must be a number >= 0; got {min_sample!r}")
    return Suite(path=path, description=str(raw.get("description", "")), repeats=repeats,
                 min_sample_seconds=float(min_sample), memory_analysis=bool(raw.get("memory_analysis", True)),
                 strategies=tuple(strategies), workloads=tuple(workloads), overhead=overhead)


def select_workloads(specs: Sequence[WorkloadSpec], only: Sequence[str] | None,
                     also_known: Sequence[str] = ()) -> tuple[list[WorkloadSpec], list[str]]:
    """The workloads whose names match a pattern of `only` (globs; None: all), and one
    `--workloads` message per pattern that matches none of them nor of `also_known`."""
    if not only:
        return list(specs), []
    known = [w.name for w in specs] + list(also_known)
    messages = [f"--workloads: {pat!r} matches none of {known}" for pat in only
                if not any(fnmatch.fnmatchcase(n, pat) for n in known)]
    return [w for w in specs if any(fnmatch.fnmatchcase(w.name, p) for p in only)], messages
