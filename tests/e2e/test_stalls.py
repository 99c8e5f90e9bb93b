"""Stalls under ``areal-async run``: a worker that stops without dying is found, killed and replaced.

Real nats-server, real worker processes, the tiny model on CPU. One run goes through every stall
the watchdog must heal: a reward worker whose unit of work never finishes while its heartbeats go on
(``AREAL_FAULT_WEDGE``), then a SIGSTOP of generation, reward, trainer, weight-sync and controller
together, each left frozen until the watchdog kills it. Two more runs freeze one
rank of a two-rank torchrun trainer, and the agent worker of a multi-turn run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_e2e import _check_exactly_once, _check_staleness, _pid_of, _wait_for
from tests.helpers.jobs import (
    REPO,
    committed_steps,
    finish_job,
    read_steps,
    start_job,
    steps_done,
    tiny_config,
)
from workers.runtime import WEDGE_ENV

FROZEN = ("generation", "reward", "trainer", "weight-sync", "controller")


def _stall_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "stalls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _healed_after(run_dir: Path, role: str, state: str, count: int) -> bool:
    """The watchdog has killed `count` stalls of `role` in `state` and seen the role heal as often."""
    records = [r for r in _stall_records(run_dir) if r["role"] == role and r["state"] == state]
    stalled = [r for r in records if r["event"] == "RunStalled" and r["action"] == "killed"]
    healed = [r for r in records if r["event"] == "RunHealed"]
    return len(stalled) >= count and len(healed) >= count


@pytest.mark.timeout(900)
def test_frozen_and_wedged_workers_are_replaced_and_nothing_is_lost(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first reward worker wedges (no unit of scoring finishes; heartbeats go on): it is named
    wedged and killed. Then every role in FROZEN is SIGSTOPped at once and never thawed: each
    is named frozen within twice the limit, its process group is killed, the launcher restarts it and
    training moves on. The run completes with every task trained once within the staleness bound,
    no other worker is ever called stalled (no false kill), and the summary lists stalls and heals."""
    name = "stalls"
    run_dir = tmp_path / name
    monkeypatch.setenv(WEDGE_ENV, f"reward:scoring:{tmp_path / 'wedged'}")
    total, batch = 120, 4  # the run outlasts the freezes and the health check, on a fast CPU too
    cfg = tiny_config(
        tmp_path,
        tiny_model,
        name,
        rollout__group_size=4,
        trainer__total_steps=total,
        trainer__batch_size=batch,
        trainer__eval_every=0,
        dataset__eval_size=4,
        checkpoint__every_steps=10,
        watchdog__frozen_after_s=6,
        watchdog__wedged_floor_s=20,
        watchdog__first_progress_s=15,
    )
    frozen_pids: list[int] = []
    started = time.monotonic()
    proc = start_job(cfg)
    try:
        _wait_for(
            lambda: _healed_after(run_dir, "reward", "wedged", 1), 240, "the wedged reward worker healed"
        )
        # Then every role in FROZEN at once: nothing in the run moves until each of them is found,
        # killed and restarted by the watchdog, which watches each on its own heartbeats.
        pids = {role: _pid_of(run_dir, role) for role in FROZEN}
        stopped = {}
        for role, pid in pids.items():
            os.kill(pid, signal.SIGSTOP)
            frozen_pids.append(pid)
            stopped[role] = time.time()
        _wait_for(
            lambda: all(_healed_after(run_dir, role, "frozen", 1) for role in FROZEN),
            240,
            "every role healed",
        )
        for role, pid in pids.items():
            [detected] = [
                r
                for r in _stall_records(run_dir)
                if r["event"] == "RunStalled" and r["role"] == role and r["state"] == "frozen"
            ]
            assert detected["pid"] == pid and "no heartbeat for" in detected["evidence"]
            assert detected["detected_at"] - stopped[role] <= 2 * 6  # within twice the frozen limit
        # While the run is still live (most of its steps ahead): every role has a worker again and
        # none is stalled; the record holds the wedge and the five freezes.
        health = subprocess.run(
            [sys.executable, "-m", "workers", "inspect", "--config", str(cfg), "health", "--json"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert health.returncode == 0, health.stdout + health.stderr
        report = json.loads(health.stdout)
        assert {w["role"] for w in report["workers"] if w["state"] != "killed"} >= set(FROZEN)
        assert all(w["state"] not in ("frozen", "wedged") for w in report["workers"]), report["workers"]
        reported = [r for r in report["stalls"] if r["event"] == "RunStalled"]
        assert sorted((r["role"], r["state"]) for r in reported) == sorted(
            [("reward", "wedged"), *((role, "frozen") for role in FROZEN)]
        ), reported
        # a killed worker's entry, until its heartbeat TTL ends, is shown as dealt with
        killed_ids = {r["worker_id"] for r in reported}
        assert all(w["state"] == "killed" for w in report["workers"] if w["worker_id"] in killed_ids)
    finally:
        res = finish_job(proc, run_dir, started, timeout=600)
    assert res.returncode == 0, res.output[-4000:]
    for pid in frozen_pids:  # killed, not thawed
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    stalls = [r for r in _stall_records(run_dir) if r["event"] == "RunStalled"]
    assert sorted((r["role"], r["state"]) for r in stalls) == sorted(
        [("reward", "wedged"), *((role, "frozen") for role in FROZEN)]
    ), stalls
    assert all(r["action"] == "killed" for r in stalls)
    wedged = next(r for r in stalls if r["state"] == "wedged")
    assert "busy in scoring" in wedged["evidence"]
    for role in FROZEN:
        assert f"warning: {role} worker" in res.output and "is frozen: no heartbeat for" in res.output
    steps = read_steps(run_dir, name)
    _check_exactly_once(steps, total, batch)
    _check_staleness(committed_steps(steps).values(), eta=2)
    summary = (run_dir / "summary.txt").read_text()
    assert summary.count("stall        ") == len(FROZEN) + 1
    assert "healed       trainer after" in summary


def _rank_pid(config: Path, rank: int) -> int | None:
    """The pid of torchrun rank `rank` of the trainer of the run file `config`, if it runs."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(config).encode() in argv and b"trainer" in argv and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


@pytest.mark.timeout(900)
def test_a_frozen_rank_of_a_torchrun_trainer_wedges_rank_0_and_the_trainer_is_replaced(
    tmp_path: Path, tiny_model: Path
) -> None:
    """trainer.num_ranks = 2 and rank 1 (no bus connection, no heartbeat of its own) SIGSTOPped
    after two steps: rank 0 blocks in the step's collectives while beating, so the trainer is
    named wedged (busy in its step, no unit finished within its threshold), its whole process tree
    (torchrun and both ranks) is killed, and the restarted trainer completes the run from its
    checkpoint with every task trained once."""
    name = "rank-stall"
    run_dir = tmp_path / name
    total, batch = 6, 4
    cfg = tiny_config(
        tmp_path,
        tiny_model,
        name,
        rollout__group_size=4,
        trainer__total_steps=total,
        trainer__batch_size=batch,
        trainer__num_ranks=2,
        trainer__eval_every=0,
        dataset__eval_size=4,
        checkpoint__every_steps=2,
        watchdog__frozen_after_s=6,
        watchdog__wedged_floor_s=15,
        watchdog__first_progress_s=120,
    )
    started = time.monotonic()
    proc = start_job(cfg)
    try:
        _wait_for(lambda: steps_done(run_dir) >= 2, 300, "2 steps")
        pid = _rank_pid(cfg, 1)
        assert pid is not None, "rank 1 of the trainer not found"
        os.kill(pid, signal.SIGSTOP)
        _wait_for(lambda: _healed_after(run_dir, "trainer", "wedged", 1), 300, "the trainer healed")
    finally:
        res = finish_job(proc, run_dir, started, timeout=600)
    assert res.returncode == 0, res.output[-4000:]
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    [stall] = [r for r in _stall_records(run_dir) if r["event"] == "RunStalled"]
    assert stall["role"] == "trainer" and "busy in training step" in stall["evidence"]
    _check_exactly_once(read_steps(run_dir, name), total, batch)


@pytest.mark.timeout(900)
def test_a_frozen_agent_worker_is_replaced_and_its_episodes_are_run_again(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A multi-turn run whose agent worker (it takes the prompts and scores its own episodes) is
    SIGSTOPped after two steps and never thawed: named frozen, killed, restarted; its unfinished
    tasks are redelivered and the run completes with every task trained once."""
    from tests.e2e.test_agents_run import _agent_config

    name = "agent-stall"
    run_dir = tmp_path / name
    total, batch = 12, 8
    cfg = _agent_config(
        tmp_path,
        tiny_model,
        name,
        trainer__total_steps=total,
        trainer__batch_size=batch,
        trainer__eval_every=0,
        dataset__eval_size=4,
        rollout__group_size=4,
        checkpoint__every_steps=2,
        watchdog__frozen_after_s=6,
    )
    started = time.monotonic()
    proc = start_job(cfg)
    try:
        _wait_for(lambda: steps_done(run_dir) >= 2, 300, "2 steps")
        pid = _pid_of(run_dir, "agent")
        os.kill(pid, signal.SIGSTOP)
        _wait_for(lambda: _healed_after(run_dir, "agent", "frozen", 1), 300, "the agent worker healed")
    finally:
        res = finish_job(proc, run_dir, started, timeout=600)
    assert res.returncode == 0, res.output[-4000:]
    [stall] = [r for r in _stall_records(run_dir) if r["event"] == "RunStalled"]
    assert (stall["role"], stall["pid"], stall["action"]) == ("agent", pid, "killed")
    _check_exactly_once(read_steps(run_dir, name), total, batch)
