"""docs/results.md, made from the committed results files (docs/results/*.json), and the
measured numbers other docs quote, filled in from the same files.

    python -m benchmarks.results_page            # write docs/results.md, refresh the docs' markers
    python -m benchmarks.results_page --check    # write nothing; exit 1 naming what is stale

A doc quotes a result between markers that this command fills (HTML comments: not shown):

    <!-- results:cell cpu; gpt; aotgrad:min_cut@0.5; peak (1 jit) / fused -->0.55x<!-- /results -->
    <!-- results:minutes cpu -->11<!-- /results -->        the run's duration, in minutes
    <!-- results:run cpu -->...<!-- /results -->           its date, machine and jax version
    <!-- results:pick cpu -->...<!-- /results -->          what to pick, per workload (a list)
    <!-- results:legend suite -->...<!-- /results -->      the column legend (suite, target, overhead)

`cpu` names docs/results/cpu.json; a cell is the table's cell for that workload, strategy and
column. Arguments are separated by semicolons, so a marker may stand in a table's cell. tests/test_results_page.py fails when the page or a marker is not current.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys
from typing import Any, Sequence

from benchmarks.columns import (MIXED_COLUMNS, NOISE, OVERHEAD_COLUMNS, OVERHEAD_KEY, SUITE_COLUMNS, SUITE_KEY,
                                TARGET_COLUMNS, TARGET_KEY, TIME_SLACK, Column, Pick, Refs, mixed_precision, pick_suite,
                                pick_target, suite_refs, target_refs)
from benchmarks.planning_results import PlanningRun, load_planning, planning_section
from benchmarks.results_files import RESULTS_DIR, ROOT, ResultsError, Run, load_dir

__all__ = ["PAGE", "fill_markers", "main", "render_page", "stale"]

PAGE = ROOT / "docs" / "results.md"
MARKER = re.compile(r"<!-- results:(\w+)([^>]*?) -->(.*?)<!-- /results -->", re.S)
SEP = ";"  # between a marker's arguments (a pipe would end a table's cell)
LEGENDS = {"suite": SUITE_COLUMNS, "target": TARGET_COLUMNS, "mixed": MIXED_COLUMNS, "overhead": OVERHEAD_COLUMNS}
MIXED_HEADING = "### Mixed precision: autocast against the model written in 16 bits by hand"
MIXED_TEXT = ("Per model: its float32 fused step (`<model>` / `fused`); the same model written in bfloat16 by "
              "hand, its fused step (`<model>_bf16` / `fused`: float32 master weights cast to bfloat16 at their "
              "use, bfloat16 activations and residual stream, layer-norm statistics, the softmax and the loss in "
              "float32), the anchor; and `aotgrad.autocast` of the target's device type on the float32 model "
              "(`autocast:bf16`, at a budget `autocast:bf16@<budget>`), its ratios to the anchor. The "
              "hand-written model's other rows (such as `aotgrad:min_cut@1`: the same partitioner as autocast's "
              "step) are compared with the anchor too:")
SLACK = f"{(TIME_SLACK - 1) * 100:.0f}%"


def _tilde(text: str) -> str:
    """Tildes escaped: a pair of them would strike the text between through."""
    return text.replace("~", "\\~")


def _md(text: str) -> str:
    """A table cell: pipes and tildes escaped."""
    return _tilde(text.replace("|", "\\|"))


def _table(key: Sequence[str], columns: Sequence[Column[Any]], rows: Sequence[Any], refs: Any) -> list[str]:
    out = ["| " + " | ".join([*key, *(c.name for c in columns)]) + " |",
           "|" + "---|" * len(key) + "---:|" * len(columns)]
    for r in rows:
        ids = [f"`{getattr(r, k)}`" if k == "strategy" else str(getattr(r, k)) for k in key]
        error = getattr(r, "error", None)
        cells = ([_md("FAILED: " + error)] + [""] * (len(columns) - 1) if error
                 else [_md(c.cell(r, refs(r))) for c in columns])
        out.append("| " + " | ".join(ids + cells) + " |")
    return out


def legend(columns: Sequence[Column[Any]]) -> list[str]:
    return [f"- **{c.name}**: {_tilde(c.legend)}." for c in columns]


def pick_lines(run: Run) -> list[str]:
    picks = pick_target(run.target_rows) if run.is_target else pick_suite(run.rows)
    return [_pick_line(w, p, run.is_target) for w, p in picks.items()]


def _pick_line(workload: str, p: Pick | None, target: bool) -> str:
    if p is None:
        return f"- `{workload}`: no fused step measured, nothing to compare with."
    if p.strategy == "fused":
        return (f"- `{workload}`: `fused`, the plain jitted step: no setting within {SLACK} of its "
                f"{'bytes moved' if target else 'time'} has a lower peak.")
    if target:
        return (f"- `{workload}`: `{p.strategy}`: activation peak {p.peak_ratio:.2f}x the fused step's, "
                f"{p.time_ratio:.2f}x its bytes moved.")
    return (f"- `{workload}`: `{p.strategy}`: peak {p.peak_ratio:.2f}x the fused step's {p.how}, "
            f"step {_tilde(NOISE) if p.noisy else ''}{p.time_ratio:.2f}x its time.")


def _machine(run: Run) -> str:
    m = run.machine
    text = f"{m.get('cpu_model') or m.get('machine')}, {m.get('cpu_count')} CPUs, {m.get('platform')}"
    if m.get("accelerator"):
        text = f"{m['accelerator']}; {text}"
    before, after = m.get("loadavg_before"), m.get("loadavg_after")
    if before and after:
        text += f"; load average (1 min) {before[0]:.2f} before, {after[0]:.2f} after"
    return text


def _versions(run: Run) -> str:
    v = run.versions
    names = [f"{k} {v[k]}" for k in ("jax", "jaxlib", "numpy", "torch") if v.get(k)]
    source = f"aotgrad {v.get('aotgrad')}" + (f" at {v['commit']}" if v.get("commit") else "")
    return ", ".join([f"Python {run.machine.get('python')}", *names, source])


def run_line(run: Run) -> str:
    """Date, machine and jax version in a line, for a doc that quotes the run."""
    where = run.machine.get("accelerator") or f"{run.machine.get('cpu_count')}-core {run.machine.get('cpu_model')}"
    return f"{run.date[:10]}, {where}, jax {run.versions.get('jax')}"


def _section(run: Run) -> list[str]:
    out = [f"## {run.title}", "", f"From `{run.file}`.", "",
           f"- date: {run.date}", f"- machine: {_machine(run)}", f"- versions: {_versions(run)}",
           f"- command: `{run.command}`"]
    if run.seconds is not None:
        out.append(f"- took: {run.seconds / 60:.1f} minutes")
    out += [f"- note: {m}" for m in run.messages]
    if run.is_target:
        basis = (f"Nothing runs on a compile-only target, so XLA's bytes moved stand for the time: per "
                 f"workload, the setting with the lowest activation peak per device among those that move at most "
                 f"{SLACK} more bytes than the fused step:")
    else:
        basis = (f"Per workload, the setting with the lowest peak as a training loop runs the step (in one "
                 f"jit; `jax_fwd_and_bwd` as two programs) among those whose median step time is within "
                 f"{SLACK} of the fused step's. aotgrad's time is measured as two programs "
                 f"(`aotgrad.fwd_and_bwd`); {_tilde(NOISE)} marks a time inside the noise:")
    out += ["", "### What to pick", "", basis, "", *pick_lines(run), "", "### Every row", ""]
    if run.is_target:
        out += _table(TARGET_KEY, TARGET_COLUMNS, run.target_rows, target_refs(run.target_rows))
        out += ["", "Columns (per device):", "", *legend(TARGET_COLUMNS)]
        mixed, refs = mixed_precision(run.target_rows)
        if mixed:
            out += ["", MIXED_HEADING, "", MIXED_TEXT, "", *_table(TARGET_KEY, MIXED_COLUMNS, mixed, refs),
                    "", "Columns (per device):", "", *legend(MIXED_COLUMNS)]
    else:
        out += _table(SUITE_KEY, SUITE_COLUMNS, run.rows, suite_refs(run.rows))
        out += ["", "Columns:", "", *legend(SUITE_COLUMNS)]
        notes = [f"- `{r.workload}` / `{r.strategy}`: {n}" for r in run.rows for n in r.notes]
        out += ["", "Notes:", "", *notes] if notes else []
    if run.overhead:
        out += ["", "### Call overhead", "",
                *_table(OVERHEAD_KEY, OVERHEAD_COLUMNS, run.overhead, lambda r: Refs(None)),
                "", "Columns:", "", *legend(OVERHEAD_COLUMNS)]
    return out + [""]


def render_page(runs: Sequence[Run], planning: Sequence[PlanningRun] = ()) -> str:
    out = ["# Results", "",
           "<!-- Generated by `python -m benchmarks.results_page` from docs/results/*.json: edit those, "
           "not this page. -->", "",
           "The latest run of each suite and compile-only target, from the results files in "
           "[docs/results/](results/), made by the command shown under each. How to run the benchmarks "
           "and read the columns: [benchmarks.md](benchmarks.md).", ""]
    titles = [r.title for r in runs] + (["Planning time"] if planning else [])
    out += [f"- [{t}](#{_anchor(t)})" for t in titles] + [""]
    for r in runs:
        out += _section(r)
    out += planning_section(planning)
    return "\n".join(out).rstrip() + "\n"


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


# ----------------------------------------------------------------------------- markers in other docs

def _cell(runs: dict[str, Run], args: list[str]) -> str:
    if len(args) != 4:
        raise ResultsError(f"cell needs 'file; workload; strategy; column', got {'; '.join(args)!r}")
    run = _run(runs, args[0])
    rows: Sequence[Any] = run.target_rows if run.is_target else run.rows
    columns: Sequence[Column[Any]] = TARGET_COLUMNS if run.is_target else SUITE_COLUMNS
    refs = target_refs(run.target_rows) if run.is_target else suite_refs(run.rows)
    if run.is_target and not any(c.name == args[3] for c in columns):  # a mixed-precision column
        rows, refs = mixed_precision(run.target_rows)
        columns = MIXED_COLUMNS
    row = next((r for r in rows if (r.workload, r.strategy) == (args[1], args[2])), None)
    column = next((c for c in columns if c.name == args[3]), None)
    if row is None or column is None:
        raise ResultsError(f"{run.file} has no {'row' if row is None else 'column'} "
                           f"{(args[1], args[2]) if row is None else args[3]!r}")
    return column.cell(row, refs(row))


def _run(runs: dict[str, Run], name: str) -> Run:
    if name not in runs:
        raise ResultsError(f"no results file {name}.json in {RESULTS_DIR.relative_to(ROOT)} (have {sorted(runs)})")
    return runs[name]


def _fill(kind: str, args: list[str], runs: dict[str, Run]) -> str:
    if kind == "cell":
        return _cell(runs, args)
    if kind == "minutes":
        seconds = _run(runs, args[0]).seconds
        if seconds is None:
            raise ResultsError(f"{args[0]}: a target's run has no duration")
        return f"{seconds / 60:.0f}"
    if kind == "run":
        return run_line(_run(runs, args[0]))
    if kind == "pick":
        return "\n" + "\n".join(pick_lines(_run(runs, args[0]))) + "\n"
    if kind == "legend" and args and args[0] in LEGENDS:
        return "\n" + "\n".join(legend(LEGENDS[args[0]])) + "\n"
    raise ResultsError(f"unknown marker results:{kind} {'; '.join(args)}")


def fill_markers(text: str, runs: Sequence[Run], where: str = "") -> str:
    """`text` with every marker's content made from the runs."""
    by_name = {r.name: r for r in runs}

    def one(m: re.Match[str]) -> str:
        args = [a.strip() for a in m[2].split(SEP)] if m[2].strip() else []
        try:
            body = _fill(m[1], args, by_name)
        except ResultsError as e:
            raise ResultsError(f"{where}: {e}") from None
        return f"<!-- results:{m[1]}{m[2]} -->{body}<!-- /results -->"
    return MARKER.sub(one, text)


def documents(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The docs that may quote results: the README and docs/*.md (the page itself aside)."""
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.exists() and p != PAGE]


def stale(runs: Sequence[Run], root: pathlib.Path = ROOT) -> dict[pathlib.Path, str]:
    """Each file that is not what the results make it, with what it should hold (the page
    with the planning-time runs of their directory)."""
    out = {}
    page = render_page(runs, load_planning())
    if not PAGE.exists() or PAGE.read_text() != page:
        out[PAGE] = page
    for doc in documents(root):
        text = doc.read_text()
        filled = fill_markers(text, runs, str(doc.relative_to(root)))
        if filled != text:
            out[doc] = filled
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.results_page", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is stale")
    args = parser.parse_args(argv)
    try:
        todo = stale(load_dir())
    except ResultsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path, text in todo.items():
        shown = path.relative_to(ROOT)
        if args.check:
            print(f"stale: {shown} (run python -m benchmarks.results_page)", file=sys.stderr)
        else:
            path.write_text(text)
            print(f"wrote {shown}", file=sys.stderr)
    return 1 if args.check and todo else 0


if __name__ == "__main__":
    sys.exit(main())
