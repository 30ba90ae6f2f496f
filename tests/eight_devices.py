"""Imported first by a test module that runs in a process of its own (see `own_process.py`):
8 simulated CPU devices, which JAX reads only when it is first imported."""
import os
import sys

if "jax" in sys.modules:
    raise RuntimeError("a test module on 8 simulated devices must run in its own process, before JAX is imported")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
