"""Device profiles: which device a step is built for, and the table of what each is like."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad
from aotgrad import devices


@pytest.mark.parametrize("platform, kind, name", [
    ("gpu", "NVIDIA H100 80GB HBM3", "h100"),
    ("cuda", "NVIDIA H100 PCIe", "h100"),
    ("gpu", "NVIDIA A100-SXM4-80GB", "a100"),
    ("tpu", "TPU v5 lite", "tpu-v5e"),
    ("gpu", "NVIDIA L4", "gpu"),  # a GPU the table has no numbers for: the platform's habits
    ("tpu", "TPU v4", "tpu"),
    ("cpu", "cpu", "cpu"),
])
def test_device_kinds_find_their_profile(platform, kind, name):
    assert devices._match(platform, kind).name == name


def test_the_table_says_where_its_numbers_come_from():
    h100 = devices.profile_named("h100")
    assert h100.memory_bandwidth == 3.35e12 and h100.flops("bfloat16") == 989.4e12
    assert round(h100.balance("float32")) == 148  # FLOPs per byte moved
    for p in devices.PROFILES:
        assert p.matmul_operands_cost == (p.platform != "cpu")
        assert (p.memory_bandwidth is None) == (not p.matmul_flops)
    with pytest.raises(ValueError, match="no device profile 'h200'"):
        devices.profile_named("h200")


def _reductions():
    """The two reductions of `x - max(x, axis)` on a (64, 32) float32 `x`: over the last
    axis and over the first."""
    x = jnp.ones((64, 32))
    eqns = [jax.make_jaxpr(lambda x: x - jnp.max(x, axis=a, keepdims=True))(x).jaxpr.eqns for a in (1, 0)]
    return [next(e for e in es if e.primitive.name == "reduce_max") for es in eqns]


def test_row_reductions_are_priced_as_the_device_runs_them():
    """XLA:GPU runs a reduction over the last axis in one kernel with the elementwise work
    around it: recomputing one there costs compute (1/16 per byte read, as a fusible op),
    not a re-read of its 64 x 32 x 4 = 8192-byte input. A reduction over another axis, and
    every reduction on a CPU or a TPU, costs the re-read."""
    from aotgrad.partition import costs
    from aotgrad.partition.rules import Kind
    last, first = _reductions()
    for name, want_last in [("h100", 8192 / 16), ("a100", 8192 / 16), ("gpu", 8192 / 16),
                            ("cpu", 8192), ("tpu-v5e", 8192)]:
        p = devices.profile_named(name)
        assert p.row_reductions_fuse == (p.platform == "gpu")
        assert costs.recompute_cost(last, Kind.REDUCE, p) == want_last, name
        assert costs.recompute_cost(first, Kind.REDUCE, p) == 8192, name
    assert costs.recompute_cost(last, Kind.REDUCE) == 8192  # device not known


def test_saving_inside_a_softmax_costs_a_read_of_its_row_where_rows_fuse():
    """A softmax over the last axis of a (64, 32) float32 input (8192 bytes): on a device
    whose row reductions fuse, saving its max, its sum or a per-row value computed from
    them costs one more read of the 8192-byte row (XLA:GPU's one-kernel softmax splits);
    full-size values and the input cost nothing more, nor does anything elsewhere."""
    import importlib
    from cuts import joint_graph
    min_cut = importlib.import_module("aotgrad.partition.min_cut")  # the package exports a function of that name

    def f(x):
        m = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
        e = jnp.exp(x - m)
        return jnp.sum(jnp.log(e / jnp.sum(e, axis=-1, keepdims=True)) ** 2)
    graph = joint_graph(f, jnp.ones((64, 32)))
    fused = min_cut.Problem.of(graph, rows_fuse=True)
    extra = {(str(v.aval.shape), fused.kind_of_value(k).value, float(r))
             for k, (v, r) in enumerate(zip(fused.values, fused.row_reads)) if r}
    assert extra and all(r == 8192.0 and shape in ("(64,)", "(64, 1)") for shape, _, r in extra), extra
    assert not any(r for v, r in zip(fused.values, fused.row_reads) if v.aval.shape == (64, 32))
    assert not min_cut.Problem.of(graph).row_reads.any()


def test_a_transcendental_is_priced_at_the_devices_speed_for_it():
    """Recomputing `exp` costs its output bytes (1.0 per byte: tens of instructions per
    element) where the device's speed for it is not known, and the time its special-function
    units take where it is: H100 3.35e12 B/s / (132 SMs x 16 per clock x 1.98 GHz) / 4 bytes
    = 0.200 per float32 byte, twice that per bfloat16 byte (half the bytes, same time)."""
    from aotgrad.partition import costs
    from aotgrad.partition.rules import Kind

    def exp_cost(device, dtype):
        eqn = jax.make_jaxpr(jnp.exp)(jnp.ones((64, 32), dtype)).jaxpr.eqns[0]
        return costs.recompute_cost(eqn, Kind.CHEAP, device) / (64 * 32 * jnp.dtype(dtype).itemsize)
    h100 = devices.profile_named("h100")
    assert exp_cost(h100, jnp.float32) == pytest.approx(3.35e12 / (132 * 16 * 1.98e9) / 4)
    assert exp_cost(h100, jnp.bfloat16) == pytest.approx(2 * exp_cost(h100, jnp.float32))
    assert exp_cost(devices.profile_named("a100"), jnp.float32) == pytest.approx(0.209, abs=1e-3)
    for name in ("cpu", "tpu-v5e", "gpu"):
        assert exp_cost(devices.profile_named(name), jnp.float32) == 1.0, name
    assert exp_cost(None, jnp.float32) == 1.0


def test_arguments_on_the_host_are_built_for_the_host():
    x = jnp.ones(3)
    assert devices.profile_of([1.0, x]).name == jax.devices()[0].platform
    seen = []
    jax.jit(lambda x: seen.append(devices.profile_of([x])) or x)(x)  # a traced value: the default backend
    assert seen[0].name == jax.devices()[0].platform


def test_explain_names_the_device_it_decided_for():
    f = aotgrad.compile(lambda w, x: jnp.sum(jnp.tanh(x @ w)))
    report = aotgrad.explain(f, jnp.ones((3, 2)), jnp.ones((4, 3)))
    assert report.device == "cpu" and "device='cpu'" in str(report).splitlines()[0]
    np.testing.assert_allclose(jax.grad(f)(jnp.ones((3, 2)), jnp.ones((4, 3))),
                               jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w)))(jnp.ones((3, 2)), jnp.ones((4, 3))))


def test_the_device_count_is_the_first_placed_arguments_mesh():
    """`device_count_of` (which decides whether recomputation waits for weight gradients,
    `schedule._finished`): the mesh size of the first leaf that has one; a Python scalar
    or an unplaced value says nothing; with none placed, 1 (the empty mesh in context)."""
    from types import SimpleNamespace
    eight = SimpleNamespace(sharding=SimpleNamespace(mesh=SimpleNamespace(size=8)))
    assert devices.device_count_of([1.0, eight]) == 8
    assert devices.device_count_of([jnp.ones(3), eight]) == 1  # one host device
    assert devices.device_count_of([2.0]) == 1
    assert devices.device_count_of([]) == 1
