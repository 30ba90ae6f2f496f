"""Sharded programs on 8 simulated CPU devices.

The cases live in `tests/sharded_cases.py`; they need
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX is imported, so they run
in a process of their own, shared with the other 8-device modules (`own_process.py`). A
failure names each failed case of `sharded_cases.py` by its test id, with its traceback.
"""
from __future__ import annotations

try:
    from tests.own_process import assert_eight_device_module_passed
except ImportError:
    from own_process import assert_eight_device_module_passed


def test_sharded_cases_on_8_devices():
    assert_eight_device_module_passed("sharded_cases.py")
