"""Unit tests of benchmarks.report and benchmarks.harness: the page of baselines and --check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import harness, report

METRICS: dict[str, harness.Direction] = {"train_s": "lower", "train_tok_s": "higher"}


def trainer_result(train_s: float, train_tok_s: float, **params: Any) -> dict[str, Any]:
    rows = [{"case": "tiny bfloat16", "train_s": train_s, "train_tok_s": train_tok_s, "peak_mem_gb": 1.0}]
    return harness.make_result("trainer", {"seqs": 16, **params}, rows, METRICS)


@pytest.fixture
def baselines(tmp_path: Path) -> Path:
    root = tmp_path / "baselines"
    harness.save_baseline(trainer_result(2.0, 1000.0), root)
    return root


def write(tmp_path: Path, doc: dict[str, Any]) -> Path:
    path = tmp_path / "new.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_result_names_its_machine_and_keeps_paths_inside_the_repository() -> None:
    """make_result fills the layout; paths lose the machine; output arguments are not params."""
    args = {"config": harness.REPO / "configs" / "arith_cpu.yaml", "model": "/data/m/smol", "out": "/tmp/x"}
    doc = harness.make_result("trainer", args, [{"case": "a", "train_s": 1.0}], METRICS)
    assert set(doc) >= {"benchmark", "hardware", "time", "command", "env", "params", "metrics", "results"}
    assert doc["params"] == {"config": "configs/arith_cpu.yaml", "model": "smol"}
    assert doc["hardware"] == harness.hardware_key(doc["env"])
    assert doc["hardware"].startswith("cpu-")
    assert doc["env"]["python"] and doc["env"]["cpu"]["cores"]


def test_hardware_keys_name_the_gpu_or_the_cpu_bf16_class() -> None:
    """An H200 is ``h200``; a CPU is keyed by its best bf16 instruction set and its cores."""
    assert harness.hardware_key({"gpu": "NVIDIA H200"}) == "h200"
    amx = {"gpu": None, "cpu": {"flags": ["avx2", "avx512f", "amx_bf16"], "cores": 2}}
    assert harness.hardware_key(amx) == "cpu-amx-2c"
    assert harness.hardware_key({"cpu": {"flags": ["avx2"], "cores": 8}}) == "cpu-avx2-8c"


def test_one_baseline_per_benchmark_and_hardware_and_a_new_one_replaces_it(baselines: Path) -> None:
    """save_baseline writes <benchmark>__<hardware>.json; saving again overwrites that file."""
    newer = trainer_result(1.5, 1300.0)
    path = harness.save_baseline(newer, baselines)
    assert [p.name for p in baselines.iterdir()] == [f"trainer__{newer['hardware']}.json"]
    assert json.loads(path.read_text())["results"][0]["train_s"] == 1.5


def test_the_page_has_a_table_row_per_hardware_and_case(baselines: Path) -> None:
    """render_page: a section per benchmark, a column per metric with its direction, the numbers."""
    page = report.render_page(report.load_baselines(baselines))
    hardware = report.load_baselines(baselines)[0]["hardware"]
    assert "## trainer" in page
    assert "| hardware | case | train_s ↓ | train_tok_s ↑ |" in page
    assert f"| {hardware} | tiny bfloat16 | 2 | 1,000 |" in page
    assert "peak_mem_gb" not in page  # not a declared metric


def test_check_flags_a_metric_more_than_five_percent_worse(
    tmp_path: Path, baselines: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step 8% slower (lower is better) is a regression: exit 1, the metric named."""
    new = write(tmp_path, trainer_result(2.16, 1000.0))
    assert report.check([new], root=baselines) == 1
    out = capsys.readouterr().out
    assert "REGRESSED tiny bfloat16: train_s 2 -> 2.16 (+8.0%, lower is better)" in out
    assert "1 of 2 metrics regressed" in out


def test_check_flags_lower_throughput_and_passes_higher(tmp_path: Path, baselines: Path) -> None:
    """For a higher-is-better metric the direction flips: 10% fewer tokens/s regress, 10% more do not."""
    assert report.check([write(tmp_path, trainer_result(2.0, 900.0))], root=baselines) == 1
    assert report.check([write(tmp_path, trainer_result(2.0, 1100.0))], root=baselines) == 0


def test_check_passes_a_result_within_noise_and_names_changed_params(
    tmp_path: Path, baselines: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Changes under 5% either way pass (exit 0); a different workload is pointed out."""
    new = write(tmp_path, trainer_result(2.08, 970.0, compile=True))
    assert report.check([new], root=baselines) == 0
    out = capsys.readouterr().out
    assert "no regression" in out
    assert "params differ from the baseline's: compile None -> True" in out


def test_reference_rows_are_shown_but_not_checked(tmp_path: Path) -> None:
    """A row marked ``reference`` (the yardstick, e.g. plain generate) cannot regress the check."""
    rows = [{"case": "generate", "tok_s": 100.0, "reference": True}, {"case": "engine", "tok_s": 500.0}]
    harness.save_baseline(harness.make_result("engine", {}, rows, {"tok_s": "higher"}), tmp_path / "b")
    slower = [{"case": "generate", "tok_s": 50.0, "reference": True}, {"case": "engine", "tok_s": 500.0}]
    new = write(tmp_path, harness.make_result("engine", {}, slower, {"tok_s": "higher"}))
    assert report.check([new], root=tmp_path / "b") == 0
    assert "| generate (reference) | 100 |" in report.render_page(report.load_baselines(tmp_path / "b"))


def test_check_without_a_baseline_says_so_and_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A result whose (benchmark, hardware) has no baseline yet is reported, not failed."""
    new = write(tmp_path, trainer_result(9.0, 1.0))
    assert report.check([new], root=tmp_path / "empty") == 0
    assert "no baseline" in capsys.readouterr().out


def test_a_file_in_another_layout_is_refused_with_the_fix(tmp_path: Path) -> None:
    """load_result names the file and the missing keys."""
    path = write(tmp_path, {"env": {}, "rows": []})
    with pytest.raises(ValueError, match=r"new.json: not a benchmark result \(missing"):
        harness.load_result(path)


def test_the_repository_baselines_render(tmp_path: Path) -> None:
    """Every committed baseline loads, and the page lists each (benchmark, hardware) of them."""
    docs = report.load_baselines()
    assert docs, "benchmarks/baselines/ holds no baseline"
    page = report.render_page(docs)
    for doc in docs:
        assert f"## {doc['benchmark']}" in page
        assert f"| {doc['hardware']} | {doc['results'][0]['case']} |" in page
