"""User errors not covered elsewhere: each message names the cause."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad


def test_fwd_and_bwd_argnums_naming_a_static_argument():
    f = aotgrad.compile(lambda x, n: jnp.sum(x ** n), static_argnums=1)
    fwd, _ = aotgrad.fwd_and_bwd(f, argnums=(0, 1))
    with pytest.raises(ValueError, match="argnums includes 1, a static argument; only array arguments"):
        fwd(jnp.ones(3), 2)


@pytest.mark.parametrize("name, value, message", [
    ("activation_memory_budget", 1.5, r"activation_memory_budget must be a fraction in \[0, 1\] or a byte size"),
    ("activation_memory_budget", "half", r"activation_memory_budget: a byte size is a number with a unit"),
    ("donate_saved", 1, "donate_saved must be True or False; got 1"),
    ("detect_anomaly", "yes", "detect_anomaly must be True or False; got 'yes'"),
])
def test_bad_option_values_name_the_option(name, value, message):
    with pytest.raises(aotgrad.ConfigError, match=message):
        aotgrad.config.patch(**{name: value})
    with pytest.raises(aotgrad.ConfigError, match=message):
        setattr(aotgrad.config, name, value)


def test_static_argnums_and_argnames_are_checked_at_decoration():
    def f(x, n, *, mode="a"):
        return x * n

    with pytest.raises(ValueError, match=r"static_argnums \[2\] out of range: the function has 2 positional"):
        aotgrad.compile(f, static_argnums=2)
    with pytest.raises(ValueError, match=r"static_argnames \['nn'\] name no parameter.*\['mode', 'n', 'x'\]"):
        aotgrad.compile(f, static_argnames="nn")
    aotgrad.compile(f, static_argnums=-1, static_argnames="mode")  # valid ones pass
    aotgrad.compile(lambda *args, **kw: args[0], static_argnums=3, static_argnames="anything")


def _with_argnums(who, f, w, argnums):
    if who == "fwd_and_bwd":
        fwd, bwd = aotgrad.fwd_and_bwd(f, argnums=argnums)
        out, saved = fwd(w, w)
        return bwd(saved, jnp.ones_like(out))
    if who == "explain":
        return aotgrad.explain(f, w, w, argnums=argnums)
    return aotgrad.export(f, w, w, argnums=argnums)


@pytest.mark.parametrize("who", ["fwd_and_bwd", "explain", "export"])
def test_argnums_of_the_wrong_type_says_what_it_takes(who):
    f = aotgrad.compile(lambda w, x: jnp.sum(w * x))
    w = jnp.ones(3)
    for bad in ("w", 1.0, True, [0, "a"]):
        with pytest.raises(TypeError, match=r"argnums takes an int or a sequence of ints .*got "):
            _with_argnums(who, f, w, bad)
    for good in (np.int64(0), [np.int32(0), 1], (0,)):  # Python and NumPy ints, and sequences of them
        _with_argnums(who, f, w, good)


def test_a_traced_python_scalar_as_a_slice_bound_is_named_with_the_fix():
    """`x[:, :n]` with `n` a traced Python int: JAX raises an IndexError (the slice bound must
    be static); through aotgrad it once named `flat_out` and "argument leaves[1]". It names the
    function and `n`, and says how to make `n` static; JAX's reason is kept. An IndexError of
    the function's own, or with no Python scalar traced, passes through unchanged."""
    def head(x, n):
        return jnp.sum(x[:, :n])

    x = jnp.ones((3, 4))
    with pytest.raises(IndexError) as plain:  # the reference: jax.jit's own error is an IndexError
        jax.jit(head)(x, 2)
    with pytest.raises(IndexError, match=r"compile\(.*head\): tracing needed a concrete value, .*: n \(int 2\)\. "
                                         r".*static_argnums / static_argnames.*python_scalars=\"static\"") as ours:
        jax.grad(aotgrad.compile(head))(x, 2)
    assert str(plain.value).splitlines()[0] in str(ours.value) and "leaves" not in str(ours.value)
    want = jax.grad(head)(x, 2)
    np.testing.assert_array_equal(jax.grad(aotgrad.compile(head, static_argnums=1))(x, 2), want)
    np.testing.assert_array_equal(jax.grad(aotgrad.compile(head, python_scalars="static"))(x, 2), want)

    def own_index_error(x, n):
        return x * n * [1.0][3]

    with pytest.raises(IndexError, match="^list index out of range") as e:
        aotgrad.compile(own_index_error)(x, 2)
    assert "Python scalar" not in str(e.value)

    def array_bound(x, m):
        return jnp.sum(x[:, :m[0]])

    with pytest.raises(IndexError) as e:
        aotgrad.compile(array_bound)(x, jnp.array([2]))
    assert "Python scalar" not in str(e.value)
