"""Workloads: each builder makes `(loss_fn, params, batch)` for given sizes, in float32.

`loss_fn(params, batch) -> scalar`; the suite differentiates it with respect to `params`
(argument 0). Builders are registered in `BUILDERS` under the `kind` a suite file names.

`gpt`, `gpt_scan` and `vit` also take `dtype` ("float32", the default, or "bfloat16" or
"float16", settable from a suite's `sizes`): the same model written as a careful JAX user
writes a 16-bit model, the anchor `aotgrad.autocast` is measured against. The parameters
stay float32 (master weights) and each is cast to `dtype` where it is used; activations
and the residual stream are `dtype`; layer-norm statistics, the softmax and the loss are
float32 (`Precision`). The batch is as in float32 and the loss is float32. At "float32"
every cast is the identity: the model is the float32 one, equation for equation.

Every builder takes `remat`, a function wrapper applied to each layer (a GPT's or a ViT's
transformer block, an MLP layer, a convolution stage, the RNN cell, the scanned GPT's scan
body): the `jax.checkpoint` strategies pass `functools.partial(jax.checkpoint,
policy=...)`, as a JAX user puts `jax.checkpoint` on each layer. The default leaves layers
as they are.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from benchmarks.stacks import stack

__all__ = ["BUILDERS", "DTYPES", "Precision", "Workload", "build", "layer_norm"]

Params = dict[str, Any]
Batch = dict[str, Any]
LossFn = Callable[[Params, Batch], jax.Array]
Remat = Callable[[Callable[..., Any]], Callable[..., Any]]


def _plain(layer: Callable[..., Any]) -> Callable[..., Any]:
    return layer


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark problem: a scalar loss of (params, batch) and concrete inputs."""
    name: str
    kind: str
    sizes: dict[str, Any]
    loss_fn: LossFn
    params: Params
    batch: Batch

    @property
    def param_bytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.params))

    @property
    def batch_bytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.batch))


class _Keys:
    """Hands out fresh PRNG keys: `keys()` -> a new key each call."""

    def __init__(self, seed: int) -> None:
        self._key = jax.random.key(seed)

    def __call__(self) -> jax.Array:
        self._key, sub = jax.random.split(self._key)
        return sub


def _dense(keys: _Keys, fan_in: int, fan_out: int) -> jax.Array:
    return jax.random.normal(keys(), (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


# The `dtype` a model's activations may be written in (see the module docstring).
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Precision:
    """Where a hand-written 16-bit model casts: `dtype` for weights at their use and for
    activations, float32 for layer-norm statistics, the softmax and the loss. At float32
    every method is the identity (`astype` to an array's own dtype adds no equation)."""
    dtype: Any = jnp.float32

    @classmethod
    def of(cls, name: str) -> "Precision":
        if name not in DTYPES:
            raise ValueError(f"dtype {name!r}: a model's activations are one of {list(DTYPES)}")
        return cls(jnp.dtype(name))

    def weight(self, w: jax.Array) -> jax.Array:
        """A float32 master weight, cast at its use."""
        return w.astype(self.dtype)

    def dense(self, x: jax.Array, p: Params) -> jax.Array:
        return x @ self.weight(p["w"]) + self.weight(p["b"])

    def layer_norm(self, x: jax.Array, p: Params) -> jax.Array:
        """Statistics, normalization and scale in float32, the result cast back to `dtype`."""
        return layer_norm(x.astype(jnp.float32), p["scale"], p["bias"]).astype(self.dtype)

    def softmax(self, scores: jax.Array) -> jax.Array:
        """In float32, the probabilities cast back to `dtype` for the value matmul."""
        return jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(self.dtype)

    def loss(self, logits: jax.Array, labels: jax.Array) -> jax.Array:
        """Cross-entropy of the logits in float32."""
        return _cross_entropy(logits.astype(jnp.float32), labels)


F32 = Precision()


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


# ----------------------------------------------------------------------------- MLP

def mlp(seed: int = 0, *, batch: int, width: int, depth: int,
        remat: Remat = _plain) -> tuple[LossFn, Params, Batch]:
    """`depth` layers of exact (erf) GELU(x @ W + b), width `width`; mean squared error."""
    keys = _Keys(seed)
    params = {f"layer{i}": {"w": _dense(keys, width, width), "b": jnp.zeros((width,), jnp.float32)}
              for i in range(depth)}
    data = {"x": jax.random.normal(keys(), (batch, width), jnp.float32),
            "y": jax.random.normal(keys(), (batch, width), jnp.float32)}

    @remat
    def layer(p: Params, h: jax.Array) -> jax.Array:
        return jax.nn.gelu(h @ p["w"] + p["b"], approximate=False)

    def loss_fn(params: Params, batch: Batch) -> jax.Array:
        h = batch["x"]
        for i in range(depth):
            h = layer(params[f"layer{i}"], h)
        return jnp.mean(jnp.square(h - batch["y"]))

    return loss_fn, params, data


# ----------------------------------------------------------------------------- transformer

def _block_params(keys: _Keys, d_model: int) -> Params:
    d_ff = 4 * d_model
    return {
        "ln1": {"scale": jnp.ones((d_model,), jnp.float32), "bias": jnp.zeros((d_model,), jnp.float32)},
        "qkv": {"w": _dense(keys, d_model, 3 * d_model), "b": jnp.zeros((3 * d_model,), jnp.float32)},
        "proj": {"w": _dense(keys, d_model, d_model), "b": jnp.zeros((d_model,), jnp.float32)},
        "ln2": {"scale": jnp.ones((d_model,), jnp.float32), "bias": jnp.zeros((d_model,), jnp.float32)},
        "fc1": {"w": _dense(keys, d_model, d_ff), "b": jnp.zeros((d_ff,), jnp.float32)},
        "fc2": {"w": _dense(keys, d_ff, d_model), "b": jnp.zeros((d_model,), jnp.float32)},
    }


def _block(p: Params, x: jax.Array, heads: int, causal: bool = True, prec: Precision = F32) -> jax.Array:
    """Pre-LN transformer block: multi-head attention (causal unless `causal` is False),
    then a tanh-GELU 4x MLP; `prec`: where a 16-bit model casts."""
    b, t, d = x.shape
    dh = d // heads
    h = prec.layer_norm(x, p["ln1"])
    qkv = prec.dense(h, p["qkv"])
    q, k, v = (z.reshape(b, t, heads, dh) for z in jnp.split(qkv, 3, axis=-1))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(dh)
    if causal:  # the most negative value of the scores' own type: no promotion, no overflow
        scores = jnp.where(jnp.tril(jnp.ones((t, t), jnp.bool_)), scores, jnp.finfo(scores.dtype).min)
    attn = prec.softmax(scores)
    o = jnp.einsum("bhts,bshd->bthd", attn, v).reshape(b, t, d)
    x = x + o @ prec.weight(p["proj"]["w"]) + prec.weight(p["proj"]["b"])
    h = prec.layer_norm(x, p["ln2"])
    h = jax.nn.gelu(prec.dense(h, p["fc1"]), approximate=True)
    return x + h @ prec.weight(p["fc2"]["w"]) + prec.weight(p["fc2"]["b"])


def transformer_block(seed: int = 0, *, batch: int, seq: int, d_model: int,
                      heads: int, remat: Remat = _plain) -> tuple[LossFn, Params, Batch]:
    """One pre-LN block on (batch, seq, d_model) activations; mean squared error to a target."""
    keys = _Keys(seed)
    params = _block_params(keys, d_model)
    data = {"x": jax.random.normal(keys(), (batch, seq, d_model), jnp.float32),
            "y": jax.random.normal(keys(), (batch, seq, d_model), jnp.float32)}

    block = remat(functools.partial(_block, heads=heads))

    def loss_fn(params: Params, batch: Batch) -> jax.Array:
        return jnp.mean(jnp.square(block(params, batch["x"]) - batch["y"]))

    return loss_fn, params, data


def gpt(seed: int = 0, *, batch: int, seq: int, d_model: int, heads: int, layers: int,
        vocab: int, dtype: str = "float32", remat: Remat = _plain) -> tuple[LossFn, Params, Batch]:
    """GPT-style stack: token + position embeddings, `layers` pre-LN blocks (a Python
    loop, so every layer is its own code), final LayerNorm, tied-embedding logits,
    next-token cross-entropy on integer tokens. `dtype`: see the module docstring."""
    keys = _Keys(seed)
    prec = Precision.of(dtype)
    params = _gpt_params(keys, d_model, seq, vocab, layers)
    block = remat(functools.partial(_block, heads=heads, prec=prec))

    def loss_fn(params: Params, batch: Batch) -> jax.Array:
        x, wte = _gpt_embed(params, batch, prec)
        for p in params["blocks"]:
            x = block(p, x)
        return _gpt_head(params, x, batch, wte, prec)

    return loss_fn, params, _gpt_batch(keys, batch, seq, vocab)


def gpt_scan(seed: int = 0, *, batch: int, seq: int, d_model: int, heads: int, layers: int,
             vocab: int, dtype: str = "float32", remat: Remat = _plain) -> tuple[LossFn, Params, Batch]:
    """The GPT stack written as large JAX models are: the blocks' parameters stacked on a
    leading layer axis and one `lax.scan` over them (the same model as `gpt`, one body)."""
    keys = _Keys(seed)
    prec = Precision.of(dtype)
    params = _gpt_params(keys, d_model, seq, vocab, layers)
    params["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *params["blocks"])

    @remat
    def body(x: jax.Array, p: Params) -> tuple[jax.Array, None]:
        return _block(p, x, heads, prec=prec), None

    def loss_fn(params: Params, batch: Batch) -> jax.Array:
        x, wte = _gpt_embed(params, batch, prec)
        x, _ = jax.lax.scan(body, x, params["blocks"])
        return _gpt_head(params, x, batch, wte, prec)

    return loss_fn, params, _gpt_batch(keys, batch, seq, vocab)


def _gpt_params(keys: _Keys, d_model: int, seq: int, vocab: int, layers: int) -> Params:
    return {
        "wte": jax.random.normal(keys(), (vocab, d_model), jnp.float32) * 0.02,
        "wpe": jax.random.normal(keys(), (seq, d_model), jnp.float32) * 0.02,
        "blocks": [_block_params(keys, d_model) for _ in range(layers)],
        "ln_f": {"scale": jnp.ones((d_model,), jnp.float32), "bias": jnp.zeros((d_model,), jnp.float32)},
    }


def _gpt_batch(keys: _Keys, batch: int, seq: int, vocab: int) -> Batch:
    tokens = jax.random.randint(keys(), (batch, seq + 1), 0, vocab, jnp.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def _gpt_embed(params: Params, batch: Batch, prec: Precision) -> tuple[jax.Array, jax.Array]:
    """The token and position embeddings summed (the residual stream's start), and the
    token embedding in `prec.dtype`, cast once for the lookup and the tied logits."""
    wte = prec.weight(params["wte"])
    return wte[batch["tokens"]] + prec.weight(params["wpe"]), wte


def _gpt_head(params: Params, x: jax.Array, batch: Batch, wte: jax.Array, prec: Precision) -> jax.Array:
    """Final LayerNorm, tied-embedding logits, next-token cross-entropy."""
    x = prec.layer_norm(x, params["ln_f"])
    return prec.loss(x @ wte.T, batch["targets"])


def vit(seed: int = 0, *, batch: int, image: int, patch: int, d_model: int, heads: int, layers: int,
        classes: int, dtype: str = "float32", remat: Remat = _plain) -> tuple[LossFn, Params, Batch]:
    """Vision transformer: non-overlapping `patch` x `patch` patches of an NHWC image
    projected to `d_model` plus learned positions, `layers` pre-LN blocks with
    bidirectional attention (a Python loop), final LayerNorm, global average pool over the
    patches, a dense classifier, softmax cross-entropy. `dtype`: see the module docstring
    (the float32 images are cast to it for the patch projection)."""
    keys = _Keys(seed)
    prec = Precision.of(dtype)
    params = {
        "patch": {"w": _dense(keys, patch * patch * 3, d_model), "b": jnp.zeros((d_model,), jnp.float32)},
        "pos": jax.random.normal(keys(), ((image // patch) ** 2, d_model), jnp.float32) * 0.02,
        "blocks": [_block_params(keys, d_model) for _ in range(layers)],
        "ln_f": {"scale": jnp.ones((d_model,), jnp.float32), "bias": jnp.zeros((d_model,), jnp.float32)},
        "head": {"w": _dense(keys, d_model, classes), "b": jnp.zeros((classes,), jnp.float32)},
    }
    data = {"images": jax.random.normal(keys(), (batch, image, image, 3), jnp.float32),
            "labels": jax.random.randint(keys(), (batch,), 0, classes, jnp.int32)}
    block = remat(functools.partial(_block, heads=heads, causal=False, prec=prec))

    def loss_fn(params: Params, batch: Batch) -> jax.Array:
        b, n = batch["images"].shape[0], image // patch
        x = batch["images"].reshape(b, n, patch, n, patch, 3).transpose(0, 1, 3, 2, 4, 5)
        x = prec.weight(x.reshape(b, n * n, patch * patch * 3))
        x = prec.dense(x, params["patch"]) + prec.weight(params["pos"])
        for p in params["blocks"]:
            x = block(p, x)
        x = jnp.mean(prec.layer_norm(x, params["ln_f"]), axis=1)
        return prec.loss(prec.dense(x, params["head"]), batch["labels"])

    return loss_fn, params, data


# ----------------------------------------------------------------------------- conv net

def convnet(seed: int = 0, *, batch: int, image: int, channels: list[int],
            classes: int, remat: Remat = _plain) -> tuple[LossFn, Params, Batch]:
    """3x3 convolutions (stride 2 after the first), each followed by batch-norm with
    batch statistics (mean/variance over N, H, W; training mode) and ReLU; global average
    pool, a dense classifier, softmax cross-entropy. NHWC."""
    keys = _Keys(seed)
    layers = []
    c_in = 3
    for c_out in channels:
        w = jax.random.normal(keys(), (3, 3, c_in, c_out), jnp.float32) / math.sqrt(9 * c_in)
        layers.append({"w": w, "scale": jnp.ones((c_out,), jnp.float32),
                       "bias": jnp.zeros((c_out,), jnp.float32)})
        c_in = c_out
    params = {"convs": layers, "head": {"w": _dense(keys, c_in, classes),
                                        "b": jnp.zeros((classes,), jnp.float32)}}
    data = {"images": jax.random.normal(keys(), (batch, image, image, 3), jnp.float32),
            "labels": jax.random.randint(keys(), (batch,), 0, classes, jnp.int32)}

    stages = [remat(functools.partial(_conv_stage, stride=1 if i == 0 else 2)) for i in range(len(channels))]

    def loss_fn(params: Params, batch: Batch) -> jax.Array:
        x = batch["images"]
        for i, layer in enumerate(params["convs"]):
            x = stages[i](layer, x)
        x = jnp.mean(x, axis=(1, 2))
        return _cross_entropy(x @ params["head"]["w"] + params["head"]["b"], batch["labels"])

    return loss_fn, params, data


def _conv_stage(layer: Params, x: jax.Array, stride: int) -> jax.Array:
    x = jax.lax.conv_general_dilated(x, layer["w"], (stride, stride), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    mean = jnp.mean(x, axis=(0, 1, 2))
    var = jnp.mean(jnp.square(x - mean), axis=(0, 1, 2))
    x = (x - mean) * jax.lax.rsqrt(var + 1e-5) * layer["scale"] + layer["bias"]
    return jax.nn.relu(x)


# ----------------------------------------------------------------------------- RNN

def rnn(seed: int = 0, *, batch: int, seq: int, d_in: int, hidden: int,
        remat: Remat = _plain) -> tuple[LossFn, Params, Batch]:
    """Elman RNN, h_t = tanh(x_t Wx + h_{t-1} Wh + b), as one `lax.scan` over time;
    mean squared error of a linear readout of every h_t."""
    keys = _Keys(seed)
    params = {"wx": _dense(keys, d_in, hidden), "wh": _dense(keys, hidden, hidden) * 0.5,
              "b": jnp.zeros((hidden,), jnp.float32), "wo": _dense(keys, hidden, d_in)}
    data = {"x": jax.random.normal(keys(), (seq, batch, d_in), jnp.float32),
            "y": jax.random.normal(keys(), (seq, batch, d_in), jnp.float32)}

    def loss_fn(params: Params, batch: Batch) -> jax.Array:
        @remat
        def cell(h: jax.Array, x_t: jax.Array) -> tuple[jax.Array, jax.Array]:
            h = jnp.tanh(x_t @ params["wx"] + h @ params["wh"] + params["b"])
            return h, h

        h0 = jnp.zeros((batch["x"].shape[1], params["wh"].shape[0]), jnp.float32)
        _, hs = jax.lax.scan(cell, h0, batch["x"])
        return jnp.mean(jnp.square(hs @ params["wo"] - batch["y"]))

    return loss_fn, params, data


# ----------------------------------------------------------------------------- real Flax models

def _real_flax(name: str, seed: int, remat: Remat, **sizes: Any) -> tuple[LossFn, Params, Batch]:
    """A decoder of benchmarks/real_flax.py as a workload: its loss of (parameters, batch)."""
    if remat is not _plain:
        raise ValueError(f"{name} is built of Flax modules: there is no layer function to wrap in jax.checkpoint")
    if seed != 0:
        raise ValueError(f"{name} initializes from its own fixed keys; seed {seed} would be ignored")
    try:
        from benchmarks import real_flax  # flax: only where these kinds are built
        import flax  # noqa: F401
    except ImportError as e:
        raise ValueError(f"workload kind {name!r} needs flax (pip install flax): {e}") from None
    model = getattr(real_flax, name)(**sizes)
    assert model.functional is not None
    return model.functional()


def gemma_nnx(seed: int = 0, *, batch: int, seq: int, d_model: int, heads: int, layers: int, vocab: int,
              dtype: str = "float32", remat: Remat = _plain) -> tuple[LossFn, Params, Batch]:
    """The Gemma-style Flax NNX decoder of benchmarks/real_flax.py (needs flax), its
    parameters an `nnx.State`; `dtype` "bfloat16": the model with Flax's `dtype=`. No
    `jax.checkpoint` strategies (Flax modules, no layer function)."""
    return _real_flax("gemma_nnx", seed, remat, batch=batch, seq=seq, d_model=d_model, heads=heads,
                      layers=layers, vocab=vocab, dtype=dtype)


def decoder_linen_scan(seed: int = 0, *, batch: int, seq: int, d_model: int, heads: int, layers: int,
                       vocab: int, dtype: str = "float32", remat: Remat = _plain) -> tuple[LossFn, Params, Batch]:
    """The Flax linen decoder with `nn.scan` of benchmarks/real_flax.py (needs flax); `dtype`
    as for `gemma_nnx`."""
    return _real_flax("decoder_linen_scan", seed, remat, batch=batch, seq=seq, d_model=d_model, heads=heads,
                      layers=layers, vocab=vocab, dtype=dtype)


BUILDERS: dict[str, Callable[..., tuple[LossFn, Params, Batch]]] = {
    "mlp": mlp,
    "transformer_block": transformer_block,
    "gpt": gpt,
    "gpt_scan": gpt_scan,
    "vit": vit,
    "convnet": convnet,
    "rnn": rnn,
    "gemma_nnx": gemma_nnx,
    "decoder_linen_scan": decoder_linen_scan,
    "stack": stack,  # benchmarks/stacks.py: stacks written otherwise than `gpt`
}


def build(name: str, kind: str, sizes: dict[str, Any], seed: int = 0, remat: Remat = _plain) -> Workload:
    """Builds the workload `kind` (a key of BUILDERS) with `sizes` as keyword arguments;
    `remat` wraps each layer (see the module docstring)."""
    if kind not in BUILDERS:
        raise ValueError(f"workload {name!r}: unknown kind {kind!r}; known kinds: {sorted(BUILDERS)}")
    try:
        loss_fn, params, batch = BUILDERS[kind](seed, **sizes, remat=remat)
    except TypeError as e:
        raise ValueError(f"workload {name!r} (kind {kind!r}): bad sizes {sizes}: {e}") from None
    return Workload(name, kind, dict(sizes), loss_fn, params, batch)
