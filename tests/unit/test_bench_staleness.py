"""bench_staleness without running anything: the grid's cells, resuming from the results file, and the
rendered section of the benchmarks page (tables with mean and spread over seeds, the figure)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_staleness, report, staleness_report
from benchmarks.bench_staleness import plan, summarize_run

PAGE = f"""# Benchmarks

## logprob

table

## staleness_grid

Intro written by hand.

{staleness_report.START}
old table
{staleness_report.END}

Reading written by hand.

## trainer

table
"""


def record(bound: int, variant: str, seed: int, *, tok_s: float, accuracy: float) -> dict[str, Any]:
    """A results-file record of a 60-step run (10 s per step) whose accuracy climbs to ``accuracy``."""
    objective = "naive" if variant == "naive" else "decoupled"
    mode = variant if variant in ("recompute", "finish") else "keep"
    steps = [
        {"time": 1000.0 + 10 * i, "step_s": 10.0, "behave_capped_fraction": 0.001, "behave_weight_max": 3.0}
        for i in range(1, 61)
    ]
    evals = [
        {"policy_version": v, "time": 1005.0 + 10 * v, "eval/accuracy": accuracy * v / 60}
        for v in range(0, 61, 5)
    ]
    return {
        "name": f"max_staleness{bound}-{variant if mode != 'keep' or objective == 'naive' else 'decoupled'}-s{seed}",
        "max_staleness": bound,
        "objective": objective,
        "kv_after_load": mode,
        "seed": seed,
        "config": "configs/arith_cpu.yaml",
        "overrides": [],
        "extra": [],
        "machine": "Test CPU",
        "hardware": "cpu-test-2c",
        "commit": "abcdef0123",
        "time": "2026-12-06T00:00:00+00:00",
        "steps": 60,
        "wall_s": 700.0,
        "startup_s": 20.0,
        "trained_tokens_per_s": tok_s,
        "seconds_per_step": 10.0,
        "staleness_mean": 0.8 * bound,
        "staleness_max": float(bound),
        **summarize_run(steps, evals, range(10, 61, 10), [120, 240, 480]),
    }


def test_the_grids_have_a_cell_per_bound_variant_and_seed() -> None:
    """staleness: 5 bounds x {decoupled, naive}; interrupt: bounds 2, 4 x {keep, recompute, finish};
    cells run seed by seed, and a keep cell is the staleness grid's decoupled run."""
    staleness = plan("staleness", None, [0, 1])
    assert len(staleness) == 20
    assert [c.name for c in staleness[:4]] == [
        "max_staleness0-decoupled-s0",
        "max_staleness0-naive-s0",
        "max_staleness1-decoupled-s0",
        "max_staleness1-naive-s0",
    ]
    assert {c.seed for c in staleness[:10]} == {0}
    interrupt = plan("interrupt", None, [0, 1])
    assert [c.name for c in interrupt[:6]] == [
        "max_staleness2-keep-s0", "max_staleness2-recompute-s0", "max_staleness2-finish-s0", "max_staleness4-keep-s0", "max_staleness4-recompute-s0", "max_staleness4-finish-s0",
    ]  # fmt: skip
    assert interrupt[0].run.name == "max_staleness2-decoupled-s0"
    assert {c.mode for c in interrupt} == {"keep", "recompute", "finish"}
    assert {c.mode for c in staleness} == {"keep"}
    assert not [c for c in staleness if c.name.startswith("max_staleness2-naive")][0].decoupled
    assert len({c.run for c in plan("all", None, [0, 1])}) == 28


def test_dry_run_lists_only_cells_missing_from_the_results_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Cells in the results file are skipped (max_staleness2-keep with its decoupled run); the rest are printed
    with their exact command; nothing runs and nothing is written."""
    results = tmp_path / "grid.json"
    for cell in (
        record(0, "decoupled", 0, tok_s=40, accuracy=0.6),
        record(2, "decoupled", 0, tok_s=60, accuracy=0.6),
    ):
        staleness_report.save_cell(results, cell)
    before = results.read_text()
    out_dir = tmp_path / "runs"
    bench_staleness.main(["--dry-run", "--results", str(results), "--out", str(out_dir), "--seeds", "0"])
    out = capsys.readouterr().out
    commands = {
        line.split(":")[0].split()[0]: line for line in out.splitlines() if line.startswith("max_staleness")
    }
    assert "12 runs to do; 2 already in" in out
    assert "done: max_staleness2-decoupled-s0 = max_staleness2-keep-s0" in out
    assert "max_staleness0-decoupled-s0" not in commands and "max_staleness2-decoupled-s0" not in commands
    assert "max_staleness2-keep-s0" not in commands
    finish = commands["max_staleness4-finish-s0"]
    for override in ("rollout.max_staleness=4", "trainer.total_steps=60", "trainer.loss.decoupled=true"):
        assert f"--set {override}" in finish
    assert "--set rollout.kv_after_load=finish --set seed=0" in finish
    assert "trainer.loss.decoupled=false" in commands["max_staleness8-naive-s0"]
    assert results.read_text() == before and not out_dir.exists()


def test_summarize_run_reads_accuracy_at_steps_and_at_wall_times() -> None:
    """Accuracy at step s is the last evaluation at a version <= s, at T seconds the last one finished
    by then (seconds from the first step's start); a target never reached has no time."""
    steps = [{"time": 100.0 + 10 * i, "step_s": 10.0, "behave_weight_max": float(i)} for i in range(1, 21)]
    evals = [
        {"policy_version": 0, "time": 95.0, "eval/accuracy": 0.0},
        {"policy_version": 10, "time": 205.0, "eval/accuracy": 0.55},
        {"policy_version": 20, "time": 305.0, "eval/accuracy": 0.5},
    ]
    got = summarize_run(steps, evals, [5, 10, 20], [50, 105, 400])
    assert got["accuracy_at_step"] == {"5": 0.0, "10": 0.55, "20": 0.5}
    assert got["accuracy_at_s"] == {"50": 0.0, "105": 0.55, "400": 0.5}
    assert got["time_to_50_s"] == 105.0 and got["time_to_60_s"] is None
    assert got["final_accuracy"] == 0.5 and got["train_s"] == 200.0
    assert got["behave_weight_max_mean"] == 10.5 and got["behave_weight_max_max"] == 20.0
    assert got["behave_capped_fraction_mean"] == 0.0


def test_render_writes_tables_with_mean_and_spread_and_the_figure(tmp_path: Path) -> None:
    """--render replaces only the marked region: per grid a speed and an accuracy table with mean ±
    half-range over seeds, the comparison against the seed spread, the figure's link and file."""
    results, page, figure = (
        tmp_path / "grid.json",
        tmp_path / "docs" / "benchmarks.md",
        tmp_path / "docs" / "grid.png",
    )
    page.parent.mkdir()
    page.write_text(PAGE)
    cells = [
        record(0, "decoupled", 0, tok_s=40, accuracy=0.60), record(0, "decoupled", 1, tok_s=44, accuracy=0.64),
        record(2, "decoupled", 0, tok_s=60, accuracy=0.62), record(2, "decoupled", 1, tok_s=70, accuracy=0.66),
        record(2, "naive", 0, tok_s=66, accuracy=0.40), record(2, "naive", 1, tok_s=64, accuracy=0.44),
        record(2, "finish", 0, tok_s=50, accuracy=0.60), record(2, "finish", 1, tok_s=52, accuracy=0.70),
    ]  # fmt: skip
    for cell in cells:
        staleness_report.save_cell(results, cell)
    assert list(json.loads(results.read_text())["cells"]) == sorted(c["name"] for c in cells)
    bench_staleness.main(
        ["--render", "--results", str(results), "--page", str(page), "--figure", str(figure)]
    )
    text = page.read_text()
    assert "old table" not in text
    assert (
        "Intro written by hand." in text and "Reading written by hand." in text and text.endswith("table\n")
    )
    region = text.split(staleness_report.START)[1].split(staleness_report.END)[0]
    assert "| max_staleness | loss | seeds | trained tok/s |" in region
    assert (
        "| 2 | decoupled | 2 | 65.0 ± 5.0 | 10.00 ± 0.00 | 1.60 ± 0.00 / 2 | 0.100 ± 0.000 / 0.100 | 3.0 ± 0.0 / 3.0 |"
        in region
    )
    assert (
        "| 2 | naive | 2 | 65.0 ± 1.0 | 10.00 ± 0.00 | 1.60 ± 0.00 / 2 | n/a (w = 1) | n/a (w = 1) |"
        in region
    )
    assert "| max_staleness | kv_after_load |" in region and "| 2 | finish | 2 | 51.0 ± 1.0 |" in region
    assert "| 2 | decoupled | 0.11 ± 0.00 | 0.21 ± 0.01 |" in region  # acc @10, @20: accuracy * v / 60
    assert (
        "| max_staleness2 naive vs decoupled | +0% within | **-34% apart** | **-34% apart** (@480 s) | - |"
        in region
    )
    assert "| max_staleness2 finish vs keep | **-22% apart** | +2% within |" in region
    assert "![staleness grid](grid.png)" in region and "Test CPU (cpu-test-2c)" in region
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_of_an_empty_results_file_says_no_cells_are_measured(tmp_path: Path) -> None:
    """A missing results file renders the region as 'no cells measured yet' and writes no figure."""
    page, figure = tmp_path / "benchmarks.md", tmp_path / "grid.png"
    page.write_text(PAGE)
    bench_staleness.main(
        ["--render", "--results", str(tmp_path / "none.json"), "--page", str(page), "--figure", str(figure)]
    )
    assert "No cells measured yet" in page.read_text() and not figure.exists()


def test_the_report_keeps_the_rendered_section_when_it_rewrites_the_page() -> None:
    """benchmarks.report regenerates the page from baselines but keeps marked sections verbatim, in
    alphabetical order among the benchmarks."""
    kept = report.kept_sections(PAGE)
    assert list(kept) == ["staleness_grid"] and kept["staleness_grid"].endswith("Reading written by hand.")
    page = report.render_page(report.load_baselines(), kept)
    assert kept["staleness_grid"] in page
    assert page.index("## logprob") < page.index("## staleness_grid") < page.index("## trainer")
