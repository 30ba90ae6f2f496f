"""`aotgrad.targets` and `aotgrad.plan` on this machine's CPU (jax 0.10.2 and later, no
compiler plugin needed). Where the CUDA compiler plugin is installed, `tests/gpu_target_cases.py`
checks `plan` against a compile-only H100 too (run by `test_gpu_target.py`)."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax
import pytest

from aotgrad import targets
from aotgrad.planning.table import COST_TIE

ROOT = pathlib.Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- targets

def test_the_target_descriptions_ship_inside_the_package(tmp_path):
    """The package copied alone (no repository, no sibling folder) resolves every shipped GPU
    target from its own files: a fresh clone or an installed wheel has nothing else."""
    shutil.copytree(ROOT / "aotgrad", tmp_path / "aotgrad")
    code = textwrap.dedent("""
        import importlib.util, pathlib, aotgrad, aotgrad.targets as t
        assert pathlib.Path(aotgrad.__file__).parent == pathlib.Path.cwd() / "aotgrad", aotgrad.__file__
        assert "NVIDIA H100" in t.resolve("h100").description
        assert "NVIDIA A100" in t.resolve("a100").description
        if importlib.util.find_spec("jax_plugins") and importlib.util.find_spec("jax_plugins.xla_cuda12"):
            mesh = t.resolve("h100").mesh(2)
            assert [d.device_kind for d in mesh.devices.flat] == ["NVIDIA H100 80GB HBM3"] * 2
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_the_package_data_is_declared_for_the_wheel():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"aotgrad.targets" = ["*.txtpb"]' in text
    assert sorted(p.name for p in (ROOT / "aotgrad" / "targets").glob("*.txtpb")) == ["a100.txtpb", "h100.txtpb"]


def test_an_unknown_target_name_lists_the_known_ones():
    with pytest.raises(targets.TargetError, match=r"unknown target 'h200'; known: 'h100', 'a100', 'tpu-v5e', 'cpu'"):
        targets.resolve("h200")
    with pytest.raises(targets.TargetError, match="no target description file at 'missing/h100.txtpb'"):
        targets.resolve("missing/h100.txtpb")


def test_a_description_file_is_a_gpu_target(tmp_path):
    path = tmp_path / "mine.txtpb"
    path.write_text(targets.resolve("h100").description)
    target = targets.resolve(str(path))
    assert (target.name, target.platform, target.compile_only) == ("mine", "cuda", True)


def test_device_counts_the_target_does_not_have_are_refused():
    cpu = targets.resolve(None)
    assert cpu.name == "cpu" and not cpu.compile_only
    with pytest.raises(targets.TargetError, match=rf"devices={len(jax.devices('cpu')) + 1}: target cpu has"):
        cpu.mesh(len(jax.devices("cpu")) + 1)
    with pytest.raises(targets.TargetError, match="devices=12: a GPU target has up to 8 GPUs per host"):
        targets.resolve("h100").mesh(12)
    with pytest.raises(targets.TargetError, match="devices=3: target tpu-v5e is a square of chips"):
        targets.resolve("tpu-v5e").mesh(3)
    with pytest.raises(targets.TargetError, match="devices must be an int >= 1; got 0"):
        cpu.mesh(0)


def test_real_devices_are_a_target():
    target = targets.resolve(jax.devices("cpu")[:1])
    assert target.mesh(1).devices.flat[0] == jax.devices("cpu")[0]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # no parent package at all
        return False


@pytest.mark.skipif(_installed("jax_plugins.xla_cuda12"), reason="the CUDA compiler plugin is installed")
def test_a_missing_gpu_compiler_names_the_extra_to_install():
    with pytest.raises(targets.TargetUnavailable, match=r"pip install 'aotgrad\[gpu-target\]'"):
        targets.resolve("h100").mesh(1)


@pytest.mark.skipif(_installed("libtpu"), reason="libtpu is installed")
def test_a_missing_tpu_compiler_names_what_to_install():
    with pytest.raises(targets.TargetUnavailable, match=r"jax\[tpu\]"):
        targets.resolve("tpu-v5e").mesh(1)


# ----------------------------------------------------------------------------- plan on the CPU

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import aotgrad  # noqa: E402
from aotgrad.planning.place import PlacementError, place  # noqa: E402

BUDGETS = [1.0, 0.5, 0.0]


def mlp_loss(params, x):
    h = x
    for i in range(3):
        h = jnp.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
    return jnp.mean(h ** 2)


def mlp_args(width=64, batch=32):
    params = {}
    for i in range(3):
        params[f"w{i}"] = jax.ShapeDtypeStruct((width, width), jnp.float32)
        params[f"b{i}"] = jax.ShapeDtypeStruct((width,), jnp.float32)
    return params, jax.ShapeDtypeStruct((batch, width), jnp.float32)


def _on_cpu(tree):
    """The reference's own placement: every leaf on a one-device CPU mesh, replicated."""
    mesh = jax.sharding.Mesh(jax.devices("cpu")[:1], ("data",))
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), tree)


def _reference(jitted, *args):
    """(peak, bytes accessed, flops) of `jitted` compiled for `args`, read from XLA directly."""
    compiled = jitted.lower(*args).compile()
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    peak = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return peak, cost["bytes accessed"], cost["flops"]


def _steps(loss):
    yield "fused", None, jax.jit(jax.value_and_grad(loss))
    for b in BUDGETS:
        with aotgrad.config.patch(activation_memory_budget=b):
            yield "aotgrad", b, jax.jit(jax.value_and_grad(aotgrad.compile(loss)))


def _assert_rows_match(plan, loss, args):
    rows = {(r.strategy, r.budget): r for r in plan.rows}
    assert len(rows) == 1 + len(BUDGETS)
    for strategy, budget, jitted in _steps(loss):
        with aotgrad.config.patch(activation_memory_budget=1.0 if budget is None else budget):
            want = _reference(jitted, *args)
        row = rows[strategy, budget]
        assert (row.peak_bytes, row.bytes_moved, row.flops) == want, (strategy, budget, row, want)


def test_plan_rows_are_what_xla_reports_for_the_same_steps(capsys):
    """Each row's peak, bytes and FLOPs are XLA's numbers for jax.jit(jax.value_and_grad(...)) of
    the same loss, compiled here independently on the same devices."""
    params, x = mlp_args()
    plan = aotgrad.plan(mlp_loss, params, x, target="cpu", budgets=BUDGETS)
    _assert_rows_match(plan, mlp_loss, _on_cpu((params, x)))
    assert plan.rows[0].strategy == "fused" and plan.rows[0].budget is None
    assert all(r.compile_s > 0 and r.est_step_s is None for r in plan.rows)  # no bandwidth known for a CPU
    err = capsys.readouterr().err
    assert err.count("compiling") == 1 + len(BUDGETS), err


def test_plan_of_a_compiled_function_is_the_plan_of_its_loss():
    params, x = mlp_args()
    a = aotgrad.plan(aotgrad.compile(mlp_loss), params, x, target="cpu", budgets=[0.0])
    b = aotgrad.plan(mlp_loss, params, x, target="cpu", budgets=[0.0])
    assert [(r.peak_bytes, r.bytes_moved) for r in a.rows] == [(r.peak_bytes, r.bytes_moved) for r in b.rows]


def test_plan_takes_arrays_as_well_as_shapes():
    params, x = mlp_args()
    arrays = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), (params, x))
    a = aotgrad.plan(mlp_loss, *arrays, target=None, budgets=[0.0])
    b = aotgrad.plan(mlp_loss, params, x, target="cpu", budgets=[0.0])
    assert [(r.peak_bytes, r.bytes_moved) for r in a.rows] == [(r.peak_bytes, r.bytes_moved) for r in b.rows]


def train_step(opt, grad):
    """The training step written out by hand: `grad`'s value and gradients, then the optax
    update, with the parameters and the optimizer state donated."""
    import optax

    def step(p, state, batch):
        value, grads = grad(p, batch)
        updates, state = opt.update(grads, state, p)
        return value, optax.apply_updates(p, updates), state
    return jax.jit(step, donate_argnums=(0, 1))


def test_plan_with_an_optimizer_is_the_whole_training_step():
    """optax.adam's update in the step, parameters and state donated: the reference is the
    training step written out by hand."""
    optax = pytest.importorskip("optax")
    params, x = mlp_args()
    opt = optax.adam(1e-3)
    plan = aotgrad.plan(mlp_loss, params, x, target="cpu", budgets=[0.0], optimizer=opt)
    state = jax.eval_shape(opt.init, params)
    args = _on_cpu((params, state, x))
    fused = _reference(train_step(opt, jax.value_and_grad(mlp_loss)), *args)
    with aotgrad.config.patch(activation_memory_budget=0.0):
        zero = _reference(train_step(opt, jax.value_and_grad(aotgrad.compile(mlp_loss))), *args)
    assert [(r.peak_bytes, r.bytes_moved, r.flops) for r in plan.rows] == [fused, zero]
    no_opt = aotgrad.plan(mlp_loss, params, x, target="cpu", budgets=[])
    assert plan.rows[0].peak_bytes > no_opt.rows[0].peak_bytes  # the moments are held too


def test_plan_takes_an_equinox_module_with_static_leaves():
    """An Equinox MLP holds functions and ints beside its arrays: those are passed as they are."""
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(16, 4, 32, 2, key=jax.random.key(0))
    x = jnp.ones((8, 16))

    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x) ** 2)
    plan = aotgrad.plan(loss, model, x, target="cpu", budgets=[0.0])
    arrays, static = eqx.partition(model, eqx.is_array)
    want = _reference(jax.jit(jax.value_and_grad(lambda a, x: loss(eqx.combine(a, static), x))), *_on_cpu((arrays, x)))
    assert (plan.rows[0].peak_bytes, plan.rows[0].bytes_moved, plan.rows[0].flops) == want


def test_plan_passes_static_leaves_and_keyword_arguments_through():
    """Leaves that are not arrays (a Python float among the parameters, a string in the batch)
    reach `fn` as they are, keyword arrays are traced; the reference closes over the statics."""
    def loss(params, batch, *, y):
        assert params["scale"] == 2.0 and batch["mode"] == "train"
        return jnp.mean((jnp.tanh(batch["x"] @ params["w"]) * params["scale"] - y) ** 2)
    w, x, y = (jax.ShapeDtypeStruct(s, jnp.float32) for s in [(16, 8), (32, 16), (32, 8)])
    plan = aotgrad.plan(loss, {"w": w, "scale": 2.0}, {"x": x, "mode": "train"}, target="cpu", budgets=[0.0], y=y)

    def closed(w, x, y):
        return loss({"w": w, "scale": 2.0}, {"x": x, "mode": "train"}, y=y)
    want = _reference(jax.jit(jax.value_and_grad(closed)), *_on_cpu((w, x, y)))
    assert (plan.rows[0].peak_bytes, plan.rows[0].bytes_moved, plan.rows[0].flops) == want


def test_plan_takes_a_flax_nnx_module():
    """Its Param state is differentiated, its other state (random keys) passed along."""
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(16, 32, rngs=rngs)
            self.b = nnx.Linear(32, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    model = Model(nnx.Rngs(0))
    x = jnp.ones((8, 16))

    def loss(m, x):
        return jnp.mean(m(x) ** 2)
    plan = aotgrad.plan(loss, model, x, target="cpu", budgets=[0.0])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    want = _reference(jax.jit(jax.value_and_grad(lambda p, r, x: loss(nnx.merge(graphdef, p, r), x))),
                      *_on_cpu((params, rest, x)))
    assert (plan.rows[0].peak_bytes, plan.rows[0].flops) == (want[0], want[2])
    assert plan.rows[1].peak_bytes is not None


def test_fit_never_returns_a_row_over_the_limit():
    params, x = mlp_args(width=128, batch=256)
    plan = aotgrad.plan(mlp_loss, params, x, target="cpu", budgets=BUDGETS)
    peaks = sorted({r.peak_bytes for r in plan.rows})
    for limit in [p + d for p in peaks for d in (-1, 0, 1)] + [10 ** 12, "1TB"]:
        try:
            row = plan.fit(limit)
        except aotgrad.DoesNotFit as e:
            assert limit == peaks[0] - 1 or e.smallest > (limit if isinstance(limit, int) else 10 ** 12)
            assert f"smallest peak reached is {e.smallest:,} bytes" in str(e)
            continue
        n = limit if isinstance(limit, int) else 10 ** 12
        assert row.peak_bytes <= n
        fitting = [r for r in plan.rows if r.peak_bytes <= n]
        assert not fitting or row.bytes_moved <= (1 + COST_TIE) * min(r.bytes_moved for r in fitting)
    with pytest.raises(aotgrad.DoesNotFit, match="no step fits in 1,000 bytes per device on 1 x cpu"):
        plan.fit("1KB")
    assert plan.fit(plan.rows[0].peak_bytes).strategy == "fused"


def test_fit_takes_the_highest_peak_among_steps_moving_about_the_fewest_bytes():
    """Bytes moved within `COST_TIE` of the fewest are one cost, and the step saving the most
    of them (the highest peak under the limit) is taken: on a real H200 the 14 GB limit took a
    12.13 GB step moving 108.85 GB where a 13.74 GB one moved 109.48. A step moving more than
    that is not taken for its higher peak."""
    from aotgrad.planning.table import Plan, Row

    def row(budget, peak, moved):
        return Row("fused" if budget is None else "aotgrad", budget, peak, moved, 1.0, None, 0.0)
    rows = (row(None, 100, 50.0), row("a", 50, 100.0), row("b", 60, 100.9), row("c", 70, 101.2))
    plan = Plan("cpu", 1, "dp", {}, rows)
    assert plan.fit(80).budget == "b"  # "a" moves the fewest; "c" moves 1.2% more
    assert plan.fit(55).budget == "a" and plan.fit(100).strategy == "fused"


def test_fit_lands_just_under_the_limit_where_a_plan_does():
    """The reference: every plan a byte budget chooses between (`plan.levels`), each compiled
    here at a byte budget inside its range. For each limit, where one of them peaks in
    [0.95 x limit, limit], `fit` returns a step peaking in that range, or a lower one that
    moves fewer bytes still, never one moving more bytes than any there. (Below that range it
    may miss a plan that moves fewer bytes: it searches for the highest that fits.) The limit
    720 KB catches a search that compiles the byte budget `limit` itself (as `fit` did): its
    estimate takes the plan that peaks at 672 KB, though a plan at 689 KB fits and moves fewer
    bytes. The levels of each limit's gap, blended finer, are searched too."""
    from aotgrad.planning.land import setting
    from aotgrad.planning.measure import xla_peak
    from benchmarks.workloads import gpt
    loss, params, batch = gpt(batch=2, seq=32, d_model=32, heads=2, layers=3, vocab=64)
    plan = aotgrad.plan(loss, params, batch, target="cpu", budgets=[])
    levels = plan.levels(10 ** 9)
    assert len(levels) >= 4
    compiled = []
    for i, low in enumerate(levels):
        with aotgrad.config.patch(activation_memory_budget=setting(low, ([*levels, float("inf")])[i + 1])):
            c = jax.jit(jax.value_and_grad(aotgrad.compile(loss))).lower(params, batch).compile()
        cost = c.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        compiled.append((xla_peak(c.memory_analysis()), cost["bytes accessed"]))
    peaks = sorted(p for p, _ in compiled)
    searchable = set(levels)  # every level of every limit's gap blended finer, too
    for limit in [720_000] + [int(p / 0.97) for p in peaks]:
        if limit >= plan.rows[0].peak_bytes:
            continue  # the fused step fits
        searchable.update(plan.levels(limit))
        row = plan.fit(limit)
        assert row.peak_bytes <= limit, (limit, row, compiled)
        landed = [moved for p, moved in compiled if 0.95 * limit <= p <= limit]
        if landed:  # in that range, or lower and moving fewer bytes still
            assert row.bytes_moved <= (1 + COST_TIE) * min(landed), (limit, row, compiled)
            assert row.peak_bytes >= 0.95 * limit or row.bytes_moved < min(landed), (limit, row, compiled)
    for level in list(searchable):  # and the gaps around each level (`land`'s `finer`)
        searchable.update(plan.levels(level))
    assert len(plan.searched) <= len(searchable)  # each setting compiled once over all the limits


@pytest.mark.parametrize("kind", ["gpt", "gpt_scan"])
def test_fit_traces_the_step_once_unless_a_scan_is_cut_at_the_limit(kind, monkeypatch):
    """Each `fit` asks for the levels at its limit. A step with no scan has the same levels
    at every limit: its joint graph is traced (at budget 1, which builds no ladder while
    tracing) and its ladder built once per plan (on GPT-2 small a trace and two ladders took
    15-30 s per `fit`). A scan's body is cut at the limit before the step is traced, so
    there each limit is traced again."""
    from aotgrad.partition import budget
    from aotgrad.planning import build, land
    from benchmarks import workloads
    traced, ladders = [], []
    monkeypatch.setattr(build, "Levels", lambda graph, real=build.Levels: traced.append(graph) or real(graph))
    real = budget.ladder_of
    for module in (budget, land):  # the ladder, built by `Levels` or while tracing at a byte budget
        monkeypatch.setattr(module, "ladder_of", lambda *a, **k: ladders.append(a) or real(*a, **k))
    w = workloads.build(kind, kind, dict(batch=2, seq=16, d_model=16, heads=2, layers=2, vocab=32))
    plan = aotgrad.plan(w.loss_fn, w.params, w.batch, target="cpu", budgets=[])
    ladders.clear()
    first, second = plan.levels(1000), plan.levels(10 ** 9)  # below every plan, then above
    assert len(traced) == (1 if kind == "gpt" else 2)
    if kind == "gpt":  # one ladder in all: none built while tracing
        assert first == second and len(ladders) == 1, ladders


def test_the_landing_tables_in_the_docs_are_the_results_files():
    """docs/planning.md quotes each landing run (docs/results/landing/*.json) as
    `benchmarks.landing.table` renders it: a number changed by hand, or a rerun not copied
    into the docs, fails here."""
    import json
    from benchmarks.landing import table
    doc = (ROOT / "docs" / "planning.md").read_text()
    files = sorted((ROOT / "docs" / "results" / "landing").glob("*.json"))
    runs = [f for f in files if not f.name.endswith("_on_device.json")]
    assert len(runs) >= 3
    for f in runs:
        assert table(json.loads(f.read_text())) in doc, f"docs/planning.md does not quote {f.name} as it is"


def test_a_setting_is_the_shortest_size_in_its_range():
    from aotgrad.partition.budget_value import parse_bytes
    from aotgrad.planning.land import setting
    assert setting(7_712_345_678, 8.1e9) == "8GB"
    assert setting(7_712_345_678, 7.75e9) == "7.72GB"
    assert setting(583_048, 674_824) == "584KB"
    assert setting(999, 1000) == "999B" and setting(12, float("inf")) == "12B"
    for low, high in [(7_712_345_678, 7_712_345_679), (1_000_000_001, 1_000_000_002)]:
        assert low <= parse_bytes(setting(low, high)) < high


def test_the_table_json_and_plot(tmp_path):
    params, x = mlp_args()
    plan = aotgrad.plan(mlp_loss, params, x, target="cpu", budgets=[1, "1MB"])
    text = str(plan)
    assert all(len(line) <= 100 for line in text.splitlines()), text
    assert f"1 x cpu (dp); jax {jax.__version__}" in text and "aotgrad@1MB" in text and "estimate" in text
    data = plan.to_json()
    import json
    assert json.loads(json.dumps(data)) == data
    assert (data["target"], data["devices"], data["versions"]["jax"]) == ("cpu", 1, jax.__version__)
    assert [r["budget"] for r in data["rows"]] == [None, 1, "1MB"]
    assert set(data["rows"][0]) == {"strategy", "budget", "peak_bytes", "bytes_moved", "flops", "est_step_s",
                                    "compile_s"}
    pytest.importorskip("matplotlib")
    assert plan.plot(str(tmp_path / "plan.png")) == str(tmp_path / "plan.png")
    assert (tmp_path / "plan.png").stat().st_size > 0


# ----------------------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("budgets, message", [
    ([1.5], r"budgets\[0\]=1.5: aotgrad.config.activation_memory_budget must be a fraction in \[0, 1\] or a byte"),
    ([0.5, -0.1], r"budgets\[1\]=-0.1"),
    ([1, "12 parsecs"], r"budgets\[1\]='12 parsecs': .*a byte size is a number with a unit"),
])
def test_a_bad_budget_is_refused_before_anything_compiles(budgets, message, capsys):
    params, x = mlp_args()
    with pytest.raises(ValueError, match=message):
        aotgrad.plan(mlp_loss, params, x, target="cpu", budgets=budgets)
    assert "compiling" not in capsys.readouterr().err


def test_bad_targets_and_device_counts_are_refused(capsys):
    params, x = mlp_args()
    with pytest.raises(targets.TargetError, match="unknown target 'v100'; known: 'h100', 'a100'"):
        aotgrad.plan(mlp_loss, params, x, target="v100")
    n = len(jax.devices("cpu"))
    with pytest.raises(targets.TargetError, match=rf"devices={n + 1}: target cpu has {n} devices"):
        aotgrad.plan(mlp_loss, params, x, target="cpu", devices=n + 1)
    assert "compiling" not in capsys.readouterr().err


def test_a_function_that_reads_a_value_is_named():
    params, x = mlp_args()

    def reads(params, x):
        if jnp.sum(x) > 0:  # a branch on data
            return mlp_loss(params, x)
        return 0.0
    with pytest.raises(TypeError, match=r"plan: fn \(.*reads\) reads the value of an argument"):
        aotgrad.plan(reads, params, x, target="cpu")


def test_a_split_that_does_not_divide_an_axis_names_the_leaf():
    """Checked on an abstract mesh of 4 devices (no devices needed)."""
    mesh = jax.sharding.AbstractMesh((4,), ("data",))
    params, _ = mlp_args(width=64)
    batch = {"x": jax.ShapeDtypeStruct((6, 64), jnp.float32)}
    with pytest.raises(PlacementError, match=r"sharding of args\[1\]\['x'\]: axis 0 of shape \(6, 64\) is not "
                                             r"divisible by the 4 devices"):
        place(params, [batch], {}, mesh, "dp")
    odd = {**params, "odd": jax.ShapeDtypeStruct((6,), jnp.float32)}
    with pytest.raises(PlacementError, match=r"sharding of args\[0\]\['odd'\]: axis 0 of shape \(6,\) is not"):
        place(odd, [batch], {}, mesh, ({k: P("data") for k in odd}, P()))
    bad = {k: P() for k in params} | {"w1": P(None, "model")}
    with pytest.raises(PlacementError, match=r"args\[0\]\['w1'\]: .* names mesh axis 'model'"):
        place(params, [{"x": jax.ShapeDtypeStruct((8, 64), jnp.float32)}], {}, mesh, (bad, P()))
    with pytest.raises(PlacementError, match="one entry .* per positional argument"):
        place(params, [batch], {}, mesh, (P(),))
    with pytest.raises(PlacementError, match="sharding must be 'dp', 'fsdp'"):
        place(params, [batch], {}, mesh, "tp")
    placed, (rest,), _ = place(params, [{"x": jax.ShapeDtypeStruct((8, 64), jnp.float32)}], {}, mesh, "fsdp")
    assert placed.dynamic["w0"].sharding.spec == P("data", None) and placed.dynamic["b0"].sharding.spec == P("data")
    assert rest.dynamic["x"].sharding.spec == P("data")


FOUR_CPU_CASE = """
import jax, jax.numpy as jnp, aotgrad
from jax.sharding import NamedSharding, PartitionSpec as P
from tests.test_plan import mlp_args, mlp_loss, _reference
assert len(jax.devices("cpu")) == 4
params, x = mlp_args(width=64, batch=32)
mesh = jax.sharding.Mesh(jax.devices("cpu"), ("data",))
put = lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
for sharding, param_spec in [("dp", lambda a: P()), ("fsdp", lambda a: P("data", *[None] * (a.ndim - 1)))]:
    plan = aotgrad.plan(mlp_loss, params, x, target="cpu", devices=4, sharding=sharding, budgets=[0.0])
    args = (jax.tree.map(lambda a: put(a, param_spec(a)), params), put(x, P("data")))
    fused = _reference(jax.jit(jax.value_and_grad(mlp_loss)), *args)
    with aotgrad.config.patch(activation_memory_budget=0.0):
        zero = _reference(jax.jit(jax.value_and_grad(aotgrad.compile(mlp_loss))), *args)
    got = [(r.peak_bytes, r.bytes_moved, r.flops) for r in plan.rows]
    assert got == [fused, zero], (sharding, got, fused, zero)
try:
    aotgrad.plan(mlp_loss, params, jax.ShapeDtypeStruct((30, 64), jnp.float32), target="cpu", devices=4)
except ValueError as e:
    assert "sharding of args[1]: axis 0 of shape (30, 64) is not divisible by the 4 devices" in str(e), e
else:
    raise AssertionError("a batch of 30 split over 4 devices was accepted")
print("ok")
"""


def test_plan_on_four_cpu_devices_data_parallel_and_fsdp():
    """On 4 CPU devices (a process of its own): dp and fsdp rows equal the steps compiled here
    with the arguments placed by hand; a batch the devices do not divide is refused."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", FOUR_CPU_CASE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("above,tries_next", [(303, True), (400, False)])
def test_landing_looks_past_a_step_that_misses_by_a_hair(above, tries_next):
    """Compiled peaks that level off: the step above the highest that fits misses the limit
    (301) by 0.7% and the next one fits. Bisection alone stops at the miss; `land` tries the
    next while a miss is within `PLATEAU`, and not past a clear miss (400)."""
    from aotgrad.planning.land import land

    @dataclasses.dataclass(frozen=True)
    class Step:
        peak_bytes: int

    estimates = [100, 200, 300, 400, 500]
    compiled = dict(zip(estimates, [100, 200, 290, above, 299]))
    tried = land(301, estimates, lambda text: Step(compiled[int(text.rstrip("B"))])).tried
    peaks = [step.peak_bytes for _, step in tried]
    assert peaks[:2] == [290, above]
    assert (299 in peaks) is tries_next


def test_landing_searches_the_finer_levels_between_the_two_steps_around_the_limit():
    """The estimate sits above the compiled peak (here by 100 bytes), so the limit's own gap
    of estimates is not where its compiled peak falls. Once 200 fits and 300 does not,
    the levels `finer` blends between them (250, 270) are searched: 270 compiles to 170 and
    fits the limit of 180 best; without `finer` the landing stops at 200's 100."""
    from aotgrad.planning.land import land

    @dataclasses.dataclass(frozen=True)
    class Step:
        peak_bytes: int

    coarse = [100, 200, 300, 400]
    fine = {200: [100, 200, 250, 270, 300, 400]}
    asked = []

    def finer(p):
        asked.append(p)
        return fine.get(p, coarse)

    def compile_at(text):
        return Step(int(text.rstrip("B")) - 100)

    peaks = [step.peak_bytes for _, step in land(180, coarse, compile_at, finer).tried]
    assert asked == [200] and max(p for p in peaks if p <= 180) == 170, peaks
    assert max(p for _, s in land(180, coarse, compile_at).tried if (p := s.peak_bytes) <= 180) == 100
