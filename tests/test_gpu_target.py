"""Steps compiled for a compile-only H100 target: the cases in `tests/gpu_target_cases.py`
run in a process of their own (JAX_PLATFORMS=cpu before JAX is imported). Without the CUDA
compiler plugin (`pip install -e '.[gpu-target]'`) they are skipped; CI installs it."""
from __future__ import annotations

import os

try:
    from tests.own_process import run_module
except ImportError:
    from own_process import run_module


def test_gpu_target_cases():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    output = run_module("gpu_target_cases.py", env, "the H100 target cases")
    assert " passed" in output or " skipped" in output
