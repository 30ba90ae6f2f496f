"""`aotgrad.plan` for a compile-only NVIDIA H100 (XLA:GPU on a machine with no GPU).

Run by `tests/test_gpu_target.py` in a process of its own, with ``JAX_PLATFORMS=cpu`` set
before JAX is imported. Needs the CUDA compiler plugin (`pip install -e '.[gpu-target]'`);
without it every case is skipped. Models are tiny (a few seconds per compile on 2 cores).

Each reference is compiled here, independently of `plan`'s code: the topology from the
package's description file, the arguments placed by hand, `jax.jit(...).lower(...).compile()`,
XLA's `memory_analysis()` and HLO cost analysis read directly.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("jax_plugins.xla_cuda12", reason="the CUDA compiler plugin: pip install -e '.[gpu-target]'")

from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import aotgrad  # noqa: E402
from aotgrad.planning.measure import EXCESS, counted_cost  # noqa: E402  (XLA's cost analysis, loops counted as they run)
from benchmarks import workloads  # noqa: E402
from tests.test_plan import train_step  # noqa: E402  (the training step written out by hand)

DESCRIPTION = os.path.join(os.path.dirname(aotgrad.__file__), "targets", "h100.txtpb")
SIZES = dict(batch=8, seq=32, d_model=32, heads=2, layers=2, vocab=64)
BUDGETS = [1.0, 0.0]


def _mesh(n, hosts=1):
    topo = topologies.get_topology_desc(platform="cuda", target_config=open(DESCRIPTION).read(),
                                        topology=f"1x{hosts}x{n // hosts}")
    return topologies.make_mesh(topo, (n,), ("data",))


def _fsdp(shape, n):
    """The largest axis n divides, split (the rule `sharding="fsdp"` documents)."""
    for a in sorted(range(len(shape)), key=lambda a: -shape[a]):
        if shape[a] % n == 0:
            return P(*["data" if i == a else None for i in range(len(shape))])
    return P()


def _placed(mesh, params, batch, fsdp=False):
    n = mesh.size

    def put(a, spec):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
    return (jax.tree.map(lambda a: put(a, _fsdp(a.shape, n) if fsdp else P()), params),
            jax.tree.map(lambda a: put(a, P("data") if n > 1 else P()), batch))


def _numbers(jitted, args):
    compiled = jitted.lower(*args).compile()
    m = compiled.memory_analysis()
    cost = counted_cost(compiled)
    peak = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return peak, cost["bytes accessed"] - cost[EXCESS], cost["flops"]


def _reference(loss, args, budgets):
    want = {("fused", None): _numbers(jax.jit(jax.value_and_grad(loss)), args)}
    for b in budgets:
        with aotgrad.config.patch(activation_memory_budget=b):
            want["aotgrad", b] = _numbers(jax.jit(jax.value_and_grad(aotgrad.compile(loss))), args)
    return want


def _got(plan):
    return {(r.strategy, r.budget): (r.peak_bytes, r.bytes_moved, r.flops) for r in plan.rows}


@pytest.fixture(scope="module")
def gpt_plan():
    w = workloads.build("gpt", "gpt", SIZES)
    return w, aotgrad.plan(w.loss_fn, w.params, w.batch, target="h100", budgets=BUDGETS)


@pytest.mark.parametrize("kind", ["gpt", "gpt_scan"])
def test_plan_rows_are_the_h100_compilers_numbers(kind, gpt_plan):
    """Unrolled and scanned GPT: every row's peak, bytes and FLOPs are XLA:GPU's for the same
    step compiled here; the estimate uses the H100's bandwidth and FLOP rate."""
    w, plan = gpt_plan if kind == "gpt" else (None, None)
    budgets = BUDGETS if kind == "gpt" else [0.0]  # the scanned model at one budget: its compiles are slower
    if plan is None:
        w = workloads.build(kind, kind, SIZES)
        plan = aotgrad.plan(w.loss_fn, w.params, w.batch, target="h100", budgets=budgets)
    assert _got(plan) == _reference(w.loss_fn, _placed(_mesh(1), w.params, w.batch), budgets)
    assert (plan.target, plan.devices) == ("h100", 1)
    for r in plan.rows:
        assert r.est_step_s == pytest.approx(max(r.bytes_moved / 3.35e12, r.flops / 494.7e12))


def test_plan_on_eight_h100s_with_fsdp_and_an_optimizer():
    """8 devices, parameters split on their largest divisible axis, Adam's update in the step
    (parameters and state donated): the rows are the training step's compiled here."""
    optax = pytest.importorskip("optax")
    w = workloads.build("gpt", "gpt", SIZES)
    opt = optax.adam(1e-3)
    plan = aotgrad.plan(w.loss_fn, w.params, w.batch, target="h100", devices=8, sharding="fsdp",
                        budgets=[0.0], optimizer=opt)
    mesh = _mesh(8)
    params, batch = _placed(mesh, w.params, w.batch, fsdp=True)
    state = jax.eval_shape(opt.init, params)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
        mesh, _fsdp(a.shape, 8) if a.ndim else P())), state)

    want = [_numbers(train_step(opt, jax.value_and_grad(w.loss_fn)), (params, state, batch))]
    with aotgrad.config.patch(activation_memory_budget=0.0):
        want.append(_numbers(train_step(opt, jax.value_and_grad(aotgrad.compile(w.loss_fn))), (params, state, batch)))
    assert [(r.peak_bytes, r.bytes_moved, r.flops) for r in plan.rows] == want
    assert plan.rows[1].peak_bytes < plan.rows[0].peak_bytes


def test_plan_on_two_hosts_of_eight_h100s():
    """16 devices are two hosts of 8 (a multi-host compile-only topology): data parallel over
    all 16, the rows as compiled here on that topology."""
    w = workloads.build("gpt", "gpt", dict(SIZES, batch=16))
    plan = aotgrad.plan(w.loss_fn, w.params, w.batch, target="h100", devices=16, budgets=[0.0])
    assert _got(plan) == _reference(w.loss_fn, _placed(_mesh(16, hosts=2), w.params, w.batch), [0.0])


def test_plan_of_a_flax_nnx_decoder_on_the_h100():
    """A two-block NNX decoder written here: the Params are differentiated, the rows are the
    step compiled here on the split state."""
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, d, rngs):
            self.norm1, self.norm2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(2, d, decode=False, rngs=rngs)
            self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

        def __call__(self, x):
            x = x + self.attn(self.norm1(x), mask=nnx.make_causal_mask(x[..., 0]))
            return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))

    class Decoder(nnx.Module):
        def __init__(self, vocab, d, rngs):
            self.embed = nnx.Embed(vocab, d, rngs=rngs)
            self.blocks = nnx.List([Block(d, rngs) for _ in range(2)]) if hasattr(nnx, "List") else [
                Block(d, rngs) for _ in range(2)]
            self.head = nnx.Linear(d, vocab, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    def loss(model, tokens, targets):
        logits = model(tokens)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

    model = Decoder(64, 32, nnx.Rngs(0))
    tokens = jax.ShapeDtypeStruct((8, 32), jnp.int32)
    plan = aotgrad.plan(loss, model, tokens, tokens, target="h100", budgets=[0.0])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    mesh = _mesh(1)

    def put(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), tree)

    def split_loss(p, r, tokens, targets):
        return loss(nnx.merge(graphdef, p, r), tokens, targets)
    args = (put(params), put(rest), put(tokens), put(tokens))
    want = [_numbers(jax.jit(jax.value_and_grad(split_loss)), args)]
    with aotgrad.config.patch(activation_memory_budget=0.0):
        want.append(_numbers(jax.jit(jax.value_and_grad(aotgrad.compile(split_loss))), args))
    assert [(r.peak_bytes, r.bytes_moved, r.flops) for r in plan.rows] == want


def test_fit_never_returns_a_plan_over_the_limit_on_the_h100(gpt_plan):
    _, plan = gpt_plan
    peaks = sorted(r.peak_bytes for r in plan.rows)
    for limit in [peaks[0] - 1, peaks[-1]]:  # the first compiles the step at its byte budget too
        try:
            row = plan.fit(limit)
        except aotgrad.DoesNotFit as e:
            assert e.smallest > limit
            continue
        assert row.peak_bytes <= limit


def test_bad_inputs_on_the_h100_are_refused_before_anything_compiles(capsys):
    w = workloads.build("gpt", "gpt", SIZES)
    with pytest.raises(ValueError, match=r"devices=12: a GPU target has up to 8 GPUs per host"):
        aotgrad.plan(w.loss_fn, w.params, w.batch, target="h100", devices=12)
    odd = dict(w.params, odd=jax.ShapeDtypeStruct((6, 32), jnp.float32))
    specs = (jax.tree.map(lambda a: P("data"), odd), P("data"))
    with pytest.raises(ValueError, match=r"sharding of args\[0\]\['odd'\]: axis 0 of shape \(6, 32\) is not "
                                         r"divisible by the 8 devices"):
        aotgrad.plan(lambda p, b: w.loss_fn(w.params, b), odd, w.batch, target="h100", devices=8, sharding=specs)
    assert "compiling" not in capsys.readouterr().err
