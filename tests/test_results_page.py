"""docs/results.md and the measured numbers the docs quote come from the committed results
files (docs/results/*.json): the page is made from them and the docs' markers are filled
from them, and a number written into docs/benchmarks.md by hand fails here."""
from __future__ import annotations

import json
import pathlib
import re

import pytest

from benchmarks import results_page
from benchmarks.columns import SUITE_COLUMNS, TARGET_COLUMNS, pick_suite, pick_target, within_noise
from benchmarks.measure import Stats
from benchmarks.records import Row
from benchmarks.results_files import RESULTS_DIR, ResultsError, load_dir, load_run
from benchmarks.strategies import ProgramMemory
from benchmarks.targets import TargetRow

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS_MD = ROOT / "docs" / "benchmarks.md"
EARLIER = "## Earlier measurements"  # dated, at a named commit: the one part with numbers of its own
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
# A measured number: a ratio with decimals (0.55x), or a size or a time with its unit.
MEASURED = re.compile(r"\b\d+\.\d+x\b|\b\d+(?:\.\d+)?\s?(?:KB|MB|GB|TB|ms|us|s|seconds?|minutes?)\b")


def test_the_results_page_and_the_docs_markers_are_current() -> None:
    stale = results_page.stale(load_dir())
    assert not stale, (f"not made from {RESULTS_DIR.relative_to(ROOT)}: "
                       f"{sorted(str(p.relative_to(ROOT)) for p in stale)}; run python -m benchmarks.results_page")


def test_each_suite_and_target_has_one_results_file_with_its_command() -> None:
    runs = load_dir()
    assert {r.is_target for r in runs} == {False, True}, "a suite's run and a compile-only target's"
    for r in runs:
        assert r.command.startswith("python -m benchmarks.run"), (r.file, r.command)
        assert r.machine.get("cpu_count") and r.versions.get("jax") and r.date[:4].isdigit()


def test_a_run_on_an_accelerator_names_it_in_its_title_and_machine(tmp_path: pathlib.Path) -> None:
    """A suite run on a GPU is titled by the device it ran on, not only "gpu" (the backend),
    and its machine line names it; a run on the host names none."""
    from benchmarks.records import machine_info
    assert "accelerator" not in machine_info()  # these tests run on the host's CPU
    data = json.loads((RESULTS_DIR / "cpu.json").read_text())
    data["backend"], data["machine"]["accelerator"] = "gpu", "1 x NVIDIA H200"
    (tmp_path / "gpu_run.json").write_text(json.dumps(data))
    run = load_run(tmp_path / "gpu_run.json")
    assert run.title.endswith("on 1 x NVIDIA H200")
    assert "- machine: 1 x NVIDIA H200; " in "\n".join(results_page._section(run))
    assert results_page.run_line(run).startswith(f"{run.date[:10]}, 1 x NVIDIA H200, jax ")


def _measured_outside_markers(text: str) -> list[str]:
    """The measured numbers in `text` outside markers, code blocks and inline code."""
    text = CODE.sub("", FENCE.sub("", results_page.MARKER.sub("", text)))
    return [m.group(0) for m in MEASURED.finditer(text)]


def test_benchmarks_md_quotes_measured_numbers_only_from_results_files() -> None:
    text = BENCHMARKS_MD.read_text()
    current, _, earlier = text.partition(EARLIER)
    assert earlier, f"docs/benchmarks.md has no section {EARLIER!r}"
    assert _measured_outside_markers(current) == [], "write measured numbers through a results marker"
    # What is left of the notebook is dated and names its commit.
    for heading in re.findall(r"^### (.*)$", earlier, re.M):
        assert re.search(r"\(20\d\d-\d\d-\d\d, .*\b[0-9a-f]{7}\)$", heading), heading


def test_a_hand_written_number_is_caught() -> None:
    assert _measured_outside_markers("budget 1 peaks at 0.55x the fused step, 12.5 MB") == ["0.55x", "12.5 MB"]
    assert _measured_outside_markers("a 4x4 loss, `aotgrad:min_cut@2.4GB`, B=8, 5%") == []
    assert _measured_outside_markers("<!-- results:minutes cpu -->11 minutes<!-- /results -->") == []


# ----------------------------------------------------------------------------- the files


def _write(tmp: pathlib.Path, name: str, data: object) -> pathlib.Path:
    p = tmp / name
    p.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return p


def test_a_missing_or_malformed_results_file_is_an_error_naming_it(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ResultsError, match="none.json: no such results file"):
        load_run(tmp_path / "none.json", tmp_path)
    with pytest.raises(ResultsError, match="bad.json: not a readable JSON file"):
        load_run(_write(tmp_path, "bad.json", "{"), tmp_path)
    good = json.loads((RESULTS_DIR / "cpu.json").read_text())
    no_date = {k: v for k, v in good.items() if k != "date"}
    with pytest.raises(ResultsError, match="nodate.json: no 'date' field"):
        load_run(_write(tmp_path, "nodate.json", no_date), tmp_path)
    row = {k: v for k, v in good["rows"][0].items() if k != "strategy"}
    with pytest.raises(ResultsError, match=r"norow.json: rows\[0\]: Row lacks the field 'strategy'"):
        load_run(_write(tmp_path, "norow.json", {**good, "rows": [row]}), tmp_path)
    with pytest.raises(ResultsError, match="no results files"):
        load_dir(tmp_path / "empty", tmp_path)


def test_two_files_of_one_suite_are_an_error_naming_both(tmp_path: pathlib.Path) -> None:
    good = (RESULTS_DIR / "cpu.json").read_text()
    _write(tmp_path, "a.json", good)
    _write(tmp_path, "b.json", good)
    with pytest.raises(ResultsError, match="a.json and b.json are both runs of suite"):
        load_dir(tmp_path, tmp_path)


def test_a_marker_that_names_nothing_is_an_error_naming_the_doc() -> None:
    runs = load_dir()
    with pytest.raises(ResultsError, match="guide.md: .*no row"):
        results_page.fill_markers("<!-- results:cell cpu; mlp; nope; step ms -->1<!-- /results -->", runs,
                                  "guide.md")
    with pytest.raises(ResultsError, match="guide.md: no results file nope.json"):
        results_page.fill_markers("<!-- results:minutes nope --><!-- /results -->", runs, "guide.md")
    cpu = next(r for r in runs if r.name == "cpu")
    first = cpu.rows[0]
    text = f"<!-- results:cell cpu; {first.workload}; {first.strategy}; step ms -->stale<!-- /results -->"
    assert f"-->{first.step.median * 1e3:.2f}<!--" in results_page.fill_markers(text, runs)
    row = f"| {first.strategy} | {text} |"  # in a table's cell: no pipe inside the marker
    assert results_page.fill_markers(row, runs).count("|") == 3


# ----------------------------------------------------------------------------- what to pick


def _row(strategy: str, median: float, iqr: float, peak: int, jitted: int | None) -> Row:
    step = Stats(median, median - iqr / 2, median + iqr / 2, median - iqr, median + iqr, 5)
    return Row("w", strategy, step=step, ratio_vs_fused=median / 10.0,
               memory=ProgramMemory(None, peak, None, None, jitted))


def test_the_pick_is_the_lowest_peak_within_five_percent_of_the_fused_time() -> None:
    rows = [_row("fused", 10.0, 0.2, 100, 100), _row("aotgrad:min_cut@0.5", 10.4, 0.5, 80, 60),
            _row("checkpoint:nothing_saveable", 12.0, 0.2, 40, 40), _row("jax_fwd_and_bwd", 10.1, 0.2, 50, None)]
    pick = pick_suite(rows)["w"]
    assert pick is not None and pick.strategy == "jax_fwd_and_bwd"  # no jitted step: its two programs' peak
    assert pick.peak_ratio == 0.5 and pick.noisy  # 0.1 apart, inside the IQR of 0.2
    pick = pick_suite(rows[:3])["w"]
    assert pick is not None and (pick.strategy, pick.peak_ratio, pick.noisy) == ("aotgrad:min_cut@0.5", 0.6, True)
    assert pick_suite(rows[1:])["w"] is None  # nothing to compare with
    alone = pick_suite(rows[:1])["w"]
    assert alone is not None and alone.strategy == "fused"
    same = pick_suite([_row("fused", 10.0, 0.2, 1000, 1000), _row("jax_fwd_and_bwd", 9.0, 0.2, 998, None)])["w"]
    # 0.998x shows as 1.00x: no lower peak than the fused step's as the tables show it
    assert same is not None and same.strategy == "fused"


def test_a_targets_pick_uses_bytes_moved_as_the_time() -> None:
    def row(strategy: str, act: int, moved: float) -> TargetRow:
        return TargetRow("w", strategy, act + 10, act, moved, 1.0, 1.0)
    rows = [row("fused", 100, 1e9), row("aotgrad:min_cut@0", 30, 1.2e9), row("aotgrad:min_cut@0.5", 50, 1.04e9)]
    pick = pick_target(rows)["w"]
    assert pick is not None and (pick.strategy, pick.peak_ratio) == ("aotgrad:min_cut@0.5", 0.5)


def test_noise_is_a_difference_within_the_wider_interquartile_range() -> None:
    a = Stats(10.0, 9.5, 10.5, 9.0, 11.0, 5)
    assert within_noise(a, Stats(10.9, 10.8, 11.0, 10.7, 11.1, 5))
    assert not within_noise(a, Stats(11.1, 11.0, 11.2, 10.9, 11.3, 5))


def test_every_column_has_a_legend_and_a_unique_name() -> None:
    for columns in (SUITE_COLUMNS, TARGET_COLUMNS):
        names = [c.name for c in columns]
        assert len(set(names)) == len(names) and all(c.legend for c in columns)


# ----------------------------------------------------------------------------- mixed precision


def test_the_mixed_precision_table_sets_autocast_beside_the_hand_written_model() -> None:
    """Per model: the float32 fused step, the hand-written bfloat16 model's rows
    (`<model>_bf16`, fused first), the autocast rows; ratios to the hand-written model's
    fused step (the anchor). A
    file without autocast rows or hand-written models has no such table."""
    from benchmarks.columns import MIXED_COLUMNS, mixed_precision

    def row(workload: str, strategy: str, act: int, moved: float, flops: float) -> TargetRow:
        return TargetRow(workload, strategy, act + 10, act, moved, flops, 1.0)
    rows = [row("gpt", "fused", 200, 120.0, 7.0), row("gpt", "autocast:bf16", 110, 75.0, 7.1),
            row("gpt", "aotgrad:min_cut@0", 40, 150.0, 8.0), row("gpt", "autocast:bf16@0", 30, 90.0, 8.3),
            row("gpt_bf16", "fused", 100, 60.0, 7.0), row("mlp", "fused", 5, 1.0, 1.0),
            row("gpt", "autocast:fp16", 120, 80.0, 7.1), row("gpt_bf16", "aotgrad:min_cut@1", 80, 66.0, 7.0),
            row("gpt_fp16", "fused", 100, 64.0, 7.0)]
    mixed, refs = mixed_precision(rows)
    assert [(r.workload, r.strategy) for r in mixed] == [
        ("gpt", "fused"), ("gpt_bf16", "fused"), ("gpt_bf16", "aotgrad:min_cut@1"), ("gpt_fp16", "fused"),
        ("gpt", "autocast:bf16"), ("gpt", "autocast:bf16@0"), ("gpt", "autocast:fp16")]
    cells = {(r.workload, r.strategy): {c.name: c.cell(r, refs(r)) for c in MIXED_COLUMNS} for r in mixed}
    assert cells[("gpt", "autocast:bf16")]["act / hand"] == "1.100x"
    assert cells[("gpt", "autocast:bf16")]["moved / hand"] == "1.250x"
    assert cells[("gpt", "autocast:bf16@0")]["act / hand"] == "0.300x"
    assert cells[("gpt", "fused")]["act / hand"] == "2.000x" and cells[("gpt_bf16", "fused")]["act / hand"] == "1.000x"
    assert cells[("gpt", "autocast:bf16")]["act / fp32"] == "0.55x"
    assert cells[("gpt", "autocast:fp16")]["moved / hand"] == "1.250x"  # against the float16 one
    assert cells[("gpt_fp16", "fused")]["moved / hand"] == "1.000x"
    assert cells[("gpt_bf16", "aotgrad:min_cut@1")]["act / hand"] == "0.800x"  # against the hand-written fused step
    assert mixed_precision([r for r in rows if "16" not in r.workload + r.strategy])[0] == []
    # Autocast rows without a hand-written model: shown, no ratio to it.
    alone, refs = mixed_precision(rows[:2])
    assert [c.cell(alone[1], refs(alone[1])) for c in MIXED_COLUMNS if c.name == "act / hand"] == ["-"]


def test_the_page_shows_the_mixed_precision_table_for_a_file_that_has_one() -> None:
    runs = load_dir()
    page = results_page.render_page(runs)
    for run in runs:
        section = "\n".join(results_page._section(run))
        has = run.is_target and any(r.strategy.startswith("autocast:") or r.workload.endswith("_bf16")
                                    for r in run.target_rows)
        assert (results_page.MIXED_HEADING in section) == has, run.file
        assert section in page
    assert any(results_page.MIXED_HEADING in "\n".join(results_page._section(r)) for r in runs), \
        "docs/results/ holds a run of the hand-written bfloat16 models beside autocast"


def test_a_marker_reads_the_mixed_precision_columns_of_a_target_file() -> None:
    runs = load_dir()
    text = "<!-- results:cell h100_autocast; gpt; autocast:bf16; act / hand -->?<!-- /results -->"
    filled = results_page.fill_markers(text, runs)
    ratio = float(filled.split("-->")[1].split("<!--")[0].rstrip("x"))
    rows = {(r.workload, r.strategy): r for r in next(r for r in runs if r.name == "h100_autocast").target_rows}
    want = rows[("gpt", "autocast:bf16")].activation_peak / rows[("gpt_bf16", "fused")].activation_peak
    assert abs(ratio - want) < 1e-3, (filled, want)


def _planning_file(path: pathlib.Path, jax: str, rows: list[tuple[int, float, float, float]]) -> None:
    path.write_text(json.dumps({
        "date": "2026-11-30T12:00:00+00:00", "jax": jax, "backend": "cpu", "repeats": 3,
        "sizes": {"batch": 1, "seq": 8}, "machine": {"cpu_count": 2, "cpu_model": "Some CPU"},
        "versions": {"jax": jax, "commit": "abc1234"}, "command": f"python -m benchmarks.planning_time --jax {jax}",
        "rows": [{"layers": n, "budget": b, "plain_cpu_s": p, "aotgrad_cpu_s": a} for n, b, p, a in rows]}))


def test_the_page_shows_planning_time_per_jax_version_with_each_rows_ratio(tmp_path: pathlib.Path) -> None:
    """Each cell is aotgrad's seconds over its own row's plain lowering (the budgets' plain
    runs differ), versions in numeric order (0.9 before 0.10), the worst ratio against the goal."""
    from benchmarks.planning_results import load_planning, planning_section
    _planning_file(tmp_path / "a.json", "0.10.2", [(12, 1.0, 0.5, 1.0), (12, 0.5, 0.4, 1.4)])
    _planning_file(tmp_path / "b.json", "0.9.1", [(12, 1.0, 0.5, 0.6), (24, 1.0, 1.0, 3.5)])
    runs = load_planning(tmp_path)
    assert [r.jax for r in runs] == ["0.9.1", "0.10.2"]
    text = "\n".join(planning_section(runs))
    assert "| 12 | 0.40-0.50 s | 1.00 s (2.0x) | 1.40 s (3.5x) |" in text
    assert "| 24 | 1.00 s | 3.50 s (3.5x) |" in text
    assert "At most 3.50x the plain step (over the goal)." in text
    assert "2-core Some CPU, aotgrad at abc1234. Command: `python -m benchmarks.planning_time --jax 0.9.1`." in text
    page = results_page.render_page(load_dir(), runs)
    assert "- [Planning time](#planning-time)" in page and text in page
    assert "Planning time" not in results_page.render_page(load_dir(), [])


def test_a_malformed_planning_file_is_an_error_naming_it(tmp_path: pathlib.Path) -> None:
    from benchmarks.planning_results import load_planning
    (tmp_path / "bad.json").write_text(json.dumps({"date": "2026-11-30", "rows": [{"layers": 2}]}))
    with pytest.raises(ResultsError, match=r"bad\.json: not a planning-time file"):
        load_planning(tmp_path)
