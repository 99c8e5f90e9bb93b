"""How busy the GPUs were over a time window, from ``nvidia-smi`` samples taken while a run goes on.

``GpuSampler`` runs ``nvidia-smi --query-gpu=index,utilization.gpu,memory.used --loop-ms=<period>`` in the
background and stamps each line with this machine's clock as it arrives; ``busy(t0, t1)`` is the
mean ``utilization.gpu`` (the share of the sample period in which any kernel ran, per nvidia-smi)
of the samples in ``[t0, t1]``, over all visible GPUs. Without nvidia-smi the sampler records
nothing and ``busy`` returns None, so CPU runs report no figure rather than a wrong one.

    with GpuSampler() as gpu:
        run()
    gpu.busy(t_first_step, t_last_step)   # e.g. 0.83
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from types import TracebackType


class GpuSampler:
    def __init__(self, period_s: float = 0.5) -> None:
        self.period_ms = max(100, int(period_s * 1000))
        self.samples: list[tuple[float, int, float, float]] = []  # (time, gpu index, util %, MiB used)
        self.proc: subprocess.Popen[str] | None = None
        self.reader: threading.Thread | None = None

    def __enter__(self) -> GpuSampler:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return self
        self.proc = subprocess.Popen(
            [
                exe,
                "--query-gpu=index,utilization.gpu,memory.used",
                "--format=csv,noheader,nounits",
                f"--loop-ms={self.period_ms}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                index, util, mem = int(parts[0]), float(parts[1]), float(parts[2])
            except (IndexError, ValueError):
                continue  # "[N/A]" or a partial line
            self.samples.append((time.time(), index, util, mem))

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        if self.reader is not None:
            self.reader.join(timeout=10)

    def window(self, t0: float, t1: float) -> list[tuple[float, int, float, float]]:
        return [s for s in self.samples if t0 <= s[0] <= t1]

    def busy(self, t0: float, t1: float) -> float | None:
        """Mean GPU utilisation (0-1) over ``[t0, t1]``; None without samples there."""
        inside = self.window(t0, t1)
        return sum(s[2] for s in inside) / (100.0 * len(inside)) if inside else None

    def peak_mib(self, t0: float, t1: float) -> float | None:
        inside = self.window(t0, t1)
        return max(s[3] for s in inside) if inside else None
