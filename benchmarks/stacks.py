"""Transformer stacks written otherwise than `workloads.gpt`: models the budget's candidate
plans were not shaped on, to check that budgets cover the `jax.checkpoint` policies there
too (config/stacks.toml).

`stack` builds `layers` pre-norm blocks on (batch, seq, d_model) float32 activations, with
no embedding and no vocabulary head (the loss is the mean squared error to a target), and
attention written as many JAX users write it: heads transposed to (batch, heads, seq,
head_dim) and multiplied with `@`. Each choice is a size a suite can set:

- `qkv`: "separate" (three projections) or "fused" (one, split in three);
- `bias`: projections with biases or without;
- `norm`: "layer" (LayerNorm) or "rms" (RMSNorm, a scale only);
- `mlp`: "gelu" (tanh-GELU, 4x) or "swiglu" (SiLU-gated, about 8/3 x, rounded to 128);
- `rotary`: rotary position embeddings on the queries and keys;
- `causal`: a causal mask, or none.

`remat` wraps each block (the `jax.checkpoint` strategies), as in `workloads`.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

__all__ = ["stack"]

Params = dict[str, Any]


def _rms_norm(x: jax.Array, p: Params, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * p["scale"]


def _layer_norm(x: jax.Array, p: Params, eps: float = 1e-5) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def _linear(x: jax.Array, p: Params) -> jax.Array:
    return x @ p["w"] + p["b"] if "b" in p else x @ p["w"]


def _rotate(x: jax.Array) -> jax.Array:
    """Rotary position embedding of (batch, heads, seq, head_dim) queries or keys."""
    t, dh = x.shape[-2], x.shape[-1]
    freq = 1.0 / 10000 ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)
    angle = jnp.arange(t, dtype=jnp.float32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _block(p: Params, x: jax.Array, *, heads: int, norm: str, mlp: str, rotary: bool, causal: bool) -> jax.Array:
    b, t, d = x.shape
    dh = d // heads
    normalize = _rms_norm if norm == "rms" else _layer_norm
    h = normalize(x, p["norm1"])
    if "qkv" in p:
        q, k, v = jnp.split(_linear(h, p["qkv"]), 3, axis=-1)
    else:
        q, k, v = (_linear(h, p[name]) for name in ("q", "k", "v"))
    q, k, v = (z.reshape(b, t, heads, dh).transpose(0, 2, 1, 3) for z in (q, k, v))
    if rotary:
        q, k = _rotate(q), _rotate(k)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh)
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((t, t), jnp.bool_)), scores, jnp.finfo(scores.dtype).min)
    o = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + _linear(o, p["out"])
    h = normalize(x, p["norm2"])
    if mlp == "swiglu":
        h = jax.nn.silu(_linear(h, p["gate"])) * _linear(h, p["up"])
    else:
        h = jax.nn.gelu(_linear(h, p["up"]), approximate=True)
    return x + _linear(h, p["down"])


def _params(key: jax.Array, d: int, *, qkv: str, bias: bool, norm: str, mlp: str) -> Params:
    keys = iter(jax.random.split(key, 8))

    def dense(fan_in: int, fan_out: int) -> Params:
        p = {"w": jax.random.normal(next(keys), (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)}
        return {**p, "b": jnp.zeros((fan_out,), jnp.float32)} if bias else p

    def norm_params() -> Params:
        p = {"scale": jnp.ones((d,), jnp.float32)}
        return p if norm == "rms" else {**p, "bias": jnp.zeros((d,), jnp.float32)}
    d_ff = 128 * math.ceil(8 * d / 3 / 128) if mlp == "swiglu" else 4 * d
    p = {"norm1": norm_params(), "norm2": norm_params(), "out": dense(d, d), "up": dense(d, d_ff),
         "down": dense(d_ff, d)}
    p.update({"qkv": dense(d, 3 * d)} if qkv == "fused" else {name: dense(d, d) for name in ("q", "k", "v")})
    if mlp == "swiglu":
        p["gate"] = dense(d, d_ff)
    return p


_CHOICES = {"qkv": ("separate", "fused"), "norm": ("layer", "rms"), "mlp": ("gelu", "swiglu")}


def stack(seed: int = 0, *, batch: int, seq: int, d_model: int, heads: int, layers: int, qkv: str = "separate",
          bias: bool = False, norm: str = "layer", mlp: str = "gelu", rotary: bool = False, causal: bool = False,
          remat: Callable[[Callable[..., Any]], Callable[..., Any]] = lambda f: f
          ) -> tuple[Callable[[Params, Params], jax.Array], Params, Params]:
    """`layers` pre-norm blocks written as the module docstring says."""
    for name, value in (("qkv", qkv), ("norm", norm), ("mlp", mlp)):
        if value not in _CHOICES[name]:
            raise ValueError(f"stack: {name} must be one of {list(_CHOICES[name])}; got {value!r}")
    if d_model % heads or (rotary and (d_model // heads) % 2):
        raise ValueError(f"stack: d_model {d_model} must split into {heads} heads (of an even size with rotary)")
    key = jax.random.key(seed)
    keys = jax.random.split(key, layers + 2)
    params = {"blocks": [_params(keys[i], d_model, qkv=qkv, bias=bias, norm=norm, mlp=mlp) for i in range(layers)]}
    batch_data = {"x": jax.random.normal(keys[-2], (batch, seq, d_model), jnp.float32),
                  "y": jax.random.normal(keys[-1], (batch, seq, d_model), jnp.float32)}
    block = remat(functools.partial(_block, heads=heads, norm=norm, mlp=mlp, rotary=rotary, causal=causal))

    def loss_fn(params: Params, batch: Params) -> jax.Array:
        x = batch["x"]
        for p in params["blocks"]:
            x = block(p, x)
        return jnp.mean(jnp.square(x - batch["y"]))

    return loss_fn, params, batch_data
