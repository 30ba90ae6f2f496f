"""autocast as a context and a trace-time transform: states, tables, and the rewrite,
checked against the dtypes JAX itself computes."""
from __future__ import annotations

import threading

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import aotgrad
from aotgrad._jax_internals import scan_params
from aotgrad.autocast import current_setting
from aotgrad.autocast.context import Setting, current_state
from aotgrad._jax_internals import jax_primitives
from aotgrad.autocast.policy import FP32, LOWER

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def eqns(closed):
    """Every equation, also inside bodies."""
    out = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            out.append(e)
            for v in e.params.values():
                for b in (v if isinstance(v, (tuple, list)) else (v,)):
                    inner = getattr(b, "jaxpr", b)
                    if hasattr(inner, "eqns"):
                        walk(inner)
    walk(closed.jaxpr)
    return out


def casts_to(closed, dtype):
    return [e for e in eqns(closed) if e.primitive is P.convert_element_type_p
            and e.params["new_dtype"] == np.dtype(dtype)]


def float_in_dtypes(closed, prim):
    return [{np.dtype(v.aval.dtype) for v in e.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)}
            for e in eqns(closed) if e.primitive is prim]


# ----------------------------------------------------------------------------- context

def test_context_nesting_inheritance_and_exact_restore():
    assert current_setting() is None
    with aotgrad.autocast("gpu", dtype=BF16):
        assert current_setting() == Setting("gpu", "bfloat16")
        with aotgrad.autocast("cuda"):  # dtype inherited from the enclosing gpu context
            assert current_setting() == Setting("gpu", "bfloat16")
            with aotgrad.autocast("gpu", enabled=False):
                assert current_setting() is None
                with aotgrad.autocast("cpu"):  # device default
                    assert current_setting() == Setting("cpu", "bfloat16")
            assert current_setting() == Setting("gpu", "bfloat16")
        inner = aotgrad.autocast("tpu", F16)
        before = current_state()
        with pytest.raises(RuntimeError):
            with inner:
                raise RuntimeError("boom")
        assert current_state() == before
    assert current_setting() is None
    with aotgrad.autocast("gpu"):
        assert current_setting() == Setting("gpu", "float16")
    with aotgrad.autocast():  # the default backend
        assert current_setting().device_type == jax.default_backend()


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype=F32), "dtype must be jnp.float16 or jnp.bfloat16.*float32"),
    (dict(dtype=jnp.float64), "dtype must be.*float64"),
    (dict(dtype="int8"), "dtype must be"),
    (dict(device_type="xpu"), "device_type must be one of.*'xpu'"),
])
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        aotgrad.autocast(**kwargs)


def test_bad_enabled_and_register_arguments():
    with pytest.raises(TypeError, match="enabled must be True or False"):
        aotgrad.autocast("cpu", enabled="yes")
    with pytest.raises(ValueError, match="policy must be one of"):
        aotgrad.register_autocast_policy("cpu", P.tanh_p, "fp16")
    with pytest.raises(TypeError, match="primitive must be a JAX primitive"):
        aotgrad.register_autocast_policy("cpu", "tanh", "fp32")
    with pytest.raises(ValueError, match="device_type must be one of"):
        aotgrad.register_autocast_policy("npu", P.tanh_p, "fp32")


def test_threads_have_their_own_state():
    results, barrier = {}, threading.Barrier(2)
    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))

    def run(device, dtype):
        with aotgrad.autocast(device, dtype=dtype):
            barrier.wait()  # both threads are inside their contexts at once
            f = aotgrad.autocast(device, dtype=dtype)(lambda a, b: a @ b)
            results[device] = (current_setting(), f(x, w).dtype)

    threads = [threading.Thread(target=run, args=a) for a in (("gpu", F16), ("cpu", BF16))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["gpu"] == (Setting("gpu", "float16"), F16)
    assert results["cpu"] == (Setting("cpu", "bfloat16"), BF16)
    assert current_setting() is None


# ----------------------------------------------------------------------------- tables

def _spd(x):
    return x @ x.T + 4 * jnp.eye(x.shape[0], dtype=x.dtype)


# One small function per table entry, exercising that primitive on a (4, 4) input.
CASES = {
    P.dot_general_p: lambda x: x @ x.T,
    P.conv_general_dilated_p: lambda x: lax.conv(x[None, None], x[None, None, :2, :2], (1, 1), "SAME"),
    P.exp_p: jnp.exp, P.expm1_p: jnp.expm1, P.log_p: lambda x: jnp.log(x + 2),
    P.log1p_p: jnp.log1p, P.pow_p: lambda x: lax.pow(x + 2, x), P.rsqrt_p: lambda x: lax.rsqrt(x + 2),
    P.acos_p: lambda x: lax.acos(x * 0.1), P.asin_p: lambda x: lax.asin(x * 0.1), P.cosh_p: lax.cosh,
    P.sinh_p: lax.sinh, P.tan_p: lax.tan, P.erf_inv_p: lambda x: lax.erf_inv(x * 0.1),
    P.integer_pow_p: lambda x: lax.integer_pow(x + 2, -2),
    P.reduce_sum_p: lambda x: lax.reduce(x, np.array(0, x.dtype), lax.add, (0,)),
    P.reduce_prod_p: lambda x: lax.reduce(x, np.array(1, x.dtype), lax.mul, (0,)),
    P.cumsum_p: lambda x: lax.cumsum(x, 0), P.cumprod_p: lambda x: lax.cumprod(x, 0),
    P.cholesky_p: lambda x: lax.linalg.cholesky(_spd(x)),
    P.qr_p: lambda x: jnp.linalg.qr(x)[1], P.eigh_p: lambda x: jnp.linalg.eigh(_spd(x))[0],
    P.svd_p: lambda x: jnp.linalg.svd(x, compute_uv=False),
    P.lu_p: lambda x: lax.linalg.lu(_spd(x))[0],
    P.triangular_solve_p: lambda x: lax.linalg.triangular_solve(_spd(x), x, left_side=True, lower=True),
}
_RAGGED_DOT = {prim for prim in jax_primitives().get("ragged_dot_general", ())}  # a grouped matmul
for _prim in _RAGGED_DOT:
    CASES[_prim] = lambda x: lax.ragged_dot(x, jnp.stack([x, x]), jnp.array([2, 2], jnp.int32))
_LOG2 = getattr(P, "log2_p", None)  # jax >= 0.11.2 (before: `jnp.log2` is `log` then `div`)
if _LOG2 is not None:
    CASES[_LOG2] = lambda x: jnp.log2(x + 2)
# Linear algebra that JAX (>= 0.11.1) refuses to trace on 16-bit inputs: a user's function cannot
# hand it a 16-bit array, but an autocast matmul can. Its case reads a float32 input through
# a matmul, which autocast runs in 16 bits, so the fp32 policy has a 16-bit value to widen.
REJECTS_16_BIT = {P.cholesky_p, P.qr_p, P.svd_p, P.eigh_p, P.lu_p}
# Entries whose primitive rejects 16-bit inputs at trace time (fft) or needs complex inputs.
NO_CASE = {P.eig_p, P.householder_product_p, P.fft_p, P.select_n_p, P.concatenate_p, P.scatter_p,
           P.scatter_add_p, P.atan2_p}


# The tables, written out by hand from PyTorch's autocast op lists as the design notes map
# them onto lax primitives (docs/autocast.md). `integer_pow` is fp32 for a negative
# exponent only ("fp32 if y < 0"). Not in the cpu table although the notes name them:
# `geqrf` (reached through `qr`, which is listed) and 3-D pooling windows (no primitive of
# their own in JAX).
_GPU_LISTS = {
    "lower_precision_fp": {P.dot_general_p, P.conv_general_dilated_p} | _RAGGED_DOT,
    "fp32": {P.exp_p, P.expm1_p, P.log_p, P.log1p_p, P.pow_p, P.rsqrt_p, P.acos_p, P.asin_p, P.cosh_p,
             P.sinh_p, P.tan_p, P.erf_inv_p, P.reduce_sum_p, P.reduce_prod_p, P.cumsum_p, P.cumprod_p}
            | ({_LOG2} if _LOG2 is not None else set()),
    "fp32 if y < 0": {P.integer_pow_p},
    "promote": {P.concatenate_p, P.scatter_p, P.scatter_add_p, P.select_n_p, P.atan2_p},
}
EXPECTED_TABLES = {
    "gpu": _GPU_LISTS,
    "tpu": _GPU_LISTS,
    "cpu": {
        "lower_precision_fp": {P.dot_general_p, P.conv_general_dilated_p} | _RAGGED_DOT,
        "fp32": {P.fft_p, P.cholesky_p, P.qr_p, P.svd_p, P.eig_p, P.eigh_p, P.lu_p, P.triangular_solve_p,
                 P.householder_product_p, P.reduce_prod_p},
        "promote": {P.concatenate_p, P.scatter_p, P.scatter_add_p, P.select_n_p, P.atan2_p},
    },
}


def _policy_name(rule):
    """A table rule as the names above: a function of params is probed at y = -2 and y = 2."""
    if not callable(rule):
        return rule
    got = (rule({"y": -2}), rule({"y": 2}))
    return "fp32 if y < 0" if got == (FP32, None) else f"function giving {got}"


@pytest.mark.parametrize("device", ["cpu", "gpu", "tpu"])
def test_tables_are_the_hand_written_lists(device):
    """Each device table, primitive by primitive, against the lists written out above: an
    entry moved (log1p to lower_precision_fp), added or dropped fails here."""
    got: dict = {}
    for prim, rule in aotgrad.autocast_policy_table(device).items():
        got.setdefault(_policy_name(rule), set()).add(prim)
    assert got == EXPECTED_TABLES[device]


def test_each_device_table_is_its_own():
    """tpu starts from the gpu lists, but registering for gpu changes gpu alone (and the
    aliases reach the gpu table)."""
    try:
        aotgrad.register_autocast_policy("rocm", P.tanh_p, "fp32")
        assert aotgrad.autocast_policy_table("gpu")[P.tanh_p] == FP32
        assert P.tanh_p not in aotgrad.autocast_policy_table("tpu")
        assert P.tanh_p not in aotgrad.autocast_policy_table("cpu")
    finally:
        aotgrad.register_autocast_policy("gpu", P.tanh_p, None)
    assert P.tanh_p not in aotgrad.autocast_policy_table("gpu")


def _table_rows():
    for device, lists in EXPECTED_TABLES.items():
        for name, prims in lists.items():
            policy = FP32 if name == "fp32 if y < 0" else name
            for prim in sorted(prims, key=lambda p: p.name):  # the same ids, in the same order, in every process
                if policy in (LOWER, FP32) and prim not in NO_CASE:
                    yield pytest.param(device, prim, policy, id=f"{device}-{prim.name}")


@pytest.mark.parametrize("device, prim, policy", list(_table_rows()))
def test_every_table_entry(device, prim, policy):
    """lower_precision_fp: float32 inputs are cast to the autocast dtype; fp32: 16-bit
    inputs are cast to float32. The primitive runs in that type, with the casts visible."""
    fn = CASES[prim]
    dtype = BF16 if device != "gpu" else F16
    x = jnp.linspace(0.1, 0.9, 16, dtype=F32 if policy == LOWER else dtype).reshape(4, 4)
    if prim in REJECTS_16_BIT:
        x, fn = x.astype(F32), (lambda x, _f=fn: _f(x @ jnp.eye(4, dtype=x.dtype)))
    want = dtype if policy == LOWER else F32
    closed = jax.make_jaxpr(aotgrad.autocast(device, dtype=dtype)(fn))(x)
    seen = float_in_dtypes(closed, prim)
    assert seen and all(s == {np.dtype(want)} for s in seen), (prim, seen)
    assert casts_to(closed, want)


def test_lower_precision_applies_to_the_other_16_bit_type():
    x = jnp.ones((4, 4), BF16)
    closed = jax.make_jaxpr(aotgrad.autocast("gpu", F16)(lambda a: a @ a))(x)
    assert float_in_dtypes(closed, P.dot_general_p) == [{np.dtype(F16)}]
    (dot,) = [e for e in eqns(closed) if e.primitive is P.dot_general_p]
    assert dot.params["preferred_element_type"] == np.dtype(F16)


def test_cpu_leaves_exp_in_the_input_dtype_and_accumulates_its_sum_in_fp32():
    x = jnp.ones((4, 4), BF16)
    f = aotgrad.autocast("cpu")(lambda a: lax.reduce(jnp.exp(a), np.array(0, a.dtype), lax.add, (0,)))
    closed = jax.make_jaxpr(f)(x)
    assert float_in_dtypes(closed, P.exp_p) == [{np.dtype(BF16)}]
    assert float_in_dtypes(closed, P.reduce_sum_p) == [{np.dtype(F32)}]
    assert closed.out_avals[0].dtype == BF16


# ----------------------------------------------------------------------------- 16-bit accumulation

def _window_sum(a):
    return lax.reduce_window(a, np.array(0, a.dtype), lax.add, (2, 1), (2, 1), "VALID")


ACCUMULATING_CASES = {
    P.reduce_sum_p: lambda a: lax.reduce_sum(a, (0,)),
    P.cumsum_p: lambda a: lax.cumsum(a, axis=0),
    P.cumprod_p: lambda a: lax.cumprod(a, axis=0),
    P.cumlogsumexp_p: lambda a: lax.cumlogsumexp(a, axis=0),
    P.reduce_window_sum_p: _window_sum,
}


def _rewritten(fn, x, device="cpu", dtype=BF16):
    """`fn`'s jaxpr under autocast, and the casts the rewrite inserted by policy."""
    from aotgrad.autocast.rewrite import Rewriter
    rw, setting = Rewriter(), Setting(device, np.dtype(dtype).name)
    closed = jax.make_jaxpr(lambda a: rw.eval_closed(jax.make_jaxpr(fn)(x), [a], setting))(x)
    return closed, dict(rw.counts)


@pytest.mark.parametrize("prim", list(ACCUMULATING_CASES), ids=lambda p: p.name)
def test_16_bit_summing_reductions_accumulate_in_fp32(prim):
    """cpu table: no policy for these, so a bf16 input stays bf16; the reduction still
    accumulates in float32 and returns bfloat16, with both casts in the jaxpr."""
    x = jnp.linspace(0.1, 0.9, 16, dtype=BF16).reshape(4, 4)
    closed, counts = _rewritten(ACCUMULATING_CASES[prim], x)
    assert float_in_dtypes(closed, prim) == [{np.dtype(F32)}]
    assert casts_to(closed, F32) and casts_to(closed, BF16)
    assert closed.out_avals[0].dtype == BF16
    assert counts == {"accumulate_fp32": 2}


def test_accumulation_applies_to_values_autocast_made_16_bit():
    """A matmul's bf16 output summed: float32 accumulator; float32 and max reductions untouched."""
    def f(a):
        h = a @ a
        return jnp.sum(h, axis=0), jnp.max(h), jnp.sum(a)

    x = jnp.ones((4, 4), F32)
    closed, counts = _rewritten(f, x)
    assert float_in_dtypes(closed, P.reduce_sum_p) == [{np.dtype(F32)}] * 2
    assert float_in_dtypes(closed, P.reduce_max_p) == [{np.dtype(BF16)}]
    assert [a.dtype for a in closed.out_avals] == [BF16, BF16, F32]
    assert counts == {"lower_precision_fp": 2, "accumulate_fp32": 2}
    _, gpu = _rewritten(lambda a: jnp.sum(a @ a), x, "gpu", F16)  # gpu table: reduce_sum is fp32
    assert "accumulate_fp32" not in gpu


def test_bf16_sum_over_many_elements_is_accurate():
    """XLA accumulates a bf16 reduce_sum in bf16: 16384 uniforms sum to 256 without the rule."""
    x = jax.random.uniform(jax.random.key(0), (16, 32, 32)).astype(BF16)
    exact = float(np.asarray(x, np.float64).sum())
    got = jax.jit(aotgrad.autocast("cpu")(lambda a: lax.reduce_sum(a, (0, 1, 2))))(x)
    assert got.dtype == BF16 and abs(float(got) - exact) <= exact * 2.0 ** -8


def test_register_a_policy():
    x = jnp.ones((4,), F32)
    f = aotgrad.autocast("cpu")(jnp.tanh)
    assert f(x).dtype == F32
    aotgrad.register_autocast_policy("cpu", P.tanh_p, "lower_precision_fp")
    try:
        assert aotgrad.autocast_policy_table("cpu")[P.tanh_p] == LOWER
        assert f(x).dtype == BF16
    finally:
        aotgrad.register_autocast_policy("cpu", P.tanh_p, None)
    assert P.tanh_p not in aotgrad.autocast_policy_table("cpu")


# ----------------------------------------------------------------------------- promotion

def _mixed(a, b):
    return a + b


@pytest.mark.parametrize("a, b, want", [
    (BF16, F16, F32),  # the join: no error, unlike PyTorch
    (BF16, F32, F32),
    (F16, F16, F16),
])
def test_promote_is_the_join(a, b, want):
    """After the matmuls are cast, an add of two 16-bit types of different kinds."""
    x = jnp.ones((4, 4), F32)
    wa, wb = jnp.ones((4, 4), a), jnp.ones((4, 4), b)

    def f(x, wa, wb):  # each matmul in its input's dtype: inside enabled=False
        with aotgrad.autocast("cpu", enabled=False):
            return _mixed(x.astype(wa.dtype) @ wa, x.astype(wb.dtype) @ wb)

    out = jax.eval_shape(aotgrad.autocast("cpu")(f), x, wa, wb)
    assert out.dtype == want


@pytest.mark.parametrize("promotion, joined", [("torch", F32), ("jax", BF16)])
def test_explicit_promote_entries_join_inputs(promotion, joined):
    """PyTorch's promotion: the float32 input wins. The "jax" promotion: an input of the
    function follows the 16-bit value it meets."""
    def f(x):
        y = x @ x  # bf16 after the rewrite; x stays float32
        return jnp.concatenate([y, x]), lax.select(x > 0, y, x), lax.atan2(y, y)

    cat, sel, at = jax.eval_shape(aotgrad.autocast("cpu", promotion=promotion)(f), jnp.ones((3, 3)))
    assert (cat.dtype, sel.dtype, at.dtype) == (joined, joined, BF16)


def test_bf16_plus_fp16_promotes_to_fp32_inside_a_table_op():
    # The two inputs of the matmul disagree only after the rewrite: both are cast.
    f = aotgrad.autocast("gpu")(lambda a, b: jnp.concatenate([a, b]))
    assert f(jnp.ones(2, BF16), jnp.ones(2, F16)).dtype == F32


def test_weak_scalars_follow_the_other_operand():
    x, w = jnp.ones((4, 4)), jnp.ones((4, 4))

    def f(x, w):
        y = x @ w  # bf16 under autocast
        return y * 2.0 + 1, jnp.where(y > 0, y, 0.0), lax.max(y, jnp.zeros_like(y))

    a, b, c = jax.eval_shape(aotgrad.autocast("cpu")(f), x, w)
    assert a.dtype == BF16 and b.dtype == BF16
    assert c.dtype == BF16  # zeros built from a literal are constants: they follow too
    closed = jax.make_jaxpr(aotgrad.autocast("cpu")(f))(x, w)
    assert len(casts_to(closed, F32)) == 0


def test_float64_integers_and_bool_are_untouched():
    with jax.enable_x64(True):
        x64 = jnp.ones((3, 3), jnp.float64)
        closed = jax.make_jaxpr(aotgrad.autocast("gpu")(lambda a: jnp.exp(a @ a)))(x64)
        assert not [e for e in eqns(closed) if e.primitive is P.convert_element_type_p]
        assert closed.out_avals[0].dtype == jnp.float64
    i = jnp.arange(9, dtype=jnp.int32).reshape(3, 3)
    closed = jax.make_jaxpr(aotgrad.autocast("gpu")(lambda a, m: (a @ a, m & m)))(i, i > 3)
    assert not [e for e in eqns(closed) if e.primitive is P.convert_element_type_p]
    assert [a.dtype for a in closed.out_avals] == [jnp.int32, jnp.bool_]


def test_enabled_false_region_inside_a_transform():
    x = jnp.ones((4, 4))

    def f(x):
        a = x @ x
        with aotgrad.autocast("cpu", enabled=False):
            b = x @ x
            with aotgrad.autocast("gpu", dtype=F16):
                c = x @ x
        return a, b, c

    a, b, c = aotgrad.autocast("cpu")(f)(x)
    assert (a.dtype, b.dtype, c.dtype) == (BF16, F32, F16)


def test_float16_under_the_cpu_table_is_an_error():
    """The cpu table leaves exp, sums and the softmax in their input's type: float16 there
    would overflow silently (exp(12) is inf in float16), so it is refused, when the context
    is made, entered with the default backend, or named for the backward."""
    with pytest.raises(ValueError, match="float16 is not supported under the cpu table.*device_type='gpu'"):
        aotgrad.autocast("cpu", dtype=F16)
    with pytest.raises(ValueError, match=r"\['device_type'\]|float16 is not supported under the cpu table"):
        aotgrad.config.patch(backward_pass_autocast={"device_type": "cpu", "dtype": "float16"})
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="float16 is not supported under the cpu table"):
            with aotgrad.autocast(dtype=F16):
                pass
    assert aotgrad.autocast("gpu", dtype=F16)(lambda a: jnp.exp(a @ a))(jnp.ones((2, 2))).dtype == F32


# ----------------------------------------------------------------------------- values and transforms

def _mlp(params, x):
    for w, b in params[:-1]:
        x = jax.nn.gelu(x @ w + b)
    w, b = params[-1]
    return jax.nn.log_softmax(x @ w + b).mean()


def _params(key, sizes=(16, 32, 32, 8)):
    keys = jax.random.split(key, len(sizes))
    return [(jax.random.normal(k, (m, n)) / np.sqrt(m), jnp.zeros(n)) for k, m, n in zip(keys, sizes, sizes[1:])]


def _same_as_by_hand(f, by_hand, plain, params, x):
    """`f` (the autocast transform of `plain`) equals `by_hand` under jit, grad and vmap,
    with float32 gradients, and is near `plain`'s float32 value."""
    np.testing.assert_allclose(jax.jit(f)(params, x), jax.jit(by_hand)(params, x), rtol=1e-6)
    g1, g2 = jax.grad(f)(params, x), jax.grad(by_hand)(params, x)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        assert a.dtype == F32
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    batched = jax.vmap(f, in_axes=(None, 0))(params, x[None].repeat(2, 0))
    np.testing.assert_allclose(batched, f(params, x) * np.ones(2), rtol=1e-6)
    np.testing.assert_allclose(f(params, x), plain(params, x), rtol=3e-2)


def test_transform_matches_jax_on_the_same_casts_under_jit_grad_vmap():
    """PyTorch's promotion, written out by hand: the bias adds and everything after them in
    float32."""
    params = _params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 16))
    f = aotgrad.autocast("gpu", dtype=BF16, promotion="torch")(_mlp)

    def by_hand(params, x):  # the same policy written out: matmuls in bf16, rest as the gpu table
        for w, b in params[:-1]:
            h = jnp.matmul(x.astype(BF16), w.astype(BF16), preferred_element_type=BF16)
            x = jax.nn.gelu(h.astype(F32) + b)
        w, b = params[-1]
        h = jnp.matmul(x.astype(BF16), w.astype(BF16), preferred_element_type=BF16).astype(F32) + b
        return jax.nn.log_softmax(h).mean()

    _same_as_by_hand(f, by_hand, _mlp, params, x)


def _mse_mlp(params, x):
    for w, b in params[:-1]:
        x = jax.nn.gelu(x @ w + b)
    w, b = params[-1]
    return jnp.mean(jnp.square(x @ w + b))


def test_jax_promotion_matches_a_hand_written_16_bit_model_under_jit_grad_vmap():
    """The default ("jax") promotion, written out as a JAX user writes a bfloat16 model:
    each float32 weight and bias cast at its use, activations in bfloat16 between layers,
    the gpu table's reduction in float32. Same values and gradients, float32 gradients."""
    params = _params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 16))
    f = aotgrad.autocast("gpu", dtype=BF16)(_mse_mlp)

    def by_hand(params, x):
        x = x.astype(BF16)
        for w, b in params[:-1]:
            x = jax.nn.gelu(jnp.matmul(x, w.astype(BF16), preferred_element_type=BF16) + b.astype(BF16))
        w, b = params[-1]
        h = jnp.matmul(x, w.astype(BF16), preferred_element_type=BF16) + b.astype(BF16)
        return jnp.sum(jnp.square(h).astype(F32)) / h.size

    _same_as_by_hand(f, by_hand, _mse_mlp, params, x)
    hidden = [e for e in jax.make_jaxpr(f)(params, x).eqns if e.primitive is P.tanh_p]  # inside each gelu
    assert hidden and all(e.outvars[0].aval.dtype == BF16 for e in hidden)


@pytest.mark.parametrize("promotion, ys_dtype", [("torch", F32), ("jax", BF16)])
def test_control_flow_keeps_declared_carry_and_branch_dtypes(promotion, ys_dtype):
    """Loop carries and branch outputs keep their declared dtypes, except that under "jax"
    a scan's float32 carry that follows (built from an input) and that the body returns in
    16 bits is carried in 16 bits."""
    w = jnp.eye(4) * 0.5

    def f(x, w):
        def body(c, xs):
            c = jnp.tanh(c @ w) + xs
            return c, c
        c, ys = lax.scan(body, x, jnp.ones((3, 4)))
        c = lax.cond(c.sum() > 0, lambda a: a @ w, lambda a: a, c)
        n, c = lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, s[1] @ w), (0, c))
        c = jax.checkpoint(lambda a: jnp.sin(a @ w))(c)
        return c, ys

    x = jnp.ones((4,))
    g = aotgrad.autocast("cpu", promotion=promotion)(f)
    c, ys = g(x, w)
    # ys: the body's outputs, `tanh(c @ w) + xs`: float32 under PyTorch's promotion (xs, a
    # slice of an input, wins), bfloat16 under "jax" (xs follows)
    assert c.dtype == BF16 and ys.dtype == ys_dtype
    closed = jax.make_jaxpr(g)(x, w)
    assert all(s == {np.dtype(BF16)} for s in float_in_dtypes(closed, P.dot_general_p))
    for prim in (P.scan_p, P.while_p, P.cond_p):
        (e,) = [e for e in closed.jaxpr.eqns if e.primitive is prim]
        # The loop carries and branch outputs keep their declared float32 ...
        kept = e.outvars[:scan_params(e).n_carry] if prim is P.scan_p else e.outvars
        want = ys_dtype if prim is P.scan_p else F32  # ... but a "jax" scan carries in 16 bits
        assert all(v.aval.dtype == want for v in kept if jnp.issubdtype(v.aval.dtype, jnp.floating)), prim
    (cond,) = [e for e in closed.jaxpr.eqns if e.primitive is P.cond_p]
    for branch in cond.params["branches"]:
        assert [v.aval.dtype for v in branch.jaxpr.outvars] == [F32]
    # ... while the matmul branch computes in bfloat16 (then casts back), the other one in float32.
    matmul_branch, = [b for b in cond.params["branches"] if float_in_dtypes(b, P.dot_general_p)]
    assert float_in_dtypes(matmul_branch, P.dot_general_p) == [{np.dtype(BF16)}]
    assert casts_to(matmul_branch, F32)
    np.testing.assert_allclose(c.astype(F32), f(x, w)[0], rtol=5e-2, atol=5e-2)
    grads = jax.grad(lambda w: g(x, w)[1].sum())(w)  # through scan/cond/checkpoint
    assert grads.dtype == F32
    np.testing.assert_allclose(grads, jax.grad(lambda w: f(x, w)[1].sum())(w), rtol=5e-2, atol=5e-2)


def test_custom_jvp_and_custom_vjp_are_rewritten_and_keep_their_rules():
    @jax.custom_vjp
    def sq(x, w):
        return x @ w

    def sq_fwd(x, w):
        return x @ w, (x, w)

    def sq_bwd(res, g):
        x, w = res
        assert x.dtype == F32  # the residuals keep their declared types
        return g @ w.T, x.T @ g

    sq.defvjp(sq_fwd, sq_bwd)
    x, w = jnp.ones((4, 4)), jnp.ones((4, 4)) * 0.1

    def f(x, w):
        return jax.nn.relu(sq(x, w) @ w).sum()  # relu is a custom_jvp function

    g = aotgrad.autocast("cpu")(f)
    closed = jax.make_jaxpr(g)(x, w)
    assert all(s == {np.dtype(BF16)} for s in float_in_dtypes(closed, P.dot_general_p))
    np.testing.assert_allclose(g(x, w), f(x, w), rtol=2e-2)
    gx = jax.grad(g)(x, w)
    assert gx.dtype == F32
    np.testing.assert_allclose(gx, jax.grad(f)(x, w), rtol=2e-2)
    jaxpr = str(jax.make_jaxpr(jax.grad(g))(x, w))
    assert "bf16" in jaxpr


def test_pjit_bodies_are_rewritten():
    inner = jax.jit(lambda a, b: jnp.exp(a @ b))
    x = jnp.ones((4, 4), F16)
    closed = jax.make_jaxpr(aotgrad.autocast("gpu")(lambda a: inner(a.astype(F32), a.astype(F32))))(x)
    assert float_in_dtypes(closed, P.dot_general_p) == [{np.dtype(F16)}]
    assert float_in_dtypes(closed, P.exp_p) == [{np.dtype(F32)}]


# ----------------------------------------------------------------------------- jitted helpers

def _fp32_op(device):
    """An op on the device's fp32 list (hand-picked: exp on gpu/tpu, reduce_prod on cpu)."""
    return jnp.exp if device != "cpu" else (lambda a: jnp.prod(a, axis=0, keepdims=True))


# (policy class, helper op per device, whether `h + op(x)` stays 16-bit under PyTorch's
# promotion); h is 16-bit. Under the "jax" promotion only the fp32 policy's result is wide.
_HELPER_OPS = {
    "lower_precision_fp": (lambda device: lambda a: a @ a, True),
    "fp32": (_fp32_op, False),
    "promote": (lambda device: lambda a: jnp.concatenate([a, a])[:4], False),
    "unlisted": (lambda device: lambda a: a * 3.0, False),
}


@pytest.mark.parametrize("promotion", ["torch", "jax"])
@pytest.mark.parametrize("device", ["cpu", "gpu", "tpu"])
@pytest.mark.parametrize("policy", list(_HELPER_OPS))
def test_a_helper_promotes_the_same_plain_or_jitted(device, policy, promotion):
    """The promotion of a helper's result does not depend on whether the helper is wrapped in
    `jax.jit`: under PyTorch's promotion a value computed from an input is strongly typed
    (float32 wins over the 16-bit matmul result); under "jax" it follows, unless the fp32
    policy made it; a value built from literals alone follows under both. The helper ends
    with a constant, so a flag left over from its last equation shows."""
    make, stays_16_bit = _HELPER_OPS[policy]
    stays_16_bit = stays_16_bit or (promotion == "jax" and policy != "fp32")
    op = make(device)

    def helper(x):
        return op(x), jnp.zeros((4, 4), F32)

    def body(call):
        def f(w, x):
            a, c = call(x)
            h = w @ w  # 16-bit under every table
            return h + a, h + c
        return f

    dtype = {"cpu": BF16, "gpu": F16, "tpu": BF16}[device]
    w = jnp.linspace(0.1, 0.9, 16, dtype=F32).reshape(4, 4)
    x = w.T * 0.5
    results = {}
    for name, call in (("plain", helper), ("jit", jax.jit(helper)), ("nested jit", jax.jit(jax.jit(helper)))):
        out, const = aotgrad.autocast(device, dtype, promotion=promotion)(body(call))(w, x)
        assert out.dtype == (dtype if stays_16_bit else F32), (name, out.dtype)
        assert const.dtype == dtype, (name, const.dtype)
        results[name] = out
    np.testing.assert_array_equal(results["plain"], results["jit"])
    np.testing.assert_array_equal(results["plain"], results["nested jit"])
    # Against a hand-cast reference: the matmul in 16 bits, the helper's op as its policy says.
    h = (w.astype(dtype) @ w.astype(dtype))
    a = op(x.astype(dtype)) if stays_16_bit else op(x)
    np.testing.assert_allclose(np.asarray(results["plain"], np.float32),
                               np.asarray(h.astype(F32) + a.astype(F32), np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name, want", [("cpu", "cpu"), ("gpu", "gpu"), ("cuda", "gpu"), ("rocm", "gpu"),
                                        ("tpu", "tpu"), ("npu", None), ("GPU", None), (3, None)])
def test_one_device_validator_for_context_config_and_tables(name, want):
    """`autocast`, `config.backward_pass_autocast` and the policy tables accept the same
    device names and reject the same ones."""
    if want is None:
        with pytest.raises(ValueError, match="device_type must be one of"):
            aotgrad.autocast(name)
        with pytest.raises(ValueError, match=r"\['device_type'\]: device_type must be one of"):
            aotgrad.config.patch(backward_pass_autocast={"device_type": name})
        with pytest.raises(ValueError, match="device_type must be one of"):
            aotgrad.autocast_policy_table(name)
        return
    assert aotgrad.autocast(name).device_type == want
    with aotgrad.config.patch(backward_pass_autocast={"device_type": name}):
        assert aotgrad.config.backward_pass_autocast[0].device_type == want
    assert aotgrad.autocast_policy_table(name) == aotgrad.autocast_policy_table(want)
