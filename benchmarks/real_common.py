"""What the real-model families share: the records of a model and its step, data, loss,
optimizer and small layers (benchmarks/real_models.py runs them)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ATOL", "RTOL", "Loss", "RealModel", "Step", "adamw", "cross_entropy", "jitted_optax_step", "key_data", "rope",
           "token_batch"]

Loss = Callable[..., Any]
RTOL, ATOL = 1e-4, 1e-5  # "trains identically": float32 agreement of losses and states


@dataclasses.dataclass(frozen=True)
class Step:
    """A jitted training step: `run(state) -> (state, loss)`; `lower(state)`: the lowering of
    the function the family's jit wraps (for XLA's memory analysis)."""
    run: Callable[[Any], tuple[Any, jax.Array]]
    lower: Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class RealModel:
    """One model family's training. `init()` makes a fresh state (model or parameters,
    optimizer state, batch); `make_step(loss)` the jitted step around `loss` (the plain
    `loss`, or `aotgrad.compile(loss)`); `arrays(state)` what training changes, to compare."""
    name: str
    family: str  # the framework, and how its users jit the step
    init: Callable[[], Any]
    loss: Loss
    make_step: Callable[[Loss], Step]
    arrays: Callable[[Any], Any]
    # The loss as a function of (parameters, batch), with fresh parameters and a batch: the
    # model as a benchmark workload (`benchmarks.workloads`); None where not offered.
    functional: Callable[[], tuple[Loss, Any, Any]] | None = None


def key_data(tree: Any) -> Any:
    """Every leaf as a NumPy array (PRNG keys as their key data)."""
    def leaf(a: Any) -> np.ndarray:
        a = jnp.asarray(a)
        return np.asarray(jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a)
    return jax.tree.map(leaf, tree)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    import optax
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def adamw() -> Any:
    """AdamW with eps 1e-6. Adam's update g / (|g| + eps) is ill-conditioned where |g| is
    near eps: with the default 1e-8, gradients that agree to 5e-7 (float32 rounding in
    another summation order) give parameters 3e-5 apart after 5 steps, at entries whose
    gradient is ~1e-8. The larger eps keeps the comparison of parameters about the gradients."""
    import optax
    return optax.adamw(1e-3, eps=1e-6, weight_decay=1e-4)


def token_batch(batch: int, seq: int, vocab: int, seed: int = 1) -> tuple[jax.Array, jax.Array]:
    tokens = jax.random.randint(jax.random.key(seed), (batch, seq + 1), 0, vocab, jnp.int32)
    return tokens[:, :-1], tokens[:, 1:]


def rope(x: jax.Array, base: float = 10_000.0) -> jax.Array:
    """Rotary position embedding of (batch, seq, heads, head_dim) queries or keys."""
    t, half = x.shape[1], x.shape[-1] // 2
    angle = jnp.arange(t, dtype=jnp.float32)[:, None] * base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    sin, cos = jnp.sin(angle)[:, None, :], jnp.cos(angle)[:, None, :]
    sin, cos = sin.astype(x.dtype), cos.astype(x.dtype)  # a 16-bit x stays 16-bit (float32: no-ops)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)



def jitted_optax_step(loss_fn: Loss, tx: Any) -> Step:
    """The step of a model held as (params, opt_state, batch), under `jax.jit`."""
    import optax

    @jax.jit
    def train_step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        value, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def run(state: Any) -> tuple[Any, jax.Array]:
        params, opt_state, value = train_step(*state)
        return (params, opt_state, state[2]), value
    return Step(run, lambda state: train_step.lower(*state))

