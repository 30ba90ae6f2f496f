"""Planning time: lowering a training step through aotgrad against the plain step, for
unrolled GPTs of tiny width (so the graph, not arithmetic, is what costs).

Each run lowers `jax.jit(jax.value_and_grad(f))` (plain) and
`jax.jit(jax.value_and_grad(aotgrad.compile(f)))` (aotgrad, under the budget) back to back
in one process, interleaved over `--repeats` rounds (after one warm-up on a 2-layer
model), each timed with a full garbage collection after it; the table gives the medians
and their ratio, of wall-clock seconds and of this process's CPU seconds (steadier where
other work shares the machine).

    python -m benchmarks.planning_time --layers 12,24,48,96 --budgets 1,0.5,0 [--out t.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any, Callable

import jax

import aotgrad
from benchmarks.records import machine_info, now, versions
from benchmarks.workloads import gpt

SIZES = {"batch": 1, "seq": 8, "d_model": 16, "heads": 2, "vocab": 32}


def _lower_seconds(make: Callable[[], Callable[..., Any]], *args: Any) -> tuple[float, float]:
    """Wall-clock and CPU seconds to lower the step, and then to collect the garbage it
    left: what a lowering defers to the cycle collector (aotgrad holds it off while it
    plans) is charged to it, and each lowering starts from a collected heap."""
    step = jax.jit(jax.value_and_grad(make()))
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    step.lower(*args)
    gc.collect()
    return time.perf_counter() - t0, time.process_time() - c0


def measure(layers: int, budget: float, repeats: int) -> dict[str, Any]:
    """Median seconds to lower the plain and the aotgrad step, `repeats` interleaved rounds."""
    loss_fn, params, batch = gpt(layers=layers, **SIZES)
    plain, ours = [], []
    for _ in range(repeats):
        plain.append(_lower_seconds(lambda: loss_fn, params, batch))
        with aotgrad.config.patch(activation_memory_budget=budget):
            ours.append(_lower_seconds(lambda: aotgrad.compile(loss_fn), params, batch))
    p, a = (statistics.median(t[0] for t in runs) for runs in (plain, ours))
    pc, ac = (statistics.median(t[1] for t in runs) for runs in (plain, ours))
    return {"layers": layers, "budget": budget, "plain_s": p, "aotgrad_s": a, "ratio": a / p,
            "plain_cpu_s": pc, "aotgrad_cpu_s": ac, "cpu_ratio": ac / pc, "plain_runs": plain, "aotgrad_runs": ours}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="12,24,48,96")
    parser.add_argument("--budgets", default="1,0.5,0")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    header = {"date": now(), "jax": jax.__version__, "backend": jax.default_backend(), "sizes": SIZES,
              "repeats": args.repeats, "command": "python -m benchmarks.planning_time " + " ".join(argv or sys.argv[1:]),
              "machine": machine_info(), "versions": versions()}
    print(f"{header['date'][:10]}  jax {header['jax']}  backend {header['backend']}  "
          f"medians of {args.repeats} interleaved runs")
    print(f"{'layers':>6} {'budget':>6} {'plain s':>8} {'aotgrad s':>9} {'ratio':>6} "
          f"{'plain cpu s':>11} {'aotgrad cpu s':>13} {'cpu ratio':>9}")
    layer_counts = [int(n) for n in args.layers.split(",")]
    budgets = [float(b) for b in args.budgets.split(",")]
    for budget in budgets:  # warm-up: JAX's and aotgrad's first-use costs, on a small model
        measure(2, budget, 1)
    rows = []
    for layers in layer_counts:
        for budget in budgets:
            row = measure(layers, budget, args.repeats)
            rows.append(row)
            print(f"{layers:>6} {budget:>6g} {row['plain_s']:>8.2f} {row['aotgrad_s']:>9.2f} "
                  f"{row['ratio']:>5.1f}x {row['plain_cpu_s']:>11.2f} {row['aotgrad_cpu_s']:>13.2f} "
                  f"{row['cpu_ratio']:>8.1f}x", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**header, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
