"""aotgrad against JAX itself, over the program corpus in `tests/corpus.py`.

For every program, on the same inputs:
  - inference: `aotgrad.compile(fn)(*args)` equals `fn(*args)`;
  - value and gradients (`jax.value_and_grad` for scalar outputs, `jax.vjp` with a fixed
    random cotangent otherwise) of the compiled function equal those of `fn`, eagerly and
    under an outer `jax.jit`;
  - `jax.vjp` of the compiled function w.r.t. every dynamic argument equals JAX's;
  - `aotgrad.fwd_and_bwd` equals `jax.fwd_and_bwd` (values and gradients), also with the
    forward and backward called inside `jax.jit`.
References are computed by plain JAX on the undecorated function, once per program.
Then a few focused tests: jacrev, vmap, partial argnums, while_loop, forward mode.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import aotgrad
try:
    from tests.corpus import BY_NAME, PROGRAMS, Program
except ImportError:  # tests/ itself on sys.path (pytest's rootdir-less "prepend" import mode)
    from corpus import BY_NAME, PROGRAMS, Program

# ----------------------------------------------------------------------------- helpers


def assert_trees_close(actual: Any, expected: Any, rtol: float, atol: float) -> None:
    """Same tree structure; every leaf the same shape and dtype and numerically close."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected), (
        f"tree structure differs:\n  actual:   {jax.tree.structure(actual)}\n"
        f"  expected: {jax.tree.structure(expected)}")

    def check(a: Any, e: Any) -> None:
        a_dtype, e_dtype = jnp.result_type(a), jnp.result_type(e)
        assert np.shape(a) == np.shape(e), f"shape {np.shape(a)} != expected {np.shape(e)}"
        assert a_dtype == e_dtype, f"dtype {a_dtype} != expected {e_dtype}"
        if e_dtype == jax.dtypes.float0:
            return  # symbolic zero cotangents: shape and dtype are all there is
        a_np, e_np = np.asarray(a), np.asarray(e)
        if e_dtype == jnp.bfloat16:
            a_np, e_np = a_np.astype(np.float32), e_np.astype(np.float32)
        np.testing.assert_allclose(a_np, e_np, rtol=rtol, atol=atol)

    jax.tree.map(check, actual, expected)


def _nums(prog: Program) -> tuple[int, ...]:
    return (prog.argnums,) if isinstance(prog.argnums, int) else tuple(prog.argnums)


def _dynamic(prog: Program, args: tuple) -> list:
    return [a for i, a in enumerate(args) if i not in prog.static_argnums]


def _rebuild(prog: Program, args: tuple, dyn: Any) -> tuple:
    """`args` with the dynamic ones replaced by `dyn` (static ones kept as Python values)."""
    it = iter(dyn)
    return tuple(a if i in prog.static_argnums else next(it) for i, a in enumerate(args))


def _is_scalar(out: Any) -> bool:
    """A single float scalar (an array, a ShapeDtypeStruct or a Python float)."""
    return (hasattr(out, "shape") or isinstance(out, float)) and np.shape(out) == () and \
        jnp.issubdtype(jnp.result_type(out), jnp.floating)


def make_cotangent(out: Any, seed: int = 1234) -> Any:
    """A fixed random cotangent for `out` (leaves: arrays or ShapeDtypeStructs); float0
    zeros for integer leaves."""
    rng = np.random.default_rng(seed)

    def one(x: Any) -> Any:
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            return np.zeros(x.shape, jax.dtypes.float0)
        return jnp.asarray(rng.standard_normal(x.shape).astype(np.float32), x.dtype)
    return jax.tree.map(one, out)


def value_and_grads(f: Any, prog: Program, args: tuple, kwargs: dict, ct: Any) -> tuple[Any, Any]:
    """(value, gradients w.r.t. prog.argnums): `jax.value_and_grad` when `f` returns a float
    scalar, else `jax.vjp` pulled back along `ct`."""
    if _is_scalar(ct):
        g = jax.value_and_grad(lambda *a: f(*a, **kwargs), argnums=prog.argnums, allow_int=True)
        return g(*args)
    nums = _nums(prog)

    def of_diff(*diff: Any) -> Any:
        full = list(args)
        for i, d in zip(nums, diff):
            full[i] = d
        return f(*full, **kwargs)

    value, pullback = jax.vjp(of_diff, *(args[i] for i in nums))
    grads = pullback(ct)
    return value, (grads[0] if isinstance(prog.argnums, int) else grads)


def vjp_all(f: Any, prog: Program, args: tuple, kwargs: dict, ct: Any) -> tuple[Any, Any]:
    """`jax.vjp` w.r.t. every dynamic positional argument (ints and keys included)."""
    value, pullback = jax.vjp(lambda *d: f(*_rebuild(prog, args, d), **kwargs), *_dynamic(prog, args))
    return value, pullback(ct)


@functools.lru_cache(maxsize=None)
def case(name: str) -> dict[str, Any]:
    """Arguments and cotangent for one program (built once). The cotangent is 1.0 for a
    scalar output (so `jax.value_and_grad` and a vjp agree), else fixed random values."""
    prog = BY_NAME[name]
    args = prog.make_args()
    kwargs = prog.make_kwargs() if prog.make_kwargs else {}
    shape = jax.eval_shape(lambda d, kw: prog.fn(*_rebuild(prog, args, d), **kw), _dynamic(prog, args), kwargs)
    ct = jnp.asarray(1.0, shape.dtype) if _is_scalar(shape) else make_cotangent(shape)
    return dict(args=args, kwargs=kwargs, ct=ct)


@functools.lru_cache(maxsize=None)
def reference(name: str) -> dict[str, Any]:
    """Plain JAX on the undecorated function, in one `jax.jit` per program:
    out: fn(*args); vjp_all: (out, vjp w.r.t. every dynamic argument);
    value_and_grad: `value_and_grads` of fn; fwd_and_bwd: (out, grads) of `jax.fwd_and_bwd`."""
    c, prog = case(name), BY_NAME[name]
    fwd, bwd = jax.fwd_and_bwd(functools.partial(prog.fn, **c["kwargs"]), prog.argnums, jitted=False)

    @jax.jit
    def run(d: list, kw: dict, ct: Any) -> dict[str, Any]:
        args = _rebuild(prog, c["args"], d)
        out, residuals = fwd(*args)
        return dict(vjp_all=vjp_all(prog.fn, prog, args, kw, ct),
                    value_and_grad=value_and_grads(prog.fn, prog, args, kw, ct),
                    fwd_and_bwd=(out, bwd(residuals, ct)))

    ref = run(_dynamic(prog, c["args"]), c["kwargs"], c["ct"])
    ref["out"] = ref["vjp_all"][0]
    return ref


@functools.lru_cache(maxsize=None)
def compiled(name: str) -> aotgrad.AOTFunction:
    """One compiled function per program, shared by the tests (as a user would share it)."""
    prog = BY_NAME[name]
    return aotgrad.compile(prog.fn, static_argnums=prog.static_argnums)


def _close(prog: Program) -> dict[str, float]:
    return dict(rtol=prog.rtol, atol=prog.atol)


@functools.lru_cache(maxsize=None)
def aot_fwd_and_bwd(name: str) -> tuple[Any, Any]:
    """aotgrad's fwd and bwd for one program (shared by the tests that use them): of the
    shared compiled function, or of a plain function when keyword arguments are bound."""
    c, prog = case(name), BY_NAME[name]
    if c["kwargs"]:
        target = functools.partial(prog.fn, **c["kwargs"])
        if prog.static_argnums:
            target = aotgrad.compile(target, static_argnums=prog.static_argnums)
    else:
        target = compiled(name)
    return aotgrad.fwd_and_bwd(target, prog.argnums)


# Known aotgrad bugs: program name -> {test name: reason}. Filled from observed failures.
KNOWN_BUGS: dict[str, dict[str, str]] = {}


def _params(test: str) -> list:
    out = []
    for p in PROGRAMS:
        reason = KNOWN_BUGS.get(p.name, {}).get(test)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(p.name, id=p.name, marks=marks))
    return out


# ----------------------------------------------------------------------------- corpus tests

@pytest.mark.parametrize("name", _params("inference"))
def test_inference(name: str) -> None:
    c, prog = case(name), BY_NAME[name]
    got = compiled(name)(*c["args"], **c["kwargs"])
    assert_trees_close(got, reference(name)["out"], **_close(prog))


@pytest.mark.parametrize("name", _params("value_and_grad"))
def test_value_and_grad(name: str) -> None:
    c, prog = case(name), BY_NAME[name]
    got = value_and_grads(compiled(name), prog, c["args"], c["kwargs"], c["ct"])
    assert_trees_close(got, reference(name)["value_and_grad"], **_close(prog))


@pytest.mark.parametrize("name", _params("value_and_grad_jit"))
def test_value_and_grad_under_jit(name: str) -> None:
    c, prog = case(name), BY_NAME[name]
    f = compiled(name)

    @jax.jit
    def run(dyn: list, kwargs: dict, ct: Any) -> Any:
        return value_and_grads(f, prog, _rebuild(prog, c["args"], dyn), kwargs, ct)

    got = run(_dynamic(prog, c["args"]), c["kwargs"], c["ct"])
    assert_trees_close(got, reference(name)["value_and_grad"], **_close(prog))


@pytest.mark.parametrize("name", _params("vjp"))
def test_vjp_all_arguments(name: str) -> None:
    c, prog = case(name), BY_NAME[name]
    got = vjp_all(compiled(name), prog, c["args"], c["kwargs"], c["ct"])
    assert_trees_close(got, reference(name)["vjp_all"], **_close(prog))


@pytest.mark.parametrize("name", _params("fwd_and_bwd"))
def test_fwd_and_bwd(name: str) -> None:
    c, prog = case(name), BY_NAME[name]
    fwd, bwd = aot_fwd_and_bwd(name)
    out, saved = fwd(*c["args"])
    assert isinstance(saved, aotgrad.Saved)
    grads = bwd(saved, c["ct"])
    want_out, want_grads = reference(name)["fwd_and_bwd"]
    assert_trees_close((out, grads), (want_out, want_grads), **_close(prog))
    # The backward can run again on the same saved values.
    assert_trees_close(bwd(saved, c["ct"]), want_grads, **_close(prog))


@pytest.mark.parametrize("name", _params("fwd_and_bwd_jit"))
def test_fwd_and_bwd_under_jit(name: str) -> None:
    c, prog = case(name), BY_NAME[name]
    fwd, bwd = aot_fwd_and_bwd(name)
    args, dyn = c["args"], _dynamic(prog, c["args"])
    want = reference(name)["fwd_and_bwd"]

    # fwd and bwd in separate jits: `saved` leaves one and enters the other.
    out, saved = jax.jit(lambda d: fwd(*_rebuild(prog, args, d)))(dyn)
    assert isinstance(saved, aotgrad.Saved)
    grads = jax.jit(bwd)(saved, c["ct"])
    assert_trees_close((out, grads), want, **_close(prog))


def test_corpus_is_large_enough() -> None:
    assert len(PROGRAMS) >= 34
    for p in PROGRAMS:
        assert all(0 <= i < len(p.make_args()) for i in _nums(p)), p.name
        assert not set(_nums(p)) & set(p.static_argnums), p.name


# ----------------------------------------------------------------------------- focused tests

def _rand(seed: int, *shape: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def test_jacrev_vector_output() -> None:
    def f(x, w):
        return jnp.tanh(x @ w).ravel() * jnp.sum(x)
    x, w = _rand(1, 2, 3), _rand(2, 3, 4)
    got = jax.jacrev(aotgrad.compile(f), argnums=(0, 1))(x, w)
    want = jax.jacrev(f, argnums=(0, 1))(x, w)
    assert got[0].shape == (8, 2, 3) and got[1].shape == (8, 3, 4)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def test_vmap_inference_and_grad() -> None:
    def loss(x, w):
        return jnp.sum(jnp.sin(x @ w) ** 2)
    xs, w = _rand(3, 5, 4, 3), _rand(4, 3, 2)
    cf = aotgrad.compile(loss)
    assert_trees_close(jax.vmap(cf, in_axes=(0, None))(xs, w),
                       jax.vmap(loss, in_axes=(0, None))(xs, w), rtol=1e-5, atol=1e-6)
    got = jax.vmap(jax.grad(cf, argnums=(0, 1)), in_axes=(0, None))(xs, w)
    want = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None))(xs, w)
    assert got[1].shape == (5, 3, 2)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def test_grad_wrt_some_arguments() -> None:
    def f(x, w, b):
        return jnp.sum(jnp.tanh(x @ w + b) ** 2)
    x, w, b = _rand(5, 4, 3), _rand(6, 3, 2), _rand(7, 2)
    cf = aotgrad.compile(f)
    assert_trees_close(jax.grad(cf, argnums=1)(x, w, b), jax.grad(f, argnums=1)(x, w, b), rtol=1e-5, atol=1e-6)
    assert_trees_close(jax.grad(cf, argnums=(0, 2))(x, w, b), jax.grad(f, argnums=(0, 2))(x, w, b),
                       rtol=1e-5, atol=1e-6)
    info = cf.cache_info()
    assert info.entries == 1, info  # one signature ...
    assert info.pairs == 2, info  # ... two differentiation patterns, each with its own programs


def _while_loop(x):
    return lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, jnp.sin(c[1]) * 1.5), (0, x))[1]


# Observed from plain JAX: jax.grad(_while_loop)(x).
_WHILE_GRAD_ERROR = "Reverse-mode differentiation does not work for lax.while_loop"


def test_while_loop_forward_works_and_grad_raises_jax_error() -> None:
    x = _rand(8, 4)
    cf = aotgrad.compile(_while_loop)
    assert_trees_close(cf(x), _while_loop(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=_WHILE_GRAD_ERROR):
        jax.grad(lambda x: jnp.sum(_while_loop(x)))(x)  # what plain JAX says ...
    with pytest.raises(ValueError, match=_WHILE_GRAD_ERROR):
        jax.grad(lambda x: jnp.sum(cf(x)))(x)  # ... is what aotgrad lets through


def test_jvp_raises_reverse_mode_error() -> None:
    def f(x):
        return jnp.sin(x) * x
    x = _rand(9, 3)
    cf = aotgrad.compile(f)
    with pytest.raises(TypeError, match="reverse-mode"):
        jax.jvp(cf, (x,), (jnp.ones_like(x),))
