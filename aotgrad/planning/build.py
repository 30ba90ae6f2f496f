"""`aotgrad.plan`: the training step compiled for the devices it will run on, the fused
step and aotgrad's at each memory budget, with the compiler's own numbers."""
from __future__ import annotations

import importlib.metadata
import sys
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from aotgrad.api import AOTFunction
from aotgrad.api import compile as aot_compile
from aotgrad.config import config
from aotgrad.devices import profile_of
from aotgrad.errors import BudgetUnreachable, ConfigError
from aotgrad.planning.land import Levels, has_scan
from aotgrad.planning.measure import Measured, estimate_step_s, measure
from aotgrad.planning.place import Placed, place
from aotgrad.planning.steps import Step, is_nnx_module, optimizer_specs
from aotgrad.planning.table import Plan, Row
from aotgrad.targets import resolve

__all__ = ["BUDGETS", "plan"]

BUDGETS = (1.0, 0.5, 0.2, 0.0)
# What tracing raises when the function needs an argument's value, which a
# ShapeDtypeStruct does not have.
_READS_A_VALUE = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
                  jax.errors.TracerIntegerConversionError, jax.errors.TracerBoolConversionError)


def _versions() -> dict[str, str]:
    try:
        own = importlib.metadata.version("aotgrad")
    except importlib.metadata.PackageNotFoundError:  # the source tree on the path, not installed
        own = "source"
    return {"jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"), "aotgrad": own}


def _check_budgets(budgets: Sequence[Any]) -> list[Any]:
    """Each budget as `activation_memory_budget` takes it; an error names the one refused."""
    if isinstance(budgets, (str, int, float)):
        budgets = [budgets]
    out = []
    for i, b in enumerate(budgets):
        try:
            with config.patch(activation_memory_budget=b):
                pass
        except ConfigError as e:
            raise ValueError(f"plan: budgets[{i}]={b!r}: {e}") from None
        out.append(b)
    return out


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _main_dtype(params: Any) -> str:
    """The floating dtype holding most of the parameters' bytes (what the FLOP rate is for)."""
    sizes: dict[str, int] = {}
    for x in jax.tree.leaves(params):
        if x is not None and jnp.issubdtype(x.dtype, jnp.floating):
            sizes[str(x.dtype)] = sizes.get(str(x.dtype), 0) + x.size * x.dtype.itemsize
    return max(sizes, key=sizes.__getitem__) if sizes else "float32"


def plan(fn: Callable[..., Any], *args: Any, target: Any = "h100", devices: int = 1, sharding: Any = None,
         budgets: Sequence[Any] | None = None, optimizer: Any = None, **kwargs: Any) -> Plan:
    """Compiles the training step of the loss `fn(*args, **kwargs)` for `devices` of `target`
    and returns a `Plan`: one row for the fused step `jax.jit(jax.value_and_grad(fn))`, and
    one per budget for `jax.jit(jax.value_and_grad(aotgrad.compile(fn)))` under
    `activation_memory_budget=budget` (default 1, 0.5, 0.2, 0), each with XLA's per-device
    peak, bytes moved and FLOPs, an estimated step time and its compile time.

    - `args`: arrays or `jax.ShapeDtypeStruct`s in any pytrees (no data or weights need to
      exist); the first is the parameters (a Flax NNX module or an Equinox module included):
      the step differentiates its floating-point leaves. Keyword arguments go to `fn`.
    - `target`: "h100", "a100", "tpu-v5e", "cpu" (or None), a GPU target description file,
      or real devices (`aotgrad.targets.resolve`).
    - `sharding`: "dp" (None): the first argument replicated, the others split on their
      leading axis over the devices; "fsdp": the parameters split too; or one PartitionSpec
      pytree (prefix) per positional argument (`planning/place.py`).
    - `optimizer`: an optax transformation: the step also applies the update and carries
      its state (parameters and state donated), so the peak is the whole training step's.
    Progress goes to stderr; nothing is run, only compiled."""
    if not callable(fn):
        raise TypeError(f"plan: fn must be a callable loss; got {fn!r:.100}.")
    if isinstance(fn, AOTFunction):  # already compiled: the fused row is of the function it wraps
        if getattr(fn, "__wrapped__", None) is None:
            raise TypeError("plan: fn is a compiled function without its source (a loaded export); give the "
                            "loss function itself.")
        fn = fn.__wrapped__
    if not args:
        raise TypeError("plan: give the loss's arguments (arrays or ShapeDtypeStructs), parameters first.")
    if optimizer is not None and not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(f"plan: optimizer must be an optax GradientTransformation; got {optimizer!r:.100}.")
    budgets = _check_budgets(BUDGETS if budgets is None else budgets)
    resolved = resolve(target)
    mesh = resolved.mesh(devices)
    mode = sharding if isinstance(sharding, str) else ("dp" if sharding is None else "custom")
    params, rest, unwrap = args[0], list(args[1:]), None
    if is_nnx_module(params):
        from flax import nnx
        graphdef, param_state, other_state = nnx.split(params, nnx.Param, ...)
        params, unwrap = (param_state, other_state), (lambda states: nnx.merge(graphdef, *states))
        if isinstance(sharding, (tuple, list)) and sharding:
            sharding = ((sharding[0], None), *sharding[1:])
    placed_params, placed_rest, placed_kwargs = place(params, rest, kwargs, mesh, sharding)
    step = Step(fn, placed_params, placed_rest, placed_kwargs, unwrap=unwrap)
    if optimizer is not None:
        abstract = jax.eval_shape(optimizer.init, step.diff)
        state = Placed(abstract, optimizer_specs(abstract, step.diff), mesh, "optimizer state")
        step = Step(fn, placed_params, placed_rest, placed_kwargs, unwrap, optimizer, state)
    profile = profile_of(jax.tree.leaves(step.arguments()))
    dtype = _main_dtype(step.diff)
    label = f"plan [{devices} x {resolved.name} {mode}]"

    def row(strategy: str, budget: Any) -> Row:
        def build() -> Any:
            if strategy == "fused":
                return step.jitted(step.loss).lower(*step.arguments()).compile()
            with config.patch(activation_memory_budget=budget):
                return step.jitted(aot_compile(step.loss)).lower(*step.arguments()).compile()
        print(f"{label} {_name(fn)}: {strategy}" + ("" if budget is None else f" budget {budget}")
              + ": compiling", file=sys.stderr, flush=True)
        try:
            _, m = measure(build)
        except _READS_A_VALUE as e:
            raise TypeError(f"plan: fn ({_name(fn)}) reads the value of an argument, which plan does not have: "
                            f"it compiles the step over ShapeDtypeStructs. Make the value a static part of the "
                            f"function (close over it, or pass a Python number), or use jnp.where / lax.cond "
                            f"for branches on data. JAX said: {str(e).splitlines()[0]}") from None
        peak = "-" if m.peak_bytes is None else f"{m.peak_bytes / 1e9:.3f} GB"
        moved = "-" if m.bytes_moved is None else f"{m.bytes_moved / 1e9:.3f} GB"
        print(f"{label} {_name(fn)}: compiled in {m.compile_s:.1f} s: peak {peak}, moved {moved}", file=sys.stderr,
              flush=True)
        return _row(strategy, budget, m, profile, dtype)

    rows = tuple([row("fused", None)] + [row("aotgrad", b) for b in budgets])

    def compile_budget(limit: Any) -> Row | None:
        try:
            return row("aotgrad", limit)
        except BudgetUnreachable:
            return None
    # After the first trace: the levels of a step with no scan (one ladder at every limit), or None.
    first: list[Levels | None] = []

    def joint_graph(budget: Any) -> Any:
        with config.patch(activation_memory_budget=budget):
            return aot_compile(step.loss).trace(*step.arguments()).pair(0, under_jit=True).graph

    def byte_levels(limit: int) -> list[int]:
        """The ladder of the step's function with its scans cut at `limit` (a scan's body is
        cut before the step's graph is traced); at budget 0 where no plan's estimate is that
        low (the compiled peak may still be). A step with no scan is traced once, at budget
        1 (the fused step's plan: no ladder is built while tracing), its levels kept."""
        if not first:
            graph = joint_graph(1.0)
            first.append(None if has_scan(graph.closed.jaxpr) else Levels(graph))
        if first[0] is not None:
            return first[0](limit)
        for budget in (f"{limit}B", 0.0):  # bytes, also where `limit` is 1 (as a fraction: budget 1)
            try:
                return Levels(joint_graph(budget))(limit)
            except BudgetUnreachable:
                continue
        raise AssertionError("budget 0 is always reachable")
    return Plan(resolved.name, devices, mode, _versions(), rows, compile_budget, byte_levels)


def _row(strategy: str, budget: Any, m: Measured, profile: Any, dtype: str) -> Row:
    return Row(strategy, budget, m.peak_bytes, m.bytes_moved, m.flops,
               estimate_step_s(profile, dtype, m.bytes_moved, m.flops), m.compile_s)
