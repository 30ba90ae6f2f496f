"""A 48-layer stack traces and partitions, under every partitioner, without recursion-depth
errors (XLA compilation of the whole stack is in `python -m benchmarks.large_graph`)."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import pytest

import aotgrad

try:
    from tests.partition_configs import config_id, partitioner_configs
except ImportError:
    from partition_configs import config_id, partitioner_configs

LAYERS, D = 48, 8


def stack(params, x):
    for w, g in params:
        h = (x - jnp.mean(x, -1, keepdims=True)) * jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5) * g
        x = x + jax.nn.gelu(h @ w)
    return jnp.mean(x ** 2)


def stack_args(layers=LAYERS, d=D, batch=4):
    keys = jax.random.split(jax.random.key(0), layers + 1)
    params = [(jax.random.normal(k, (d, d)) * d ** -0.5, jnp.ones(d)) for k in keys[:-1]]
    return params, jax.random.normal(keys[-1], (batch, d))


@pytest.mark.parametrize("config", partitioner_configs(budgets=(0.0, 0.5)), ids=config_id)
def test_deep_stack_traces_and_partitions(config):
    assert sys.getrecursionlimit() <= 10_000  # nothing raised it to hide deep recursion
    f = aotgrad.compile(stack)
    params, x = stack_args()
    with aotgrad.config.patch(**config):
        pair = f.trace(params, x).pair()
    n_joint = len(pair.graph.eqns)
    assert n_joint > 48 * 30  # the graph really is deep
    assert len(pair.split.backward.out_avals) == 2 * LAYERS + 1  # every weight, gain and x
    assert pair.timings.trace > 0 and pair.timings.partition > 0
