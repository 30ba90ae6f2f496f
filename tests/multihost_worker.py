"""One process of the multi-host test (tests/test_multihost.py starts two of them).

    python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES COORDINATOR_PORT

Each process owns 4 simulated CPU devices; `jax.distributed` joins them into one 8-device
system, and every global array spans both processes. On the same global inputs, under every
registered partitioner, aotgrad must equal JAX:
  - a data-parallel MLP step (batch over all 8 devices, parameters replicated) and a
    tensor-parallel one (`shard_map` with `psum` over a "model" axis inside each process, the
    batch split across processes): value, gradients and updated parameters;
  - gradients keep the parameters' shardings, and saved activations stay split over the
    batch (never gathered onto one process);
  - anomaly mode raises in every process, and `debug_dir` files are written per process.
Arrays here are not fully addressable, so each process compares the shards it holds.
Prints "ok <process id> <checks>" on success; any failure raises (exit status 1).
"""
from __future__ import annotations

import os
import sys

LOCAL_DEVICES = 4
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={LOCAL_DEVICES}")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import aotgrad  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from partition_configs import config_id, partitioner_configs  # noqa: E402

CONFIGS = partitioner_configs(budgets=(0.0, 1.0))
BATCH = 32


def _global(mesh: jax.sharding.Mesh, value: np.ndarray, *spec) -> jax.Array:
    """A global array from data every process knows; each process supplies its own shards."""
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, P(*spec)), lambda idx: value[idx])


def _data(seed: int, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def assert_close(got, want, what: str, rtol: float = 2e-5) -> None:
    """Shard by shard (this process's shards), normwise relative to the whole leaf's largest entry."""
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    for k, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}[{k}]"
        assert g.sharding.is_equivalent_to(w.sharding, w.ndim), f"{what}[{k}]: {g.sharding} vs {w.sharding}"
        scale = max(float(jnp.max(jnp.abs(w))), 1e-30)  # a jitted global reduction, replicated
        for gs, ws in zip(g.addressable_shards, w.addressable_shards):
            assert gs.index == ws.index
            err = float(np.max(np.abs(np.asarray(gs.data, np.float64) - np.asarray(ws.data, np.float64)),
                               initial=0.0))
            assert err <= rtol * scale, f"{what}[{k}] shard {gs.index}: error {err:.3g} > {rtol} * {scale:.3g}"


def _mlp(p, x, y):
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def _tp_mlp(p, x, y):
    """Megatron-style: w1 split by columns, w2 by rows, one psum over "model" per layer pair."""
    def body(w1, b1, w2, x, y):
        out = lax.psum(jax.nn.gelu(x @ w1 + b1) @ w2, "model")
        return lax.pmean(jnp.mean((out - y) ** 2), "data")
    return jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(),
                         in_specs=(P(None, "model"), P("model"), P("model", None), P("data", None), P("data", None)),
                         out_specs=P())(p["w1"], p["b1"], p["w2"], x, y)


def _params(mesh, tensor_parallel: bool):
    w1, b1, w2 = _data(0, 16, 64, scale=0.3), _data(1, 64, scale=0.1), _data(2, 64, 8, scale=0.3)
    if tensor_parallel:
        return {"w1": _global(mesh, w1, None, "model"), "b1": _global(mesh, b1, "model"),
                "w2": _global(mesh, w2, "model", None)}
    return {"w1": _global(mesh, w1), "b1": _global(mesh, b1), "w2": _global(mesh, w2)}


def _sgd_step(loss):
    def step(p, x, y):
        value, grads = jax.value_and_grad(loss)(p, x, y)
        return value, grads, jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)
    return jax.jit(step)


def check_step(loss, mesh, batch_spec, tensor_parallel: bool, config: dict) -> None:
    what = f"{loss.__name__} {config_id(config)}"
    p = _params(mesh, tensor_parallel)
    x, y = _global(mesh, _data(7, BATCH, 16), batch_spec, None), _global(mesh, _data(8, BATCH, 8), batch_spec, None)
    with jax.set_mesh(mesh), aotgrad.config.patch(**config):
        want = _sgd_step(loss)(p, x, y)
        got = _sgd_step(aotgrad.compile(loss))(p, x, y)
        assert_close(got, want, what + " jit step")
        eager = jax.value_and_grad(aotgrad.compile(loss))(p, x, y)  # the two programs, called one by one
        assert_close(eager, want[:2], what + " value_and_grad")
        fwd, bwd = aotgrad.fwd_and_bwd(loss, argnums=0)
        out, saved = fwd(p, x, y)
        grads = bwd(saved, jnp.ones_like(out))
        assert_close((out, grads), want[:2], what + " fwd_and_bwd")
    for a in saved.arrays[:len(saved.pair.split.activations)]:
        assert len(a.sharding.device_set) == 8, (what, a.sharding)
        if a.ndim and a.shape[0] == BATCH:  # batch-major activations stay split across processes
            assert not a.is_fully_addressable, (what, a.shape, a.sharding)
            assert a.sharding.shard_shape(a.shape)[0] < BATCH, (what, a.shape, a.sharding)


def check_debug_dir(mesh, process_id: int) -> None:
    """Each process dumps its own files, even into a directory the processes share."""
    directory = os.environ["AOTGRAD_TEST_DEBUG_DIR"]
    p = _params(mesh, False)
    x, y = _global(mesh, _data(7, BATCH, 16), "data", None), _global(mesh, _data(8, BATCH, 8), "data", None)
    with jax.set_mesh(mesh), aotgrad.config.patch(debug_dir=directory):
        jax.grad(aotgrad.compile(_mlp))(p, x, y)
    mine = [f for f in os.listdir(directory) if f".process{process_id}." in f]
    assert any(f.endswith(".backward.jaxpr") for f in mine), sorted(os.listdir(directory))


def _masked_log(p, x, y):
    """The gradient at x == 0 is NaN (as in JAX): anomaly mode must say where it came from."""
    return jnp.sum(jnp.where(x > 0, jnp.log(x), 0.0) @ p["w1"]) + jnp.sum(y)


def check_anomaly_mode(mesh) -> None:
    """Anomaly checks read a replicated vector of codes, which every process can read."""
    p = _params(mesh, False)
    x, y = _global(mesh, _data(7, BATCH, 16), "data", None), _global(mesh, _data(8, BATCH, 8), "data", None)
    with jax.set_mesh(mesh), aotgrad.config.patch(detect_anomaly=True):
        assert_close(jax.value_and_grad(aotgrad.compile(_mlp))(p, x, y),
                     jax.jit(jax.value_and_grad(_mlp))(p, x, y), "anomaly mode, finite")
        zeros = _global(mesh, np.zeros((BATCH, 16), np.float32), "data", None)
        try:
            jax.grad(aotgrad.compile(_masked_log), argnums=1)(p, zeros, y)
        except FloatingPointError as e:
            assert "derivative of the forward operation `log`" in str(e), str(e)
        else:
            raise AssertionError("anomaly mode did not raise on a NaN gradient")


def main(process_id: int, num_processes: int, port: int) -> None:
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=num_processes,
                               process_id=process_id, initialization_timeout=120)
    assert jax.process_count() == num_processes and jax.device_count() == LOCAL_DEVICES * num_processes
    checks = 0
    data_parallel = jax.make_mesh((jax.device_count(),), ("data",))
    # (processes, local devices): "data" crosses processes, "model" stays inside one
    tensor_parallel = jax.make_mesh((num_processes, LOCAL_DEVICES), ("data", "model"))
    for config in CONFIGS:
        check_step(_mlp, data_parallel, "data", False, config)
        check_step(_tp_mlp, tensor_parallel, "data", True, config)
        checks += 2
    check_debug_dir(data_parallel, process_id)
    check_anomaly_mode(data_parallel)
    checks += 2
    jax.distributed.shutdown()
    print(f"ok {process_id} {checks}", flush=True)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
