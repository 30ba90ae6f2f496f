"""Export and load of programs over 8 simulated CPU devices; run by tests/test_export.py in
a process of its own (``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set
before JAX is imported). Run alone with ``python -m pytest tests/export_sharded_cases.py``.

A data-parallel and a tensor-parallel MLP, exported from sharded arrays or from
`jax.ShapeDtypeStruct`s with shardings, serialized and loaded: values and gradients
bit-identical to the `aotgrad.compile`d function on the same inputs, close to
`jax.value_and_grad`, and gradients with their inputs' shardings.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
import eight_devices  # noqa: E402,F401  (before JAX: 8 simulated devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import aotgrad  # noqa: E402

from partition_configs import config_id, partitioner_configs  # noqa: E402

CONFIGS = partitioner_configs(budgets=(0.0, 1.0))


def _mlp(p, x, y):
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def _inputs(layout: str):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    k = jax.random.split(jax.random.key(0), 5)
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    model = "model" if layout == "tensor" else None
    p = {"w1": put(jax.random.normal(k[0], (16, 64)) * 0.3, None, model),
         "b1": put(jax.random.normal(k[1], (64,)) * 0.1, model),
         "w2": put(jax.random.normal(k[2], (64, 8)) * 0.3, model, None)}
    return p, put(jax.random.normal(k[3], (32, 16)), "data", None), put(jax.random.normal(k[4], (32, 8)), "data", None)


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def test_eight_devices():
    assert jax.device_count() == 8


@pytest.mark.parametrize("layout, specs", [("data", False), ("tensor", True)],
                         ids=["data_parallel-arrays", "tensor_parallel-shape_dtype_structs"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_sharded_round_trip(config, specs, layout):
    args = _inputs(layout)
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), args) if specs else args
    with aotgrad.config.patch(**config):
        compiled = aotgrad.compile(_mlp)
        blob = aotgrad.export(compiled, *like, argnums=0).serialize()
        want = jax.value_and_grad(compiled)(*args)
    loaded = aotgrad.deserialize(blob)
    got = jax.value_and_grad(loaded)(*args)
    assert _bits(got) == _bits(want)
    ref = jax.jit(jax.value_and_grad(_mlp))(*args)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=1e-6)
    for g, x in zip(jax.tree.leaves(got[1]), jax.tree.leaves(args[0])):
        assert g.sharding.is_equivalent_to(x.sharding, x.ndim), (g.sharding, x.sharding)
    step = jax.jit(jax.value_and_grad(loaded))(*args)
    assert _bits(step) == _bits(jax.jit(jax.value_and_grad(compiled))(*args))


_LOAD = """
import sys, hashlib, jax, numpy as np, aotgrad
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
loaded = aotgrad.deserialize(open(sys.argv[1], "rb").read())
mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
leaves = [np.load(f) for f in sys.argv[2:]]
specs = [P()] * 3 + [P("data", None)] * 2  # params replicated, batch split
args = jax.tree.unflatten(loaded.in_tree, [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(leaves, specs)])[0]
print(hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(jax.value_and_grad(loaded)(*args)))).hexdigest())
"""


def _load_elsewhere(tmp_path, blob: bytes, args, devices: int) -> subprocess.CompletedProcess:
    """Loads `blob` in a new process with `devices` CPU devices and prints a digest of its
    value and gradients for `args`."""
    (tmp_path / "f.aotgrad").write_bytes(blob)
    files = []
    for i, x in enumerate(jax.tree.leaves(args)):
        files.append(str(tmp_path / f"{i}.npy"))
        np.save(files[-1], np.asarray(x))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run([sys.executable, "-c", _LOAD, str(tmp_path / "f.aotgrad"), *files],
                          capture_output=True, text=True, env=env, timeout=600)


def test_load_in_another_process(tmp_path):
    """Exported here, loaded by a new 8-device process (bit-identical), refused by a
    1-device one with an error that says why."""
    args = _inputs("data")
    compiled = aotgrad.compile(_mlp)
    blob = aotgrad.export(compiled, *args, argnums=0).serialize()
    want = hashlib.sha256(b"".join(_bits(jax.value_and_grad(compiled)(*args)))).hexdigest()
    same = _load_elsewhere(tmp_path, blob, args, 8)
    assert same.returncode == 0 and same.stdout.strip() == want, same.stdout + same.stderr[-3000:]
    fewer = _load_elsewhere(tmp_path, blob, args, 1)
    assert fewer.returncode != 0
    assert "exported for 8 devices; this process has 1" in fewer.stderr, fewer.stderr[-3000:]
