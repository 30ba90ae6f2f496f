"""Flax NNX modules as arguments of compiled functions: every Variable update (BatchNorm
statistics, Dropout RNG counters) reaches the caller's objects, eagerly, under `nnx.jit` and
under `jax.jit` of split/merge code, and training matches plain nnx step for step."""
from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad

nnx = pytest.importorskip("flax.nnx")


class Model(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.relu(self.bn(self.l1(x)))))


def _loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _data():
    x = jax.random.normal(jax.random.key(1), (16, 4))
    return x, jnp.sin(x[:, :1])


def _sgd_step(loss_fn):
    def step(model, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
        return loss
    return step


def _plain_arrays(state):
    """Every leaf as a plain array (RNG keys as their key data)."""
    return jax.tree.map(lambda a: jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
                        else a, state)


def _assert_states_equal(got, want):
    got, want = nnx.to_pure_dict(got), nnx.to_pure_dict(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6),
                 _plain_arrays(got), _plain_arrays(want))


def _train(loss_fn, wrap, steps=5):
    model = Model(nnx.Rngs(0, dropout=1))
    step = wrap(_sgd_step(loss_fn))
    x, y = _data()
    losses = [step(model, x, y) for _ in range(steps)]
    return np.array(losses), nnx.state(model)


@pytest.mark.parametrize("wrap", [lambda f: f, nnx.jit], ids=["eager", "nnx.jit"])
def test_sgd_steps_match_plain_nnx(wrap):
    want_losses, want_state = _train(_loss, wrap)
    got_losses, got_state = _train(aotgrad.compile(_loss), wrap)
    np.testing.assert_allclose(got_losses, want_losses, rtol=2e-5)
    _assert_states_equal(got_state, want_state)
    assert int(got_state["drop"]["rngs"]["count"][...]) == 5  # one dropout mask per step
    assert not np.allclose(got_state["bn"]["mean"][...], 0.0)  # the statistics moved


def test_jax_jit_of_split_merge_code():
    def train(loss_fn):
        graphdef, state = nnx.split(Model(nnx.Rngs(0, dropout=1)))
        step = _sgd_step(loss_fn)

        @jax.jit
        def jitted(state, x, y):
            model = nnx.merge(graphdef, state)
            loss = step(model, x, y)
            return loss, nnx.state(model)

        losses = []
        for _ in range(3):
            loss, state = jitted(state, *_data())
            losses.append(loss)
        return np.array(losses), state

    want_losses, want_state = train(_loss)
    got_losses, got_state = train(aotgrad.compile(_loss))
    np.testing.assert_allclose(got_losses, want_losses, rtol=2e-5)
    _assert_states_equal(got_state, want_state)


def test_param_gradients_equal_plain_nnx():
    x, y = _data()
    grads = {}
    for name, fn in (("plain", _loss), ("aotgrad", aotgrad.compile(_loss))):
        model = Model(nnx.Rngs(0, dropout=1))
        grads[name] = nnx.grad(fn)(model, x, y)
    _assert_states_equal(grads["aotgrad"], grads["plain"])


def test_eager_call_updates_state_and_rngs_as_arguments():
    @aotgrad.compile
    def noisy(rngs, bn, x):
        return bn(x + jax.random.normal(rngs.noise(), x.shape))

    rngs, bn = nnx.Rngs(noise=3), nnx.BatchNorm(4, rngs=nnx.Rngs(0))
    ref_rngs, ref_bn = nnx.Rngs(noise=3), nnx.BatchNorm(4, rngs=nnx.Rngs(0))
    x = _data()[0]
    for _ in range(2):
        np.testing.assert_allclose(noisy(rngs, bn, x), noisy.__wrapped__(ref_rngs, ref_bn, x), rtol=1e-5,
                                   atol=1e-6)
    _assert_states_equal(nnx.state((rngs, bn)), nnx.state((ref_rngs, ref_bn)))
    assert int(rngs.noise.count[...]) == 2


def test_update_that_cannot_be_written_back_names_the_variable():
    model = Model(nnx.Rngs(0, dropout=1))
    compiled = aotgrad.compile(_loss)
    x, y = _data()
    # The model is a constant of the jit: its BatchNorm statistics cannot hold the trace's values.
    with pytest.raises(ValueError, match=r"BatchStat at model\['bn'\]\['mean'\]"):
        jax.jit(lambda x: compiled(model, x, y))(x)
    model.eval()  # nothing changes: reading a captured model is fine, as in plain nnx
    np.testing.assert_allclose(jax.jit(lambda x: compiled(model, x, y))(x), _loss(model, x, y), rtol=1e-6)


def test_structural_change_inside_is_an_error():
    @aotgrad.compile
    def grows(model, x):
        model.extra = nnx.Variable(jnp.zeros(()))
        return jnp.sum(model(x))

    with pytest.raises(ValueError, match="changed the structure of the graph node in argument"):
        grows(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), _data()[0])


def test_aotgrad_works_without_flax():
    code = ("import sys; sys.modules['flax'] = None\n"
            "import jax.numpy as jnp, aotgrad\n"
            "f = aotgrad.compile(lambda x: jnp.sum(x ** 2))\n"
            "assert float(f(jnp.ones(3))) == 3.0\n"
            "assert 'flax.nnx' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hooks_on_a_function_of_modules_see_what_the_user_function_has():
    # Before, the hooks of a function taking graph nodes were never run (its inner
    # function on states had hooks of its own): a silently ignored setting.
    f = aotgrad.compile(lambda m, x: jnp.sum(m(x) ** 2))
    plain = lambda m, x: jnp.sum(m(x) ** 2)  # noqa: E731
    m, x = nnx.Linear(3, 2, rngs=nnx.Rngs(0)), jnp.ones((4, 3))
    want = nnx.grad(plain)(m, x)
    seen = []

    def whole(grads, ct):
        seen.append((type(grads[0]).__name__, grads[1], np.shape(ct)))
        return jax.tree.map(lambda g: 2 * g, grads)

    def leaf(grad, path):
        seen.append(path)

    with f.register_prehook(lambda ct: 3 * ct), f.register_hook(whole), f.register_hook(leaf, per_leaf=True):
        got = nnx.grad(f)(m, x)
    assert seen == [("State", None, ()), "m['bias'].value", "m['kernel'].value"]
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, 6 * w, rtol=1e-5), got, want)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5), nnx.grad(f)(m, x), want)
