"""The library calls of an optimized GPU module, which XLA's cost analysis leaves out.

XLA:GPU runs a matmul it does not fuse as a cuBLAS call and a convolution as a cuDNN call
(`custom-call` instructions). The generic HLO cost analysis charges each custom call -1
FLOPs and -1 bytes ("unknown"), so a step whose matmuls are library calls is counted
without them: a real GPU's, where autotuning picks them (GPT-2 small's fused step on an
H200: 0.50 TFLOP counted, its matmuls alone 7), and a compile-only target's convolutions.
Read from the module's text, each call's bytes are its operands' and its result's (not a
library's workspace), and its FLOPs those of a GEMM (2 x result elements x contracted
size) or of a convolution (2 x the forward output's elements x the filter's elements per
output feature). Each instruction counts once, as the cost analysis counts a loop body.
"""
from __future__ import annotations

import dataclasses
import math
import re

from aotgrad.planning.hlo_text import INSTRUCTION, NAME

__all__ = ["LibraryCalls", "array_bytes", "arrays", "has_library_calls", "library_calls"]

_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
               "u32": 4, "f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1,
               "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "c64": 8, "c128": 16}

_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_CALL = re.compile(r"custom-call\(([^)]*)\)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_DIM_LABELS = re.compile(r"dim_labels=\w+_(\w+)->\w+")
_LIBRARIES = ("__cublas$", "__cudnn$", "__miopen$", "__rocblas$", "__hipblas$")
_ANY_LIBRARY = re.compile('custom_call_target="(?:' + "|".join(map(re.escape, _LIBRARIES)) + ")")
_SCRATCH = ("s8", "u8")  # a library's workspace: the last element of its result tuple


@dataclasses.dataclass(frozen=True)
class LibraryCalls:
    """What a module's library calls move and compute, and how many there are (each one
    -1 FLOPs and -1 bytes in the generic cost analysis). `unknown`: the targets of calls
    whose FLOPs are not counted here (not a GEMM or a convolution: 0 FLOPs)."""
    count: int = 0
    bytes: float = 0.0
    flops: float = 0.0
    unknown: tuple[str, ...] = ()

    def __add__(self, other: LibraryCalls) -> LibraryCalls:
        return LibraryCalls(self.count + other.count, self.bytes + other.bytes, self.flops + other.flops,
                            tuple(sorted({*self.unknown, *other.unknown})))


Array = tuple[str, tuple[int, ...]]  # (element type, dimensions)


def arrays(shape: str) -> list[Array]:
    """The arrays of a printed shape (a tuple's each), of the element types counted here
    (not tokens or opaque values)."""
    return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape)
            if t in _ITEM_BYTES]


def array_bytes(array: Array) -> int:
    return math.prod(array[1]) * _ITEM_BYTES[array[0]]


def has_library_calls(hlo_text: str) -> bool:
    return _ANY_LIBRARY.search(hlo_text) is not None


def library_calls(hlo_text: str) -> LibraryCalls:
    """The library calls of an optimized module's text (`compiled.as_text()`)."""
    if "custom-call(" not in hlo_text:
        return LibraryCalls()
    shapes: dict[str, list[Array]] = {}
    calls = []
    for line in hlo_text.splitlines():
        m = INSTRUCTION.match(line)
        if not m:
            continue
        shapes[m[1]] = arrays(m[2])
        if m[3] == "custom-call" and (t := _TARGET.search(line)) and t[1].startswith(_LIBRARIES):
            calls.append((m[1], t[1], line))
    count, moved, flops, unknown = 0, 0.0, 0.0, set()
    for name, target, line in calls:
        result = shapes[name]
        if len(result) > 1 and result[-1][0] in _SCRATCH:
            result = result[:-1]
        listed = _CALL.search(line)
        operands = [shapes.get(o, []) for o in NAME.findall(listed[1] if listed else "")]
        first = [a[0] for a in operands if a]
        count += 1
        moved += sum(map(array_bytes, result)) + sum(array_bytes(a) for o in operands for a in o)
        try:
            work = _gemm_flops(line, first, result) if "blas$" in target else None
            if "$conv" in target:
                work = _conv_flops(line, target, first, result)
        except (IndexError, ValueError, ZeroDivisionError):  # a call printed otherwise: FLOPs unknown
            work = None
        if work is None:
            unknown.add(target)
        else:
            flops += work
    return LibraryCalls(count, moved, flops, tuple(sorted(unknown)))


def _gemm_flops(line: str, operands: list, result: list) -> float | None:
    """2 x the result's elements x the contracted size of the left operand."""
    m = _CONTRACTING.search(line)
    if m is None or not operands or not result:
        return None
    lhs = operands[0][1]
    contracted = math.prod(lhs[int(d.strip('" '))] for d in m[1].split(",") if d.strip('" '))
    return 2.0 * math.prod(result[0][1]) * contracted


def _conv_flops(line: str, target: str, operands: list, result: list) -> float | None:
    """2 x the forward convolution's output elements x the filter's elements per output
    feature. `dim_labels` name the forward's filter dimensions whatever the call computes:
    the filter is the second operand, or the result of a filter gradient; the forward's
    output is the result, the first operand of an input gradient, the second of a filter
    gradient."""
    m = _DIM_LABELS.search(line)
    if m is None or "o" not in m[1] or len(operands) < 2 or not result:
        return None
    if target.endswith("BackwardFilter"):
        out, kernel = operands[1], result[0]
    elif target.endswith("BackwardInput"):
        out, kernel = operands[0], operands[1]
    else:  # a forward convolution, alone or with its bias and activation
        out, kernel = result[0], operands[1]
    per_output = math.prod(kernel[1]) / kernel[1][m[1].index("o")]
    return 2.0 * math.prod(out[1]) * per_output
