"""What XLA says of one compiled step, on the devices it was compiled for.

- peak: `memory_analysis()` per device, arguments + outputs - outputs aliased to donated
  arguments + scratch (`xla_peak`);
- bytes accessed and FLOPs: XLA's HLO cost analysis of the optimized module
  (`_jax_internals.hlo_cost`), a loop's bytes and FLOPs counted as often as it runs
  (`loops`: the analysis counts a loop's body once). A GPU module (a compile-only one's, or a real
  GPU's) is analysed with the host's generic cost model, its library calls (cuBLAS
  matmuls, cuDNN convolutions), which the analysis leaves out, counted from its text
  (`library_calls`); where the target's compiler slices asynchronously (XLA:TPU copying
  weights in chunks, XLA:GPU writing a scan's stacks), the bytes with each slice counted at
  the bytes it moves (`async_excess`);
- an estimated step time from the device's memory bandwidth and FLOP rate (`estimate_step_s`).
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Callable

import jax

from aotgrad._jax_internals import hlo_cost, module_cost
from aotgrad.devices import DeviceProfile
from aotgrad.planning.library_calls import has_library_calls
from aotgrad.planning.async_excess import async_excess
from aotgrad.planning.hlo_text import computations
from aotgrad.planning.loops import counted
from aotgrad.xla_buffers import xla_peak

__all__ = ["EXCESS", "Measured", "async_slice_excess", "counted_cost", "estimate_step_s", "measure", "xla_peak"]


def async_slice_excess(hlo_text: str) -> float:
    """What XLA's cost analysis charges the asynchronous slices and in-place updates of an
    optimized module's entry (or of instruction lines given alone) beyond the bytes they move
    (`async_excess`)."""
    blocks, entry = computations(hlo_text)
    return async_excess(blocks[entry] if entry else hlo_text.splitlines(), blocks, hlo_text, module_cost)


@dataclasses.dataclass(frozen=True)
class Measured:
    """One compiled step, per device (None: the compiler did not say)."""
    peak_bytes: int | None
    bytes_accessed: float | None  # XLA's cost analysis, as it charges them (`counted_cost`)
    flops: float | None
    compile_s: float  # trace, lower and compile
    # Of `bytes_accessed`, what the cost analysis charges asynchronous slices and in-place
    # updates beyond the bytes they move (0 where the compiler emits none).
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
    text = compiled.as_text()
    cost = counted_cost(compiled, text)
    return compiled, Measured(None if m is None else xla_peak(m), cost.get("bytes accessed"), cost.get("flops"),
                              seconds, cost.get(EXCESS, 0.0))


EXCESS = "async excess"  # `counted_cost`'s key: of "bytes accessed", what async slices are charged beyond moving


def counted_cost(compiled: Any, text: str | None = None) -> dict[str, float]:
    """XLA's cost analysis of `compiled` (`hlo_cost`); where the module has loops or library
    calls, the generic analysis (on a GPU always), with each library call's bytes and FLOPs
    counted (it charged each -1) and each loop's bytes and FLOPs counted as often as it runs
    (`loops.counted`). Under `EXCESS`, what the bytes charge asynchronous slices and updates
    beyond what they move, counted as often (`async_excess`; subtract it for the bytes
    moved). {} where that cannot be counted (a warning says why). `text`:
    `compiled.as_text()`, if already read."""
    text = compiled.as_text() if text is None else text
    if " while(" not in text and not has_library_calls(text):
        cost = (hlo_cost(compiled, generic=True) if _platform(compiled) == "gpu" else {}) or hlo_cost(compiled)
        return {**cost, EXCESS: float(async_slice_excess(text))} if cost else cost
    whole = hlo_cost(compiled, generic=True)
    c = counted(text, whole, module_cost)
    if c.flops is None or c.bytes_accessed is None:
        warnings.warn("aotgrad: the step's bytes moved and FLOPs are not known: XLA's cost analysis counts "
                      "a loop's body once and a library call as -1, and counting them needs the host's CPU "
                      "backend (JAX_PLATFORMS must include 'cpu') to analyse the module's computations.",
                      stacklevel=2)
        return {}
    if c.calls.unknown:
        warnings.warn(f"aotgrad: the step's FLOPs leave out its calls of {', '.join(c.calls.unknown)} "
                      f"(library calls XLA's cost analysis does not count, nor does aotgrad).", stacklevel=2)
    return {**whole, "flops": c.flops, "bytes accessed": c.bytes_accessed, EXCESS: float(c.excess)}


def _platform(compiled: Any) -> str | None:
    """The platform of the devices `compiled` runs on (None: it takes no arguments)."""
    for sharding in jax.tree.leaves(compiled.input_shardings):
        return next(iter(sharding.device_set)).platform
    return None


def estimate_step_s(profile: DeviceProfile, dtype: str, bytes_moved: float | None,
                    flops: float | None) -> float | None:
    """An estimate, not a measurement: the longer of moving the step's bytes at the device's
    memory bandwidth and computing its FLOPs at its peak matmul rate for `dtype` (no overlap
    lost, no communication, no launch overhead). None where the device's numbers are not known."""
    rate = profile.flops(dtype) or profile.flops("float32")
    if bytes_moved is None or flops is None or not rate or not profile.memory_bandwidth:
        return None
    return max(bytes_moved / profile.memory_bandwidth, flops / rate)
