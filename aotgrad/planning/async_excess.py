"""What XLA's cost analysis charges slices and in-place updates beyond the bytes they move.

A slice is charged what it moves (its output, read and written), and an in-place update of
a slice (`dynamic-update-slice` into a buffer it aliases) the update. But:
- XLA:TPU copies a weight into on-chip memory in four asynchronous slices (`slice-start`),
  each charged the whole weight;
- XLA:GPU writes each iteration's row of a scan's stack (its residuals, its `ys`) by an
  asynchronous update (`async-start` or `fusion-start` of a dynamic-update-slice, then its
  `-done`), charged the whole stack once or twice (its result, and its operand where the
  update reads it through a bitcast), and reads a row through a bitcast of the stack (a
  dynamic slice, asynchronous or not) charged the whole stack: a loop of n iterations
  counted as often as it runs (`loops`) was charged n stacks or more, n^2 rows, for n.
Such an instruction's charge is read from the analysis of it alone (an asynchronous start
with its done), with its operands as parameters; what it moves is what it reads besides the
stack, and the row it reads (and writes out) or writes.
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping

from aotgrad.planning.hlo_text import INSTRUCTION, NAME, Analyse, computation_texts
from aotgrad.planning.library_calls import array_bytes, arrays

__all__ = ["async_excess"]

# `%x = ((f32[768,2304]{1,0:T(8,128)}), f32[192,2304]{...}, s32[]{...}) slice-start(%w), ...`:
# the operand's shape, then the slice's (a layout may hold parentheses, never braces).
_SLICE_START = re.compile(r"= \(\((\w+\[[\d,]*\])(?:\{[^}]*\})?\), (\w+\[[\d,]*\]).*? slice-start\(")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_LAYOUT = re.compile(r"\{[^}]*\}")
_FRAME = re.compile(r" stack_frame_id=\d+")


def async_excess(lines: Iterable[str], computations: Mapping[str, list[str]], text: str,
                 analyse: Analyse) -> float:
    """The sum over the asynchronous slices and in-place updates among `lines` (one
    computation's instruction lines, of the optimized module `text`) of what the cost
    analysis charges them beyond what they move. `computations`: the module's
    computations' lines by name; `analyse`: the analysis of a module given as text."""
    lines = list(lines)
    excess = 0.0
    shapes = {m[1]: m[2] for line in lines if (m := INSTRUCTION.match(line))}
    for line in lines:
        if m := _SLICE_START.search(line):
            excess += sum(map(array_bytes, arrays(m[1]))) - sum(map(array_bytes, arrays(m[2])))
        elif (m := INSTRUCTION.match(line)) and m[3] in ("async-start", "fusion-start", "fusion"):
            excess += _update_excess(m, lines, shapes, computations, text, analyse)
    return excess


def _update_excess(start: re.Match, lines: list[str], shapes: dict[str, str],
                   computations: Mapping[str, list[str]], text: str, analyse: Analyse) -> float:
    """A slice's or an in-place update's charge (a fusion, or an asynchronous start and its
    done, analysed alone) less what it moves; 0 for any other instruction."""
    called = _CALLS.search(start.string)
    root = _root(computations, called[1]) if called else None
    if root is None:
        return 0.0
    op, piece = root
    shape = _LAYOUT.sub("", start[2])
    if start[3] == "fusion":
        result, done = arrays(shape), None
    else:  # `((operands...), result, context)`
        rest = shape[shape.find(")") + 1:].lstrip(", ")
        result = [] if rest.startswith("(") else arrays(rest)[:1]  # a tuple: not one buffer
        done = next((d for line in lines if (d := INSTRUCTION.match(line)) and d[3].endswith("-done")
                     and _operands(d) == f"%{start[1]}"), None)
        if done is None:
            return 0.0
    operands = NAME.findall(_operands(start))
    if len(result) != 1 or any(o not in shapes for o in operands):
        return 0.0
    reads = [array_bytes(a) for o in operands for a in arrays(_LAYOUT.sub("", shapes[o]))]
    whole = array_bytes(result[0]) if op == "dynamic-update-slice" else max(reads, default=0)
    if whole not in reads or whole <= piece:
        return 0.0
    reads.remove(whole)  # the stack: an update writes `piece` of it in place, a slice reads `piece`
    moved = sum(reads) + piece * (1 if op == "dynamic-update-slice" else 2)
    params = [f"  %p{i} = {shapes[o]} parameter({i})" for i, o in enumerate(operands)]
    call = re.sub(r"\((.*?)\)", lambda _: "(" + ", ".join(f"%p{i}" for i in range(len(operands))) + ")",
                  start.string[start.start(3):], count=1)
    call = re.sub(r", control-predecessors=\{[^}]*\}", "", call)
    probe = [*params, f"  {'ROOT ' if done is None else ''}%start = {start[2]} {call}"]
    if done is not None:
        probe.append(f"  ROOT %done = {done[2]} {done[3]}(%start)")
    charged = analyse(_probe_module(text, called[1], "\n".join(probe))).get("bytes accessed")
    return 0.0 if charged is None else max(charged - moved, 0.0)


def _root(computations: Mapping[str, list[str]], name: str, depth: int = 4) -> tuple[str, int] | None:
    """What a computation's root does, through the fusions it calls, where it is a
    dynamic slice or update: the opcode, and the bytes of the slice it reads or writes."""
    lines = computations.get(name, ())
    shapes = {m[1]: m[2] for line in lines if (m := INSTRUCTION.match(line))}
    for line in lines:
        if line.lstrip().startswith("ROOT ") and (m := INSTRUCTION.match(line)):
            called = _CALLS.search(line)
            if m[3] == "fusion" and called and depth:
                return _root(computations, called[1], depth - 1)
            operands = NAME.findall(_operands(m))
            if m[3] == "dynamic-slice":
                return m[3], sum(map(array_bytes, arrays(_LAYOUT.sub("", m[2]))))
            if m[3] != "dynamic-update-slice" or len(operands) < 2 or operands[1] not in shapes:
                return None
            return m[3], sum(map(array_bytes, arrays(_LAYOUT.sub("", shapes[operands[1]]))))
    return None


def _probe_module(text: str, called: str, body: str) -> str:
    """A module of the computations `called` reaches in `text`, its entry the instruction
    lines `body`."""
    blocks = computation_texts(text)
    todo, seen = [called], []
    while todo:
        name = todo.pop()
        if name in blocks and name not in seen:
            seen.append(name)
            todo += NAME.findall(blocks[name].split("{", 1)[1])
    entry = "ENTRY %aotgrad_probe {\n" + body + "\n}\n"
    module = "\n\n".join(["HloModule aotgrad_probe", *(blocks[name] for name in reversed(seen)), entry])
    return _FRAME.sub("", module)  # its metadata would name stack frames the probe does not hold



def _operands(m: re.Match) -> str:
    """The operand list of an instruction matched by `INSTRUCTION` (it holds no parentheses)."""
    return m.string[m.end():].split(")", 1)[0].strip()
