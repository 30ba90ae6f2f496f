"""Real models: five model families trained plain and through aotgrad.compile, compared.

Each model is written as its family's users write it and trained for a few steps with an
optax AdamW optimizer, once with the loss as is ("plain") and once with the loss wrapped in
`aotgrad.compile` (default options; nothing else changes).

- `gemma_nnx`: a Gemma-style Flax NNX decoder (RMSNorm, rotary embeddings, GeGLU MLP,
  multi-head attention through `jax.nn.dot_product_attention`), step under `nnx.jit`;
- `resnet_linen_pmap`: a Flax linen ResNet with BatchNorm (batch statistics a mutable
  collection, averaged over the device axis), step under `jax.pmap` (one device);
- `decoder_linen_scan`: a Flax linen decoder whose layers are one `nn.scan`, step under `jax.jit`;
- `vit_equinox`: an Equinox ViT with static int fields (patch size, heads), step under
  `eqx.filter_jit` with `eqx.filter_value_and_grad`;
- `gpt_flash_custom_vjp`: a decoder whose attention is a `jax.custom_vjp` blockwise
  ("flash-style") attention with its own backward, step under `jax.jit`.

For each model the runner checks that both variants train identically (losses per step,
final parameters, optimizer and model state), then measures the step time (median of
interleaved samples), the build time (the first call: tracing, compiling, one step) and
XLA's peak of the jitted step (arguments + outputs - aliased + scratch).

    python -m benchmarks.real_models [--models=gemma_nnx,vit_equinox] [--steps=5] [--repeats=15] [--tiny]

Progress goes to stderr, the table (markdown) to stdout. Needs flax, equinox and optax.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any, Callable

import jax
import numpy as np

import aotgrad
from benchmarks.measure import Stats, interleaved, steps_for, summarize, time_steps

from benchmarks.real_common import ATOL, RTOL, Loss, RealModel, Step
from benchmarks.strategies import first_line, xla_peak
from benchmarks.real_flax import decoder_linen_scan, gemma_nnx, resnet_linen_pmap
from benchmarks.real_jax import gpt_flash_custom_vjp, vit_equinox

__all__ = ["MODELS", "TINY", "Comparison", "Result", "Trained", "compare", "format_table", "main", "run_model",
           "step_peak", "train"]


MODELS: dict[str, Callable[..., RealModel]] = {
    "gemma_nnx": gemma_nnx,
    "resnet_linen_pmap": resnet_linen_pmap,
    "decoder_linen_scan": decoder_linen_scan,
    "vit_equinox": vit_equinox,
    "gpt_flash_custom_vjp": gpt_flash_custom_vjp,
}

# Sizes at which every model trains in about a second (the tests, `--tiny`).
TINY: dict[str, dict[str, int]] = {
    "gemma_nnx": dict(batch=2, seq=8, d_model=16, heads=2, layers=1, vocab=32),
    "resnet_linen_pmap": dict(batch=4, size=8, channels=8, blocks=1, classes=4),
    "decoder_linen_scan": dict(batch=2, seq=8, d_model=16, heads=2, layers=2, vocab=32),
    "vit_equinox": dict(batch=2, size=8, patch=4, d_model=16, heads=2, layers=1, classes=4),
    "gpt_flash_custom_vjp": dict(batch=2, seq=8, d_model=16, heads=2, layers=1, vocab=32, block=4),
}


# ----------------------------------------------------------------------------- training and comparing

@dataclasses.dataclass(frozen=True)
class Trained:
    """`steps` training steps from a fresh state: the loss of each, the state after them,
    the step (to go on training or lower), and the first call's seconds (trace, compile, run)."""
    losses: np.ndarray
    state: Any
    step: Step
    first_call_s: float
    step_s: float  # mean seconds of the later steps


def _block(x: Any) -> Any:
    return jax.block_until_ready(x)


def train(model: RealModel, loss: Loss, steps: int) -> Trained:
    """Trains `model` for `steps` steps with the step built around `loss`."""
    step, state, losses = model.make_step(loss), model.init(), []
    t0 = time.perf_counter()
    state, value = _block(step.run(state))
    first = time.perf_counter() - t0
    losses.append(float(value))
    t0 = time.perf_counter()
    for _ in range(steps - 1):
        state, value = _block(step.run(state))
        losses.append(float(value))
    rest = (time.perf_counter() - t0) / max(steps - 1, 1)
    return Trained(np.array(losses), state, step, first, rest)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Plain against aotgrad training: identical within (RTOL, ATOL)? The largest
    differences, and the first leaf (pytree path) that is not close."""
    identical: bool
    loss_diff: float  # max |plain - aotgrad| over the steps' losses
    state_diff: float  # max |plain - aotgrad| over every array of the final states
    first_mismatch: str | None


def compare(model: RealModel, plain: Trained, compiled: Trained) -> Comparison:
    """Losses step by step, then every array of `model.arrays` (parameters, optimizer
    moments and step count, model state), elementwise within (RTOL, ATOL)."""
    loss_ok = np.allclose(compiled.losses, plain.losses, rtol=RTOL, atol=ATOL)
    loss_diff = float(np.max(np.abs(compiled.losses - plain.losses)))
    want = jax.tree_util.tree_flatten_with_path(model.arrays(plain.state))
    got = jax.tree_util.tree_flatten_with_path(model.arrays(compiled.state))
    if want[1] != got[1]:
        return Comparison(False, loss_diff, float("nan"), f"state structures differ: {want[1]} vs {got[1]}")
    state_diff, mismatch = 0.0, None if loss_ok else f"losses {compiled.losses} vs {plain.losses}"
    for (path, a), (_, b) in zip(got[0], want[0], strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.size:
            state_diff = max(state_diff, float(np.max(np.abs(a - b))))
        if mismatch is None and not np.allclose(a, b, rtol=RTOL, atol=ATOL):
            mismatch = f"{jax.tree_util.keystr(path)}: max diff {np.max(np.abs(a - b)):.2e}"
    return Comparison(mismatch is None, loss_diff, state_diff, mismatch)


def step_peak(step: Step, state: Any) -> int | None:
    """XLA's peak bytes of the compiled step at `state`: arguments + outputs - outputs
    aliased to arguments + scratch. None if the backend reports no memory analysis. (At a
    state the step has run on, JAX's caches make this a lookup, not a compilation.)"""
    m = step.lower(state).compile().memory_analysis()
    return None if m is None else xla_peak(m)


# ----------------------------------------------------------------------------- the benchmark

VARIANTS = ("plain", "aotgrad")


@dataclasses.dataclass(frozen=True)
class Result:
    """One model's row; on a failure only `error` is set: `crash: <first line>` when the
    aotgrad variant raised, `plain crashed: ...` or `timing: ...` otherwise."""
    name: str
    family: str
    comparison: Comparison | None = None
    losses: dict[str, tuple[float, ...]] | None = None  # variant -> the training steps' losses
    step: dict[str, Stats] | None = None  # variant -> seconds per step
    steps_per_sample: int | None = None
    first_call_s: dict[str, float] | None = None  # variant -> build seconds
    peak: dict[str, int | None] | None = None  # variant -> XLA peak bytes of the step
    peak_note: str | None = None  # why a peak is missing
    error: str | None = None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_model(name: str, sizes: dict[str, int], steps: int, repeats: int, min_sample_seconds: float) -> Result:
    """Trains both variants, compares them, times them interleaved, reads their peaks."""
    t0 = time.perf_counter()
    model = MODELS[name](**sizes)
    trained: dict[str, Trained] = {}
    for variant in VARIANTS:
        try:
            loss = model.loss if variant == "plain" else aotgrad.compile(model.loss)
            trained[variant] = train(model, loss, steps)
        except Exception as e:
            log(f"{name} / {variant}: crashed: {first_line(e)}")
            prefix = "crash: " if variant == "aotgrad" else "plain crashed: "
            return Result(name, model.family, error=prefix + first_line(e))
        t = trained[variant]
        log(f"{name} / {variant}: first call {t.first_call_s:.2f}s, losses "
            + " ".join(f"{x:.4f}" for x in t.losses))
    comparison = compare(model, trained["plain"], trained["aotgrad"])
    losses = {v: tuple(float(x) for x in t.losses) for v, t in trained.items()}
    if not comparison.identical:
        log(f"{name}: training differs: {comparison.first_mismatch}")

    # Both variants go on training from where they are, one sample of each in turn.
    states = {v: t.state for v, t in trained.items()}
    n = steps_for(float(np.median([t.step_s for t in trained.values()])), min_sample_seconds)

    def sampler(variant: str) -> Callable[[], float]:
        run = trained[variant].step.run

        def one() -> Any:
            states[variant], value = run(states[variant])
            return value

        return lambda: time_steps(one, _block, n)

    try:
        samples = interleaved({v: sampler(v) for v in VARIANTS}, repeats)
    except Exception as e:
        log(f"{name}: failed while timing: {first_line(e)}")
        return Result(name, model.family, comparison, losses, error=f"timing: {first_line(e)}")
    stats = {v: summarize(s) for v, s in samples.items()}
    log(f"{name}: " + ", ".join(f"{v} {s.median * 1e3:.2f} ms (IQR {s.iqr * 1e3:.2f})" for v, s in stats.items())
        + f"; {repeats} interleaved samples of {n} steps")
    peak: dict[str, int | None] = {}
    note = None
    for variant in VARIANTS:
        try:
            peak[variant] = step_peak(trained[variant].step, states[variant])
            if peak[variant] is None:
                note = "the backend reports no memory analysis"
        except Exception as e:
            peak[variant], note = None, f"{variant}: {first_line(e)}"
    log(f"{name}: done in {time.perf_counter() - t0:.1f}s")
    return Result(name, model.family, comparison, losses, stats, n,
                  {v: t.first_call_s for v, t in trained.items()}, peak, note)


def _ratio(new: float | None, old: float | None, unit: str, scale: float, digits: int) -> str:
    if new is None or old is None or not old:
        return "-"
    return f"{new / old:.2f}x ({old * scale:.{digits}f} / {new * scale:.{digits}f} {unit})"


def format_table(results: list[Result]) -> str:
    """A markdown table: one row per model; plain / aotgrad in parentheses."""
    lines = ["| model | family | trains identically | step time vs plain | build vs plain | "
             "XLA peak vs fused (plain) |", "|---|---|---|---|---|---|"]
    for r in results:
        if r.error is not None:
            lines.append(f"| {r.name} | {r.family} | {r.error} | - | - | - |")
            continue
        assert r.comparison is not None and r.step is not None and r.first_call_s is not None and r.peak is not None
        c = r.comparison
        same = (f"yes (loss {c.loss_diff:.0e}, state {c.state_diff:.0e})" if c.identical
                else f"no: {c.first_mismatch}")
        step = _ratio(r.step["aotgrad"].median, r.step["plain"].median, "ms", 1e3, 2)
        build = _ratio(r.first_call_s["aotgrad"], r.first_call_s["plain"], "s", 1, 2)
        peak = _ratio(r.peak["aotgrad"], r.peak["plain"], "MB", 1e-6, 2)
        if peak == "-" and r.peak_note:
            peak = f"- ({r.peak_note})"
        lines.append(f"| {r.name} | {r.family} | {same} | {step} | {build} | {peak} |")
    return "\n".join(lines)


def _loadavg() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"  # other work on the machine
    except OSError:
        return "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma list of " + ", ".join(MODELS))
    parser.add_argument("--steps", type=int, default=5, help="training steps of each variant")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--min-sample-seconds", type=float, default=0.2,
                        help="steps per timing sample: enough for a sample to last this")
    parser.add_argument("--tiny", action="store_true", help="the test sizes (seconds per model)")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.repeats < 1:
        parser.error("--steps must be >= 2 (the first call builds; the others estimate a step) "
                     "and --repeats >= 1")
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {list(MODELS)}")
    t0, load = time.perf_counter(), _loadavg()
    results = []
    for name in names:
        sizes = TINY[name] if args.tiny else {}
        log(f"{name}: {', '.join(f'{k}={v}' for k, v in sizes.items()) or 'default sizes'}")
        results.append(run_model(name, sizes, args.steps, args.repeats, args.min_sample_seconds))
    print(f"real models - {time.strftime('%Y-%m-%d %H:%M:%S %Z')} - jax {jax.__version__}, backend "
          f"{jax.default_backend()}, {os.cpu_count()} CPUs - {args.steps} training steps per variant, "
          f"{args.repeats} interleaved timing rounds; load average (1 min) before/after: {load} / {_loadavg()}\n")
    print(format_table(results))
    print(f"\ntotal {time.perf_counter() - t0:.1f}s", flush=True)
    return 0 if all(r.error is None and r.comparison is not None and r.comparison.identical
                    for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
