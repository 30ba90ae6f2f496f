"""Hooks on 8 simulated CPU devices; run by tests/test_hooks.py in its own process.

A per-leaf hook that `psum`s each gradient inside `shard_map` gives the gradients of a
`psum` after the backward, and is placed in the backward program right after the
equation that finalizes its leaf: the last layer's psum comes before the first layer's
backward matmuls.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import eight_devices  # noqa: E402,F401  (before JAX: 8 simulated devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, PartitionSpec as P  # noqa: E402

import aotgrad  # noqa: E402

N_LAYERS = 3


def _mlp(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.sum(x ** 2)


def _setup():
    keys = jax.random.split(jax.random.key(1), N_LAYERS + 1)
    params = [jax.random.normal(k, (8, 8)) * 0.4 for k in keys[:-1]]
    x = jax.random.normal(keys[-1], (16, 8))
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,)), params, x


def _sharded_grad(mesh, loss):
    # check_vma=False: the gradients of the replicated params stay per device, so the
    # psum over "data" is the data-parallel all-reduce, written by the user.
    return jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                                 check_vma=False))


def test_per_leaf_psum_equals_a_psum_after_the_backward():
    mesh, params, x = _setup()
    f = aotgrad.compile(_mlp)
    f.register_hook(lambda g, path: jax.lax.psum(g, "data"), per_leaf=True)
    got = _sharded_grad(mesh, f)(params, x)
    want = jax.jit(jax.shard_map(lambda p, xb: jax.lax.psum(jax.grad(_mlp)(p, xb), "data"), mesh=mesh,
                                 in_specs=(P(), P("data")), out_specs=P(), check_vma=False))(params, x)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    full = jax.grad(_mlp)(params, x)  # the psum of per-shard gradients is the full batch's gradient
    for a, b in zip(got, full):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def _backward_jaxpr(jaxpr):
    """The backward program's jaxpr: the jit call holding both psums and dot_generals."""
    for eqn in jaxpr.eqns:
        for name in ("jaxpr", "call_jaxpr"):
            sub = eqn.params.get(name)
            if sub is None:
                continue
            sub = getattr(sub, "jaxpr", sub)
            names = [e.primitive.name for e in sub.eqns]
            if "psum" in names and "dot_general" in names:
                return sub
            found = _backward_jaxpr(sub)
            if found is not None:
                return found
    return None


def test_last_layer_psum_comes_before_the_first_layers_backward_matmuls():
    mesh, params, x = _setup()
    f = aotgrad.compile(_mlp)
    f.register_hook(lambda g, path: jax.lax.psum(g, "data"), per_leaf=True)
    step = jax.shard_map(jax.grad(f), mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
    backward = _backward_jaxpr(jax.make_jaxpr(step)(params, x).jaxpr)
    assert backward is not None
    names = [e.primitive.name for e in backward.eqns]
    psums = [i for i, n in enumerate(names) if n == "psum"]
    matmuls = [i for i, n in enumerate(names) if n == "dot_general"]
    # One psum per layer; the first (the last layer's weight gradient) comes before the
    # first layer's backward matmuls, the last after every matmul.
    assert len(psums) == N_LAYERS
    assert psums[0] < psums[1] < matmuls[-2] and psums[-1] > matmuls[-1]
    outs = backward.outvars
    assert backward.eqns[psums[0]].outvars[0] is outs[N_LAYERS - 1]
    assert backward.eqns[psums[-1]].outvars[0] is outs[0]


def test_whole_hook_psum_after_the_backward_is_placed_at_the_end():
    mesh, params, x = _setup()
    f = aotgrad.compile(_mlp)
    f.register_hook(lambda grads, ct: (jax.lax.psum(grads[0], "data"), None))
    step = jax.shard_map(jax.grad(f), mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
    backward = _backward_jaxpr(jax.make_jaxpr(step)(params, x).jaxpr)
    names = [e.primitive.name for e in backward.eqns]
    assert max(i for i, n in enumerate(names) if n == "dot_general") < names.index("psum")
