"""`planning.loops`: XLA's cost analysis counts a loop's body once; a step's FLOPs count it
as often as it runs. The reference is XLA:CPU's own analysis of the same
arithmetic written without loops."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from aotgrad._jax_internals import hlo_cost
from aotgrad.planning.measure import counted_cost

ARGS = (jax.ShapeDtypeStruct((128, 128), jnp.float32), jax.ShapeDtypeStruct((4, 128, 128), jnp.float32))
MATMUL = 2 * 128 ** 3


def scanned(x, ws):  # 4 layers, each its matmul 3 times: a scan inside a scan
    def layer(c, w):
        return jax.lax.scan(lambda c2, _: (jnp.tanh(c2 @ w), None), c, None, length=3)[0], None
    return jnp.sum(jax.lax.scan(layer, x, ws)[0])


def unrolled(x, ws):
    for i in range(ws.shape[0]):
        for _ in range(3):
            x = jnp.tanh(x @ ws[i])
    return jnp.sum(x)


def _flops(fn, grad):
    step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)) if grad else fn)
    compiled = step.lower(*ARGS).compile()
    return counted_cost(compiled)["flops"], hlo_cost(compiled)["flops"]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "step"])
def test_a_scans_flops_are_its_unrolled_twins(grad):
    counted, once = _flops(scanned, grad)
    reference, _ = _flops(unrolled, grad)
    assert abs(counted / reference - 1) < 0.01, (counted, reference)
    assert once < 0.2 * reference  # what the analysis alone says: each body once


def test_a_loop_of_unknown_length_counts_once():
    def loop(x, ws):  # the trip count depends on a value: XLA does not know it
        def body(carry):
            i, y = carry
            return i + 1, jnp.tanh(y @ ws[0])
        return jnp.sum(jax.lax.while_loop(lambda c: (c[0] < 4) & (jnp.sum(c[1]) < 1e9), body, (0, x))[1])
    compiled = jax.jit(loop).lower(*ARGS).compile()
    counted, once = counted_cost(compiled)["flops"], hlo_cost(compiled)["flops"]
    assert once >= MATMUL and abs(counted - once) <= 1e-6 * once, (counted, once)
