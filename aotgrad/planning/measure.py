"""What XLA says of one compiled step, on the devices it was compiled for.

- peak: `memory_analysis()` per device, arguments + outputs - outputs aliased to donated
  arguments + scratch (`xla_peak`);
- bytes accessed and FLOPs: XLA's HLO cost analysis of the optimized module
  (`_jax_internals.hlo_cost`; a compile-only GPU executable's module is analysed with the
  host's generic cost model); where the target's compiler copies weights in chunks by
  asynchronous slices (XLA:TPU), the bytes with each slice counted at the bytes it moves
  (`async_slice_excess`);
- an estimated step time from the device's memory bandwidth and FLOP rate (`estimate_step_s`).
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any, Callable

from aotgrad._jax_internals import hlo_cost
from aotgrad.devices import DeviceProfile
from aotgrad.xla_buffers import xla_peak

__all__ = ["Measured", "async_slice_excess", "estimate_step_s", "measure", "xla_peak"]


_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
               "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# `%x = ((f32[768,2304]{1,0:T(8,128)}), f32[192,2304]{...}, s32[]{...}) slice-start(%w), ...`:
# the operand's shape, then the slice's (a layout may hold parentheses, never braces).
_SLICE_START = re.compile(r"= \(\((\w+)\[([\d,]*)\](?:\{[^}]*\})?\), (\w+)\[([\d,]*)\].*? slice-start\(")


def _array_bytes(dtype: str, dims: str) -> int:
    return math.prod(int(d) for d in dims.split(",") if d) * _ITEM_BYTES[dtype]


def async_slice_excess(hlo_text: str) -> int:
    """What XLA's cost analysis charges the asynchronous slices of an optimized module
    (`slice-start`) beyond the bytes they move. A slice is charged what it moves (its
    output, read and written), but an asynchronous one the whole operand as well: XLA:TPU
    copies a weight into on-chip memory in four slices, each charged the whole weight.
    Returns the sum over slices of operand bytes minus slice bytes."""
    excess = 0
    for line in hlo_text.splitlines():
        m = _SLICE_START.search(line)
        if m:
            excess += _array_bytes(m[1], m[2]) - _array_bytes(m[3], m[4])
    return excess


@dataclasses.dataclass(frozen=True)
class Measured:
    """One compiled step, per device (None: the compiler did not say)."""
    peak_bytes: int | None
    bytes_accessed: float | None  # XLA's cost analysis, as it counts
    flops: float | None
    compile_s: float  # trace, lower and compile
    # Of `bytes_accessed`, what the cost analysis charges asynchronous slices beyond the
    # bytes they move (0 where the compiler emits none).
    slice_excess: float = 0.0

    @property
    def bytes_moved(self) -> float | None:
        """Bytes accessed with each asynchronous slice at the bytes it moves."""
        return None if self.bytes_accessed is None else self.bytes_accessed - self.slice_excess


def measure(build: Callable[[], Any]) -> tuple[Any, Measured]:
    """Runs `build` (which traces, lowers and compiles a step) and reads the result."""
    t0 = time.perf_counter()
    compiled = build()
    seconds = time.perf_counter() - t0
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 (a backend without it)
        m = None
    cost = hlo_cost(compiled)
    return compiled, Measured(None if m is None else xla_peak(m), cost.get("bytes accessed"), cost.get("flops"),
                              seconds, float(async_slice_excess(compiled.as_text())))


def estimate_step_s(profile: DeviceProfile, dtype: str, bytes_moved: float | None,
                    flops: float | None) -> float | None:
    """An estimate, not a measurement: the longer of moving the step's bytes at the device's
    memory bandwidth and computing its FLOPs at its peak matmul rate for `dtype` (no overlap
    lost, no communication, no launch overhead). None where the device's numbers are not known."""
    rate = profile.flops(dtype) or profile.flops("float32")
    if bytes_moved is None or flops is None or not rate or not profile.memory_bandwidth:
        return None
    return max(bytes_moved / profile.memory_bandwidth, flops / rate)
