"""How many casts autocast inserted, by policy, in the forward and in the backward."""
from __future__ import annotations

import dataclasses

__all__ = ["CastCounts"]


@dataclasses.dataclass(frozen=True)
class CastCounts:
    """Casts autocast inserted while tracing, by policy (`accumulate_fp32`: around a
    16-bit summing reduction; `restore`: back to a declared dtype), in the forward and in
    the backward."""
    forward: tuple[tuple[str, int], ...] = ()
    backward: tuple[tuple[str, int], ...] = ()

    @property
    def total(self) -> int:
        """All casts, forward and backward."""
        return sum(n for _, n in self.forward) + sum(n for _, n in self.backward)

    def __str__(self) -> str:
        def part(counts: tuple[tuple[str, int], ...]) -> str:
            return ", ".join(f"{p} x{n}" for p, n in counts) or "none"
        return f"forward: {part(self.forward)}; backward: {part(self.backward)}"
