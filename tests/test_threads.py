"""8 threads compiling and running the same and different functions under different
`aotgrad.config.patch` and `aotgrad.autocast` states at once: results equal single-threaded
ones, caches hold exactly the expected entries."""
from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp
import numpy as np

import aotgrad

try:
    from tests.partition_configs import config_id, partitioner_configs
except ImportError:
    from partition_configs import config_id, partitioner_configs

CONFIGS = partitioner_configs(budgets=(0.0, 1.0))
N_THREADS = 8
ROUNDS = 2


def mlp(p, x):
    return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"] ** 2)


def gated(p, x):
    h = x @ p["w1"]
    return jnp.sum(jax.nn.sigmoid(h) * jnp.sin(h) @ p["w2"])


def _params(width):
    k1, k2 = jax.random.split(jax.random.key(width))
    return {"w1": jax.random.normal(k1, (6, width)) * 0.3, "w2": jax.random.normal(k2, (width, 3)) * 0.3}


# What each thread runs: (function, config, autocast state, batch size). Threads 0 and 1,
# 2 and 6, 3 and 4 need the same entry (built by two threads at once); otherwise entries
# differ in function, partitioner, budget, autocast table and dtype, or backward mode.
_OFF = None
_BF16 = ("cpu", jnp.bfloat16)
_FP16 = ("gpu", jnp.float16)
JOBS = [
    (mlp, CONFIGS[0], _OFF, 4),
    (mlp, CONFIGS[0], _OFF, 4),
    (mlp, CONFIGS[1], _BF16, 4),
    (gated, CONFIGS[2], _FP16, 5),
    (gated, CONFIGS[2], _FP16, 5),
    (gated, {**CONFIGS[1], "backward_pass_autocast": "off"}, _FP16, 5),
    (mlp, CONFIGS[1], _BF16, 4),
    (gated, CONFIGS[0], _OFF, 4),
]
assert len(JOBS) == N_THREADS


def _job(t):
    return JOBS[t]


def _autocast(state):
    return contextlib.nullcontext() if state is None else aotgrad.autocast(state[0], dtype=state[1])


def _label(config, state, batch):
    """A hashable name of one cache entry."""
    mode = config.get("backward_pass_autocast", "same_as_forward")
    cast = None if state is None else (state[0], jnp.dtype(state[1]).name)
    return config_id(config), mode, cast, batch


def _work(compiled, t):
    fn, config, state, batch = _job(t)
    f = compiled[fn.__name__]
    p, x = _params(8), jnp.linspace(-1.0, 1.0, batch * 6).reshape(batch, 6) + t % 3
    results = []
    with aotgrad.config.patch(**config), _autocast(state):
        step = jax.jit(jax.value_and_grad(f))
        fwd, bwd = aotgrad.fwd_and_bwd(f, argnums=0)
        for _ in range(ROUNDS):
            out, saved = fwd(p, x)
            results.append((f(p, x), jax.value_and_grad(f)(p, x), step(p, x), out, bwd(saved, jnp.ones_like(out))))
    return results


def _check_against_jax(t, results):
    """One job's results against JAX: `jax.value_and_grad` of the plain function, or of the
    autocast-transformed one (a 16-bit tolerance: the backward modes differ from it by a
    few 16-bit ulps)."""
    fn, config, state, batch = _job(t)
    p, x = _params(8), jnp.linspace(-1.0, 1.0, batch * 6).reshape(batch, 6) + t % 3
    ref = fn if state is None else aotgrad.autocast(state[0], dtype=state[1])(fn)
    value, grads = jax.value_and_grad(ref)(p, x)
    tol = 1e-5 if state is None else 3e-2
    for out, (v1, g1), (v2, g2), fwd_out, bwd_grads in results:
        for got in (out, v1, v2, fwd_out):
            np.testing.assert_allclose(got, value, rtol=tol, err_msg=f"thread {t}: {_job(t)}")
        for got in (g1, g2, bwd_grads):
            jax.tree.map(lambda a, b: np.testing.assert_allclose(
                a, b, rtol=tol, atol=tol * float(jnp.abs(b).max()), err_msg=f"thread {t}: {_job(t)}"), got, grads)


def test_threads_match_single_threaded_and_caches_are_exact():
    single = {fn.__name__: aotgrad.compile(fn) for fn in (mlp, gated)}
    expected = [_work(single, t) for t in range(N_THREADS)]
    for t in range(N_THREADS):  # the single-threaded results are right, not only repeatable
        _check_against_jax(t, expected[t])

    shared = {fn.__name__: aotgrad.compile(fn) for fn in (mlp, gated)}
    results: list = [None] * N_THREADS
    errors: list = []
    barrier = threading.Barrier(N_THREADS)

    def run(t):
        try:
            barrier.wait()
            results[t] = _work(shared, t)
        except BaseException as e:  # reported below, with the thread's number
            errors.append((t, e))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(N_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for t in range(N_THREADS):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7,
                                                             err_msg=f"thread {t}: {_job(t)}"),
                     results[t], expected[t])

    for name, f in shared.items():
        jobs = [(c, state, batch) for fn, c, state, batch in JOBS if fn.__name__ == name]
        want = {_label(c, state, batch) for c, state, batch in jobs}
        info = f.cache_info()
        assert info.entries == len(want) == single[name].cache_info().entries
        # value_and_grad and fwd_and_bwd(argnums=0): one pattern; under "min_cut" the jitted
        # step has a pair of its own (planned as one program, the others run apart)
        staged = {_label(c, state, batch) for c, state, batch in jobs
                  if c.get("partitioner", aotgrad.config.partitioner) != "vjp"}
        assert info.pairs == info.entries + len(staged)
        assert info.hits + info.misses == single[name].cache_info().hits + single[name].cache_info().misses
        # Each job's entry is held, keyed on the job's options and autocast state: traced
        # under them, the job's arguments find it (nothing is traced).
        for c, state, batch in jobs:
            with aotgrad.config.patch(**c), _autocast(state):
                f.trace(_params(8), jnp.zeros((batch, 6)))
        assert f.cache_info().misses == info.misses, name
