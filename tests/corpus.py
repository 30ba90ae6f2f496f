"""A corpus of small JAX programs for checking aotgrad against JAX itself.

Each `Program` is a plain (undecorated) function plus a deterministic argument builder.
`argnums` are the positional arguments to differentiate; `static_argnums` are passed to
`aotgrad.compile` (and closed over wherever the test traces the arguments);
`make_kwargs`, when given, builds keyword arguments that are passed but not differentiated.
Shapes are tiny so the whole corpus runs in seconds on a small CPU.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["Program", "PROGRAMS", "BY_NAME"]

F32 = dict(rtol=1e-5, atol=1e-5)
F32_LOOSE = dict(rtol=1e-4, atol=1e-5)  # deep reductions / matmul chains (XLA may reassociate)
BF16 = dict(rtol=2e-2, atol=2e-2)


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    fn: Callable[..., Any]
    make_args: Callable[[], tuple]
    argnums: int | tuple[int, ...]
    rtol: float
    atol: float
    static_argnums: tuple[int, ...] = ()
    make_kwargs: Callable[[], dict] | None = None

    def __repr__(self) -> str:
        return f"Program({self.name})"


def _normal(seed: int, *shapes: tuple[int, ...], dtype: Any = np.float32, scale: float = 1.0) -> list:
    rng = np.random.default_rng(seed)
    return [jnp.asarray((scale * rng.standard_normal(s)).astype(np.float32), dtype) for s in shapes]


def _uniform(seed: int, shape: tuple[int, ...], lo: float, hi: float) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).uniform(lo, hi, shape).astype(np.float32))


# ----------------------------------------------------------------------------- shared pieces

def _layer_norm(x, g, b, eps=1e-5):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + eps) * g + b


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + jnp.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def _softmax(x, axis=-1):
    z = x - lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    e = jnp.exp(z)
    return e / jnp.sum(e, axis=axis, keepdims=True)


# ----------------------------------------------------------------------------- programs

def mlp(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    h = jax.nn.relu(h @ params["w2"] + params["b2"])
    pred = h @ params["w3"]
    return jnp.mean(jnp.square(pred - y))


def mlp_args():
    w1, b1, w2, b2, w3, x, y = _normal(1, (6, 16), (16,), (16, 16), (16,), (16, 3), (8, 6), (8, 3), scale=0.5)
    return dict(w1=w1, b1=b1, w2=w2, b2=b2, w3=w3), x, y


D, H, T, B, FF = 16, 2, 8, 2, 32


def transformer_block(p, x):
    """Pre-LN block: LN -> causal multi-head self-attention -> residual; LN -> GELU MLP -> residual."""
    bsz, t, d = x.shape
    dh = d // H
    h = _layer_norm(x, p["ln1_g"], p["ln1_b"])
    q = (h @ p["wq"]).reshape(bsz, t, H, dh)
    k = (h @ p["wk"]).reshape(bsz, t, H, dh)
    v = (h @ p["wv"]).reshape(bsz, t, H, dh)
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(dh)
    causal = jnp.tril(jnp.ones((t, t), bool))
    s = jnp.where(causal, s, -1e9)
    a = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhts,bshd->bthd", a, v).reshape(bsz, t, d)
    x = x + o @ p["wo"]
    h = _layer_norm(x, p["ln2_g"], p["ln2_b"])
    x = x + _gelu_tanh(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return x


def transformer_args():
    ws = _normal(2, (D, D), (D, D), (D, D), (D, D), (D, FF), (FF,), (FF, D), (D,), (B, T, D), scale=0.3)
    wq, wk, wv, wo, w1, b1, w2, b2, x = ws
    g1, g2 = 1.0 + 0.1 * _normal(3, (D,), (D,))[0], 1.0 + 0.1 * _normal(4, (D,))[0]
    p = dict(ln1_g=g1, ln1_b=jnp.zeros(D), wq=wq, wk=wk, wv=wv, wo=wo,
             ln2_g=g2, ln2_b=jnp.full((D,), 0.1), w1=w1, b1=b1, w2=w2, b2=b2)
    return p, x


_CONV_DN = ("NHWC", "HWIO", "NHWC")


def convnet_bn(params, x, labels):
    """conv -> batch-norm (batch statistics) -> relu -> strided conv -> global pool -> CE loss."""
    h = lax.conv_general_dilated(x, params["c1"], (1, 1), "SAME", dimension_numbers=_CONV_DN)
    mean = jnp.mean(h, axis=(0, 1, 2))
    var = jnp.var(h, axis=(0, 1, 2))
    h = (h - mean) * lax.rsqrt(var + 1e-5) * params["gamma"] + params["beta"]
    h = jax.nn.relu(h)
    h = lax.conv_general_dilated(h, params["c2"], (2, 2), ((1, 1), (1, 1)), dimension_numbers=_CONV_DN,
                                 rhs_dilation=(1, 1))
    h = jnp.mean(h, axis=(1, 2))
    logits = h @ params["dense"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def convnet_args():
    c1, c2, dense, x = _normal(5, (3, 3, 3, 8), (3, 3, 8, 8), (8, 4), (4, 8, 8, 3), scale=0.4)
    params = dict(c1=c1, c2=c2, dense=dense, gamma=jnp.ones(8) * 1.1, beta=jnp.full((8,), 0.05))
    return params, x, jnp.array([0, 3, 1, 2], jnp.int32)


def layer_norm(x, g, b):
    return _layer_norm(x, g, b)


def layer_norm_args():
    x, g, b = _normal(6, (5, 12), (12,), (12,))
    return x * 2.0 + 0.5, 1.0 + 0.1 * g, b


def softmax(x):
    return jax.nn.softmax(x, axis=-1)


def logsumexp(x, w):
    return jax.nn.logsumexp(x * w, axis=1)


def scan_rnn(params, xs, h0):
    def step(h, x):
        h = jnp.tanh(h @ params["wh"] + x @ params["wx"] + params["b"])
        return h, h @ params["wo"]
    h_last, ys = lax.scan(step, h0, xs)
    return h_last, ys


def scan_rnn_args():
    wh, wx, b, wo, xs, h0 = _normal(7, (6, 6), (3, 6), (6,), (6, 2), (5, 4, 3), (4, 6), scale=0.5)
    return dict(wh=wh, wx=wx, b=b, wo=wo), xs, h0


def cond(x, w):
    def pos(x, w):
        return jnp.sin(x) @ w
    def neg(x, w):
        return jnp.cos(x) @ (w * w)
    a = lax.cond(jnp.sum(x) > 0, pos, neg, x, w)
    b = lax.cond(jnp.sum(x) < 0, pos, neg, x * 2.0, w)  # the other branch
    return a + b


def cond_args():
    x, w = _normal(8, (4, 5), (5, 3))
    return jnp.abs(x) + 0.1, w


def gather_scatter(x, idx, v):
    g = x[idx]  # gather rows (with a duplicate index)
    s = x.at[idx].add(v)  # scatter-add (duplicates accumulate)
    c = x[:, jnp.array([2, 0])]
    return jnp.sum(jnp.sin(g)) + jnp.sum(s * s) + jnp.sum(jnp.exp(c))


def gather_scatter_args():
    x, v = _normal(9, (6, 4), (3, 4))
    return x, jnp.array([4, 1, 4], jnp.int32), v


def cumsum_cumprod(x, y):
    return jnp.cumsum(x, axis=0), jnp.cumprod(y, axis=1), lax.cumsum(x * y, axis=1, reverse=True)


def cumsum_cumprod_args():
    return _normal(10, (4, 5))[0], _uniform(11, (4, 5), 0.5, 1.5)


def sort(x, w):
    s = jnp.sort(x, axis=-1)
    keys, vals = lax.sort((x[0], w[0]), num_keys=1)
    return s * w, vals * jnp.sin(keys)


def pool_max(x, w):
    y = lax.reduce_window(x * w, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    return y


def pool_avg(x):
    s = lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
    return s / 9.0


def attention(q, k, v, lengths):
    """Scaled dot-product attention with a key-padding mask from integer lengths."""
    s = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(q.shape[-1])
    mask = jnp.arange(k.shape[1])[None, None, :] < lengths[:, None, None]
    s = jnp.where(mask, s, -1e9)
    return jnp.einsum("bqk,bkd->bqd", _softmax(s), v)


def attention_args():
    q, k, v = _normal(12, (2, 5, 8), (2, 6, 8), (2, 6, 8))
    return q, k, v, jnp.array([6, 3], jnp.int32)


def conv_transpose(x, w, b):
    y = lax.conv_transpose(x, w, (2, 2), "SAME", dimension_numbers=_CONV_DN)
    return jnp.tanh(y + b)


@jax.custom_jvp
def _softplus(x):
    return jnp.logaddexp(x, 0.0)


@_softplus.defjvp
def _softplus_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _softplus(x), jax.nn.sigmoid(x) * t


@jax.custom_jvp
def _round_ste(x):
    return jnp.round(x * 4.0) / 4.0


@_round_ste.defjvp
def _round_ste_jvp(primals, tangents):  # straight-through: autodiff of round would give 0
    (x,), (t,) = primals, tangents
    return _round_ste(x), t


def custom_jvp(x, w):
    return jnp.sum(_softplus(x @ w) * _round_ste(x @ w) ** 2)


@jax.custom_vjp
def _tanh_clipgrad(x, s):
    return jnp.tanh(x) * s


def _tanh_clipgrad_fwd(x, s):
    y = jnp.tanh(x)
    return y * s, (y, s)


def _tanh_clipgrad_bwd(res, g):  # clipped: differs from the true derivative on purpose
    y, s = res
    return jnp.clip(g * (1.0 - y * y) * s, -0.1, 0.1), jnp.sum(g * y)


_tanh_clipgrad.defvjp(_tanh_clipgrad_fwd, _tanh_clipgrad_bwd)


def custom_vjp(x, w, s):
    return _tanh_clipgrad(x @ w, s) + x @ w


def dropout(x, w, key):
    h = jnp.tanh(x @ w)
    keep = jax.random.bernoulli(key, 0.7, h.shape)
    h = jnp.where(keep, h / 0.7, 0.0)
    return jnp.sum(h * h)


def dropout_args():
    x, w = _normal(13, (6, 5), (5, 7))
    return x, w, jax.random.key(42)


def dropout_raw_key(x, key):
    keep = jax.random.bernoulli(key, 0.5, x.shape)
    return jnp.where(keep, jnp.sin(x), x * 3.0)


def checkpointed(x, w1, w2):
    @jax.checkpoint
    def block(h, w):
        return jnp.sin(h @ w) * jnp.tanh(h)

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    def block2(h, w):
        return jnp.exp(-jnp.square(h @ w)) + h
    return jnp.sum(block2(block(x, w1), w2) ** 2)


def nested_jit(x, w):
    @jax.jit
    def inner(a, b):
        return jnp.tanh(a @ b)

    @functools.partial(jax.jit, static_argnums=1)
    def power(a, n):
        return a ** n
    return power(inner(inner(x, w), w.T), 3) + inner(x, w.T @ w)


class Point(NamedTuple):
    x: Any
    y: Any


def pytree_io(tree, scale):
    a0, (a1, a2) = tree["a"]
    p = tree["p"]
    r = jnp.sqrt(p.x ** 2 + p.y ** 2 + 1.0)
    return {"pt": Point(p.x / r, p.y * scale), "list": [a0 * a1, (jnp.sum(a2) * scale,)], "r": r}


def pytree_io_args():
    a0, a1, a2, px, py = _normal(14, (3,), (3,), (2, 2), (4,), (4,))
    return {"a": [a0, (a1, a2)], "p": Point(px, py)}, jnp.float32(1.5)


def embedding(emb, tokens, w):
    """An int array used as indices; the float arguments are differentiated."""
    h = emb[tokens]  # (B, T, E)
    return jnp.mean(jnp.tanh(h @ w))


def embedding_args():
    emb, w = _normal(15, (10, 6), (6, 3))
    return emb, jnp.array([[1, 2, 9, 2], [0, 0, 5, 7]], jnp.int32), w


_CLOSED_W = jnp.asarray(np.random.default_rng(100).standard_normal((5, 4)).astype(np.float32) * 0.5)
_CLOSED_B = np.linspace(-1.0, 1.0, 4, dtype=np.float32)


def closure(x, s):
    """Closes over module-level arrays; also returns a value that depends on no input."""
    return jnp.tanh(x @ _CLOSED_W + _CLOSED_B) * s + jnp.sum(_CLOSED_W) * x[:, :1], _CLOSED_W * 2.0


def aliased_args(x, y):
    """Called with the same array as both arguments."""
    return jnp.sum(jnp.sin(x) * y ** 2)


def mixed_bf16(x, w, s):
    """x: bf16, w and s: f32; a bf16 matmul upcast to f32, plus a bf16 output."""
    y = (x @ w.astype(jnp.bfloat16)).astype(jnp.float32) * s
    return jnp.tanh(y), (x * x.astype(jnp.float32).mean().astype(jnp.bfloat16))


def mixed_bf16_args():
    x, w, s = _normal(16, (4, 8), (8, 3), (3,), scale=0.5)
    return x.astype(jnp.bfloat16), w, s


def unused_inputs(x, unused, w, unused_int):
    del unused, unused_int
    return jnp.sum(jnp.tanh(x @ w))


def scalar_inputs(a, b, x):
    """a: a 0-d f32 array, b: a Python float."""
    return jnp.sum(a * jnp.sin(x) + b * x ** 2) * a


def outputs_are_inputs(x, y):
    return x, x * jnp.cos(y), y


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "b"], meta_fields=["act"])
@dataclasses.dataclass
class Dense:
    w: Any
    b: Any
    act: str = "tanh"


def registered_dataclass(layer, x):
    act = {"tanh": jnp.tanh, "sin": jnp.sin}[layer.act]
    y = act(x @ layer.w + layer.b)
    return {"y": y, "layer": Dense(layer.w * 2.0, jnp.sum(y, axis=0), "sin")}


def registered_dataclass_args():
    w, b, x = _normal(17, (4, 3), (3,), (5, 4))
    return Dense(w, b, "tanh"), x


def keyword_args(x, w, *, scale, shift):
    return jnp.tanh((x @ w) * scale + shift)


def keyword_args_kwargs():
    scale, shift = _normal(18, (3,), (3,))
    return dict(scale=scale, shift=shift)


def static_arg(x, n, w):
    for _ in range(n):
        x = jnp.tanh(x @ w)
    return jnp.sum(x.reshape(n, -1) ** 2, axis=1)


def where_select(x, y):
    a = jnp.where(x > 0, x * y, jnp.exp(y))
    b = lax.select(x < y, jnp.sin(x), jnp.cos(y))
    return a + b


def max_min(x, y):
    return jnp.max(x, axis=1), jnp.min(x, axis=0), jnp.max(x * y), jnp.maximum(x, y) + jnp.minimum(x, y ** 2)


def dynamic_slice(x, i, u):
    a = lax.dynamic_slice(x, (i, 1), (3, 4))
    b = lax.dynamic_update_slice(x, u * 2.0, (i + 1, 0))
    return jnp.sum(jnp.sin(a)) + jnp.sum(b ** 2)


def dynamic_slice_args():
    x, u = _normal(19, (7, 6), (2, 6))
    return x, jnp.int32(2), u


def concat_transpose_reshape(x, y):
    c = jnp.concatenate([x, y.T, x * y.T], axis=0)  # (9, 4)
    t = jnp.transpose(c.reshape(3, 3, 4), (2, 0, 1))  # (4, 3, 3)
    return jnp.sin(t).reshape(12, 3) @ jnp.arange(3.0)


def clip(x, y):
    return jnp.clip(x, -0.5, 0.5) * y + jnp.clip(y, min=0.0)


def log1p_expm1(x):
    return jnp.log1p(x * x) + jnp.expm1(-x) * jnp.log1p(jnp.exp(x))


def integer_pow(x, y):
    return x ** 3 + lax.integer_pow(y, -2) + x ** 2 * y


def rsqrt(x, y):
    return lax.rsqrt(x * x + 1.0) * y + jnp.sum(lax.rsqrt(jnp.abs(y) + 0.5))


def int_leaf_in_diff_arg(params, x):
    """The differentiated argument holds an integer leaf: it gets a float0 cotangent."""
    return jnp.sum(jnp.tanh(x @ params["w"])) * params["step"].astype(jnp.float32)


def int_output(x, w):
    logits = x @ w
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1)), jnp.argmax(logits, axis=-1)


def _a(seed, *shapes, **kw):
    return lambda: tuple(_normal(seed, *shapes, **kw))


PROGRAMS: tuple[Program, ...] = (
    Program("mlp", mlp, mlp_args, (0, 1), **F32),
    Program("transformer_block", transformer_block, transformer_args, (0, 1), **F32_LOOSE),
    Program("convnet_bn", convnet_bn, convnet_args, (0, 1), **F32_LOOSE),
    Program("layer_norm", layer_norm, layer_norm_args, (0, 1, 2), **F32),
    Program("softmax", softmax, _a(20, (4, 7)), 0, **F32),
    Program("logsumexp", logsumexp, _a(21, (5, 6), (6,)), (0, 1), **F32),
    Program("scan_rnn", scan_rnn, scan_rnn_args, (0, 1, 2), **F32_LOOSE),
    Program("cond", cond, cond_args, (0, 1), **F32),
    Program("gather_scatter", gather_scatter, gather_scatter_args, (0, 2), **F32),
    Program("cumsum_cumprod", cumsum_cumprod, cumsum_cumprod_args, (0, 1), **F32),
    Program("sort", sort, _a(22, (3, 6), (3, 6)), (0, 1), **F32),
    Program("pool_max", pool_max, _a(23, (2, 6, 6, 3), (3,)), (0, 1), **F32),
    Program("pool_avg", pool_avg, _a(24, (2, 5, 5, 2)), 0, **F32),
    Program("attention", attention, attention_args, (0, 1, 2), **F32_LOOSE),
    Program("conv_transpose", conv_transpose, _a(25, (2, 3, 3, 2), (3, 3, 2, 4), (4,), scale=0.5), (0, 1, 2),
            **F32_LOOSE),
    Program("custom_jvp", custom_jvp, _a(26, (4, 5), (5, 3)), (0, 1), **F32),
    Program("custom_vjp", custom_vjp, lambda: (*_normal(27, (4, 5), (5, 3)), jnp.float32(0.8)), (0, 1, 2), **F32),
    Program("dropout", dropout, dropout_args, (0, 1), **F32),
    Program("dropout_raw_key", dropout_raw_key, lambda: (_normal(28, (3, 8))[0], jax.random.PRNGKey(7)), 0, **F32),
    Program("checkpoint", checkpointed, _a(29, (4, 6), (6, 6), (6, 6), scale=0.5), (0, 1, 2), **F32),
    Program("nested_jit", nested_jit, _a(30, (4, 5), (5, 5), scale=0.5), (0, 1), **F32),
    Program("pytree_io", pytree_io, pytree_io_args, (0, 1), **F32),
    Program("embedding_int_indices", embedding, embedding_args, (0, 2), **F32),
    Program("closure", closure, _a(31, (3, 5), (4,)), (0, 1), **F32),
    Program("aliased_args", aliased_args, lambda: (lambda x: (x, x))(_normal(49, (3, 4))[0]), (0, 1), **F32),
    Program("mixed_bf16", mixed_bf16, mixed_bf16_args, (0, 1, 2), **BF16),
    Program("unused_inputs", unused_inputs,
            lambda: (*_normal(32, (3, 4), (2,), (4, 2)), jnp.arange(3)), (0, 1, 2), **F32),
    Program("scalar_inputs", scalar_inputs, lambda: (jnp.float32(0.7), 1.25, _normal(33, (5,))[0]), (0, 1, 2),
            **F32),
    Program("outputs_are_inputs", outputs_are_inputs, _a(34, (3, 4), (3, 4)), (0, 1), **F32),
    Program("registered_dataclass", registered_dataclass, registered_dataclass_args, (0, 1), **F32),
    Program("keyword_args", keyword_args, _a(35, (4, 5), (5, 3)), (0, 1), **F32,
            make_kwargs=keyword_args_kwargs),
    Program("static_arg", static_arg, lambda: (_normal(36, (4, 4))[0], 2, _normal(37, (4, 4), scale=0.5)[0]),
            (0, 2), **F32, static_argnums=(1,)),
    Program("where_select", where_select, _a(38, (4, 5), (4, 5)), (1, 0), **F32),  # argnums out of order
    Program("max_min", max_min, _a(39, (4, 5), (4, 5)), (0, 1), **F32),
    Program("dynamic_slice", dynamic_slice, dynamic_slice_args, (0, 2), **F32),
    Program("concat_transpose_reshape", concat_transpose_reshape, _a(40, (3, 4), (4, 3)), (0, 1), **F32),
    Program("clip", clip, _a(41, (5, 6), (5, 6)), (0, 1), **F32),
    Program("log1p_expm1", log1p_expm1, _a(42, (6,), scale=0.5), 0, **F32),
    Program("integer_pow", integer_pow, lambda: (_normal(43, (5,))[0], _uniform(44, (5,), 0.5, 2.0)), (0, 1),
            **F32),
    Program("rsqrt", rsqrt, _a(45, (4, 3), (4, 3)), (0, 1), **F32),
    Program("int_leaf_in_diff_arg", int_leaf_in_diff_arg,
            lambda: ({"w": _normal(46, (4, 3))[0], "step": jnp.array(3, jnp.int32)}, _normal(47, (2, 4))[0]),
            (0, 1), **F32),
    Program("int_output", int_output, _a(48, (5, 4), (4, 6)), (0, 1), **F32),
)

BY_NAME: dict[str, Program] = {p.name: p for p in PROGRAMS}
assert len(BY_NAME) == len(PROGRAMS), "program names must be unique"
