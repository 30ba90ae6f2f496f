"""Per-call overhead of `aotgrad.fwd_and_bwd` against `jax.fwd_and_bwd` on tiny inputs.

On a 4x4 problem the programs do almost nothing, so the time per call is the host-side
cost of a forward call plus a backward call: argument flattening, cache lookup, dispatch.
Each sample times `calls` consecutive fwd+bwd calls; samples of the contenders are
interleaved (round-robin), and the median over samples is reported, in two modes:

- latency:  block_until_ready on every call's gradients (a synchronous training step);
- dispatch: block once, after the last call (host cost with asynchronous dispatch).

    python -m benchmarks.overhead [--size=4] [--calls=1000] [--repeats=21]
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

import aotgrad
from benchmarks.measure import Stats, interleaved, summarize
from benchmarks.suite import OverheadSpec

__all__ = ["OverheadRow", "TARGET_RATIO", "run_overhead"]

TARGET_RATIO = 1.3  # aotgrad's per-call overhead should stay within this of jax's
PEER = "jax_fwd_and_bwd"
MODES = ("latency", "dispatch")


@dataclasses.dataclass(frozen=True)
class OverheadRow:
    strategy: str
    mode: str  # "latency" or "dispatch"
    per_call: Stats  # seconds per fwd+bwd call
    ratio_vs_jax: float  # median / jax's median
    paired_ratio_vs_jax: float  # median over rounds of (this sample / jax's sample that round)


def tiny_loss(w: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.tanh(x @ w))


def _sampler(fwd: Callable, bwd: Callable, args: tuple[Any, ...], calls: int, block_each: bool,
             context: Callable[[], Any]) -> Callable[[], float]:
    ct = jnp.ones((), jnp.float32)

    def sample() -> float:
        with context():
            t0 = time.perf_counter()
            g = None
            for _ in range(calls):
                out, saved = fwd(*args)
                g = bwd(saved, ct)
                if block_each:
                    jax.block_until_ready(g)
            jax.block_until_ready(g)
            return (time.perf_counter() - t0) / calls
    return sample


def run_overhead(spec: OverheadSpec, partitioners: Sequence[str],
                 log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> list[OverheadRow]:
    """Times jax.fwd_and_bwd and aotgrad.fwd_and_bwd (one per partitioner name) per call."""
    key = jax.random.key(0)
    w = jax.random.normal(key, (spec.size, spec.size), jnp.float32)
    x = jax.random.normal(jax.random.split(key)[0], (spec.size, spec.size), jnp.float32)
    contenders: dict[str, tuple[Callable, Callable, Callable[[], Any]]] = {
        PEER: (*jax.fwd_and_bwd(tiny_loss, argnums=0), contextlib.nullcontext)}
    for p in partitioners:
        ctx = (lambda p=p: aotgrad.config.patch(partitioner=p))
        with ctx():
            contenders[f"aotgrad:{p}"] = (*aotgrad.fwd_and_bwd(tiny_loss, argnums=0), ctx)
    rows: list[OverheadRow] = []
    for mode in MODES:
        samplers = {name: _sampler(f, b, (w, x), spec.calls, mode == "latency", ctx)
                    for name, (f, b, ctx) in contenders.items()}
        for s in samplers.values():  # compile and warm
            s()
        log(f"[overhead] {mode}: {spec.repeats} interleaved samples of {spec.calls} calls x {len(samplers)} contenders")
        samples = interleaved(samplers, spec.repeats)
        base = summarize(samples[PEER]).median
        for name, xs in samples.items():
            st = summarize(xs)
            paired = statistics.median(a / b for a, b in zip(xs, samples[PEER], strict=True))
            rows.append(OverheadRow(name, mode, st, st.median / base, paired))
    return rows


def format_rows(rows: Sequence[OverheadRow], spec: OverheadSpec) -> str:
    lines = [f"call overhead: {spec.size}x{spec.size} tanh(x @ w) loss, fwd+bwd per call, "
             f"median of {spec.repeats} interleaved samples of {spec.calls} calls "
             f"(target: aotgrad within {TARGET_RATIO}x of jax)",
             f"  {'mode':9s} {'strategy':22s} {'us/call':>9s} {'IQR us':>8s} {'vs jax':>7s} {'paired':>7s}"]
    for r in rows:
        verdict = ""
        if r.strategy != PEER and r.ratio_vs_jax is not None:
            verdict = "  ok" if r.ratio_vs_jax <= TARGET_RATIO else "  OVER TARGET"
        lines.append(f"  {r.mode:9s} {r.strategy:22s} {r.per_call.median * 1e6:9.1f} "
                     f"{r.per_call.iqr * 1e6:8.1f} {r.ratio_vs_jax:6.2f}x {r.paired_ratio_vs_jax:6.2f}x{verdict}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    from absl import flags
    del argv
    spec = OverheadSpec(size=flags.FLAGS.size, calls=flags.FLAGS.calls, repeats=flags.FLAGS.repeats)
    print(format_rows(run_overhead(spec, list(aotgrad.partitioners())), spec))


if __name__ == "__main__":
    from absl import app, flags
    flags.DEFINE_integer("size", 4, "Side of the square inputs.")
    flags.DEFINE_integer("calls", 1000, "fwd+bwd calls per timing sample.")
    flags.DEFINE_integer("repeats", 21, "Interleaved samples per contender.")
    app.run(main)
