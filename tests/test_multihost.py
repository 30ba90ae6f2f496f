"""Multi-host: two processes joined by `jax.distributed`, 4 simulated CPU devices each.

The cases live in `tests/multihost_worker.py`, one copy per process (each must set its
device count before JAX is imported); this test starts them, waits, and shows both
processes' output on failure.
"""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
PROCESSES = 2
TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_match_jax(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["AOTGRAD_TEST_DEBUG_DIR"] = str(tmp_path)  # one directory for both processes
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "multihost_worker.py"), str(i), str(PROCESSES), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=HERE.parent)
             for i in range(PROCESSES)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:  # one process failing leaves the other waiting on a collective
            p.kill()
    report = "\n".join(f"--- process {i} (exit {p.returncode}):\n{out[-6000:]}"
                       for i, (p, out) in enumerate(zip(procs, outputs)))
    assert all(p.returncode == 0 for p in procs), report
    for i, out in enumerate(outputs):
        assert f"ok {i} " in out, report


def test_import_does_not_start_the_backend():
    """`jax.distributed.initialize` must run before the backend starts: importing aotgrad
    (before or after it) must not start it."""
    code = ("import jax._src.xla_bridge as xb, aotgrad, aotgrad.partition, aotgrad.autocast\n"
            "assert not xb.backends_are_initialized(), 'importing aotgrad started the backend'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
