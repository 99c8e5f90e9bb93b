"""bench_async --dry-run: the runs it would start and where each role would compute, nothing started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("flags", [("--max-staleness", "--naive-max-staleness"), ("--etas", "--naive-etas")])
def test_the_two_gpu_plan_puts_generation_and_the_trainer_on_their_own_gpus(
    tmp_path: Path, flags: tuple[str, str]
) -> None:
    """Runs are labelled by their rollout.max_staleness; the flags' other spellings (``--etas``,
    ``--naive-etas``) plan the same runs."""
    out = tmp_path / "bench"
    bounds, naive = flags
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_async", "--config", "configs/gsm8k_2gpu.yaml", bounds, "0,2",
         naive, "", "--affinity", "", "--cuda-devices", "generation=0;trainer=1", "--dry-run",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    runs = [line for line in lines if line.startswith("max_staleness")]
    assert [r.split(":")[0] for r in runs] == ["max_staleness0", "max_staleness2"]
    assert all("AREAL_CUDA_DEVICES='generation=0;trainer=1'" in r for r in runs)
    assert "--set rollout.max_staleness=2" in runs[1]
    places = {line.split()[0]: line for line in lines if line.startswith("  ")}
    assert (
        places["generation"].endswith("CUDA_VISIBLE_DEVICES=0")
        and "local engine on cuda" in places["generation"]
    )
    assert places["trainer"].endswith("CUDA_VISIBLE_DEVICES=1")
    assert "weights by nccl" in places["weight-sync"]
    assert not out.exists(), "a dry run starts nothing and writes nothing"
