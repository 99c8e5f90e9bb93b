"""Live progress display of ``areal-async run`` (rich), built from the run directory.

Reads what the workers already write: ``metrics.jsonl`` (trainer, one line per step),
``eval.jsonl`` (controller, one line per evaluation) and each worker's JSON log under
``logs/`` (last ``status`` event = its health), and the watchdog's ``stalls.jsonl`` (a role
stalled and not yet healed is marked). No bus connection is needed, so the
display can never slow the run down. The launcher adds what only it knows per role: whether
the process is up, its restarts, and the peak resident memory of its process tree.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table

from workers.report import format_rss


def _tail_json(path: Path, max_bytes: int = 65536) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - max_bytes))
        chunk = f.read().decode(errors="replace")
    rows = []
    for line in chunk.splitlines()[1 if size > max_bytes else 0 :]:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def role_health(run_dir: Path, role: str) -> tuple[str, str, float | None]:
    """(status, detail, seconds since the worker last logged) from the newest log of ``role``."""
    logs = sorted((run_dir / "logs").glob(f"{role}-*.jsonl"), key=lambda p: p.stat().st_mtime)
    if not logs:
        return "starting", "", None
    rows = _tail_json(logs[-1])
    status, detail = "running", ""
    for row in rows:
        if row.get("event") == "status":
            status, detail = row.get("status", status), row.get("detail") or ""
    return status, detail, time.time() - logs[-1].stat().st_mtime


def open_stalls(run_dir: Path) -> dict[str, str]:
    """Role -> state of its stall, for roles stalled and not yet healed (``stalls.jsonl``)."""
    open_: dict[str, str] = {}
    for row in _tail_json(run_dir / "stalls.jsonl"):
        if row.get("event") == "RunStalled":
            open_[row["role"]] = row["state"]
        elif row.get("event") == "RunHealed":
            open_.pop(row["role"], None)
    return open_


def render(
    run_dir: Path, roles: Sequence[str], procs: Callable[[str], tuple[bool, int, int]], started: float
) -> Group:
    """The step table and the role table; ``procs(role)`` is (process up, restarts, peak RSS bytes)."""
    steps = _tail_json(run_dir / "metrics.jsonl")
    evals = _tail_json(run_dir / "eval.jsonl")
    last = steps[-1] if steps else {}
    head = Table(title=f"areal-async  {run_dir}  ({time.time() - started:.0f} s)", show_header=True)
    for col in (
        "step",
        "reward",
        "eval acc",
        "staleness max/mean",
        "trained tok/s",
        "step s (wait/compute/save)",
    ):
        head.add_column(col)
    acc = f"{evals[-1]['eval/accuracy']:.3f} @v{evals[-1]['policy_version']}" if evals else "-"
    if last:
        head.add_row(
            str(last.get("policy_version")),
            f"{last.get('reward_mean', 0.0):.3f}",
            acc,
            f"{last.get('staleness_max', 0):.0f} / {last.get('staleness_mean', 0.0):.2f}",
            f"{last.get('trained_tokens_per_s', 0.0):.0f}",
            f"{last.get('step_s', 0.0):.1f} ({last.get('wait_s', 0.0):.1f}/{last.get('compute_s', 0.0):.1f}/"
            f"{last.get('save_s', 0.0):.1f})",
        )
    else:
        head.add_row("0", "-", acc, "-", "-", "-")
    health = Table(show_header=True)
    for col in ("role", "process", "restarts", "peak RSS", "status", "detail", "last log"):
        health.add_column(col)
    stalled = open_stalls(run_dir)
    for role in roles:
        alive, restarts, peak_rss = procs(role)
        status, detail, age = role_health(run_dir, role)
        health.add_row(
            role,
            "up" if alive else "down",
            str(restarts),
            format_rss(peak_rss),
            f"[bold red]STALLED ({stalled[role]})[/]" if role in stalled else status,
            detail[:60],
            f"{age:.0f} s ago" if age is not None else "-",
        )
    return Group(head, health)
