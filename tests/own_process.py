"""Running test modules in a process of their own, for modules that must configure JAX
before it is imported (device count, x64).

The modules on 8 simulated CPU devices (`EIGHT_DEVICE_MODULES`) share ONE such process:
it pays JAX's import and the 8-device backend once. Each module's wrapper test
(`assert_eight_device_module_passed`) reports the cases of its own module that failed,
by their test ids, with their tracebacks.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

HERE = pathlib.Path(__file__).resolve().parent

# Run by tests/test_sharding.py, tests/test_export.py and tests/test_hooks.py, in one process.
EIGHT_DEVICE_MODULES = ("sharded_cases.py", "export_sharded_cases.py", "hooks_sharded_cases.py")


def _pytest(paths: list[str], env: dict[str, str], timeout: float | None,
            *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", *paths, "-p", "no:cacheprovider",
         "-rfE", "--tb=short", "-W", "ignore::DeprecationWarning", *extra],
        capture_output=True, text=True, env=env, cwd=HERE.parent, timeout=timeout)


def _report(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout[-12000:] + ("\n" + proc.stderr[-4000:] if proc.stderr.strip() else "")


def run_module(name: str, env: dict[str, str], what: str, timeout: float | None = 900) -> str:
    """Runs `pytest tests/<name>` under `env`; asserts it passed (a failure shows that run's
    report) and returns its output."""
    proc = _pytest([str(HERE / name)], env, timeout)
    report = _report(proc)
    assert proc.returncode == 0, f"{what} failed (exit {proc.returncode}):\n{report}"
    assert " passed" in proc.stdout, report
    return report


# ----------------------------------------------------------------------------- one 8-device process

@dataclasses.dataclass(frozen=True)
class Case:
    """One test case of the shared run, as its JUnit XML record gives it."""
    module: str  # file name, e.g. "sharded_cases.py"
    test_id: str  # e.g. "tests/sharded_cases.py::test_saved_values_stay_sharded[min_cut@0]"
    outcome: str  # "passed", "failed", "error" or "skipped"
    text: str  # the traceback or skip reason; "" when it passed


@dataclasses.dataclass(frozen=True)
class Run:
    returncode: int
    cases: tuple[Case, ...]
    report: str  # the tail of the run's output


def _cases(xml_path: pathlib.Path) -> tuple[Case, ...]:
    if not xml_path.exists():
        return ()
    out = []
    for tc in ET.parse(xml_path).getroot().iter("testcase"):
        # classname "tests.sharded_cases" (or "sharded_cases"), name "test_x[param]"
        module = tc.get("classname", "").rsplit(".", 1)[-1] + ".py"
        outcome, text = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag if child.tag != "failure" else "failed"
                text = (child.get("message") or "") + "\n" + (child.text or "")
                break
        out.append(Case(module, f"tests/{module}::{tc.get('name')}", outcome, text.strip()))
    return tuple(out)


@functools.cache
def eight_device_run() -> Run:
    """Runs every module of `EIGHT_DEVICE_MODULES` in one pytest process with 8 simulated
    CPU devices (each module imports `eight_devices` first); once per test session."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = pathlib.Path(tmp) / "cases.xml"
        proc = _pytest([str(HERE / m) for m in EIGHT_DEVICE_MODULES], env, 900, f"--junitxml={xml_path}")
        return Run(proc.returncode, _cases(xml_path), _report(proc))


def assert_eight_device_module_passed(name: str) -> None:
    """Asserts that every case of `tests/<name>` passed in the shared 8-device run; a
    failure names each failed case by its test id, with its traceback."""
    run = eight_device_run()
    cases = [c for c in run.cases if c.module == name]
    assert cases, f"no case of tests/{name} ran in the 8-device process (exit {run.returncode}):\n{run.report}"
    failed = [c for c in cases if c.outcome in ("failed", "error")]
    assert not failed, (f"{len(failed)} of {len(cases)} cases of tests/{name} failed on 8 devices:\n\n"
                        + "\n\n".join(f"{c.test_id} {c.outcome.upper()}:\n{c.text[-4000:]}" for c in failed))
    assert any(c.outcome == "passed" for c in cases), f"every case of tests/{name} skipped:\n{run.report}"
    assert run.returncode in (0, 1), f"the 8-device process failed (exit {run.returncode}):\n{run.report}"
