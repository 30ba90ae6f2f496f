"""Differential fuzzing: random programs from `tests/fuzz_grammar.py`, compiled by aotgrad,
against JAX itself, under every registered partitioner and memory budget.

For each program (float32): the value and the VJP (random cotangent) of the compiled function
equal JAX's, through one of `jax.vjp`, `aotgrad.fwd_and_bwd` or `jax.jit(jax.vjp)`. bfloat16
programs compare values only (the forward-only program against `jax.jit(fn)`).

CI runs a fixed-seed slice (`derandomize=True`, 30 programs). For a longer, randomized run:
    AOTGRAD_FUZZ_EXAMPLES=2000 python -m pytest tests/test_fuzz.py
A failing example prints its program's `repr`; paste it into `REGRESSIONS` below.
"""
from __future__ import annotations

import contextlib
import itertools
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aotgrad

try:
    from tests.fuzz_grammar import Program, Step, programs
    from tests.partition_configs import config_id, partitioner_configs
except ImportError:
    from fuzz_grammar import Program, Step, programs
    from partition_configs import config_id, partitioner_configs

LONG_RUN = "AOTGRAD_FUZZ_EXAMPLES" in os.environ
EXAMPLES = int(os.environ.get("AOTGRAD_FUZZ_EXAMPLES", 30))
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, derandomize=not LONG_RUN, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                         print_blob=True)

# The contexts every program is checked under: the product of these axes, each a list of
# (label, context factory). A new dimension (e.g. autocast states) is one more entry.
AXES: list[list[tuple[str, Callable[[], Any]]]] = [
    [(config_id(c), lambda c=c: aotgrad.config.patch(**c)) for c in partitioner_configs()],
]
PATHS = ("vjp", "fwd_and_bwd", "jit_vjp")
TOLERANCE = {"float32": 2e-4, "bfloat16": 6e-2}  # normwise, relative to the reference's largest entry


def contexts() -> list[tuple[str, Callable[[], Any]]]:
    out = []
    for combo in itertools.product(*AXES):
        def enter(combo: tuple = combo) -> Any:
            stack = contextlib.ExitStack()
            for _, factory in combo:
                stack.enter_context(factory())
            return stack
        out.append(("/".join(label for label, _ in combo), enter))
    return out


def assert_close(got: Any, want: Any, rtol: float, what: str) -> None:
    got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_l) == len(want_l), what
    for k, (g, w) in enumerate(zip(got_l, want_l)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}[{k}]: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        scale = max(float(np.max(np.abs(w64), initial=0.0)), 1.0)
        err = float(np.max(np.abs(g64 - w64), initial=0.0))
        assert err <= rtol * scale, f"{what}[{k}]: max error {err:.3g} > {rtol:g} * {scale:.3g}"


def _vjp(path: str, fn: Callable, args: list, cts: Any) -> tuple[Any, Any]:
    if path == "vjp":
        out, vjp_fn = jax.vjp(aotgrad.compile(fn), *args)
        return out, vjp_fn(cts)
    if path == "fwd_and_bwd":
        fwd, bwd = aotgrad.fwd_and_bwd(fn, argnums=tuple(range(len(args))))
        out, saved = fwd(*args)
        return out, bwd(saved, cts)
    compiled = aotgrad.compile(fn)
    return jax.jit(lambda a, c: (lambda o, f: (o, f(c)))(*jax.vjp(compiled, *a)))(args, cts)


def check_program(program: Program, seed: int, path: str) -> None:
    fn, args = program.fn(), program.args(seed)
    tol = TOLERANCE[program.dtype]
    if program.dtype != "float32":
        want = jax.jit(fn)(*args)
        for label, enter in contexts():
            with enter():
                assert_close(aotgrad.compile(fn)(*args), want, tol, f"{label} value")
        return
    want_out, vjp_fn = jax.vjp(fn, *args)
    rng = np.random.default_rng(seed + 1)
    cts = jax.tree.map(lambda o: jnp.asarray(rng.standard_normal(o.shape), o.dtype), want_out)
    want_grads = vjp_fn(cts)
    if not all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves((want_out, want_grads))):
        return  # JAX itself is not finite here: nothing to compare
    for label, enter in contexts():
        with enter():
            out, grads = _vjp(path, fn, args, cts)
        assert_close(out, want_out, tol, f"{label} {path} value")
        assert_close(grads, tuple(want_grads), tol, f"{label} {path} gradient")


@FUZZ_SETTINGS
@given(program=programs(), seed=st.integers(0, 2**16), path=st.sampled_from(PATHS))
def test_float32_programs_match_jax(program, seed, path):
    check_program(program, seed, path)


@settings(FUZZ_SETTINGS, max_examples=max(EXAMPLES // 5, 5))
@given(program=programs(max_steps=4, dtypes=("bfloat16",)), seed=st.integers(0, 2**16))
def test_bfloat16_values_match_jax(program, seed):
    check_program(program, seed, "vjp")


# Programs always checked, as `repr(program)` prints them: a fixed control-flow chain, and
# any program fuzzing finds wrong (none so far, over 400 randomized examples).
REGRESSIONS: list[tuple[Program, int, str]] = [
    (Program(inputs=((3, 2),), steps=(Step("while_scale", (0,), None),
                                       Step("scan_rows", (1,), None), Step("cond", (2,), None)),
             outputs=(3,), dtype="float32"), 0, "jit_vjp"),
]


@pytest.mark.parametrize("program, seed, path", REGRESSIONS, ids=[f"regression{i}" for i in range(len(REGRESSIONS))])
def test_regressions(program, seed, path):
    check_program(program, seed, path)
