"""`partition/shards.py`: which values of a sharded step are split over its devices.

The reference is how the layout of each value follows from its input's by the meaning of
the operation (a batch axis survives a matmul over features, a sum over the batch makes a
whole weight gradient), written out by hand for small programs; the graphs are traced
with one input declared split (`JointGraph.input_splits`), so no devices are needed. The
step-level check against XLA's own per-device peak is in tests/sharded_cases.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from aotgrad.partition.graph import JointGraph
from aotgrad.partition.shards import input_splits, per_device_bytes, splits

N = 8  # devices


def _graph(fn, *args, split_input=1, axis=0):
    closed = jax.make_jaxpr(fn)(*args)
    marks = [None] * len(args)
    marks[split_input] = (axis, N)
    return JointGraph(closed, n_inputs=len(args), n_outs=len(closed.jaxpr.outvars), devices=N,
                      input_splits=tuple(marks))


def _by_shape(graph):
    """(primitive name, output shape) -> the split of the first such output."""
    found, out = splits(graph), {}
    for e in graph.eqns:
        for v in e.outvars:
            out.setdefault((e.primitive.name, v.aval.shape), found.get(v))
    return out


def test_a_transformer_layers_activations_stay_split_and_its_weight_gradient_is_whole():
    """Split tokens: the embedding lookup, the (B, S, D) activations, a matmul over
    features, the (B*S, D) reshape and the attention scores (a matmul with the batch as a
    batch dimension) are split on the batch axis; the weight gradient (a contraction over
    the batch and sequence) and the loss (a sum over everything) are whole."""
    def f(table, tokens, w):
        x = table[tokens]  # (B, S, D)
        h = jnp.tanh(x @ w)  # (B, S, D)
        scores = jnp.einsum("bsd,btd->bst", h, x)  # (B, S, S)
        flat = h.reshape(-1, h.shape[-1])  # (B*S, D)
        grad_w = jnp.einsum("bsd,bse->de", x, h)  # (D, D): summed over the batch
        return jnp.sum(scores) + jnp.sum(flat) + jnp.sum(grad_w)

    table, w = jnp.ones((50, 16)), jnp.ones((16, 16))
    tokens = jnp.zeros((16, 4), jnp.int32)
    by_shape = _by_shape(_graph(f, table, tokens, w))
    assert by_shape[("gather", (16, 4, 16))] == (0, N)
    assert by_shape[("tanh", (16, 4, 16))] == (0, N)
    assert by_shape[("dot_general", (16, 4, 4))] == (0, N)  # the batch as a batch dimension
    assert by_shape[("reshape", (64, 16))] == (0, N)  # (B, S) merged: still split
    assert by_shape[("dot_general", (16, 16))] is None  # summed over the batch
    assert all(s is None for (name, shape), s in by_shape.items() if shape == ())  # the sums


def test_the_axis_moves_with_transposes_broadcasts_and_reductions():
    def f(w, x):  # x: (A, B) split on axis 1
        t = x.T  # (B, A): axis 0
        b = jnp.broadcast_to(t[None], (3, 16, 8))  # axis 1
        r = jnp.sum(b, axis=0)  # (B, A): axis 0
        m = jnp.max(r, axis=0)  # summed over the split axis: whole
        return jnp.sum(m * w)

    got = _by_shape(_graph(f, jnp.ones((8,)), jnp.ones((8, 16)), axis=1))
    assert got[("transpose", (16, 8))] == (0, N)
    assert got[("broadcast_in_dim", (3, 16, 8))] == (1, N)
    assert got[("reduce_sum", (16, 8))] == (0, N)
    assert got[("reduce_max", (8,))] is None


def test_a_value_broadcast_to_a_split_shape_is_split_as_its_reader():
    """A mask built from constants and broadcast to the split activations' shape (XLA
    splits it as the select that reads it): split, found back from the reader."""
    def f(w, x):  # x: (B, S) split on the batch
        mask = jnp.broadcast_to(jnp.arange(x.shape[1]) < 2, x.shape)
        return jnp.sum(jax.lax.select(mask, x, jnp.zeros(x.shape)) * w)

    graph = _graph(f, jnp.ones(()), jnp.ones((16, 4)))
    found = splits(graph)
    (select,) = [e for e in graph.eqns if e.primitive.name == "select_n"]
    assert all(found.get(v) == (0, N) for v in select.invars if v.aval.shape == (16, 4))


def test_a_scans_stacked_outputs_are_split_one_axis_later():
    def f(w, x):  # x: (B, D) split on the batch
        def body(h, _):
            h = jnp.tanh(h @ w)
            return h, h
        h, hs = jax.lax.scan(body, x, None, length=3)  # hs: (3, B, D)
        return jnp.sum(hs) + jnp.sum(h)

    graph = _graph(f, jnp.ones((4, 4)), jnp.ones((16, 4)))
    found = splits(graph)
    (scan,) = [e for e in graph.eqns if e.primitive.name == "scan"]
    assert [found.get(v) for v in scan.outvars] == [(0, N), (1, N)]


def test_per_device_bytes_divide_split_values_only():
    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    graph = _graph(f, jnp.ones((4, 4)), jnp.ones((16, 4)))
    size = per_device_bytes(graph)
    w, x = graph.inputs
    (dot,) = [e for e in graph.eqns if e.primitive.name == "dot_general"]
    assert size(w) == 4 * 4 * 4 and size(x) == 16 * 4 * 4 // N and size(dot.outvars[0]) == 16 * 4 * 4 // N
    one = JointGraph(graph.closed, graph.n_inputs, graph.n_outs, input_splits=graph.input_splits)
    assert per_device_bytes(one)(x) == 16 * 4 * 4  # one device: nothing is divided


@pytest.mark.parametrize("differentiated, explicit, want", [
    (False, False, (0, N)),  # a batch the devices divide, layout not visible: its leading axis
    (True, False, None),  # a parameter, layout not visible: whole where it is used
    (False, True, None),  # explicit axes: the layout seen (replicated) is the layout
])
def test_input_splits_where_the_layout_is_not_visible(differentiated, explicit, want):
    mesh = jax.sharding.AbstractMesh((N,), ("data",), axis_types=(AxisType.Explicit if explicit else AxisType.Auto,))
    aval = jax.ShapeDtypeStruct((16, 4), np.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    assert input_splits([aval], [differentiated], N) == (want,)
    odd = jax.ShapeDtypeStruct((12, 4), np.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    assert input_splits([odd], [False], N) == (None,)  # 8 devices do not divide 12 rows
    named = jax.ShapeDtypeStruct((16, 4), np.float32, sharding=NamedSharding(mesh, PartitionSpec(None, "data")))
    assert input_splits([named], [differentiated], N) == ((1, N),)  # a named axis: that one


def test_on_a_mesh_of_several_axes_a_batch_is_guessed_split_over_the_first():
    """Automatic axes on a (2, 4) mesh: which axes the batch uses is not visible; the
    first (by custom the data axis) is assumed, not all 8 devices (which would count the
    activations at a quarter of their size where the batch uses only that axis)."""
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    aval = jax.ShapeDtypeStruct((16, 4), np.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    assert input_splits([aval], [False], 8) == ((0, 2),)
