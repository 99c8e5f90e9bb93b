"""What every benchmark shares: the machine it ran on, one result layout, baselines.

A result is one JSON document::

    {
      "benchmark": "trainer",                  # the module's name without ``bench_``
      "hardware": "h200",                      # hardware_key(): the GPU, or the CPU class and cores
      "time": "2026-12-04T12:27:27+00:00",     # when it was measured (UTC)
      "command": "python -m benchmarks.bench_trainer --device cuda ...",
      "env": {...},                            # capture_env(): versions, CPU, GPU, git commit
      "params": {...},                         # the run's arguments
      "metrics": {"train_s": "lower", ...},    # the compared metrics, each lower- or higher-is-better
      "results": [{"case": "...", "train_s": 0.69, ...}, ...],
      "note": "..."                            # optional: how to read it
    }

Each row of ``results`` names its ``case`` (unique within the result); ``report --check`` compares
a new result with the baseline case by case, metric by metric, except rows with
``"reference": true`` (the yardstick a benchmark measures against, not the project's code). Paths
in ``params`` and ``command`` are relative to the repository (``repo_path``).

The repository keeps one baseline per (benchmark, hardware) in
``benchmarks/baselines/<benchmark>__<hardware>.json``; ``save_baseline`` replaces it and git
history keeps the old one. ``python -m benchmarks.report`` renders docs/benchmarks.md from them.

Torch is imported here only where the benchmark already imported it or computed on CUDA (GPU name,
versions).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[1]
BASELINES = REPO / "benchmarks" / "baselines"

Direction = Literal["lower", "higher"]

_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""CPU flags recorded in ``env``: they decide whether bf16 runs natively (the trainer's dtype)."""

_OUTPUT_ARGS = ("out", "save_baseline")
"""Arguments that say where a result goes, not what was measured: left out of ``params``."""


def cpu_info() -> dict[str, Any]:
    """CPU model, the flags of ``_CPU_FLAGS`` it has, and its logical cores (Linux /proc/cpuinfo)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    return {"model": model, "flags": [f for f in _CPU_FLAGS if f in flags], "cores": os.cpu_count()}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if out.strip() else "")


def capture_env(device: str = "cpu") -> dict[str, Any]:
    """The software and machine a result came from. ``device`` is where the benchmark computed."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": cpu_info(),
        "gpu": None,
        "device": device,
        "commit": _git_commit(),
    }
    torch = sys.modules.get("torch")
    if torch is None and device.startswith("cuda"):
        import torch  # a whole-run benchmark computed on the GPU in its child processes
    if torch is not None:
        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
        if device.startswith("cuda") and torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name()
            env["cuda"] = torch.version.cuda
    return env


def hardware_key(env: Mapping[str, Any]) -> str:
    """``h200`` for a run on an NVIDIA H200; on a CPU its bf16 class and cores, e.g. ``cpu-amx-2c``.

    The CPU class is the best of ``amx`` (AMX tiles), ``avx512bf16``, ``avx512``, ``avx2``, or the
    architecture: it decides how fast bf16 (and so the trainer) runs there."""
    if env.get("gpu"):
        name = re.sub(r"^nvidia\s+", "", str(env["gpu"]).strip(), flags=re.IGNORECASE)
        return _slug(name)
    cpu = env.get("cpu") or {}
    flags = set(cpu.get("flags") or ())
    classes = (("amx", "amx_bf16"), ("avx512bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2"))
    isa = next((name for name, flag in classes if flag in flags), None)
    isa = isa or _slug(str(env.get("platform") or "unknown").split()[-1])
    return f"cpu-{isa}-{cpu.get('cores') or 0}c"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def repo_path(value: str | Path) -> str:
    """A path without the machine in it: relative inside the repository, ``~/...`` under the home
    directory, else only its last component."""
    path = Path(value).expanduser()
    if not path.is_absolute():
        return path.as_posix()
    path = path.resolve()
    if path.is_relative_to(REPO):
        return path.relative_to(REPO).as_posix() or "."
    if path.is_relative_to(Path.home()):
        return "~/" + path.relative_to(Path.home()).as_posix()
    return path.name


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return repo_path(value)
    if isinstance(value, str) and value.startswith(("/", "~")):
        return repo_path(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def command(module: str, argv: Sequence[str]) -> str:
    """The command that reproduces a run: ``python -m MODULE ARGS`` with repo-relative paths."""
    words = ["python", "-m", module]
    words += [w if w.startswith("-") else str(_jsonable(w)) for w in argv]
    return shlex.join(words)


def add_output_args(parser: argparse.ArgumentParser, *, out_help: str = "write the result JSON here") -> None:
    """``--out FILE`` and ``--save-baseline``, the same in every benchmark."""
    parser.add_argument("--out", type=Path, default=None, help=out_help)
    parser.add_argument(
        "--save-baseline",
        action="store_true",
        help="also write the result as benchmarks/baselines/<benchmark>__<hardware>.json",
    )


def make_result(
    benchmark: str,
    args: argparse.Namespace | Mapping[str, Any],
    results: Sequence[Mapping[str, Any]],
    metrics: Mapping[str, Direction],
    *,
    device: str = "cpu",
    note: str | None = None,
    drop: Sequence[str] = (),
) -> dict[str, Any]:
    """One result document (module docstring) for rows measured just now on this machine.

    ``args`` become ``params`` without the output arguments and ``drop``; every row needs a
    ``case``, and every metric a direction."""
    cases = [row.get("case") for row in results]
    if None in cases or len(set(cases)) != len(cases):
        raise ValueError(f"every result row needs a unique 'case', got {cases}")
    bad = {k: v for k, v in metrics.items() if v not in ("lower", "higher")}
    if bad:
        raise ValueError(f"metric directions must be 'lower' or 'higher', got {bad}")
    raw = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    params = {k: v for k, v in raw.items() if k not in _OUTPUT_ARGS and k not in drop}
    env = capture_env(device)
    doc: dict[str, Any] = {
        "benchmark": benchmark,
        "hardware": hardware_key(env),
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command(f"benchmarks.bench_{benchmark}", _reproducing_argv(sys.argv[1:])),
        "env": env,
        "params": _jsonable(params),
        "metrics": dict(metrics),
        "results": _jsonable(list(results)),
    }
    if note:
        doc["note"] = note
    return doc


def _reproducing_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--out X`` and ``--save-baseline``."""
    out: list[str] = []
    skip = False
    for word in argv:
        if skip:
            skip = False
            continue
        if word == "--out":
            skip = True
            continue
        if word.startswith("--out=") or word == "--save-baseline":
            continue
        out.append(word)
    return out


def baseline_path(benchmark: str, hardware: str, root: Path = BASELINES) -> Path:
    return root / f"{benchmark}__{hardware}.json"


def write_json(doc: Mapping[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def save_baseline(doc: Mapping[str, Any], root: Path = BASELINES) -> Path:
    """Write ``doc`` as the baseline of its (benchmark, hardware), replacing the previous one."""
    return write_json(doc, baseline_path(doc["benchmark"], doc["hardware"], root))


def emit(doc: Mapping[str, Any], out: Path | None, save: bool) -> None:
    """Write the result where the output arguments say, and say where."""
    if out is not None:
        print(f"wrote {write_json(doc, out)}")
    if save:
        print(f"baseline {repo_path(save_baseline(doc))}")


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    """Rows as aligned plain-text columns, those of ``columns`` that some row has, in that order."""
    columns = [c for c in columns if any(c in r for r in rows)]
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def load_result(path: Path) -> dict[str, Any]:
    """Read a result document; ValueError naming the file and the missing keys if it is not one."""
    doc = json.loads(Path(path).read_text())
    missing = [
        k
        for k in ("benchmark", "hardware", "metrics", "results")
        if not isinstance(doc, dict) or k not in doc
    ]
    if missing:
        raise ValueError(
            f"{path}: not a benchmark result (missing {missing}); write one with a benchmark's --out"
        )
    return doc
