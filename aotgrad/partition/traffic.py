"""An estimate of the bytes a saved set's step moves through memory on one device, for
ranking cuts of about the same peak before compiling (`budget.choices`, on devices that
rank so: `DeviceProfile.ranks_by_traffic`).

Each kernel reads its operands from memory and writes its results there: a value XLA
writes (`fusion.reads`) is written once and read once by each equation that reads it
there, fused chains included (XLA:GPU's cheap elementwise work, computed again in each
reader, has its operands read in each). The min cut's per-value costs charge a saved
value one read in the backward; a cut that saves a block's last matmul output and not the
residual sum it feeds has that output read by every kernel that recomputes the sum, which
only a simulation of the step sees. Compute-bound work adds its FLOPs at
`costs.FLOPS_PER_BYTE`.
"""
from __future__ import annotations

from typing import Callable

from jax.extend.core import JaxprEqn, Var

from aotgrad.partition import costs
from aotgrad.partition.fusion import FUSED, Programs, Row, Value, reads, rows
from aotgrad.partition.rules import Kind

__all__ = ["traffic"]


def traffic(step: Programs) -> float:
    """The estimated cost of running the step's programs (`fusion.programs`), in bytes:
    what each kernel reads from memory and writes to it (`_program_traffic`), plus the
    FLOPs of compute-bound work at `costs.FLOPS_PER_BYTE`."""
    return sum(_program_traffic(run.eqns, run.outs, step.size, step.recomputed_in_readers,
                                run.table(step.recomputed_in_readers)) for run in step.runs)


def _program_traffic(eqns: list[JaxprEqn], outs: list, size: Callable[[Var], int],
                     recomputed_in_readers: Callable[[JaxprEqn], bool], table: list[Row] | None = None) -> float:
    """Bytes moved running `eqns`: each value in memory (an argument, an output, a value
    XLA writes: `fusion.reads`) read once by each equation that reads it there, each value
    written once; plus compute-bound work's FLOPs at `costs.FLOPS_PER_BYTE`. (Recomputation
    moved early, `fusion.Program.early`, is not passed: it moves no read, only lifetimes.)
    `table`: the equations' `fusion.Row`s, if known."""
    if table is None:
        table = rows(eqns, recomputed_in_readers)
    kinds = [row[2] for row in table]
    r = reads(eqns, kinds, recomputed_in_readers, table=table)
    out_set = {v for v in outs if isinstance(v, Var)}

    def in_memory(u: Value) -> bool:
        v, j = u
        return j < 0 or u in r.written or kinds[j] not in FUSED or v in out_set

    moved = sum(size(u[0]) * len(rs) for u, rs in r.readers.items() if in_memory(u))
    moved += sum(size(v) for i, e in enumerate(eqns) for v in e.outvars
                 if isinstance(v, Var) and in_memory((v, i)))
    flops = sum(costs.flops(e) for e, k in zip(eqns, kinds) if k is Kind.COSTLY)
    return moved + flops / costs.FLOPS_PER_BYTE
