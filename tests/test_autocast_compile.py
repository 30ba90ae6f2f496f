"""autocast in compiled functions: the cache key, the forward rewrite, and the three
`backward_pass_autocast` modes, checked against JAX (values and gradients)."""
from __future__ import annotations

import functools
import logging

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad
from tests.test_autocast import BF16, F16, F32, _mlp, _params, eqns, float_in_dtypes

F16_SET, F32_SET, BF16_SET = {np.dtype(F16)}, {np.dtype(F32)}, {np.dtype(BF16)}


def _loss(x, w, b):
    return jnp.sum(jnp.exp(x @ w + b))


def _inputs(dtype=F16):
    k1, k2 = jax.random.split(jax.random.key(0))
    return ((jax.random.normal(k1, (8, 16)) * 0.1).astype(dtype),
            (jax.random.normal(k2, (16, 4)) * 0.1).astype(dtype), jnp.zeros(4, dtype))


def _pair(fn, args, mode, device="gpu", dtype=F16):
    cf = aotgrad.compile(fn)
    with aotgrad.config.patch(backward_pass_autocast=mode), aotgrad.autocast(device, dtype=dtype):
        pair = cf.trace(*args).pair()
        grads = jax.grad(cf, argnums=tuple(range(len(args))))(*args)
    return pair, grads


def test_three_backward_modes_build_different_backward_programs():
    args = _inputs(F16)
    same, g_same = _pair(_loss, args, "same_as_forward")
    off, g_off = _pair(_loss, args, "off")
    bf16, g_bf16 = _pair(_loss, args, {"dtype": jnp.bfloat16})
    # The forward program is identical in all three.
    assert str(same.split.forward) == str(off.split.forward) == str(bf16.split.forward)
    assert float_in_dtypes(same.split.forward, P.dot_general_p) == [F16_SET]
    # same_as_forward (gpu table): the bias gradient is accumulated in float32; off: not.
    assert F32_SET in float_in_dtypes(same.split.backward, P.reduce_sum_p)
    assert all(s == F16_SET for s in float_in_dtypes(off.split.backward, P.reduce_sum_p))
    # An explicit bfloat16 backward under a float16 forward: the backward matmuls in bfloat16.
    assert all(s == BF16_SET for s in float_in_dtypes(bf16.split.backward, P.dot_general_p))
    assert all(s == F16_SET for s in float_in_dtypes(same.split.backward, P.dot_general_p))
    # Input cotangents come back in the inputs' dtypes, and close to each other.
    for gs in (g_same, g_off, g_bf16):
        assert [g.dtype for g in gs] == [F16] * 3
    reference = jax.grad(_loss, argnums=(0, 1, 2))(*[a.astype(F32) for a in args])
    for gs, tol in ((g_same, 1e-2), (g_off, 1e-2), (g_bf16, 3e-2)):
        for g, r in zip(gs, reference):
            np.testing.assert_allclose(g.astype(F32), r, rtol=tol, atol=tol * float(jnp.abs(r).max()))
    assert same.casts.backward and not off.casts.backward and bf16.casts.forward == off.casts.forward


def test_enabled_false_region_stays_out_of_autocast_in_its_backward():
    def region(x, w, b):
        z = x @ w
        with aotgrad.autocast("gpu", enabled=False):
            z = z + b  # its backward: the bias gradient's reduction
        return jnp.sum(jnp.exp(z))

    args = _inputs(F16)
    pair, grads = _pair(region, args, "same_as_forward")
    assert all(s == F16_SET for s in float_in_dtypes(pair.split.backward, P.reduce_sum_p))
    assert all(s == F16_SET for s in float_in_dtypes(pair.split.forward, P.dot_general_p))
    assert [g.dtype for g in grads] == [F16] * 3
    # The disabled region's backward is JAX's own (nothing autocast in it): as jax.vjp of
    # the transformed function, and close to float32.
    want = jax.grad(aotgrad.autocast("gpu")(region), argnums=(0, 1, 2))(*args)
    exact = jax.grad(region, argnums=(0, 1, 2))(*[a.astype(F32) for a in args])
    for g, w, e in zip(grads, want, exact):
        np.testing.assert_allclose(g.astype(F32), w.astype(F32), rtol=5e-3, atol=5e-3 * float(jnp.abs(w).max()))
        np.testing.assert_allclose(g.astype(F32), e, rtol=2e-2, atol=2e-2 * float(jnp.abs(e).max()))


def test_off_equals_jax_grad_of_the_transformed_function():
    params = _params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 16))
    cf = aotgrad.compile(_mlp)
    with aotgrad.config.patch(backward_pass_autocast="off"), aotgrad.autocast("gpu", dtype=BF16):
        loss, grads = jax.value_and_grad(cf)(params, x)
    expected_loss, expected = jax.jit(jax.value_and_grad(aotgrad.autocast("gpu", dtype=BF16)(_mlp)))(params, x)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    # The same equations; XLA may fuse a bf16 rounding away differently in two programs
    # than in one, so values agree to a bfloat16 ulp, not bit for bit.
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        assert g.dtype == e.dtype == F32
        np.testing.assert_allclose(g, e, rtol=1e-2, atol=1e-2 * float(jnp.abs(e).max()))
    with aotgrad.config.patch(backward_pass_autocast="off"), aotgrad.autocast("gpu", dtype=BF16):
        pairs = cf.trace(params, x).pairs
    assert cf.cache_info().entries == 1 and len(pairs) == 1
    assert all(not p.casts.backward for p in pairs.values())  # nothing rewritten in the backward


def _block(p, x):
    """A pre-LN transformer block: attention (4 heads) and a GELU MLP."""
    def norm(h, g):
        mu = h.mean(-1, keepdims=True)
        return (h - mu) * jax.lax.rsqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g

    B, T, D = x.shape
    h = norm(x, p["g1"])
    q, k, v = (h @ p[n] for n in ("wq", "wk", "wv"))
    split = lambda a: a.reshape(B, T, 4, D // 4).transpose(0, 2, 1, 3)  # noqa: E731
    att = jax.nn.softmax(split(q) @ split(k).swapaxes(-1, -2) / np.sqrt(D // 4), axis=-1)
    x = x + (att @ split(v)).transpose(0, 2, 1, 3).reshape(B, T, D) @ p["wo"]
    x = x + jax.nn.gelu(norm(x, p["g2"]) @ p["w1"]) @ p["w2"]
    return jnp.mean(x ** 2)


def _block_params(D=32):
    ks = jax.random.split(jax.random.key(2), 6)
    p = {n: jax.random.normal(k, (D, D)) / np.sqrt(D) for n, k in zip(("wq", "wk", "wv", "wo"), ks)}
    p.update(w1=jax.random.normal(ks[4], (D, 4 * D)) / np.sqrt(D),
             w2=jax.random.normal(ks[5], (4 * D, D)) / np.sqrt(4 * D), g1=jnp.ones(D), g2=jnp.ones(D))
    return p


def _rel_err(grads, reference):
    return max(float(jnp.max(jnp.abs(g.astype(F32) - r)) / jnp.max(jnp.abs(r)))
               for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)))


_EXPLICIT = {"device_type": "gpu", "dtype": "float16"}


@functools.cache
def _float32_reference(model: str):
    """(fn, params, x, float32 gradients by `jax.jit(jax.grad(fn))`), once per model."""
    if model == "mlp":
        fn, params, x = _mlp, _params(jax.random.key(0)), jax.random.normal(jax.random.key(1), (8, 16))
    else:
        fn, params, x = _block, _block_params(), jax.random.normal(jax.random.key(1), (2, 8, 32))
    return fn, params, x, jax.jit(jax.grad(fn))(params, x)


@pytest.mark.parametrize("model, mode, device, dtype, tol", [
    ("mlp", "same_as_forward", "gpu", F16, 2e-2), ("mlp", "off", "gpu", F16, 2e-2),
    ("mlp", _EXPLICIT, "cpu", BF16, 6e-2), ("mlp", "same_as_forward", "cpu", BF16, 6e-2),
    ("block", "same_as_forward", "gpu", F16, 2e-2), ("block", "off", "cpu", BF16, 6e-2),
    ("block", _EXPLICIT, "gpu", BF16, 2e-2), ("block", "same_as_forward", "tpu", BF16, 6e-2),
])
def test_gradients_close_to_float32(model, mode, device, dtype, tol):
    fn, params, x, reference = _float32_reference(model)
    cf = aotgrad.compile(fn)
    with aotgrad.config.patch(backward_pass_autocast=mode), aotgrad.autocast(device, dtype=dtype):
        grads = jax.grad(cf)(params, x)
    assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
    assert _rel_err(grads, reference) < tol


def _conv_bn(p, x, y):
    """A convolution, batch-norm with batch statistics over N, H, W (2048 values), ReLU."""
    h = jax.lax.conv_general_dilated(x, p["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    mu = jnp.mean(h, axis=(0, 1, 2))
    var = jnp.mean(jnp.square(h - mu), axis=(0, 1, 2))
    h = jax.nn.relu((h - mu) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"])
    return jnp.mean(jnp.square(h @ p["head"] - y))


@pytest.mark.parametrize("mode", ["same_as_forward", {"device_type": "cpu"}])
def test_conv_batch_norm_gradients_close_to_float32_under_the_cpu_table(mode):
    """The cpu table leaves reductions in bf16 after a bf16 convolution; they accumulate in
    float32 (forward statistics, backward bias and scale gradients), else the gradients
    are off by more than 100%."""
    rng = np.random.default_rng(3)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), F32)  # noqa: E731
    params = {"w": normal(3, 3, 3, 16) / np.sqrt(27), "g": jnp.ones(16), "b": jnp.zeros(16),
              "head": normal(16, 4) / 4}
    x, y = normal(8, 16, 16, 3), normal(8, 16, 16, 4)
    pair, grads = _pair(_conv_bn, (params, x, y), mode, "cpu", BF16)
    assert _rel_err(grads[0], jax.jit(jax.grad(_conv_bn))(params, x, y)) < 6e-2  # max 0.013 (w)
    assert dict(pair.casts.backward)["accumulate_fp32"] > 0
    for program in (pair.split.forward, pair.split.backward):
        assert all(s == F32_SET for s in float_in_dtypes(program, P.reduce_sum_p))


def test_cache_key_separates_autocast_states(caplog):
    cf = aotgrad.compile(_loss)
    args = _inputs(F32)
    plain = cf(*args)
    with aotgrad.config.patch(log_recompiles=True), caplog.at_level(logging.WARNING, logger="aotgrad"):
        with aotgrad.autocast("cpu"):
            low = cf(*args)
            cf(*args)
    assert cf.cache_info().entries == 2 and cf.cache_info().hits == 1
    assert "autocast changed: off -> autocast('cpu', dtype=bfloat16)" in caplog.text
    # cpu table: `x @ w + b` and exp in bfloat16 (b follows), the sum accumulated in float32
    assert plain.dtype == F32 and low.dtype == BF16
    np.testing.assert_allclose(np.float32(low), plain, rtol=3e-2)
    with aotgrad.autocast("cpu", enabled=False):
        cf(*args)  # disabled: the plain entry again
    assert cf.cache_info().entries == 2


def test_vjp_inside_the_block_backward_outside():
    params = _params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 16))
    cf = aotgrad.compile(_mlp)
    with aotgrad.autocast("cpu", dtype=BF16):
        loss, vjp_fn = jax.vjp(cf, params, x)
    grads, _ = vjp_fn(jnp.ones_like(loss))
    assert _rel_err(grads, jax.grad(_mlp)(params, x)) < 6e-2


def test_explain_counts_casts_by_policy():
    cf = aotgrad.compile(_mlp)
    params, x = _params(jax.random.key(0)), jnp.ones((8, 16))
    plain = aotgrad.explain(cf, params, x)
    assert plain.casts.total == 0 and "autocast casts" not in str(plain)
    with aotgrad.autocast("gpu", dtype=BF16):
        report = aotgrad.explain(cf, params, x)
    forward = dict(report.casts.forward)
    # 3 matmuls: each weight, and the first one's input (later inputs are 16-bit already:
    # each bias follows the matmul's result, so the activations stay 16-bit)
    assert forward["lower_precision_fp"] == 4 and forward["follow"] == 3
    assert "autocast casts: forward: lower_precision_fp x4" in str(report)
    n_converts = sum(e.primitive is P.convert_element_type_p for e in eqns(report.forward_jaxpr))
    assert n_converts >= 6
    saved_dtypes = {s.dtype for s in report.saved if not s.is_input}
    assert "bfloat16" in saved_dtypes  # 16-bit where the forward computed in 16 bits


def test_autocast_decorator_on_a_compiled_function_and_inner_contexts():
    cf = aotgrad.compile(_loss)
    args = _inputs(F32)
    low = aotgrad.autocast("cpu")(cf)
    np.testing.assert_allclose(low(*args), jax.jit(aotgrad.autocast("cpu")(_loss))(*args), rtol=1e-6)

    @aotgrad.compile
    def inner(x, w, b):
        with aotgrad.autocast("cpu"):  # a context inside a compiled function
            z = x @ w
        return z, jnp.sum(jnp.exp(z + b))

    def by_hand(x, w, b):  # the matmul in bfloat16; the rest promoted to float32
        z = jnp.matmul(x.astype(BF16), w.astype(BF16), preferred_element_type=BF16)
        return z, jnp.sum(jnp.exp(z + b))

    z, out = inner(*args)
    want_z, want_out = by_hand(*args)
    assert z.dtype == BF16 and out.dtype == F32
    np.testing.assert_array_equal(z, want_z)
    np.testing.assert_allclose(out, want_out, rtol=1e-4)
    g = jax.grad(lambda *a: inner(*a)[1], argnums=1)(*args)
    assert g.dtype == F32
    np.testing.assert_allclose(g, jax.grad(lambda *a: by_hand(*a)[1], argnums=1)(*args), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- off vs same_as_forward

@jax.custom_vjp
def _proj(x, m):
    return x @ m


def _proj_fwd(x, m):
    return x @ m, (x, m)


def _proj_bwd(res, g):  # a backward with matmuls of the cotangent
    x, m = res
    return g @ m.T, x.T @ g


_proj.defvjp(_proj_fwd, _proj_bwd)


def _proj_loss(x, m, c):
    return jnp.sum(jnp.tanh(_proj(x, m)) * c)


def _proj_grads_by_hand(x, m, c, backward_dtype):
    """The gradients written out: the forward's matmul in bfloat16 (cpu table), the user's
    backward matmuls in `backward_dtype` (float32: JAX's vjp of the autocast forward, which
    is what "off" must give; bfloat16: the backward autocast as the forward, "same_as_forward")."""
    def mm(a, b, dtype):  # a matmul in `dtype`, its result in `dtype` (as autocast specifies)
        return jnp.matmul(a.astype(dtype), b.astype(dtype), preferred_element_type=dtype).astype(F32)
    h = mm(x, m, BF16)
    ct = c * (1 - jnp.tanh(h) ** 2)
    return mm(ct, m.T, backward_dtype), mm(x.T, ct, backward_dtype)


def _proj_args(batch=None):
    """x and m hold halves in [-1, 1], so the forward's bfloat16 matmul is exact (however XLA
    fuses its rounding); the cotangents of the backward are not."""
    rng = np.random.default_rng(0)
    lead = () if batch is None else (batch,)
    return (jnp.asarray(rng.integers(-2, 3, (*lead, 8, 4)) / 2, F32), jnp.asarray(rng.integers(-2, 3, (4, 4)) / 2, F32),
            jnp.asarray(rng.uniform(0.5, 2, (8, 4)), F32))


_BACKWARD_DTYPE = {"off": F32, "same_as_forward": BF16}


@pytest.mark.parametrize("call", ["grad", "jit", "vmap"])
@pytest.mark.parametrize("mode", ["off", "same_as_forward"])
def test_off_and_same_as_forward_differ_as_written_by_hand(mode, call):
    """A backward whose own matmuls read the cotangent (a custom_vjp rule): "off" runs them
    in float32, as JAX's vjp of the autocast forward does; "same_as_forward" in bfloat16.
    The two differ by ~3e-3, so one mode acting as the other fails: "off" is checked to
    1e-5, "same_as_forward" to bfloat16 precision and must not match float32."""
    x, m, c = _proj_args(batch=4 if call == "vmap" else None)
    cf = aotgrad.compile(_proj_loss)
    grad = jax.grad(cf, argnums=(0, 1))
    with aotgrad.config.patch(backward_pass_autocast=mode), aotgrad.autocast("cpu"):
        if call == "vmap":
            got = jax.vmap(grad, in_axes=(0, None, None))(x, m, c)
        else:
            got = (jax.jit(grad) if call == "jit" else grad)(x, m, c)
        report = aotgrad.explain(cf, x[0] if call == "vmap" else x, m, c)
    want_dtype = np.dtype(_BACKWARD_DTYPE[mode])
    assert float_in_dtypes(report.backward_jaxpr, P.dot_general_p) == [{want_dtype}, {want_dtype}]
    assert float_in_dtypes(report.forward_jaxpr, P.dot_general_p) == [BF16_SET]  # the same forward
    by_hand = _proj_grads_by_hand
    if call == "vmap":
        by_hand = jax.vmap(by_hand, in_axes=(0, None, None, None))
    if mode == "off":  # also JAX's own vjp of the autocast function
        reference = jax.grad(aotgrad.autocast("cpu")(_proj_loss), argnums=(0, 1))
        if call == "vmap":
            reference = jax.vmap(reference, in_axes=(0, None, None))
        for g, r in zip(got, reference(x, m, c)):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    for g, w, w32 in zip(got, by_hand(x, m, c, _BACKWARD_DTYPE[mode]), by_hand(x, m, c, F32)):
        assert g.dtype == F32
        if mode == "off":
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        else:  # to a bfloat16 tolerance: XLA may skip roundings around a fused matmul (excess precision)
            np.testing.assert_allclose(g, w, rtol=1e-2, atol=1e-2)
            assert not np.allclose(g, w32, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- two programs

_SMALL = {"mlp": dict(batch=32, width=64, depth=3),
          "transformer_block": dict(batch=2, seq=32, d_model=64, heads=4),
          "gpt": dict(batch=2, seq=32, d_model=64, heads=4, layers=2, vocab=128),
          "gpt_scan": dict(batch=2, seq=32, d_model=64, heads=4, layers=2, vocab=128),
          "convnet": dict(batch=4, image=16, channels=[8, 16], classes=10),
          "rnn": dict(batch=8, seq=16, d_in=16, hidden=64)}


@pytest.mark.parametrize("kind", list(_SMALL))
def test_two_programs_pass_16_bit_values_under_bf16_autocast(kind):
    """Where forward and backward run apart (`explain` plans an eager call), bf16 autocast
    saves at most 0.55x the float32 step's activation bytes: no value crosses in float32
    where its 16-bit source could cross (a scan's residual stream or hidden state included:
    under PyTorch's promotion the RNN's hidden state crosses in float32, 0.72x)."""
    from benchmarks.workloads import build
    w = build(kind, kind, _SMALL[kind])
    plain = aotgrad.explain(aotgrad.compile(w.loss_fn), w.params, w.batch, argnums=0)
    with aotgrad.autocast("gpu", dtype=BF16):
        low = aotgrad.explain(aotgrad.compile(w.loss_fn), w.params, w.batch, argnums=0)
    assert low.saved_bytes <= 0.55 * plain.saved_bytes, (low.saved_bytes, plain.saved_bytes)
    wide = sum(s.nbytes for s in low.saved if not s.is_input and s.dtype == "float32")
    assert wide <= 0.05 * low.saved_bytes, [(s.shape, s.primitive) for s in low.saved if s.dtype == "float32"]
