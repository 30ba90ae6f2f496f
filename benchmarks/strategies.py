"""Strategies: ways of computing (loss, grads wrt params) for one workload.

- `fused`: `jax.jit(jax.value_and_grad(loss))`, one XLA program (the speed reference);
- `jax_fwd_and_bwd`: `jax.fwd_and_bwd(loss, argnums=0)`, separate forward and backward
  programs with JAX's own residuals (the peer aotgrad is measured against);
- `aotgrad:<name>`: `aotgrad.fwd_and_bwd(loss, argnums=0)` built under
  `aotgrad.config.patch(partitioner=<name>)`, one per registered partitioner;
- `aotgrad:<name>@<budget>`: the same with `activation_memory_budget=<budget>`, for any
  registered partitioner and budget in [0, 1] or byte size per device ("2.4GB"), named
  explicitly (`aotgrad:*` does not expand to budgets); `+donate_saved` after either, with
  `donate_saved=True` too (its backward releases the saved values as it reads them,
  `aotgrad/segments.py`; the two programs only: a compile-only target refuses it);
- `checkpoint:<policy>`: `jax.jit(jax.value_and_grad(loss))` with `jax.checkpoint(policy=...)`
  on each layer (the scan body for scanned models), for the policies a JAX user reaches for:
  `nothing_saveable`, `dots_saveable`, `dots_with_no_batch_dims_saveable`;
- `autocast:bf16` / `autocast:fp16`: `aotgrad.fwd_and_bwd(loss, argnums=0)` built and run
  under `aotgrad.autocast(dtype=...)` (the default backend's table), to compare step time
  and saved bytes with float32; the gradient error is against float32;
  `autocast:bf16@<budget>`: the same with `activation_memory_budget=<budget>` (the budget as
  in `aotgrad:<name>@<budget>`). The same names on a compile-only target
  (`benchmarks.targets`) are the jitted step under the target's table. A model written in
  16 bits by hand (`dtype` in its sizes) is the anchor autocast is measured against, not a
  model to autocast: such a pair is refused (`not_applicable`).

`prepare(name, workload)` builds and warms a strategy and measures what does not need
repeated timing (saved bytes, XLA memory of each program, build seconds, gradient error inputs).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import time
from typing import Any, Callable, ContextManager, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import Var

import aotgrad
from aotgrad.config import budget_from_text
from aotgrad.planning.measure import xla_peak
from benchmarks.workloads import Workload, build

__all__ = ["AOTGRAD_PREFIX", "AUTOCAST_PREFIX", "Autocast", "BASE_STRATEGIES", "BuildSeconds", "CHECKPOINT_POLICIES",
           "DONATED",
           "Prepared", "ProgramMemory", "SavedBytes", "aotgrad_options", "autocast_strategy", "available",
           "applicable", "check_applies", "checkpointed", "expand", "first_line", "name_error", "narrow", "not_applicable", "prepare",
           "split_budget", "xla_peak"]

AOTGRAD_PREFIX = "aotgrad:"
BASE_STRATEGIES = ("fused", "jax_fwd_and_bwd")


@dataclasses.dataclass(frozen=True)
class SavedBytes:
    """What the forward keeps for the backward: activations, and inputs it keeps (counted
    separately: they exist anyway)."""
    activations: int
    inputs: int
    arrays: int  # number of saved arrays
    inputs_copied: int = 0  # bytes of `inputs` held in new buffers (copies), not the caller's


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """XLA's `memory_analysis()` of a strategy's programs, in bytes (None: not reported,
    or no such program). A program's peak is its arguments + outputs + scratch (`xla_peak`): for a
    backward, the saved values, cotangents and gradients it holds besides its scratch
    (under `+donate_saved`, where it runs as several programs: theirs, `report.Memory`).
    The step's peak is the larger of the two (a one-program strategy has only `forward`).

    `jitted_peak`: the peak of the same step inside one `jax.jit` (of `jax.value_and_grad`
    of the strategy's function), as a training loop that jits its step runs it. There XLA
    frees each saved value after its last use, which separate programs cannot: their
    saved values are the backward's arguments. A one-program strategy's own peak."""
    forward_temp: int | None
    forward_peak: int | None
    backward_temp: int | None = None
    backward_peak: int | None = None
    jitted_peak: int | None = None

    @property
    def peak(self) -> int | None:
        vals = [v for v in (self.forward_peak, self.backward_peak) if v is not None]
        return max(vals) if vals else None

    @classmethod
    def of(cls, forward: Any, backward: Any = None, jitted: Any = None) -> "ProgramMemory":
        """From compiled programs (`jax.stages.Compiled`); `jitted`: the step in one
        program (for a one-program strategy, `forward` itself)."""
        ft, fp = _stats(forward)
        if backward is None:
            return cls(ft, fp, jitted_peak=fp)
        bt, bp = _stats(backward)
        return cls(ft, fp, bt, bp, _stats(jitted)[1] if jitted is not None else None)


@dataclasses.dataclass(frozen=True)
class BuildSeconds:
    """Seconds aotgrad spent building the programs (from `Compiled.timings`)."""
    trace: float
    partition: float
    lower: float
    compile: float


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A strategy built and warmed for one workload."""
    name: str
    step: Callable[[], Any]  # one forward + backward; returns (loss, grads), not yet blocked
    context: Callable[[], ContextManager[Any]]  # enter around every call of `step`
    grads: Any  # gradients from one step, for the error check
    first_step_s: float  # the first call: tracing + compiling + one step
    saved: SavedBytes | None
    memory: ProgramMemory | None
    build: BuildSeconds | None
    notes: tuple[str, ...] = ()
    block: Callable[[Any], Any] = jax.block_until_ready  # waits for a `step` result


# ----------------------------------------------------------------------------- names

def available() -> tuple[str, ...]:
    """Every strategy this installation can run: the base ones, one per partitioner, and
    the autocast ones."""
    return (BASE_STRATEGIES + tuple(AOTGRAD_PREFIX + p for p in aotgrad.partitioners()) + CHECKPOINT_STRATEGIES
            + tuple(AUTOCAST_STRATEGIES))


def expand(patterns: list[str]) -> tuple[list[str], list[str]]:
    """Expands suite/flag patterns (exact names or globs such as ``aotgrad:*``) into
    available strategies, in order, without duplicates. Returns (names, messages) where
    messages explain patterns that matched nothing (e.g. a partitioner not registered
    in this version of aotgrad)."""
    have = available()
    names: list[str] = []
    messages: list[str] = []
    for pat in patterns:
        hits = [n for n in have if fnmatch.fnmatchcase(n, pat)]
        if not hits and pat.startswith(PARAMETERIZED):
            why = name_error(pat)
            if why is None:
                hits = [pat]
            else:
                messages.append(f"skipping strategy {pat!r}: {why}")
        elif not hits:
            messages.append(f"skipping strategy {pat!r}: unknown (available: {list(have)})")
        names.extend(h for h in hits if h not in names)
    return names, messages


def name_error(name: str) -> str | None:
    """Why a name of the parameterized families names no strategy, or None where it names
    one: `aotgrad:<partitioner>[@<budget>]` (a registered partitioner) and
    `autocast:<bf16|fp16>[@<budget>]`, the budget one `activation_memory_budget` takes (a
    fraction in [0, 1] or a byte size per device, "2.4GB"). A glob names none."""
    try:
        if name.startswith(AOTGRAD_PREFIX):
            split_budget(name[len(AOTGRAD_PREFIX):].removesuffix(DONATED), name)  # "@" without a budget: an error
            aotgrad.config.patch(**aotgrad_options(name[len(AOTGRAD_PREFIX):]))  # checks each option
        elif name.startswith(AUTOCAST_PREFIX):
            autocast_strategy(name)
        else:
            return f"not an {AOTGRAD_PREFIX} or {AUTOCAST_PREFIX} name"
    except ValueError as e:  # ConfigError is one
        return str(e)
    return None



# ----------------------------------------------------------------------------- building

def prepare(name: str, workload: Workload, memory: bool = True) -> Prepared:
    """Builds, compiles and warms strategy `name` on `workload`. Raises on failure."""
    if name == "fused":
        return _fused(workload, memory)
    if name == "jax_fwd_and_bwd":
        return _jax_peer(workload, memory)
    if name.startswith(AOTGRAD_PREFIX):
        return _aotgrad(name, name[len(AOTGRAD_PREFIX):], workload, memory)
    if name.startswith(AUTOCAST_PREFIX):
        return _autocast(name, workload, memory)
    if name in CHECKPOINT_STRATEGIES:
        return _checkpointed(name, workload, memory)
    raise ValueError(f"unknown strategy {name!r}; available: {list(available())}")


def _timed_first(step: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = jax.block_until_ready(step())
    return out, time.perf_counter() - t0


def _stats(compiled: Any) -> tuple[int | None, int | None]:
    """(scratch bytes, peak bytes) of one compiled program."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # some backends do not implement it
        return None, None
    if m is None:
        return None, None
    return int(m.temp_size_in_bytes), xla_peak(m)


def _fused(w: Workload, memory: bool, name: str = "fused") -> Prepared:
    fn = jax.jit(jax.value_and_grad(w.loss_fn, argnums=0))
    step = lambda: fn(w.params, w.batch)  # noqa: E731
    (_, grads), first = _timed_first(step)
    mem = ProgramMemory.of(fn.lower(w.params, w.batch).compile()) if memory else None
    return Prepared(name, step, contextlib.nullcontext, grads, first, None, mem, None)


# Names of `jax.checkpoint_policies` entries offered as strategies.
CHECKPOINT_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")
CHECKPOINT_PREFIX = "checkpoint:"
CHECKPOINT_STRATEGIES = tuple(CHECKPOINT_PREFIX + p for p in CHECKPOINT_POLICIES)


def checkpointed(name: str, w: Workload) -> Workload:
    """The same model with `jax.checkpoint(policy)` on each layer (`name`:
    "checkpoint:<policy>")."""
    policy = getattr(jax.checkpoint_policies, name[len(CHECKPOINT_PREFIX):])
    remat = functools.partial(jax.checkpoint, policy=policy)
    again = build(w.name, w.kind, w.sizes, remat=remat)  # same seed: the same parameters
    return dataclasses.replace(w, loss_fn=again.loss_fn)


def _checkpointed(name: str, w: Workload, memory: bool) -> Prepared:
    """The fused program of the same model with `jax.checkpoint(policy)` on each layer."""
    return _fused(checkpointed(name, w), memory, name)


def _fwd_bwd_step(fwd: Callable, bwd: Callable, w: Workload) -> Callable[[], Any]:
    ct = jnp.ones((), jnp.float32)  # d loss / d loss; built once, outside the timed region

    def step() -> Any:
        out, saved = fwd(w.params, w.batch)
        return out, bwd(saved, ct)
    return step


def _buffer(x: Any) -> int | None:
    try:
        return x.unsafe_buffer_pointer()
    except Exception:  # e.g. an array sharded over several devices
        return None


def _input_leaf_mask(w: Workload) -> list[bool]:
    """For each residual leaf of `jax.fwd_and_bwd`'s forward: is it an input passed
    through? (Found on the jaxpr of the unjitted forward: its output *is* an input.)
    The jitted forward returns copies, so object identity cannot tell."""
    fwd, _ = jax.fwd_and_bwd(w.loss_fn, argnums=0, jitted=False)
    closed = jax.make_jaxpr(lambda p, b: jax.tree.leaves(fwd(p, b)[1]))(w.params, w.batch)
    invars = set(closed.jaxpr.invars)
    return [isinstance(v, Var) and v in invars for v in closed.jaxpr.outvars]


def _jax_peer(w: Workload, memory: bool) -> Prepared:
    fwd, bwd = jax.fwd_and_bwd(w.loss_fn, argnums=0)
    step = _fwd_bwd_step(fwd, bwd, w)
    (_, grads), first = _timed_first(step)
    out, residuals = fwd(w.params, w.batch)
    leaves = jax.tree.leaves(residuals)
    mask = _input_leaf_mask(w)
    notes: tuple[str, ...] = ()
    if len(mask) != len(leaves):
        notes = (f"could not match residuals to inputs ({len(leaves)} leaves vs {len(mask)}); "
                 f"counting all as activations",)
        mask = [False] * len(leaves)
    theirs = {_buffer(x) for x in jax.tree.leaves((w.params, w.batch))}
    copied = sum(x.nbytes for x, m in zip(leaves, mask, strict=True) if m and _buffer(x) not in theirs | {None})
    saved = SavedBytes(activations=sum(x.nbytes for x, m in zip(leaves, mask, strict=True) if not m),
                       inputs=sum(x.nbytes for x, m in zip(leaves, mask, strict=True) if m), arrays=len(leaves),
                       inputs_copied=copied)
    if copied:
        notes += (f"the residuals hold copies of {copied / 1e6:.2f} MB of inputs (new buffers: extra memory)",)
    mem = None
    if memory:  # the jit caches make these compiles cheap: both programs already ran
        ct = jnp.ones((), jnp.float32)
        mem = ProgramMemory.of(fwd.lower(w.params, w.batch).compile(), bwd.lower(residuals, ct).compile())
    del out, residuals
    return Prepared("jax_fwd_and_bwd", step, contextlib.nullcontext, grads, first, saved, mem, None, notes)


def _jitted_step(w: Workload, notes: list[str]) -> Any:
    """The compiled `jax.jit(jax.value_and_grad(aotgrad.compile(loss)))`, as a training
    loop jits its step (built under the caller's options); None, with a note, if it
    cannot be built: the row keeps its other measurements."""
    try:
        step = jax.jit(jax.value_and_grad(aotgrad.compile(w.loss_fn), argnums=0))
        return step.lower(w.params, w.batch).compile()
    except Exception as e:  # reported, not fatal: the split programs were measured
        notes.append(f"the step in one jit could not be built: {first_line(e)}")
        return None


def first_line(e: BaseException) -> str:
    """An exception as one short line, for notes and failed rows: its type and the first
    line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def split_budget(spec: str, name: str | None = None) -> tuple[str, dict[str, Any]]:
    """"<head>[@<budget>]" (the part of a strategy name after its family's prefix) as
    (head, the `aotgrad.config.patch` options of the budget: none without one). The budget
    is a fraction or a byte size, as `activation_memory_budget` takes it (checked when the
    options are patched in); "@" with nothing after it is a ValueError naming `name`."""
    head, at, budget = spec.partition("@")
    if at and not budget:
        raise ValueError(f"strategy {name or spec!r}: no budget after '@' (a fraction in [0, 1] or a byte size "
                         f"such as 2.4GB)")
    return head, ({"activation_memory_budget": budget_from_text(budget)} if budget else {})


DONATED = "+donate_saved"  # the suffix of aotgrad strategies run with donate_saved=True


def aotgrad_options(spec: str) -> dict[str, Any]:
    """`aotgrad.config.patch` options of "<partitioner>[@<budget>][+donate_saved]"."""
    donated = spec.endswith(DONATED)
    partitioner, budgeted = split_budget(spec.removesuffix(DONATED))
    options: dict[str, Any] = {"partitioner": partitioner, **budgeted, **({"donate_saved": True} if donated else {})}
    if partitioner not in aotgrad.partitioners():
        raise ValueError(f"partitioner {partitioner!r} is not registered "
                         f"(registered: {sorted(aotgrad.partitioners())})")
    return options


def _aotgrad(name: str, partitioner: str, w: Workload, memory: bool) -> Prepared:
    options = aotgrad_options(partitioner)
    # Options are read when a function is traced, and are part of its cache key: build,
    # warm and run every call inside the same patch.
    context = lambda: aotgrad.config.patch(**options)  # noqa: E731
    notes: list[str] = []
    with context():
        fwd, bwd = aotgrad.fwd_and_bwd(w.loss_fn, argnums=0)
        step = _fwd_bwd_step(fwd, bwd, w)
        (_, grads), first = _timed_first(step)
        _, saved_tree = fwd(w.params, w.batch)
        inputs = jax.tree.leaves((w.params, w.batch))
        leaves = jax.tree.leaves(saved_tree)
        is_input = [any(x is i for i in inputs) for x in leaves]
        measured = SavedBytes(activations=sum(x.nbytes for x, m in zip(leaves, is_input, strict=True) if not m),
                              inputs=sum(x.nbytes for x, m in zip(leaves, is_input, strict=True) if m),
                              arrays=len(leaves))
        del saved_tree
        # The same differentiation pattern as fwd_and_bwd(argnums=0): `batch` is closed
        # over, so only `params` is differentiated (explain and lower differentiate every
        # floating-point argument).
        of_params = aotgrad.compile(lambda params: w.loss_fn(params, w.batch))
        compiled = of_params.lower(w.params).compile()
        report = aotgrad.explain(of_params, w.params)
        jitted = _jitted_step(w, notes) if memory else None
    if report.saved_bytes != measured.activations:
        notes.append(f"explain says {report.saved_bytes:,} saved activation bytes; "
                     f"the forward returned {measured.activations:,}")
    saved = SavedBytes(activations=report.saved_bytes, inputs=measured.inputs, arrays=measured.arrays)
    mem = ProgramMemory.of(compiled.forward, compiled.backward, jitted) if memory else None
    if mem is not None and report.memory is not None and report.memory.backward_programs > 1:
        # donate_saved: the backward runs as programs releasing what they read (their peak)
        mem = dataclasses.replace(mem, backward_peak=report.memory.backward_peak)
        notes.append(f"the backward ran as {report.memory.backward_programs} programs (donate_saved)")
    t = compiled.timings
    build = BuildSeconds(t.trace, t.partition, t.lower, t.compile)
    return Prepared(name, step, context, grads, first, saved, mem, build, tuple(notes))


# ----------------------------------------------------------------------------- autocast

AUTOCAST_PREFIX = "autocast:"
PARAMETERIZED = (AOTGRAD_PREFIX, AUTOCAST_PREFIX)  # families whose names take a budget
# dtype in a name -> (dtype, expected normwise gradient error against float32: a few 16-bit ulps)
AUTOCAST_DTYPES: dict[str, tuple[Any, float]] = {
    "bf16": (jnp.bfloat16, 5e-2),
    "fp16": (jnp.float16, 1e-2),
}
AUTOCAST_STRATEGIES = tuple(AUTOCAST_PREFIX + d for d in AUTOCAST_DTYPES)  # those `available` lists


@dataclasses.dataclass(frozen=True)
class Autocast:
    """A strategy `autocast:<bf16|fp16>[@<budget>]`: the default partitioner under
    `aotgrad.autocast(<device type>, dtype=...)` and, with a budget,
    `aotgrad.config.patch(activation_memory_budget=...)`."""
    name: str
    dtype: Any
    tolerance: float  # expected normwise gradient error against float32
    options: dict[str, Any]  # aotgrad.config.patch options (the budget, if named)

    @contextlib.contextmanager
    def context(self, device_type: str | None = None) -> Any:
        """Both settings, entered around tracing (`device_type` None: the default backend's
        table). They are read when a function is traced and are part of its cache key."""
        with aotgrad.config.patch(**self.options), aotgrad.autocast(device_type, dtype=self.dtype):
            yield


def autocast_strategy(name: str) -> Autocast:
    """The strategy `name` ("autocast:bf16", "autocast:fp16@0.5", ...) names; ValueError
    (ConfigError for a bad budget) naming it where it names none."""
    if not name.startswith(AUTOCAST_PREFIX):
        raise ValueError(f"strategy {name!r} is not an {AUTOCAST_PREFIX} name")
    short, options = split_budget(name[len(AUTOCAST_PREFIX):], name)
    if short not in AUTOCAST_DTYPES:
        raise ValueError(f"strategy {name!r}: autocast dtype {short!r} is not one of {list(AUTOCAST_DTYPES)} "
                         f"(names: {AUTOCAST_PREFIX}<dtype>[@<budget>], e.g. {AUTOCAST_PREFIX}bf16@0.5)")
    aotgrad.config.patch(**options)  # checks the budget (ConfigError, a ValueError, naming the option)
    dtype, tolerance = AUTOCAST_DTYPES[short]
    return Autocast(name, dtype, tolerance, options)


def not_applicable(strategy: str, sizes: dict[str, Any]) -> str | None:
    """Why `strategy` does not apply to a workload built with `sizes`, or None where it
    does: autocast on a model already written in 16 bits by hand (`dtype` in its sizes),
    the anchor autocast is measured against, measures nothing."""
    dtype = sizes.get("dtype", "float32")
    if strategy.startswith(AUTOCAST_PREFIX) and dtype != "float32":
        return f"the model is written in {dtype} by hand (dtype in its sizes): the anchor autocast is measured against"
    return None


def applicable(workload: str, strategies: Sequence[str], sizes: dict[str, Any]) -> tuple[list[str], str | None]:
    """The strategies that apply to the workload, and one message naming those that do not
    and why (None where all apply), for the run's log and its file."""
    out = [s for s in strategies if not_applicable(s, sizes) is None]
    left = [s for s in strategies if s not in out]
    if not left:
        return out, None
    return out, f"{workload}: {', '.join(left)} not run: {not_applicable(left[0], sizes)}"


def check_applies(strategy: str, w: Workload) -> None:
    """Raises ValueError naming the pair where `not_applicable` says why."""
    why = not_applicable(strategy, w.sizes)
    if why is not None:
        raise ValueError(f"workload {w.name!r}: {strategy} does not apply: {why}")


def _autocast(name: str, w: Workload, memory: bool) -> Prepared:
    """The default partitioner under `aotgrad.autocast(dtype=...)` (and the budget, if
    named): the settings are read when the function is traced and are part of its cache
    key, so every call runs inside them."""
    check_applies(name, w)
    spec = autocast_strategy(name)
    context = spec.context
    notes: list[str] = []
    with context():
        fwd, bwd = aotgrad.fwd_and_bwd(w.loss_fn, argnums=0)
        ct = jnp.ones((), fwd(w.params, w.batch)[0].dtype)  # the loss may be 16-bit under autocast

        def step() -> Any:
            out, saved = fwd(w.params, w.batch)
            return out, bwd(saved, ct)
        (_, grads), first = _timed_first(step)
        of_params = aotgrad.compile(lambda params: w.loss_fn(params, w.batch))
        compiled = of_params.lower(w.params).compile()
        report = aotgrad.explain(of_params, w.params)
        jitted = _jitted_step(w, notes) if memory else None
    saved = SavedBytes(activations=report.saved_bytes, inputs=report.saved_input_bytes,
                       arrays=len(report.saved))
    mem = ProgramMemory.of(compiled.forward, compiled.backward, jitted) if memory else None
    if mem is not None and report.memory is not None and report.memory.backward_programs > 1:
        # donate_saved: the backward runs as programs releasing what they read (their peak)
        mem = dataclasses.replace(mem, backward_peak=report.memory.backward_peak)
        notes.append(f"the backward ran as {report.memory.backward_programs} programs (donate_saved)")
    t = compiled.timings
    reference = jax.jit(jax.grad(w.loss_fn))(w.params, w.batch)
    error = max_relative_error(grads, reference)
    notes.insert(0, f"casts: {report.casts}")
    if error > spec.tolerance:
        notes.append(f"gradient error {error:.1e} above the expected {spec.tolerance:.0e} for "
                     f"{jnp.dtype(spec.dtype).name}")
    return Prepared(name, step, context, grads, first, saved, mem,
                    BuildSeconds(t.trace, t.partition, t.lower, t.compile), tuple(notes))


# ----------------------------------------------------------------------------- accuracy

def max_relative_error(grads: Any, reference: Any) -> float:
    """Largest, over gradient leaves, of max|g - ref| / max|ref|: normwise (inf-norm)
    relative error, which elementwise division by near-zero entries would swamp."""
    worst = 0.0
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True):
        scale = float(jnp.max(jnp.abs(r)))
        err = float(jnp.max(jnp.abs(jnp.asarray(g, jnp.float32) - r)))
        worst = max(worst, err / scale if scale > 0 else err)
    return worst


def narrow(names: list[str], only: Sequence[str],
           extend: Callable[[str], tuple[list[str], list[str]]]) -> tuple[list[str], list[str]]:
    """`names` matching a pattern of `only` (`--strategies`), then what `extend` finds for a
    pattern that matches none of them (a strategy the suite does not list, a budget named on
    the command line); and one error per pattern that matched nothing, naming the known
    names (and, for an `aotgrad:` name, why it names no strategy)."""
    extra: list[str] = []
    errors: list[str] = []
    for pat in only:
        if not any(fnmatch.fnmatchcase(n, pat) for n in names):
            hits, _ = extend(pat)
            if hits:
                extra += [h for h in hits if h not in extra]
            else:
                why = name_error(pat) if pat.startswith(PARAMETERIZED) else None
                errors.append(f"--strategies: {pat!r} matches none of {names}" + (f": {why}" if why else ""))
    return [n for n in names if any(fnmatch.fnmatchcase(n, pat) for pat in only)] + extra, errors
