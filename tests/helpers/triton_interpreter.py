"""Run a snippet under Triton's CPU interpreter (`TRITON_INTERPRET=1`) in a subprocess.

CI has no GPU; the interpreter executes the CUDA kernels' source on CPU tensors with numpy.
Triton lives outside `.venv` (`scripts/test.sh` installs it into `.cache/triton`) and is imported
only in the subprocess, so the suite's own torch never sees it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRITON_DIR = Path(os.environ.get("AREAL_TRITON_DIR", ROOT / ".cache" / "triton"))

needs_triton = pytest.mark.skipif(
    not (TRITON_DIR / "triton").is_dir(), reason=f"no Triton at {TRITON_DIR} (scripts/test.sh installs it)"
)
"""Skip marker for tests that need the interpreter's Triton."""


def run_interpreted(code: str) -> Any:
    """Run `code` under the interpreter; return the JSON its last stdout line holds."""
    env = os.environ | {
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(TRITON_DIR), str(ROOT)]),
        "PYTHONWARNINGS": "ignore",
    }
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
