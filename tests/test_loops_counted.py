"""A step's bytes and FLOPs with each loop counted as often as it runs (`planning/loops.py`):
XLA's cost analysis counts a `while` body once, so a scan over n iterations was counted as
if it ran one. The reference is the same step unrolled, which has no loop to count."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from aotgrad.planning.measure import EXCESS, counted_cost

ROW = 1 << 16


def _body(c, x):
    y = jnp.sin(x) * c
    return c + y.sum(), y


def _scanned(c, xs):
    return jax.lax.scan(_body, c, xs)


def _unrolled(c, xs):
    ys = []
    for i in range(xs.shape[0]):
        c, y = _body(c, xs[i])
        ys.append(y)
    return c, jnp.stack(ys)


def _counted(f, n):
    cost = counted_cost(jax.jit(f).lower(jnp.float32(1), jnp.ones((n, ROW), jnp.float32)).compile())
    return cost["bytes accessed"] - cost[EXCESS], cost["flops"]


@pytest.mark.parametrize("n", [8, 32])
def test_a_scans_bytes_and_flops_are_counted_as_often_as_it_runs(n):
    """On XLA:CPU the scan reads each row of `xs` and writes each row of `ys` once per
    iteration: its bytes are the unrolled step's within 1.25x, its FLOPs at least 0.8x of
    them (the scan's body counts one more elementwise op per element). Counted once, the
    body's were about 1/n of them."""
    (moved, flops), (moved_unrolled, flops_unrolled) = _counted(_scanned, n), _counted(_unrolled, n)
    assert 0.8 * moved_unrolled <= moved <= 1.25 * moved_unrolled, (n, moved, moved_unrolled)
    assert moved >= 2 * n * ROW * 4  # each row read and written
    assert flops >= 0.8 * flops_unrolled, (n, flops, flops_unrolled)
