"""Sharded programs on 8 simulated CPU devices.

The cases live in `tests/sharded_cases.py`; they need
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX is imported, so they run
in a process of their own (one pytest run). A failure shows that run's report.
"""
from __future__ import annotations

import os

try:
    from tests.own_process import run_module
except ImportError:
    from own_process import run_module


def test_sharded_cases_on_8_devices():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    run_module("sharded_cases.py", env, "sharded cases")
