"""The ahead-of-time stages of a compiled function, as `jax.jit`'s: `Traced` (a call's
entry: the forward traced, its program pairs), `Lowered` (both programs of a pair in
StableHLO) and `Compiled` (both compiled by XLA)."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from jax.extend.core import ClosedJaxpr

from aotgrad.entry import Entry
from aotgrad.runtime import Pair, Timings
from aotgrad.signature import argnum_positions

__all__ = ["Compiled", "Lowered", "Traced"]


@dataclasses.dataclass(frozen=True)
class Traced:
    """One call traced (`AOTFunction.trace(*args, **kwargs)`, as `jax.jit(f).trace(...)`):
    the cache entry of these arguments (the forward traced, the program pairs built for
    it, one per differentiation pattern) and the call's flat inputs. `.pair()` builds a
    pair on first use; `.lower()` lowers one, and `.lower().compile()` compiles it."""
    name: str  # the function's name
    entry: Entry  # the cached entry of the call's signature (traced on a miss)
    inputs: tuple[Any, ...]  # the call's flat inputs: closed-over values, then argument leaves

    @property
    def jaxpr(self) -> ClosedJaxpr:
        """The forward, from the argument leaves to the flat outputs (rewritten under the
        autocast setting of the call)."""
        return self.entry.fwd.jaxpr

    @property
    def paths(self) -> tuple[str, ...]:
        """The readable path of each argument leaf, e.g. ``params['w']``."""
        return self.entry.layout.paths

    @property
    def n_args(self) -> int:
        """The positional arguments of the call."""
        return self.entry.layout.n_args

    @property
    def pairs(self) -> dict[tuple[tuple[bool, ...], tuple[bool, ...], bool], Pair]:
        """The program pairs built so far (by calls, `fwd_and_bwd`, `pair`), by their pattern
        (perturbed, has_ct, staged): which inputs are differentiated, which outputs take a
        cotangent, and whether the pair is for a step traced under `jax.jit`: below budget 1
        such a step is planned as one program with its backward, so it may save otherwise
        than the eager pair `pair()`, `lower` and `explain` show."""
        return dict(self.entry.pairs)

    def perturbed(self, argnums: int | Sequence[int] | None = None) -> tuple[bool, ...]:
        """Which inputs (closed-over values, then argument leaves) are differentiated when
        the positional arguments `argnums` are, as in `jax.grad`: their floating-point
        leaves. None: every floating-point input (for a loaded export: those it exported)."""
        if argnums is None:
            return self.entry.default_perturbed
        positions = argnum_positions(f"aotgrad.compile({self.name}).trace(...)", argnums, self.n_args)
        return self.entry.perturbed_for(positions)

    def pair(self, argnums: int | Sequence[int] | None = None, *,
             perturbed: Sequence[bool] | None = None, under_jit: bool = False) -> Pair:
        """The program pair that differentiates `argnums` (see `perturbed`), or the inputs
        `perturbed` marks, with a cotangent for every floating-point output; built on first
        use, then the one calls and `fwd_and_bwd` use too. `under_jit`: the pair a step
        traced under `jax.jit` uses (below budget 1, planned as one program with its
        backward; see `pairs`)."""
        if perturbed is None:
            perturbed = self.perturbed(argnums)
        return self.entry.pair(tuple(perturbed), self.entry.default_has_ct(), under_jit)

    def lower(self, argnums: int | Sequence[int] | None = None) -> "Lowered":
        """Lowers the forward and backward programs of `pair(argnums)` for these inputs."""
        pair = self.pair(argnums)
        return Lowered(self.name, pair, *pair.lower(self.inputs))


@dataclasses.dataclass(frozen=True)
class _Stages:
    """Shared by `Lowered` and `Compiled`: a forward and a backward `jax.stages` object."""
    name: str
    pair: Pair
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
