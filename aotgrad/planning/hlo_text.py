"""Reading an optimized HLO module's text: its computations, its instructions.

XLA's cost analysis is read per computation (a loop body made the module's entry) and per
instruction (one alone in a module of its own), so its text is cut into computations here.
"""
from __future__ import annotations

import functools
import re
from typing import Callable

__all__ = ["Analyse", "HEADER", "INSTRUCTION", "NAME", "as_entry", "computation_texts", "computations"]

Analyse = Callable[[str], dict]  # HLO module text -> XLA's cost analysis ({}: it could not)

# `[ENTRY ]%name (params...) -> shape {`
HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\{\s*$")
# `%name = <shape> opcode(operands), attributes`: a shape may be a tuple; an operand may be
# printed with its shape before its name.
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(")
NAME = re.compile(r"%([\w.\-]+)")  # an instruction's, or a computation's it calls


def computations(text: str) -> tuple[dict[str, list[str]], str]:
    """Each computation's instruction lines, by name, and the entry's name."""
    blocks: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if m := HEADER.match(line):
            current = blocks.setdefault(m[2], [])
            entry = m[2] if m[1] else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return blocks, entry


@functools.lru_cache(maxsize=2)
def computation_texts(text: str) -> dict[str, str]:
    """Each non-entry computation's whole text (header to closing brace), by name."""
    out: dict[str, str] = {}
    name, current = None, []
    for line in text.splitlines():
        if (m := HEADER.match(line)) and not m[1]:
            name, current = m[2], [line]
        elif name is not None:
            current.append(line)
            if line.startswith("}"):
                out[name], name = "\n".join(current), None
    return out


def as_entry(text: str, name: str) -> str:
    """`text` with the computation `name` as the module's entry."""
    out = []
    for line in text.splitlines():
        if m := HEADER.match(line):
            line = line[len("ENTRY "):] if m[1] else line
            line = "ENTRY " + line if m[2] == name else line
        out.append(line)
    return "\n".join(out)
