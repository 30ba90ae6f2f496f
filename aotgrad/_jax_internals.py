"""The few JAX internals aotgrad relies on, in one place so a JAX upgrade touches one file.

- source information on equations (to re-bind an equation under the user's source line,
  and to print that line in reports);
- the traceback filter (so aotgrad's own frames never appear as "the user's line").
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from jax._src import source_info_util, traceback_util
from jax._src.core import Tracer

__all__ = ["Tracer", "bind_eqn", "source_line"]

traceback_util.register_exclusion(os.path.dirname(__file__))


def bind_eqn(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Binds `eqn`'s primitive on new inputs under the equation's own source info and
    context, as `jax.core.eval_jaxpr` does; returns the outputs as a list."""
    params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def source_line(eqn: Any) -> str:
    """The user's source line that produced `eqn`, e.g. ``model.py:12:8 (mlp)``."""
    info = getattr(eqn, "source_info", None)
    if info is None:
        return "<unknown>"
    return source_info_util.summarize(info)
