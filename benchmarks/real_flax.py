"""The Flax real-model families: a Gemma-style NNX decoder, a linen ResNet under pmap,
a linen decoder with nn.scan (benchmarks/real_models.py).

The two decoders also take `dtype` ("float32", the default, or "bfloat16"): the model as a
Flax user writes it in 16 bits, modules built with `dtype=<dtype>, param_dtype=float32`
(float32 master weights cast at use), normalization statistics, the attention softmax and
the loss in float32. At "float32" the model is the one trained in the tests, unchanged.
Each `RealModel` of these two also has `functional`: the loss as a function of
(parameters, batch), fresh parameters and a batch, which `benchmarks.workloads` makes the
workload kinds `gemma_nnx` and `decoder_linen_scan`."""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.real_common import (Loss, RealModel, Step, adamw, cross_entropy, jitted_optax_step, key_data, rope,
                                    token_batch)

__all__ = ["decoder_linen_scan", "gemma_nnx", "resnet_linen_pmap"]


def _dtype(name: str) -> Any:
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {name!r}: one of 'float32', 'bfloat16', 'float16'")
    return jnp.dtype(name)


def _logits_f32(logits: jax.Array) -> jax.Array:
    """The loss in float32 (no-op for float32 logits)."""
    return logits.astype(jnp.float32)

# ----------------------------------------------------------------------------- 1. Gemma-style NNX

def gemma_nnx(*, batch: int = 4, seq: int = 64, d_model: int = 64, heads: int = 4, layers: int = 2,
              vocab: int = 512, dtype: str = "float32") -> RealModel:
    """A Gemma-style decoder in Flax NNX: scaled token embedding, pre- and post-RMSNorm
    ((1 + scale), zero-initialized), rotary embeddings, causal attention through
    `jax.nn.dot_product_attention`, GeGLU MLP, tied logits. Step: `nnx.jit`, `nnx.Optimizer`.
    `dtype`: see the module docstring (RMSNorm in float32, its output cast back;
    `jax.nn.dot_product_attention` takes its softmax in float32 itself)."""
    from flax import nnx

    compute = _dtype(dtype)
    # Modules in 16 bits: dtype= casts the float32 parameters at use. float32: as before.
    kw: dict[str, Any] = {} if compute == jnp.float32 else {"dtype": compute, "param_dtype": jnp.float32}

    class RMSNorm(nnx.Module):
        def __init__(self, dim: int) -> None:
            self.scale = nnx.Param(jnp.zeros((dim,), jnp.float32))

        def __call__(self, x: jax.Array) -> jax.Array:
            x32 = x.astype(jnp.float32)  # the statistics in float32 (float32 x: no-op)
            y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6) * (1 + self.scale[...])
            return y.astype(x.dtype)

    class Attention(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.heads = heads
            self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, rngs=rngs, **kw)
            self.out = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs, **kw)

        def __call__(self, x: jax.Array) -> jax.Array:
            b, t, d = x.shape
            q, k, v = (z.reshape(b, t, self.heads, d // self.heads) for z in jnp.split(self.qkv(x), 3, -1))
            o = jax.nn.dot_product_attention(rope(q), rope(k), v, is_causal=True)
            return self.out(o.reshape(b, t, d))

    class GeGLU(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.gate = nnx.Linear(d_model, 4 * d_model, use_bias=False, rngs=rngs, **kw)
            self.up = nnx.Linear(d_model, 4 * d_model, use_bias=False, rngs=rngs, **kw)
            self.down = nnx.Linear(4 * d_model, d_model, use_bias=False, rngs=rngs, **kw)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.down(jax.nn.gelu(self.gate(x)) * self.up(x))

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.pre_attn, self.post_attn = RMSNorm(d_model), RMSNorm(d_model)
            self.pre_mlp, self.post_mlp = RMSNorm(d_model), RMSNorm(d_model)
            self.attn, self.mlp = Attention(rngs), GeGLU(rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            x = x + self.post_attn(self.attn(self.pre_attn(x)))
            return x + self.post_mlp(self.mlp(self.pre_mlp(x)))

    class Decoder(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(vocab, d_model, rngs=rngs, **kw)
            self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
            self.norm = RMSNorm(d_model)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = self.embed(tokens) * math.sqrt(d_model)
            for block in self.blocks:
                x = block(x)
            return self.embed.attend(self.norm(x))

    @nnx.jit  # one program, not one compilation per initializer op
    def create() -> tuple[Decoder, nnx.Optimizer]:
        model = Decoder(nnx.Rngs(0))
        return model, nnx.Optimizer(model, adamw(), wrt=nnx.Param)

    def init() -> tuple[Any, Any, tuple[jax.Array, jax.Array]]:
        return *create(), token_batch(batch, seq, vocab)

    def loss(model: Decoder, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        tokens, targets = batch
        return cross_entropy(_logits_f32(model(tokens)), targets)

    def make_step(loss_fn: Loss) -> Step:
        @nnx.jit
        def train_step(model: Decoder, optimizer: nnx.Optimizer, batch: Any) -> jax.Array:
            value, grads = nnx.value_and_grad(loss_fn)(model, batch)
            optimizer.update(model, grads)
            return value

        def run(state: Any) -> tuple[Any, jax.Array]:
            return state, train_step(*state)
        return Step(run, lambda state: train_step.lower(*state))

    def arrays(state: Any) -> Any:
        model, optimizer, _ = state
        return key_data(nnx.to_pure_dict(nnx.state((model, optimizer))))

    def functional() -> tuple[Loss, Any, Any]:
        """The loss of (the model's parameters, a batch): the module graph split off once,
        merged again with the traced parameters inside the loss."""
        graphdef, params = nnx.split(nnx.jit(lambda: Decoder(nnx.Rngs(0)))())
        return (lambda params, batch: loss(nnx.merge(graphdef, params), batch)), params, \
            token_batch(batch, seq, vocab)

    return RealModel("gemma_nnx", "flax.nnx, nnx.jit", init, loss, make_step, arrays, functional)


# ----------------------------------------------------------------------------- 2. linen ResNet under pmap

AXIS = "batch"  # the pmap axis: gradients, the loss and BatchNorm statistics are averaged over it


def resnet_linen_pmap(*, batch: int = 16, size: int = 16, channels: int = 16, blocks: int = 2,
                      classes: int = 10) -> RealModel:
    """A ResNet in Flax linen: conv stem, `blocks` residual blocks (conv-BN-relu-conv-BN, the
    second BN zero-initialized), global average pool, dense head. BatchNorm statistics are
    the mutable `batch_stats` collection, averaged over the pmap axis; the step is
    `jax.pmap` over a leading device axis of size 1, as Flax's ImageNet example trains."""
    import flax.linen as nn
    from flax import jax_utils

    norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9, axis_name=AXIS)

    class ResBlock(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            y = nn.relu(norm()(nn.Conv(channels, (3, 3), use_bias=False)(x)))
            y = norm(scale_init=nn.initializers.zeros)(nn.Conv(channels, (3, 3), use_bias=False)(y))
            return nn.relu(x + y)

    class ResNet(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.relu(norm()(nn.Conv(channels, (3, 3), use_bias=False)(x)))
            for _ in range(blocks):
                x = ResBlock()(x)
            return nn.Dense(classes)(jnp.mean(x, axis=(1, 2)))

    model, tx = ResNet(), adamw()

    @jax.jit  # one program, not one compilation per initializer op
    def create(key: jax.Array) -> tuple[Any, ...]:
        k_init, k_x, k_y = jax.random.split(key, 3)
        images = jax.random.normal(k_x, (batch, size, size, 3), jnp.float32)
        labels = jax.random.randint(k_y, (batch,), 0, classes, jnp.int32)
        variables = model.init(k_init, images)
        params = variables["params"]
        return params, variables["batch_stats"], tx.init(params), images, labels

    def init() -> tuple[Any, ...]:
        state = create(jax.random.key(0))
        # One device. The axis name is the step's: pmap's outputs are laid out on a mesh
        # with that name, and inputs on another one would compile the second step again.
        return jax_utils.replicate(state, devices=jax.local_devices()[:1], axis_name=AXIS)

    def loss(params: Any, batch_stats: Any, images: jax.Array, labels: jax.Array) -> tuple[jax.Array, Any]:
        logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, images,
                                      mutable=["batch_stats"])
        return cross_entropy(logits, labels), updates["batch_stats"]

    def make_step(loss_fn: Loss) -> Step:
        import optax

        @functools.partial(jax.pmap, axis_name=AXIS)
        def train_step(params: Any, batch_stats: Any, opt_state: Any, images: jax.Array,
                       labels: jax.Array) -> tuple[Any, ...]:
            (value, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, batch_stats, images, labels)
            grads, value = jax.lax.pmean((grads, value), AXIS)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), batch_stats, opt_state, value

        def run(state: Any) -> tuple[Any, jax.Array]:
            params, batch_stats, opt_state, value = train_step(*state)
            return (params, batch_stats, opt_state, *state[3:]), value[0]
        return Step(run, lambda state: train_step.lower(*state))

    return RealModel("resnet_linen_pmap", "flax.linen, jax.pmap", init, loss, make_step,
                     lambda state: key_data(state[:3]))


# ----------------------------------------------------------------------------- 3. linen decoder, nn.scan

def decoder_linen_scan(*, batch: int = 4, seq: int = 64, d_model: int = 64, heads: int = 4,
                       layers: int = 4, vocab: int = 512, dtype: str = "float32") -> RealModel:
    """A pre-LN decoder in Flax linen whose `layers` blocks are one `nn.scan` (parameters
    stacked on a leading layer axis): `nn.MultiHeadDotProductAttention` with a causal mask, GELU MLP,
    learned positions, untied head. Step: `jax.jit` of an optax update. `dtype`: see the
    module docstring (`nn.LayerNorm` keeps its statistics in float32 itself; the attention
    is `jax.nn.dot_product_attention`, softmax in float32, the probabilities in `dtype` for
    the value matmul: Flax's own `force_fp32_for_softmax` leaves them float32, and that
    matmul with them)."""
    import flax.linen as nn

    compute = _dtype(dtype)
    kw: dict[str, Any] = {} if compute == jnp.float32 else {"dtype": compute, "param_dtype": jnp.float32}
    attend: dict[str, Any] = {} if compute == jnp.float32 else {"attention_fn": _attention_fp32_softmax}

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
            attention = nn.MultiHeadDotProductAttention(num_heads=heads, use_bias=False, deterministic=True,
                                                        **kw, **attend)
            x = x + attention(nn.LayerNorm(**kw)(x), mask=mask)
            h = nn.gelu(nn.Dense(4 * d_model, **kw)(nn.LayerNorm(**kw)(x)))
            return x + nn.Dense(d_model, **kw)(h), None

    class Decoder(nn.Module):
        @nn.compact
        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = nn.Embed(vocab, d_model, **kw)(tokens)
            x = x + self.param("positions", nn.initializers.normal(0.02), (seq, d_model)).astype(x.dtype)
            stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=layers)
            x, _ = stack()(x, None)
            return nn.Dense(vocab, use_bias=False, **kw)(nn.LayerNorm(**kw)(x))

    model, tx = Decoder(), adamw()

    @jax.jit
    def create(key: jax.Array, tokens: jax.Array) -> tuple[Any, Any]:
        params = model.init(key, tokens)["params"]
        return params, tx.init(params)

    def init() -> tuple[Any, ...]:
        batch_ = token_batch(batch, seq, vocab)
        return *create(jax.random.key(0), batch_[0]), batch_

    def loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        tokens, targets = batch
        return cross_entropy(_logits_f32(model.apply({"params": params}, tokens)), targets)

    make_step = functools.partial(jitted_optax_step, tx=tx)

    def functional() -> tuple[Loss, Any, Any]:
        batch_ = token_batch(batch, seq, vocab)
        return loss, jax.jit(model.init)(jax.random.key(0), batch_[0])["params"], batch_

    return RealModel("decoder_linen_scan", "flax.linen nn.scan, jax.jit", init, loss, make_step,
                     lambda state: key_data(state[:2]), functional)


def _attention_fp32_softmax(query: jax.Array, key: jax.Array, value: jax.Array, bias: Any = None,
                            mask: Any = None, **_: Any) -> jax.Array:
    """`nn.MultiHeadDotProductAttention`'s `attention_fn` for a 16-bit model:
    `jax.nn.dot_product_attention` (logits and softmax in float32, the probabilities in the
    inputs' dtype for the value matmul). No dropout (the decoder is deterministic)."""
    return jax.nn.dot_product_attention(query, key, value, bias=bias,
                                        mask=None if mask is None else mask.astype(jnp.bool_))


