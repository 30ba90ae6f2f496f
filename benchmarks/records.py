"""Result records: one `Row` per (workload, strategy), and the run as a whole."""
from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import subprocess
import sys
from typing import Any

from benchmarks.measure import Stats
from benchmarks.strategies import BuildSeconds, ProgramMemory, SavedBytes

__all__ = ["Row", "machine_info", "versions"]


@dataclasses.dataclass(frozen=True)
class Row:
    """One (workload, strategy) result. On failure only `error` is set."""
    workload: str
    strategy: str
    error: str | None = None
    step: Stats | None = None  # seconds per forward+backward step
    steps_per_sample: int | None = None
    ratio_vs_jax: float | None = None  # median step time / jax_fwd_and_bwd's
    ratio_vs_fused: float | None = None  # median step time / fused's
    saved: SavedBytes | None = None  # None for `fused`: one program saves nothing between calls
    memory: ProgramMemory | None = None  # XLA scratch and peak of each program
    build: BuildSeconds | None = None  # aotgrad only
    first_step_s: float | None = None  # first call: trace + compile + one step
    grad_error: float | None = None  # vs float32 jax.grad, see strategies.max_relative_error
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.error is None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine_info() -> dict[str, Any]:
    import jax
    out = {"platform": platform.platform(), "machine": platform.machine(), "cpu_model": _cpu_model(),
           "cpu_count": os.cpu_count(), "python": sys.version.split()[0]}
    devices = jax.devices()
    if devices[0].platform != "cpu":  # the accelerator the steps ran on, e.g. "NVIDIA H200"
        out["accelerator"] = f"{len(devices)} x {devices[0].device_kind}"
    return out


def versions() -> dict[str, str | None]:
    import jax
    import jaxlib
    import numpy

    import aotgrad
    out: dict[str, str | None] = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                                  "aotgrad": aotgrad.__version__, "numpy": numpy.__version__}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.__version__
    out["commit"] = SOURCE_COMMIT
    return out


def source_commit() -> str | None:
    """The repository's commit, with "+changes" when files were changed since (the numbers
    may come from code no commit holds); None outside a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=30)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "aotgrad",
                                  "benchmarks", "config"], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if changed.stdout.strip() else "")


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


# Read when a run starts (the runner imports this module first), not when it writes its
# file: the code a run measured is the code it loaded, and others may commit meanwhile.
SOURCE_COMMIT = source_commit()
