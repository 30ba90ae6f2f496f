"""Which autocast setting each equation of a backward program is rewritten under
(`config.backward_pass_autocast`), after partitioning."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from aotgrad.autocast.context import setting_from_kwargs, setting_of
from aotgrad.autocast.rewrite import CastCounts, has_markers, rewrite_backward
from aotgrad.partition import Split

if TYPE_CHECKING:
    from aotgrad.trace import ForwardTrace

__all__ = ["autocast_backward"]


def autocast_backward(split: Split, fwd: "ForwardTrace",
                      mode: Any) -> tuple[Split, CastCounts]:
    """The split with its backward program rewritten under `config.backward_pass_autocast`
    (`mode`): "off" leaves it as traced (its dtypes follow the forward's casts);
    "same_as_forward" rewrites each cotangent-dependent equation under the setting its
    forward equation ran under (its autocast marker, else the forward's setting); nested
    contexts (a tuple of keyword tuples) rewrite all of them under one setting.

    Only the backward program changes: the partitioner chose the saved set, so the forward program is the same in every mode, and forward values the
    backward recomputes are re-bound unchanged: the forward's own equations.
    """
    if mode == "off":
        return split, CastCounts(fwd.casts)
    if mode == "same_as_forward":
        if fwd.autocast is None and not has_markers(split.backward.jaxpr):
            return split, CastCounts(fwd.casts)
        choose = lambda eqn: setting_of(eqn, fwd.autocast)  # noqa: E731
    else:
        fixed = setting_from_kwargs(mode)
        choose = lambda eqn: fixed  # noqa: E731
    backward, casts = rewrite_backward(split.backward, split.n_cotangents, choose)
    return dataclasses.replace(split, backward=backward), CastCounts(fwd.casts, casts)
