"""A min cut's flow network, laid out once per problem: a budget solves tens of cuts on one
graph (`budget.py`), over the same edges with other capacities. Each solve then sums the
capacities of repeated edges and drops the empty ones on arrays sorted once, rather than
building and sorting a sparse matrix from scratch.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

__all__ = ["INF", "Network"]

INF = 2 ** 30  # larger than any finite cut: scipy's max-flow takes int32 capacities


class Network:
    """Directed edges `rows[k] -> cols[k]` over `n` nodes (node 0 the source, 1 the sink),
    repeats allowed (their capacities add up)."""

    def __init__(self, rows: np.ndarray, cols: np.ndarray, n: int) -> None:
        self.order = np.lexsort((cols, rows))  # row-major, as a CSR matrix lays them out
        r, c = rows[self.order], cols[self.order]
        first = np.ones(len(r), bool)
        first[1:] = (r[1:] != r[:-1]) | (c[1:] != c[:-1])
        self.starts = np.flatnonzero(first)  # each distinct edge's first place in `order`
        self.rows, self.cols = r[self.starts], c[self.starts].astype(np.int32)
        self.n = n

    def source_side(self, caps: np.ndarray) -> np.ndarray:
        """Per node, whether it is on the source's side of a minimum cut, for these integer
        capacities (per edge as given, each at most `INF`)."""
        reachable = np.zeros(self.n, bool)
        if not len(self.order):
            reachable[0] = True
            return reachable
        summed = np.minimum(np.add.reduceat(caps[self.order], self.starts), INF)
        keep = summed > 0
        indptr = np.zeros(self.n + 1, np.int32)
        np.cumsum(np.bincount(self.rows[keep], minlength=self.n), out=indptr[1:])
        capacity = scipy.sparse.csr_matrix((summed[keep].astype(np.int32), self.cols[keep], indptr),
                                           shape=(self.n, self.n))
        flow = maximum_flow(capacity, 0, 1).flow
        residual = (capacity.astype(np.int64) - flow.astype(np.int64)).tocsr()
        residual.data = (residual.data > 0).astype(np.int8)
        residual.eliminate_zeros()
        reachable[breadth_first_order(residual, 0, directed=True, return_predecessors=False)] = True
        return reachable
