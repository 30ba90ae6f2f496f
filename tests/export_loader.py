"""The loading side of the export round trip, run as a fresh Python process by
tests/test_export.py: ``python tests/export_loader.py DIR``.

`DIR/manifest.json` lists cases, each an exported blob, its inputs, the argument numbers
to differentiate and the SHA-256 of the outputs and gradients the exporting process got
from the `aotgrad.compile`d function. This process imports neither the functions' module
(tests/corpus.py) nor their source; it loads each blob, calls it eagerly and under
`jax.jit`, differentiates it with `jax.grad` and `aotgrad.fwd_and_bwd`, and checks every
result bit for bit. Exit status 0 when all match; the mismatches are printed otherwise.
It also prints how many programs JAX's persistent compilation cache held (hits) or not.
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import sys
from typing import Any, Callable, Sequence

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np

# ----------------------------------------------------------------------------- shared with the exporting side


def scalar_loss(fn: Callable[..., Any], kwargs: dict) -> Callable[..., Any]:
    """`fn`'s floating outputs summed in float32: one scalar to differentiate."""
    def loss(*args: Any) -> Any:
        leaves = [x for x in jax.tree.leaves(fn(*args, **kwargs)) if jnp.issubdtype(x.dtype, jnp.inexact)]
        return sum(jnp.sum(x.astype(jnp.float32)) for x in leaves)
    return loss


def results(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict, argnums: Sequence[int],
            jit: bool = False) -> dict[str, list[Any]]:
    """What the round trip compares: the outputs, and `jax.grad` of `scalar_loss`."""
    grad = jax.grad(scalar_loss(fn, kwargs), argnums=tuple(argnums))
    if jit:
        return {"out": jax.tree.leaves(jax.jit(lambda *a: fn(*a, **kwargs))(*args)),
                "grads": jax.tree.leaves(jax.jit(grad)(*args))}
    return {"out": jax.tree.leaves(fn(*args, **kwargs)), "grads": jax.tree.leaves(grad(*args))}


def digests(leaves: Sequence[Any]) -> list[str]:
    """dtype, shape and SHA-256 of each array's bytes: equal digests, equal bits."""
    out = []
    for x in leaves:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            x = jax.random.key_data(x)
        a = np.asarray(x)
        out.append(f"{a.dtype}{list(a.shape)}:{hashlib.sha256(a.tobytes()).hexdigest()}")
    return out


def save_leaves(path: pathlib.Path, leaves: Sequence[Any]) -> None:
    """Arrays as raw bytes plus dtype/shape (bfloat16 and PRNG keys included)."""
    meta, raw = [], {}
    for i, x in enumerate(leaves):
        impl, python = None, type(x).__name__ if isinstance(x, (int, float)) else None
        if python is None and jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            impl, x = str(jax.random.key_impl(x)), jax.random.key_data(x)
        a = np.asarray(x)
        meta.append({"dtype": a.dtype.name, "shape": list(a.shape), "key_impl": impl, "python": python})
        raw[f"l{i}"] = np.frombuffer(a.tobytes(), np.uint8)
    np.savez(path.with_suffix(".npz"), **raw)
    path.with_suffix(".json").write_text(json.dumps(meta))


def load_leaves(path: pathlib.Path) -> list[Any]:
    meta = json.loads(path.with_suffix(".json").read_text())
    raw = np.load(path.with_suffix(".npz"))
    leaves = []
    for i, m in enumerate(meta):
        a = np.frombuffer(raw[f"l{i}"].tobytes(), jnp.dtype(m["dtype"])).reshape(m["shape"])
        if m["key_impl"] is not None:
            leaves.append(jax.random.wrap_key_data(jnp.asarray(a), impl=m["key_impl"]))
        elif m["python"] is not None:
            leaves.append({"int": int, "float": float}[m["python"]](a))
        else:
            leaves.append(jnp.asarray(a))
    return leaves


# ----------------------------------------------------------------------------- the loading process

def check_case(case: dict[str, Any], directory: pathlib.Path) -> list[str]:
    import aotgrad

    exported = aotgrad.deserialize((directory / case["blob"]).read_bytes())
    args, kwargs = jax.tree.unflatten(exported.in_tree, load_leaves(directory / case["inputs"]))
    nums = case["argnums"]
    problems = []
    for mode in case["modes"]:
        got = results(exported, args, kwargs, nums, jit=mode == "jit")
        for part in ("out", "grads"):
            if digests(got[part]) != case[f"{mode}_{part}"]:
                problems.append(f"{case['name']}: {mode} {part} differ from the exporting process")
    if not kwargs:
        fwd, bwd = aotgrad.fwd_and_bwd(exported, argnums=tuple(nums))
        out, saved = fwd(*args)
        grads = bwd(saved, jax.tree.map(jnp.ones_like, out))
        if digests(jax.tree.leaves(grads)) != case["fwd_and_bwd_grads"]:
            problems.append(f"{case['name']}: fwd_and_bwd gradients differ from the exporting process")
    return problems


def main(directory: pathlib.Path) -> int:
    events: list[str] = []
    jax.monitoring.register_event_listener(lambda event, **_: events.append(event))
    manifest = json.loads((directory / "manifest.json").read_text())
    problems = [p for case in manifest for p in check_case(case, directory)]
    print(f"persistent cache: {events.count('/jax/compilation_cache/cache_hits')} hits, "
          f"{events.count('/jax/compilation_cache/cache_misses')} misses")
    leaked = [m for m in ("corpus", "tests.corpus") if m in sys.modules]
    if leaked:
        problems.append(f"the loading process imported the functions' module: {leaked}")
    print("\n".join(problems) or f"{len(manifest)} cases: bit-identical")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1])))
