"""Sharded programs on 8 simulated CPU devices.

The cases live in `tests/sharded_cases.py`; they need
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX is imported, so they run
in a process of their own (one pytest run). A failure shows that run's report.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def test_sharded_cases_on_8_devices():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(HERE / "sharded_cases.py"), "-p", "no:cacheprovider",
         "-rfE", "--tb=short", "-W", "ignore::DeprecationWarning"],
        capture_output=True, text=True, env=env, cwd=HERE.parent, timeout=900)
    report = proc.stdout[-12000:] + ("\n" + proc.stderr[-4000:] if proc.stderr.strip() else "")
    assert proc.returncode == 0, f"sharded cases failed (exit {proc.returncode}):\n{report}"
    assert " passed" in proc.stdout, report
