"""How pytest-xdist's workers share the suite (`-n auto --dist loadscope`, pyproject.toml).

xdist hands a free worker the next unit of work, in collection order. Here a unit is
(`Units`, in place of loadscope's one unit a module or class):
- each test of `LONG` alone, collected first, longest first, so that no worker is left
  running one alone while the other idles at the end of the run (on 2 cores that tail
  was minutes);
- the tests that read the one 8-device process's results
  (`own_process.assert_eight_device_module_passed`), together: one worker starts that
  process once, where two would start it twice;
- every other test module, whole: its module fixtures and caches are built once.

Without xdist (`-n 0`, `-p no:xdist`) only the order changes.
"""
from __future__ import annotations

import ast
import functools
import os
import pathlib

import pytest

# XLA's backend optimizations off for every program the tests compile (JAX's own switch for
# tests whose compiles outweigh their runs: LLVM at -O0, its expensive passes skipped): each
# XLA:CPU compile takes about a third less. XLA's buffer assignment and HLO cost analysis,
# which the tests assert, are the same either way (tests/test_compile_setting.py checks it).
# Set here, before any test module imports JAX, so subprocesses inherit it; the cases
# compiled for a compile-only H100 run with the defaults (tests/test_gpu_target.py).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "true")

HERE = pathlib.Path(__file__).resolve().parent

EIGHT_DEVICES = "eight_devices"  # the place in LONG of the tests that read the 8-device run
# Tests measured at a minute or more on a 2-core machine, longest first (2026-11-28; the plan's
# fit and the compile setting 2026-12-01, jax 0.10.2: 144 and 79 s; the byte budget's blends,
# 28 s since its ladder is built once, left the list on 2026-12-02).
# A test no longer here is simply not moved; a prefix matches every parameter of a test.
LONG = (
    "tests/test_fuzz.py::test_autocast_programs_match_a_hand_written_oracle",
    "tests/test_gpu_target.py::test_gpu_target_cases[",
    EIGHT_DEVICES,
    "tests/test_gpu_target.py::test_plan_gpu_cases",
    "tests/test_plan.py::test_fit_lands_just_under_the_limit_where_a_plan_does",
    "tests/test_compile_setting.py::test_xla_numbers_are_the_defaults_numbers",
    "tests/test_export.py::test_round_trip_in_a_fresh_process",
    "tests/test_fuzz.py::test_float64_programs_in_their_own_process",
    "tests/test_readme.py::test_readme_blocks_run_in_a_fresh_venv_after_its_install_lines",
    "tests/test_benchmark_workloads.py::test_checkpoint_strategies_lower_the_peak_of_a_scanned_model",
    "tests/test_scan_partition.py::test_scanned_gpt_checkpoints_carries_below_the_per_iteration_cut",
    "tests/test_threads.py::test_threads_match_single_threaded_and_caches_are_exact",
    "tests/test_schedule.py::test_unrolled_gpt_peak_falls_with_the_budget",
    "tests/test_scan_partition.py::test_scanned_model_saves_about_what_the_unrolled_one_saves",
    "tests/test_multihost.py::test_two_processes_match_jax",
)


@functools.cache
def _eight_device_readers() -> frozenset[str]:
    """The node ids ("tests/test_x.py::test_y") of the test functions that call
    `assert_eight_device_module_passed`, read from the sources (the controller collects no
    tests, and both it and the workers must agree)."""
    found = set()
    for path in sorted(HERE.glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id == "assert_eight_device_module_passed" for call in ast.walk(node)):
                found.add(f"tests/{path.name}::{node.name}")
    return frozenset(found)


def _function_id(nodeid: str) -> str:
    return nodeid.split("[", 1)[0]


def _rank(nodeid: str) -> int:
    """The test's place in `LONG`; len(LONG) for every other test."""
    if _function_id(nodeid) in _eight_device_readers():
        return LONG.index(EIGHT_DEVICES)
    return next((rank for rank, prefix in enumerate(LONG) if prefix != EIGHT_DEVICES and nodeid.startswith(prefix)),
                len(LONG))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: _rank(item.nodeid))  # stable: the rest as collected


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        """loadscope's scheduling over this module's units, in collection order."""

        def __init__(self, config: pytest.Config, log) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False  # xdist 3.6+ would put the largest units first

        def _split_scope(self, nodeid: str) -> str:
            rank = _rank(nodeid)
            if rank == LONG.index(EIGHT_DEVICES):
                return EIGHT_DEVICES
            return nodeid if rank < len(LONG) else nodeid.split("::", 1)[0]
    return Units(config, log)
