"""float64 differential fuzzing; run by tests/test_fuzz.py in a process of its own.

float64 needs ``JAX_ENABLE_X64=1`` before JAX is imported. Run alone with
``python -m pytest tests/fuzz_x64_cases.py`` (this module sets it when JAX is not imported
yet); in a process where JAX is already imported without it, every case skips.

- float64 programs: the value and the VJP equal JAX's at a float64 tolerance, under every
  partitioner and memory budget; random ones and `covering_programs` (every op).
- float64 under autocast: float64 is never cast (it is not an eligible type), so the
  compiled programs compute nothing in 16 bits, and values and VJPs equal JAX's without
  autocast at the same tolerance.

`AOTGRAD_FUZZ_EXAMPLES` scales these runs as it does tests/test_fuzz.py's.
"""
from __future__ import annotations

import os
import sys

if "jax" not in sys.modules:
    os.environ.setdefault("JAX_ENABLE_X64", "1")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import aotgrad  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from fuzz_grammar import MATMULS, Program, covering_programs, programs  # noqa: E402
from test_fuzz import (AUTOCAST_STATES, CONFIGS, EXAMPLES, FUZZ_SETTINGS, PATHS, TOLERANCE,  # noqa: E402
                       AutocastState, _vjp, all_finite, assert_close, check_covering, check_program, config_id,
                       cotangents, sixteen_bit)

pytestmark = pytest.mark.skipif(not jax.config.jax_enable_x64,
                                reason="float64 needs JAX_ENABLE_X64=1 before JAX is imported "
                                       "(tests/test_fuzz.py runs this module in a process of its own)")

F64_EXAMPLES = max(EXAMPLES * 2 // 3, 5)


@settings(FUZZ_SETTINGS, max_examples=F64_EXAMPLES)
@given(program=programs(dtypes=("float64",)), seed=st.integers(0, 2**16), path=st.sampled_from(PATHS))
def test_float64_programs_match_jax(program, seed, path):
    check_program(program, seed, path)


COVERING = covering_programs(dtype="float64")


@pytest.mark.parametrize("i", range(len(COVERING)), ids=lambda i: f"cover{i}")
def test_every_op_float64_matches_jax(i):
    check_covering(COVERING, i)


def check_float64_under_autocast(program: Program, seed: int, path: str, state: AutocastState,
                                 config: dict) -> None:
    fn, args = program.fn(), program.args(seed)
    want_out, vjp_fn = jax.vjp(fn, *args)
    cts = cotangents(want_out, seed)
    want_grads = vjp_fn(cts)
    if not all_finite((want_out, want_grads)):
        return
    with aotgrad.config.patch(**config), state.context():
        out, grads = _vjp(path, fn, args, cts)
        report = aotgrad.explain(fn, *args)
    what, tol = f"{state!r} {config_id(config)} {path}", TOLERANCE["float64"]
    assert_close(out, want_out, tol, f"{what} value")
    assert_close(grads, tuple(want_grads), tol, f"{what} gradient")
    for name in ("forward_jaxpr", "backward_jaxpr"):
        cast = sixteen_bit(getattr(report, name))
        assert not cast, f"{what}: 16-bit equations in the {name}: {cast[:3]}"
    assert report.casts.total == 0, f"{what}: {report.casts}"


@settings(FUZZ_SETTINGS, max_examples=F64_EXAMPLES)
@given(program=programs(dtypes=("float64",), first_ops=MATMULS, chain=True), seed=st.integers(0, 2**16),
       path=st.sampled_from(PATHS), state=st.sampled_from([s for s in AUTOCAST_STATES if s.on]),
       config=st.sampled_from(CONFIGS))
def test_autocast_leaves_float64_alone(program, seed, path, state, config):
    check_float64_under_autocast(program, seed, path, state, config)
