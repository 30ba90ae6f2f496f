"""aotgrad.config: validation, patch semantics, threads, environment defaults, cache keys."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad
from aotgrad.autocast.context import AutocastArgs
from aotgrad.config import ConfigError, Snapshot


def test_defaults():
    assert aotgrad.config.partitioner == "min_cut"
    assert aotgrad.config.backward_pass_autocast == "same_as_forward"
    assert aotgrad.config.cache_size_limit >= 1
    assert aotgrad.config.log_recompiles is False
    assert aotgrad.config.debug_dir is None


def test_unknown_option_lists_valid_names():
    with pytest.raises(ConfigError, match=r"no option 'partitionr'.*'partitioner'"):
        aotgrad.config.partitionr = "vjp"
    with pytest.raises(ConfigError, match="no option 'nope'"):
        aotgrad.config.patch(nope=1)
    with pytest.raises(ConfigError, match="no option"):
        _ = aotgrad.config.nope


@pytest.mark.parametrize("name, value, message", [
    ("partitioner", "fastest", r"must be one of \['vjp'"),
    ("partitioner", 3, "must be one of"),
    ("cache_size_limit", 0, "integer >= 1"),
    ("cache_size_limit", "8", "integer >= 1"),
    ("cache_size_limit", True, "integer >= 1"),
    ("log_recompiles", "yes", "True or False"),
    ("debug_dir", 5, "directory path or None"),
    ("backward_pass_autocast", "on", "'same_as_forward', 'off'"),
    ("backward_pass_autocast", {"dtype": "float32"}, r"\['dtype'\]: dtype must be jnp.float16 or jnp.bfloat16.*'float32'"),
    ("backward_pass_autocast", {"device_type": "npu"}, r"\['device_type'\]: device_type must be one of.*'npu'"),
    ("backward_pass_autocast", {"dtyp": "float16"}, r"unknown keys \['dtyp'\]"),
    ("backward_pass_autocast", {"enabled": 1}, r"\['enabled'\] must be True or False"),
    ("backward_pass_autocast", {"promotion": "numpy"}, r"\['promotion'\]: promotion must be one of \['jax', 'torch'\]"),
    ("backward_pass_autocast", [], "non-empty list"),
    ("backward_pass_autocast", [{"dtype": "bfloat16"}, "off"], r"\[1\] must be a dict"),
])
def test_bad_values_name_option_and_choices(name, value, message):
    before = getattr(aotgrad.config, name)
    with pytest.raises(ConfigError, match=message):
        setattr(aotgrad.config, name, value)
    with pytest.raises(ConfigError, match=message):
        aotgrad.config.patch(**{name: value})
    assert getattr(aotgrad.config, name) == before


def test_backward_pass_autocast_accepts_and_normalizes():
    with aotgrad.config.patch(backward_pass_autocast={"device_type": "cuda", "dtype": jnp.float16}):
        value = aotgrad.config.backward_pass_autocast
        assert value == (AutocastArgs(device_type="gpu", dtype="float16", enabled=True),)
    with aotgrad.config.patch(backward_pass_autocast=[{"dtype": "bfloat16"}, {"enabled": False}]):
        assert len(aotgrad.config.backward_pass_autocast) == 2
    with aotgrad.config.patch(backward_pass_autocast="off"):
        assert aotgrad.config.backward_pass_autocast == "off"


def test_snapshot_has_one_typed_field_per_option():
    snap = aotgrad.config.snapshot()
    assert isinstance(snap, Snapshot)
    assert [f.name for f in dataclasses.fields(Snapshot)] == list(aotgrad.config.options())
    with aotgrad.config.patch(partitioner="vjp", activation_memory_budget="1GB", cache_size_limit=3,
                              backward_pass_autocast={"dtype": jnp.bfloat16}):
        snap = aotgrad.config.snapshot()
    assert (snap.partitioner, snap.activation_memory_budget.n, snap.cache_size_limit) == ("vjp", 10 ** 9, 3)
    assert snap.backward_pass_autocast == (AutocastArgs(dtype="bfloat16"),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.partitioner = "min_cut"
    # The keyed part is hashable and equal when the options are; an export records plain values.
    assert hash(snap.key) == hash(dataclasses.replace(snap, cache_size_limit=5).key)
    assert snap.as_dict()["backward_pass_autocast"] == ((("device_type", None), ("dtype", "bfloat16"),
                                                         ("enabled", True), ("promotion", None)),)
    # A value read back from a snapshot is accepted again as it is.
    with aotgrad.config.patch(backward_pass_autocast=snap.backward_pass_autocast):
        assert aotgrad.config.backward_pass_autocast == snap.backward_pass_autocast


def test_patch_nests_and_restores_on_exception():
    assert aotgrad.config.cache_size_limit == 64
    with aotgrad.config.patch(cache_size_limit=3):
        assert aotgrad.config.cache_size_limit == 3
        with pytest.raises(RuntimeError):
            with aotgrad.config.patch(cache_size_limit=5, log_recompiles=True):
                assert aotgrad.config.cache_size_limit == 5
                assert aotgrad.config.log_recompiles is True
                raise RuntimeError("boom")
        assert aotgrad.config.cache_size_limit == 3
        assert aotgrad.config.log_recompiles is False
    assert aotgrad.config.cache_size_limit == 64


def test_patch_as_decorator_reentrant():
    seen = []

    @aotgrad.config.patch(cache_size_limit=7)
    def inner(depth):
        seen.append(aotgrad.config.cache_size_limit)
        if depth:
            inner(depth - 1)
        return aotgrad.config.cache_size_limit

    assert inner(2) == 7
    assert seen == [7, 7, 7]
    assert aotgrad.config.cache_size_limit == 64


def test_global_assignment_and_patch_override():
    try:
        aotgrad.config.cache_size_limit = 11
        assert aotgrad.config.cache_size_limit == 11
        with aotgrad.config.patch(cache_size_limit=2):
            assert aotgrad.config.cache_size_limit == 2
        assert aotgrad.config.cache_size_limit == 11
    finally:
        aotgrad.config.cache_size_limit = 64


def test_patch_is_per_thread():
    barrier = threading.Barrier(2)
    seen = {}

    def worker(limit):
        with aotgrad.config.patch(cache_size_limit=limit):
            barrier.wait()
            seen[limit] = aotgrad.config.cache_size_limit
            barrier.wait()

    threads = [threading.Thread(target=worker, args=(n,)) for n in (3, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {3: 3, 9: 9}
    assert aotgrad.config.cache_size_limit == 64


def test_environment_sets_defaults():
    code = ("import aotgrad; c = aotgrad.config; "
            "print(c.cache_size_limit, c.log_recompiles, c.backward_pass_autocast)")
    env = dict(os.environ, AOTGRAD_CACHE_SIZE_LIMIT="5", AOTGRAD_LOG_RECOMPILES="1",
               AOTGRAD_BACKWARD_PASS_AUTOCAST="off")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["5", "True", "off"]


def test_environment_budget_is_a_fraction_or_a_byte_size():
    """AOTGRAD_ACTIVATION_MEMORY_BUDGET as text: "0.5" a fraction, "1" the fraction 1, a whole
    number above 1 a byte count (as the int or the string would be: "1e9" too), "12GB" a size
    (a plain byte count was once read as a float and refused)."""
    code = "import aotgrad; print(repr(aotgrad.config.activation_memory_budget))"
    seen = []
    for text in ("0.5", "1", "2000000000", "1e9", "12GB"):
        env = dict(os.environ, AOTGRAD_ACTIVATION_MEMORY_BUDGET=text)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        seen.append(out.stdout.strip())
    assert seen == ["0.5", "1.0", "Bytes(n=2000000000)", "Bytes(n=1000000000)", "Bytes(n=12000000000)"]


def test_bad_environment_value_names_the_variable():
    env = dict(os.environ, AOTGRAD_PARTITIONER="fastest")
    out = subprocess.run([sys.executable, "-c", "import aotgrad"], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "AOTGRAD_PARTITIONER='fastest'" in out.stderr


def test_changing_a_keyed_option_builds_new_programs():
    @aotgrad.compile
    def f(x):
        return jnp.sum(jnp.sin(x) ** 2)

    x = jnp.linspace(0.0, 1.0, 5)
    g1 = jax.grad(f)(x)
    with aotgrad.config.patch(backward_pass_autocast="off"):
        g2 = jax.grad(f)(x)
    g3 = jax.grad(f)(x)
    info = f.cache_info()
    assert info.entries == 2  # one per backward_pass_autocast value
    assert info.misses == 2 and info.hits == 1
    want = jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(x)
    for g in (g1, g2, g3):
        np.testing.assert_allclose(g, want, rtol=1e-6)


def test_unkeyed_option_does_not_recompile():
    f = aotgrad.compile(lambda x: x * 2.0)
    x = jnp.ones(3)
    f(x)
    with aotgrad.config.patch(log_recompiles=True, cache_size_limit=10):
        f(x)
    assert f.cache_info().entries == 1
    assert f.cache_info().misses == 1


def test_a_registered_partitioner_is_a_partitioner_choice():
    """register_partitioner's strategy is what `partitioner=name` runs: one that saves only
    the inputs recomputes every forward value, and gradients stay JAX's. The registry is
    read through `partitioners()`, and a name is taken once."""
    def inputs_only(graph, budget):
        return {v: "input" for v in graph.inputs}

    registration = aotgrad.register_partitioner("inputs_only", inputs_only)
    try:
        assert aotgrad.partitioners()[-1] == "inputs_only"
        f = aotgrad.compile(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2))
        w, x = jnp.full((8, 8), 0.1), jnp.arange(32.0).reshape(4, 8) / 32
        with aotgrad.config.patch(partitioner="inputs_only"):
            report = aotgrad.explain(f, w, x)
            got = jax.grad(f)(w, x)
        assert report.saved_bytes == 0 and report.partitioner == "inputs_only"
        np.testing.assert_allclose(got, jax.grad(f.__wrapped__)(w, x), rtol=1e-6)
        with pytest.raises(ValueError, match="'inputs_only' is already registered"):
            aotgrad.register_partitioner("inputs_only", inputs_only)
    finally:
        registration.remove()
    assert "inputs_only" not in aotgrad.partitioners()
    with pytest.raises(aotgrad.ConfigError, match="must be one of"):
        aotgrad.config.patch(partitioner="inputs_only")
    with pytest.raises(TypeError, match="strategy must be callable"):
        aotgrad.register_partitioner("bad", 3)
    with pytest.raises(ValueError, match="name must be an identifier"):
        aotgrad.register_partitioner("no spaces", inputs_only)
