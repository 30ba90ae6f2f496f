"""Running a test module in a process of its own, for modules that must configure JAX
before it is imported (device count, x64)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def run_module(name: str, env: dict[str, str], what: str, timeout: float | None = 900) -> str:
    """Runs `pytest tests/<name>` under `env`; asserts it passed (a failure shows that run's
    report) and returns its output."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(HERE / name), "-p", "no:cacheprovider",
         "-rfE", "--tb=short", "-W", "ignore::DeprecationWarning"],
        capture_output=True, text=True, env=env, cwd=HERE.parent, timeout=timeout)
    report = proc.stdout[-12000:] + ("\n" + proc.stderr[-4000:] if proc.stderr.strip() else "")
    assert proc.returncode == 0, f"{what} failed (exit {proc.returncode}):\n{report}"
    assert " passed" in proc.stdout, report
    return report
