"""How programs run: the program-pair interface (`Pair`), compiled program pairs, their
backward programs, and the saved values a forward hands to its backward."""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from aotgrad import anomaly, pipeline, segments
from aotgrad.autocast.rewrite import CastCounts
from aotgrad.config import Snapshot
from aotgrad.hooks import InForce, with_hooks
from aotgrad.partition import JointGraph, Split, without_cotangents
from aotgrad.signature import ArrayImpl
from aotgrad.trace import ForwardTrace
from aotgrad.xla_buffers import aliasable, spec

__all__ = ["Backward", "GuardedBackward", "Pair", "ProgramPair", "Saved", "Timings"]

_RELEASED = (
    "aotgrad.compile({owner}): saved values were released after the first backward: "
    "aotgrad.config.donate_saved=True gives the backward program ownership of them. To run "
    "the backward more than once on the same saved values (e.g. call a jax.vjp function "
    "twice), run the forward under aotgrad.config.patch(donate_saved=False).")


@dataclasses.dataclass(frozen=True)
class Timings:
    """Seconds spent building one program pair (lower/compile: only when asked for)."""
    trace: float = 0.0
    partition: float = 0.0
    lower: float = 0.0
    compile: float = 0.0


def _placed_elsewhere(x: Any) -> bool:
    """An array or ShapeDtypeStruct placed on several devices, or on a device this process
    does not run (a compile-only target's)."""
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return False
    devices = sharding.device_set
    return len(devices) > 1 or not devices <= set(jax.devices())


class Pair(Protocol):
    """A forward and a backward program for one signature and one differentiation pattern:
    which inputs are differentiated (`perturbed`: closed-over values, then argument leaves)
    and which outputs take a cotangent (`has_ct`). Compiled ones are `ProgramPair`s; an
    export's loaded programs are `export.programs.LoadedPair`s. Entries, the `custom_vjp`
    rule, `fwd_and_bwd` and the stages use pairs through this interface only."""
    owner: str  # the function's name, for messages
    perturbed: tuple[bool, ...]
    has_ct: tuple[bool, ...]
    in_avals: tuple[Any, ...]  # of the inputs
    n_outs: int
    layouts: dict[object, Any]  # per fwd_and_bwd: how its bwd regroups gradients

    def run_forward(self, inputs: Sequence[Any], hooks: InForce | None = None) -> tuple[list[Any], "Saved"]:
        """Outputs and the values saved for the backward; `hooks`: those in force, which the
        backward runs."""

    def run_backward(self, saved: "Saved", cts: Sequence[Any], present: tuple[bool, ...] | None = None) -> list[Any]:
        """Gradients of the perturbed inputs from `saved` and the cotangents (those `present`
        marks as given, when it is not None; the others are zero)."""

    def lower(self, inputs: Sequence[Any]) -> tuple[Any, Any, Timings]:
        """Both programs lowered (`jax.stages.Lowered`) for these inputs (arrays or
        ShapeDtypeStructs)."""


@dataclasses.dataclass(eq=False)
class ProgramPair:
    """A `Pair` compiled from the joint graph: `split`'s forward and backward programs."""
    owner: str  # the function's name, for messages
    perturbed: tuple[bool, ...]
    has_ct: tuple[bool, ...]
    graph: JointGraph
    split: Split
    timings: Timings
    in_avals: tuple[Any, ...]
    partitioner: str  # the strategy that chose the saved set
    casts: CastCounts = CastCounts()  # casts autocast inserted, forward and backward
    donate_saved: bool = False  # the backward takes ownership of the saved activations
    detect_anomaly: bool = False  # the backward also reports where a NaN/Inf first appeared
    # the split with its backward rewritten under config.backward_pass_autocast
    autocast: Callable[[Split], Split] = lambda sp: sp

    def __post_init__(self) -> None:
        self.forward = jax.jit(self.split.forward_program.fn)
        self.n_outs = self.graph.n_outs
        self.layouts: dict[object, Any] = {}  # per fwd_and_bwd: how its bwd regroups gradients
        self.grad_inputs = tuple(i for i, p in enumerate(self.perturbed) if p)
        self.n_activations = len(self.split.activations)
        # `run_backward(saved, cts)`: one cotangent per output that has one -> one cotangent
        # per perturbed input. The plain one does nothing else (the hot path).
        guarded = self.donate_saved or self.detect_anomaly
        self.run_backward = (GuardedBackward if guarded else Backward)(self)
        self.backward = self.run_backward.program(None)

    @classmethod
    def build(cls, owner: str, fwd: ForwardTrace, perturbed: tuple[bool, ...],
              has_ct: tuple[bool, ...], options: Snapshot, staged: bool = False) -> "ProgramPair":
        """The pair of `fwd` for this pattern, planned under `options` for a step run as two
        programs, or as one (`staged`: traced under `jax.jit`)."""
        built = pipeline.build(fwd, perturbed, has_ct, options, staged)
        return cls(owner, perturbed, has_ct, built.graph, built.split,
                   Timings(trace=built.trace_s, partition=built.partition_s), tuple(fwd.in_avals),
                   options.partitioner, built.casts, options.donate_saved, options.detect_anomaly, built.autocast)

    @property
    def staged(self) -> bool:
        """Planned for a step traced under `jax.jit` (one program with its backward)."""
        return self.graph.staged

    def runs_in_segments(self, sharding: Any = None) -> bool:
        """Whether the backward may run as programs that release the saved values as they
        are read (`segments.py`): under donate_saved, outside anomaly mode, run apart, on
        one device (`sharding`'s; None: the default one). On several it is one program,
        which pins the gradients' shardings."""
        return (self.donate_saved and not self.detect_anomaly and not self.staged
                and (sharding is None or len(sharding.device_set) == 1))

    def backward_without(self, present: tuple[bool, ...]) -> Any:
        """The backward program (`split.Program`) taking only the cotangents marked present: every
        equation that only the others (known zero) reach is left out."""
        return self.autocast(without_cotangents(self.graph, self.split, present)).backward_program

    # ---------------------------------------------------------------- running

    def run_forward(self, inputs: Sequence[Any], hooks: InForce | None = None) -> tuple[list[Any], "Saved"]:
        """Runs the forward program; `hooks` (those in force) go to the backward in `Saved`."""
        results = self.forward(*inputs)
        saved = results[self.n_outs:]
        if self.split.saved_inputs:
            saved.extend([inputs[i] for i in self.split.saved_inputs])
        probe = results[0] if results else None
        if type(probe) is ArrayImpl and type(probe.sharding) is not SingleDeviceSharding:
            return results[:self.n_outs], Saved(saved, self, self._grad_shardings(inputs), hooks)
        return results[:self.n_outs], Saved(saved, self, None, hooks)  # one device, or traced: XLA chooses

    def _grad_shardings(self, inputs: Sequence[Any]) -> tuple[Any, ...]:
        """For a forward that ran over several devices: the differentiated inputs' shardings,
        which the backward gives their gradients (None for an input on one device, e.g.
        uncommitted: XLA chooses)."""
        shardings = [getattr(inputs[i], "sharding", None) for i in self.grad_inputs]
        return tuple(None if type(s) is SingleDeviceSharding else s for s in shardings)

    # ---------------------------------------------------------------- inspection

    def lower(self, inputs: Sequence[Any]) -> tuple[Any, Any, Timings]:
        """Lowers both programs (`jax.stages.Lowered`); inputs may be arrays or
        ShapeDtypeStructs (shardings of arrays are kept)."""
        t0 = time.perf_counter()
        lowered_f = self.forward.lower(*inputs)
        if not any(_placed_elsewhere(a) for a in inputs):
            lowered_b = self.backward.lower(*[spec(a) for a in self.split.backward_program.in_avals])
        else:  # as it runs: saved values and cotangents sharded as the forward leaves them
            lowered_b = self._lower_sharded_backward(lowered_f, inputs)
        return lowered_f, lowered_b, dataclasses.replace(self.timings, lower=time.perf_counter() - t0)

    def _lower_sharded_backward(self, lowered_f: Any, inputs: Sequence[Any]) -> Any:
        """The backward lowered for the shardings it runs with: the forward's outputs' (as
        XLA compiles it) for activations and cotangents, the inputs' for saved inputs, and
        the differentiated inputs' for the gradients. Then its memory analysis is per device."""
        outs = lowered_f.compile().output_shardings  # (cached: Lowered.compile() reuses it)
        held = [*outs[self.n_outs:], *(inputs[i].sharding for i in self.split.saved_inputs)]
        cts = [s for s, c in zip(outs[:self.n_outs], self.has_ct, strict=True) if c]
        avals = self.split.backward_program.in_avals
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s, weak_type=getattr(a, "weak_type", False))
                 for a, s in zip(avals, [*held, *cts], strict=True)]
        return self.run_backward.program(self._grad_shardings(inputs)).lower(*specs)

    def dump(self, directory: str, tag: str) -> None:
        """Writes both programs' jaxprs and lowered text (config.debug_dir)."""
        os.makedirs(directory, exist_ok=True)
        lf, lb, _ = self.lower([spec(a) for a in self.in_avals])
        for name, text in (("forward.jaxpr", str(self.split.forward)),
                           ("backward.jaxpr", str(self.split.backward)),
                           ("forward.stablehlo.txt", lf.as_text()),
                           ("backward.stablehlo.txt", lb.as_text())):
            with open(os.path.join(directory, f"{tag}.{name}"), "w") as fh:
                fh.write(text)


class Backward:
    """How a pair's backward program runs: one jitted program per set of gradient shardings
    (a forward over several devices pins them; else XLA chooses), per set of cotangents
    known to be zero (auxiliary outputs: they are not inputs of that program) and per set
    of hooks (traced in around the backward: `hooks.with_hooks`)."""

    def __init__(self, pair: ProgramPair) -> None:
        self.pair = pair
        self.donated = ()  # the saved activations XLA may write gradients into (donate_saved)
        if pair.donate_saved:
            backward = pair.split.backward  # (its jaxpr is traced only here)
            self.donated = aliasable(backward.in_avals, backward.out_avals, range(pair.n_activations))
        self.programs: dict[Any, Any] = {}  # (gradient shardings, present cotangents, hooks) -> program
        self.plain = self.program(None)

    def __call__(self, saved: "Saved", cts: Sequence[Any], present: tuple[bool, ...] | None = None) -> list[Any]:
        """`cts`: the cotangents marked present (all when `present` is None)."""
        if saved.grad_shardings is None and present is None and saved.hooks is None:
            return self.plain(*saved.arrays, *cts)
        return self.program(saved.grad_shardings, present, saved.hooks)(*saved.arrays, *cts)

    def function(self, present: tuple[bool, ...] | None, hooks: InForce | None = None) -> Callable[..., Any]:
        """The backward as a function of (saved..., present cotangents...), hooks traced in."""
        pair = self.pair
        backward = pair.split.backward_program
        has_ct = pair.has_ct
        if present is not None:
            backward = pair.backward_without(present)
            given = iter(present)
            has_ct = tuple(c and next(given) for c in has_ct)
        function = anomaly.checked(backward.closed) if pair.detect_anomaly else backward.fn
        if hooks:  # per-leaf hooks are placed in the plain backward's equation order
            function = with_hooks(function, None if pair.detect_anomaly else backward.closed, hooks,
                                  pair.perturbed, has_ct)
        return function

    def program(self, shardings: tuple[Any, ...] | None, present: tuple[bool, ...] | None = None,
                hooks: InForce | None = None) -> Any:
        """The jitted backward, with out_shardings pinned to the gradients' shardings."""
        key = (shardings, present, hooks.hooks if hooks else ())
        program = self.programs.get(key)
        if program is None:
            pinned = {}
            if shardings is not None:
                codes = [None] if self.pair.detect_anomaly else []  # anomaly's codes: XLA chooses
                pinned["out_shardings"] = [*shardings, *codes]
            program = jax.jit(self.function(present, hooks), donate_argnums=self.donated, **pinned)
            self.programs[key] = program
        return program


class GuardedBackward(Backward):
    """The backward under donate_saved (it refuses released values and releases them,
    each after the segment of the backward that reads it last: `segments.py`) and/or
    detect_anomaly (it raises where a NaN/Inf first appeared)."""

    def __init__(self, pair: ProgramPair) -> None:
        super().__init__(pair)
        self.segmented_programs: dict[Any, segments.Segmented | None] = {}  # per present cotangents

    def __call__(self, saved: "Saved", cts: Sequence[Any], present: tuple[bool, ...] | None = None) -> list[Any]:
        pair = self.pair
        owned = [a for a in saved.arrays[:pair.n_activations] if type(a) is ArrayImpl]
        if pair.donate_saved and any(a.is_deleted() for a in owned):
            raise RuntimeError(_RELEASED.format(owner=pair.owner))
        if pair.detect_anomaly and present is not None:
            # Anomaly reports index the full backward's equations: it gets the zeros.
            cts, present = _with_zeros(cts, present, pair.split.backward_program.in_avals[-len(present):]), None
        program = self.program(saved.grad_shardings, present, saved.hooks)
        if saved.hooks is None and saved.grad_shardings is None and len(owned) == pair.n_activations:
            # concrete values on one device
            program = self.segmented(present) or program
        results = program(*saved.arrays, *cts)
        if pair.donate_saved:
            for a in owned:  # XLA consumed those it aliased; release the rest now
                if not a.is_deleted():
                    a.delete()
        return anomaly.check(pair, results) if pair.detect_anomaly else results

    def segmented(self, present: tuple[bool, ...] | None = None) -> segments.Segmented | None:
        """Under donate_saved, the backward (taking the cotangents marked `present`) as
        programs that release the saved values as they are read, where that peaks lower
        on the default device (`segments.chosen`); None: one program."""
        if not self.pair.runs_in_segments():
            return None
        if present not in self.segmented_programs:  # decided when first run (two compiles)
            pair = self.pair
            backward = pair.split.backward_program if present is None else pair.backward_without(present)
            self.segmented_programs[present] = segments.chosen(backward.closed, pair.n_activations,
                                                               self.program(None, present))
        return self.segmented_programs[present]


@jax.tree_util.register_pytree_node_class
class Saved:
    """The values a forward program saved for its backward: a pytree whose leaves are the
    saved `jax.Array`s (activations first, then saved inputs). It remembers which program
    pair produced it, so a backward can refuse values saved by another function, and the
    hooks in force when the forward ran, which its backward runs."""

    def __init__(self, arrays: Sequence[Any], pair: Pair,
                 grad_shardings: tuple[Any, ...] | None = None, hooks: InForce | None = None) -> None:
        self.arrays = arrays
        self.pair = pair
        self.grad_shardings = grad_shardings  # the differentiated inputs' shardings (sharded runs)
        self.hooks = hooks  # the hooks in force when the forward ran (None: none)

    def tree_flatten(self) -> tuple[Sequence[Any], tuple[Pair, Any, Any]]:
        return self.arrays, (self.pair, self.grad_shardings, self.hooks)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Pair, Any, Any], arrays: Sequence[Any]) -> "Saved":
        return cls(arrays, *aux)

    @property
    def nbytes(self) -> int:
        """Bytes of the saved arrays (activations and saved inputs)."""
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in self.arrays)

    def __len__(self) -> int:
        return len(self.arrays)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{np.dtype(a.dtype).name}{list(a.shape)}" for a in self.arrays)
        return f"Saved({self.pair.owner}: {shapes})"


def _with_zeros(cts: Sequence[Any], present: Sequence[bool], avals: Sequence[Any]) -> list[Any]:
    """The present cotangents, with zeros where `present` is False."""
    given = iter(cts)
    return [next(given) if p else jax.numpy.zeros(a.shape, a.dtype) for p, a in zip(present, avals)]
