"""How a backward program is specialized to output cotangents that are known to be zero.

Under `jax.value_and_grad(f, has_aux=True)` the auxiliary outputs get symbolic-zero
cotangents. Instantiating them would make the backward program read (and compute with)
arrays of zeros; instead the backward gets a variant with those cotangents removed.

The backward is linear in its cotangents, so its JVP in the cotangents, taken at zero
cotangents, is the backward itself; JAX's JVP carries the missing cotangents as symbolic
zeros and drops every operation that only they feed. The saved values are unchanged: a
variant reads the same `Saved`.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

__all__ = ["without_zero_cotangents"]


def without_zero_cotangents(backward: ClosedJaxpr, n_saved: int,
                            present: Sequence[bool]) -> ClosedJaxpr:
    """`backward(*saved, *cts) -> grads` as `(*saved, *cts[present]) -> grads`, where the
    cotangents not present are zero.

    Arguments:
        backward: the backward program's jaxpr, inputs saved values then cotangents.
        n_saved: how many of its inputs are saved values.
        present: per cotangent input, whether it is given (False: known to be zero).
    """
    full = jaxpr_as_fun(backward)
    ct_avals = backward.in_avals[n_saved:]
    assert len(present) == len(ct_avals)
    kept = [a for a, p in zip(ct_avals, present) if p]

    def specialized(*args: Any) -> list[Any]:
        saved, given = args[:n_saved], args[n_saved:]

        def linear(*cts: Any) -> list[Any]:
            it = iter(cts)
            return full(*saved, *[next(it) if p else jax.numpy.zeros(a.shape, a.dtype)
                                  for a, p in zip(ct_avals, present)])

        zeros = [jax.numpy.zeros(a.shape, a.dtype) for a in kept]
        return jax.jvp(linear, zeros, list(given))[1]

    return jax.make_jaxpr(specialized)(*backward.in_avals[:n_saved], *kept)
