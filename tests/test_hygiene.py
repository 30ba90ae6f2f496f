"""Memory hygiene: caches stay bounded under new shapes, and what is evicted or dropped is
freed (checked with weak references to entries and program pairs, not with RSS)."""
from __future__ import annotations

import gc
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np

import aotgrad

LIMIT = 3


def _loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def _refs(traced):
    """Weak references to a traced call's entry and to every program pair it holds."""
    return [weakref.ref(traced.entry)] + [weakref.ref(p) for p in traced.pairs.values()]


def test_new_shapes_beyond_the_limit_do_not_accumulate():
    f = aotgrad.compile(_loss)
    fwd, bwd = aotgrad.fwd_and_bwd(f, argnums=0)
    step = jax.jit(jax.value_and_grad(f))
    evicted: list[weakref.ref] = []
    w = jnp.ones((4, 3)) * 0.1
    with aotgrad.config.patch(cache_size_limit=LIMIT), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the one-time eviction warning
        for n in range(1, 13):  # a new batch size, hence a new signature, every time
            x = jnp.ones((n, 4)) * 0.5
            out, saved = fwd(w, x)
            bwd(saved, jnp.ones_like(out))
            jax.grad(f)(w, x)
            f(w, x)
            step(w, x)
            if n <= 12 - LIMIT:  # a shape the cache evicts by the end (it holds the last LIMIT)
                evicted += _refs(f.trace(w, x))
            del out, saved
            assert f.cache_info().entries <= LIMIT
    assert f.cache_info().entries == LIMIT
    assert f.cache_info().misses == 12
    gc.collect()
    alive = [r() for r in evicted if r() is not None]
    assert len(evicted) >= 2 * (12 - LIMIT) and not alive, f"{len(alive)} of {len(evicted)} evicted objects alive"


def test_dropped_function_frees_entries_pairs_and_programs():
    f = aotgrad.compile(_loss)
    w, x = jnp.ones((4, 3)) * 0.1, jnp.ones((2, 4))
    jax.grad(f)(w, x)
    fwd, bwd = aotgrad.fwd_and_bwd(f, argnums=(0, 1))
    out, saved = fwd(w, x)
    bwd(saved, jnp.ones_like(out))
    jax.jit(jax.grad(f))(w, x)
    assert f.cache_info().entries == 1
    refs = _refs(f.trace(w, x)) + [weakref.ref(f)]
    assert len(refs) >= 4
    del f, fwd, bwd, out, saved
    gc.collect()
    assert all(r() is None for r in refs)


def test_saved_values_do_not_outlive_their_use():
    """`Saved` holds the only reference to its activations: dropping it frees them."""
    fwd, bwd = aotgrad.fwd_and_bwd(_loss)
    out, saved = fwd(jnp.ones((4, 3)), jnp.ones((2, 4)))
    np.testing.assert_allclose(bwd(saved, 1.0), jax.grad(_loss)(jnp.ones((4, 3)), jnp.ones((2, 4))), rtol=1e-6)
    arrays = [weakref.ref(a) for a in saved.arrays[:len(saved.pair.split.activations)]]
    assert arrays
    del saved
    gc.collect()
    assert all(r() is None for r in arrays)
