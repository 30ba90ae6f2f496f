"""No primitive is unknown by accident, on the installed JAX.

- Every primitive `jax.extend.core.primitives` exports, and every other one JAX's modules
  define (`stack`, async collectives, kernels), has a recompute rule, and is either listed in an autocast table or declared
  dtype-neutral (`aotgrad.autocast.policy.NEUTRAL`), never both.
- The joint graphs (function and `jax.vjp`) of the test corpus, the scan programs, the fuzz
  grammar's covering programs and the default benchmark suite's workloads hold no primitive without
  a rule: a failure names the primitive and the program.
- A primitive met without a rule falls back to the conservative rule, and says so: once as
  a warning, and in `aotgrad.explain`'s report.
"""
from __future__ import annotations

import pathlib
import tomllib
import warnings

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import pytest
from jax.extend.core import Primitive

import aotgrad
from aotgrad._jax_internals import jax_primitives
from aotgrad._jax_internals import primitives as internal
from aotgrad.autocast.policy import NEUTRAL, TABLES
from aotgrad.interpret import sub_jaxprs
from aotgrad.partition import rules
from benchmarks import workloads

try:
    from tests.corpus import PROGRAMS
    from tests.fuzz_grammar import covering_programs
    from tests.test_scan_partition import PROGRAMS as SCAN_PROGRAMS
    from tests.test_scan_partition import _params as scan_params
except ImportError:
    from corpus import PROGRAMS
    from fuzz_grammar import covering_programs
    from test_scan_partition import PROGRAMS as SCAN_PROGRAMS
    from test_scan_partition import _params as scan_params

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _exported() -> list[Primitive]:
    """`jax.extend.core.primitives`, then every other primitive JAX's modules define."""
    public = [getattr(P, n) for n in sorted(dir(P)) if isinstance(getattr(P, n), Primitive)]
    extra = [p for _, p in sorted(vars(internal).items()) if p is not None]
    extra += [p for _, found in sorted(jax_primitives().items()) for p in found]
    return public + [p for p in dict.fromkeys(extra) if p not in public]


def _has_rule(p: Primitive) -> bool:
    return p in rules.RULES or p in rules.CALLS


def _listed(p: Primitive) -> bool:
    return any(p in table for table in TABLES.values())


def test_every_exported_primitive_has_a_recompute_rule():
    missing = [p.name for p in _exported() if not _has_rule(p)]
    assert not missing, f"primitives of jax {jax.__version__} with no rule in partition/rules.py: {missing}"


def test_every_exported_primitive_is_listed_or_declared_neutral():
    prims = _exported()
    neither = [p.name for p in prims if not _listed(p) and p not in NEUTRAL]
    both = [p.name for p in prims if _listed(p) and p in NEUTRAL]
    assert not neither, f"primitives of jax {jax.__version__} neither in an autocast table nor NEUTRAL: {neither}"
    assert not both, f"primitives both in an autocast table and declared NEUTRAL: {both}"


def test_log2_is_float32_under_gpu_autocast_like_log():
    """jax >= 0.11.2 has a `log2` primitive (before: `log` then `div`); either way `jnp.log2`
    of a float16 matmul runs in float32, as PyTorch's CUDA autocast runs log2."""
    x = jnp.ones((4, 4), jnp.float32) * 2.0
    f = aotgrad.compile(lambda x: jnp.log2(x @ x))
    with aotgrad.autocast("gpu", dtype=jnp.float16):
        closed = jax.make_jaxpr(f)(x)
    assert _walk_dtypes(closed.jaxpr, {"log", "log2"}) == {"float32"}


def _walk_dtypes(jaxpr, names: set[str]) -> set[str]:
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in names:
            found |= {str(v.aval.dtype) for v in eqn.invars}
        for body in sub_jaxprs(eqn):
            found |= _walk_dtypes(body, names)
    return found


def _joint_primitives(fn, args, argnums) -> list[Primitive]:
    """The primitives of `fn` and its VJP (what aotgrad's joint graph is traced from)."""
    argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def joint(*diff):
        full = list(args)
        for i, a in zip(argnums, diff, strict=True):
            full[i] = a

        def f(*d):
            inner = list(full)
            for i, a in zip(argnums, d, strict=True):
                inner[i] = a
            return fn(*inner)
        out, vjp = jax.vjp(f, *diff)
        return out, vjp(jax.tree.map(jnp.ones_like, out))

    closed = jax.make_jaxpr(joint)(*[args[i] for i in argnums])
    found: dict[str, Primitive] = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            found.setdefault(eqn.primitive.name, eqn.primitive)
            for body in sub_jaxprs(eqn):
                walk(body)
    walk(closed.jaxpr)
    return list(found.values())


def _check(name: str, prims: list[Primitive]) -> None:
    no_rule = [p.name for p in prims if not _has_rule(p)]
    unplaced = [p.name for p in prims if not _listed(p) and p not in NEUTRAL]
    assert not no_rule, f"{name}: primitives with no recompute rule on jax {jax.__version__}: {no_rule}"
    assert not unplaced, f"{name}: primitives with no autocast placement on jax {jax.__version__}: {unplaced}"


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_corpus_joint_graphs_have_rules(program):
    args = program.make_args()
    fn = program.fn
    if program.static_argnums or program.make_kwargs:
        kwargs = program.make_kwargs() if program.make_kwargs else {}
        static = {i: args[i] for i in program.static_argnums}

        def fn(*a, _f=program.fn):
            full = [static.get(i, x) for i, x in enumerate(a)]
            return _f(*full, **kwargs)
    _check(program.name, _joint_primitives(fn, args, program.argnums))


@pytest.mark.parametrize("fn", SCAN_PROGRAMS, ids=lambda f: f.__name__)
def test_scan_program_joint_graphs_have_rules(fn):
    """Scans stack their residuals (`stack`, which JAX does not export)."""
    _check(fn.__name__, _joint_primitives(fn, (scan_params(),), 0))


def test_fuzz_grammar_joint_graphs_have_rules():
    for k, program in enumerate(covering_programs()):
        args = program.args(0)
        _check(f"covering program {k}", _joint_primitives(program.fn(), args, tuple(range(len(args)))))


def _default_suite() -> list[dict]:
    with open(ROOT / "config" / "cpu.toml", "rb") as f:
        return tomllib.load(f)["workloads"]


def _tiny(sizes: dict) -> dict:
    """The same model family at a small size (the graph's primitives do not depend on it)."""
    small = {"batch": 2, "seq": 8, "d_model": 16, "heads": 2, "layers": 2, "vocab": 32, "width": 16,
             "depth": 2, "image": 8, "channels": [4, 8], "hidden": 8, "d_in": 4}
    return {k: small.get(k, v) for k, v in sizes.items()}


@pytest.mark.parametrize("spec", _default_suite(), ids=lambda s: s["name"])
def test_benchmark_workload_joint_graphs_have_rules(spec):
    w = workloads.build(spec["name"], spec["kind"], _tiny(spec["sizes"]))
    _check(spec["name"], _joint_primitives(w.loss_fn, (w.params, w.batch), 0))


def test_a_primitive_without_a_rule_is_reported_not_silent():
    mine = Primitive("aotgrad_test_sin_without_rule")
    mine.def_impl(jnp.sin)
    mine.def_abstract_eval(lambda x: x)
    jax.interpreters.ad.defjvp(mine, lambda g, x: g * jnp.cos(x))
    jax.interpreters.mlir.register_lowering(mine, jax.interpreters.mlir.lower_fun(jnp.sin, multiple_results=False))
    f = aotgrad.compile(lambda x: (mine.bind(x @ x) ** 2).sum())
    x = jnp.ones((4, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = aotgrad.explain(f, x)
        aotgrad.explain(f, x * 2)  # a second build: no second warning
    messages = [str(w.message) for w in caught if "aotgrad_test_sin_without_rule" in str(w.message)]
    assert len(messages) == 1 and "'costly'" in messages[0]
    assert report.fallback_rules == (("aotgrad_test_sin_without_rule", "costly"),)
    assert "no recompute rule for 'aotgrad_test_sin_without_rule'" in str(report)
    want = jax.grad(lambda x: (jnp.sin(x @ x) ** 2).sum())(x)
    assert jnp.allclose(jax.grad(f)(x), want, rtol=1e-5)
