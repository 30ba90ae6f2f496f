"""Entries: everything for one call signature of a compiled function (its forward, the
forward-only program, the program pair of each differentiation pattern, built on first
use) and the `jax.custom_vjp` glue that makes a call differentiable by `jax.grad` /
`jax.vjp`. How an entry gets a pair is given to it: compiled entries build them from the
joint graph (`compiled_entry`), an export's loaded entry wraps the exported programs."""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from typing import Any, Callable, Protocol, Sequence

import jax
from jax.custom_derivatives import SymbolicZero
from jax.tree_util import tree_leaves, tree_unflatten

from aotgrad._jax_internals import staging
from aotgrad.collector import collector_paused
from aotgrad.config import Snapshot, config
from aotgrad.hooks import ArgLayout, Hook, InForce
from aotgrad.partition import plans_staged
from aotgrad.partition.split import named
from aotgrad.runtime import Pair, ProgramPair, Saved
from aotgrad.trace import ForwardTrace, differentiable

__all__ = ["Entry", "Forward", "HookSource", "PairMaker", "compiled_entry", "leaf_args"]

logger = logging.getLogger("aotgrad")
_dump_counter = itertools.count()

# (perturbed, has_ct, staged): which inputs are differentiated, which outputs take a
# cotangent, and whether the step is traced under `jax.jit` (one program with its backward)
Pattern = tuple[tuple[bool, ...], tuple[bool, ...], bool]


class Forward(Protocol):
    """What an entry and its stages read of its forward: a `trace.ForwardTrace`, or an
    export's loaded forward (frozen records: read-only)."""

    @property
    def consts(self) -> tuple[Any, ...]:
        """Closed-over values: the leading inputs."""

    @property
    def in_avals(self) -> tuple[Any, ...]:
        """Of (consts..., argument leaves...)."""

    @property
    def out_avals(self) -> tuple[Any, ...]:
        """Of the flat outputs."""

    @property
    def out_tree(self) -> Any:
        """The structure of the output."""

    @property
    def jaxpr(self) -> Any:
        """The forward as a `ClosedJaxpr`: argument leaves -> flat outputs."""


class HookSource(Protocol):
    """Where an entry reads the hooks in force when a forward runs (`hooks.Hooks`, or the
    view an `nnx.NnxCall` gives its inner function)."""

    @property
    def current(self) -> tuple[Hook, ...]:
        """The hooks registered now, in order."""


class PairMaker(Protocol):
    """How an entry gets the pair of a differentiation pattern it has not built yet."""

    def __call__(self, entry: "Entry", perturbed: tuple[bool, ...], has_ct: tuple[bool, ...],
                 staged: bool) -> Pair:
        """The pair of `entry` for this pattern; `staged`: for a step traced under `jax.jit`,
        whose forward and backward XLA compiles as one program."""


def leaf_args(in_tree: Any, arg_positions: tuple[int, ...]) -> tuple[int, ...]:
    """The positional argument each leaf of (dynamic args, dynamic kwargs) belongs to (-1:
    a keyword argument)."""
    dyn_args, _ = tree_unflatten(in_tree, [0] * in_tree.num_leaves)
    positions = tuple(p for p, a in zip(arg_positions, dyn_args) for _ in tree_leaves(a))
    return positions + (-1,) * (in_tree.num_leaves - len(positions))


class Entry:
    """Everything for one call signature: the forward, the forward-only program, program
    pairs per differentiation pattern (made by `make_pair` on first use), and the
    differentiable callable."""

    def __init__(self, layout: ArgLayout, fwd: Forward, forward_only: Callable[..., list[Any]],
                 make_pair: PairMaker, hooks: HookSource | None = None,
                 default_perturbed: tuple[bool, ...] | None = None, by_staging: bool = False) -> None:
        """`layout`: how the flat inputs map to the arguments; `hooks`: the function's hooks
        (read when a forward runs; None: it has none); `default_perturbed`: the inputs
        differentiated when no arguments are named (None: every floating input);
        `by_staging`: a step traced under `jax.jit` gets a pair of its own (planned for one
        program); else every call shares the pattern's one pair."""
        self.layout = layout
        self.owner = layout.owner
        self.fwd = fwd
        self.in_tree = layout.in_tree  # of (dynamic args, dynamic kwargs)
        self.arg_positions = layout.arg_positions  # position among all arguments of each dynamic arg
        self.leaf_args = leaf_args(layout.in_tree, layout.arg_positions)
        self.forward_only = forward_only
        self.make_pair = make_pair
        self.by_staging = by_staging
        self.pairs: dict[Pattern, Pair] = {}
        self.plans: dict[object, Pair] = {}  # the pair each fwd_and_bwd uses
        self.hooks = hooks
        self.default_perturbed = self.perturbed_for(None) if default_perturbed is None else default_perturbed
        self.call = self._differentiable()

    def in_force(self) -> InForce | None:
        """The hooks the next backward runs (None: none)."""
        hooks = self.hooks.current if self.hooks is not None else ()
        return InForce(hooks, self.layout) if hooks else None

    def pair(self, perturbed: tuple[bool, ...], has_ct: tuple[bool, ...], staged: bool = False) -> Pair:
        """The program pair for this differentiation pattern, made on first use; `staged`:
        for a step traced under `jax.jit` (the same pair as an eager call's unless
        `by_staging`): the `custom_vjp` forward asks for it when staging, and
        `Traced.pair` / `explain` with `under_jit`; `fwd_and_bwd` runs two programs."""
        key = (perturbed, has_ct, staged and self.by_staging)
        pair = self.pairs.get(key)
        if pair is None:
            pair = self.make_pair(self, *key)
            self.pairs[key] = pair
        return pair

    def perturbed_for(self, positions: set[int] | None) -> tuple[bool, ...]:
        """Differentiate the floating leaves of these positional arguments (None: of all
        arguments); closed-over constants are never differentiated this way."""
        n = len(self.fwd.consts)
        return (False,) * n + tuple(
            differentiable(a) and (positions is None or p in positions)
            for p, a in zip(self.leaf_args, self.fwd.in_avals[n:]))

    def default_has_ct(self) -> tuple[bool, ...]:
        return tuple(differentiable(a) for a in self.fwd.out_avals)

    def _differentiable(self) -> Callable[..., Any]:
        entry = self
        has_ct = self.default_has_ct()

        @jax.custom_vjp
        def call(*inputs: Any) -> list[Any]:
            return entry.forward_only(*inputs)

        def while_tracing() -> contextlib.AbstractContextManager:
            """Planning and tracing the programs into a step: the collector waits (`collector`)."""
            return collector_paused() if staging() else contextlib.nullcontext()

        def fwd(*primals: Any) -> tuple[list[Any], Saved]:
            with while_tracing():
                perturbed = tuple(bool(p.perturbed) for p in primals)
                pair = entry.pair(perturbed, has_ct, staging() and entry.by_staging)
                return pair.run_forward([p.value for p in primals], entry.in_force())

        def bwd(saved: Saved, cts: Sequence[Any]) -> tuple[Any, ...]:
            with while_tracing():
                return run_backward(saved, cts)

        def run_backward(saved: Saved, cts: Sequence[Any]) -> tuple[Any, ...]:
            pair = saved.pair
            given = [ct for ct, c in zip(cts, has_ct) if c]
            present = tuple(not isinstance(ct, SymbolicZero) for ct in given)
            if all(present):
                grads = iter(pair.run_backward(saved, given))
            else:  # e.g. auxiliary outputs: their zero cotangents are not inputs of the program
                grads = iter(pair.run_backward(saved, [ct for ct, p in zip(given, present) if p], present))
            return tuple(next(grads) if p else None for p in pair.perturbed)

        call.defvjp(fwd, bwd, symbolic_zeros=True)
        return call


# ----------------------------------------------------------------------------- compiled entries

def compiled_entry(layout: ArgLayout, fwd: ForwardTrace, options: Snapshot, donate_argnums: tuple[int, ...],
             hooks: HookSource | None = None) -> Entry:
    """The entry of a traced forward: its forward-only program donates the leaves of
    `donate_argnums` (negative positions count from the last positional argument, as
    static_argnums do); its pairs are built under `options`."""
    donated = {d + layout.n_args if d < 0 else d for d in donate_argnums}
    leaves = leaf_args(layout.in_tree, layout.arg_positions)
    donate = tuple(len(fwd.consts) + i for i, p in enumerate(leaves) if p in donated)
    return Entry(layout, fwd, jax.jit(named(lambda *inputs: fwd(*inputs), layout.owner), donate_argnums=donate),
                 functools.partial(_build_pair, options, fwd), hooks,
                 by_staging=plans_staged(options.partitioner, options.activation_memory_budget))


def _build_pair(options: Snapshot, fwd: ForwardTrace, entry: Entry, perturbed: tuple[bool, ...],
                has_ct: tuple[bool, ...], staged: bool) -> ProgramPair:
    """A compiled entry's pair: the joint graph of `fwd`, built under the options the entry
    was built under, planned for one program where `staged`."""
    # The options of the call that needs the pair: log_recompiles and debug_dir are not
    # keyed, so they take effect on an entry built before they were set.
    now = config.snapshot()
    if now.log_recompiles and (perturbed, has_ct, not staged) in entry.pairs:
        logger.warning("aotgrad: compiling %s again: %s", entry.owner,
                       "traced under jax.jit, planned as one program with its backward" if staged
                       else "called outside jax.jit, planned as two programs")
    elif now.log_recompiles and entry.pairs:
        n = len(entry.fwd.consts)
        # Blame the nearest pattern built (fewest differently differentiated inputs).
        old = min((k[0] for k in reversed(entry.pairs)),
                  key=lambda o: sum(a != b for a, b in zip(o, perturbed)))
        logger.warning("aotgrad: compiling %s again: differentiated inputs changed: %s -> %s",
                       entry.owner, _mask_text(old[n:]), _mask_text(perturbed[n:]))
    pair = ProgramPair.build(entry.owner, fwd, perturbed, has_ct, options, staged)
    if now.debug_dir:
        pair.dump(now.debug_dir, _dump_tag(entry.owner))
    return pair


def _mask_text(mask: Sequence[bool]) -> str:
    """`[dd-]`: which inputs are differentiated (d) or not (-)."""
    return "[" + "".join("d" if m else "-" for m in mask) + "]"


def _dump_tag(owner: str) -> str:
    """A file name prefix for one compilation's dump; with several processes (multi-host),
    each process writes its own files, even into a shared directory."""
    tag = f"{_file_safe(owner)}-{next(_dump_counter)}"
    return f"{tag}.process{jax.process_index()}" if jax.process_count() > 1 else tag


def _file_safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
