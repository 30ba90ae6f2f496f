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
