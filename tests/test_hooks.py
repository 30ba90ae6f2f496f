"""Backward hooks: every kind against a hand-written `jax.custom_vjp` equivalent in plain JAX.

The sharded cases (per-leaf psum under `shard_map`, the order of collectives in the backward
jaxpr) are in `tests/hooks_sharded_cases.py`, run in the process of 8 simulated devices that
the 8-device modules share (`tests/own_process.py`).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad

try:
    from tests.own_process import assert_eight_device_module_passed
except ImportError:
    from own_process import assert_eight_device_module_passed


def _params():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {"w1": jax.random.normal(k1, (6, 5)) * 0.5, "w2": jax.random.normal(k2, (5, 3)) * 0.5}, \
        jax.random.normal(k3, (4, 6))


def _loss(p, x):
    h = jnp.tanh(x @ p["w1"])
    return jnp.sum((h @ p["w2"]) ** 2)


def _with_ct_and_grad_map(fn, ct_map, grad_map):
    """Plain-JAX reference: a custom_vjp around `fn` whose bwd maps the incoming cotangent,
    runs JAX's own vjp, and maps the gradients (written out independently of aotgrad)."""
    @jax.custom_vjp
    def g(p, x):
        return fn(p, x)

    def fwd(p, x):
        out, vjp = jax.vjp(fn, p, x)
        return out, vjp

    def bwd(vjp, ct):
        gp, gx = vjp(ct_map(ct))
        return grad_map(gp, gx)

    g.defvjp(fwd, bwd)
    return g


def _close(got, want, rtol=1e-5, atol=1e-6):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def test_prehook_scales_the_cotangent():
    f = aotgrad.compile(_loss)
    p, x = _params()
    handle = f.register_prehook(lambda ct: ct * 3.0)
    want = jax.value_and_grad(_with_ct_and_grad_map(_loss, lambda c: c * 3.0, lambda gp, gx: (gp, gx)))(p, x)
    _close(jax.value_and_grad(f)(p, x), want)
    handle.remove()
    _close(jax.grad(f)(p, x), jax.grad(_loss)(p, x))


def test_whole_hook_sees_one_entry_per_argument_and_the_cotangent():
    f = aotgrad.compile(_loss)
    p, x = _params()
    seen = []

    def clip(grads, ct):
        seen.append((jax.tree.structure(grads), ct.shape))
        gp, gx = grads
        return ({k: jnp.clip(v, -0.5, 0.5) * ct for k, v in gp.items()}, gx)

    f.register_hook(clip)
    ref = _with_ct_and_grad_map(_loss, lambda c: c, lambda gp, gx: (jax.tree.map(lambda v: jnp.clip(v, -0.5, 0.5),
                                                                                gp), gx))
    _close(jax.grad(f)(p, x), jax.grad(ref)(p, x))
    # argument 1 not differentiated: None
    assert seen[0][0] == jax.tree.structure(({"w1": 0, "w2": 0}, None)) and seen[0][1] == ()
    _close(jax.grad(f, argnums=(0, 1))(p, x), jax.grad(ref, argnums=(0, 1))(p, x))


def test_per_leaf_hooks_run_in_registration_order_last_used_leaf_first():
    f = aotgrad.compile(_loss)
    p, x = _params()
    order = []
    f.register_hook(lambda g, path: order.append(path) or g * 2.0, per_leaf=True)
    f.register_hook(lambda g, path: g + 1.0, per_leaf=True)  # after the first: (2g + 1)
    ref = _with_ct_and_grad_map(_loss, lambda c: c, lambda gp, gx: (jax.tree.map(lambda v: v * 2.0 + 1.0, gp), gx))
    _close(jax.grad(f)(p, x), jax.grad(ref)(p, x))
    assert order == ["p['w2']", "p['w1']"]  # w2 is used last in the forward: its gradient is final first


def test_grad_hook_matches_plain_jax_and_saves_nothing_more():
    def model(p, x, hooked):
        h = jnp.tanh(x @ p["w1"])
        if hooked:
            h = aotgrad.grad_hook(h, lambda ct: jnp.clip(ct, -0.1, 0.1))
        return jnp.sum(jnp.sin(h @ p["w2"]))

    @jax.custom_vjp
    def clip_ct(h):
        return h
    clip_ct.defvjp(lambda h: (h, None), lambda _, ct: (jnp.clip(ct, -0.1, 0.1),))

    def ref(p, x):
        return jnp.sum(jnp.sin(clip_ct(jnp.tanh(x @ p["w1"])) @ p["w2"]))

    p, x = _params()
    f = aotgrad.compile(model, static_argnums=2)
    want = jax.value_and_grad(ref)(p, x)
    _close(jax.value_and_grad(f)(p, x, True), want)
    _close(jax.value_and_grad(model)(p, x, True), want)  # plain jax.grad, no aotgrad around it
    assert not np.allclose(want[1]["w1"], jax.grad(model)(p, x, False)["w1"])  # the hook matters here
    with aotgrad.config.patch(partitioner="min_cut"):
        plain = aotgrad.explain(f, p, x, False)
        hooked = aotgrad.explain(f, p, x, True)
    assert hooked.saved_bytes == plain.saved_bytes


def test_hooks_rebuild_only_the_backward_and_removal_is_a_cache_hit():
    traces = []

    def loss(p, x):
        traces.append(1)
        return _loss(p, x)

    f = aotgrad.compile(loss)
    p, x = _params()
    hook_traces = []

    def prehook(ct):
        hook_traces.append(1)
        return ct * 2.0

    g0 = jax.grad(f)(p, x)
    info0 = f.cache_info()
    (pair,) = f.trace(p, x).pairs.values()
    forward_program = pair.forward
    handle = f.register_prehook(prehook)
    _close(jax.grad(f)(p, x), jax.tree.map(lambda v: 2.0 * v, g0))
    jax.grad(f)(p, x)  # the same hooks again: the same backward program
    info1 = f.cache_info()
    assert (info1.entries, info1.pairs, info1.backwards) == (info0.entries, info0.pairs, info0.backwards + 1)
    (pair,) = f.trace(p, x).pairs.values()
    assert pair.forward is forward_program
    assert len(traces) == 1  # the function is traced once (the joint graph is built from that trace)
    handle.remove()
    _close(jax.grad(f)(p, x), g0)
    handle = f.register_prehook(prehook)  # the same function again is a new hook: a new program
    jax.grad(f)(p, x)
    assert f.cache_info().backwards == info1.backwards + 1
    handle.remove()
    jax.grad(f)(p, x)
    assert f.cache_info().backwards == info1.backwards + 1 and len(traces) == 1
    assert len(hook_traces) == 2  # traced once per program, never again on a hit


def test_jitted_step_retraces_when_hooks_change():
    f = aotgrad.compile(_loss)
    p, x = _params()
    step = jax.jit(jax.grad(f))
    g0 = step(p, x)
    handle = f.register_hook(lambda g, path: -g, per_leaf=True)
    _close(step(p, x), jax.tree.map(jnp.negative, g0))
    handle.remove()
    _close(step(p, x), g0)


def test_vmap_and_fwd_and_bwd():
    f = aotgrad.compile(_loss)
    p, xs = _params()
    xs = jnp.stack([xs, 2 * xs])
    f.register_prehook(lambda ct: ct * 0.5)
    f.register_hook(lambda g, path: g + 1.0, per_leaf=True)
    ref = _with_ct_and_grad_map(_loss, lambda c: c * 0.5, lambda gp, gx: (jax.tree.map(lambda v: v + 1.0, gp), gx))
    _close(jax.vmap(jax.grad(f), (None, 0))(p, xs), jax.vmap(jax.grad(ref), (None, 0))(p, xs))
    fwd, bwd = aotgrad.fwd_and_bwd(f, argnums=0)
    out, saved = fwd(p, xs[0])
    _close(bwd(saved, jnp.ones_like(out)), jax.grad(ref)(p, xs[0]))


def test_has_aux_prehook_sees_none_for_the_aux_output():
    @aotgrad.compile
    def f(p, x):
        return _loss(p, x), jnp.sum(x)

    p, x = _params()
    seen = []
    f.register_prehook(lambda ct: seen.append(ct) or (ct[0] * 2.0, ct[1]))
    fwd, bwd = aotgrad.fwd_and_bwd(f, argnums=0, has_aux=True)
    out, saved, aux = fwd(p, x)
    _close(bwd(saved, jnp.ones_like(out)), jax.tree.map(lambda v: 2.0 * v, jax.grad(_loss)(p, x)))
    assert seen[0][1] is None
    seen.clear()  # under jax.grad(has_aux=True) the aux cotangent is a symbolic zero: None too
    _close(jax.grad(f, has_aux=True)(p, x)[0], jax.tree.map(lambda v: 2.0 * v, jax.grad(_loss)(p, x)))
    assert seen[0][1] is None


def test_debug_callback_in_a_hook_fires_once_per_backward():
    f = aotgrad.compile(_loss)
    p, x = _params()
    norms = []
    f.register_hook(lambda g, ct: jax.debug.callback(norms.append, jnp.sqrt(sum(
        jnp.sum(v ** 2) for v in jax.tree.leaves(g)))))
    step = jax.jit(jax.grad(f))
    for _ in range(3):
        g = step(p, x)
    jax.effects_barrier()
    want = np.sqrt(sum(np.sum(np.asarray(v) ** 2) for v in jax.tree.leaves(g)))
    assert len(norms) == 3 and np.allclose(norms, want)


def test_loss_scaling_prehook_reproduces_dynamic_loss_scale():
    f = aotgrad.compile(_loss)
    p, x = _params()
    scale = aotgrad.DynamicLossScale(loss_scale=jnp.asarray(2.0 ** 10, jnp.float32))
    want = scale.unscale(jax.grad(lambda q: scale.scale(_loss(q, x)))(p))
    f.register_prehook(lambda ct: scale.scale(ct))
    f.register_hook(lambda grads, ct: (scale.unscale(grads[0]), None))
    _close(jax.grad(f)(p, x), want)


def test_hook_returning_a_wrong_shape_or_structure_names_the_hook_and_the_leaf():
    f = aotgrad.compile(_loss)
    p, x = _params()

    def bad_leaf(g, path):
        return g[:1] if path == "p['w1']" else g

    h = f.register_hook(bad_leaf, per_leaf=True)
    with pytest.raises(ValueError, match=r"per-leaf hook .*bad_leaf returned float32\[1, 5\] at p\['w1'\]"):
        jax.grad(f)(p, x)
    h.remove()
    h = f.register_hook(lambda g, ct: g[0])
    with pytest.raises(ValueError, match="returned a value of structure"):
        jax.grad(f)(p, x)
    h.remove()
    f.register_prehook(lambda ct: ct.astype(jnp.float16))
    with pytest.raises(ValueError, match=r"prehook .* returned float16\[\] at ct; expected float32\[\]"):
        jax.grad(f)(p, x)
    with pytest.raises(ValueError, match=r"aotgrad.grad_hook: grad_hook .* returned float32\[2\]"):
        jax.grad(lambda v: jnp.sum(aotgrad.grad_hook(v, lambda ct: ct[:2])))(jnp.ones(3))


def test_export_refuses_hooks():
    f = aotgrad.compile(_loss)
    p, x = _params()
    h = f.register_prehook(lambda ct: ct)
    with pytest.raises(aotgrad.ExportError, match="backward hook"):
        aotgrad.export(f, p, x)
    h.remove()
    exported = aotgrad.export(f, p, x)
    with pytest.raises(aotgrad.ExportError, match="hooks cannot be added"):
        exported.register_hook(lambda g, ct: g)


def test_sharded_hooks_on_8_devices():
    assert_eight_device_module_passed("hooks_sharded_cases.py")
