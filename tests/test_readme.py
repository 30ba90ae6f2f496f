"""The README works as written, from a fresh clone: a new virtual environment (no site
packages of this one) gets the README's own install line, `pip install -e .`, and each Python
block then runs in a process of its own, after the install command the README gives above it
(`pip install -e '.[export]'` before the export block). tests/test_docs.py runs the same
blocks here, in this environment, with every extra installed; this test is what catches a
block that needs a package its install line does not bring.

The repository is copied to a temporary directory first: installing writes build files
next to the sources, and the checkout stays as it was. Installs use pip's cache and the
configured indexes, as a user's pip does."""
from __future__ import annotations

import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from tests.test_docs import ROOT, fenced

README = ROOT / "README.md"
BUDGET_S = 900.0  # the whole test, on a loaded 2-core machine (quiet: about 2 minutes)
# What a user's shell would not have: this environment's own packages and interpreter.
CLEARED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")


def install_command(sh: str) -> str | None:
    """The `pip install ...` command of a shell block (before any `&&`), or None."""
    for line in sh.splitlines():
        first = line.split("&&")[0].strip()
        if first.startswith("pip install "):
            return first
    return None


def plan(readme: pathlib.Path) -> list[tuple[str, str]]:
    """(install command, Python block) for each Python block of `readme`, in order: the
    nearest `pip install` line above the block."""
    steps, install = [], None
    for language, text in fenced(readme):
        if language == "sh":
            install = install_command(text) or install
        elif language == "python":
            assert install is not None, f"{readme.name}: a Python block comes before any pip install line"
            steps.append((install, text))
    return steps


def test_the_plan_follows_the_readme() -> None:
    """The first block runs after the README's first install line, which installs no extra."""
    steps = plan(README)
    first_install = next(filter(None, (install_command(t) for lang, t in fenced(README) if lang == "sh")))
    assert steps and steps[0][0] == first_install == "pip install -e ."
    assert install_command("pip install -e '.[test]' && python -m pytest") == "pip install -e '.[test]'"


class _Clock:
    def __init__(self, budget: float) -> None:
        self.deadline = time.monotonic() + budget

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"the README's install and blocks took more than {BUDGET_S:.0f} s")
        return left


def _copy_checkout(dest: pathlib.Path) -> None:
    """The files a clone of the working tree would have (tracked, and new ones not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, timeout=120)
    if listed.returncode != 0:  # not a git checkout: everything but caches and build output
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
            ".git", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "build"))
        return
    for name in filter(None, listed.stdout.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _run(cmd: list[str], cwd: pathlib.Path, env: dict[str, str], clock: _Clock, what: str) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=clock.left())
    assert proc.returncode == 0, f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def test_readme_blocks_run_in_a_fresh_venv_after_its_install_lines(tmp_path: pathlib.Path) -> None:
    clock = _Clock(BUDGET_S)
    clone, venv = tmp_path / "aotgrad", tmp_path / "venv"
    _copy_checkout(clone)
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env, clock, "python -m venv")
    python = str(venv / ("Scripts" if os.name == "nt" else "bin") / "python")
    env["PATH"] = os.pathsep.join([str(pathlib.Path(python).parent), env.get("PATH", "")])

    installed = None
    for i, (install, block) in enumerate(plan(README)):
        if install != installed:
            args = shlex.split(install)[1:]  # "pip install -e ." -> python -m pip install -e .
            _run([python, "-m", "pip", *args, "--no-input", "-q"], clone, env, clock, f"`{install}`")
            installed = install
            if i == 0:
                _check_the_export_hint_without_flatbuffers(python, clone, env, clock)
        _run([python, "-c", block], clone, env, clock, f"README Python block {i} (after `{install}`):\n{block}")


HINT_PROBE = """
import importlib.util, jax.numpy as jnp, aotgrad
if importlib.util.find_spec("flatbuffers") is None:
    exported = aotgrad.export(aotgrad.compile(lambda x: jnp.sum(x ** 2)), jnp.ones(3))
    try:
        exported.serialize()
    except aotgrad.ExportError as e:
        print(e)
    else:
        raise AssertionError("serialize ran without flatbuffers")
"""


def _check_the_export_hint_without_flatbuffers(python: str, clone: pathlib.Path, env: dict[str, str],
                                               clock: _Clock) -> None:
    """Where the first install brings no flatbuffers, serialize's error says how to get it,
    from a clone too."""
    said = _run([python, "-c", HINT_PROBE], clone, env, clock, "serialize without flatbuffers")
    if said:
        assert "pip install 'aotgrad[export]'" in said and "pip install -e '.[export]'" in said, said
