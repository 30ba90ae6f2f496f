"""`peak._program_peak` on arrays, for the tens of candidate saved sets a budget weighs on
one graph: what each equation reads and makes is laid out once per graph (`Arrays`), and
each program's reads, writes and buffer lifetimes are found with numpy rather than by
following its equations one by one in Python.

The same estimate, found another way (`tests/test_planning_time.py` compares the two on
every candidate): a value XLA writes is held from its equation to its last reader, and
the step's peak is the most bytes held at once. Where a result takes the buffer of an
operand read for the last time (`peak._reusable`), the operand's bytes stay held through
that step and the result's are counted from the next. Not here: XLA:GPU's recomputation
in each reader (`rules.duplicated`) and recomputation moved to the backward's start
(`Program.early`), which `peak._program_peak` follows (`supports` says which), nor XLA:GPU's
kernels holding a last-axis reduction's input to their end (`peak._held_by_kernels`: a
GPU's programs are estimated there).
"""
from __future__ import annotations

import weakref

import numpy as np
from jax.extend.core import Var

from aotgrad._jax_internals import primitives as I
from aotgrad.partition import schedule
from aotgrad.partition.fusion import FUSED, READ_FUSED, Program, deps, table
from aotgrad.partition.graph import JointGraph
from aotgrad.partition.rules import IN_PLACE, Kind

__all__ = ["Arrays", "arrays", "program_peak", "supports"]


class Arrays:
    """Per joint equation: its variable operands and results (numbered as in `fusion.Deps`,
    laid out one after another: `in_ptr`/`in_var`, `out_ptr`/`out_var`), what its rule
    says of fusion, and each variable's bytes on one device."""

    def __init__(self, graph: JointGraph) -> None:
        t, ids = table(graph), deps(graph).ids
        ins = [[ids[v] for v in row[0]] for row in t.rows]
        outs = [[ids[v] for v in row[1]] for row in t.rows]
        self.in_ptr, self.in_var = _flat(ins)
        self.out_ptr, self.out_var = _flat(outs)
        kinds = [row[2] for row in t.rows]
        self.read_fuses = np.asarray([k in READ_FUSED for k in kinds])  # a single producer fuses into it
        self.fused = np.asarray([k in FUSED for k in kinds])  # fuses into its readers
        self.cheap = np.asarray([k is Kind.CHEAP for k in kinds])
        self.in_place = np.asarray([e.primitive in IN_PLACE for e in graph.eqns])
        self.first_in = np.asarray([ids[e.invars[0]] if e.invars and isinstance(e.invars[0], Var) else -1
                                    for e in graph.eqns], np.int64)  # an update in place's target
        self.splits = np.asarray([e.primitive is I.split_p for e in graph.eqns])
        self.views = np.asarray([e.primitive in schedule.VIEWS for e in graph.eqns])
        self.duplicated = np.asarray([row[3] for row in t.rows])
        self.size = np.zeros(len(ids), np.int64)
        for v, k in ids.items():
            self.size[k] = t.size(v)
        self.ids = ids


def _flat(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(lists) + 1, np.int64)
    ptr[1:] = np.cumsum([len(x) for x in lists])
    return ptr, np.asarray([k for x in lists for k in x], np.int64)


_ARRAYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def arrays(graph: JointGraph) -> Arrays:
    """The graph's `Arrays`, built once."""
    if graph not in _ARRAYS:
        _ARRAYS[graph] = Arrays(graph)
    return _ARRAYS[graph]


def supports(graph: JointGraph, run: Program) -> bool:
    """Whether `program_peak` estimates `run`: its joint indices are known, nothing moved to
    the backward's start, nothing computed again in each reader."""
    return run.index is not None and not len(run.early) and not arrays(graph).duplicated[run.index].any()


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The indices starts[k] .. starts[k] + counts[k] - 1, for each k in turn."""
    total = int(counts.sum())
    offsets = np.cumsum(counts) - counts
    return np.arange(total) - np.repeat(offsets, counts) + np.repeat(starts, counts)


def program_peak(graph: JointGraph, run: Program) -> int:
    """`peak._program_peak(run...)` for a run that `supports` covers."""
    a, idx = arrays(graph), np.asarray(run.index, np.int64)
    made_at, made_var = _laid_out(idx, a.out_ptr, a.out_var)
    read_at, read_var = _laid_out(idx, a.in_ptr, a.in_var)
    read = _bindings(made_var, made_at, read_var, read_at, len(idx))  # per read: the value, -1 an argument
    first_read = np.full(len(idx), -1, np.int64)  # per step: the value its first operand is
    steps_read, first = np.unique(read_at, return_index=True)
    first_read[steps_read] = read[first]
    ok = read >= 0
    read, read_at, read_var = read[ok], read_at[ok], read_var[ok]
    written, last = _writes(a, idx, len(made_var), read, read_at, first_read)
    arg_ids, out_ids = deps(graph).numbers(run.args), deps(graph).numbers(run.outs)
    kept = np.zeros(len(a.size), bool)
    kept[arg_ids] = kept[out_ids] = True
    held = ~kept[made_var] & ~(a.fused[idx[made_at]] & ~written)  # temporaries XLA writes
    start = made_at.copy()
    _take_buffers(a, idx, held, last, made_var, made_at, read, read_var, read_at, start)
    free = np.where(last >= 0, last, made_at)  # after its last reader, or at once
    size = a.size[made_var]
    live = np.zeros(len(idx) + 1, np.int64)
    np.add.at(live, start[held], size[held])
    np.add.at(live, free[held] + 1, -size[held])
    unique_args = np.unique(arg_ids)
    fixed = a.size[unique_args].sum() + a.size[np.setdiff1d(out_ids, unique_args)].sum()
    return int(fixed) + int(np.cumsum(live[:-1]).max(initial=0))


def _laid_out(idx: np.ndarray, ptr: np.ndarray, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The entries of `flat` (laid out per joint equation by `ptr`) of the equations `idx`,
    in turn, and the step (position in `idx`) of each."""
    counts = ptr[idx + 1] - ptr[idx]
    return np.repeat(np.arange(len(idx)), counts), flat[_ranges(ptr[idx], counts)]


def _writes(a: Arrays, idx: np.ndarray, m: int, read: np.ndarray, read_at: np.ndarray,
            first_read: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Of the `m` values made: which XLA writes (a second read, or one by an equation that
    does not fuse it; a split's operand whose part is read), and each one's last reader
    (-1: none), as `fusion.reads` finds them."""
    written = np.bincount(read, minlength=m) > 1
    written |= np.bincount(read[~a.read_fuses[idx[read_at]]], minlength=m) > 0
    last = np.full(m, -1, np.int64)
    np.maximum.at(last, read, read_at)
    if a.splits[idx].any():  # a split's parts are read from its operand: it is written and lives on
        through = _split_operands(a, idx, first_read, m)[read]
        into = through >= 0
        written[through[into]] = True
        np.maximum.at(last, through[into], read_at[into])
    return written, last


def _bindings(made_var: np.ndarray, made_at: np.ndarray, read_var: np.ndarray, read_at: np.ndarray,
              n: int) -> np.ndarray:
    """Per read, the value it reads: the latest binding of its variable before it (a
    forward value the backward recomputes is bound twice), as an index into the values
    made; -1 where none is (an argument)."""
    made_key = made_var * (n + 1) + made_at
    order = np.argsort(made_key, kind="stable")
    keys = made_key[order]
    j = np.searchsorted(keys, read_var * (n + 1) + read_at) - 1
    found = (j >= 0) & (keys[np.maximum(j, 0)] // (n + 1) == read_var)
    return np.where(found, order[np.maximum(j, 0)], -1)


def _split_operands(a: Arrays, idx: np.ndarray, first_read: np.ndarray, m: int) -> np.ndarray:
    """Per value made: the split operand it is a part of (or a view of a part of), -1 if
    none (or if that operand is an argument, which is never a temporary). `first_read`:
    per step, the value its first operand is (-1: an argument or none)."""
    part_of = np.full(m, -1, np.int64)
    counts = a.out_ptr[idx + 1] - a.out_ptr[idx]
    made_start = np.cumsum(counts) - counts
    splits = np.flatnonzero(a.splits[idx] & (first_read >= 0) & (counts > 0))
    part_of[_ranges(made_start[splits], counts[splits])] = np.repeat(first_read[splits], counts[splits])
    views = np.flatnonzero(a.views[idx] & ~a.splits[idx] & (first_read >= 0) & (counts > 0))
    u, made = first_read[views], made_start[views]
    while True:  # a view of a part, then a view of that view: one link of the chain a round
        through = part_of[u]
        new = (through >= 0) & (part_of[made] != through)
        if not new.any():
            break
        part_of[made[new]] = through[new]
    return part_of


def _take_buffers(a: Arrays, idx: np.ndarray, held: np.ndarray, last: np.ndarray, made_var: np.ndarray,
                  made_at: np.ndarray, read: np.ndarray, read_var: np.ndarray, read_at: np.ndarray,
                  start: np.ndarray) -> None:
    """Results that take the buffer of a same-sized operand read for the last time by
    their equation (`peak._reusable`: an elementwise result, an update in place's over its
    first operand), in `peak._program_peak`'s order: these are counted from the next step
    (`start`), the operand through this one."""
    eqn = idx[read_at]
    reusable = held[read] & (last[read] == read_at) & np.where(a.in_place[eqn], read_var == a.first_in[eqn],
                                                               a.cheap[eqn])
    size, m = a.size[made_var], len(made_var)
    pairs = np.unique(read_at[reusable] * (m + 1) + read[reusable])  # (step, value), each once
    pair_at, pair_value = pairs // (m + 1), pairs % (m + 1)
    steps, values = np.unique(pair_at, return_counts=True)
    held_at = np.flatnonzero(held)
    results = np.bincount(made_at[held_at], minlength=len(idx))[steps]
    one = (values == 1) & (results == 1)  # one operand to give, one result to take it: no order to follow
    k = held_at[np.searchsorted(made_at[held_at], steps[one])]
    u = pair_value[np.searchsorted(pair_at, steps[one])]
    takes = size[u] == size[k]
    start[k[takes]] = steps[one][takes] + 1
    steps = steps[~one & (results > 0)]  # the rest: several operands or results, in order
    made_from, made_to = np.searchsorted(made_at, steps), np.searchsorted(made_at, steps, side="right")
    read_from, read_to = np.searchsorted(read_at, steps), np.searchsorted(read_at, steps, side="right")
    for p, m0, m1, r0, r1 in zip(steps.tolist(), made_from.tolist(), made_to.tolist(), read_from.tolist(),
                                 read_to.tolist()):
        pool = list(dict.fromkeys(read[r0:r1][reusable[r0:r1]].tolist()))  # in operand order
        for k in range(m0, m1):
            if not held[k]:
                continue
            taken = next((j for j, u in enumerate(pool) if size[u] == size[k]), None)
            if taken is not None:
                start[k] = p + 1
                del pool[taken]
                if not pool:
                    break
