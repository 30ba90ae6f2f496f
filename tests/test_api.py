"""The compile pipeline's contract: paths taken, caching, AOT stages, explain, bad input."""
from __future__ import annotations

import collections.abc
import logging
import os
import typing
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad


def _mlp(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"]) ** 2)


def _params(key=0):
    k1, k2 = jax.random.split(jax.random.key(key))
    return {"w1": jax.random.normal(k1, (6, 8)) * 0.3, "b1": jnp.zeros(8),
            "w2": jax.random.normal(k2, (8, 2)) * 0.3}


X = jnp.linspace(-1.0, 1.0, 24).reshape(4, 6)


def _traced(f, *args):
    """`f.trace(*args)`, where `f` holds one entry, that of these arguments (nothing traced)."""
    before = f.cache_info()
    traced = f.trace(*args)
    assert before.entries == 1 and f.cache_info().misses == before.misses
    return traced


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=rtol, atol=atol), a, b)


# ----------------------------------------------------------------------------- paths

def test_inference_runs_forward_only_program():
    f = aotgrad.compile(_mlp)
    np.testing.assert_allclose(f(_params(), X), _mlp(_params(), X), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(_params(), X), _mlp(_params(), X), rtol=1e-6)
    info = f.cache_info()
    assert info.pairs == 0, "inference must not build a forward program that saves values"
    # The forward-only program returns only the output: nothing saved.
    traced = _traced(f, _params(), X)
    (out_aval,) = traced.entry.forward_only.trace(*traced.inputs).out_info
    assert out_aval.shape == ()


def test_grad_builds_one_pair_and_reuses_it():
    f = aotgrad.compile(_mlp)
    g1 = jax.grad(f)(_params(), X)
    g2 = jax.grad(f)(_params(1), X)
    assert f.cache_info().pairs == 1
    assert f.cache_info().hits == 1
    assert_trees_close(g1, jax.grad(_mlp)(_params(), X))
    assert_trees_close(g2, jax.grad(_mlp)(_params(1), X))


@pytest.mark.parametrize("budget", [1.0, 0.5, "1MB"])
def test_a_jitted_step_gets_a_plan_of_its_own(budget, caplog):
    """A step traced under `jax.jit` is planned as one program (at budget 1 the fused step's
    plan; below, its saved values freed at their last reader), an eager call as two
    programs run apart: each gets a pair of its own, keyed `staged`, and both compute JAX's
    gradients. An eager `vmap` of the gradient runs the programs apart (no new pair); a
    jitted one is staged (the jitted pair again)."""
    staged = [False, True]
    with aotgrad.config.patch(activation_memory_budget=budget, log_recompiles=True):
        f = aotgrad.compile(_mlp)
        eager = jax.grad(f)(_params(), X)
        with caplog.at_level(logging.WARNING, logger="aotgrad"):
            jitted = jax.jit(jax.grad(f))(_params(), X)
        batch = jnp.stack([X, -X])
        mapped = jax.vmap(jax.grad(f), in_axes=(None, 0))(_params(), batch)
        mapped_jit = jax.jit(jax.vmap(jax.grad(f), in_axes=(None, 0)))(_params(), batch)
        pairs = _traced(f, _params(), X).pairs
        eager_report = aotgrad.explain(f, _params(), X)
        jit_report = aotgrad.explain(f, _params(), X, under_jit=True)
    want = jax.grad(_mlp)(_params(), X)
    assert_trees_close(eager, want)
    assert_trees_close(jitted, want)
    want_mapped = jax.vmap(jax.grad(_mlp), in_axes=(None, 0))(_params(), batch)
    assert_trees_close(mapped, want_mapped)
    assert_trees_close(mapped_jit, want_mapped)
    assert sorted(k[2] for k in pairs) == staged
    assert all(p.staged == k[2] and p.graph.staged == k[2] for k, p in pairs.items())
    assert "traced under jax.jit" in caplog.text, caplog.text
    # explain reports the jitted step's plan when asked, and says where each runs
    assert not eager_report.under_jit and "jax.jit" not in str(eager_report).splitlines()[0]
    assert "runs apart" in str(eager_report).splitlines()[0]
    assert jit_report.under_jit and "planned for a step under jax.jit" in str(jit_report)


def test_backward_only_computes_requested_gradients():
    f = aotgrad.compile(_mlp)
    gx = jax.grad(f, argnums=1)(_params(), X)
    np.testing.assert_allclose(gx, jax.grad(_mlp, argnums=1)(_params(), X), rtol=1e-5, atol=1e-7)
    (pair,) = _traced(f, _params(), X).pairs.values()
    assert len(pair.split.backward.out_avals) == 1  # only x's cotangent
    assert [a.shape for a in pair.split.backward.out_avals] == [(4, 6)]
    jax.grad(f)(_params(), X)
    assert f.cache_info().pairs == 2  # the differentiated inputs are part of the key
    backward_outs = sorted(len(p.split.backward.out_avals) for p in _traced(f, _params(), X).pairs.values())
    assert backward_outs == [1, 3]


def test_fwd_and_bwd_only_requested_argnums():
    fwd, bwd = aotgrad.fwd_and_bwd(_mlp, argnums=1)
    out, saved = fwd(_params(), X)
    assert len(saved.pair.split.backward.out_avals) == 1
    gx = bwd(saved, jnp.ones_like(out))
    np.testing.assert_allclose(gx, jax.grad(_mlp, argnums=1)(_params(), X), rtol=1e-5, atol=1e-7)


def test_saved_is_a_pytree_of_arrays():
    fwd, bwd = aotgrad.fwd_and_bwd(_mlp, argnums=0)
    out, saved = fwd(_params(), X)
    leaves = jax.tree.leaves(saved)
    assert leaves and all(isinstance(a, jax.Array) for a in leaves)
    assert saved.nbytes == sum(a.nbytes for a in leaves)
    moved = jax.tree.map(lambda a: jax.device_put(np.asarray(a)), saved)  # offload and back
    assert_trees_close(bwd(moved, 1.0), jax.grad(_mlp)(_params(), X))


def test_saved_inputs_appear_once():
    def f(x, w):
        return jnp.sum((x @ w) * (x @ w) + jnp.sin(x) @ w)
    report = aotgrad.explain(f, X, jnp.ones((6, 3)))
    inputs = [s for s in report.saved if s.is_input]
    assert sorted(s.source for s in inputs) == ["argument w", "argument x"]
    assert report.saved_input_bytes == X.nbytes + 6 * 3 * 4


def test_closed_over_tracers_get_gradients():
    def outer(w, x):
        inner = aotgrad.compile(lambda x: jnp.sum(jnp.sin(x * w)))
        return inner(x)
    want = jax.grad(lambda w, x: jnp.sum(jnp.sin(x * w)), argnums=(0, 1))(X, X + 1)
    assert_trees_close(jax.grad(outer, argnums=(0, 1))(X, X + 1), want)
    assert_trees_close(jax.jit(jax.grad(outer, argnums=(0, 1)))(X, X + 1), want)


def test_closed_over_constants_are_inputs_not_baked_in():
    w = jnp.arange(6.0)
    f = aotgrad.compile(lambda x: jnp.sum(jnp.cos(x * w)))
    np.testing.assert_allclose(jax.grad(f)(X), -jnp.sin(X * w) * w, rtol=1e-6)
    assert len(_traced(f, X).entry.fwd.consts) == 1


def test_static_and_keyword_arguments():
    @aotgrad.compile(static_argnames="power")
    def f(x, *, scale, power):
        return jnp.sum(scale * x ** power)

    g = jax.grad(f)(X, scale=2.0, power=3)
    np.testing.assert_allclose(g, 6.0 * X ** 2, rtol=1e-6)
    f(X, scale=2.0, power=2)
    assert f.cache_info().entries == 2


def test_method_decoration():
    class Model:
        def __init__(self, k):
            self.k = k

        @aotgrad.compile(static_argnums=0)
        def loss(self, x):
            return jnp.sum(x ** 2) * self.k

        def __hash__(self):
            return hash(self.k)

        def __eq__(self, other):
            return isinstance(other, Model) and other.k == self.k

    np.testing.assert_allclose(jax.grad(Model(3.0).loss)(X), 6.0 * X, rtol=1e-6)


def test_donated_argument_is_consumed_on_cpu_or_ignored():
    f = aotgrad.compile(lambda x, y: x * 2 + y, donate_argnums=0)
    x, y = jnp.ones(4), jnp.ones(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some backends cannot donate and say so
        np.testing.assert_allclose(f(x, y), 3.0)
    if jax.default_backend() == "cpu":  # XLA:CPU takes donated buffers: the argument is gone
        assert x.is_deleted() and not y.is_deleted()


def test_a_negative_donated_position_counts_from_the_end():
    # Before, donate_argnums=-1 was compared with non-negative positions: silently nothing.
    f = aotgrad.compile(lambda x, y: x * 2 + y, donate_argnums=-1)
    x, y = jnp.ones(4), jnp.ones(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        np.testing.assert_allclose(f(x, y), 3.0)
    if jax.default_backend() == "cpu":
        assert y.is_deleted() and not x.is_deleted()


def test_lower_without_data():
    f = aotgrad.compile(_mlp)
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (_params(), X))
    lowered = f.lower(*specs)
    assert "stablehlo" in lowered.as_text() or "func.func" in lowered.as_text()
    compiled = lowered.compile()
    mem = compiled.memory_analysis()
    assert set(mem) == {"forward", "backward"}
    assert mem["forward"].output_size_in_bytes > 4  # the output and the saved values
    cost = compiled.cost_analysis()
    assert set(cost) == {"forward", "backward"}
    assert "forward" in compiled.as_text() and "backward" in compiled.as_text()
    assert compiled.timings.compile > 0 and compiled.timings.lower > 0


def test_trace_is_the_entry_of_its_arguments():
    f = aotgrad.compile(_mlp)
    traced = f.trace(_params(), X)
    assert isinstance(traced, aotgrad.Traced) and traced.pairs == {}  # traced; no pair built yet
    assert traced.jaxpr.out_avals[0].shape == () and traced.n_args == 2
    assert traced.paths == ("params['b1']", "params['w1']", "params['w2']", "x")
    assert traced.perturbed(1) == (False, False, False, True)
    pair = traced.pair(1)
    assert traced.pair(perturbed=(False, False, False, True)) is pair
    jax.grad(f, argnums=1)(_params(), X)  # finds the pair `trace` built
    assert f.cache_info().pairs == 1 and traced.pairs == {(pair.perturbed, pair.has_ct, False): pair}
    # Another signature has another entry; these arguments find theirs again.
    other = f.trace(_params(), X[:2])
    assert other.entry is not traced.entry and other.inputs[-1].shape == (2, 6)
    assert f.trace(_params(), X).entry is traced.entry and f.cache_info().entries == 2
    assert other.pairs == {}
    lowered = traced.lower()  # every floating input differentiated, as f.lower
    assert lowered.pair is traced.pair() is not pair and f.cache_info().pairs == 2
    assert lowered.compile().memory_analysis()["backward"] is not None
    with pytest.raises(ValueError, match=r"argnums \[2\] out of range for 2 positional arguments"):
        traced.pair(2)


def test_explain_report():
    with aotgrad.config.patch(partitioner="vjp"):
        report = aotgrad.explain(_mlp, _params(), X)
    acts = [s for s in report.saved if not s.is_input]
    assert report.saved_bytes == sum(s.nbytes for s in acts) > 0
    assert all(s.nbytes == int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in report.saved)
    assert any("test_api.py" in s.source for s in acts), [s.source for s in acts]
    assert {s.primitive for s in acts} >= {"tanh"}
    assert report.forward_jaxpr.jaxpr.eqns and report.backward_jaxpr.jaxpr.eqns
    t = report.timings
    assert t.trace > 0 and t.partition > 0 and t.lower > 0 and t.compile > 0
    text = str(report)
    assert "saved activations" in text and "tanh" in text and "recomputed" in text
    # The default strategy saves what jax.vjp saves.
    _, vjp = jax.vjp(_mlp, _params(), X)
    jax_bytes = sum(a.nbytes for a in jax.tree.leaves(vjp))
    assert report.saved_bytes + report.saved_input_bytes <= jax_bytes + X.nbytes


def test_cache_limit_evicts_and_warns_once():
    f = aotgrad.compile(lambda x: jnp.sum(x ** 2))
    with aotgrad.config.patch(cache_size_limit=2):
        with pytest.warns(UserWarning, match="cache_size_limit=2") as record:
            for n in range(1, 6):
                f(jnp.ones(n))
    assert len([w for w in record if "cache_size_limit" in str(w.message)]) == 1
    assert f.cache_info().entries == 2
    misses = f.cache_info().misses
    f.trace(jnp.ones(4)), f.trace(jnp.ones(5))  # the two most recent are held: nothing traced
    assert f.cache_info().misses == misses


def test_repeated_calls_count_as_hits_and_keep_the_least_recent_evicted():
    # A call with the latest call's signature skips the cache's lookup; it must still count
    # as a hit and leave the latest entry most recent, so eviction drops the right one.
    f = aotgrad.compile(lambda x: jnp.sum(x ** 2))
    with aotgrad.config.patch(cache_size_limit=2), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the one-time eviction warning
        for n in (1, 2, 1, 1, 1, 3):  # 1 is used after 2: 2 is the one evicted by 3
            f(jnp.ones(n))
        assert (f.cache_info().hits, f.cache_info().misses) == (3, 3)
        f(jnp.ones(1)), f(jnp.ones(3))
        assert f.cache_info().misses == 3
        f(jnp.ones(2))
        assert f.cache_info().misses == 4


def test_a_repeated_call_is_served_only_while_its_state_holds():
    # The latest call is recognised without building its key (same tree, leaf types and
    # state); a changed option default, patch, autocast or leaf type must miss it.
    f = aotgrad.compile(lambda x: jnp.sum(jnp.tanh(x) ** 2))
    x = jnp.ones(3)

    def misses_after(call: collections.abc.Callable[[], typing.Any]) -> int:
        call()
        return f.cache_info().misses

    assert misses_after(lambda: (f(x), f(x))) == 1
    old = aotgrad.config.activation_memory_budget
    try:
        aotgrad.config.activation_memory_budget = 0.5  # a default that changes programs
        assert misses_after(lambda: f(x)) == 2
    finally:
        aotgrad.config.activation_memory_budget = old
    with aotgrad.config.patch(partitioner="vjp"):
        assert misses_after(lambda: f(x)) == 3
    with aotgrad.autocast("cpu"):
        assert misses_after(lambda: f(x)) == 4
    assert misses_after(lambda: f(x)) == 4  # the first entry, now the latest call
    assert misses_after(lambda: f(x.astype(jnp.bfloat16))) == 5
    assert misses_after(lambda: f(jnp.ones(3, jnp.int32).astype(jnp.float32))) == 5  # x's type again
    assert misses_after(lambda: f(x=x)) == 6  # the same leaf as a keyword: another tree
    assert misses_after(lambda: f(x)) == 6
    assert f.cache_info().hits == 4
    g = aotgrad.compile(lambda p, s: jnp.sum(p["w"] * s), static_argnums=1)
    w = {"w": x}
    assert (g(w, 2.0), g(w, 2.0), g(w, 3.0)) and (g.cache_info().misses, g.cache_info().hits) == (2, 1)


def test_log_recompiles_names_the_cause(caplog):
    f = aotgrad.compile(lambda params, x: jnp.sum(params["w"] * x))
    with aotgrad.config.patch(log_recompiles=True), caplog.at_level(logging.WARNING, "aotgrad"):
        f({"w": jnp.ones(3)}, jnp.ones(3))
        f({"w": jnp.ones(4)}, jnp.ones(4))
        f({"w": jnp.ones(4, jnp.bfloat16)}, jnp.ones(4))
        with aotgrad.config.patch(backward_pass_autocast="off"):
            f({"w": jnp.ones(4, jnp.bfloat16)}, jnp.ones(4))
        jax.grad(f)({"w": jnp.ones(4, jnp.bfloat16)}, jnp.ones(4))
        jax.grad(f, argnums=1)({"w": jnp.ones(4, jnp.bfloat16)}, jnp.ones(4))
    text = caplog.text
    assert "argument params['w'] changed: float32[3] -> float32[4]" in text
    assert "argument params['w'] changed: float32[4] -> bfloat16[4]" in text
    assert "option aotgrad.config.backward_pass_autocast changed: 'same_as_forward' -> 'off'" in text
    assert "differentiated inputs changed: [d-] -> [-d]" in text
    assert text.count("compiling") == 4  # the call after the patch reuses the first entry


def test_log_recompiles_blames_the_nearest_differentiation_pattern(caplog):
    f = aotgrad.compile(lambda a, b, c: jnp.sum(a * b * c))
    x = jnp.ones(3)
    with aotgrad.config.patch(log_recompiles=True), caplog.at_level(logging.WARNING, "aotgrad"):
        jax.grad(f, argnums=(0, 1))(x, x, x)
        jax.grad(f, argnums=2)(x, x, x)
        jax.grad(f, argnums=(0, 1, 2))(x, x, x)  # one input away from the first pattern
    assert "differentiated inputs changed: [dd-] -> [ddd]" in caplog.text


def test_debug_dir_dumps_both_programs(tmp_path):
    f = aotgrad.compile(_mlp)
    with aotgrad.config.patch(debug_dir=str(tmp_path)):
        jax.grad(f)(_params(), X)
    names = sorted(os.listdir(tmp_path))
    kinds = {n.split(".", 1)[1] for n in names}
    assert kinds == {"forward.jaxpr", "backward.jaxpr", "forward.stablehlo.txt", "backward.stablehlo.txt"}
    assert "tanh" in (tmp_path / [n for n in names if n.endswith("forward.jaxpr")][0]).read_text()


def test_dropped_function_frees_its_cache():
    import gc
    import weakref
    f = aotgrad.compile(lambda x: jnp.sum(jnp.exp(x)))
    jax.grad(f)(X)
    ref = weakref.ref(_traced(f, X).entry)
    del f
    gc.collect()
    assert ref() is None


# ----------------------------------------------------------------------------- forward mode, loops

def test_forward_mode_says_reverse_only():
    f = aotgrad.compile(lambda x: jnp.sin(x))
    with pytest.raises(TypeError, match="reverse-mode only.*jax.jacrev"):
        jax.jvp(f, (X,), (X,))
    with pytest.raises(TypeError, match="reverse-mode only"):
        jax.jacfwd(f)(jnp.ones(3))


def test_while_loop_forward_works_and_grad_gives_jax_error():
    def loop(x):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 1.5), (0, x))[1]
    f = aotgrad.compile(loop)
    np.testing.assert_allclose(f(X), loop(X), rtol=1e-6)
    with pytest.raises(ValueError, match="Reverse-mode differentiation does not work for lax.while_loop"):
        jax.grad(lambda x: jnp.sum(f(x)))(X)


# ----------------------------------------------------------------------------- bad input

def test_non_array_leaves_are_static():
    f = aotgrad.compile(lambda p, x: jax.nn.relu(p["w"] * x) if p["cfg"]["act"] == "relu" else p["w"] * x)
    x = jnp.array([-1.0, 2.0])
    np.testing.assert_allclose(f({"w": jnp.ones(2), "cfg": {"act": "relu"}}, x), [0.0, 2.0])
    np.testing.assert_allclose(f({"w": jnp.ones(2), "cfg": {"act": "none"}}, x), [-1.0, 2.0])
    f({"w": jnp.ones(2), "cfg": {"act": "relu"}}, x)
    assert f.cache_info().entries == 2 and f.cache_info().hits == 1


def test_static_argnums_pointing_at_array():
    f = aotgrad.compile(lambda x, n: x * len(n), static_argnums=1)
    with pytest.raises(TypeError, match=r"marks argument 1 \(n\) as static, but it is an array"):
        f(jnp.ones(2), jnp.ones(2))
    n = [1, 2]  # unhashable: keyed by identity
    np.testing.assert_allclose(f(jnp.ones(2), n), [2.0, 2.0])
    f(jnp.ones(2), n)
    f(jnp.ones(2), [1, 2])
    assert f.cache_info().entries == 2 and f.cache_info().hits == 1


def test_static_and_donated_clash():
    with pytest.raises(ValueError, match="both donate_argnums and static_argnums"):
        aotgrad.compile(lambda x, n: x, static_argnums=1, donate_argnums=1)


def test_not_callable():
    with pytest.raises(TypeError, match="expects a callable"):
        aotgrad.compile(3)


def test_function_returning_non_array():
    f = aotgrad.compile(lambda x: {"y": x, "name": "hello"})
    with pytest.raises(TypeError, match=r"returned a str \('hello'\) at output out\['name'\]"):
        f(jnp.ones(2))


def test_bwd_rejects_wrong_cotangent():
    fwd, bwd = aotgrad.fwd_and_bwd(lambda x: jnp.sin(x) * 2)
    out, saved = fwd(jnp.ones(3))
    with pytest.raises(ValueError, match=r"cotangent at ct is float32\[4\]; expected float32\[3\]"):
        bwd(saved, jnp.ones(4))
    with pytest.raises(ValueError, match=r"cotangent at ct is int32\[3\]; expected float32\[3\]"):
        bwd(saved, jnp.ones(3, jnp.int32))
    with pytest.raises(ValueError, match="has structure"):
        bwd(saved, (jnp.ones(3),))


def test_bwd_rejects_foreign_saved():
    fwd, bwd = aotgrad.fwd_and_bwd(lambda x: jnp.sin(x) * 2)
    fwd2, _ = aotgrad.fwd_and_bwd(lambda x: jnp.cos(x) * 2)
    fwd3, _ = aotgrad.fwd_and_bwd(lambda x, y: x * y, argnums=(0, 1))
    _, saved2 = fwd2(jnp.ones(3))
    _, saved3 = fwd3(jnp.ones(3), jnp.ones(3))
    with pytest.raises(ValueError, match="produced by another forward"):
        bwd(saved2, jnp.ones(3))
    with pytest.raises(ValueError, match="produced by another forward"):
        bwd(saved3, jnp.ones(3))
    with pytest.raises(TypeError, match="expects the `saved` returned by its fwd"):
        bwd([jnp.ones(3)], jnp.ones(3))


def test_saved_of_another_signature_cannot_take_a_mismatched_cotangent():
    fwd, bwd = aotgrad.fwd_and_bwd(lambda x: jnp.sin(x) * 2)
    _, saved5 = fwd(jnp.ones(5))
    with pytest.raises(ValueError, match=r"expected float32\[5\].*forward that produced `saved`"):
        bwd(saved5, jnp.ones(3))
    np.testing.assert_allclose(bwd(saved5, jnp.ones(5)), 2 * jnp.cos(jnp.ones(5)), rtol=1e-6)


def test_fwd_and_bwd_bad_argnums():
    fwd, _ = aotgrad.fwd_and_bwd(lambda x: x * 2, argnums=3)
    with pytest.raises(ValueError, match=r"argnums \[3\] out of range for 1 positional"):
        fwd(jnp.ones(2))
    with pytest.raises(ValueError, match="must name at least one"):
        aotgrad.fwd_and_bwd(lambda x: x, argnums=())


def test_has_aux_requires_a_pair():
    fwd, _ = aotgrad.fwd_and_bwd(lambda x: jnp.sum(x), has_aux=True)
    with pytest.raises(TypeError, match=r"must return a pair \(output, aux\)"):
        fwd(jnp.ones(2))


def test_has_aux():
    def f(x):
        return jnp.sum(x ** 2), {"mean": jnp.mean(x), "n": jnp.int32(3)}
    fwd, bwd = aotgrad.fwd_and_bwd(f, has_aux=True)
    out, saved, aux = fwd(X)
    jfwd, jbwd = jax.fwd_and_bwd(f, argnums=0, has_aux=True)
    jout, jres, jaux = jfwd(X)
    assert_trees_close((out, aux), (jout, jaux))
    assert_trees_close(bwd(saved, 1.0), jbwd(jres, jnp.ones(())))


def _aux_loss(w, x):
    def layer(h, _):
        h = jnp.tanh(h @ w)
        return h, jnp.sin(h)
    h, per_step = jax.lax.scan(layer, x, None, length=3)
    big = jnp.cos(h) @ w
    return jnp.sum(h ** 2), {"big": big, "steps": per_step, "n": jnp.int32(3)}


@pytest.mark.parametrize("wrap", [lambda g: g, jax.jit], ids=["eager", "jit"])
def test_aux_outputs_are_not_backward_inputs(wrap):
    # Auxiliary outputs get symbolic-zero cotangents: the backward must not read zeros
    # for them (materialized zeros cost memory and time) and gradients must equal JAX's.
    w = jax.random.normal(jax.random.key(1), (6, 6)) * 0.3
    f = aotgrad.compile(_aux_loss)
    (out, aux), g = wrap(jax.value_and_grad(f, has_aux=True))(w, X)
    (want, want_aux), want_g = jax.value_and_grad(_aux_loss, has_aux=True)(w, X)
    assert_trees_close((out, aux, g), (want, want_aux, want_g))
    jaxpr = jax.make_jaxpr(jax.value_and_grad(f, has_aux=True))(w, X).jaxpr
    *_, forward, backward = [e for e in jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    reads = [v for v in backward.invars if not isinstance(v, jax.extend.core.Literal)]
    # Saved activations and inputs only; the loss cotangent is the literal 1.0.
    assert set(reads) <= set(forward.outvars[4:]) | set(jaxpr.invars), \
        "the backward reads cotangents built outside the forward"


def test_hessian_forward_over_reverse_matches_jax():
    def f(x):
        return jnp.sum(jnp.sin(x) * x ** 2)
    x = jnp.linspace(0.1, 1.0, 4)
    np.testing.assert_allclose(jax.hessian(aotgrad.compile(f))(x), jax.hessian(f)(x), rtol=1e-5, atol=1e-6)


def test_explain_argnums_matches_what_fwd_and_bwd_saves():
    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w) * jnp.sin(x).sum())
    w, x = jnp.ones((6, 3)) * 0.1, X
    fwd, _ = aotgrad.fwd_and_bwd(f, argnums=0)
    _, saved = fwd(w, x)
    report = aotgrad.explain(f, w, x, argnums=0)
    assert report.saved_bytes + report.saved_input_bytes == saved.nbytes
    everything = aotgrad.explain(f, w, x)
    # x's gradient needs more saved values (w, here, for x's cotangent)
    assert everything.saved_bytes + everything.saved_input_bytes > report.saved_bytes + report.saved_input_bytes
    with pytest.raises(ValueError, match=r"argnums \[2\] out of range"):
        aotgrad.explain(f, w, x, argnums=2)


def test_log_recompiles_blames_the_nearest_cached_key(caplog):
    f = aotgrad.compile(lambda x, n: x * n, static_argnames="n")
    with aotgrad.config.patch(log_recompiles=True), caplog.at_level(logging.WARNING, "aotgrad"):
        f(jnp.ones(4), n=1)
        f(jnp.ones(8), n=1)  # the most recent key
        caplog.clear()
        f(jnp.ones(4), n=2)  # nearest cached key: shape 4, n=1
    messages = [r.getMessage() for r in caplog.records if "compiling" in r.getMessage()]
    assert len(messages) == 1
    assert "static argument n changed: 1 -> 2" in messages[0]
    assert "float32[8]" not in messages[0], messages[0]


def test_compile_keeps_the_signature_for_type_checkers():
    """`AOTFunction` is generic over the wrapped function's parameters and result, and
    `compile`'s overloads say so for the bare and the configured decorator."""
    from aotgrad.api import function

    assert function.AOTFunction.__parameters__ == (function.P, function.R)
    call = typing.get_type_hints(function.AOTFunction.__call__)
    assert (call["args"], call["kwargs"], call["return"]) == (function.P.args, function.P.kwargs, function.R)
    bare, configured = (typing.get_type_hints(o)["return"] for o in typing.get_overloads(aotgrad.compile))
    assert bare == function.AOTFunction[function.P, function.R]
    assert typing.get_origin(configured) is collections.abc.Callable
    assert typing.get_args(configured)[1] == function.AOTFunction[function.P, function.R]
    assert aotgrad.AOTFunction[[int, float], int] is not None  # subscriptable as a type


def test_argument_types_are_keyed_exactly_through_the_key_cache(monkeypatch):
    """A call's cache key holds each leaf's type (`signature.leaf_key`), remembered per type
    (JAX's types are interned). Arrays that differ only in dtype, shape or weak type get
    entries of their own, also once the remembered keys were dropped for being too many;
    the same types hit, with JAX's values."""
    from aotgrad import signature
    monkeypatch.setattr(signature, "_MAX_KEYS", 2)
    monkeypatch.setattr(signature, "_KEYS", {})  # (whatever earlier tests left, it fills up here)
    f = aotgrad.compile(lambda x: jnp.sum(jnp.sin(x) * 2))
    cases = [jnp.ones(3), jnp.ones(3, jnp.bfloat16), jnp.ones(4), jnp.array(1.0, jnp.float32), 1.0]
    for _ in range(2):
        for x in cases:
            got, want = f(x), jnp.sum(jnp.sin(x) * 2)
            assert got.dtype == want.dtype and jnp.allclose(got, want)
            assert signature.leaf_key(x) == signature.aval_key(jax.typeof(x))
    assert f.cache_info().entries == len({signature.aval_key(jax.typeof(x)) for x in cases}) == 5
    assert len(signature._KEYS) <= 2


def test_the_forward_only_program_is_named_after_the_function():
    """Called inside a jit without differentiation, the forward-only program is a call
    named after the function, as `jax.jit(model)` names its own (it was "<unnamed
    function>", and JAX printed the whole forward trace to name it)."""
    @aotgrad.compile
    def model(w, x):
        return jnp.tanh(x @ w).sum()

    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    model(w, x)  # run once eagerly: the jit below calls the same forward-only program
    text = jax.jit(model).lower(w, x).as_text()
    assert "unnamed" not in text
