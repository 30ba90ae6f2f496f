"""`aotgrad.export` / `aotgrad.deserialize`: round trips (in this process and in a fresh
one that does not import the functions' module), symbolic batch sizes, and every error:
call mismatches, format version, platform, truncated and corrupted blobs (fuzzed).

References are independent of the export: `jax.grad` / `jax.vjp` of the plain function for
values, and, for "the same as before the restart", the `aotgrad.compile`d function in
the exporting process, bit for bit.
"""
from __future__ import annotations

import json
import os
import pathlib
import struct
import subprocess
import sys

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import aotgrad
from aotgrad.export import ExportError

try:
    from tests import corpus, export_loader
    from tests.own_process import assert_eight_device_module_passed
    from tests.partition_configs import config_id, partitioner_configs
except ImportError:
    import corpus
    import export_loader
    from own_process import assert_eight_device_module_passed
    from partition_configs import config_id, partitioner_configs

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT = {"partitioner": aotgrad.config.partitioner, "activation_memory_budget": 1.0}

# Programs of the round trip: pytrees of dicts and tuples, keyword arguments, closed-over
# arrays, scan, PRNG keys, integer inputs and outputs, bfloat16, Python scalars.
ROUND_TRIP = ("mlp", "scan_rnn", "closure", "keyword_args", "dropout", "embedding_int_indices",
              "int_output", "mixed_bf16", "scalar_inputs")
# In a fresh process: these under every partitioner configuration, the others of
# ROUND_TRIP under the default one, these under autocast.
FRESH_PROCESS = ("mlp", "scan_rnn")
AUTOCAST_ROUND_TRIP = ("mlp", "scan_rnn")


def _argnums(p: corpus.Program) -> tuple[int, ...]:
    return (p.argnums,) if isinstance(p.argnums, int) else tuple(p.argnums)


def _same_bits(got, want) -> bool:
    return export_loader.digests(jax.tree.leaves(got)) == export_loader.digests(jax.tree.leaves(want))


def _mlp():
    p = corpus.BY_NAME["mlp"]
    return p, p.make_args()


# ----------------------------------------------------------------------------- in this process

@pytest.mark.parametrize("name", ROUND_TRIP)
def test_round_trip_matches_jax(name):
    """Values and gradients of the loaded programs against plain JAX, called eagerly and
    inside a `jax.jit` (where the exported pair, planned to run apart, still runs; bit-identity
    with the exporting process is checked in a fresh process, below)."""
    p = corpus.BY_NAME[name]
    args, kwargs = p.make_args(), (p.make_kwargs() if p.make_kwargs else {})
    nums = _argnums(p)
    loaded = aotgrad.deserialize(aotgrad.export(p.fn, *args, argnums=nums, **kwargs).serialize())
    want = export_loader.results(p.fn, args, kwargs, nums, jit=True)  # plain JAX
    for jit in (False, True):
        got = export_loader.results(loaded, args, kwargs, nums, jit=jit)
        for g, w in zip(got["out"] + got["grads"], want["out"] + want["grads"]):
            np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                       rtol=p.rtol, atol=p.atol)


def test_vjp_fwd_and_bwd_and_explain():
    p, args = _mlp()
    compiled = aotgrad.compile(p.fn)
    loaded = aotgrad.deserialize(aotgrad.export(compiled, *args).serialize())
    out, vjp = jax.vjp(loaded, *args)
    want_out, want_vjp = jax.vjp(p.fn, *args)
    np.testing.assert_allclose(out, want_out, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(vjp(jnp.float32(1.5))), jax.tree.leaves(want_vjp(jnp.float32(1.5)))):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    fwd, bwd = aotgrad.fwd_and_bwd(loaded, argnums=0)
    out, saved = fwd(*args)
    assert isinstance(saved, aotgrad.Saved)
    ref_fwd, ref_bwd = aotgrad.fwd_and_bwd(compiled, argnums=0)
    ref_out, ref_saved = ref_fwd(*args)
    assert _same_bits(bwd(saved, jnp.ones_like(out)), ref_bwd(ref_saved, jnp.ones_like(ref_out)))
    with pytest.raises(ValueError, match="cotangent"):
        bwd(saved, jnp.ones((3,)))
    report, ref = aotgrad.explain(loaded, *args), aotgrad.explain(compiled, *args)
    assert report.saved == ref.saved and report.recomputed == ref.recomputed
    assert report.saved_bytes == ref.saved_bytes and report.memory == ref.memory
    assert "tests/corpus.py" in str(report)  # the user's source lines, without the source


def test_gradients_for_a_subset_of_the_exported_inputs():
    p, (params, x, y) = _mlp()
    loaded = aotgrad.deserialize(aotgrad.export(p.fn, params, x, y, argnums=(0, 1)).serialize())
    g = jax.grad(loaded, argnums=1)(params, x, y)  # x only: the params' gradients are dropped
    np.testing.assert_allclose(g, jax.grad(p.fn, argnums=1)(params, x, y), rtol=1e-5, atol=1e-6)
    with pytest.raises(ExportError, match=r"argument\(s\) y, which the export does not differentiate"):
        jax.grad(loaded, argnums=2)(params, x, y)
    traced = loaded.trace(params, x, y)  # its one entry: the exported pattern by default
    assert traced.entry is loaded.trace(params, x, y).entry and traced.perturbed() == traced.perturbed((0, 1))
    assert traced.pair(1).perturbed == traced.perturbed(1)
    assert traced.lower().pair is traced.pair((0, 1)) and loaded.cache_info().entries == 1


def test_has_aux_through_fwd_and_bwd():
    def f(w, x):
        h = jnp.tanh(x @ w)
        return jnp.sum(h ** 2), {"mean": jnp.mean(h)}
    w, x = corpus._normal(3, (4, 5), (6, 4))
    loaded = aotgrad.deserialize(aotgrad.export(f, w, x, argnums=0).serialize())
    fwd, bwd = aotgrad.fwd_and_bwd(loaded, argnums=0, has_aux=True)
    out, saved, aux = fwd(w, x)
    (want_out, want_aux), want_g = jax.value_and_grad(f, has_aux=True)(w, x)
    np.testing.assert_allclose(bwd(saved, jnp.float32(1.0)), want_g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(aux["mean"], want_aux["mean"], rtol=1e-6)
    # Through jax.value_and_grad, the aux output's cotangent is a symbolic zero.
    (out, aux), g = jax.value_and_grad(loaded, has_aux=True)(w, x)
    np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(aux["mean"], want_aux["mean"], rtol=1e-6)


def test_static_arguments_are_fixed():
    p = corpus.BY_NAME["static_arg"]
    a, n, b = p.make_args()
    compiled = aotgrad.compile(p.fn, static_argnums=1)
    loaded = aotgrad.deserialize(aotgrad.export(compiled, a, n, b, argnums=(0, 2)).serialize())
    assert _same_bits(loaded(a, n, b), compiled(a, n, b))
    g = jax.grad(export_loader.scalar_loss(lambda a, b: loaded(a, n, b), {}), argnums=(0, 1))(a, b)
    assert _same_bits(g, jax.grad(export_loader.scalar_loss(lambda a, b: compiled(a, n, b), {}), argnums=(0, 1))(a, b))
    with pytest.raises(ExportError, match="static arguments .* differ"):
        loaded(a, n + 1, b)


def test_symbolic_batch_with_the_default_partitioner():
    p, (params, x, y) = _mlp()
    b, = jax.export.symbolic_shape("b")
    specs = (jax.ShapeDtypeStruct((b, 6), jnp.float32), jax.ShapeDtypeStruct((b, 3), jnp.float32))
    with aotgrad.config.patch(partitioner="vjp"):
        loaded = aotgrad.deserialize(aotgrad.export(p.fn, params, *specs, argnums=0).serialize())
    for n in (8, 5, 1):
        got = jax.grad(loaded)(params, x[:n], y[:n])
        want = jax.grad(p.fn)(params, x[:n], y[:n])
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
    assert aotgrad.explain(loaded, params, x[:5], y[:5]).saved_bytes > 0
    with pytest.raises(ExportError, match="symbolic dimensions; explain it for arrays"):
        aotgrad.explain(loaded, params, *specs)


def test_symbolic_batch_where_a_partitioner_needs_shapes():
    p, (params, _, _) = _mlp()
    b, = jax.export.symbolic_shape("b")
    specs = (jax.ShapeDtypeStruct((b, 6), jnp.float32), jax.ShapeDtypeStruct((b, 3), jnp.float32))
    with aotgrad.config.patch(partitioner="min_cut"), \
            pytest.raises(ExportError, match="symbolic dimensions failed under partitioner='min_cut'.*"
                                             "partitioner='vjp'"):
        aotgrad.export(p.fn, params, *specs)


def test_config_and_autocast_are_recorded():
    p, args = _mlp()
    with aotgrad.config.patch(partitioner="vjp"), aotgrad.autocast("cpu", dtype=jnp.bfloat16):
        loaded = aotgrad.deserialize(aotgrad.export(p.fn, *args).serialize())
    assert loaded.config["partitioner"] == "vjp"
    assert loaded.autocast == {"device_type": "cpu", "dtype": "bfloat16", "promotion": "jax"}
    assert loaded.platforms == (jax.export.default_export_platform(),)


# ----------------------------------------------------------------------------- errors

def test_call_mismatches_name_the_argument():
    p, (params, x, y) = _mlp()
    loaded = aotgrad.deserialize(aotgrad.export(p.fn, params, x, y).serialize())
    with pytest.raises(ExportError, match=r"argument x is float32\[8, 5\]; it was exported for float32\[8, 6\]"):
        loaded(params, x[:, :5], y)
    with pytest.raises(ExportError, match=r"argument params\['w1'\] is int32\[6, 16\]"):
        loaded({**params, "w1": params["w1"].astype(jnp.int32)}, x, y)
    with pytest.raises(ExportError, match="the arguments have structure"):
        loaded(params, (x,), y)
    with pytest.raises(ExportError, match="the arguments have structure"):
        loaded(params, x)


def test_export_refusals():
    p, args = _mlp()
    with aotgrad.config.patch(donate_saved=True), pytest.raises(ExportError, match="donate_saved"):
        aotgrad.export(p.fn, *args)
    with pytest.raises(ExportError, match="static argument 1 is a _Hashable"):
        aotgrad.export(aotgrad.compile(lambda x, n: x * len(n), static_argnums=1), args[1], _Hashable([1]))
    with pytest.raises(ExportError, match="under a JAX transformation"):
        jax.jit(lambda x: aotgrad.export(jnp.sin, x) and x)(args[1])
    pt = corpus.BY_NAME["pytree_io"]
    with pytest.raises(ExportError, match="cannot be stored.*register_pytree_node_serialization"):
        aotgrad.export(pt.fn, *pt.make_args()).serialize()


class _Hashable(list):
    __hash__ = object.__hash__


@pytest.fixture(scope="module")
def blob() -> bytes:
    p, args = _mlp()
    return aotgrad.export(p.fn, *args).serialize()


def test_format_version(blob):
    other = bytearray(blob)
    struct.pack_into("<I", other, 8, 99)
    with pytest.raises(ExportError, match="format version 99; this aotgrad reads format version 1. Export again"):
        aotgrad.deserialize(bytes(other))


def test_platform():
    p, args = _mlp()
    tpu = aotgrad.export(p.fn, *args, platforms=["tpu"]).serialize()
    with pytest.raises(ExportError, match=r"exported for platform\(s\) \['tpu'\]; this process runs on 'cpu'"):
        aotgrad.deserialize(tpu)
    both = aotgrad.deserialize(aotgrad.export(p.fn, *args, platforms=["tpu", "cpu"]).serialize())
    np.testing.assert_allclose(both(*args), p.fn(*args), rtol=1e-6)


def test_truncated_corrupted_and_foreign_bytes(blob):
    with pytest.raises(ExportError, match="truncated"):
        aotgrad.deserialize(blob[:-1])
    with pytest.raises(ExportError, match="corrupted"):
        aotgrad.deserialize(blob[:200] + bytes([blob[200] ^ 1]) + blob[201:])
    with pytest.raises(ExportError, match="not an aotgrad export"):
        aotgrad.deserialize(b"PK\x03\x04" + blob)
    with pytest.raises(TypeError, match="expects bytes"):
        aotgrad.deserialize("blob")


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_blobs_give_errors(blob, data):
    """Any truncation, any flipped or inserted bytes: an ExportError, never a crash or a
    program that runs."""
    edit = data.draw(st.sampled_from(["truncate", "flip", "insert", "splice"]))
    b = bytearray(blob)
    if edit == "truncate":
        b = b[:data.draw(st.integers(0, len(b) - 1))]
    elif edit == "flip":
        for i in data.draw(st.lists(st.integers(0, len(b) - 1), min_size=1, max_size=4)):
            b[i] ^= data.draw(st.integers(1, 255))
    elif edit == "insert":
        i = data.draw(st.integers(0, len(b)))
        b[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    else:  # a well-formed header over a damaged payload: the checksum decides
        i = data.draw(st.integers(60, len(b) - 1))
        b[i] ^= 0xFF
    with pytest.raises(ExportError):
        aotgrad.deserialize(bytes(b))


# ----------------------------------------------------------------------------- in a fresh process

def _write_case(directory: pathlib.Path, tag: str, p: corpus.Program, manifest: list,
                modes: tuple[str, ...] = ("eager",)) -> None:
    args, kwargs = p.make_args(), (p.make_kwargs() if p.make_kwargs else {})
    nums = _argnums(p)
    compiled = aotgrad.compile(p.fn)
    exported = aotgrad.export(compiled, *args, argnums=nums, **kwargs)
    (directory / f"{tag}.aotgrad").write_bytes(exported.serialize())
    export_loader.save_leaves(directory / f"{tag}.inputs", jax.tree.leaves((args, kwargs)))
    case = {"name": tag, "blob": f"{tag}.aotgrad", "inputs": f"{tag}.inputs", "argnums": list(nums),
            "modes": list(modes)}
    for mode in modes:
        # Under jax.jit the compiled function plans the step as one program, while the
        # export holds the pair planned to run apart: the reference is the export itself.
        want = export_loader.results(compiled if mode == "eager" else exported, args, kwargs, nums,
                                     jit=mode == "jit")
        case.update({f"{mode}_{part}": export_loader.digests(want[part]) for part in want})
    if not kwargs:
        fwd, bwd = aotgrad.fwd_and_bwd(compiled, argnums=nums)
        out, saved = fwd(*args)
        case["fwd_and_bwd_grads"] = export_loader.digests(jax.tree.leaves(bwd(saved, jax.tree.map(jnp.ones_like, out))))
    manifest.append(case)


def test_round_trip_in_a_fresh_process(tmp_path):
    """Every partitioner configuration and autocast: exported here, loaded by a process
    that never imports tests/corpus.py; outputs and gradients bit-identical (eager, and
    under jax.jit for the default configuration)."""
    manifest: list = []
    for config in partitioner_configs():
        with aotgrad.config.patch(**config):
            default = config_id(config) == config_id(DEFAULT)
            for name in ROUND_TRIP if default else FRESH_PROCESS:
                _write_case(tmp_path, f"{name}.{config_id(config)}", corpus.BY_NAME[name], manifest,
                            ("eager", "jit") if default else ("eager",))
    with aotgrad.autocast("cpu", dtype=jnp.bfloat16):
        for name in AUTOCAST_ROUND_TRIP:
            _write_case(tmp_path, f"{name}.autocast", corpus.BY_NAME[name], manifest)
    assert f"{len(manifest)} cases: bit-identical" in _load_in_fresh_process(tmp_path, manifest)


def _load_in_fresh_process(directory: pathlib.Path, manifest: list, **env: str) -> str:
    """Runs tests/export_loader.py on `manifest` in a new Python process; returns its output."""
    (directory / "manifest.json").write_text(json.dumps(manifest))
    env = {**os.environ, **env,
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(HERE / "export_loader.py"), str(directory)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    return proc.stdout


def test_warm_start_from_the_compilation_cache(tmp_path):
    """AOTGRAD_COMPILATION_CACHE_DIR: the first loading process compiles and fills the
    cache, the second compiles nothing (every program is a cache hit)."""
    manifest: list = []
    _write_case(tmp_path, "mlp", corpus.BY_NAME["mlp"], manifest, ("eager", "jit"))
    cache = str(tmp_path / "cache")
    first = _load_in_fresh_process(tmp_path, manifest, AOTGRAD_COMPILATION_CACHE_DIR=cache)
    assert "persistent cache: 0 hits" in first and os.listdir(cache), first
    second = _load_in_fresh_process(tmp_path, manifest, AOTGRAD_COMPILATION_CACHE_DIR=cache)
    assert " 0 misses" in second and "1 cases: bit-identical" in second, second
    assert "persistent cache: 0 hits" not in second, second


def test_compilation_cache_dir_option(tmp_path):
    with pytest.raises(aotgrad.ConfigError, match="compilation_cache_dir must be a directory path or None"):
        aotgrad.config.compilation_cache_dir = 3
    assert aotgrad.config.compilation_cache_dir is None
    assert ("compilation_cache_dir", None) not in aotgrad.config.snapshot().key  # changes no program


def test_sharded_export_on_8_devices():
    """tests/export_sharded_cases.py, in the process of 8 simulated devices that the
    8-device modules share (tests/own_process.py)."""
    assert_eight_device_module_passed("export_sharded_cases.py")

