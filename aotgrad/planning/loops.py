"""A step's FLOPs with each loop counted as many times as it runs, and each library call
counted (`library_calls`).

XLA's cost analysis counts a `while` body once, whatever its trip count: a model written as
a `lax.scan` over its layers was counted as if it had one layer (a scanned GPT-2 small's
fused step on an H100: 2.33 TFLOP, the unrolled one's 7.05). Each loop whose trip count XLA
knows (`known_trip_count`: a scan, a `fori_loop` with static bounds) has its body analysed
on its own, the module's text with that body as its entry, and counted that many times,
nested loops inside out (the scanned step: 7.04 TFLOP). A loop XLA does not know the count
of (a `while_loop` that tests a value) counts once, as the analysis counts it. A library
call counts where it is: in a loop body, as often as the body runs; anywhere else, once.

Bytes are not counted so: the analysis charges each of XLA:GPU's asynchronous in-place
updates of a stacked value (a scan's residuals) with the whole stack, so a body counted
twelve times charged the scanned GPT-2 small's fused step 447.9 GB, where the unrolled
step moves 124.3.
"""
from __future__ import annotations

import re
from typing import Callable

from aotgrad.planning.library_calls import LibraryCalls, library_calls

__all__ = ["counted"]

_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\{\s*$")
_WHILE = re.compile(r" while\(.*?body=%([\w.\-]+)")
_REF = re.compile(r"%([\w.\-]+)")  # a name: an instruction's, or a computation's it calls
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')

Analyse = Callable[[str], dict]  # HLO module text -> XLA's cost analysis ({}: it could not)


def counted(text: str, whole: dict, analyse: Analyse) -> tuple[float | None, LibraryCalls]:
    """The step's FLOPs, from its optimized module's `text` and `whole`, XLA's cost analysis
    of that module; `analyse` analyses a module given as text. None where the analysis
    could not be made or a loop body could not be analysed. And the module's library calls,
    each instruction once (what computations no loop or entry runs hold left out)."""
    blocks, entry = _blocks(text)
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
    flops: dict[str, float | None] = {entry: whole.get("flops")}
    done: dict[str, float | None] = {}

    def once(name: str) -> float | None:  # the analysis's count: its loops once each
        if name not in flops:
            flops[name] = analyse(_as_entry(text, name)).get("flops")
        return flops[name]

    def run(name: str) -> float | None:  # one run of `name`, its loops counted inside out
        if name not in done:
            total = once(name)
            if total is not None:
                total += calls[name].count + calls[name].flops  # each call was charged -1
                for body, trip in nested[name]:
                    inner, counted_once = run(body), once(body)
                    if inner is None or counted_once is None:
                        total = None
                        break
                    total += trip * inner - counted_once
            done[name] = total
        return done[name]
    return run(entry), sum(calls.values(), LibraryCalls())


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
            stack += [ref for line in blocks[name] for ref in _REF.findall(line) if ref in blocks]
    return {name: owner.get(name, "") for name in blocks}


def _blocks(text: str) -> tuple[dict[str, list[str]], str]:
    """Each computation's instruction lines, by name, and the entry's name."""
    blocks: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if m := _HEADER.match(line):
            current = blocks.setdefault(m[2], [])
            entry = m[2] if m[1] else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return blocks, entry


def _as_entry(text: str, name: str) -> str:
    """`text` with the computation `name` as the module's entry."""
    out = []
    for line in text.splitlines():
        if m := _HEADER.match(line):
            line = line[len("ENTRY "):] if m[1] else line
            line = "ENTRY " + line if m[2] == name else line
        out.append(line)
    return "\n".join(out)
