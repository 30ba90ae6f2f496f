"""Build cost on deep graphs: trace and partition seconds per 1,000 joint-graph equations,
and the XLA compile of both programs, for stacks of pre-LN GELU layers (small width, so the
time is graph handling, not arithmetic).

    python -m benchmarks.large_graph [--layers=12,24,48] [--width=8] [--no-compile]
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import aotgrad


def stack(params: list, x: jax.Array) -> jax.Array:
    for w, g in params:
        h = (x - jnp.mean(x, -1, keepdims=True)) * jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5) * g
        x = x + jax.nn.gelu(h @ w)
    return jnp.mean(x ** 2)


def stack_args(layers: int, width: int, batch: int = 4) -> tuple[list, jax.Array]:
    keys = jax.random.split(jax.random.key(0), layers + 1)
    params = [(jax.random.normal(k, (width, width)) * width ** -0.5, jnp.ones(width)) for k in keys[:-1]]
    return params, jax.random.normal(keys[-1], (batch, width))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="12,24,48")
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args(argv)
    print(f"{time.strftime('%Y-%m-%d')}  jax {jax.__version__}  backend {jax.default_backend()}")
    print(f"{'partitioner':<12} {'layers':>6} {'joint eqns':>10} {'trace s':>8} {'part s':>7} "
          f"{'trace s/1k':>10} {'part s/1k':>9} {'compile s':>9}")
    for layers in (int(n) for n in args.layers.split(",")):
        params, x = stack_args(layers, args.width)
        for name in aotgrad.partition.PARTITIONERS:
            f = aotgrad.compile(stack)
            with aotgrad.config.patch(partitioner=name):
                t0 = time.perf_counter()
                traced = f.trace(params, x)
                forward_trace = time.perf_counter() - t0
                pair = traced.pair()
                compile_s = float("nan")
                if not args.no_compile:
                    compile_s = f.lower(params, x).compile().timings.compile
            n = len(pair.graph.eqns)
            trace = forward_trace + pair.timings.trace
            part = pair.timings.partition
            print(f"{name:<12} {layers:>6} {n:>10} {trace:>8.3f} {part:>7.3f} {trace / n * 1e3:>10.3f} "
                  f"{part / n * 1e3:>9.3f} {compile_s:>9.2f}")


if __name__ == "__main__":
    main()
