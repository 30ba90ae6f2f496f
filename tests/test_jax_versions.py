"""What differs between the supported JAX versions is read in one place, and the supported
range is enforced at import: too old an installed JAX is refused by name, a newer one works."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import aotgrad
from aotgrad._jax_internals import MIN_JAX, open_jaxpr, scan_params


def _scan_eqn(**kwargs):
    w = jnp.arange(3.0)

    def f(c, h, xs, ys):
        def body(carry, x):
            c, h = carry
            return (c * w[0] + x[0], h + x[1].sum()), jnp.sin(c) + w[1]
        return jax.lax.scan(body, (c, h), (xs, ys), **kwargs)
    closed = jax.make_jaxpr(f)(1.0, 2.0, jnp.ones(5), jnp.ones((5, 2)))
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    return eqn


@pytest.mark.parametrize("reverse, unroll", [(False, 1), (True, 2)])
def test_scan_params_read_operands_and_options(reverse, unroll):
    eqn = _scan_eqn(reverse=reverse, unroll=unroll)
    p = scan_params(eqn)
    assert (p.n_consts + p.n_carry + p.n_xs) == len(eqn.invars)
    assert (p.n_carry, p.n_xs) == (2, 2)  # (c, h); (xs, ys)
    assert (p.length, p.reverse, p.unroll) == (5, reverse, unroll)
    body, consts = open_jaxpr(p.body)
    assert len(body.invars) == len(eqn.invars) + len(body.constvars) - len(consts)
    assert len(body.outvars) == len(eqn.outvars) == 3


def test_a_scan_gradient_matches_jax():
    """The two lines that broke every scan gradient on jax 0.11 and later."""
    f = lambda c, xs: jax.lax.scan(lambda c, x: (jnp.sin(c) * x, c * x), c, xs)[0]
    xs = jnp.linspace(0.5, 1.5, 7)
    got = jax.grad(aotgrad.compile(f), argnums=(0, 1))(0.3, xs)
    want = jax.grad(f, argnums=(0, 1))(0.3, xs)
    for g, w in zip(got, want, strict=True):
        assert jnp.allclose(g, w, rtol=1e-6)


def _import_with_jax_version(version: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import jax
        jax.__version__ = {version!r}
        import aotgrad
        print("imported")
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_an_older_jax_is_refused_by_name():
    done = _import_with_jax_version("0.9.1")
    assert done.returncode != 0
    assert "ImportError: aotgrad needs jax >= " + ".".join(map(str, MIN_JAX)) in done.stderr
    assert "jax 0.9.1 is installed" in done.stderr


def test_a_newer_jax_than_the_newest_tested_is_not_refused():
    done = _import_with_jax_version("99.0.0")
    assert done.returncode == 0, done.stderr
    assert "imported" in done.stdout
