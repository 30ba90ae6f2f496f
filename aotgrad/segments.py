"""How a backward run apart releases the saved values it has read (`config.donate_saved`).

One backward program holds every argument until it returns: XLA never frees an argument's
buffer early, so the values a forward saved are all held to the backward's end, where one
jitted step frees each after its last reader. Under `donate_saved` the backward owns them,
and is run as a few programs in order (`Segmented`), each releasing the saved values it
read last: they are cut where about an eighth (or a 32nd: `PARTS`, whichever peaks lower)
of the saved bytes has been read for the last time, at the point of that stretch where
the fewest bytes pass from one program to the next.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Var

from aotgrad.interpret import eval_jaxpr, read
from aotgrad.partition.costs import nbytes
from aotgrad.signature import ArrayImpl
from aotgrad.xla_buffers import aliasable, spec, xla_peak

__all__ = ["PARTS", "Segment", "Segmented", "chosen", "segmented"]

PARTS = (8, 32)  # the backward is cut about every 8th or 32nd of the saved bytes it reads last


@dataclasses.dataclass(frozen=True, eq=False)
class Segment:
    """One program of a segmented backward: a stretch of the backward's equations."""
    program: Callable[..., Any]  # jitted: values of `reads` -> values of `writes`
    reads: tuple[Var, ...]  # values made before it (inputs, earlier segments' results)
    writes: tuple[Var, ...]  # values it makes that later segments read, or results
    frees: tuple[Var, ...]  # saved values and earlier results it reads for the last time


@dataclasses.dataclass(frozen=True, eq=False)
class Segmented:
    """A backward as segments run in order; the first `n_owned` inputs (the saved
    activations) are released after the segment that reads them last."""
    closed: ClosedJaxpr
    segments: tuple[Segment, ...]
    owned: frozenset[Var]
    peaks: dict[Any, int] = dataclasses.field(default_factory=dict)  # `peak` per sharding

    def __call__(self, *args: Any) -> list[Any]:
        jaxpr = self.closed.jaxpr
        env = dict(zip(jaxpr.invars, args, strict=True))
        for seg in self.segments:
            results = seg.program(*[env[v] for v in seg.reads])
            for v in seg.frees:
                x = env.pop(v)
                if v in self.owned and type(x) is ArrayImpl and not x.is_deleted():
                    x.delete()  # the caller's reference too: the backward owns it
            env.update(zip(seg.writes, results, strict=True))
        return [read(env, v) for v in jaxpr.outvars]

    def peak(self, sharding: Any = None) -> int:
        """The largest device memory the segments need as they run: each one's XLA peak
        (arguments, results, scratch, less what it aliases) plus what is held beside it
        (inputs not yet released, earlier results). `sharding`: where every value is
        (one device), for a compile-only target's; None: the default device."""
        if sharding in self.peaks:
            return self.peaks[sharding]
        held = {v: nbytes(v.aval) for v in self.closed.jaxpr.invars}
        worst = 0
        for seg in self.segments:
            reads = set(seg.reads)
            own = _peak(seg.program, seg.reads, sharding)
            worst = max(worst, own + sum(b for v, b in held.items() if v not in reads))
            for v in seg.frees:
                held.pop(v, None)
            held.update((v, nbytes(v.aval)) for v in seg.writes)
        self.peaks[sharding] = worst
        return worst


def chosen(closed: ClosedJaxpr, n_owned: int, one_program: Any, sharding: Any = None) -> Segmented | None:
    """The segmented backward (cut into about each `PARTS`) that XLA's memory analysis
    says peaks lowest, if lower than `one_program` (the backward jitted whole, or its
    peak in bytes) on the device of `sharding` (None: the default device), else None.
    Cutting splits XLA's fusions and schedules, so where little is released before the
    backward's peak (a transformer block recomputing its attention at budget 0: 1 MB) it
    can peak higher; and no one fineness is best everywhere (CPU suite, budget 1: a
    transformer block 37.1 MB in 8ths, 33.9 in 32nds; its MLP 15.2 in 8ths, 16.3 in 32nds)."""
    found = [s for s in (segmented(closed, n_owned, parts) for parts in PARTS) if s is not None]
    if not found:
        return None
    if not isinstance(one_program, int):
        one_program = _peak(one_program, closed.jaxpr.invars, sharding)
    best = min(found, key=lambda s: (s.peak(sharding), len(s.segments)))
    return best if best.peak(sharding) < one_program else None


def _peak(program: Any, values: Sequence[Var], sharding: Any) -> int:
    """XLA's peak of `program` (jitted) compiled for `values` on `sharding`."""
    return xla_peak(program.lower(*[spec(v.aval, sharding) for v in values]).compile().memory_analysis())


def segmented(closed: ClosedJaxpr, n_owned: int, parts: int = PARTS[0]) -> Segmented | None:
    """`closed` (a backward: saved activations first among its inputs) as segments, or
    None where there is nothing to release before its end."""
    jaxpr = closed.jaxpr
    n = len(jaxpr.eqns)
    last: dict[Var, int] = {}
    made: dict[Var, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, Var):
                last[v] = i
        for v in eqn.outvars:
            if isinstance(v, Var):
                made[v] = i
    for v in jaxpr.outvars:
        if isinstance(v, Var):
            last[v] = n  # a result: held to the end
    owned = [v for v in jaxpr.invars[:n_owned] if -1 < last.get(v, -1) < n]
    cuts = _cuts(n, owned, made, last, parts)
    if not cuts:
        return None
    bounds = [0, *cuts, n]
    carried = set(jaxpr.invars[:n_owned]) | set(made)  # what a segment may release
    segments = []
    for a, b in zip(bounds, bounds[1:]):
        eqns = jaxpr.eqns[a:b]
        reads = list(dict.fromkeys(v for e in eqns for v in e.invars
                                   if isinstance(v, Var) and made.get(v, -1) < a and v not in jaxpr.constvars))
        writes = [v for e in eqns for v in e.outvars if isinstance(v, Var) and last.get(v, -1) >= b]
        frees = [v for v in reads if last[v] < b and v in carried]
        segments.append(Segment(_program(closed, eqns, reads, writes, frees), tuple(reads), tuple(writes),
                                tuple(frees)))
    return Segmented(closed, tuple(segments), frozenset(jaxpr.invars[:n_owned]))


def _cuts(n: int, owned: Sequence[Var], made: dict[Var, int], last: dict[Var, int], parts: int) -> list[int]:
    """Equation positions to cut before: one where about `1/parts` more of the owned bytes
    has been read for the last time, at the position of least carried bytes among those
    releasing up to half a part more."""
    released = np.zeros(n + 1)
    for v in owned:
        released[last[v] + 1] += nbytes(v.aval)
    released = np.cumsum(released)  # [p]: bytes read last before equation p
    total = released[n]
    if total == 0 or n < 2:
        return []
    delta = np.zeros(n + 2)
    for v, i in made.items():
        if -1 < last.get(v, -1) < n:  # read later, not a result (results are held anyway)
            delta[i + 1] += nbytes(v.aval)
            delta[last[v] + 1] -= nbytes(v.aval)
    carried = np.cumsum(delta)[:n + 1]  # [p]: bytes made before equation p and read from it on
    step = total / parts
    cuts: list[int] = []
    target = step
    while True:
        lo = max(int(np.searchsorted(released, target)), cuts[-1] + 1 if cuts else 1)
        if lo >= n or released[lo] >= total:
            break
        hi = min(int(np.searchsorted(released, target + step / 2, side="right")), n - 1)
        window = carried[lo:hi + 1]
        q = lo + int(np.flatnonzero(window == window.min())[-1])  # the latest of the least
        cuts.append(q)
        target = released[q] + step
    return cuts


def _program(closed: ClosedJaxpr, eqns: Sequence[Any], reads: Sequence[Var], writes: Sequence[Var],
             frees: Sequence[Var]) -> Any:
    """One segment, jitted; the values it releases are donated where XLA can alias them
    to a result of the same type (donating others would only warn)."""
    def segment(*args: Any) -> list[Any]:
        return eval_jaxpr(closed.jaxpr, closed.consts, args, invars=reads, eqns=eqns, outvars=writes)
    segment.__name__ = segment.__qualname__ = "backward"
    released = set(frees)
    donate = aliasable([v.aval for v in reads], [v.aval for v in writes],
                       (k for k, v in enumerate(reads) if v in released))
    return jax.jit(segment, donate_argnums=donate)
