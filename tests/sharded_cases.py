"""aotgrad on 8 simulated CPU devices; run by tests/test_sharding.py in its own process.

Run alone with ``python -m pytest tests/sharded_cases.py`` (this module sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX is imported).

Every case compares against JAX itself on the same sharded inputs, under every registered
partitioner (and memory budget):
  - gradients keep the inputs' shardings; saved values stay sharded (never gathered);
  - `with_sharding_constraint` inside the function is honoured by both programs;
  - `shard_map` with `psum` / `all_gather` / `ppermute` differentiates correctly, and the
    backward runs no collective that JAX's own backward does not;
  - a data-parallel and a tensor-parallel MLP step equal `jax.value_and_grad`.
"""
from __future__ import annotations

import collections
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import eight_devices  # noqa: E402,F401  (before JAX: 8 simulated devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax import lax  # noqa: E402
from jax.extend.core import ClosedJaxpr, Jaxpr  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import aotgrad  # noqa: E402
from benchmarks.strategies import xla_peak  # noqa: E402

from partition_configs import config_id, partitioner_configs  # noqa: E402

CONFIGS = partitioner_configs(budgets=(0.0, 1.0))
MODES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
COLLECTIVES = ("psum", "all_gather", "reduce_scatter", "psum_scatter", "ppermute", "all_to_all",
               "pmax", "pmin")


def test_eight_devices():
    assert jax.device_count() == 8


def _mesh(mode: str = "auto") -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(MODES[mode],) * 2)


def _put(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def _normal(seed, *shape, scale=1.0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale


def assert_close(got, want, rtol=2e-5):
    """Normwise relative error per leaf (reduction order differs between programs)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape
        scale = max(np.max(np.abs(w)), 1e-30)
        assert np.max(np.abs(g - w)) <= rtol * scale, (np.max(np.abs(g - w)), scale)


def assert_same_shardings(grads, inputs):
    for g, x in zip(jax.tree.leaves(grads), jax.tree.leaves(inputs)):
        assert g.sharding.is_equivalent_to(x.sharding, x.ndim), (g.sharding, x.sharding)


def _mlp(p, x, y):
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def _mlp_params(seed=0, d_in=16, hidden=64, d_out=8):
    return {"w1": _normal(seed, d_in, hidden, scale=0.3), "b1": _normal(seed + 1, hidden, scale=0.1),
            "w2": _normal(seed + 2, hidden, d_out, scale=0.3)}


# ----------------------------------------------------------------------------- inputs and gradients

def _mixed(x, w, b, s):
    """Batch-sharded x, column-sharded w and b, and s whose gradient does not depend on any
    saved value (the backward alone cannot know its sharding)."""
    return jnp.sum(jnp.tanh(x @ w + b) ** 2) + 3.0 * jnp.sum(s)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_gradients_keep_input_shardings(config, mode):
    mesh = _mesh(mode)
    args = (_put(mesh, _normal(0, 32, 16), "data", None), _put(mesh, _normal(1, 16, 64, scale=0.2), None, "model"),
            _put(mesh, _normal(2, 64), "model"), _put(mesh, _normal(3, 32, 8), "data", "model"))
    nums = (0, 1, 2, 3)
    with jax.set_mesh(mesh), aotgrad.config.patch(**config):
        want = jax.jit(jax.value_and_grad(_mixed, argnums=nums))(*args)
        got = jax.value_and_grad(aotgrad.compile(_mixed), argnums=nums)(*args)
        fwd, bwd = aotgrad.fwd_and_bwd(_mixed, argnums=nums)
        out, saved = fwd(*args)
        grads = bwd(saved, jnp.ones_like(out))
    assert_close(got, want)
    assert_close((out, grads), want)
    assert_same_shardings(got[1], args)
    assert_same_shardings(grads, args)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_saved_values_stay_sharded(config):
    mesh = _mesh()
    p = jax.tree.map(lambda a: _put(mesh, a), _mlp_params())
    x, y = _put(mesh, _normal(5, 32, 16), "data", None), _put(mesh, _normal(6, 32, 8), "data", None)
    with aotgrad.config.patch(**config):
        fwd, bwd = aotgrad.fwd_and_bwd(_mlp, argnums=0)
        out, saved = fwd(p, x, y)
        grads = bwd(saved, jnp.ones_like(out))
    assert_close(grads, jax.jit(jax.grad(_mlp))(p, x, y))
    n_act = len(saved.pair.split.activations)
    for a in saved.arrays[:n_act]:
        assert len(a.sharding.device_set) == 8, a.sharding
        if a.ndim and a.shape[0] == 32:  # batch-major activations keep the batch split over "data"
            assert a.sharding.shard_shape(a.shape)[0] == 16, (a.shape, a.sharding)
    leaves = jax.tree.leaves((p, x, y))  # no closed-over constants: input i is leaf i
    for a, i in zip(saved.arrays[n_act:], saved.pair.split.saved_inputs):
        assert a is leaves[i]  # saved inputs are the caller's own arrays, not copies


def test_same_function_on_one_device_then_sharded():
    f = aotgrad.compile(_mlp)
    p, x, y = _mlp_params(), _normal(5, 32, 16), _normal(6, 32, 8)
    want = jax.jit(jax.value_and_grad(_mlp))(p, x, y)
    assert_close(jax.value_and_grad(f)(p, x, y), want)
    mesh = _mesh()
    xs, ys = _put(mesh, x, "data", None), _put(mesh, y, "data", None)
    got = jax.value_and_grad(f)(p, xs, ys)
    assert_close(got, want)
    assert_close(jax.value_and_grad(f)(p, x, y), want)


def test_explicit_sharding_change_on_the_same_function():
    mesh = _mesh("explicit")
    f = aotgrad.compile(_mixed)
    with jax.set_mesh(mesh):
        for spec in (("data", None), (None, "model"), (None, None)):
            args = (_put(mesh, _normal(0, 32, 16), *spec), _put(mesh, _normal(1, 16, 64), None, "model"),
                    _put(mesh, _normal(2, 64), "model"), _put(mesh, _normal(3, 32, 8), "data", "model"))
            grads = jax.grad(f, argnums=(0, 1, 2, 3))(*args)
            assert_close(grads, jax.jit(jax.grad(_mixed, argnums=(0, 1, 2, 3)))(*args))
            assert_same_shardings(grads, args)


def test_explicit_sharding_is_part_of_the_signature():
    # Under Explicit mesh axes the sharding is part of the type: a new sharding is a new trace.
    def f(x):
        return jnp.sum(x) * (2.0 if jax.typeof(x).sharding.spec[0] == "data" else 3.0)
    mesh = _mesh("explicit")
    g = aotgrad.compile(f)
    with jax.set_mesh(mesh):
        for spec in (("data", None), (None, "model")):
            x = _put(mesh, _normal(0, 32, 16), *spec)
            assert_close(g(x), f(x))


# ----------------------------------------------------------------------------- with_sharding_constraint

def _constrained(w1, w2, x):
    h = lax.with_sharding_constraint(jnp.tanh(x @ w1), P("data", "model"))
    return jnp.sum(jnp.sin(h) @ w2)


def _count(jaxpr, predicate) -> collections.Counter:
    """Primitives of `jaxpr` matching `predicate`, counted inside nested jaxprs too."""
    counts: collections.Counter = collections.Counter()
    for eqn in jaxpr.eqns:
        if predicate(eqn.primitive.name):
            counts[eqn.primitive.name] += 1
        for sub in _sub_jaxprs(eqn.params):
            counts += _count(sub, predicate)
    return counts


def _sub_jaxprs(params):
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, Jaxpr):
                yield v


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_with_sharding_constraint_in_both_programs(config):
    mesh = _mesh()
    w1, w2, x = _normal(0, 16, 64, scale=0.3), _normal(1, 64, 8), _put(mesh, _normal(2, 32, 16), "data", None)
    with jax.set_mesh(mesh), aotgrad.config.patch(**config):
        fwd, bwd = aotgrad.fwd_and_bwd(_constrained, argnums=(0, 1))
        out, saved = fwd(w1, w2, x)
        grads = bwd(saved, jnp.ones_like(out))
        want = jax.jit(jax.value_and_grad(_constrained, argnums=(0, 1)))(w1, w2, x)
    assert_close((out, grads), want)
    split = saved.pair.split
    is_wsc = lambda name: name == "sharding_constraint"  # noqa: E731
    assert _count(split.forward.jaxpr, is_wsc)["sharding_constraint"] >= 1
    assert _count(split.backward.jaxpr, is_wsc)["sharding_constraint"] >= 1  # on the cotangent
    want_sharding = NamedSharding(mesh, P("data", "model"))
    for a in saved.arrays[:len(split.activations)]:
        if a.shape == (32, 64):  # h, or values computed from it pointwise
            assert a.sharding.is_equivalent_to(want_sharding, 2), a.sharding


# ----------------------------------------------------------------------------- shard_map

def _collectives(w1, w2, x):
    mesh = jax.sharding.get_abstract_mesh()

    def body(w1, w2, x):
        h = jnp.tanh(x @ w1)
        y = lax.psum(h @ w2, "model")
        g = lax.all_gather(jnp.sin(y), "data", tiled=True)
        r = lax.ppermute(y, "data", perm=[(0, 1), (1, 0)])
        return lax.psum(jnp.sum(g ** 2) / 2 + jnp.sum(r * y), "data")

    return jax.shard_map(body, mesh=mesh, in_specs=(P(None, "model"), P("model", None), P("data", None)),
                         out_specs=P())(w1, w2, x)


def _is_collective(name: str) -> bool:
    return any(c in name for c in COLLECTIVES)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_shard_map_collectives(config):
    mesh = _mesh()
    w1 = _put(mesh, _normal(0, 16, 64, scale=0.3), None, "model")
    w2 = _put(mesh, _normal(1, 64, 8, scale=0.3), "model", None)
    x = _put(mesh, _normal(2, 32, 16), "data", None)
    nums = (0, 1, 2)
    with jax.set_mesh(mesh), aotgrad.config.patch(**config):
        want = jax.jit(jax.value_and_grad(_collectives, argnums=nums))(w1, w2, x)
        fwd, bwd = aotgrad.fwd_and_bwd(_collectives, argnums=nums)
        out, saved = fwd(w1, w2, x)
        grads = bwd(saved, jnp.ones_like(out))
        got = jax.jit(jax.value_and_grad(aotgrad.compile(_collectives), argnums=nums))(w1, w2, x)
        # JAX's own programs: the function (forward) and the VJP (backward).
        fwd_ref = jax.make_jaxpr(_collectives)(w1, w2, x).jaxpr
        _, vjp_fn = jax.vjp(_collectives, w1, w2, x)
        bwd_ref = jax.make_jaxpr(vjp_fn)(jnp.ones_like(out)).jaxpr
    assert_close((out, grads), want)
    assert_close(got, want)
    assert_same_shardings(grads, (w1, w2, x))
    split = saved.pair.split
    fwd_counts, bwd_counts = _count(split.forward.jaxpr, _is_collective), _count(split.backward.jaxpr, _is_collective)
    assert fwd_counts == _count(fwd_ref, _is_collective)
    ref = _count(bwd_ref, _is_collective)
    extra = {name: n - ref[name] for name, n in bwd_counts.items() if n > ref[name]}
    assert not extra, f"collectives recomputed in the backward: {extra} (JAX's backward runs {dict(ref)})"


# ----------------------------------------------------------------------------- training steps

def _sgd_step(loss):
    def step(p, x, y):
        value, grads = jax.value_and_grad(loss)(p, x, y)
        return value, grads, jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)
    return jax.jit(step)


def _check_steps(loss, p, x, y, config, mesh):
    with jax.set_mesh(mesh), aotgrad.config.patch(**config):
        want_step, got_step = _sgd_step(loss), _sgd_step(aotgrad.compile(loss))
        vw, gw, pw = want_step(p, x, y)
        vg, gg, pg = got_step(p, x, y)
        assert_close((vg, gg, pg), (vw, gw, pw))
        assert_same_shardings(gg, p)
        eager = jax.value_and_grad(aotgrad.compile(loss))(p, x, y)  # forward and backward programs
    assert_close(eager, (vw, gw))
    assert_same_shardings(eager[1], p)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_data_parallel_mlp_step(config):
    mesh = _mesh()
    p = jax.tree.map(lambda a: _put(mesh, a), _mlp_params())  # replicated
    x = _put(mesh, _normal(7, 64, 16), ("data", "model"), None)  # batch over all 8 devices
    y = _put(mesh, _normal(8, 64, 8), ("data", "model"), None)
    _check_steps(_mlp, p, x, y, config, mesh)


def test_explain_reports_memory_per_device():
    """A data-parallel step over 8 devices: explain's XLA memory is one device's, as for
    JAX's own jitted gradient (a backward lowered without the shardings it runs with
    would count the whole batch). Both meshes' axis types."""
    def mlp(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x ** 2)

    ws = [jnp.full((128, 128), 0.01)] * 3
    x = _normal(9, 1024, 128)
    whole = aotgrad.explain(aotgrad.compile(mlp), ws, x).memory
    for mode in MODES:
        mesh = jax.make_mesh((8,), ("data",), axis_types=(MODES[mode],))
        ws_s = [_put(mesh, w) for w in ws]
        x_s = _put(mesh, x, "data")
        m = aotgrad.explain(aotgrad.compile(mlp), ws_s, x_s).memory
        ref = jax.jit(jax.grad(mlp)).lower(ws_s, x_s).compile().memory_analysis()
        per_device = xla_peak(ref)
        assert m.backward_peak < whole.backward_peak / 2, (mode, m, whole)
        assert m.backward_peak < 2 * per_device, (mode, m, per_device)


def test_backward_waits_without_collectives():
    """With several devices the backward's recomputation waits through barriers: the data
    tie's zero (read from two elements of a cotangent) would be read across shards, one
    collective per group. The data-parallel step's backward has no more all-reduces
    than with no waiting at all."""
    from aotgrad.partition import ties
    assert not ties.tie_by_data()
    mesh = _mesh()
    p = jax.tree.map(lambda a: _put(mesh, a), _mlp_params())
    x = _put(mesh, _normal(7, 64, 16), ("data", "model"), None)
    y = _put(mesh, _normal(8, 64, 8), ("data", "model"), None)
    def deeper(p, x, y):  # a layer below the loss head's, whose recomputation waits
        return _mlp(p, jax.nn.gelu(x @ p["w0"]), y)
    p["w0"] = _put(mesh, _normal(9, 16, 16, scale=0.3))
    with aotgrad.config.patch(activation_memory_budget=0.99):  # below 1: recomputation
        report = aotgrad.explain(aotgrad.compile(deeper), p, x, y, argnums=0)
    assert report.recompute_groups
    prims = [e.primitive.name for e in report.backward_jaxpr.jaxpr.eqns]
    assert "optimization_barrier" in prims and "bitcast_convert_type" not in prims


def _tp_mlp(p, x, y):
    """Megatron-style: w1 split by columns, w2 by rows, one psum per layer pair."""
    mesh = jax.sharding.get_abstract_mesh()

    def body(w1, b1, w2, x, y):
        h = jax.nn.gelu(x @ w1 + b1)
        out = lax.psum(h @ w2, "model")
        return lax.pmean(jnp.mean((out - y) ** 2), "data")

    return jax.shard_map(body, mesh=mesh,
                         in_specs=(P(None, "model"), P("model"), P("model", None), P("data", None), P("data", None)),
                         out_specs=P())(p["w1"], p["b1"], p["w2"], x, y)


def _tp_params(mesh):
    p = _mlp_params()
    return {"w1": _put(mesh, p["w1"], None, "model"), "b1": _put(mesh, p["b1"], "model"),
            "w2": _put(mesh, p["w2"], "model", None)}


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_tensor_parallel_mlp_step(config):
    mesh = _mesh()
    x, y = _put(mesh, _normal(7, 32, 16), "data", None), _put(mesh, _normal(8, 32, 8), "data", None)
    _check_steps(_tp_mlp, _tp_params(mesh), x, y, config, mesh)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_tensor_parallel_mlp_by_sharding_annotations(config):
    """The same model left to XLA's partitioner: weights sharded, the hidden layer constrained."""
    def loss(p, x, y):
        h = lax.with_sharding_constraint(jax.nn.gelu(x @ p["w1"] + p["b1"]), P("data", "model"))
        return jnp.mean((h @ p["w2"] - y) ** 2)
    mesh = _mesh()
    x, y = _put(mesh, _normal(7, 32, 16), "data", None), _put(mesh, _normal(8, 32, 8), "data", None)
    _check_steps(loss, _tp_params(mesh), x, y, config, mesh)


# ----------------------------------------------------------------------------- donate_saved

def test_donate_saved_releases_sharded_values():
    mesh = _mesh()
    p = jax.tree.map(lambda a: _put(mesh, a), _mlp_params())
    x, y = _put(mesh, _normal(5, 32, 16), "data", None), _put(mesh, _normal(6, 32, 8), "data", None)
    with aotgrad.config.patch(donate_saved=True):
        fwd, bwd = aotgrad.fwd_and_bwd(_mlp, argnums=0)
        out, saved = fwd(p, x, y)
    activations = saved.arrays[:len(saved.pair.split.activations)]
    grads = bwd(saved, jnp.ones_like(out))
    assert_close(grads, jax.jit(jax.grad(_mlp))(p, x, y))
    assert_same_shardings(grads, p)
    assert activations and all(a.is_deleted() for a in activations)
    assert not any(a.is_deleted() for a in jax.tree.leaves((p, x, y)))
    with pytest.raises(RuntimeError, match="saved values were released after the first backward"):
        bwd(saved, jnp.ones_like(out))


def _tanh_mlp(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2)


def _tanh_inputs() -> tuple[list, jax.Array]:
    return [_normal(i, 128, 128, scale=0.1) for i in range(4)], _normal(9, 2048, 128)


def _smallest_budget(step, *args) -> int:
    """The smallest peak a byte budget can reach, as the error for an unreachable one says."""
    with pytest.raises(aotgrad.BudgetUnreachable) as e, aotgrad.config.patch(activation_memory_budget="1KB"):
        step.lower(*args)
    return e.value.smallest


def test_a_byte_budget_is_per_device():
    """`activation_memory_budget` in bytes is per device. With the batch split over 8
    devices, the smallest peak the error names is about one device's (XLA's per-device
    peak of the step planned at it), not the whole batch's (as it was when the estimate
    counted global shapes); that budget and a larger one plan steps whose gradients are
    JAX's. Both meshes' axis types."""
    ws, x = _tanh_inputs()
    whole = _smallest_budget(jax.jit(jax.grad(aotgrad.compile(_tanh_mlp))), ws, x)
    for mode in MODES:
        mesh = jax.make_mesh((8,), ("data",), axis_types=(MODES[mode],))
        ws_s, x_s = [_put(mesh, w) for w in ws], _put(mesh, x, "data")
        step = jax.jit(jax.grad(aotgrad.compile(_tanh_mlp)))
        with jax.set_mesh(mesh):
            smallest = _smallest_budget(step, ws_s, x_s)
            want = jax.jit(jax.grad(_tanh_mlp))(ws_s, x_s)
            with aotgrad.config.patch(activation_memory_budget=smallest):
                peak = xla_peak(step.lower(ws_s, x_s).compile().memory_analysis())
                assert_close(step(ws_s, x_s), want)
            with aotgrad.config.patch(activation_memory_budget=4 * smallest):
                assert_close(step(ws_s, x_s), want)
        assert smallest < whole / 3, (mode, smallest, whole)
        assert smallest / 2 < peak < 2 * smallest, (mode, smallest, peak)


def test_a_scan_is_weighed_per_device():
    """A scan's levels (each iteration's cut, or its carry every k-th iteration) are
    weighed in bytes per device, as XLA's peak is: with the batch split over 8 devices, a
    batch of 8 R rows is planned as one device plans R rows. The carry is split, the
    stacked weights sliced per iteration are whole on each device; counted globally, the
    carry looked 8 times its share and segments were taken where one device's bytes say
    they do not lower the peak (R = 8: none), while where they do (R = 64) they are kept.
    Gradients are JAX's; both meshes' axis types (with automatic axes the batch's split is
    seen where it is not differentiated: `shards.input_splits`)."""
    n, d = 12, 64

    def fn(ws, x):
        def body(h, w):
            return jnp.tanh(h @ w), None
        h, _ = lax.scan(body, x, ws)
        return jnp.mean(h ** 2)

    ws = _normal(0, n, d, d, scale=0.1)
    for rows in (8, 64):
        x = _normal(1, 8 * rows, d)
        with aotgrad.config.patch(activation_memory_budget=0.0):
            one = aotgrad.explain(aotgrad.compile(fn), ws, x[:rows], argnums=0).scan_segments
            assert (one == ()) == (rows == 8), one
            for mode in MODES:
                mesh = jax.make_mesh((8,), ("data",), axis_types=(MODES[mode],))
                ws_s, x_s = _put(mesh, ws), _put(mesh, x, "data")
                with jax.set_mesh(mesh):
                    f = aotgrad.compile(fn)
                    assert aotgrad.explain(f, ws_s, x_s, argnums=0).scan_segments == one, (mode, rows)
                    assert_close(jax.jit(jax.grad(f))(ws_s, x_s), jax.jit(jax.grad(fn))(ws_s, x_s))


def test_inside_shard_map_the_shapes_are_one_devices():
    """Inside `shard_map` (manual axes) every shape is already one device's: the step's
    estimate counts it whole, as for the same shapes on one device (the smallest byte
    budget is the same), rather than splitting the local batch over the mesh again (it
    was smaller). At that budget the step recomputes and runs, and its gradients are those
    of JAX's own gradient in the same `shard_map` (where the barrier a recomputation waits
    behind once made the replicated weights vary, and their re-bound `pvary` failed)."""
    ws, x = _tanh_inputs()
    one = _smallest_budget(jax.jit(jax.grad(aotgrad.compile(_tanh_mlp))), ws, x[:256])
    mesh = jax.make_mesh((8,), ("data",))
    ws_s, x_s = [_put(mesh, w) for w in ws], _put(mesh, x, "data")

    def in_shard_map(f):
        step = lambda ws, x: jax.lax.pmean(jax.grad(f)(ws, x), "data")  # noqa: E731
        return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))

    sharded = in_shard_map(aotgrad.compile(_tanh_mlp))
    inside = _smallest_budget(sharded, ws_s, x_s)
    assert one / 1.2 < inside < one * 1.2, (inside, one)
    with aotgrad.config.patch(activation_memory_budget=inside):
        assert_close(sharded(ws_s, x_s), in_shard_map(_tanh_mlp)(ws_s, x_s))


def test_varying_axes_are_part_of_the_signature():
    """One compiled function called in two `shard_map`s with the same local shapes, its
    batch varying over the mesh axis in one and replicated in the other: each call gets
    programs traced for its own types (the second once reused the first's and failed:
    a matmul of a varying and a replicated operand), and both gradients are JAX's."""
    mesh = jax.make_mesh((8,), ("data",))

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    def run(f, x, spec):
        step = jax.shard_map(lambda w, x: jax.grad(f)(w, x), mesh=mesh, in_specs=(P(), spec), out_specs=P())
        return jax.jit(step)(w, x)

    w = _put(mesh, _normal(0, 16, 16, scale=0.3))
    varying, replicated = _put(mesh, _normal(1, 64, 16), "data"), _put(mesh, _normal(2, 8, 16))
    f = aotgrad.compile(loss)
    assert_close(run(f, varying, P("data")), run(loss, varying, P("data")))
    assert_close(run(f, replicated, P()), run(loss, replicated, P()))
