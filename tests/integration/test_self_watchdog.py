"""A worker's own watchdog (systemd and Slurm) and the Slurm wrapper that restarts a stalled worker.

Real processes against the session's nats-server; the reward role loads no model.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
import yaml

from bus import Bus
from tests.helpers.jobs import REPO
from tests.helpers.ops_helpers import script_env
from tests.integration.test_ops_launch import rollout_group
from workers.runtime import WEDGE_ENV
from workers.watchdog import SELF_WATCHDOG_ENV, STALLED_EXIT

SLURM_DIR = REPO / "scripts" / "slurm"


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_wedged_worker_stops_notifying_systemd_and_exits_3_under_slurm(
    bus_factory: object, nats_url: str, run_name: str, tmp_path: Path
) -> None:
    """A reward worker with a notify socket says READY=1, then WATCHDOG=1 while healthy. Its first
    unit of work never finishes (``AREAL_FAULT_WEDGE``; its heartbeats go on): past
    ``first_progress_s`` its own watchdog calls it wedged, the notifications stop, and with
    ``AREAL_SELF_WATCHDOG=exit`` (what the Slurm entry scripts set) it exits 3."""
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "name": run_name,
                "dir": str(tmp_path / "run"),
                "model": {"path": str(tmp_path)},
                "bus": {"url": nats_url, "heartbeat_interval_s": 0.5, "heartbeat_ttl_s": 5},
                "reward": {"fn": "arithmetic", "num_workers": 1},
                "watchdog": {"frozen_after_s": 5, "first_progress_s": 3, "wedged_floor_s": 3},
                "logging": {"format": "json"},
            }
        )
    )
    notify = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify))
    listener.settimeout(0.2)
    env = {
        **os.environ,
        "NOTIFY_SOCKET": str(notify),
        "WATCHDOG_USEC": "1000000",
        SELF_WATCHDOG_ENV: "exit",
        WEDGE_ENV: f"reward:scoring:{tmp_path / 'wedged'}",
    }
    log = tmp_path / "worker.err"
    messages: list[tuple[float, str]] = []
    bus: Bus = await bus_factory("test", provision=True)  # type: ignore[operator]
    with log.open("wb") as err:
        proc = await anyio.open_process(
            [sys.executable, "-m", "workers.cli", "--role", "reward", "--config", str(config)],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        deadline = time.monotonic() + 60
        while not any(m == "WATCHDOG=1" for _, m in messages):
            assert time.monotonic() < deadline and proc.returncode is None, messages
            await anyio.to_thread.run_sync(_receive, listener, messages)
        await bus.publish(bus.subjects.rollout_generated, rollout_group(answer=42, texts=("42",)))
        sent = time.monotonic()
        while proc.returncode is None:
            assert time.monotonic() < deadline, "the wedged worker did not exit"
            await anyio.to_thread.run_sync(_receive, listener, messages)
            with anyio.move_on_after(0.01):
                await proc.wait()
        exited = time.monotonic()
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.aclose()
        listener.close()
    stderr = log.read_text()
    assert proc.returncode == STALLED_EXIT, stderr[-3000:]
    assert messages[0][1] == "READY=1"
    assert (tmp_path / "wedged").is_file()
    stalled = [json.loads(line) for line in stderr.splitlines() if '"this worker is stalled"' in line]
    assert stalled and stalled[0]["state"] == "wedged" and "busy in scoring" in stalled[0]["evidence"]
    # It stayed healthy (notifying) while its unit of work was younger than first_progress_s.
    assert max(t for t, m in messages if m == "WATCHDOG=1") >= sent
    assert exited - sent >= 3


def _receive(listener: socket.socket, into: list[tuple[float, str]]) -> None:
    try:
        into.append((time.monotonic(), listener.recv(256).decode()))
    except TimeoutError:
        pass


def test_the_slurm_wrapper_restarts_a_stalled_worker_and_passes_other_codes_on(tmp_path: Path) -> None:
    """stall_restart.sh runs the worker with AREAL_SELF_WATCHDOG=exit, starts it again after
    exit 3 (stalled) up to AREAL_STALL_RESTARTS times, and ends with any other exit code."""
    counter = tmp_path / "starts"
    worker = tmp_path / "worker.sh"
    # Exits 3 on its first two starts, then with the code in $FINAL; records each start's env.
    worker.write_text(
        f'#!/usr/bin/env bash\necho "$AREAL_SELF_WATCHDOG" >> {counter}\n'
        f'[ "$(wc -l < {counter})" -le 2 ] && exit 3\nexit "$FINAL"\n'
    )
    worker.chmod(0o755)

    def run(final: str, **env: str) -> subprocess.CompletedProcess[str]:
        counter.unlink(missing_ok=True)
        return subprocess.run(
            [str(SLURM_DIR / "stall_restart.sh"), str(worker)],
            env=script_env(FINAL=final, **env),
            capture_output=True,
            text=True,
            timeout=30,
        )

    done = run("0")
    assert done.returncode == 0 and counter.read_text().split() == ["exit"] * 3
    assert "restart 2/3" in done.stderr
    failed = run("1")
    assert failed.returncode == 1 and len(counter.read_text().split()) == 3
    gave_up = run("0", AREAL_STALL_RESTARTS="1")
    assert gave_up.returncode == STALLED_EXIT and len(counter.read_text().split()) == 2
