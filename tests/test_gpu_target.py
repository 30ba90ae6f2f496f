"""Steps compiled for a compile-only H100 target: the cases in `tests/gpu_target_cases.py`
(and `aotgrad.plan`'s in `tests/plan_gpu_cases.py`) run in processes of their own
(JAX_PLATFORMS=cpu before JAX is imported). Without the CUDA compiler plugin
(`pip install -e '.[gpu-target]'`) they are skipped; CI installs it.

Each compile for the H100 takes 10-30 s of a core whatever the model's size, so the cases
are split into groups (`GROUPS`) of about equal time, each run serially in one process by a
test of its own, which pytest-xdist hands to any free worker. A group holds the cases that
compile the same steps: a process compiles each distinct program once
(`gpu_target_cases._compile`)."""
from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent

# The cases of tests/gpu_target_cases.py by process. Cases that share compiled steps are in
# one group (the GPT at GPT-2 small's widths; the tiny GPT of `h100_args`; the batch-32 GPT
# of the low budgets and the row reductions). Measured serially on a loaded 2-core machine,
# 2026-12-02 (jax 0.12.0.1): 10-18 minutes each, "small" about 3.
GROUPS = {
    "gpt2_widths": [
        "test_budget_zero_checkpoints_each_layer_once_at_gpt2_widths",
        "test_budget_zero_keeps_the_loss_head_as_nothing_saveable_does",
        "test_the_peak_falls_with_the_budget_at_gpt2_widths",
        "test_a_budget_meets_dots_with_no_batch_dims_saveable_at_gpt2_widths",
        "test_a_budget_meets_dots_saveable_at_gpt2_widths",
    ],
    "eight_devices": [
        "test_data_parallel_weight_gradients_do_not_wait_for_their_collective",
        "test_sharded_bias_and_tied_weight_gradients_do_not_wait_for_their_collective",
        "test_sharded_weights_are_gathered_again_for_the_backward",
    ],
    "vit_convnet": [
        "test_candidates_are_ranked_by_the_steps_traffic_on_the_h100",
        "test_cheap_elementwise_work_is_counted_where_xla_gpu_writes_it",
        "test_library_calls_are_counted_on_the_h100",
    ],
    "gpt_heads_scan": [
        "test_a_jitted_step_frees_the_kept_head_where_a_layers_backward_peaks",
        "test_a_budget_meets_dots_with_no_batch_dims_saveable_on_a_scanned_gpt",
        "test_a_scans_backward_waits_for_the_weight_gradients_before_it",
        "test_the_loss_head_does_not_wait_on_the_h100",
    ],
    "small": [
        "test_the_h100_step_waits_through_barriers_the_host_step_through_data",
        "test_the_default_moves_the_fused_steps_bytes_on_the_h100",
        "test_the_target_benchmark_reports_xla_numbers_for_every_strategy",
        "test_the_target_command_runs_budgets_it_does_not_list_and_writes_json",
        "test_recomputation_moves_no_more_bytes_than_a_checkpoint_policy",
        "test_an_a100_target_compiles_and_is_decided_for_the_a100",
        "test_saving_inside_a_softmax_costs_a_read_of_its_row_on_the_h100",
        "test_a_scans_stacks_are_counted_at_the_rows_written_on_the_h100",
    ],
    "small_more": [
        "test_the_h100_step_peak_is_at_most_the_fused_steps",
        "test_explain_reports_the_programs_compiled_for_the_target",
        "test_the_low_budgets_peak_falls_below_nothing_saveable_on_the_h100",
        "test_row_reductions_priced_as_fused_move_fewer_bytes_on_the_h100",
        "test_moved_recomputation_is_computed_where_it_is_read_on_the_h100",
        "test_a_fused_kernel_holds_what_it_reads_on_the_h100",
        "test_a_budget_meets_dots_saveable_on_a_held_out_stack",
    ],
}
# The groups every run of the suite compiles (about 3 minutes of a core, 2026-12-02). The
# others hold the H100's memory and traffic claims on GPT-2-sized models, about 70 minutes of
# a core in all on a 2-core machine: they run where ALL_CASES is set in the environment
# (`AOTGRAD_TARGET_CASES=all python -m pytest tests/test_gpu_target.py`), as before a
# change to the partitioner, the schedule or the device profiles lands, and each time the
# results files under docs/results are rerun.
EVERY_RUN = ("small",)
ALL_CASES = "AOTGRAD_TARGET_CASES"


def _has_cuda_compiler() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


needs_cuda_compiler = pytest.mark.skipif(not _has_cuda_compiler(),
                                         reason="the CUDA compiler plugin: pip install -e '.[gpu-target]'")


def _cases_of(module: str) -> list[str]:
    """The test functions `tests/<module>` defines, read from its source (importing it here
    would import JAX with the plugin)."""
    tree = ast.parse((HERE / module).read_text())
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]


def _run_serially(paths: list[str], what: str, timeout: float) -> str:
    """`pytest paths` in one process (no xdist workers of its own: the cases of a group
    share its compiled steps), JAX_PLATFORMS=cpu; asserts that every case collected passed
    and returns the output."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)  # XLA:GPU as users run it (tests/conftest.py)
    proc = subprocess.run([sys.executable, "-m", "pytest", *paths, "-n", "0", "-p", "no:cacheprovider", "-rfEs",
                           "--tb=short", "-W", "ignore::DeprecationWarning"],
                          capture_output=True, text=True, env=env, cwd=HERE.parent, timeout=timeout)
    report = proc.stdout[-12000:] + ("\n" + proc.stderr[-4000:] if proc.stderr.strip() else "")
    assert proc.returncode == 0, f"{what} failed (exit {proc.returncode}):\n{report}"
    summary = re.search(r"(\d+) passed", proc.stdout)
    assert summary and not re.search(r"\d+ (skipped|deselected)", proc.stdout), report
    return report


def test_every_gpu_target_case_is_in_one_group():
    """A case added to tests/gpu_target_cases.py runs only once it is in a group."""
    grouped = [name for names in GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(set(grouped)), "a case in two groups"
    assert set(grouped) == set(_cases_of("gpu_target_cases.py"))


@needs_cuda_compiler
@pytest.mark.parametrize("group", list(GROUPS))
def test_gpu_target_cases(group):
    if group not in EVERY_RUN and os.environ.get(ALL_CASES) != "all":
        pytest.skip(f"the {group} cases run with {ALL_CASES}=all")
    # The limit stops a hung run only (a group takes up to 18 minutes serially on a loaded
    # 2-core machine).
    names = GROUPS[group]
    output = _run_serially([f"tests/gpu_target_cases.py::{name}" for name in names],
                           f"the H100 target cases ({group})", timeout=3600)
    assert f"{len(names)} passed" in output, output


@needs_cuda_compiler
def test_plan_gpu_cases():
    """`aotgrad.plan` against the compile-only H100 (`tests/plan_gpu_cases.py`): tiny models,
    about 2 minutes on 2 busy cores."""
    _run_serially(["tests/plan_gpu_cases.py"], "the H100 plan cases", timeout=1800)
