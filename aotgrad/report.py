"""`aotgrad.explain`: what was saved, recomputed, and why, with the user's source lines."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from jax.extend.core import ClosedJaxpr

from aotgrad import segments
from aotgrad._jax_internals import source_line
from aotgrad.api import AOTFunction, Lowered, Traced
from aotgrad.api import compile as aot_compile
from aotgrad.autocast.rewrite import CastCounts
from aotgrad.partition.costs import nbytes as _nbytes
from aotgrad.partition.rules import FALLBACK, without_rule
from aotgrad.partition.scan import segment_schedules, uncut_scans
from aotgrad.provenance import BackwardCost, backward_costs
from aotgrad.runtime import Pair, ProgramPair, Timings
from aotgrad.signature import argnum_positions
from aotgrad.xla_buffers import xla_peak

__all__ = ["BackwardCost", "Memory", "Report", "SavedValue", "explain", "report_of"]

TOP_BACKWARD_OPS = 10  # rows of the backward-cost table `str(report)` prints


@dataclasses.dataclass(frozen=True)
class SavedValue:
    """One value the forward program saves for the backward."""
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    is_input: bool
    primitive: str  # the primitive that produced it ("input" for inputs)
    source: str  # the user's source line (or the argument's path, for inputs)
    reason: str  # why the partitioner saved it


@dataclasses.dataclass(frozen=True)
class Memory:
    """Device memory of one forward + backward step, from XLA's `memory_analysis()` of
    both compiled programs (bytes; None where the backend does not report it)."""
    forward_temp: int | None
    backward_temp: int | None
    forward_peak: int | None  # arguments + outputs (saved values included) + scratch
    backward_peak: int | None  # saved values + cotangents + gradients + scratch
    # Programs the backward runs as: more than one under donate_saved where releasing the
    # saved values as they are read peaks lower (`segments.py`; its peak then theirs).
    backward_programs: int = 1

    @property
    def peak(self) -> int | None:
        """The larger of the two programs' peaks (None where neither is reported)."""
        known = [p for p in (self.forward_peak, self.backward_peak) if p is not None]
        return max(known) if known else None

    @classmethod
    def of(cls, compiled: Any) -> "Memory":
        def stats(program: Any) -> tuple[int | None, int | None]:
            m = program.memory_analysis()
            if m is None:
                return None, None
            return int(m.temp_size_in_bytes), xla_peak(m)
        (ft, fp), (bt, bp) = stats(compiled.forward), stats(compiled.backward)
        return cls(ft, bt, fp, bp)


@dataclasses.dataclass(frozen=True)
class Report:
    """What `aotgrad.compile` builds for one call signature (every floating input
    differentiated). `str(report)` is a readable table."""
    function: str
    partitioner: str
    forward_jaxpr: ClosedJaxpr
    backward_jaxpr: ClosedJaxpr
    saved: tuple[SavedValue, ...]
    saved_bytes: int  # activations, excluding inputs
    saved_input_bytes: int
    recomputed: tuple[tuple[str, int], ...]  # (primitive, count) recomputed in the backward
    timings: Timings  # compile is ~0 when XLA's compilation cache already held the programs
    casts: CastCounts = CastCounts()  # casts autocast inserted, by policy, forward and backward
    memory: Memory | None = None  # XLA's memory analysis of both programs
    # The backward's estimated cost by the forward operation it comes from, costliest
    # first (`provenance`); None for a loaded export (its programs carry no numbers).
    backward_by_op: tuple[BackwardCost, ...] | None = None
    # Groups of recomputed equations that each wait for the cotangent first needing them
    # (`partition/schedule.py`); None for a loaded export.
    recompute_groups: int | None = None
    # Scans whose carry is saved every k-th iteration, e.g. "carry saved every 3 of 12
    # iterations" (`partition/scan.py`), in program order.
    scan_segments: tuple[str, ...] = ()
    # Scans whose body is not cut, and why, e.g. "body not cut (it has effects): the budget
    # does not act inside it"; their residuals are `jax.vjp`'s.
    uncut_scans: tuple[str, ...] = ()
    # (primitive, the rule it fell back to) for primitives of the joint graph that have no
    # recompute rule (`partition/rules.py`), e.g. a library's own primitive.
    fallback_rules: tuple[tuple[str, str], ...] = ()
    # The device profile the programs were decided for (`aotgrad.devices`: "cpu", "h100",
    # ...): the arguments' devices, a compile-only target's included; None for a loaded export.
    device: str | None = None
    # Planned for a step traced under `jax.jit`: one program with its backward, where XLA
    # frees each saved value after its last reader (`explain(..., under_jit=True)`); False:
    # for programs run apart (an eager call, `fwd_and_bwd`, an export).
    under_jit: bool = False

    def __str__(self) -> str:
        rows = [("#", "shape", "dtype", "bytes", "kind", "produced by", "source", "why")]
        for i, s in enumerate(self.saved):
            rows.append((str(i), str(list(s.shape)), s.dtype, f"{s.nbytes:,}",
                         "input" if s.is_input else "activation", s.primitive, s.source, s.reason))
        device = f", device={self.device!r}" if self.device is not None else ""
        planned = (", planned for a step under jax.jit (one program: XLA frees each saved value after its "
                   "last reader)" if self.under_jit else
                   ", runs apart (saved values cross from the forward program to the backward's, "
                   "so it saves what crosses cheapest)")
        lines = [f"aotgrad.explain({self.function}), partitioner={self.partitioner!r}{device}{planned}",
                 *_table(rows)]
        lines.append(f"saved activations: {_mb(self.saved_bytes)} in "
                     f"{sum(not s.is_input for s in self.saved)} arrays; saved inputs: "
                     f"{_mb(self.saved_input_bytes)} in {sum(s.is_input for s in self.saved)} arrays")
        recomputed = ", ".join(f"{p} x{n}" for p, n in self.recomputed) or "nothing"
        lines.append(f"recomputed in the backward: {recomputed}")
        for name, kind in self.fallback_rules:
            lines.append(f"no recompute rule for {name!r}: treated as {kind!r}")
        for schedule in self.scan_segments:
            lines.append(f"scan: {schedule}, one segment recomputed at a time")
        for why in self.uncut_scans:
            lines.append(f"scan: {why}")
        if self.recompute_groups:
            lines.append(f"recomputation runs in {self.recompute_groups} groups, each when the "
                         f"cotangent that first needs it is ready")
        if self.casts.total:
            lines.append(f"autocast casts: {self.casts}")
        if self.memory is not None and self.memory.peak is not None:
            m = self.memory
            lines.append(f"XLA memory: forward peak {_mb(m.forward_peak or 0)} (scratch {_mb(m.forward_temp or 0)}), "
                         f"backward peak {_mb(m.backward_peak or 0)} (scratch {_mb(m.backward_temp or 0)})")
            if m.backward_programs > 1:
                lines.append(f"the backward runs as {m.backward_programs} programs, each releasing the saved "
                             f"values it reads last (donate_saved)")
        if self.backward_by_op:
            lines.extend(self._backward_table(TOP_BACKWARD_OPS))
        t = self.timings
        lines.append(f"seconds: trace {t.trace:.3f}, partition {t.partition:.3f}, "
                     f"lower {t.lower:.3f}, compile {t.compile:.3f}")
        return "\n".join(lines)


    def _backward_table(self, top: int) -> list[str]:
        rows = [("backward of", "est. FLOPs", "bytes", "equations", "recomputed")]
        for c in self.backward_by_op[:top]:
            rows.append((str(c).removeprefix("backward of "), f"{c.flops:,.0f}", f"{c.bytes:,}",
                         str(c.equations), str(c.recomputed)))
        shown = min(top, len(self.backward_by_op))
        return [f"backward cost by forward operation (top {shown} of {len(self.backward_by_op)}):",
                *_table(rows, indent="  ")]


def _table(rows: list[tuple[str, ...]], indent: str = "") -> list[str]:
    """Rows as aligned columns, the first row a header underlined with dashes."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        lines.append(indent + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
        if k == 0:
            lines.append(indent + "  ".join("-" * w for w in widths))
    return lines


def _mb(n: int) -> str:
    return f"{n / 1e6:.3f} MB ({n:,} bytes)"


def _dtype_name(dtype: Any) -> str:
    return str(dtype)  # also for extended dtypes (PRNG keys: "key<fry>")


def explain(fn: Callable, *args: Any, argnums: int | Sequence[int] | None = None,
            under_jit: bool = False, **kwargs: Any) -> Report:
    """Builds (or reuses) the programs for `fn(*args, **kwargs)`, compiles them, and
    reports what the forward saves.

    Arguments:
        fn: an `aotgrad.compile`d function or a plain one.
        *args, **kwargs: its arguments, arrays or `jax.ShapeDtypeStruct`s.
        argnums: the positional arguments differentiated (as in `jax.grad` or
            `aotgrad.fwd_and_bwd`); by default every floating-point input.
        under_jit: report the plan a step traced under `jax.jit` gets: planned as one
            program with its backward (XLA frees each saved value after its last reader
            there; at budget 1 the fused step's plan), so it may save otherwise than the
            default report's plan, for programs run apart (`fwd_and_bwd`, an eager
            `jax.grad`, an export), where every saved value crosses between them. The
            memory figures are of the two programs compiled apart.
    """
    if isinstance(fn, AOTFunction) and hasattr(fn, "explain"):
        # a loaded export (`export.Exported`): no source, the report made when it was exported
        return fn.explain(*args, argnums=argnums, **kwargs)
    f = fn if isinstance(fn, AOTFunction) else aot_compile(fn)
    traced = f.trace(*args, **kwargs)
    perturbed = None
    if argnums is not None:
        who = f"aotgrad.explain({f.name})"
        perturbed = traced.entry.perturbed_for(argnum_positions(who, argnums, len(args)))
    pair = traced.pair(perturbed=perturbed, under_jit=under_jit)
    compiled = Lowered(f.name, pair, *pair.lower(traced.inputs)).compile()
    return report_of(traced, pair, compiled.timings, _segmented(pair, traced.inputs, Memory.of(compiled)))


def _segmented(pair: ProgramPair, inputs: Sequence[Any], memory: Memory) -> Memory:
    """`memory` with the backward's peak as it runs under donate_saved: in segments where
    they peak lower (`segments.chosen`), on the inputs' device."""
    shardings = {getattr(x, "sharding", None) for x in inputs}
    if memory.backward_peak is None or len(shardings) != 1 or not pair.runs_in_segments(*shardings):
        return memory
    sharding, = shardings
    found = segments.chosen(pair.split.backward, pair.n_activations, memory.backward_peak, sharding)
    if found is None:
        return memory
    return dataclasses.replace(memory, backward_peak=found.peak(sharding), backward_programs=len(found.segments))


def report_of(traced: Traced, pair: Pair, timings: Timings, memory: Memory | None, costs: bool = True) -> Report:
    """The report of one of `traced`'s compiled pairs; `costs=False` leaves out the
    backward-cost table (an export's shapes may be symbolic)."""
    if not isinstance(pair, ProgramPair):
        raise TypeError(f"aotgrad.explain({traced.name}): a report is made of a compiled pair; got {pair!r}.")
    sp = pair.split
    n_consts = len(traced.entry.fwd.consts)
    saved = []
    for v, eqn, why in zip(sp.activations, sp.producers, sp.reasons):
        saved.append(SavedValue(tuple(v.aval.shape), _dtype_name(v.aval.dtype), _nbytes(v.aval),
                                False, eqn.primitive.name, source_line(eqn), why))
    for i, why in zip(sp.saved_inputs, sp.reasons[len(sp.activations):], strict=True):
        aval = pair.in_avals[i]
        where = f"closed-over constant {i}" if i < n_consts else f"argument {traced.paths[i - n_consts]}"
        saved.append(SavedValue(tuple(aval.shape), _dtype_name(aval.dtype), _nbytes(aval),
                                True, "input", where, why))
    return Report(
        function=traced.name, partitioner=pair.partitioner,
        forward_jaxpr=sp.forward, backward_jaxpr=sp.backward, saved=tuple(saved),
        saved_bytes=sum(s.nbytes for s in saved if not s.is_input),
        saved_input_bytes=sum(s.nbytes for s in saved if s.is_input),
        recomputed=sp.recomputed, recompute_groups=sp.recompute_groups,
        scan_segments=segment_schedules(sp.forward.jaxpr), uncut_scans=uncut_scans(sp.forward.jaxpr),
        timings=timings, casts=pair.casts, memory=memory,
        fallback_rules=tuple((name, FALLBACK.value) for name in without_rule([pair.graph.closed.jaxpr])),
        device=pair.graph.device.name if pair.graph.device is not None else None,
        under_jit=pair.graph.staged,
        backward_by_op=backward_costs(sp.backward.jaxpr, len(pair.graph.cotangents)) if costs else None)
