"""Planning below budget 1 does no work twice: each distinct saved set is estimated once,
the backward and forward of each cut are found on arrays built once per graph (as
`graph.live_eqns` finds them), and the cycle collector held off while candidates are
estimated is switched back on. Counts and equalities, not timings (the timings are in
docs/partitioner.md, "Planning time": `python -m benchmarks.planning_time`)."""
from __future__ import annotations

import gc

import numpy as np
import pytest
from jax.extend.core import Var

import aotgrad
from aotgrad.partition import budget
from aotgrad.partition.budget import choices, ladder
from aotgrad.partition.fusion import deps, programs
from aotgrad.partition.graph import JointGraph, live_eqns
from aotgrad.partition.min_cut import Cut, Problem
from aotgrad.partition.peak import _program_peak, collector_paused, estimate
from aotgrad.partition.split import recompute_late
from benchmarks.workloads import build

WORKLOADS = [("gpt", dict(batch=1, seq=8, d_model=16, heads=2, layers=3, vocab=32)),
             ("convnet", dict(batch=2, image=16, channels=[4, 8], classes=10))]


def _graph(kind: str, sizes: dict, under_jit: bool) -> JointGraph:
    w = build(kind, kind, sizes)
    return aotgrad.compile(w.loss_fn).trace(w.params, w.batch).pair(0, under_jit=under_jit).graph


def _candidates(problem: Problem) -> list[Cut]:
    relaxed = problem.recompute_costs(allow_costly=True)
    return ladder(problem, relaxed) + budget._with_boundaries(problem, relaxed)


@pytest.mark.parametrize("under_jit", [True, False])
def test_each_saved_set_is_estimated_once(monkeypatch: pytest.MonkeyPatch, under_jit: bool) -> None:
    problem = Problem.priced(_graph(*WORKLOADS[0], under_jit))
    distinct = {frozenset(c.saved) for c in _candidates(problem)}
    estimated: list[frozenset] = []
    real = budget._programs
    monkeypatch.setattr(budget, "_programs", lambda cut: estimated.append(frozenset(cut.saved)) or real(cut))
    choices(Problem.priced(problem.graph))
    assert len(_candidates(problem)) > len(distinct)  # the ladder does repeat itself here
    assert sorted(map(sorted_names, estimated)) == sorted(map(sorted_names, distinct))


def sorted_names(saved: frozenset) -> tuple[str, ...]:
    return tuple(sorted(str(v) for v in saved))


@pytest.mark.parametrize("kind,sizes", WORKLOADS)
@pytest.mark.parametrize("under_jit", [True, False])
def test_dependency_arrays_find_what_live_eqns_finds(kind: str, sizes: dict, under_jit: bool) -> None:
    graph = _graph(kind, sizes, under_jit)
    problem = Problem.priced(graph)
    inputs, consts = set(graph.inputs), set(graph.closed.jaxpr.constvars)
    for cut in _candidates(problem):
        available = set(cut.cut) | inputs | set(graph.cotangents) | consts
        backward, _ = live_eqns(graph.eqns, graph.grads, available,
                                keep=lambda e: bool(e.effects) and graph.is_backward_eqn(e))
        assert cut.backward_eqns == backward
        read = {v for i in backward for v in graph.eqns[i].invars if isinstance(v, Var)}
        read |= {v for v in graph.grads if isinstance(v, Var)}
        assert cut.saved == tuple(v for v in [*graph.inputs, *problem.values] if v in read
                                  and (v in inputs or v in cut.cut))
        roots = list(graph.outputs) + [v for v in cut.saved if v not in inputs]
        forward, _ = live_eqns(graph.eqns, roots, inputs | consts)
        assert deps(graph).live(roots, np.zeros(0, np.int64)).tolist() == forward


def test_estimate_with_rows_worked_out_once_is_the_plain_estimate() -> None:
    graph = _graph(*WORKLOADS[0], under_jit=True)
    for cut in _candidates(Problem.priced(graph))[::7]:
        step = programs(graph, cut.saved, recompute_late(graph, cut.backward_eqns))
        run, = step.runs
        assert estimate(step) == _program_peak(run.eqns, run.args, run.outs, step.size,
                                               step.recomputed_in_readers, run.early)


@pytest.mark.parametrize("enabled", [True, False])
def test_collector_paused_restores_the_collector(enabled: bool) -> None:
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with collector_paused():
            assert not gc.isenabled()
            with collector_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
