"""Layer boundaries: the narrow forward values every later computation flows through.

In a stack of layers, each layer's output (the residual stream of a transformer) lies on
every path from the layer's internals to the loss: it *post-dominates* them. Saving those
values costs little, and it lets the backward recompute one layer at a time from its
input instead of recomputing the whole forward at its start, which would keep every
layer's internals live at once.

The boundaries are found from the graph alone: the post-dominator tree of the forward
values (toward the forward's outputs), its heavy path (from the outputs, always the
child that post-dominates the most values: the model's spine), and on it the values that
post-dominate some other value, no wider than the median of those (the loss's logits or
a layer's hidden activations are not boundaries; the residual stream is). Which of them
are worth saving is left to the peak estimate: they are offered together, for free.

A layer has several boundaries: a transformer block's residual stream after attention and
after the MLP, and beside each a value one cheap step from it (before and after a bias
add). `layer_points` groups the boundaries that no compute-bound equation separates: one
group is one place where the backward could restart. Saving every point lets the backward
recompute half a layer at a time; saving every second point saves half the bytes and
recomputes a whole layer at once (as `jax.checkpoint` on each layer does), which the peak
estimate weighs (`budget.py`).

Past the last layer, the loss head (a final norm, the logits, the loss) is not a layer:
the backward starts there, so `head` finds it by when the backward is done with each
value, not by post-dominance. Saving the head's values instead of recomputing them
(the logits' matmul, on a language model) costs memory only at the backward's start,
where the head's gradient is computed anyway: in a jitted step XLA frees them there
(GPT-2 small on an H100 peaked no higher with them kept). (`jax.checkpoint` on each layer
leaves the head outside too.)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from jax.extend.core import Var

from aotgrad.partition.rules import Kind

if TYPE_CHECKING:  # min_cut imports budget, which imports this module
    from aotgrad.partition.min_cut import Problem

__all__ = ["boundaries", "head", "layer_points", "post_dominators"]


def post_dominators(problem: Problem) -> list[int | None]:
    """The immediate post-dominator of each forward value (a position in
    `problem.values`), toward the forward's outputs; `len(values)` stands for the outputs,
    None for a value no output depends on."""
    n = len(problem.values)
    sink = n
    outputs = {problem.position[v] for v in problem.graph.outputs
               if isinstance(v, Var) and v in problem.position}
    made_by = [[] for _ in problem.eqns]  # each equation's output values
    for k, e in enumerate(problem.producer):
        made_by[e].append(k)
    successors: list[list[int]] = [[] for _ in range(n)]
    for v, e in zip(*problem.edges, strict=True):
        successors[v].extend(made_by[e])
    ipdom: list[int | None] = [None] * n + [sink]

    def meet(a: int, b: int) -> int:  # values are in program order: a post-dominator comes later
        while a != b:
            while a < b:
                a = ipdom[a]
            while b < a:
                b = ipdom[b]
        return a

    for k in range(n - 1, -1, -1):
        after = [s for s in successors[k] if ipdom[s] is not None] + ([sink] if k in outputs else [])
        if after:
            d = after[0]
            for s in after[1:]:
                d = meet(d, s)
            ipdom[k] = d
    return ipdom[:n]


def boundaries(problem: Problem) -> np.ndarray:
    """Positions (in `problem.values`) of the layer boundaries: values on the heavy path of
    the post-dominator tree that post-dominate another value, no wider than their median,
    the path ending at the first layer's residual add where the input is the stream
    (`_first_layer_end`)."""
    ipdom = post_dominators(problem)
    n = len(problem.values)
    size = np.ones(n + 1, np.int64)  # values each one post-dominates, itself included
    children: list[list[int]] = [[] for _ in range(n + 1)]
    for k in range(n):  # in program order, so a value's size is complete before its ipdom's
        if ipdom[k] is not None:
            size[ipdom[k]] += size[k]
            children[ipdom[k]].append(k)
    path, node = [], n
    while children[node]:
        node = max(children[node], key=lambda c: (size[c], c))
        if size[node] > 1:
            path.append(node)
    path = path[:_first_layer_end(problem, ipdom, path)]
    if not path:
        return np.zeros(0, np.int64)
    nbytes = problem.nbytes[path]
    wide = nbytes[nbytes > 0]
    limit = float(np.median(wide)) if len(wide) else 0.0
    return np.asarray(sorted(k for k, b in zip(path, nbytes, strict=True) if 0 < b <= limit), np.int64)


def _first_layer_end(problem: Problem, ipdom: list[int | None], path: list[int]) -> int:
    """How much of the heavy `path` (from the outputs down) is the spine: up to the lowest
    value whose equation adds the model's input as it is (same shape and type) where that
    input also flows into the value's other operand: the first layer's residual add, where
    the input itself is the residual stream. Below it the path runs into that layer's
    branch, as the input is no value of the tree (on a transformer stack fed no embedding,
    its attention output, which is no layer boundary). An input read once, as a loss's
    target, ends nothing. All of `path` where no value does."""
    graph = problem.graph
    inputs = set(graph.inputs)
    readers: dict[Var, list[int]] = {}  # an input's readers: their first outputs' positions
    for k, e in enumerate(problem.producer):
        if k == 0 or problem.producer[k - 1] != e:
            for u in graph.eqns[problem.eqns[e]].invars:
                if isinstance(u, Var) and u in inputs:
                    readers.setdefault(u, []).append(k)

    def under(k: int, top: int) -> bool:  # whether `top` post-dominates `k`
        while k is not None and k < top:
            k = ipdom[k]
        return k == top
    end = len(path)
    for i, k in enumerate(path):
        v = problem.values[k]
        eqn = graph.eqns[problem.eqns[problem.producer[k]]]
        if any(isinstance(u, Var) and u in inputs and u.aval.shape == v.aval.shape and u.aval.dtype == v.aval.dtype
               and any(r != k and under(r, k) for r in readers.get(u, ())) for u in eqn.invars):
            end = i + 1  # the path runs down: the last such value is the lowest
    return end


def layer_points(problem: Problem, found: np.ndarray) -> list[np.ndarray]:
    """The boundaries `found` (sorted positions), grouped: a new group starts where a
    compute-bound or never-recomputed equation (a matmul, a convolution, a collective)
    lies between one boundary and the next, or produces the next."""
    costly = np.asarray([k in (Kind.COSTLY, Kind.UNSAFE) for k in problem.kinds], np.int64)
    before = np.concatenate([[0], np.cumsum(costly)])  # compute-bound equations before each position
    groups: list[list[int]] = []
    last = None
    for k in found:
        e = int(problem.producer[k])
        if last is None or before[e + 1] > before[last + 1]:
            groups.append([])
        groups[-1].append(int(k))
        last = e
    return [np.asarray(g, np.int64) for g in groups]


def head(problem: Problem, found: np.ndarray) -> np.ndarray:
    """Positions of the forward values that the backward is done with no later than it is
    done with any of the boundaries `found`: the loss head. Empty without boundaries."""
    graph = problem.graph
    position = problem.position
    done = np.zeros(len(problem.values), np.int64)  # rank of the last backward reader; 0: none
    rank = 0
    for eqn in graph.eqns:
        if graph.is_backward_eqn(eqn):
            rank += 1
            for v in eqn.invars:
                if isinstance(v, Var) and v in position:
                    done[position[v]] = rank
    for v in graph.grads:  # a forward value that is a gradient lives to the end
        if isinstance(v, Var) and v in position:
            done[position[v]] = rank + 1
    read = done[found][done[found] > 0]
    if not len(read):
        return np.zeros(0, np.int64)
    return np.nonzero((done > 0) & (done <= read.min()))[0]
