"""A data-parallel MLP training step on 8 simulated CPU devices: aotgrad against
`jax.fwd_and_bwd` (and a fused `jax.jit(value_and_grad)` for reference).

The batch is split over the 8 devices, the parameters are replicated. Each step runs the
forward, then the backward, and blocks on the gradients. Samples of the contenders are
interleaved; the median over samples is reported, with the ratio to `jax.fwd_and_bwd` and
the activation bytes each keeps between forward and backward (inputs excluded), in total
and on one device.

    python -m benchmarks.sharded [--batch=512] [--width=256] [--depth=4] [--repeats=15]

Sets ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` itself, before importing JAX.
"""
from __future__ import annotations

import os
import sys

if "jax" in sys.modules:
    raise RuntimeError("benchmarks.sharded must set XLA_FLAGS before JAX is imported; run it as a script")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.extend.core import Var  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import aotgrad  # noqa: E402
from benchmarks.measure import interleaved, steps_for, summarize, time_steps  # noqa: E402


def mlp_loss(params: list, batch: tuple) -> jax.Array:
    x, y = batch
    for w, b in params[:-1]:
        x = jax.nn.gelu(x @ w + b)
    w, b = params[-1]
    return jnp.mean((x @ w + b - y) ** 2)


def workload(batch: int, width: int, depth: int) -> tuple[Any, Any]:
    mesh = jax.make_mesh((8,), ("data",))
    keys = jax.random.split(jax.random.key(0), depth + 2)
    params = [(jax.random.normal(k, (width, width)) * width ** -0.5, jnp.zeros(width)) for k in keys[:depth]]
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    split = NamedSharding(mesh, P("data", None))
    data = (jax.device_put(jax.random.normal(keys[-2], (batch, width)), split),
            jax.device_put(jax.random.normal(keys[-1], (batch, width)), split))
    return params, data


def _per_device(arrays: list) -> int:
    return sum(a.addressable_shards[0].data.nbytes for a in arrays)


def _input_mask(params: Any, data: Any) -> list[bool]:
    """Which residual leaves of `jax.fwd_and_bwd` are inputs passed through (on the jaxpr
    of the unjitted forward; the jitted one returns copies)."""
    fwd, _ = jax.fwd_and_bwd(mlp_loss, argnums=0, jitted=False)
    closed = jax.make_jaxpr(lambda p, b: jax.tree.leaves(fwd(p, b)[1]))(params, data)
    invars = set(closed.jaxpr.invars)
    return [isinstance(v, Var) and v in invars for v in closed.jaxpr.outvars]


def contenders(params: Any, data: Any) -> dict[str, tuple[Callable[[], Any], int, int]]:
    """name -> (step, saved activation bytes in total, on one device)."""
    ct = jnp.ones((), jnp.float32)
    out: dict[str, tuple[Callable[[], Any], int, int]] = {}
    fused = jax.jit(jax.value_and_grad(mlp_loss))
    out["fused"] = (lambda: fused(params, data), 0, 0)

    fwd, bwd = jax.fwd_and_bwd(mlp_loss, argnums=0)
    _, residuals = fwd(params, data)
    leaves = [a for a, m in zip(jax.tree.leaves(residuals), _input_mask(params, data), strict=True) if not m]
    out["jax_fwd_and_bwd"] = (lambda: bwd(fwd(params, data)[1], ct), sum(a.nbytes for a in leaves),
                              _per_device(leaves))
    for name in aotgrad.partitioners():
        with aotgrad.config.patch(partitioner=name):
            afwd, abwd = aotgrad.fwd_and_bwd(mlp_loss, argnums=0)
            _, saved = afwd(params, data)
        acts = saved.arrays[:len(saved.pair.split.activations)]
        out[f"aotgrad:{name}"] = (lambda f=afwd, b=abwd: b(f(params, data)[1], ct),
                                  sum(a.nbytes for a in acts), _per_device(acts))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--min-sample-seconds", type=float, default=0.2)
    args = parser.parse_args(argv)
    assert jax.device_count() == 8, jax.devices()
    params, data = workload(args.batch, args.width, args.depth)
    steps = contenders(params, data)
    for step, _, _ in steps.values():  # compile and warm up
        jax.block_until_ready(step())
    per_step = {n: time_steps(s, jax.block_until_ready, 3) for n, (s, _, _) in steps.items()}
    n = steps_for(float(np.median(list(per_step.values()))), args.min_sample_seconds)
    samplers = {name: (lambda s=s: time_steps(s, jax.block_until_ready, n)) for name, (s, _, _) in steps.items()}
    samples = interleaved(samplers, args.repeats)
    ref = summarize(samples["jax_fwd_and_bwd"]).median
    print(f"data-parallel MLP step on {jax.device_count()} CPU devices: batch {args.batch} split 8 ways, "
          f"width {args.width}, depth {args.depth}; {args.repeats} interleaved samples of {n} steps; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(f"{'strategy':<20} {'step ms':>8} {'IQR ms':>7} {'vs jax':>7} {'saved MB':>9} {'per device MB':>14}")
    for name, (_, total, device) in steps.items():
        s = summarize(samples[name])
        saved = "-" if name == "fused" else f"{total / 1e6:.2f}"
        dev = "-" if name == "fused" else f"{device / 1e6:.2f}"
        print(f"{name:<20} {s.median * 1e3:>8.2f} {s.iqr * 1e3:>7.2f} {s.median / ref:>6.2f}x {saved:>9} {dev:>14}")


if __name__ == "__main__":
    main()
