"""The partitioners: gradients under every strategy and budget, saved sets whose optimum
is known by hand, the reference block's saved bytes, monotonicity in the budget, random
bits reproduced by recomputation, collectives never duplicated, and explain's reasons."""
from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any

import jax
import jax.extend.core.primitives
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import aotgrad
from aotgrad.partition import PARTITIONERS, partition
from aotgrad.partition.budget_value import FUSED_REASON
from aotgrad.partition.split import split
from aotgrad.trace import trace_joint
from cuts import cheapest, joint_graph

try:
    from tests import test_corpus as tc
    from tests.partition_configs import config_id, partitioner_configs
except ImportError:  # tests/ itself on sys.path
    import test_corpus as tc  # type: ignore[no-redef]
    from partition_configs import config_id, partitioner_configs  # type: ignore[no-redef]

split_module = importlib.import_module("aotgrad.partition.split")

# test_corpus.py runs the whole corpus under the configured default; here, every other
# partitioner and budget, on the broadest check (vjp w.r.t. every dynamic argument).
_DEFAULT = {"partitioner": aotgrad.config.partitioner,
            "activation_memory_budget": aotgrad.config.activation_memory_budget}
_OTHER_CONFIGS = [c for c in partitioner_configs() if {**_DEFAULT, **c} != _DEFAULT]


@pytest.mark.parametrize("config", _OTHER_CONFIGS, ids=config_id)
@pytest.mark.parametrize("name", [p.name for p in tc.PROGRAMS])
def test_corpus_gradients_under_every_partitioner_and_budget(name: str, config: dict) -> None:
    c, prog = tc.case(name), tc.BY_NAME[name]
    with aotgrad.config.patch(**config):
        f = aotgrad.compile(prog.fn, static_argnums=prog.static_argnums)
        got = tc.vjp_all(f, prog, c["args"], c["kwargs"], c["ct"])
    tc.assert_trees_close(got, tc.reference(name)["vjp_all"], rtol=prog.rtol, atol=prog.atol)


# ----------------------------------------------------------------------------- helpers

def _activations(sp: Any) -> list[Any]:
    return [v.aval for v in sp.activations]


def _nbytes(aval: Any) -> int:
    return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


def _rand(seed: int, *shape: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


# ----------------------------------------------------------------------------- known cuts

def test_pointwise_chain_after_a_matmul_saves_exactly_the_matmul_output() -> None:
    def f(x, w):
        h = x @ w
        return jnp.sum(jnp.square(jnp.maximum(h * 0.5 + 1.0, 0.0)) * 3.0 - h)
    sp = cheapest(joint_graph(f, _rand(0, 16, 8), _rand(1, 8, 32)))
    assert len(sp.activations) == 1
    assert sp.producers[0].primitive.name == "dot_general"
    assert sp.activations[0].aval.shape == (16, 32)


def test_pointwise_chain_on_inputs_saves_no_activation() -> None:
    def f(x):
        return jnp.sum(jnp.tanh(jnp.exp(jnp.sin(x))))
    sp = cheapest(joint_graph(f, _rand(0, 64)))
    assert sp.activations == () and sp.saved_inputs == (0,)
    assert partition(joint_graph(f, _rand(0, 64)), "vjp").activations  # vjp saves tanh etc.


def test_a_checkpointed_pointwise_chain_is_recomputed() -> None:
    """A `jax.checkpoint` region (primitive `remat2`) is classified by its body: a pointwise
    chain on a non-differentiated input is recomputed from that input. Budget 1 (the fused
    step's plan) recomputes the user's region as `jax.vjp` does and keeps nothing of it;
    the cheapest cut saves less than `jax.vjp` and the "vjp" strategy (which keeps the
    region's [64, 8] output). Hand-counted: the [64, 4] tanh derivative input and the
    [64, 2] input."""
    def f(x, w):
        c = jax.checkpoint(lambda a: jnp.exp(jnp.sin(jnp.concatenate([a] * 4, axis=1)) * 0.5))(x)
        return jnp.sum(jnp.tanh(c @ w))
    x, w = _rand(0, 64, 2), _rand(1, 8, 4)
    out, vjp = jax.vjp(lambda w: f(x, w), w)
    jax_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(vjp))
    saved = {}
    for name, budget in (("vjp", 1.0), ("min_cut", 1.0)):
        with aotgrad.config.patch(partitioner=name, activation_memory_budget=budget):
            fwd, bwd = aotgrad.fwd_and_bwd(aotgrad.compile(f), argnums=1)
            got, saved[name, budget] = fwd(x, w)
            np.testing.assert_allclose(got, out, rtol=1e-6)
            np.testing.assert_allclose(bwd(saved[name, budget], jnp.ones(())), vjp(jnp.ones(()))[0],
                                       rtol=1e-5, atol=1e-6)
    assert all(a.shape != (64, 8) for a in saved["min_cut", 1.0].arrays)
    assert saved["min_cut", 1.0].nbytes <= jax_bytes
    sp = cheapest(joint_graph(f, x, w, argnums=1))
    assert [a.shape for a in _activations(sp)] == [(64, 4)] and sp.saved_inputs == (0,)
    assert 64 * 4 * 4 + 64 * 2 * 4 < min(jax_bytes, saved["vjp", 1.0].nbytes)


def test_rules_are_keyed_by_primitive_objects() -> None:
    rules = aotgrad.partition.rules
    assert all(isinstance(p, jax.extend.core.Primitive) for p in rules.RULES)
    assert jax.extend.core.primitives.remat_p in rules.CALLS  # jax.checkpoint's primitive
    with pytest.raises(TypeError, match="primitive must be a jax.extend.core.Primitive"):
        rules.register("tanh", rules.Kind.CHEAP)  # a name would never match an equation


def test_derived_weight_copies_are_recomputed_not_saved() -> None:
    def f(x, w):  # a cast and a transpose of the weight, read by the backward
        return jnp.sum(jnp.tanh(x @ w.T.astype(jnp.bfloat16).astype(jnp.float32)))
    sp = cheapest(joint_graph(f, _rand(0, 8, 16), _rand(1, 32, 16)))
    # One [8, 32] activation (x @ w.T on jax 0.10; on jax >= 0.11.2, where tanh's derivative is
    # `one_minus_square(tanh(.))`, that value: the same bytes), never a [16, 32] weight copy.
    assert [tuple(v.aval.shape) for v in sp.activations] == [(8, 32)]
    assert not {e.primitive.name for e in sp.producers} & {"transpose", "convert_element_type"}
    assert 1 in sp.saved_inputs  # the weight itself, free


def test_small_reductions_are_saved_large_inputs_are_not_reread() -> None:
    def f(x):  # layer-norm statistics: saving [n, 1] beats re-reading [n, 512]
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return jnp.sum(jnp.tanh((x - mean) * jax.lax.rsqrt(var + 1e-5)))
    sp = cheapest(joint_graph(f, _rand(0, 64, 512)))
    assert sp.activations and all(a.shape in ((64,), (64, 1)) for a in _activations(sp))


# ----------------------------------------------------------------------------- the reference block

@pytest.fixture(scope="module")
def reference_block() -> Any:
    from benchmarks.workloads import transformer_block
    loss, params, batch = transformer_block(0, batch=8, seq=128, d_model=256, heads=8)
    traced = aotgrad.compile(loss).trace(params, batch)
    graph = trace_joint(traced.entry.fwd, traced.perturbed(0), traced.entry.default_has_ct())
    return graph


def test_reference_block_saved_bytes(reference_block: Any) -> None:
    b, t, d, h = 8, 128, 256, 8
    act, scores = b * t * d * 4, b * h * t * t * 4
    default = sum(map(_nbytes, _activations(partition(reference_block, "vjp"))))
    sp = cheapest(reference_block)
    got = sum(map(_nbytes, _activations(sp)))
    # q, k, v, the softmax numerator exp(scores - max) (exp is not recomputed), the
    # attention output, the projection output, the pre-GELU matmul output, the MLP output
    # (the loss reads y - target), and small softmax / layer-norm statistics.
    big = 3 * act + scores + act + act + 4 * act + act
    small = b * h * t * 4 + 4 * b * t * 4  # softmax sum; mean and variance of both norms
    assert got == big + small == 14_729_216
    # jax.vjp's residuals are the installed JAX's own: 45,163,520 bytes on jax 0.10.2 (min_cut
    # 0.33x), 40,969,216 on jax 0.12.0.1 (0.36x).
    assert got <= 0.37 * default
    assert got <= 0.75 * 19.9e6  # PyTorch 2.13 AOTAutograd's min-cut on the same block
    assert {e.primitive.name for e in sp.producers} <= {"dot_general", "reshape", "reduce_sum", "exp"}


def _step_peak(sp: Any) -> int:
    """XLA's peak of the larger of a split's two programs (`memory_analysis()`)."""
    from benchmarks.strategies import ProgramMemory
    from jax.extend.core import jaxpr_as_fun
    peaks = []
    for program in (sp.forward, sp.backward):
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in program.jaxpr.invars]
        peaks.append(ProgramMemory.of(jax.jit(jaxpr_as_fun(program)).lower(*avals).compile()).peak)
    return max(peaks)


def test_saved_bytes_and_peak_rise_with_the_budget(reference_block: Any) -> None:
    """The budget spans the estimated step peak: saved bytes rise with it, budget 1 is the
    cheapest cut where the programs run apart (this graph is not staged) and the fused
    step's plan (what the "vjp" strategy saves) in a step under `jax.jit`, and the ladder
    offers real intermediate points. Budget 0 is the
    lowest peak, not the fewest saved bytes: by XLA's own count its step peak is below that
    of saving nothing (which recomputes the whole block at the backward's start and holds
    it: 0.71x), and below the runtime-optimal cut's (0.82x)."""
    budgets = np.linspace(0.0, 1.0, 11)
    splits = [partition(reference_block, "min_cut", float(b)) for b in budgets]
    saved = [sum(map(_nbytes, _activations(sp))) for sp in splits]
    assert saved == sorted(saved), saved
    assert saved[-1] == 14_729_216  # the cheapest cut
    staged = dataclasses.replace(reference_block, staged=True)
    fused = sum(map(_nbytes, _activations(partition(staged, "min_cut"))))
    assert fused == sum(map(_nbytes, _activations(partition(reference_block, "vjp")))) > saved[-1]
    assert len(set(saved)) >= 2  # cuts between save 8-13 MB for no lower peak (XLA agrees)
    nothing = split(reference_block, {v: "input" for v in reference_block.inputs})
    assert not nothing.activations
    low, full = _step_peak(splits[0]), _step_peak(splits[-1])
    assert low < 0.75 * _step_peak(nothing) and low < full, (low, _step_peak(nothing), full)


def test_a_scan_body_budget_spans_saved_bytes(reference_block: Any) -> None:
    """A scan body's saved values are stacked once per iteration, so its budget spans
    saved bytes: at 0 it saves nothing (every value of the block can be recomputed from
    the inputs), where the graph's budget 0 saves the layer boundaries."""
    mc = importlib.import_module("aotgrad.partition.min_cut")
    inputs = set(reference_block.inputs)
    assert not [v for v in mc.min_cut(reference_block, 0.0, stacked=True) if v not in inputs]
    assert [v for v in mc.min_cut(reference_block, 0.0) if v not in inputs]


def test_budget_zero_recomputes_matmuls(reference_block: Any) -> None:
    """Below 1 the budget may recompute compute-bound equations; at 1 it never does."""
    assert "dot_general" not in dict(partition(reference_block, "min_cut", 1.0).recomputed)
    assert dict(partition(reference_block, "min_cut", 0.0).recomputed)["dot_general"] >= 3


def test_default_partitioner_rejects_a_budget() -> None:
    with aotgrad.config.patch(partitioner="vjp", activation_memory_budget=0.5):
        with pytest.raises(aotgrad.ConfigError, match="activation_memory_budget=0.5 needs a partitioner"):
            jax.grad(aotgrad.compile(lambda x: jnp.sum(jnp.sin(x))))(jnp.ones(3))


# ----------------------------------------------------------------------------- random bits

def _dropout_mlp(params: dict, x: jax.Array, key: jax.Array) -> jax.Array:
    for i, w in enumerate(params["w"]):
        x = jnp.tanh(x @ w)
        keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.6, x.shape)
        x = jnp.where(keep, x / 0.6, 0.0)
    return jnp.mean(x ** 2)


@pytest.mark.parametrize("budget", [0.0, 0.25, 0.5, 1.0])
def test_dropout_gradients_are_jax_at_every_budget(budget: float) -> None:
    params = {"w": [_rand(i, 32, 32) * 0.3 for i in range(3)]}
    x, key = _rand(9, 16, 32), jax.random.key(3)
    want = jax.value_and_grad(_dropout_mlp)(params, x, key)
    with aotgrad.config.patch(partitioner="min_cut", activation_memory_budget=budget):
        f = aotgrad.compile(_dropout_mlp)
        got = jax.value_and_grad(f)(params, x, key)
    tc.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def _scanned_dropout(params: dict, x: jax.Array, key: jax.Array) -> jax.Array:
    def layer(x: jax.Array, wi: tuple) -> tuple:
        w, i = wi
        x = jnp.tanh(x @ w)
        keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.6, x.shape)
        return jnp.where(keep, x / 0.6, 0.0), None
    x, _ = jax.lax.scan(layer, x, (params["w"], jnp.arange(params["w"].shape[0])))
    return jnp.mean(x ** 2)


def test_recomputed_random_bits_are_the_forward_bits() -> None:
    """At budget 0 a scan body saves nothing but its carry (its budget spans saved
    bytes), so the backward draws each layer's dropout mask again: the same bits, as the
    gradients equal to JAX's show (a different mask would zero other units)."""
    params = {"w": jnp.stack([_rand(i, 32, 32) * 0.3 for i in range(3)])}
    x, key = _rand(9, 16, 32), jax.random.key(3)
    want = jax.value_and_grad(_scanned_dropout)(params, x, key)
    with aotgrad.config.patch(partitioner="min_cut", activation_memory_budget=0.0):
        f = aotgrad.compile(_scanned_dropout)
        got = jax.value_and_grad(f)(params, x, key)
        report = aotgrad.explain(f, params, x, key, argnums=0)
    tc.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
    assert _count(report.backward_jaxpr.jaxpr, {"random_bits"}) > 0


# ----------------------------------------------------------------------------- equality masks

def _max_of_maximum(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.max(jnp.maximum(x, w.T @ w), axis=0)  # both derivatives compare with `eq`


_TIE_INPUTS = (jnp.array([[-1.0], [0.4], [-0.9]]), jnp.array([[-0.809068], [0.46504775]]))


@pytest.mark.parametrize("mode", ["same_as_forward", "off"])
@pytest.mark.parametrize("budget", [0.0, 0.5, 0.9])
def test_equality_masks_of_16_bit_values_come_from_the_forward(budget: float, mode: str) -> None:
    """XLA keeps the bfloat16 matmul output in float32 inside the forward's fusion, and saves
    it rounded. A max mask recomputed from the rounded copy matched nowhere (gradient 0).
    (PyTorch's promotion widens the 16-bit matmul result to meet the float32 input; under
    "jax" the input follows and nothing is widened.)"""
    cast = aotgrad.autocast("cpu", dtype=jnp.bfloat16, promotion="torch")
    loss = lambda f: lambda x, w: jnp.sum(f(x, w))  # noqa: E731
    want = jax.grad(loss(cast(_max_of_maximum)), argnums=1)(*_TIE_INPUTS)
    assert float(jnp.abs(want).max()) > 0.5
    with aotgrad.config.patch(partitioner="min_cut", activation_memory_budget=budget,
                              backward_pass_autocast=mode), cast:
        f = aotgrad.compile(_max_of_maximum)
        got = jax.grad(loss(f), argnums=1)(*_TIE_INPUTS)
        report = aotgrad.explain(f, *_TIE_INPUTS)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2)
    masks = [s for s in report.saved if s.primitive == "eq"]
    assert masks and all(s.dtype == "bool" and s.reason.startswith("banned: eq of values widened from 16 bits")
                         for s in masks)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_equality_masks_of_values_in_one_type_are_recomputed(dtype: str) -> None:
    """Values computed in one type are recomputed bit for bit: a relu written as `maximum`
    saves no mask, in float32 or bfloat16."""
    def mlp(ws: list, x: jax.Array) -> jax.Array:
        for w in ws:
            x = jnp.maximum(x @ w, 0.0)
        return jnp.sum(jnp.clip(x, -1.0, 1.0) ** 2)
    ws, x = [(_rand(i, 32, 32) * 0.3).astype(dtype) for i in range(3)], _rand(9, 16, 32).astype(dtype)
    with aotgrad.config.patch(partitioner="min_cut", activation_memory_budget=0.9):
        got = jax.value_and_grad(aotgrad.compile(mlp))(ws, x)
    tol = 1e-5 if dtype == "float32" else 1e-2
    tc.assert_trees_close(jax.tree.map(lambda a: a.astype(jnp.float32), got),
                          jax.tree.map(lambda a: a.astype(jnp.float32), jax.value_and_grad(mlp)(ws, x)),
                          rtol=tol, atol=tol)
    assert [e.primitive.name for e in cheapest(joint_graph(mlp, ws, x)).producers] == ["dot_general"] * 3


# ----------------------------------------------------------------------------- control flow, collectives

def test_scan_and_cond_graphs_partition_at_every_budget() -> None:
    def f(w, xs):
        def body(h, x):
            h = jnp.tanh(h @ w + x)
            return h, jax.lax.cond(jnp.sum(h) > 0, jnp.sin, jnp.cos, h)
        _, ys = jax.lax.scan(body, jnp.zeros(8), xs)
        return jnp.sum(ys ** 2)
    w, xs = _rand(0, 8, 8) * 0.5, _rand(1, 5, 8)
    want = jax.value_and_grad(f)(w, xs)
    for budget in (0.0, 0.5, 1.0):
        with aotgrad.config.patch(partitioner="min_cut", activation_memory_budget=budget):
            got = jax.value_and_grad(aotgrad.compile(f))(w, xs)
        tc.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def _count(jaxpr: Any, names: set[str]) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name in names
        for sub in aotgrad.partition.rules.sub_jaxprs(eqn):
            n += _count(sub, names)
    return n


@pytest.mark.parametrize("budget", [0.0, 1.0])
def test_collectives_inside_shard_map_are_never_recomputed(budget: float) -> None:
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))

    def f(w, x):
        def body(w, x):
            h = jnp.tanh(x @ w)
            return jax.lax.psum(jnp.sum(h * h), "d")
        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())(w, x)
    w, x = _rand(0, 8, 8), _rand(1, 4, 8)
    graph = joint_graph(f, w, x)
    with_default = partition(graph, "vjp")
    sp = partition(graph, "min_cut", budget)
    collectives = {"psum", "all_gather", "ppermute", "psum_scatter", "all_to_all", "pbroadcast"}
    # The forward's shard_map (holding the psum) is never run again in the backward.
    assert _count(sp.backward.jaxpr, collectives) == _count(with_default.backward.jaxpr, collectives)
    assert "shard_map" not in dict(sp.recomputed)
    with aotgrad.config.patch(partitioner="min_cut", activation_memory_budget=budget):
        got = jax.value_and_grad(aotgrad.compile(f), argnums=(0, 1))(w, x)
    tc.assert_trees_close(got, jax.value_and_grad(f, argnums=(0, 1))(w, x), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- schedule, explain

def test_recomputation_is_emitted_just_before_first_use() -> None:
    def f(ws, x):
        for w in ws:
            x = x + jnp.sin(x @ w)
        return jnp.sum(x)
    ws = [_rand(i, 16, 16) * 0.3 for i in range(3)]
    graph = joint_graph(f, ws, _rand(5, 4, 16))
    sp = cheapest(graph)
    eqns = sp.backward.jaxpr.eqns
    names = [e.primitive.name for e in eqns]
    # sin's derivative, cos, is recomputed for every layer (each matmul output is saved) ...
    assert names.count("cos") == 3 and dict(sp.recomputed)["cos"] == 3
    # ... each just before its own layer's backward: the layers' backward matmuls (two per
    # layer, the first layer's input cotangent unused: 5) come between consecutive cos.
    cos_at = [i for i, n in enumerate(names) if n == "cos"]
    for before, after in zip(cos_at, cos_at[1:]):
        assert "dot_general" in names[before:after], names
    assert names.index("dot_general") > cos_at[0]  # the first one is not hoisted either
    order = split_module.recompute_late(graph, list(range(len(graph.eqns))))
    assert sorted(order) == list(range(len(graph.eqns)))


def test_explain_gives_reasons_and_recomputed_counts() -> None:
    def f(x, w):
        return jnp.sum(jnp.tanh(x @ w) ** 2)
    x, w = _rand(0, 8, 16), _rand(1, 16, 16)
    report = aotgrad.explain(aotgrad.compile(f), x, w, under_jit=True)
    assert {s.reason for s in report.saved} == {"input: saved as itself, free", FUSED_REASON}
    assert not report.recomputed  # budget 1 under jax.jit: the fused step's plan
    apart = aotgrad.explain(aotgrad.compile(f), x, w)  # apart: the cheapest cut
    assert {s.reason for s in apart.saved} == {"input: saved as itself, free",
                                              "banned: dot_general is compute-bound, not recomputed"}
    assert "tanh" in dict(apart.recomputed) and "dot_general" not in dict(apart.recomputed)
    assert apart.saved_bytes < report.saved_bytes
    with aotgrad.config.patch(activation_memory_budget=0.0):
        report0 = aotgrad.explain(aotgrad.compile(f), x, w)
    assert report0.saved_bytes == 0 and dict(report0.recomputed)["dot_general"] == 1
    assert "min_cut" in PARTITIONERS and report.partitioner == "min_cut"
    # Peak memory of both programs, from XLA: the backward holds at least the saved values.
    m = report.memory
    assert m.peak == max(m.forward_peak, m.backward_peak)
    assert m.backward_peak >= report.saved_bytes + report.saved_input_bytes > 0
    assert "XLA memory: forward peak" in str(report)
