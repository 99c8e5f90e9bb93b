"""benchmarks.gpu_busy: the busy share over a window from nvidia-smi's looped CSV lines."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from benchmarks.gpu_busy import GpuSampler

FAKE_SMI = """#!/bin/sh
# Two GPUs: index 0 at 80%, index 1 at 40%; a line nvidia-smi prints for an unsupported field.
echo "[N/A], [N/A], [N/A]"
while true; do
  printf "0, 80, 1000\n1, 40, 3000\n"   # one write: a stop never falls between the two GPUs' lines
  sleep 0.05
done
"""


@pytest.fixture
def smi_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    exe = tmp_path / "nvidia-smi"
    exe.write_text(FAKE_SMI)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return exe


def test_busy_share_and_peak_over_the_window(smi_on_path: Path) -> None:
    with GpuSampler(period_s=0.1) as gpu:
        time.sleep(0.6)
    t_end = time.time()
    assert gpu.samples, "no sample read from nvidia-smi"
    assert gpu.busy(0.0, t_end) == pytest.approx(0.6)  # mean over both GPUs
    assert gpu.peak_mib(0.0, t_end) == 3000.0
    assert gpu.busy(t_end + 1, t_end + 2) is None  # nothing sampled there
    assert gpu.proc is not None and gpu.proc.poll() is not None  # the loop was stopped


def test_without_nvidia_smi_there_is_no_figure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with GpuSampler() as gpu:
        pass
    assert gpu.busy(0.0, time.time()) is None and gpu.peak_mib(0.0, time.time()) is None
