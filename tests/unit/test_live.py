"""The live display of `areal-async run` renders from what the workers write into the run dir."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console

from workers.live import render, role_health


def test_live_display_shows_step_eval_and_role_health(tmp_path: Path) -> None:
    """Step metrics, the latest eval, each role's last status and its peak RSS appear in the
    rendered tables; a role the watchdog found stalled and that has not healed yet is marked."""
    (tmp_path / "logs").mkdir()
    step = {
        "policy_version": 7,
        "reward_mean": 0.4375,
        "staleness_max": 2,
        "staleness_mean": 1.5,
        "step_s": 3.0,
    }
    (tmp_path / "metrics.jsonl").write_text(json.dumps(step) + "\n")
    (tmp_path / "eval.jsonl").write_text(json.dumps({"policy_version": 5, "eval/accuracy": 0.625}) + "\n")
    (tmp_path / "logs" / "trainer-h-1.jsonl").write_text(
        json.dumps({"event": "status", "status": "waiting", "detail": "2/4 groups"}) + "\n"
    )
    assert role_health(tmp_path, "trainer")[:2] == ("waiting", "2/4 groups")
    assert role_health(tmp_path, "reward")[0] == "starting"
    stalls = [
        {"event": "RunStalled", "role": "trainer", "state": "frozen"},
        {"event": "RunHealed", "role": "trainer", "state": "frozen"},
        {"event": "RunStalled", "role": "reward", "state": "wedged"},
    ]
    (tmp_path / "stalls.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stalls))
    console = Console(record=True, width=200)

    def procs(role: str) -> tuple[bool, int, int]:  # (process up, restarts, peak RSS bytes)
        return role == "trainer", 1, 312 * 2**20

    console.print(render(tmp_path, ["trainer", "reward"], procs, time.time()))
    text = console.export_text()
    expected_text = ("0.438", "0.625 @v5", "2 / 1.50", "waiting", "2/4 groups", "STALLED (wedged)", "down")
    for expected in (*expected_text, "312 MiB"):
        assert expected in text, expected
    assert "starting" not in text and "STALLED (frozen)" not in text  # reward stalled; trainer healed
