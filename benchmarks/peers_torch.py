"""The PyTorch peers (`--peers`): the same workloads in PyTorch, same weights and data
(copied from the JAX workload), timed in the same interleaved rounds. Optional: nothing
else imports torch, and without it `--peers` says so and runs the JAX strategies only
(`pip install 'aotgrad[peers]'`, i.e. torch==2.13.0, the version these numbers are for).

The PyTorch code is op for op the JAX code: attention is written out (scores, causal mask
with the float32 minimum, softmax, weighted sum), not `scaled_dot_product_attention`,
whose fused CPU kernel keeps a log-sum-exp instead of the probabilities and so would save
a different set of tensors than the JAX block.

Strategies:

- `torch_eager`: forward, then `torch.autograd.grad` of the loss with respect to every
  parameter. Saved bytes are what autograd keeps for the backward, packed by
  `torch.autograd.graph.saved_tensors_hooks` and counted by distinct storage as below
  (tensor by tensor, the attention probabilities would count twice: the softmax and the
  matmul after it both keep them).
- `torch_aot_min_cut`: AOTAutograd (`aot_function`) with the min-cut partitioner
  (`min_cut_rematerialization_partition`, its default cost model), no decompositions,
  and forward/backward "compilers" that return the fx graphs as they are (run eagerly).
  This is what `torch.compile(backend="aot_eager")` builds (the same partitioner, no
  decompositions), without Dynamo: one traced graph per workload, no guards or graph
  breaks, and direct access to the partitioned forward. A step is the partitioned
  forward and backward.

Saved bytes of `torch_aot_min_cut` are counted at run time from what the partitioned
forward returns: its outputs are the loss followed by the values saved for the backward
(as many as the backward graph has non-tangent inputs). They are counted by distinct
storage (`untyped_storage()`), so views of one buffer (q, k, v of one qkv matmul) count
once and whole; storages of parameters and batch arrays count as inputs. Counting the
output node's `meta["val"]` shapes instead would count each view separately (and views
of parameters as activations): not exact. The same count with `saved_tensors_hooks`
(what AOTAutograd passes to `save_for_backward`) is a cross-check; a disagreement is noted.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import time
from typing import Any, Callable, Iterable

import jax
import numpy as np

from benchmarks.strategies import Prepared, SavedBytes
from benchmarks.workloads import Workload

__all__ = ["AOT_NAME", "NAME", "NAMES", "available", "prepare_torch"]

NAME = "torch_eager"
AOT_NAME = "torch_aot_min_cut"
NAMES = (NAME, AOT_NAME)
TORCH_VERSION = "2.13.0"  # the version the peers were written and measured with


def available() -> str | None:
    """None when torch imports; else a one-line reason."""
    try:
        importlib.import_module("torch")
    except ImportError as e:
        return (f"PyTorch peers skipped: torch is not importable ({e}); "
                f"pip install 'aotgrad[peers]' (torch=={TORCH_VERSION}) to include them")
    return None


# ----------------------------------------------------------------------------- workloads

def _losses() -> dict[str, Callable[[dict[str, Any]], Callable[[Any, Any], Any]]]:
    import torch
    import torch.nn.functional as F

    def mlp(sizes: dict[str, Any]) -> Callable[[Any, Any], Any]:
        def loss(p: Any, b: Any) -> Any:
            h = b["x"]
            for i in range(sizes["depth"]):
                h = F.gelu(h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])  # exact (erf)
            return torch.mean(torch.square(h - b["y"]))
        return loss

    def attention(q: Any, k: Any, v: Any) -> Any:
        """Causal softmax attention on (batch, heads, seq, head_dim), as the JAX block."""
        t, dh = q.shape[-2], q.shape[-1]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(dh)
        causal = torch.tril(torch.ones((t, t), dtype=torch.bool))
        scores = torch.where(causal, scores, torch.finfo(torch.float32).min)
        return torch.softmax(scores, dim=-1) @ v

    def block(p: Any, x: Any, heads: int) -> Any:
        bsz, t, d = x.shape
        h = F.layer_norm(x, (d,), p["ln1"]["scale"], p["ln1"]["bias"], eps=1e-5)
        qkv = h @ p["qkv"]["w"] + p["qkv"]["b"]
        q, k, v = (z.reshape(bsz, t, heads, d // heads).transpose(1, 2) for z in qkv.chunk(3, dim=-1))
        o = attention(q, k, v).transpose(1, 2).reshape(bsz, t, d)
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


def _inputs(w: Workload) -> tuple[Callable[[Any, Any], Any], Any, Any]:
    """(loss_fn, params, batch) of the PyTorch version of `w`. Raises if there is none."""
    builders = _losses()
    if w.kind not in builders:
        raise ValueError(f"no PyTorch version of workload kind {w.kind!r}")
    params = jax.tree.map(lambda x: _to_torch(x, True), w.params)
    batch = jax.tree.map(_to_torch, w.batch)
    if w.kind == "convnet":
        batch["images"] = batch["images"].permute(0, 3, 1, 2).contiguous()
    return builders[w.kind](w.sizes), params, batch


# ----------------------------------------------------------------------------- strategies

def prepare_torch(w: Workload, name: str = NAME) -> Prepared:
    """Builds and warms PyTorch strategy `name` (one of NAMES) on `w`. Raises on failure."""
    import torch
    if name not in NAMES:
        raise ValueError(f"unknown PyTorch strategy {name!r}; known: {list(NAMES)}")
    loss_fn, params, batch = _inputs(w)
    leaves = jax.tree.leaves(params)
    outside = _storages(jax.tree.leaves((params, batch)))
    captured = _Captured()
    fn = loss_fn if name == NAME else _aot_min_cut(loss_fn, captured)

    def step() -> Any:
        loss = fn(params, batch)
        return loss, torch.autograd.grad(loss, leaves)

    t0 = time.perf_counter()
    _, grads = step()
    first = time.perf_counter() - t0
    hooked = _hooked_saved(fn, params, batch, outside)
    notes = [f"torch {torch.__version__}, {torch.get_num_threads()} threads"]
    if name == NAME:
        saved = hooked
    else:
        saved = _aot_saved(fn, params, batch, outside, captured)
        notes.append("AOTAutograd, min_cut_rematerialization_partition, no decompositions, graphs run eagerly")
        if (saved.activations, saved.inputs) != (hooked.activations, hooked.inputs):
            notes.append(f"saved_tensors_hooks count {hooked.activations:,} activation bytes; "
                         f"the forward returned {saved.activations:,}")
    grads_np = jax.tree.unflatten(jax.tree.structure(w.params), [g.numpy() for g in grads])
    return Prepared(name, step, contextlib.nullcontext, grads_np, first, saved, None, None,
                    notes=tuple(notes), block=lambda out: out)


@dataclasses.dataclass
class _Captured:
    """The partitioned graphs, and the forward's outputs of a call made while `record`."""
    forward: Any = None  # torch.fx.GraphModule
    backward: Any = None
    record: bool = False
    outputs: tuple[Any, ...] = ()


def _aot_min_cut(loss_fn: Callable[[Any, Any], Any], captured: _Captured) -> Callable[[Any, Any], Any]:
    """`loss_fn` through AOTAutograd with the min-cut partitioner; graphs run as traced."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def forward_compiler(gm: Any, example_inputs: Any) -> Callable[..., Any]:
        captured.forward = gm

        def forward(*args: Any) -> Any:
            out = gm(*args)
            if captured.record:
                captured.outputs = tuple(out)
            return out
        return make_boxed_func(forward)

    def backward_compiler(gm: Any, example_inputs: Any) -> Callable[..., Any]:
        captured.backward = gm  # compiled lazily, at the first backward
        return make_boxed_func(gm)

    return aot_function(loss_fn, forward_compiler, backward_compiler,
                        partition_fn=min_cut_rematerialization_partition)


# ----------------------------------------------------------------------------- saved bytes

def _storages(tensors: Iterable[Any]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def _count(tensors: list[Any], outside: set[int]) -> SavedBytes:
    """Bytes of the distinct storages of `tensors`: activations, and those in `outside`
    (parameters, batch) as inputs."""
    activations: dict[int, int] = {}
    inputs: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        (inputs if s.data_ptr() in outside else activations)[s.data_ptr()] = s.nbytes()
    return SavedBytes(activations=sum(activations.values()), inputs=sum(inputs.values()),
                      arrays=len(tensors))


def _hooked_saved(fn: Callable[[Any, Any], Any], params: Any, batch: Any, outside: set[int]) -> SavedBytes:
    """What autograd is asked to keep for the backward of one call of `fn`."""
    import torch
    kept: list[Any] = []

    def pack(t: Any) -> Any:
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(params, batch)
    del loss
    return _count(kept, outside)


def _aot_saved(fn: Callable[[Any, Any], Any], params: Any, batch: Any, outside: set[int],
               captured: _Captured) -> SavedBytes:
    """The tensors one call of the partitioned forward returns for the backward."""
    import torch
    if captured.backward is None:
        raise RuntimeError("run a backward first: AOTAutograd builds the backward graph lazily")
    n_saved = sum(1 for n in captured.backward.graph.nodes
                  if n.op == "placeholder" and not str(n.target).startswith("tangents"))
    captured.record = True
    try:
        loss = fn(params, batch)
    finally:
        captured.record = False
    outputs, captured.outputs = captured.outputs, ()
    del loss
    saved = [t for t in outputs[len(outputs) - n_saved:] if isinstance(t, torch.Tensor)]
    return _count(saved, outside)
