"""The ahead-of-time stages of a compiled function: `Lowered` (both programs in StableHLO)
and `Compiled` (both compiled by XLA)."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from aotgrad.runtime import ProgramPair, Timings

__all__ = ["Compiled", "Lowered"]


@dataclasses.dataclass(frozen=True)
class _Stages:
    """Shared by `Lowered` and `Compiled`: a forward and a backward `jax.stages` object."""
    name: str
    pair: ProgramPair
    forward: Any
    backward: Any
    timings: Timings

    def as_text(self) -> str:
        return (f"// aotgrad forward program of {self.name}\n{self.forward.as_text()}\n"
                f"// aotgrad backward program of {self.name}\n{self.backward.as_text()}")


@dataclasses.dataclass(frozen=True)
class Lowered(_Stages):
    """Both programs lowered to StableHLO; `.compile()` compiles them."""

    def compile(self) -> "Compiled":
        """Compiles both lowered programs with XLA (timed in `Compiled.timings`)."""
        t0 = time.perf_counter()
        f, b = self.forward.compile(), self.backward.compile()
        timings = dataclasses.replace(self.timings, compile=time.perf_counter() - t0)
        return Compiled(self.name, self.pair, f, b, timings)


@dataclasses.dataclass(frozen=True)
class Compiled(_Stages):
    """Both programs compiled: each a `jax.stages.Compiled` with `as_text()`,
    `memory_analysis()` and `cost_analysis()`."""

    def memory_analysis(self) -> dict[str, Any]:
        """XLA's memory analysis of the forward and the backward program, by name."""
        return {"forward": self.forward.memory_analysis(), "backward": self.backward.memory_analysis()}

    def cost_analysis(self) -> dict[str, Any]:
        """XLA's cost analysis (FLOPs, bytes accessed) of the forward and the backward program."""
        return {"forward": self.forward.cost_analysis(), "backward": self.backward.cost_analysis()}
