"""One rule for argnums across `fwd_and_bwd`, `explain` and `export` (and for static_argnums /
donate_argnums in `compile`): a Python or NumPy int, or a tuple or list of them; negative
numbers count from the end, as in `jax.grad`. Gradients are checked against `jax.grad` /
`jax.value_and_grad` of the same plain function."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aotgrad


def f(w, x, b):
    return jnp.sum(jnp.tanh(x * w + b) ** 2) + jnp.sum(w) * b


# Three arguments of different shapes, so a gradient for the wrong argument cannot pass.
ARGS = (jnp.linspace(0.1, 0.9, 3), jnp.arange(6.0).reshape(2, 3) / 6, jnp.float32(0.3))

# (aotgrad argnums, the same for jax.grad); jax.grad takes a tuple where aotgrad takes a list
GOOD = [
    (0, 0),
    (np.int64(0), 0),
    (np.int32(2), 2),
    (-1, -1),
    ((0, np.int32(1)), (0, 1)),
    ([1], (1,)),
    ((2, 0), (2, 0)),
    ((np.int64(-3), -1), (-3, -1)),
]
BAD_TYPE = ["a", 1.0, True, np.bool_(False), (0, "b"), [0, True], np.array(0), range(2), {0}]
OUT_OF_RANGE = [3, -4, (0, 3), [np.int64(5)]]


def _close(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6), got, want)


def _positions(ref):
    return {i % len(ARGS) for i in ((ref,) if isinstance(ref, int) else ref)}


def _shapes(tree):
    return [tuple(np.shape(leaf)) for leaf in jax.tree.leaves(tree)]


@pytest.mark.parametrize("argnums,ref", GOOD, ids=repr)
def test_fwd_and_bwd_matches_value_and_grad(argnums, ref):
    want_out, want_grads = jax.value_and_grad(f, argnums=ref)(*ARGS)
    fwd, bwd = aotgrad.fwd_and_bwd(f, argnums=argnums)
    out, saved = fwd(*ARGS)
    _close(out, want_out)
    _close(bwd(saved, jnp.ones_like(out)), want_grads)  # single int -> one gradient, as jax.grad


@pytest.mark.parametrize("argnums,ref", GOOD, ids=repr)
def test_export_differentiates_what_argnums_names(argnums, ref):
    exported = aotgrad.export(f, *ARGS, argnums=argnums)
    want_out, want_grads = jax.value_and_grad(f, argnums=ref)(*ARGS)
    out, grads = jax.value_and_grad(exported, argnums=ref)(*ARGS)
    _close(out, want_out)
    _close(grads, want_grads)
    loaded = aotgrad.deserialize(exported.serialize())
    _close(jax.grad(loaded, argnums=ref)(*ARGS), want_grads)
    other = next((i for i in range(len(ARGS)) if i not in _positions(ref)), None)
    if other is not None:  # an argument the export was not asked to differentiate
        with pytest.raises(Exception, match=r"argnums|differentiat"):
            jax.grad(exported, argnums=other)(*ARGS)


@pytest.mark.parametrize("argnums,ref", GOOD, ids=repr)
def test_explain_reports_the_backward_of_argnums(argnums, ref):
    report = aotgrad.explain(f, *ARGS, argnums=argnums)
    want = jax.grad(f, argnums=tuple(sorted(_positions(ref))))(*ARGS)
    # the backward program returns exactly the gradients jax.grad computes (in argument order)
    assert [tuple(v.aval.shape) for v in report.backward_jaxpr.jaxpr.outvars] == _shapes(want)
    fwd, _ = aotgrad.fwd_and_bwd(f, argnums=argnums)
    _, saved = fwd(*ARGS)
    assert report.saved_bytes + report.saved_input_bytes == saved.nbytes
    exported = aotgrad.export(f, *ARGS, argnums=argnums)
    assert exported.explain(*ARGS, argnums=argnums).saved_bytes == exported.explain(*ARGS).saved_bytes


def _entry_points(argnums):
    """Each entry point called with `argnums`, as a zero-argument function."""
    exported = aotgrad.export(f, *ARGS, argnums=(0, 1, 2))

    def fwd_and_bwd():
        fwd, bwd = aotgrad.fwd_and_bwd(f, argnums=argnums)
        out, saved = fwd(*ARGS)
        return bwd(saved, jnp.ones_like(out))
    return {
        "fwd_and_bwd": fwd_and_bwd,
        "explain": lambda: aotgrad.explain(f, *ARGS, argnums=argnums),
        "export": lambda: aotgrad.export(f, *ARGS, argnums=argnums),
        "Exported.explain": lambda: exported.explain(*ARGS, argnums=argnums),
    }


@pytest.mark.parametrize("bad", BAD_TYPE, ids=repr)
def test_argnums_of_another_type_is_a_type_error(bad):
    found = type(bad[1] if isinstance(bad, (tuple, list)) else bad).__name__
    for who, call in _entry_points(bad).items():
        with pytest.raises(TypeError) as info:
            call()
        message = str(info.value)
        assert "argnums takes an int or a sequence of ints" in message, (who, message)
        assert repr(bad) in message and found in message, (who, message)


@pytest.mark.parametrize("bad", OUT_OF_RANGE, ids=repr)
def test_argnums_out_of_range_is_a_value_error(bad):
    for who, call in _entry_points(bad).items():
        with pytest.raises(ValueError, match=r"argnums \[-?\d\] out of range for 3 positional arguments"):
            call()


def test_static_and_donate_argnums_follow_the_same_rule():
    def g(x, n, m):
        return x * n + m

    x = jnp.ones(3)
    for nums in (np.int64(1), (1, np.int32(2)), [1], -2):
        assert aotgrad.compile(g, static_argnums=nums)(x, 2, 3.0).shape == (3,)
    compiled = aotgrad.compile(g, static_argnums=[np.int64(1)])
    exported = aotgrad.export(compiled, x, 2, 3.0)  # the static positions are plain ints in its metadata
    np.testing.assert_allclose(aotgrad.deserialize(exported.serialize())(x, 2, 3.0), x * 2 + 3)
    np.testing.assert_allclose(aotgrad.compile(g, donate_argnums=np.int64(0))(jnp.ones(3), 2, 1.0), 3 * x)
    for name in ("static_argnums", "donate_argnums"):
        for bad, found in (("a", "'a' (str)"), (1.0, "1.0 (float)"), (True, "True (bool)"),
                           ((0, "b"), "element 'b' is a str")):
            with pytest.raises(TypeError, match=rf"{name} takes an int or a sequence of ints .*got "
                                                rf".*{re.escape(found)}"):
                aotgrad.compile(g, **{name: bad})
    with pytest.raises(ValueError, match=r"static_argnums \[3\] out of range"):
        aotgrad.compile(g, static_argnums=np.int64(3))


def test_donate_argnums_out_of_range_is_an_error_as_static_argnums_is():
    """`jax.jit` refuses a donated position the function does not have, at decoration, as
    aotgrad's static_argnums does; donate_argnums=7 on a two-argument function once ran
    silently. With *args the call's positional arguments are what the positions must name."""
    def f(x, y):
        return jnp.sum(x * y)

    with pytest.raises(ValueError, match="donate_argnums"):
        jax.jit(f, donate_argnums=7)  # the reference: JAX refuses it too
    for name in ("static_argnums", "donate_argnums"):
        for bad, out in ((7, "[7]"), (-3, "[-3]"), ((0, 2), "[2]")):
            with pytest.raises(ValueError, match=rf"compile\(.*f\): {name} {re.escape(out)} out of range: "
                                                 r"the function has 2 positional parameters \['x', 'y'\]"):
                aotgrad.compile(f, **{name: bad})

    varargs = aotgrad.compile(lambda *a: a[0] * a[1], donate_argnums=2)
    with pytest.raises(ValueError, match=r"donate_argnums \[2\] out of range: the call passes 2 positional"):
        varargs(jnp.ones(3), 2.0)
    np.testing.assert_allclose(varargs(jnp.ones(3), 2.0, jnp.ones(3)), 2 * np.ones(3))
