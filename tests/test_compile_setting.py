"""The suite compiles with XLA's backend optimizations off (tests/conftest.py): that must not
change what the tests assert. XLA's peak (`memory_analysis()`), its HLO bytes accessed and
FLOPs of the fused step and of aotgrad's at budgets 0.5 and 0 (budget 1 under `jax.jit` is the
fused step's plan), on a GPT, a scanned GPT and a convnet: here, and in a process compiling with the defaults."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax

import aotgrad
from aotgrad._jax_internals import hlo_cost
from benchmarks import workloads
from benchmarks.strategies import xla_peak

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODELS = [("gpt", dict(batch=2, seq=32, d_model=32, heads=2, layers=2, vocab=64)),
          ("gpt_scan", dict(batch=2, seq=32, d_model=32, heads=2, layers=2, vocab=64)),
          ("convnet", dict(batch=4, image=16, channels=[4, 8], classes=10))]


def numbers() -> list[list[float]]:
    """Peak, bytes accessed and FLOPs of each model's steps, as compiled in this process."""
    found = []
    for kind, sizes in MODELS:
        w = workloads.build(kind, kind, sizes)
        for budget in (None, 0.5, 0.0):
            with aotgrad.config.patch(activation_memory_budget=1.0 if budget is None else budget):
                f = w.loss_fn if budget is None else aotgrad.compile(w.loss_fn)
                c = jax.jit(jax.value_and_grad(f)).lower(w.params, w.batch).compile()
            cost = hlo_cost(c)
            found.append([xla_peak(c.memory_analysis()), cost["bytes accessed"], cost["flops"]])
    return found


def _setting() -> bool:
    return bool(jax.config.read("jax_disable_most_optimizations"))


def test_xla_numbers_are_the_defaults_numbers():
    assert _setting()  # as tests/conftest.py sets it
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_DISABLE_MOST_OPTIMIZATIONS", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "-c", "import json, tests.test_compile_setting as t; "
                           "print(json.dumps([t._setting(), t.numbers()]))"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    setting, defaults = json.loads(proc.stdout.strip().splitlines()[-1])
    assert setting is False
    assert numbers() == defaults
