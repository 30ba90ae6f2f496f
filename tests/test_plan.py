"""`aotgrad.targets` and `aotgrad.plan` on this machine's CPU (jax 0.10.2 and later, no
compiler plugin needed). Where the CUDA compiler plugin is installed, `tests/plan_gpu_cases.py`
checks the same against a compile-only H100 (run by `test_gpu_target.py`)."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax
import pytest

from aotgrad import targets

ROOT = pathlib.Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- targets

def test_the_target_descriptions_ship_inside_the_package(tmp_path):
    """The package copied alone (no repository, no sibling folder) resolves every shipped GPU
    target from its own files: a fresh clone or an installed wheel has nothing else."""
    shutil.copytree(ROOT / "aotgrad", tmp_path / "aotgrad")
    code = textwrap.dedent("""
        import importlib.util, pathlib, aotgrad, aotgrad.targets as t
        assert pathlib.Path(aotgrad.__file__).parent == pathlib.Path.cwd() / "aotgrad", aotgrad.__file__
        assert "NVIDIA H100" in t.resolve("h100").description
        assert "NVIDIA A100" in t.resolve("a100").description
        if importlib.util.find_spec("jax_plugins") and importlib.util.find_spec("jax_plugins.xla_cuda12"):
            mesh = t.resolve("h100").mesh(2)
            assert [d.device_kind for d in mesh.devices.flat] == ["NVIDIA H100 80GB HBM3"] * 2
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_the_package_data_is_declared_for_the_wheel():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"aotgrad.targets" = ["*.txtpb"]' in text
    assert sorted(p.name for p in (ROOT / "aotgrad" / "targets").glob("*.txtpb")) == ["a100.txtpb", "h100.txtpb"]


def test_an_unknown_target_name_lists_the_known_ones():
    with pytest.raises(targets.TargetError, match=r"unknown target 'h200'; known: 'h100', 'a100', 'tpu-v5e', 'cpu'"):
        targets.resolve("h200")
    with pytest.raises(targets.TargetError, match="no target description file at 'missing/h100.txtpb'"):
        targets.resolve("missing/h100.txtpb")


def test_a_description_file_is_a_gpu_target(tmp_path):
    path = tmp_path / "mine.txtpb"
    path.write_text(targets.resolve("h100").description)
    target = targets.resolve(str(path))
    assert (target.name, target.platform, target.compile_only) == ("mine", "cuda", True)


def test_device_counts_the_target_does_not_have_are_refused():
    cpu = targets.resolve(None)
    assert cpu.name == "cpu" and not cpu.compile_only
    with pytest.raises(targets.TargetError, match=rf"devices={len(jax.devices('cpu')) + 1}: target cpu has"):
        cpu.mesh(len(jax.devices("cpu")) + 1)
    with pytest.raises(targets.TargetError, match="devices=12: a GPU target has up to 8 GPUs per host"):
        targets.resolve("h100").mesh(12)
    with pytest.raises(targets.TargetError, match="devices=3: target tpu-v5e is a square of chips"):
        targets.resolve("tpu-v5e").mesh(3)
    with pytest.raises(targets.TargetError, match="devices must be an int >= 1; got 0"):
        cpu.mesh(0)


def test_real_devices_are_a_target():
    target = targets.resolve(jax.devices("cpu")[:1])
    assert target.mesh(1).devices.flat[0] == jax.devices("cpu")[0]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # no parent package at all
        return False


@pytest.mark.skipif(_installed("jax_plugins.xla_cuda12"), reason="the CUDA compiler plugin is installed")
def test_a_missing_gpu_compiler_names_the_extra_to_install():
    with pytest.raises(targets.TargetUnavailable, match=r"pip install 'aotgrad\[gpu-target\]'"):
        targets.resolve("h100").mesh(1)


@pytest.mark.skipif(_installed("libtpu"), reason="libtpu is installed")
def test_a_missing_tpu_compiler_names_what_to_install():
    with pytest.raises(targets.TargetUnavailable, match=r"jax\[tpu\]"):
        targets.resolve("tpu-v5e").mesh(1)
