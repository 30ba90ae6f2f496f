"""Differential fuzzing: random programs from `tests/fuzz_grammar.py`, compiled by aotgrad,
against JAX itself.

The axes a program is checked along:
- partitioner: every registered partitioner and memory budget (`AXES`, `contexts()`).
  float32 programs compare the value and the VJP (random cotangent) with JAX's under every
  one of them; bfloat16 programs compare values only (the forward-only program against
  `jax.jit(fn)`).
- path: `jax.vjp`, `aotgrad.fwd_and_bwd` or `jax.jit(jax.vjp)`, drawn per example.
- autocast: `AUTOCAST_STATES` (off; the cpu table in bfloat16, the gpu table in float16;
  backward "same_as_forward", "off" or an explicit setting), drawn per example together
  with one partitioner configuration. The value and VJP equal JAX differentiating the same
  mixed-precision program, `jax.vjp(aotgrad.autocast(...)(fn))`, and the dtypes of the
  compiled programs follow the policy tables (`policy_errors`, an oracle that reads only
  `policy_for`). Under backward "off" the tolerance is float32's: the compiled programs
  run the reference's own equations, and a backward autocast like the forward (the matmuls
  of `matmul_rule`'s custom_vjp backward) is far outside it.
- a hand-written oracle: programs of the ops in `fuzz_grammar.HAND_WRITTEN`, against
  `jax.vjp` of the same program written with explicit casts (independent of the rewrite).
- float64: `tests/fuzz_x64_cases.py`, in a process of its own (it needs
  `JAX_ENABLE_X64=1` before JAX is imported): values and VJPs at a float64 tolerance under
  every partitioner, and autocast leaving float64 programs alone.

Every grammar production is checked whatever the draws: `fuzz_grammar.covering_programs`
apply every op (both axes of those that take one) at least once, as float32 and float64
programs and under autocast (after a matmul), each program under one partitioner
configuration, path and autocast state, taken in turn. CI adds a fixed-seed random slice
(`derandomize=True`): 6 float32 programs and 5 + 5 float64 (each under every
configuration), 5 bfloat16, 12 under autocast, 30 against the hand-written oracle (the random
slice alone, at 30 float32 and 60 autocast programs, missed 17 and 11 of the 48 ops). A
reference (JAX) result that is not finite is compared too: aotgrad must give the same
Inf/NaN in the same places. For a longer, randomized run of every axis, N float32 programs
(N/5 bfloat16, 4N under autocast, N against the hand-written oracle, 2N/3 + 2N/3 float64),
the covering programs too:
    AOTGRAD_FUZZ_EXAMPLES=N python -m pytest tests/test_fuzz.py --hypothesis-show-statistics
(N=30 is about the slice CI ran before the covering programs; the statistics count the
examples whose compiled programs had each kind of table entry to check). A failing example
prints its program's `repr` (and its autocast state and configuration); paste it into
`REGRESSIONS` (or `AUTOCAST_REGRESSIONS`) below.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Var

import aotgrad
from aotgrad.autocast.policy import ACCUMULATING, FP32, LOWER, policy_for

try:
    from tests.fuzz_grammar import (HAND_WRITTEN, MATMULS, Program, Step, covering_programs, hand_written,
                                    programs)
    from tests.own_process import run_module
    from tests.partition_configs import config_id, partitioner_configs
except ImportError:
    from fuzz_grammar import HAND_WRITTEN, MATMULS, Program, Step, covering_programs, hand_written, programs
    from own_process import run_module
    from partition_configs import config_id, partitioner_configs

LONG_RUN = "AOTGRAD_FUZZ_EXAMPLES" in os.environ
EXAMPLES = int(os.environ.get("AOTGRAD_FUZZ_EXAMPLES", 6))
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, derandomize=not LONG_RUN, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                         print_blob=True)

# The contexts every float32 program is checked under: the product of these axes, each a
# list of (label, context factory). The autocast axis is not part of the product (that
# would multiply the cost by its length): each autocast example draws its state and one
# partitioner configuration instead.
CONFIGS = partitioner_configs()
AXES: list[list[tuple[str, Callable[[], Any]]]] = [
    [(config_id(c), lambda c=c: aotgrad.config.patch(**c)) for c in CONFIGS],
]
PATHS = ("vjp", "fwd_and_bwd", "jit_vjp")
# Normwise, relative to the reference's largest entry. float64: the largest error measured
# over 400 programs (with and without autocast) was 4.3e-16, two ulps (XLA sums in another
# order in two programs than in one); 1e-12 leaves a wide margin and still fails any
# rounding to float32 (6e-8).
TOLERANCE = {"float32": 2e-4, "bfloat16": 6e-2, "float64": 1e-12}


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
    """Normwise, relative to the reference's largest finite entry (a floor of 1e-6 for an
    all-zero reference). Non-finite entries must be where the reference has them, the same."""
    got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_l) == len(want_l), what
    for k, (g, w) in enumerate(zip(got_l, want_l)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}[{k}]: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        finite = np.isfinite(w64)
        if not finite.all():
            np.testing.assert_array_equal(g64[~finite], w64[~finite], err_msg=f"{what}[{k}]: non-finite entries")
            g64, w64 = g64[finite], w64[finite]
        scale = max(float(np.max(np.abs(w64), initial=0.0)), 1e-6)
        err = float(np.max(np.abs(g64 - w64), initial=0.0))
        assert err <= rtol * scale, f"{what}[{k}]: max error {err:.3g} > {rtol:g} * {scale:.3g}"


def all_finite(tree: Any) -> bool:
    return all(np.isfinite(np.asarray(x, np.float64)).all() for x in jax.tree.leaves(tree))


def cotangents(out: Any, seed: int) -> Any:
    """A random cotangent for `out` (arrays or `ShapeDtypeStruct`s), in its dtypes."""
    rng = np.random.default_rng(seed + 1)
    return jax.tree.map(lambda o: jnp.asarray(rng.standard_normal(o.shape), o.dtype), out)


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


def check_program(program: Program, seed: int, path: str, only: str | None = None) -> None:
    """Value and VJP against JAX under every context of `contexts()` (`only`: the one of
    that label)."""
    fn, args = program.fn(), program.args(seed)
    tol = TOLERANCE[program.dtype]
    checked = [(label, enter) for label, enter in contexts() if only is None or label == only]
    assert checked, f"no context {only!r}"
    if program.dtype == "bfloat16":
        want = jax.jit(fn)(*args)
        for label, enter in checked:
            with enter():
                assert_close(aotgrad.compile(fn)(*args), want, tol, f"{label} value")
        return
    want_out, vjp_fn = jax.vjp(fn, *args)
    cts = cotangents(want_out, seed)
    want_grads = vjp_fn(cts)
    for label, enter in checked:
        with enter():
            out, grads = _vjp(path, fn, args, cts)
        assert_close(out, want_out, tol, f"{label} {path} value")
        assert_close(grads, tuple(want_grads), tol, f"{label} {path} gradient")


@FUZZ_SETTINGS
@given(program=programs(), seed=st.integers(0, 2**16), path=st.sampled_from(PATHS))
def test_float32_programs_match_jax(program, seed, path):
    check_program(program, seed, path)


COVERING = covering_programs()


def check_covering(programs: Sequence[Program], i: int) -> None:
    """Program `i` of `programs` under one partitioner configuration and one path, both
    taken in turn: every op checked whatever the random draws (which go under every
    configuration)."""
    check_program(programs[i], i, PATHS[i % len(PATHS)], only=config_id(CONFIGS[i % len(CONFIGS)]))


@pytest.mark.parametrize("i", range(len(COVERING)), ids=lambda i: f"cover{i}")
def test_every_op_float32_matches_jax(i):
    check_covering(COVERING, i)


@settings(FUZZ_SETTINGS, max_examples=max(EXAMPLES // 5, 5))
@given(program=programs(max_steps=4, dtypes=("bfloat16",)), seed=st.integers(0, 2**16))
def test_bfloat16_values_match_jax(program, seed):
    check_program(program, seed, "vjp")


# ----------------------------------------------------------------------------- autocast

HALF = frozenset({np.dtype(jnp.float16), np.dtype(jnp.bfloat16)})
F32 = np.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """What a compiled function is traced under: `aotgrad.autocast(device_type, dtype)`
    (`device_type` None: autocast off) and `config.backward_pass_autocast = backward`."""
    device_type: str | None = None
    dtype: str = "float32"  # the autocast dtype ("float16" / "bfloat16"); float32 when off
    # "same_as_forward", "off", or a dict of autocast kwargs (not hashed: a dict)
    backward: Any = dataclasses.field(default="same_as_forward", hash=False)
    promotion: str = "jax"

    @property
    def on(self) -> bool:
        return self.device_type is not None

    def context(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(aotgrad.config.patch(backward_pass_autocast=self.backward))
        if self.on:
            stack.enter_context(aotgrad.autocast(self.device_type, dtype=self.dtype, promotion=self.promotion))
        return stack

    def transform(self, fn: Callable) -> Callable:
        """`fn` as JAX sees the mixed-precision program: the autocast decorator."""
        return aotgrad.autocast(self.device_type, dtype=self.dtype, promotion=self.promotion)(fn) if self.on else fn

    def backward_table(self) -> tuple[str, np.dtype] | None:
        """The (device type, dtype) whose table the backward's own equations follow; None
        when they follow no table ("off": their dtypes follow the forward's casts)."""
        if not self.on or self.backward == "off":
            return None
        if self.backward == "same_as_forward":
            return self.device_type, np.dtype(self.dtype)
        return self.backward["device_type"], np.dtype(self.backward["dtype"])

    def __repr__(self) -> str:  # what a failing example prints
        if not self.on:
            return "AutocastState()"
        extra = "" if self.promotion == "jax" else f", promotion={self.promotion!r}"
        return f"AutocastState({self.device_type!r}, {self.dtype!r}, {self.backward!r}{extra})"


AUTOCAST_STATES = (
    AutocastState(),
    AutocastState("cpu", "bfloat16", "same_as_forward"),
    AutocastState("cpu", "bfloat16", "off"),
    AutocastState("gpu", "float16", "same_as_forward"),
    AutocastState("gpu", "float16", "off"),
    AutocastState("cpu", "bfloat16", "same_as_forward", promotion="torch"),
    AutocastState("gpu", "float16", "off", promotion="torch"),
    # a float16 forward with a bfloat16 backward under the cpu table
    AutocastState("gpu", "float16", {"device_type": "cpu", "dtype": "bfloat16"}),
)

# Normwise, relative to the reference's largest entry (as `assert_close`), by the 16-bit
# type the programs compute in. The reference runs the same equations as the compiled
# programs, but XLA may elide a rounding to 16 bits in one program and not in the other
# (excess precision), so allow a few ulps of that type: float16 5e-3 (5 ulps of 2^-10),
# bfloat16 6e-2 (8 ulps of 2^-7). Measured over 1500 randomized examples: the largest error
# was 3e-7 under every state but one ("same_as_forward"'s float32 accumulation gave the
# reference's 16-bit sums: a few terms, which XLA on CPU accumulates in float32 too), and
# 1.6e-2 for the explicit bfloat16 backward against the reference's float16 one (its
# tolerance: bfloat16's).
AUTOCAST_TOLERANCE = {"float32": TOLERANCE["float32"], "float16": 5e-3, "bfloat16": 6e-2}


def autocast_tolerance(state: AutocastState) -> float:
    """"off" runs the reference's own equations (measured: 3e-7), so float32's tolerance:
    a backward autocast as the forward's (a custom_vjp rule's matmuls of the cotangent in
    16 bits, `matmul_rule`) differs from the reference by far more than that."""
    if state.backward == "off":
        return AUTOCAST_TOLERANCE["float32"]
    table = state.backward_table()
    widest = max((state.dtype, table[1].name if table else state.dtype),
                 key=lambda d: AUTOCAST_TOLERANCE[d])
    return AUTOCAST_TOLERANCE[widest]


# The policy oracle. It reads the compiled programs and the policy tables only, never the
# rewrite that produced the programs.

def bodies(eqn: JaxprEqn) -> Iterator[Jaxpr]:
    """The sub-jaxprs among `eqn`'s params (jit, scan, while, cond branches, remat,
    custom_jvp / custom_vjp calls, ...), found by type, whatever the primitive."""
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, Jaxpr):
                yield v


def walk(eqns: Iterable[JaxprEqn]) -> Iterator[JaxprEqn]:
    """`eqns` and every equation in their bodies, recursively."""
    for eqn in eqns:
        yield eqn
        for body in bodies(eqn):
            yield from walk(body.eqns)


def live(jaxpr: Jaxpr, outvars: Sequence[Any]) -> list[JaxprEqn]:
    """The top-level equations some of `outvars` depends on."""
    needed = {v for v in outvars if isinstance(v, Var)}
    out = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            out.append(eqn)
            needed.update(v for v in eqn.invars if isinstance(v, Var))
    return out[::-1]


def dependent(jaxpr: Jaxpr, invars: Sequence[Var]) -> list[JaxprEqn]:
    """The top-level equations that depend on some of `invars`."""
    reached = set(invars)
    out = []
    for eqn in jaxpr.eqns:
        if any(isinstance(v, Var) and v in reached for v in eqn.invars):
            out.append(eqn)
            reached.update(eqn.outvars)
    return out


def float_inputs(eqn: JaxprEqn) -> list[np.dtype]:
    return [np.dtype(v.aval.dtype) for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)]


def sixteen_bit(closed: ClosedJaxpr) -> list[JaxprEqn]:
    """Equations (also in bodies) with a 16-bit input or output; a cast to 16 bits is one."""
    def half(atoms: list) -> bool:
        return any(getattr(v.aval, "dtype", None) in HALF for v in atoms)
    return [e for e in walk(closed.jaxpr.eqns) if half(e.invars) or half(e.outvars)]


def policy_errors(eqns: Iterable[JaxprEqn], device_type: str, dtype: np.dtype, where: str) -> list[str]:
    """Equations whose floating inputs break `device_type`'s table under `dtype`: a
    lower_precision_fp op with an input not in `dtype`, an fp32 op with an input not in
    float32, a summing reduction with a 16-bit input."""
    errors, checked = [], set()
    for eqn in eqns:
        dtypes = float_inputs(eqn)
        if not dtypes:
            continue
        policy = policy_for(device_type, eqn.primitive, eqn.params)
        want = {LOWER: dtype, FP32: F32}.get(policy)
        if want is not None:
            checked.add(f"{where} {policy}")
            if any(d != want for d in dtypes):
                errors.append(f"{where}: {policy} {eqn.primitive} on {[d.name for d in dtypes]}")
        if eqn.primitive in ACCUMULATING:
            checked.add(f"{where} accumulation")
            if any(d in HALF for d in dtypes):
                errors.append(f"{where}: {eqn.primitive} accumulates {[d.name for d in dtypes]}")
    if currently_in_test_context():  # coverage: pytest --hypothesis-show-statistics
        for what in sorted(checked):
            event(f"checked {what}")
    return errors


def lowered_matmuls(eqns: Iterable[JaxprEqn], dtype: np.dtype) -> int:
    return sum(e.primitive is P.dot_general_p and set(float_inputs(e)) == {dtype} for e in eqns)


def check_policy(fn: Callable, args: list, report: Any, state: AutocastState) -> None:
    """The compiled programs' dtypes follow the tables of `state`.

    What is checked, and what is not:
    - forward program: the equations its outputs (the function's, the first `n_out`)
      depend on, with everything in their bodies. Equations that only compute saved
      values (residuals) are JAX's linearization of the rewritten forward (reduce_max's
      tie count, the `integer_pow(y, -2)` of a division's derivative, `exp(-x^2)` of
      erf's): JAX emits them in the dtypes of the rewritten forward, and aotgrad rewrites
      neither them nor their copies in the backward, so they can break the tables (a
      float16 `integer_pow(y, -2)` under the gpu table). `jax.vjp(aotgrad.autocast(...)(fn))`
      has the same equations.
    - backward program: only when its own equations follow a table ("same_as_forward" or
      an explicit setting, not "off"), the equations that depend on the cotangents (its
      last `n_out` inputs), with their bodies. The others recompute forward values (checked
      in the forward) or are linearization equations (above).
    - bodies are checked whole. A custom_jvp call is gone from the joint graph (JAX ran its
      rule, which autocast rewrites like the function); the grammar has no `enabled=False`
      region, the one place where a marked equation may legitimately ignore the table.
    """
    if not state.on:  # nothing is cast to 16 bits
        halves = sixteen_bit(report.forward_jaxpr) + sixteen_bit(report.backward_jaxpr)
        assert not halves, f"16-bit equations without autocast: {halves[:3]}"
        return
    forward, backward = report.forward_jaxpr.jaxpr, report.backward_jaxpr.jaxpr
    n_out = len(jax.tree.leaves(jax.eval_shape(fn, *args)))
    dtype = np.dtype(state.dtype)
    checked = list(walk(live(forward, forward.outvars[:n_out])))
    errors = policy_errors(checked, state.device_type, dtype, "forward")
    table = state.backward_table()
    if table is not None:
        own = list(walk(dependent(backward, backward.invars[len(backward.invars) - n_out:])))
        errors += policy_errors(own, *table, "backward")
    assert not errors, "\n".join(errors)
    # Not vacuous: a matmul the outputs depend on runs in the autocast dtype, and so do
    # the matmuls of its backward.
    original = jax.make_jaxpr(fn)(*args).jaxpr
    if any(e.primitive is P.dot_general_p for e in walk(live(original, original.outvars))):
        assert lowered_matmuls(checked, dtype), f"no {dtype.name} dot_general in the forward"
        if table is not None:
            assert lowered_matmuls(own, table[1]), f"no {table[1].name} dot_general in the backward"


def check_autocast_program(program: Program, seed: int, path: str, state: AutocastState,
                           config: dict[str, Any]) -> None:
    """Value and VJP against `jax.vjp` of the autocast-transformed function, and the
    dtypes of the compiled programs against the tables."""
    fn, args = program.fn(), program.args(seed)
    reference = state.transform(fn)
    cts = cotangents(jax.eval_shape(reference, *args), seed)
    want_out, want_grads = jax.jit(lambda a, c: (lambda o, f: (o, f(c)))(*jax.vjp(reference, *a)))(args, cts)
    if not all_finite((want_out, want_grads)):
        return  # the mixed-precision program itself is not finite here (16-bit overflow)
    with aotgrad.config.patch(**config), state.context():
        out, grads = _vjp(path, fn, args, cts)
        report = aotgrad.explain(fn, *args)
    tol, what = autocast_tolerance(state), f"{state!r} {config_id(config)} {path}"
    assert_close(out, want_out, tol, f"{what} value")
    assert_close(grads, tuple(want_grads), tol, f"{what} gradient")
    check_policy(fn, args, report, state)


# Programs that start with a matmul (the op autocast lowers) and mostly chain its result
# through later steps, so that the ops of the tables see 16-bit values.
@settings(FUZZ_SETTINGS, max_examples=EXAMPLES * (4 if LONG_RUN else 2))  # CI: a fixed slice of 12
@given(program=programs(first_ops=MATMULS, chain=True), seed=st.integers(0, 2**16), path=st.sampled_from(PATHS),
       state=st.sampled_from(AUTOCAST_STATES), config=st.sampled_from(CONFIGS))
def test_autocast_programs_match_jax_and_follow_the_tables(program, seed, path, state, config):
    check_autocast_program(program, seed, path, state, config)


AUTOCAST_COVERING = covering_programs(first="matmul_nt")


@pytest.mark.parametrize("i", range(len(AUTOCAST_COVERING)), ids=lambda i: f"cover{i}")
def test_every_op_under_autocast_matches_jax_and_follows_the_tables(i):
    """Every op after a matmul; states, configurations and paths taken in turn (each at
    least once)."""
    check_autocast_program(AUTOCAST_COVERING[i], i, PATHS[i % len(PATHS)],
                           AUTOCAST_STATES[(i + 1) % len(AUTOCAST_STATES)], CONFIGS[i % len(CONFIGS)])


# An oracle independent of aotgrad's rewrite, for programs of the ops whose mixed-precision
# form is written out by hand (`fuzz_grammar.HAND_WRITTEN`): values, gradients and output
# dtypes against `jax.vjp` of that hand-written program. Its backward is JAX's transpose
# of the hand-cast forward, which is "off"; "same_as_forward" differs from it only where a
# backward op of the tables reads a cotangent, which these ops do not emit... except the
# 16-bit sums of broadcast cotangents, within the 16-bit tolerance.
_HAND_STATES = [s for s in AUTOCAST_STATES if s.on and s.backward in ("off", "same_as_forward")]


def check_against_hand_written(program: Program, seed: int, path: str, state: AutocastState) -> None:
    fn, args = program.fn(), program.args(seed)
    reference = hand_written(program, state.device_type, state.dtype, state.promotion)
    cts = cotangents(jax.eval_shape(reference, *args), seed)
    want_out, want_grads = jax.jit(lambda a, c: (lambda o, f: (o, f(c)))(*jax.vjp(reference, *a)))(args, cts)
    if not all_finite((want_out, want_grads)):
        return  # 16-bit overflow of the mixed-precision program itself
    with state.context():
        out, grads = _vjp(path, fn, args, cts)
    tol = AUTOCAST_TOLERANCE[state.dtype]
    assert_close(out, want_out, tol, f"{state!r} {path} value")
    assert_close(grads, tuple(want_grads), tol, f"{state!r} {path} gradient")


# CI: a fixed slice of 30 (the random draws alone cover the oracle's ops but tanh).
@settings(FUZZ_SETTINGS, max_examples=EXAMPLES if LONG_RUN else 30)
@given(program=programs(first_ops=("matmul_nt", "matmul_tn"), chain=True, ops=tuple(HAND_WRITTEN)),
       seed=st.integers(0, 2**16), path=st.sampled_from(PATHS), state=st.sampled_from(_HAND_STATES))
def test_autocast_programs_match_a_hand_written_oracle(program, seed, path, state):
    check_against_hand_written(program, seed, path, state)


# Always checked: a matmul feeding exp, log1p and a sum (fp32 on the gpu table, on no cpu
# list), under every state the oracle covers; log1p's result is returned, with its dtype.
_HAND_CHAIN = Program(inputs=((3, 4), (2, 4)), steps=(
    Step("matmul_nt", (0, 1), None), Step("exp_bounded", (2,), None), Step("log1p_square", (3,), None),
    Step("sum", (4,), 0)), outputs=(4, 5, 2), dtype="float32")


@pytest.mark.parametrize("state", _HAND_STATES, ids=repr)
def test_hand_written_oracle_regressions(state):
    check_against_hand_written(_HAND_CHAIN, 0, "vjp", state)


# ----------------------------------------------------------------------------- float64

def test_float64_programs_in_their_own_process():
    """`tests/fuzz_x64_cases.py`, with `JAX_ENABLE_X64=1` (it skips without it). A failure
    shows that run's report."""
    env = {**os.environ, "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"}
    report = run_module("fuzz_x64_cases.py", env, "float64 cases", timeout=None if LONG_RUN else 900)
    assert "skipped" not in report, report


# ----------------------------------------------------------------------------- regressions

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


# Autocast programs always checked, whatever the draws: a matmul feeding fp32 ops of the gpu
# table (exp, log1p, a sum), and one through a scan and a cond, under each table.
_MATMUL_CHAIN = Program(inputs=((3, 4), (2, 4)), steps=(
    Step("matmul_nt", (0, 1), None), Step("exp_bounded", (2,), None), Step("log1p_square", (3,), None),
    Step("sum", (4,), 0)), outputs=(5, 2), dtype="float32")
_MATMUL_LOOPS = Program(inputs=((3, 3),), steps=(
    Step("matmul_tn", (0, 0), None), Step("scan_rows", (1,), None), Step("cond", (2,), None),
    Step("cumsum", (3,), 1)), outputs=(4,), dtype="float32")
# Found by fuzzing: a max mask recomputed from a rounded bfloat16 copy matched nowhere
# (gradient 0) where XLA had kept the forward's value in float32; the mask now comes from
# the forward (docs/partitioner.md, "Equality tests").
_MAX_OF_BF16 = Program(inputs=((3, 3), (2, 1)), steps=(
    Step("matmul_tn", (1, 1), None), Step("div_safe", (2, 2), None), Step("gather_rows", (3,), (0,)),
    Step("maximum", (0, 2), None), Step("max", (5,), 0)), outputs=(6,), dtype="float32")
AUTOCAST_REGRESSIONS: list[tuple[Program, int, str, AutocastState, dict[str, Any]]] = [
    (_MAX_OF_BF16, 1242, "vjp", AUTOCAST_STATES[1], {"partitioner": "min_cut", "activation_memory_budget": 1.0}),
    (_MAX_OF_BF16, 1242, "jit_vjp", AUTOCAST_STATES[2], {"partitioner": "min_cut", "activation_memory_budget": 1.0}),
    (_MATMUL_CHAIN, 0, "vjp", AUTOCAST_STATES[3], {"partitioner": "min_cut", "activation_memory_budget": 0.5}),
    (_MATMUL_CHAIN, 1, "fwd_and_bwd", AUTOCAST_STATES[1], {"partitioner": "vjp"}),
    (_MATMUL_LOOPS, 2, "jit_vjp", AUTOCAST_STATES[5], {"partitioner": "min_cut", "activation_memory_budget": 0.0}),
]


@pytest.mark.parametrize("program, seed, path, state, config", AUTOCAST_REGRESSIONS,
                         ids=[f"autocast{i}" for i in range(len(AUTOCAST_REGRESSIONS))])
def test_autocast_regressions(program, seed, path, state, config):
    check_autocast_program(program, seed, path, state, config)


# Found by the random slice: the oracle kept a sum's 16-bit type under the gpu table, where
# reduce_sum is on the fp32 list (a float32 result, as aotgrad gives); any state, any path.
_SUM_OF_A_MATMUL = Program(inputs=((2, 2), (1, 3)), steps=(
    Step("matmul_nt", (1, 1), None), Step("add", (2, 2), None), Step("add", (3, 2), None),
    Step("sum", (2,), 1)), outputs=(5,), dtype="float32")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("state", _HAND_STATES, ids=repr)
def test_hand_written_oracle_sum_follows_the_table(state, path):
    check_against_hand_written(_SUM_OF_A_MATMUL, 591, path, state)
