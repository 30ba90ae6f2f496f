"""What an `activation_memory_budget` is: a fraction of the way from the lowest estimated
step peak to the cheapest cut's (run apart: budget 1's plan's; 1: budget 1's plan, the
fused step's under `jax.jit`), or a number of bytes; and how
a byte size is written ("12GB", "512MiB"). Which cut a budget takes is `budget.py`'s."""
from __future__ import annotations

import dataclasses
import re
from fractions import Fraction
from typing import Union

__all__ = ["FUSED_REASON", "Budget", "Bytes", "is_fused_plan", "parse_bytes"]


@dataclasses.dataclass(frozen=True)
class Bytes:
    """A budget in bytes: the step's estimated peak may be at most `n`."""
    n: int

    def __str__(self) -> str:
        return f"{self.n:,} bytes"


# A fraction in [0, 1]: 1 the fused step's plan (run apart: the cut cheapest in what crosses),
# below it between the lowest and the cheapest cut's estimated peak (run apart: budget 1's
# plan's; `budget.py`). Or bytes.
Budget = Union[float, Bytes]


def is_fused_plan(budget: Budget) -> bool:
    """Budget 1 (or above): the fused step's plan, chosen without weighing a peak estimate."""
    return not isinstance(budget, Bytes) and budget >= 1.0


_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(value: int | str) -> int:
    """A byte size: an int, or a number with a unit (B, KB, MB, GB, TB powers of 1000; KiB,
    MiB, GiB, TiB powers of 1024; case-insensitive). It must come to a whole number of
    bytes ("1.5GB" does, "1.0000000001KB" does not); ValueError says why not."""
    if not isinstance(value, str):
        if value < 0:
            raise ValueError(f"a byte size must not be negative; got {value!r}.")
        return int(value)
    match = _SIZE.fullmatch(value)
    unit = match and _UNITS.get((match.group(2) or "b").lower())
    if not match or unit is None:
        raise ValueError(f"a byte size is a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), "
                         f"e.g. '12GB' or '512MiB'; got {value!r}.")
    size = Fraction(match.group(1)) * unit
    if size.denominator != 1:
        raise ValueError(f"{value!r} is not a whole number of bytes ({float(size):,.3f}).")
    return int(size)


# Why budget 1 saves a value outside scans (`Problem.top_cut`).
FUSED_REASON = "budget 1: saved, as the fused step keeps it (recomputing costs time)"
