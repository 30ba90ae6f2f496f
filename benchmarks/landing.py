"""Where a byte limit lands: for each limit, the step `aotgrad.plan(...).fit(limit)` returns
(its `activation_memory_budget`, compiled per-device peak, bytes moved and FLOPs), beside
the step the byte budget `limit` itself builds (planned on aotgrad's estimate alone).

    JAX_PLATFORMS=cpu python -m benchmarks.landing --target h100 --devices 8 --sharding fsdp \\
        --workload gpt --sizes batch=64 --limits 5GB,7GB,10GB,14GB --out docs/results/h100_landing_x8.json

`--target local` compiles for this machine's own devices (a real GPU). Workload sizes default to GPT-2 small (`config/gpu.toml`'s `gpt`); `--sizes` overrides some.
Shapes only: no step runs, each is compiled for the target.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any

import jax

import aotgrad
from aotgrad.partition.budget_value import parse_bytes
from benchmarks.workloads import build

GPT2_SMALL = {"batch": 8, "seq": 1024, "d_model": 768, "heads": 12, "layers": 12, "vocab": 50304}


def _sizes(text: str) -> dict[str, Any]:
    sizes = dict(GPT2_SMALL)
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        sizes[key.strip()] = int(value)
    return sizes


def _row(row: Any) -> dict[str, Any] | None:
    if row is None:
        return None  # no plan's estimate is that low
    return {"budget": row.budget, "peak_bytes": row.peak_bytes, "bytes_moved": row.bytes_moved, "flops": row.flops}


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def table(result: dict[str, Any]) -> str:
    """The results as a Markdown table (docs/planning.md quotes it; tests/test_plan.py checks
    that it does so exactly)."""
    fused = result["fused"]
    lines = [f"{result['devices']} x {result['target']} ({result['sharding']}), {result['workload']} "
             f"{result['sizes']}, {result['date']}, jax {result['versions']['jax']}; the fused step: "
             f"{_gb(fused['peak_bytes'])} GB peak, {_gb(fused['bytes_moved'])} GB moved, "
             f"{fused['flops'] / 1e12:.2f} TFLOP per device.", "",
             "| limit | `fit`: budget | peak GB | GB moved | TFLOP | the limit as the budget: peak GB | GB moved |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        fit, own = r["fit"], r["byte_budget"]
        fit_cells = (["does not fit", "-", "-", "-"] if "does_not_fit" in fit else
                     [f"`{fit['budget']}`", _gb(fit["peak_bytes"]), _gb(fit["bytes_moved"]), f"{fit['flops'] / 1e12:.2f}"])
        own_cells = ["unreachable", "-"] if own is None else [_gb(own["peak_bytes"]), _gb(own["bytes_moved"])]
        lines.append("| " + " | ".join([r["limit"], *fit_cells, *own_cells]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="h100", help='a target name, or "local": this machine\'s devices')
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--sharding", default="dp")
    parser.add_argument("--workload", default="gpt")
    parser.add_argument("--sizes", default="", help="e.g. batch=64,layers=4 (GPT-2 small's otherwise)")
    parser.add_argument("--limits", default="5GB,7GB,10GB,14GB")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    sizes = _sizes(args.sizes)
    w = build(args.workload, args.workload, sizes)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (w.params, w.batch))
    started = time.time()
    target = jax.devices()[:args.devices] if args.target == "local" else args.target
    plan = aotgrad.plan(w.loss_fn, *shapes, target=target, devices=args.devices, sharding=args.sharding,
                        budgets=[])
    rows: list[dict[str, Any]] = []

    def result() -> dict[str, Any]:
        return {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {platform.node()}",
                "command": "python -m benchmarks.landing " + " ".join(sys.argv[1:] if argv is None else argv),
                "target": plan.target, "devices": args.devices, "sharding": args.sharding,
                "workload": args.workload, "sizes": sizes, "versions": plan.versions,
                "fused": _row(plan.rows[0]), "rows": rows, "seconds": round(time.time() - started),
                "compiled": {k: _row(v) for k, v in plan.searched.items()}}
    for limit in args.limits.split(","):
        n = parse_bytes(limit)
        try:
            landed = _row(plan.fit(limit))
        except aotgrad.DoesNotFit as e:
            landed = {"does_not_fit": str(e)}
        asked = plan.searched.get(limit) or plan.compile_budget(limit)  # the byte budget's own step
        rows.append({"limit": limit, "limit_bytes": n, "fit": landed, "byte_budget": _row(asked)})
        print(f"{limit}: fit {landed}  byte budget {_row(asked)}", flush=True)
        if args.out:  # after each limit: a run stopped partway keeps the limits it finished
            with open(args.out, "w") as f:
                json.dump(result(), f, indent=1)
    print(table(result()))


if __name__ == "__main__":
    main()
