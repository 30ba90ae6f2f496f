"""Time to the first gradient after a restart: `aotgrad.deserialize` with a warm
compilation cache against the cold path (trace, partition, compile), each in a fresh
process, on a 12-layer GPT stack written as a Python loop (every layer its own code) and
the same stack as one `lax.scan`.

    python -m benchmarks.export [--layers=12] [--d-model=64] [--seq=32] [--batch=2] [--repeats=3]

Per workload, every phase is a new Python process (imports are not timed; the clock runs
from the first aotgrad call to gradients ready):
  - cold: `jax.grad(aotgrad.compile(loss))` on the inputs: trace, partition, compile, run;
    then `aotgrad.export`, and the blob and inputs written to disk;
  - prime: load the blob with `aotgrad.config.compilation_cache_dir` set, one gradient
    (fills JAX's persistent cache, as the first run of a restarted job would);
  - warm (`--repeats` times): read the blob, `aotgrad.deserialize`, one gradient, with the
    warm cache. It does not import this module's model code.
Gradients of every load are checked bit for bit against the cold process's.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

GPT_SIZES = dict(batch=2, seq=32, d_model=64, heads=4, layers=12, vocab=256)


def gpt_scan(seed: int = 0, **sizes: int) -> tuple[Any, Any, Any]:
    """`workloads.gpt` with the blocks stacked and run by one `lax.scan`."""
    from benchmarks import workloads
    _, params, data = workloads.gpt(seed, **sizes)
    params = {**params, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *params["blocks"])}

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        x = params["wte"][batch["tokens"]] + params["wpe"]
        x, _ = jax.lax.scan(lambda x, p: (workloads._block(p, x, sizes["heads"]), None), x, params["blocks"])
        x = workloads.layer_norm(x, params["ln_f"]["scale"], params["ln_f"]["bias"])
        return workloads._cross_entropy(x @ params["wte"].T, batch["targets"])

    return loss_fn, params, data


def _workload(kind: str, sizes: dict[str, int]) -> tuple[Any, Any, Any]:
    from benchmarks import workloads
    return workloads.gpt(0, **sizes) if kind == "unrolled" else gpt_scan(0, **sizes)


def _digest(tree: Any) -> str:
    return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(tree))).hexdigest()


# ----------------------------------------------------------------------------- phases (one process each)

def cold(directory: pathlib.Path, kind: str, sizes: dict[str, int]) -> dict[str, Any]:
    import aotgrad
    loss_fn, params, batch = _workload(kind, sizes)
    jax.block_until_ready((params, batch))
    t0 = time.perf_counter()
    grads = jax.block_until_ready(jax.grad(aotgrad.compile(loss_fn))(params, batch))
    seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    blob = aotgrad.export(loss_fn, params, batch, argnums=0).serialize()
    export_seconds = time.perf_counter() - t1
    (directory / "model.aotgrad").write_bytes(blob)
    np.savez(directory / "inputs.npz", *[np.asarray(x) for x in jax.tree.leaves(((params, batch), {}))])
    return {"seconds": seconds, "export_seconds": export_seconds, "bytes": len(blob), "grads": _digest(grads)}


def load(directory: pathlib.Path, cache: str) -> dict[str, Any]:
    import aotgrad
    aotgrad.config.compilation_cache_dir = cache
    stored = np.load(directory / "inputs.npz")
    leaves = [stored[f"arr_{i}"] for i in range(len(stored.files))]
    t0 = time.perf_counter()
    exported = aotgrad.deserialize((directory / "model.aotgrad").read_bytes())
    (params, batch), _ = jax.tree.unflatten(exported.in_tree, leaves)
    grads = jax.block_until_ready(jax.grad(exported)(params, batch))
    return {"seconds": time.perf_counter() - t0, "grads": _digest(grads)}


def _phase(*args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.export", "--phase", *args],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"phase {args[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- driver

def run(kind: str, sizes: dict[str, int], repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        directory, cache = pathlib.Path(tmp), str(pathlib.Path(tmp) / "cache")
        c = _phase("cold", str(directory), kind, json.dumps(sizes))
        prime = _phase("load", str(directory), cache)
        warm = [_phase("load", str(directory), cache) for _ in range(repeats)]
    median = statistics.median(w["seconds"] for w in warm)
    return {"workload": f"gpt_{kind}", "cold_s": c["seconds"], "prime_s": prime["seconds"],
            "warm_s": median, "ratio": median / c["seconds"], "export_s": c["export_seconds"],
            "bytes": c["bytes"],
            "bit_identical": all(r["grads"] == c["grads"] for r in [prime, *warm])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phase", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=GPT_SIZES["layers"])
    parser.add_argument("--d-model", type=int, default=GPT_SIZES["d_model"])
    parser.add_argument("--seq", type=int, default=GPT_SIZES["seq"])
    parser.add_argument("--batch", type=int, default=GPT_SIZES["batch"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.phase:
        name, directory, *rest = args.phase
        if name == "cold":
            result = cold(pathlib.Path(directory), rest[0], json.loads(rest[1]))
        else:
            result = load(pathlib.Path(directory), rest[0])
        print(json.dumps(result))
        return
    sizes = {**GPT_SIZES, "layers": args.layers, "d_model": args.d_model, "seq": args.seq, "batch": args.batch}
    print(f"{time.strftime('%Y-%m-%d')}  jax {jax.__version__}  backend {jax.default_backend()}  "
          f"cpus {os.cpu_count()}  sizes {sizes}")
    print(f"{'workload':<14} {'cold s':>7} {'prime s':>8} {'warm s':>7} {'warm/cold':>9} "
          f"{'export s':>8} {'export KB':>9}  bit-identical")
    for kind in ("unrolled", "scanned"):
        r = run(kind, sizes, args.repeats)
        print(f"{r['workload']:<14} {r['cold_s']:>7.2f} {r['prime_s']:>8.2f} {r['warm_s']:>7.3f} "
              f"{r['ratio']:>8.3f}x {r['export_s']:>8.2f} {r['bytes'] / 1e3:>9.1f}  {r['bit_identical']}")


if __name__ == "__main__":
    main()
