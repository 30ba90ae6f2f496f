"""`aotgrad.config.patch` and `aotgrad.autocast` reach an enclosing, already traced `jax.jit`:
aotgrad's program-changing state is part of JAX's jit cache key."""
from __future__ import annotations

import contextlib
import contextvars
import threading

import jax
import jax.numpy as jnp
import numpy as np

import aotgrad


def _loss(w, b, x):
    return jnp.mean(jnp.tanh(x @ w + b) ** 2)


def _inputs():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k1, (16, 32)), jax.random.normal(k2, (32,)) * 0.1,
            jax.random.normal(k3, (8, 16)))


def _state(autocast=None, **options):
    @contextlib.contextmanager
    def enter():
        with aotgrad.config.patch(**options), (
                aotgrad.autocast(*autocast) if autocast else contextlib.nullcontext()):
            yield
    return enter


STATES = [  # (name, state, is new for the step's cache)
    ("plain", _state(), True),
    ("bf16", _state(("cpu", jnp.bfloat16)), True),
    ("bf16, backward off", _state(("cpu", jnp.bfloat16), backward_pass_autocast="off"), True),
    ("gpu fp16 table", _state(("gpu", jnp.float16)), True),
    ("budget 0", _state(activation_memory_budget=0.0), True),
    ("plain again", _state(), False),
    ("bf16 again", _state(("cpu", jnp.bfloat16)), False),
    ("log_recompiles", _state(log_recompiles=True, cache_size_limit=7), False),
]


def test_one_jitted_step_follows_every_state():
    loss = aotgrad.compile(_loss)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    args = _inputs()
    sizes, results = [], {}
    for name, enter, _ in STATES:
        with enter():
            got = step(*args)
            eager = jax.value_and_grad(loss, argnums=(0, 1))(*args)
            fresh = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(*args)  # traced under this state
            misses = loss.cache_info().misses
            loss.trace(*args)  # an entry built under this state is held: nothing is traced
            assert loss.cache_info().misses == misses, name
        sizes.append(step._cache_size())
        results[name] = got
        # Bit for bit what a jit traced under this state gives; close to the eager call (which
        # runs the programs apart, planned otherwise: a few 16-bit ulps apart under autocast).
        rtol = 2e-3 if "16" not in name else 2e-2
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b, err_msg=name), got, fresh)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(
            a, b, rtol=rtol, atol=max(2e-5, rtol * float(jnp.abs(b).max())), err_msg=name), got, eager)
    expected_sizes = list(np.cumsum([new for _, _, new in STATES]))
    assert sizes == expected_sizes
    # The states really give different programs (else the test above proves nothing).
    assert not np.array_equal(results["plain"][1][0], results["bf16"][1][0])
    assert not np.array_equal(results["bf16"][1][0], results["gpu fp16 table"][1][0])
    jax.tree.map(np.testing.assert_array_equal, results["plain"], results["plain again"])


def test_global_default_of_a_keyed_option_retraces():
    loss = aotgrad.compile(_loss)
    step = jax.jit(jax.grad(loss))
    args = _inputs()
    step(*args)
    old = aotgrad.config.partitioner
    try:
        aotgrad.config.partitioner = "vjp"
        step(*args)
        misses = loss.cache_info().misses
        loss.trace(*args)  # an entry built under the new default is held
        assert loss.cache_info().misses == misses
        assert step._cache_size() == 2
        aotgrad.config.log_recompiles = False  # no program changes: no retrace
        step(*args)
        assert step._cache_size() == 2
    finally:
        aotgrad.config.partitioner = old
    step(*args)
    assert step._cache_size() == 2


def test_threads_keep_their_own_state_under_one_step():
    loss = aotgrad.compile(_loss)
    step = jax.jit(jax.grad(loss))
    args = _inputs()
    want = {}
    for label, cast in (("off", None), ("bf16", ("cpu", jnp.bfloat16))):
        with aotgrad.autocast(*cast) if cast else contextlib.nullcontext():
            want[label] = jax.jit(jax.grad(aotgrad.compile(_loss)))(*args)
    got, errors = {}, []

    def run(label, cast):
        try:
            for _ in range(3):
                with aotgrad.autocast(*cast) if cast else contextlib.nullcontext():
                    got[label] = step(*args)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=a) for a in (("off", None), ("bf16", ("cpu", jnp.bfloat16)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for label in want:
        np.testing.assert_array_equal(got[label], want[label], err_msg=label)


def test_context_copied_into_another_thread_is_refused_under_jit():
    loss = aotgrad.compile(_loss)
    step = jax.jit(jax.grad(loss))
    args = _inputs()
    with aotgrad.config.patch(activation_memory_budget=0.0):
        context = contextvars.copy_context()  # the patch, without this thread's jit-key state
    out = {}

    def run():
        try:
            context.run(step, *args)
        except RuntimeError as e:
            out["error"] = str(e)
        out["eager"] = context.run(loss, *args)  # eager calls repair the state and run

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert "differs from the one this thread last entered" in out["error"]
    np.testing.assert_allclose(out["eager"], _loss(*args), rtol=1e-6)
