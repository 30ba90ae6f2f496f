"""An estimate of a saved set's step peak on one device, for choosing between cuts before
compiling (each value counted at its size on one device: `shards.py`).

A program's peak is estimated as XLA's `memory_analysis()` adds it up: its arguments and
outputs, plus the largest total of temporaries live at once, running the step's programs
as XLA runs them (`fusion.py`: in emitted order, the backward's untied recomputation at
its start). A temporary is counted only if XLA writes it to memory (`fusion.reads`: not
an elementwise value read by one elementwise equation or one reduction, which fuses into
it; on XLA:GPU not cheap elementwise work either, computed again in each reader, whose
operand is kept instead: `rules.duplicated`), from its equation to its last reader, and
not beside an operand whose buffer it takes: an elementwise result writes over a
same-sized operand read for the last time, a scatter or an update in place over its first
operand. On XLA:GPU a reduction over the last axis is one kernel with the elementwise work
around it, which holds the reduction's input until it writes (`_held_by_kernels`: a
softmax's backward holds the scores and the probability gradient beside the score
gradient). A `split`'s operand lives as long as its parts (and their reshapes), whose
readers read it (8 H100s, GPT-2 medium with sharded parameters: a cut that saved each
layer's q, k and v held the qkv projection beside them: 13952.82 MB of activations, where
the estimate without it was 11274.8 MB for the whole step).

An eager call's step peak is the larger of its two programs', the saved values arguments
of the whole backward; a jitted step's is its one program's, where each saved value is
freed after its last reader.
"""
from __future__ import annotations

from typing import Callable

from jax.extend.core import JaxprEqn, Var

from aotgrad.partition import costs, peak_arrays
from aotgrad.partition.fusion import FUSED, Program, Programs, Reads, Row, Value, reads, rows
from aotgrad.partition.rules import IN_PLACE, Kind

__all__ = ["estimate"]


def estimate(step: Programs) -> int:
    """The estimated peak of the step's programs (`fusion.programs`): the largest of
    theirs."""
    return max(_run_peak(step, run) for run in step.runs)


def _run_peak(step: Programs, run: Program) -> int:
    """One program's estimated peak: on arrays where `peak_arrays` covers it (not on a GPU:
    `_held_by_kernels`)."""
    device = None if step.graph is None else step.graph.device
    whole_kernels = device is not None and device.platform == "gpu"  # measured on XLA:GPU only
    if step.graph is not None and not whole_kernels and peak_arrays.supports(step.graph, run):
        return peak_arrays.program_peak(step.graph, run)
    return _program_peak(run.eqns, run.args, run.outs, step.size, step.recomputed_in_readers, run.early,
                         run.table(step.recomputed_in_readers), whole_kernels)


def _program_peak(eqns: list[JaxprEqn], args: list[Var], outs: list,
                  size: Callable[[Var], int] = lambda v: costs.nbytes(v.aval),
                  recomputed_in_readers: Callable[[JaxprEqn], bool] = lambda e: False,
                  early: range = range(0), table: list[Row] | None = None, whole_kernels: bool = False) -> int:
    """Arguments + outputs + the most temporaries live at once, running `eqns` in order.
    A value is held from its equation to its last reader if XLA writes it (`fusion.reads`); a
    value computed again in each fusing reader (`recomputed_in_readers`,
    `rules.duplicated`) is not written for a second one: its operands are read there
    instead, and live until then.
    A result takes the buffer of an operand read for the last time by the same equation
    where XLA reuses it: an elementwise result of the operand's size (a fused loop writes
    over its input), an update in place (`IN_PLACE`) over its first operand. A variable
    bound twice (a forward value the backward recomputes, in one program) is two buffers.
    `size`: a value's bytes (on one device: `shards.per_device_bytes`); `early`: the
    backward's recomputation moved to its start (`fusion.Program.early`); `table`: the
    equations' `fusion.Row`s, if known; `whole_kernels`: a value a reduction over its last
    axis reads lives until that reduction's kernel ends (`_held_by_kernels`)."""
    arg_set = set(args)
    out_set = {v for v in outs if isinstance(v, Var)}
    fixed = sum(size(v) for v in arg_set) + sum(size(v) for v in out_set - arg_set)
    if table is None:
        table = rows(eqns, recomputed_in_readers)
    kinds = [row[2] for row in table]
    r = reads(eqns, kinds, recomputed_in_readers, early, table)
    if whole_kernels:
        _held_by_kernels(eqns, kinds, r)
    operands, last, written = r.operands, r.last, r.written
    held: dict[Value, int] = {}  # temporaries in memory: their bytes
    frees: dict[int, list[Value]] = {}
    live = peak = 0
    for i, e in enumerate(eqns):
        made_fuses = kinds[i] in FUSED
        # Operands whose last reader this is: all are among the values freed here.
        dying = [u for u in operands[i] if u in held and last[u] == i] if i in frees else []
        reusable = _reusable(e, kinds[i], dying) if dying else dying
        for v in table[i][1]:
            if v in out_set or v in arg_set:
                continue
            made = (v, i)
            if made_fuses and made not in written:
                continue
            b = size(v)
            taken = next((u for u in reusable if held[u] == b), None)
            if taken is not None:  # the operand's buffer, no longer freed at i
                reusable.remove(taken)
                frees[i].remove(taken)
                del held[taken]
            else:
                live += b
            held[made] = b
            frees.setdefault(last.get(made, i), []).append(made)  # after its last reader, or at once
        if live > peak:
            peak = live
        for u in frees.pop(i, ()):
            live -= held.pop(u)
    return fixed + peak


def _held_by_kernels(eqns: list[JaxprEqn], kinds: list[Kind], r: Reads) -> None:
    """XLA:GPU runs a reduction over the last axis in one kernel with the elementwise work
    that reads its input and its result (a softmax, a layer norm, their backwards): a value
    in memory that such a reduction reads lives until that kernel writes, at the end of the
    chain of fused equations that read the value there. (A softmax's backward reads the
    scores and the probability gradient until it writes the score gradient: freed at their
    last reader inside the chain, three (B, H, T, T) buffers were counted as two.) Only
    there: elsewhere freeing at the last fused reader ranked a ViT's and a transformer
    block's cuts as XLA:GPU peaks them."""
    def fused(u: Value) -> bool:  # computed inside its reader, not written
        return u[1] >= 0 and kinds[u[1]] in FUSED and u in r.last and u not in r.written

    runs_at = list(range(len(kinds)))  # each equation: where the kernel it fuses into runs
    made: dict[int, list[Value]] = {}
    for u in r.last:
        if u[1] >= 0:
            made.setdefault(u[1], []).append(u)
    for j in range(len(kinds) - 1, -1, -1):
        outs = made.get(j, ())
        if outs and kinds[j] in FUSED and all(fused(u) for u in outs):
            runs_at[j] = max(runs_at[r.last[u]] for u in outs)
    for w, readers in r.readers.items():
        if fused(w):
            continue
        ends = [runs_at[i] for i in readers]
        if any(kinds[i] is Kind.REDUCE and costs.over_last_axis(eqns[i]) for i in ends):
            r.last[w] = max(max(ends), r.last.get(w, -1))


def _reusable(eqn: JaxprEqn, kind: Kind, dying: list[Value]) -> list[Value]:
    """The operands read for the last time by `eqn` whose buffers its result may take."""
    if eqn.primitive in IN_PLACE:
        return [u for u in dying if u[0] is eqn.invars[0]]
    return dying if kind is Kind.CHEAP else []


