"""The Equinox ViT and the decoder with a custom_vjp blockwise attention
(benchmarks/real_models.py)."""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import workloads
from benchmarks.real_common import Loss, RealModel, Step, adamw, cross_entropy, jitted_optax_step, key_data, token_batch

__all__ = ["flash_attention", "gpt_flash_custom_vjp", "reference_attention", "vit_equinox"]

# ----------------------------------------------------------------------------- 4. Equinox ViT

def vit_equinox(*, batch: int = 8, size: int = 32, patch: int = 4, d_model: int = 64, heads: int = 4,
                layers: int = 2, classes: int = 10) -> RealModel:
    """A ViT in Equinox: patches cut with the static int `patch`, a linear patch embedding,
    learned positions, pre-LN blocks whose attention reshapes with the static int `heads`,
    mean pooling, linear head. Step: `eqx.filter_jit` of `eqx.filter_value_and_grad`."""
    import equinox as eqx

    class Block(eqx.Module):
        heads: int
        norm1: eqx.nn.LayerNorm
        qkv: eqx.nn.Linear
        out: eqx.nn.Linear
        norm2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key: jax.Array) -> None:
            k1, k2, k3 = jax.random.split(key, 3)
            self.heads = heads
            self.norm1, self.norm2 = eqx.nn.LayerNorm(d_model), eqx.nn.LayerNorm(d_model)
            self.qkv = eqx.nn.Linear(d_model, 3 * d_model, use_bias=False, key=k1)
            self.out = eqx.nn.Linear(d_model, d_model, key=k2)
            self.mlp = eqx.nn.MLP(d_model, d_model, 4 * d_model, 1, activation=jax.nn.gelu, key=k3)

        def __call__(self, x: jax.Array) -> jax.Array:  # (tokens, d_model)
            t, d = x.shape
            qkv = jax.vmap(self.qkv)(jax.vmap(self.norm1)(x))
            q, k, v = (z.reshape(t, self.heads, d // self.heads) for z in jnp.split(qkv, 3, -1))
            scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(d // self.heads)
            o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v).reshape(t, d)
            x = x + jax.vmap(self.out)(o)
            return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))

    class ViT(eqx.Module):
        patch: int
        embed: eqx.nn.Linear
        positions: jax.Array
        blocks: list[Block]
        norm: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key: jax.Array) -> None:
            keys = jax.random.split(key, layers + 3)
            self.patch = patch
            self.embed = eqx.nn.Linear(3 * patch * patch, d_model, key=keys[0])
            self.positions = 0.02 * jax.random.normal(keys[1], ((size // patch) ** 2, d_model))
            self.blocks = [Block(k) for k in keys[3:]]
            self.norm = eqx.nn.LayerNorm(d_model)
            self.head = eqx.nn.Linear(d_model, classes, key=keys[2])

        def __call__(self, image: jax.Array) -> jax.Array:  # (channels, height, width)
            c, h, w = image.shape
            p = self.patch
            x = image.reshape(c, h // p, p, w // p, p).transpose(1, 3, 2, 4, 0).reshape(-1, p * p * c)
            x = jax.vmap(self.embed)(x) + self.positions
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(jnp.mean(x, axis=0)))

    tx = adamw()

    @eqx.filter_jit
    def create(key: jax.Array) -> tuple[Any, ...]:
        k_model, k_x, k_y = jax.random.split(key, 3)
        model = ViT(k_model)
        images = jax.random.normal(k_x, (batch, 3, size, size), jnp.float32)
        labels = jax.random.randint(k_y, (batch,), 0, classes, jnp.int32)
        return model, tx.init(eqx.filter(model, eqx.is_inexact_array)), images, labels

    def init() -> tuple[Any, ...]:
        return create(jax.random.key(0))

    def loss(model: ViT, images: jax.Array, labels: jax.Array) -> jax.Array:
        return cross_entropy(jax.vmap(model)(images), labels)

    def make_step(loss_fn: Loss) -> Step:
        @eqx.filter_jit
        def train_step(model: ViT, opt_state: Any, images: jax.Array, labels: jax.Array) -> tuple[Any, Any, jax.Array]:
            value, grads = eqx.filter_value_and_grad(loss_fn)(model, images, labels)
            updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
            return eqx.apply_updates(model, updates), opt_state, value

        def run(state: Any) -> tuple[Any, jax.Array]:
            model, opt_state, value = train_step(*state)
            return (model, opt_state, *state[2:]), value
        # `eqx.filter_jit`'s lowering wraps JAX's (whose compiled form has the memory analysis).
        return Step(run, lambda state: train_step.lower(*state).lowered)

    def arrays(state: Any) -> Any:
        return key_data(eqx.filter(state[:2], eqx.is_array))

    return RealModel("vit_equinox", "equinox, eqx.filter_jit", init, loss, make_step, arrays)


# ----------------------------------------------------------------------------- 5. custom_vjp attention

def _blocks(x: jax.Array, block: int) -> jax.Array:
    """(b, h, t, d) -> (t // block, b, h, block, d): key/value blocks to scan over."""
    b, h, t, d = x.shape
    return jnp.moveaxis(x.reshape(b, h, t // block, block, d), 2, 0)


def _block_scores(q: jax.Array, kj: jax.Array, j: jax.Array, block: int) -> jax.Array:
    """Causal scaled scores of every query against key block `j`: (b, h, t, block)."""
    t = q.shape[2]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, kj) * q.shape[-1] ** -0.5
    visible = jnp.arange(t)[:, None] >= j * block + jnp.arange(block)[None, :]
    return jnp.where(visible, s, -jnp.inf)


def _flash_forward(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Online softmax over key blocks: (output, log-sum-exp); no (t, t) matrix is formed.
    Block 0 holds key 0, which every query sees, so the running max is finite after it."""
    b, h, t, d = q.shape

    def body(carry: tuple[jax.Array, ...], xs: tuple[jax.Array, ...]) -> tuple[tuple[jax.Array, ...], None]:
        m, l, acc = carry
        kj, vj, j = xs
        s = _block_scores(q, kj, j, block)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        correction = jnp.exp(m - m_new)
        l = l * correction + jnp.sum(p, axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("bhqk,bhkd->bhqd", p, vj)
        return (m_new, l, acc), None

    init = (jnp.full((b, h, t), -jnp.inf, q.dtype), jnp.zeros((b, h, t), q.dtype), jnp.zeros_like(q))
    (m, l, acc), _ = jax.lax.scan(body, init, (_blocks(k, block), _blocks(v, block), jnp.arange(t // block)))
    return acc / l[..., None], m + jnp.log(l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> jax.Array:
    """Causal attention of (batch, heads, seq, head_dim) arrays, blockwise over keys
    (`block` divides seq), with its own backward that recomputes each block's scores."""
    return _flash_forward(q, k, v, block)[0]


def _flash_fwd(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    out, lse = _flash_forward(q, k, v, block)
    return out, (q, k, v, out, lse)


def _flash_bwd(block: int, residuals: tuple[jax.Array, ...], d_out: jax.Array) -> tuple[jax.Array, ...]:
    q, k, v, out, lse = residuals
    b, h, t, d = q.shape
    delta = jnp.sum(d_out * out, axis=-1)  # rowwise sum of softmax * its cotangent

    def body(dq: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        kj, vj, j = xs
        p = jnp.exp(_block_scores(q, kj, j, block) - lse[..., None])
        dv = jnp.einsum("bhqk,bhqd->bhkd", p, d_out)
        ds = p * (jnp.einsum("bhqd,bhkd->bhqk", d_out, vj) - delta[..., None]) * d ** -0.5
        return dq + jnp.einsum("bhqk,bhkd->bhqd", ds, kj), (jnp.einsum("bhqk,bhqd->bhkd", ds, q), dv)

    dq, (dk, dv) = jax.lax.scan(body, jnp.zeros_like(q), (_blocks(k, block), _blocks(v, block),
                                                          jnp.arange(t // block)))
    unblock = lambda x: jnp.moveaxis(x, 0, 2).reshape(b, h, t, d)  # noqa: E731
    return dq, unblock(dk), unblock(dv)


flash_attention.defvjp(_flash_fwd, _flash_bwd)


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention of (batch, heads, seq, head_dim) arrays, written plainly."""
    t = q.shape[2]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), jnp.bool_)), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def gpt_flash_custom_vjp(*, batch: int = 4, seq: int = 64, d_model: int = 64, heads: int = 4,
                         layers: int = 2, vocab: int = 512, block: int = 16) -> RealModel:
    """A GPT-style decoder in plain JAX (a dict of parameters) whose attention is
    `flash_attention`, a `jax.custom_vjp`; pre-LN blocks, GELU MLP, tied logits. Step:
    `jax.jit` of an optax update."""

    def dense(key: jax.Array, fan_in: int, fan_out: int) -> jax.Array:
        return jax.random.normal(key, (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)

    def ln() -> dict[str, jax.Array]:
        return {"scale": jnp.ones((d_model,), jnp.float32), "bias": jnp.zeros((d_model,), jnp.float32)}

    def layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        return workloads.layer_norm(x, p["scale"], p["bias"])

    def init_params(key: jax.Array) -> dict[str, Any]:
        keys = iter(jax.random.split(key, 2 + 4 * layers))
        return {
            "wte": 0.02 * jax.random.normal(next(keys), (vocab, d_model), jnp.float32),
            "wpe": 0.02 * jax.random.normal(next(keys), (seq, d_model), jnp.float32),
            "blocks": [{"ln1": ln(), "qkv": dense(next(keys), d_model, 3 * d_model),
                        "proj": dense(next(keys), d_model, d_model), "ln2": ln(),
                        "fc1": dense(next(keys), d_model, 4 * d_model),
                        "fc2": dense(next(keys), 4 * d_model, d_model)} for _ in range(layers)],
            "ln_f": ln(),
        }

    def attention(p: dict[str, Any], x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = (z.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3)
                   for z in jnp.split(layer_norm(x, p["ln1"]) @ p["qkv"], 3, -1))
        o = flash_attention(q, k, v, block).transpose(0, 2, 1, 3).reshape(b, t, d)
        return o @ p["proj"]

    tx = adamw()

    @jax.jit
    def create(key: jax.Array) -> tuple[Any, Any]:
        params = init_params(key)
        return params, tx.init(params)

    def init() -> tuple[Any, ...]:
        return *create(jax.random.key(0)), token_batch(batch, seq, vocab)

    def loss(params: dict[str, Any], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        tokens, targets = batch
        x = params["wte"][tokens] + params["wpe"]
        for p in params["blocks"]:
            x = x + attention(p, x)
            x = x + jax.nn.gelu(layer_norm(x, p["ln2"]) @ p["fc1"]) @ p["fc2"]
        return cross_entropy(layer_norm(x, params["ln_f"]) @ params["wte"].T, targets)

    make_step = functools.partial(jitted_optax_step, tx=tx)

    return RealModel("gpt_flash_custom_vjp", "jax, custom_vjp attention, jax.jit", init, loss, make_step,
                     lambda state: key_data(state[:2]))


