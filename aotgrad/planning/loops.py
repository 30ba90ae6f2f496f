"""A step's FLOPs and bytes with each loop counted as many times as it runs, each library
call counted (`library_calls`), and each asynchronous slice at the bytes it moves
(`async_excess`).

XLA's cost analysis counts a `while` body once, whatever its trip count: a model written as
a `lax.scan` over its layers was counted as if it had one layer (a scanned GPT-2 small's
fused step on an H100: 2.33 TFLOP, the unrolled one's 7.05). Each loop whose trip count XLA
knows (`known_trip_count`: a scan, a `fori_loop` with static bounds) has its body analysed
on its own, the module's text with that body as its entry, and counted that many times,
nested loops inside out (the scanned step: 7.04 TFLOP). A loop XLA does not know the count
of (a `while_loop` that tests a value) counts once, as the analysis counts it. A library
call counts where it is: in a loop body, as often as the body runs; anywhere else, once.
Bytes are counted so too, and what the analysis charges a body's asynchronous updates of
its stacks beyond what they write (`async_excess`) as often: that excess, left in, grows
with the square of the trip count.
"""
from __future__ import annotations

import dataclasses
import re

from aotgrad.planning.async_excess import async_excess
from aotgrad.planning.hlo_text import NAME, Analyse, as_entry, computations
from aotgrad.planning.library_calls import LibraryCalls, library_calls

__all__ = ["Counted", "counted"]

_WHILE = re.compile(r" while\(.*?body=%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Counted:
    """One step's numbers, each loop counted as often as it runs (None: not known)."""
    flops: float | None
    bytes_accessed: float | None  # as the analysis charges them, library calls included
    excess: float  # of `bytes_accessed`, what asynchronous slices are charged beyond what they move
    calls: LibraryCalls  # each instruction once (what computations no loop or entry runs hold left out)


def counted(text: str, whole: dict, analyse: Analyse) -> Counted:
    """The step's numbers, from its optimized module's `text` and `whole`, XLA's cost
    analysis of that module; `analyse` analyses a module given as text. A number is None
    where the analysis could not make it or a loop body could not be analysed."""
    blocks, entry = computations(text)
    loops: dict[str, list[tuple[str, int]]] = {name: [] for name in blocks}
    for name, lines in blocks.items():
        for line in lines:
            if m := _WHILE.search(line):
                trip = _TRIP.search(line)
                loops[name].append((m[1], int(trip[1]) if trip else 1))
    bodies = {body for found in loops.values() for body, _ in found}
    owned = {*bodies, entry}
    owner = _owners(blocks, owned)
    calls = {name: library_calls("\n".join(line for b, lines in blocks.items() if owner[b] == name for line in lines))
             for name in owned}
    nested = {name: [w for b in blocks if owner[b] == name for w in loops[b]] for name in owned}
    analysed: dict[str, dict] = {entry: whole}
    done: dict[tuple[str, str], float | None] = {}

    def once(name: str, key: str) -> float | None:  # the analysis's count: its loops once each
        if name not in analysed:
            analysed[name] = analyse(as_entry(text, name))
        return analysed[name].get(key)

    def own(name: str, key: str) -> float:  # what the analysis leaves out of `name` (each call was charged -1)
        c = calls[name]
        return c.count + (c.flops if key == "flops" else c.bytes)

    def run(name: str, key: str) -> float | None:  # one run of `name`, its loops counted inside out
        if (name, key) not in done:
            total = once(name, key)
            if total is not None:
                total += own(name, key)
                for body, trip in nested[name]:
                    inner, counted_once = run(body, key), once(body, key)
                    if inner is None or counted_once is None:
                        total = None
                        break
                    total += trip * inner - counted_once
            done[name, key] = total
        return done[name, key]

    def excess(name: str) -> float:
        inner = sum(trip * excess(body) for body, trip in nested[name])
        return async_excess(blocks[name], blocks, text, analyse) + inner
    return Counted(run(entry, "flops"), run(entry, "bytes accessed"), excess(entry),
                   sum(calls.values(), LibraryCalls()))


def _owners(blocks: dict[str, list[str]], roots: set[str]) -> dict[str, str]:
    """For each computation, the root (the entry or a loop's body) whose runs run it: a
    fusion's computation, a branch, a reducer run where the computation that calls them
    does (XLA:GPU puts a cuBLAS call that writes into a slice inside a fusion)."""
    owner: dict[str, str] = {}
    for root in sorted(roots):
        stack = [root]
        while stack:
            name = stack.pop()
            if name in owner or (name in roots and name != root):
                continue
            owner[name] = root
            stack += [ref for line in blocks[name] for ref in NAME.findall(line) if ref in blocks]
    return {name: owner.get(name, "") for name in blocks}
