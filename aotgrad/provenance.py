"""Sequence numbers: which forward operation each equation of the programs comes from.

When the joint graph is traced, equation *n* of the forward trace (its position, in trace
order) is bound under a `jax.named_scope` that names it, ``#<n> <primitive> at <file>:<line>``.
JAX keeps name stacks through `jvp` and `transpose`, so every equation of the joint graph
(forward, derivative, and the forward equations the backward recomputes) carries the
number of the forward equation it comes from; after `split` both programs keep it, and
XLA's `op_name` metadata carries it into the compiled programs, where profiler traces
show it (e.g. ``jit(...)/transpose(jvp(#3 dot_general at model.py:42))/dot_general``).
Equations inside a forward equation's body (scan and cond bodies, inlined `jit`s) carry
their enclosing equation's number.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import jax
from jax.extend.core import Jaxpr, JaxprEqn, Literal, Primitive

from aotgrad._jax_internals import bind_eqn, name_scopes, short_source_line
from aotgrad.interpret import Rule
from aotgrad.partition.costs import FLOPS_PER_BYTE, flops, nbytes
from aotgrad.partition.graph import reachable

__all__ = ["BackwardCost", "Origin", "backward_costs", "numbered", "origin"]

_SCOPE = re.compile(r"#(\d+) (\S+) at (.*)")  # as Origin.__str__ writes it


@dataclasses.dataclass(frozen=True)
class Origin:
    """The forward equation an equation comes from."""
    seq: int  # its sequence number: its position in the forward trace
    primitive: str
    line: str  # the user's file and line, e.g. "model.py:42"

    def __str__(self) -> str:
        return f"#{self.seq} {self.primitive} at {self.line}"


def _scope(seq: int, eqn: JaxprEqn) -> str:
    # XLA's op_name keeps spaces, colons and parentheses (it cuts at "@").
    return str(Origin(seq, eqn.primitive.name, short_source_line(eqn)))


def numbered(jaxpr: Jaxpr, rules: Mapping[Primitive, Rule] | None = None,
             bind: Rule = bind_eqn) -> tuple[dict[Primitive, Rule], Rule]:
    """`rules` and `bind` (as `interpret.eval_jaxpr` takes them) that evaluate each
    equation of `jaxpr` under the scope naming its sequence number."""
    scopes = {id(e): _scope(k, e) for k, e in enumerate(jaxpr.eqns)}

    def scoped(evaluate: Rule) -> Rule:
        def rule(eqn: JaxprEqn, invals: list) -> list:
            name = scopes.get(id(eqn))
            if name is None:  # not an equation of `jaxpr`
                return evaluate(eqn, invals)
            with jax.named_scope(name):
                return evaluate(eqn, invals)
        return rule

    return {p: scoped(r) for p, r in (rules or {}).items()}, scoped(bind)


def origin(eqn: JaxprEqn) -> Origin | None:
    """The forward equation `eqn` comes from (the outermost numbered scope on its name
    stack: a compiled function called inside another has its own numbers inside); None
    for an equation traced outside every forward equation (e.g. a zero cotangent)."""
    for scope in name_scopes(eqn):
        m = _SCOPE.fullmatch(scope)
        if m:
            return Origin(int(m.group(1)), m.group(2), m.group(3))
    return None


@dataclasses.dataclass(frozen=True)
class BackwardCost:
    """The estimated cost of the backward equations that come from one forward equation
    (the cost model of `partition.costs`, nested bodies included)."""
    origin: Origin | None  # None: equations traced outside every forward equation
    flops: float
    bytes: int  # read and written: inputs and outputs of each equation
    equations: int  # backward equations (top level)
    recomputed: int  # of which recompute forward values (they read no cotangent)

    @property
    def cost(self) -> float:
        """FLOPs and bytes in one unit (bytes moved), as the partitioner weighs them."""
        return self.flops / FLOPS_PER_BYTE + self.bytes

    def __str__(self) -> str:
        return f"backward of {self.origin}" if self.origin else "backward of no forward operation"


def backward_costs(backward: Jaxpr, n_cotangents: int) -> tuple[BackwardCost, ...]:
    """The backward program's cost grouped by forward equation, costliest first.

    Arguments:
        backward: the backward program (its last `n_cotangents` inputs are cotangents).
        n_cotangents: how many of its inputs are output cotangents.
    """
    n_saved = len(backward.invars) - n_cotangents
    derivative = reachable(backward.eqns, backward.invars[n_saved:])
    totals: dict[Origin | None, list] = {}
    for eqn in backward.eqns:
        row = totals.setdefault(origin(eqn), [0.0, 0, 0, 0])
        row[0] += flops(eqn)
        row[1] += _bytes(eqn.invars) + _bytes(eqn.outvars)
        row[2] += 1
        row[3] += not any(v in derivative for v in eqn.invars if not isinstance(v, Literal))
    rows = (BackwardCost(o, f, b, n, r) for o, (f, b, n, r) in totals.items())
    return tuple(sorted(rows, key=lambda r: (-r.cost, r.origin.seq if r.origin else -1)))


def _bytes(atoms: Sequence[Any]) -> int:
    return sum(nbytes(v.aval) for v in atoms if not isinstance(v, Literal))
