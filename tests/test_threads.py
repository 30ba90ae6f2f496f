"""8 threads compiling and running the same and different functions under different
`aotgrad.config.patch` states at once: results equal single-threaded ones, caches hold
exactly the expected entries."""
from __future__ import annotations

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


def _job(t):
    """What thread `t` runs: a function, a configuration, a signature (batch size)."""
    return (mlp, gated)[t % 2], CONFIGS[(t // 2) % len(CONFIGS)], (4, 5)[(t // 4) % 2]


def _config_of(options):
    """The `partitioner_configs` entry an entry was built under."""
    config = {"partitioner": options["partitioner"]}
    if config["partitioner"] != "default":
        config["activation_memory_budget"] = options["activation_memory_budget"]
    return config


def _work(compiled, t):
    fn, config, batch = _job(t)
    f = compiled[fn.__name__]
    p, x = _params(8), jnp.linspace(-1.0, 1.0, batch * 6).reshape(batch, 6) + t % 3
    results = []
    with aotgrad.config.patch(**config):
        step = jax.jit(jax.value_and_grad(f))
        fwd, bwd = aotgrad.fwd_and_bwd(f, argnums=0)
        for _ in range(ROUNDS):
            out, saved = fwd(p, x)
            results.append((f(p, x), jax.value_and_grad(f)(p, x), step(p, x), out, bwd(saved, jnp.ones_like(out))))
    return results


def test_threads_match_single_threaded_and_caches_are_exact():
    single = {fn.__name__: aotgrad.compile(fn) for fn in (mlp, gated)}
    expected = [_work(single, t) for t in range(N_THREADS)]

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
        want = {(config_id(c), batch) for fn, c, batch in map(_job, range(N_THREADS)) if fn.__name__ == name}
        got = {(config_id(_config_of(e.options)), e.fwd.in_avals[-1].shape[0]) for e in f._cache.values()}
        assert got == want, name
        info = f.cache_info()
        assert info.entries == len(want) == len(single[name]._cache)
        assert info.pairs == info.entries  # value_and_grad and fwd_and_bwd(argnums=0): one pattern
        assert info.hits + info.misses == single[name].cache_info().hits + single[name].cache_info().misses
