"""The PyTorch peer (`--peers`): the same workloads in eager PyTorch, same weights and
data (copied from the JAX workload), timed in the same interleaved rounds.

Strategy `torch_eager`: forward, then `torch.autograd.grad` of the loss with respect to
every parameter. Saved bytes are what autograd keeps for the backward, counted with
`torch.autograd.graph.saved_tensors_hooks` by distinct storage, excluding storages of
parameters and inputs (as for the JAX strategies). Optional: nothing else imports torch.
"""
from __future__ import annotations

import importlib
import math
import time
from typing import Any, Callable

import jax
import numpy as np

from benchmarks.strategies import Prepared, SavedBytes
from benchmarks.workloads import Workload

__all__ = ["NAME", "available", "prepare_torch"]

NAME = "torch_eager"


def available() -> str | None:
    """None when torch imports; else a one-line reason."""
    try:
        importlib.import_module("torch")
    except ImportError as e:
        return f"PyTorch peer skipped: torch is not importable ({e}); pip install torch to include it"
    return None


def _losses() -> dict[str, Callable[[dict[str, Any]], Callable[[Any, Any], Any]]]:
    import torch
    import torch.nn.functional as F

    def mlp(sizes: dict[str, Any]) -> Callable[[Any, Any], Any]:
        def loss(p: Any, b: Any) -> Any:
            h = b["x"]
            for i in range(sizes["depth"]):
                h = F.gelu(h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])
            return torch.mean(torch.square(h - b["y"]))
        return loss

    def block(p: Any, x: Any, heads: int) -> Any:
        bsz, t, d = x.shape
        h = F.layer_norm(x, (d,), p["ln1"]["scale"], p["ln1"]["bias"], eps=1e-5)
        qkv = h @ p["qkv"]["w"] + p["qkv"]["b"]
        q, k, v = (z.reshape(bsz, t, heads, d // heads).transpose(1, 2) for z in qkv.chunk(3, dim=-1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(bsz, t, d)
        x = x + o @ p["proj"]["w"] + p["proj"]["b"]
        h = F.layer_norm(x, (d,), p["ln2"]["scale"], p["ln2"]["bias"], eps=1e-5)
        h = F.gelu(h @ p["fc1"]["w"] + p["fc1"]["b"], approximate="tanh")
        return x + h @ p["fc2"]["w"] + p["fc2"]["b"]

    def transformer_block(sizes: dict[str, Any]) -> Callable[[Any, Any], Any]:
        def loss(p: Any, b: Any) -> Any:
            return torch.mean(torch.square(block(p, b["x"], sizes["heads"]) - b["y"]))
        return loss

    def gpt(sizes: dict[str, Any]) -> Callable[[Any, Any], Any]:
        def loss(p: Any, b: Any) -> Any:
            x = p["wte"][b["tokens"]] + p["wpe"]
            for bp in p["blocks"]:
                x = block(bp, x, sizes["heads"])
            x = F.layer_norm(x, (x.shape[-1],), p["ln_f"]["scale"], p["ln_f"]["bias"], eps=1e-5)
            logits = x @ p["wte"].T
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["targets"].reshape(-1))
        return loss

    def same_pad(size: int, stride: int) -> tuple[int, int]:
        out = math.ceil(size / stride)
        total = max((out - 1) * stride + 3 - size, 0)
        return total // 2, total - total // 2

    def convnet(sizes: dict[str, Any]) -> Callable[[Any, Any], Any]:
        def loss(p: Any, b: Any) -> Any:
            x = b["images"]  # NCHW (converted once, outside the timed step)
            for i, layer in enumerate(p["convs"]):
                stride = 1 if i == 0 else 2
                (hl, hh), (wl, wh) = same_pad(x.shape[2], stride), same_pad(x.shape[3], stride)
                x = F.conv2d(F.pad(x, (wl, wh, hl, hh)), layer["w"].permute(3, 2, 0, 1), stride=stride)
                x = F.batch_norm(x, None, None, layer["scale"], layer["bias"], training=True, eps=1e-5)
                x = F.relu(x)
            x = x.mean(dim=(2, 3))
            return F.cross_entropy(x @ p["head"]["w"] + p["head"]["b"], b["labels"])
        return loss

    def rnn(sizes: dict[str, Any]) -> Callable[[Any, Any], Any]:
        def loss(p: Any, b: Any) -> Any:
            xs = b["x"]
            h = xs.new_zeros((xs.shape[1], p["wh"].shape[0]))
            hs = []
            for t in range(xs.shape[0]):
                h = torch.tanh(xs[t] @ p["wx"] + h @ p["wh"] + p["b"])
                hs.append(h)
            return torch.mean(torch.square(torch.stack(hs) @ p["wo"] - b["y"]))
        return loss

    return {"mlp": mlp, "transformer_block": transformer_block, "gpt": gpt, "convnet": convnet, "rnn": rnn}


def _to_torch(x: Any, requires_grad: bool = False) -> Any:
    import torch
    a = np.asarray(x)
    t = torch.from_numpy(a.astype(np.int64) if a.dtype.kind in "iu" else a.copy())
    return t.requires_grad_(requires_grad)


def prepare_torch(w: Workload) -> Prepared:
    """Builds and warms the eager PyTorch version of `w`. Raises if there is none."""
    import contextlib

    import torch
    builders = _losses()
    if w.kind not in builders:
        raise ValueError(f"no PyTorch version of workload kind {w.kind!r}")
    loss_fn = builders[w.kind](w.sizes)
    params = jax.tree.map(lambda x: _to_torch(x, True), w.params)
    batch = jax.tree.map(_to_torch, w.batch)
    if w.kind == "convnet":
        batch["images"] = batch["images"].permute(0, 3, 1, 2).contiguous()
    leaves = jax.tree.leaves(params)

    def step() -> Any:
        loss = loss_fn(params, batch)
        return loss, torch.autograd.grad(loss, leaves)

    t0 = time.perf_counter()
    _, grads = step()
    first = time.perf_counter() - t0
    saved = _saved_bytes(loss_fn, params, batch)
    grads_np = jax.tree.unflatten(jax.tree.structure(w.params), [g.numpy() for g in grads])
    return Prepared(NAME, step, contextlib.nullcontext, grads_np, first, saved, None, None,
                    notes=(f"torch {torch.__version__}, {torch.get_num_threads()} threads",),
                    block=lambda out: out)


def _saved_bytes(loss_fn: Callable[[Any, Any], Any], params: Any, batch: Any) -> SavedBytes:
    import torch
    outside = {t.untyped_storage().data_ptr() for t in jax.tree.leaves((params, batch))}
    storages: dict[int, int] = {}
    inputs: dict[int, int] = {}
    count = 0

    def pack(t: Any) -> Any:
        nonlocal count
        count += 1
        s = t.untyped_storage()
        (inputs if s.data_ptr() in outside else storages)[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(params, batch)
    del loss
    return SavedBytes(activations=sum(storages.values()), inputs=sum(inputs.values()), arrays=count)
