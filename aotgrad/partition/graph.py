"""Analysis of the joint graph: which values depend on cotangents, on inputs, who uses what.

The joint graph is one closed jaxpr
    (inputs..., cotangents...) -> (outputs..., input cotangents...)
traced from `fn` and its VJP. A value is *backward* if it depends on a cotangent; every
other value could be computed in the forward program.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterable

from jax.extend.core import ClosedJaxpr, JaxprEqn, Var

from aotgrad.devices import DeviceProfile

__all__ = ["JointGraph", "live_eqns", "reachable"]


@dataclasses.dataclass(frozen=True, eq=False)
class JointGraph:
    closed: ClosedJaxpr
    n_inputs: int  # leading invars: the function's inputs (closed-over constants first)
    n_outs: int  # leading outvars: the function's outputs; the rest are input cotangents
    device: DeviceProfile | None = None  # what the programs are built for (None: not known)
    # The forward and backward run as one program: the step was traced under `jax.jit`,
    # where XLA frees each saved value after its last reader in the backward.
    staged: bool = False
    # Devices the step runs on (its arguments' mesh): with several, collectives sum the
    # weight gradients, and the backward's recomputation waits for them (`schedule.py`).
    devices: int = 1
    # Per input, the axis split over the devices and over how many (`shards.input_splits`;
    # None: whole on each device). Empty: none split.
    input_splits: tuple[tuple[int, int] | None, ...] = ()

    @property
    def eqns(self) -> list[JaxprEqn]:
        return self.closed.jaxpr.eqns

    @property
    def inputs(self) -> list[Var]:
        return self.closed.jaxpr.invars[:self.n_inputs]

    @property
    def cotangents(self) -> list[Var]:
        return self.closed.jaxpr.invars[self.n_inputs:]

    @property
    def outputs(self) -> list:
        return self.closed.jaxpr.outvars[:self.n_outs]

    @property
    def grads(self) -> list:
        return self.closed.jaxpr.outvars[self.n_outs:]

    @functools.cached_property
    def producer(self) -> dict[Var, int]:
        """Index of the equation that defines each value."""
        return {v: i for i, e in enumerate(self.eqns) for v in e.outvars if isinstance(v, Var)}

    @functools.cached_property
    def backward(self) -> frozenset[Var]:
        """Values that depend on a cotangent: they can only be computed in the backward."""
        return reachable(self.eqns, self.cotangents)

    @functools.cached_property
    def input_dependent(self) -> frozenset[Var]:
        """Values that depend on an input or a cotangent; the rest are constants, cheap to
        rebuild anywhere (zeros, iotas) and never worth saving."""
        return reachable(self.eqns, list(self.closed.jaxpr.invars))

    def is_backward_eqn(self, eqn: JaxprEqn) -> bool:
        return any(isinstance(v, Var) and v in self.backward for v in eqn.invars)


def reachable(eqns: Iterable[JaxprEqn], seeds: Iterable[Var]) -> frozenset[Var]:
    """The values computed from `seeds` (included) by `eqns`, in program order."""
    found = set(seeds)
    for eqn in eqns:
        if any(isinstance(v, Var) and v in found for v in eqn.invars):
            found.update(v for v in eqn.outvars if isinstance(v, Var))
    return frozenset(found)


def live_eqns(eqns: list[JaxprEqn], roots: Iterable, available: set[Var],
              keep: Callable[[JaxprEqn], bool] = lambda e: False) -> tuple[list[int], set[Var]]:
    """Dead-code elimination: the indices of `eqns` needed to compute `roots`, stopping at
    values in `available` (inputs of the program). Equations for which `keep` is true (side
    effects) are kept too. Also returns the free values read but neither computed nor
    available (empty for a well-formed program)."""
    needed = {v for v in roots if isinstance(v, Var) and v not in available}
    kept = []
    for i in range(len(eqns) - 1, -1, -1):
        eqn = eqns[i]
        outs = [v for v in eqn.outvars if isinstance(v, Var)]
        if not (keep(eqn) or any(v in needed for v in outs)):
            continue
        kept.append(i)
        needed.difference_update(outs)
        needed.update(v for v in eqn.invars if isinstance(v, Var) and v not in available)
    kept.reverse()
    return kept, needed
