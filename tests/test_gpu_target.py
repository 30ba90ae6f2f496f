"""Steps compiled for a compile-only H100 target: the cases in `tests/gpu_target_cases.py`
(and `aotgrad.plan`'s in `tests/plan_gpu_cases.py`) run in a process of their own
(JAX_PLATFORMS=cpu before JAX is imported). Without the CUDA compiler plugin
(`pip install -e '.[gpu-target]'`) they are skipped; CI installs it."""
from __future__ import annotations

import importlib.util
import os

import pytest

try:
    from tests.own_process import run_module
except ImportError:
    from own_process import run_module


def _has_cuda_compiler() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


@pytest.mark.skipif(not _has_cuda_compiler(), reason="the CUDA compiler plugin: pip install -e '.[gpu-target]'")
def test_gpu_target_cases():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    # The cases compile GPT-2 small steps for the H100: 25 minutes in one process beside
    # another compile (2026-11-28), past 15 on pytest-xdist's workers in a CI run on a
    # loaded machine. The limit stops a hung run only.
    output = run_module("gpu_target_cases.py", env, "the H100 target cases", timeout=2700)
    assert " passed" in output or " skipped" in output


@pytest.mark.skipif(not _has_cuda_compiler(), reason="the CUDA compiler plugin: pip install -e '.[gpu-target]'")
def test_plan_gpu_cases():
    """`aotgrad.plan` against the compile-only H100 (`tests/plan_gpu_cases.py`): tiny models,
    about 5 minutes on 2 busy cores."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    output = run_module("plan_gpu_cases.py", env, "the H100 plan cases", timeout=1800)
    assert " passed" in output
