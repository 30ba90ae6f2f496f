"""What an XLA program holds in device memory: its peak by XLA's own memory analysis, and
which of its arguments it can take over for its results (donation)."""
from __future__ import annotations

import collections
from typing import Any, Iterable, Sequence

import jax

__all__ = ["aliasable", "spec", "xla_peak"]


def xla_peak(analysis: Any) -> int:
    """A compiled program's peak bytes from its `memory_analysis()`: arguments + results +
    scratch, less the results written into donated arguments (aliased)."""
    m = analysis
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def aliasable(inputs: Sequence[Any], results: Sequence[Any], among: Iterable[int]) -> tuple[int, ...]:
    """The positions `among` the `inputs` (avals) that XLA can alias to a result (avals) of
    the same shape, dtype and weak type, each result taken once, in order: donating any
    other input would only warn."""
    free = collections.Counter(_key(a) for a in results)
    picks = []
    for i in among:
        key = _key(inputs[i])
        if free[key]:
            free[key] -= 1
            picks.append(i)
    return tuple(picks)


def spec(aval: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
    """A value's shape, dtype and weak type to lower a program for (on `sharding`)."""
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding, weak_type=getattr(aval, "weak_type", False))


def _key(aval: Any) -> tuple[Any, ...]:
    return aval.shape, aval.dtype, getattr(aval, "weak_type", False)
