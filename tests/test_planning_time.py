"""Planning below budget 1 does no work twice: each distinct saved set is estimated once,
the backward and forward of each cut are found on arrays built once per graph (as
`graph.live_eqns` finds them), the backward is ordered and its peak estimated on index
lists and arrays built once per graph (as `schedule.plan` and `peak._program_peak` find
them), no candidate walks the graph's equations, and the cycle collector is held off while a
pair is planned and switched back on after. Counts and equalities, not timings (the
timings are in docs/partitioner.md, "Planning time": `python -m benchmarks.planning_time`)."""
from __future__ import annotations

import dataclasses
import gc

import jax
import numpy as np
import pytest
from jax.extend.core import Var

import aotgrad
from aotgrad import trace
from aotgrad._jax_internals import bind_eqn, source_line
from aotgrad.collector import collector_paused
from aotgrad.devices import profile_named
from aotgrad.partition import budget, fusion, order, peak, peak_arrays, schedule
from aotgrad.partition.budget import choices, ladder
from aotgrad.partition.fusion import deps, programs
from aotgrad.partition.graph import JointGraph, live_eqns
from aotgrad.partition.min_cut import Cut, Problem
from aotgrad.partition.peak import _program_peak, estimate
from aotgrad.partition.split import recompute_late
from aotgrad.partition.vjp import save_what_backward_reads
from benchmarks.workloads import build, gpt

WORKLOADS = [("gpt", dict(batch=1, seq=8, d_model=16, heads=2, layers=3, vocab=32)),
             ("convnet", dict(batch=2, image=16, channels=[4, 8], classes=10))]


def _graph(kind: str, sizes: dict, under_jit: bool) -> JointGraph:
    w = build(kind, kind, sizes)
    return aotgrad.compile(w.loss_fn).trace(w.params, w.batch).pair(0, under_jit=under_jit).graph


def _on(graph: JointGraph, device: str | None) -> JointGraph:
    return graph if device is None else dataclasses.replace(graph, device=profile_named(device))


def _candidates(problem: Problem) -> list[Cut]:
    relaxed = problem.recompute_costs(allow_costly=True)
    return ladder(problem, relaxed) + budget._with_boundaries(problem, relaxed)


@pytest.mark.parametrize("under_jit", [True, False])
def test_each_saved_set_is_estimated_once(monkeypatch: pytest.MonkeyPatch, under_jit: bool) -> None:
    problem = Problem.priced(_graph(*WORKLOADS[0], under_jit))
    distinct = {frozenset(c.saved) for c in _candidates(problem)}
    estimated: list[frozenset] = []
    real = budget.step_programs
    monkeypatch.setattr(budget, "step_programs", lambda cut: estimated.append(frozenset(cut.saved)) or real(cut))
    choices(Problem.priced(problem.graph))
    assert len(_candidates(problem)) > len(distinct)  # the ladder does repeat itself here
    names = [sorted_names(saved) for saved in estimated]
    assert len(names) == len(set(names))  # the blends (`blends.between`) too
    assert set(map(sorted_names, distinct)) <= set(names)


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


@pytest.mark.parametrize("under_jit", [True, False])
def test_the_collector_waits_while_a_pair_is_planned(under_jit: bool) -> None:
    """The partitioner runs with the cycle collector off, eagerly and under jax.jit, and
    under jax.jit so does the tracing of the backward into the step (a hook is traced
    there); it is on again after, as the caller had it."""
    seen: list[tuple[str, bool]] = []

    def strategy(graph, budget):
        seen.append(("plan", gc.isenabled()))
        return save_what_backward_reads(graph, budget)

    def prehook(ct):
        seen.append(("backward", gc.isenabled()))
        return ct

    registration = aotgrad.register_partitioner("watch_collector", strategy)
    was = gc.isenabled()
    gc.enable()
    try:
        f = aotgrad.compile(lambda w, x: jax.numpy.sum(jax.numpy.tanh(x @ w)))
        f.register_prehook(prehook)
        w, x = jax.numpy.ones((4, 4)), jax.numpy.ones((2, 4))
        with aotgrad.config.patch(partitioner="watch_collector"):
            grad = jax.grad(lambda w: f(w, x))
            (jax.jit(grad) if under_jit else grad)(w)
        assert ("plan", False) in seen and ("plan", True) not in seen
        assert ("backward", not under_jit) in seen and ("backward", under_jit) not in seen
        assert gc.isenabled()
    finally:
        registration.remove()
        (gc.enable if was else gc.disable)()


def _joint_text(kind: str, sizes: dict) -> str:
    """The joint graph as text, with each equation's name stack and source line."""
    graph = _graph(kind, sizes, True)
    return str(graph.closed) + "\n".join(f"{e.source_info.name_stack} | {source_line(e)}" for e in graph.eqns)


@pytest.mark.parametrize("kind,sizes", WORKLOADS + [("transformer_block", dict(batch=2, seq=8, d_model=16, heads=2))])
def test_repeated_equations_are_differentiated_once_into_the_same_joint_graph(kind: str, sizes: dict,
                                                                               monkeypatch) -> None:
    """The joint trace binds forward equations through one inlined jitted call per distinct
    equation (`trace._Repeated`): the graph is the same, names and source lines included,
    as when each is bound on its own, and a deeper model makes no more calls."""
    made: list = []

    class Counted(trace._Repeated):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(trace, "_Repeated", Counted)
    cached = _joint_text(kind, sizes)
    monkeypatch.setattr(trace, "_Repeated", lambda: bind_eqn)
    assert cached == _joint_text(kind, sizes)
    if kind == "gpt":
        monkeypatch.setattr(trace, "_Repeated", Counted)
        _graph(kind, {**sizes, "layers": 6}, True)
        assert 0 < len(made[-1].calls) == len(made[0].calls)  # 6 layers: as many as 3


@pytest.mark.parametrize("budget", [1.0, 0.5])
def test_a_step_under_jit_traces_its_programs_into_the_step_only(budget: float) -> None:
    """The split's programs are functions traced into the step by the step's own trace;
    their jaxprs are made only when asked for (explain, hooks, export), not while planning."""
    w = build("gpt", "gpt", WORKLOADS[0][1])
    f = aotgrad.compile(w.loss_fn)
    with aotgrad.config.patch(activation_memory_budget=budget):
        jax.jit(jax.value_and_grad(f)).lower(w.params, w.batch)
        entry, _ = f.entries.resolve((w.params, w.batch), {})  # the entry of this budget
    pair, = entry.pairs.values()
    programs = pair.split.forward_program, pair.split.backward_program
    assert not any("closed" in vars(p) for p in programs)
    assert [a.shape for a in pair.split.backward.in_avals] == [a.shape for a in programs[1].in_avals]


@pytest.mark.parametrize("kind,sizes", WORKLOADS)
@pytest.mark.parametrize("under_jit", [True, False])
@pytest.mark.parametrize("device", [None, "h100", "tpu"])
def test_backward_order_on_index_lists_is_plans(kind: str, sizes: dict, under_jit: bool, device: str | None) -> None:
    graph = _on(_graph(kind, sizes, under_jit), device)
    for cut in _candidates(Problem.priced(graph)):
        backward = order.ordered(graph, cut.backward_eqns)
        assert backward.order == recompute_late(graph, cut.backward_eqns)
        groups = schedule.plan([graph.eqns[i] for i in backward.order], graph.backward)
        assert backward.waiting == {p for g in groups for p in range(g.start, g.stop)}


def _late_by_recursion(graph: JointGraph, idx: list[int]) -> list[int]:
    """`recompute_late`'s order found afresh from the equations: each backward equation in
    turn after the recomputation it reads, depth first, the last operand's first."""
    backward = [graph.is_backward_eqn(e) for e in graph.eqns]
    pending = {i for i in idx if not backward[i]}
    out: list[int] = []

    def visit(i: int) -> None:
        ops = [graph.producer[v] for v in graph.eqns[i].invars if isinstance(v, Var) and v in graph.producer]
        for p in reversed(ops):
            if p in pending and not backward[p]:
                pending.discard(p)
                visit(p)
        out.append(i)
    for i in [i for i in idx if backward[i]] + [i for i in idx if not backward[i]]:
        if backward[i] or i in pending:
            pending.discard(i)
            visit(i)
    return out


@pytest.mark.parametrize("kind,sizes", WORKLOADS)
@pytest.mark.parametrize("under_jit", [True, False])
def test_runs_reused_between_candidates_are_the_order_found_afresh(kind: str, sizes: dict, under_jit: bool) -> None:
    """`order._late` reuses a run of recomputation an earlier candidate emitted before the
    same backward equation where the search would find it again; every candidate's order,
    ordered after all the others (the most runs to reuse), is the one found afresh."""
    graph = _graph(kind, sizes, under_jit)
    cuts = _candidates(Problem.priced(graph))
    for cut in cuts:
        order.ordered(graph, cut.backward_eqns)
    searched = []
    real = order._emit
    with pytest.MonkeyPatch.context() as m:
        m.setattr(order, "_emit", lambda *a: searched.append(a[0]) or real(*a))
        for cut in reversed(cuts):
            assert order.ordered(graph, cut.backward_eqns).order == _late_by_recursion(graph, cut.backward_eqns)
    runs = sum(len(r) for r in order.links(graph).runs.values())
    assert len(searched) < runs  # runs were reused, not all searched again


@pytest.mark.parametrize("kind,sizes", WORKLOADS)
@pytest.mark.parametrize("under_jit", [True, False])
@pytest.mark.parametrize("device", [None, "h100", "tpu"])
def test_peak_on_arrays_is_the_peak_followed_in_python(kind: str, sizes: dict, under_jit: bool,
                                                       device: str | None) -> None:
    graph = _on(_graph(kind, sizes, under_jit), device)
    covered = 0
    for cut in _candidates(Problem.priced(graph)):
        step = budget.step_programs(cut)
        for run in step.runs:
            expected = _program_peak(run.eqns, run.args, run.outs, step.size, step.recomputed_in_readers, run.early)
            if peak_arrays.supports(graph, run):
                covered += 1
                assert peak_arrays.program_peak(graph, run) == expected
    assert covered or device == "h100"  # an XLA:GPU step's elementwise work is followed in Python


@pytest.mark.parametrize("under_jit", [True, False])
def test_no_candidate_walks_the_graph(monkeypatch: pytest.MonkeyPatch, under_jit: bool) -> None:
    """Per candidate, no pass over the joint graph's equations in Python: the equations are
    looked up a bounded number of times per graph plus a few per candidate, and neither
    `schedule.plan` nor `fusion.reads` runs (before, each candidate ordered its backward
    through `graph.eqns` and `is_backward_eqn`, equation by equation, and followed its
    step in `reads`)."""
    graph = _graph(*WORKLOADS[0], under_jit)
    problem = Problem.priced(graph)
    n, candidates = len(graph.eqns), len({frozenset(c.saved) for c in _candidates(problem)})
    counts = {"eqns": 0, "is_backward_eqn": 0, "plan": 0, "reads": 0}
    eqns, is_backward_eqn, reads = JointGraph.eqns, JointGraph.is_backward_eqn, fusion.reads

    def counted(name: str, f):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            counts[name] += 1
            return f(*args, **kwargs)
        return call

    monkeypatch.setattr(JointGraph, "eqns", property(counted("eqns", eqns.fget)))
    monkeypatch.setattr(JointGraph, "is_backward_eqn", counted("is_backward_eqn", is_backward_eqn))
    monkeypatch.setattr(schedule, "plan", counted("plan", schedule.plan))
    monkeypatch.setattr(fusion, "reads", counted("reads", reads))
    monkeypatch.setattr(peak, "reads", counted("reads", reads))
    choices(problem)
    assert counts["plan"] == counts["reads"] == 0, counts
    assert counts["is_backward_eqn"] <= n, counts  # once per equation, for the whole graph
    assert counts["eqns"] <= 3 * n + 4 * candidates, (counts, n, candidates)


def test_the_estimates_benchmark_compiles_the_candidate_budget_0_takes() -> None:
    """`benchmarks.estimates` lists every candidate with its estimated peak and compiles the
    lowest: the row it marks as budget 0's compiles to the peak of the step built at budget
    0 itself (a candidate found again by the wrong place in a re-trace, or the wrong row
    marked, compiles to another peak), and it leaves no partitioner registered."""
    from benchmarks import estimates
    from benchmarks.strategies import xla_peak
    sizes = dict(batch=2, seq=32, d_model=32, heads=2, layers=3, vocab=64)
    result = estimates.measure("gpt", "gpt", sizes, "cpu", compile_lowest=2, log=lambda s: None)
    rows = result["rows"]
    assert [r["estimated_peak"] for r in rows] == sorted(r["estimated_peak"] for r in rows)
    assert sum(r["compiled_peak"] is not None for r in rows) >= 2
    (ours,) = [r for r in rows if r["budget_0"]]
    loss_fn, params, batch = gpt(**sizes)
    with aotgrad.config.patch(activation_memory_budget=0.0):
        step = jax.jit(jax.value_and_grad(aotgrad.compile(loss_fn)))
        assert ours["compiled_peak"] == xla_peak(step.lower(params, batch).compile().memory_analysis())
    with pytest.raises(ValueError, match=estimates.PARTITIONER):
        with aotgrad.config.patch(partitioner=estimates.PARTITIONER):
            pass
    assert estimates.summary(result)[0].startswith(f"budget 0 takes candidate {ours['rank']}")


def test_the_estimates_benchmark_compiles_a_band_and_weighs_the_traffic() -> None:
    """`benchmarks.estimates --band LO,HI`: the candidates estimated to peak in the band are
    compiled (with budget 0's, and none of the lowest when `--compile 0`), each with XLA's
    bytes moved and FLOPs beside the estimated traffic that every row has; the summary says
    how many compiled pairs the traffic estimate ranks otherwise than the compiler."""
    import argparse
    from benchmarks import estimates
    sizes = dict(batch=2, seq=32, d_model=32, heads=2, layers=2, vocab=64)
    first = estimates.measure("gpt", "gpt", sizes, "cpu", compile_lowest=0, log=lambda s: None)
    top = max(r["estimated_peak"] for r in first["rows"])
    result = estimates.measure("gpt", "gpt", sizes, "cpu", compile_lowest=0, log=lambda s: None, band=(top, top))
    compiled = {r["rank"] for r in result["rows"] if r["compiled_peak"] is not None}
    wanted = {r["rank"] for r in result["rows"] if r["estimated_peak"] == top or r["budget_0"]}
    assert compiled == wanted, (compiled, wanted)
    for r in result["rows"]:
        assert r["estimated_traffic"] > 0, r
        if r["compiled_peak"] is not None:
            assert r["compiled_moved"] > 0 and r["compiled_flops"] > 0, r
    assert estimates.summary(result)[-1].startswith("traffic estimate: ")
    assert estimates._band("6000,7100") == (6e9, 7.1e9)
    with pytest.raises(argparse.ArgumentTypeError, match="LO,HI"):
        estimates._band("7100")
