"""Blends fill the budget's ladder (`blends.between`): on a stack written otherwise than the
GPT the candidates were shaped on, each budget step below 1 takes a plan of its own.
Planned for an H100's profile (the estimate only: nothing is compiled, no GPU compiler is
needed); the compiled peaks are in docs/partitioner.md ("Blends fill the ladder")."""
from __future__ import annotations

import dataclasses
import math

import jax
import pytest

import aotgrad
from aotgrad.devices import profile_named
from aotgrad.partition import blends, budget
from aotgrad.partition.budget_value import Bytes
from aotgrad.partition.min_cut import Problem
from benchmarks.stacks import stack
from benchmarks.workloads import build

STEPS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.3, 0.2, 0.1, 0.05, 0.0)


@pytest.fixture(scope="module")
def graph():
    """An 8-layer pre-norm stack (separate q/k/v without biases, heads transposed and
    multiplied with @), traced on shapes, planned for an H100."""
    return _planned_for_h100(*stack(batch=2, seq=512, d_model=256, heads=4, layers=8))


def _planned_for_h100(loss, params, batch):
    """The step's joint graph, traced on the arguments' shapes, with an H100's profile."""
    spec = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)  # noqa: E731
    graph = aotgrad.compile(loss).trace(spec(params), spec(batch)).pair(0, under_jit=True).graph
    return dataclasses.replace(graph, device=profile_named("h100"))


def _taken(problem: Problem, stacked: bool = False, fractions: tuple[float, ...] = STEPS) -> list[int]:
    """The estimated peak of the plan each budget step takes (`within_budget`'s rule)."""
    steps = budget.choices(problem, stacked)
    low, high = steps[0].peak, steps[-1].peak
    return [[c for c in steps if c.peak <= low + b * (high - low)][-1].peak for b in fractions]


def test_each_budget_step_is_a_plan_of_its_own(graph, monkeypatch):
    """Each of budgets 0.9 to 0 takes a plan of its own, its estimated peak falling with
    the budget. Without blends steps share plans; without the blends with the top
    (`blends.past`), 0.7 and 0.6 share one plan: the rung above it saves other values in
    each layer and no blend of the two is cheaper than it."""
    taken = _taken(Problem.priced(graph))
    assert taken == sorted(taken, reverse=True) and len(set(taken)) == len(STEPS), taken
    monkeypatch.setattr(blends, "past", lambda *args: [])
    assert len(set(_taken(Problem.priced(graph)))) < len(STEPS)
    monkeypatch.setattr(budget, "BLEND_STEP", math.inf)  # without blends, steps share plans
    assert len(set(_taken(Problem.priced(graph)))) < len(STEPS)


def test_blends_leave_the_ends_of_the_ladder(monkeypatch):
    """Budget 0's and the cheapest cut's plans are the ladder's own, blends or not. An
    8-layer MLP (batch 8192, width 2048) has a blend estimated 1.6% above budget 0's cut and
    cheaper, which took its place until blends that close to either end were dropped (it
    compiled 1.09x higher on an H100: tests/gpu_target_cases.py)."""
    w = build("mlp", "mlp", dict(batch=8192, width=2048, depth=8))
    graph = _planned_for_h100(w.loss_fn, w.params, w.batch)
    with_blends = budget.choices(Problem.priced(graph))
    monkeypatch.setattr(budget, "BLEND_STEP", math.inf)
    without = budget.choices(Problem.priced(graph))
    for end in (0, -1):
        assert with_blends[end].cut.saved == without[end].cut.saved


def test_blends_fill_the_run_where_two_rungs_differ():
    """GPT-2 small (12 layers, D=768, B8 x 1024) planned for an H100. Blends were first made at
    up to three points spaced over the whole model; here those fell in a layer's middle (a
    dominated blend) or past the run of layers where the two rungs differ (the higher rung
    again), so no rung was estimated between 8.45 and 10.61 GB, and `plan.fit("10GB")`
    compiled a plan of 8.27 GB where one of 9.93 GB fits (docs/planning.md). Bisecting the
    points inside that run places rungs there, each cheaper than the one below."""
    w = build("gpt", "gpt", dict(batch=8, seq=1024, d_model=768, heads=12, layers=12, vocab=50304))
    steps = budget.choices(Problem.priced(_planned_for_h100(w.loss_fn, w.params, w.batch)))
    inside = [c for c in steps if 8.6e9 < c.peak < 10.5e9]
    assert inside, [round(c.peak / 1e9, 3) for c in steps]
    for low, high in zip(steps, steps[1:]):
        assert high.peak > low.peak and high.cheaper_than(low), (low.peak, high.peak)


def test_a_byte_budget_blends_its_own_gap_finer(graph):
    """A byte budget is checked by compiling (`plan.fit`), so the gap of the ladder it falls
    in is blended finer than a fraction's steps (`Ladder.near`): a limit just under a rung
    takes a blend above the rung below, the highest that fits, where the kept ladder alone
    offers only the rung below. GPT-2 small on 8 H100s (FSDP): 14 GB compiled 13.57 GB
    without, with the next plan up at 14.18 (docs/planning.md)."""
    problem = Problem.priced(graph)
    steps = budget.ladder_of(problem)
    refined = 0
    for low, high in zip(steps.kept, steps.kept[1:]):
        near = steps.near(high.peak - 1)
        inside = [c for c in near if low.peak < c.peak < high.peak]
        assert steps.near(low.peak) == near and len(near) == len(steps.kept) + len(inside)  # one gap, either end
        for a, b in zip(near, near[1:]):
            assert b.peak > a.peak and b.cheaper_than(a) and b.saved >= a.saved
        if inside:
            refined += 1
            reasons = budget.within_budget(problem, Bytes(high.peak - 1))
            assert any(f"estimated step peak {inside[-1].peak:,} bytes" in r for r in reasons.values())
    assert refined >= 2, [round(c.peak / 1e6) for c in steps.kept]


def test_each_gap_is_blended_once_however_often_a_limit_falls_in_it(graph, monkeypatch):
    """`plan.fit` asks for a limit's levels and again for the gap its compiled peak falls
    in; every ask of one gap reuses its blends (each blend solves the min cut again)."""
    steps = budget.ladder_of(Problem.priced(graph))
    calls = []
    real = blends.finer
    monkeypatch.setattr(blends, "finer", lambda *a: calls.append(a) or real(*a))
    low, high = steps.kept[0], steps.kept[1]
    first = steps.near(high.peak - 1)
    assert steps.near(low.peak) == first and steps.near((low.peak + high.peak) / 2) == first
    assert len(calls) == 1
    steps.near(steps.kept[2].peak - 1)  # another gap: blended on its own
    assert len(calls) == 2


def test_a_byte_budgets_gap_is_blended_inside_a_layer_too(graph, monkeypatch):
    """Where two neighbouring cuts of a byte budget's gap differ inside one layer, `finer`
    also saves the lower's values with the higher's extra ones less the largest (a layer's
    attention probabilities outweigh the rest of it): more levels inside the gaps, each
    strictly between its rungs, and the chain `near` keeps still rises in peak, cost order
    and saved bytes. GPT-2 small on 8 H100s (FSDP): 14 GB's gap had one blend, at 14.74
    GB estimated between rungs at 14.24 and 14.87; these add 14.31 and 14.34, which `fit`
    compiled to 13.57 and 13.62 GB (the blend at 14.74 to 14.02)."""
    problem = Problem.priced(graph)
    ladder = budget.ladder_of(problem)
    gaps = range(len(ladder.kept) - 1)
    for i in gaps:
        low, high = ladder.kept[i], ladder.kept[i + 1]
        assert all(low.peak < c.peak < high.peak for c in ladder.fill(i))
        near = ladder.near(high.peak - 1)
        for a, b in zip(near, near[1:]):
            assert b.peak > a.peak and b.cheaper_than(a) and b.saved >= a.saved
    with_values = [len(ladder.near(ladder.kept[i + 1].peak - 1)) for i in gaps]
    monkeypatch.setattr(blends, "LAYER_VALUES", 0)  # layer points only
    points_only = budget.ladder_of(Problem.priced(graph))  # a problem's ladder is built once
    without = [len(points_only.near(points_only.kept[i + 1].peak - 1)) for i in gaps]
    assert sum(with_values) > sum(without), (with_values, without)


def _scan_body_problem(batch: int, seq: int, d_model: int, heads: int) -> Problem:
    """The body of a scanned GPT (`gpt_scan`: one pre-LN block) as a scan's body is cut:
    its own joint graph, every input differentiated, priced for an H100."""
    from aotgrad.trace import trace_body_joint
    from benchmarks.workloads import gpt_scan
    loss, params, tokens = gpt_scan(batch=batch, seq=seq, d_model=d_model, heads=heads, layers=2, vocab=64)
    jaxpr = jax.make_jaxpr(loss)(params, tokens)
    body = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan").params["jaxpr"]
    graph = trace_body_joint(body, [v.aval for v in body.jaxpr.invars], device=profile_named("h100"))
    return Problem.priced(graph, stacked=True)


def test_a_scan_bodys_ladder_is_filled_between_its_rungs(monkeypatch):
    """A scan body is one layer, so there are no layer points to blend at (`between`); its
    rungs can still differ by several values (`blends.in_body`). A scanned GPT's body at
    GPT-2 small's proportions (T / D = 4 / 3, H T / D = 4; B1 x 256, D=192) saves 2, then 8
    (batch x seq x d_model) units per iteration: the rung above saves three matmul outputs
    (the MLP's up projection, q/k/v, the output projection: 4, 3 and 1 units). Budgets
    0.6 to 0.16 of its span all took the 2-unit cut. With the blends, a cut saving 5 and
    one saving 6 lie between (GPT-2 small on an H100 compiled them to 6105 and 6407 MB,
    between 5199 and 7086), each budget step in that range takes a plan of its own, and
    the saved bytes fall with the budget."""
    problem = _scan_body_problem(batch=1, seq=256, d_model=192, heads=3)
    unit = 1 * 256 * 192 * 4

    fractions = (0.65, 0.5, 0.4, 0.3)  # of the body's span, 0 to 13 units: 8.45, 6.5, 5.2, 3.9
    with_blends = [peak / unit for peak in _taken(problem, True, fractions)]
    assert with_blends == sorted(with_blends, reverse=True) and len(set(with_blends)) == len(fractions), with_blends
    assert {5.0, 6.0} <= set(with_blends), with_blends
    monkeypatch.setattr(blends, "in_body", lambda *args: [])
    problem = _scan_body_problem(batch=1, seq=256, d_model=192, heads=3)  # its ladder built anew
    assert len(set(_taken(problem, True, fractions))) < len(fractions)
