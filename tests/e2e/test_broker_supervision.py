"""``areal-async run`` supervises its broker and accounts for memory; ``inspect`` reads a finished run.

One tiny run (module fixture) under the per-run credentials: its embedded nats-server is
SIGKILLed after a few steps. The tests then check what that run left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.jobs import (
    REPO,
    JobResult,
    committed_steps,
    finish_job,
    read_steps,
    start_job,
    steps_done,
    tiny_config,
)
from workers.roles import run_roles

TOTAL, BATCH = 16, 4
ROLES = run_roles(uses_agents=False)


def server_pid(store: Path) -> int | None:
    """Pid of the run's nats-server, from the ports file it writes into its store."""
    for ports in store.glob("nats-server_*.ports"):
        pid = int(ports.stem.rsplit("_", 1)[1])
        if Path(f"/proc/{pid}").exists():
            return pid
    return None


def wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def broker_killed(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> tuple[JobResult, Path]:
    """(result, run file) of a run whose nats-server was SIGKILLed once three steps were done."""
    tmp = tmp_path_factory.mktemp("broker")
    cfg = tiny_config(
        tmp, tiny_model, "broker",
        rollout__group_size=4, trainer__total_steps=TOTAL, trainer__batch_size=BATCH, trainer__eval_every=0,
        dataset__eval_size=4, checkpoint__every_steps=4,
    )  # fmt: skip
    run_dir = tmp / "broker"
    started = time.monotonic()
    proc = start_job(cfg)
    try:
        wait_for(lambda: steps_done(run_dir) >= 3, 240, "three steps")
        pid = server_pid(run_dir / "nats")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
    finally:
        result = finish_job(proc, run_dir, started, timeout=600)
    return result, cfg


def areal_async(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workers", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


@pytest.mark.timeout(900)
def test_a_killed_broker_is_restarted_and_every_step_is_trained_once(
    broker_killed: tuple[JobResult, Path],
) -> None:
    """The launcher restarts the server on its port and store; the workers reconnect without
    being restarted; the run exits 0 and its stored trainer.step stream commits every step,
    each task once."""
    result, _ = broker_killed
    assert result.returncode == 0, result.output[-4000:]
    assert "warning: nats-server exited with -9; restart 1/3" in result.output
    assert not re.search(r"warning: (controller|generation|reward|trainer|weight-sync) exited", result.output)
    final = committed_steps(read_steps(result.run_dir, "broker"))
    assert sorted(final) == list(range(1, TOTAL + 1))
    tasks = Counter(t for step in final.values() for t in step.task_ids)
    assert all(n == 1 for n in tasks.values()) and len(tasks) == TOTAL * BATCH


def test_the_summary_lists_the_peak_rss_of_every_role(broker_killed: tuple[JobResult, Path]) -> None:
    """summary.txt names each role and the server with a peak resident memory in MiB or GiB."""
    result, _ = broker_killed
    summary = (result.run_dir / "summary.txt").read_text().splitlines()
    line = next(text for text in summary if text.startswith("peak RSS"))
    for role in (*ROLES, "nats-server"):
        assert re.search(rf"\b{role} \d+(\.\d)? (MiB|GiB)", line), (role, line)


def test_inspect_reads_a_finished_run_from_its_store(broker_killed: tuple[JobResult, Path]) -> None:
    """With the run's server gone, ``inspect`` starts a private one on the store, answers steps,
    summary and deadletter, and leaves no server behind; tailing a core subject is one error line."""
    result, cfg = broker_killed
    steps = areal_async("inspect", "--config", str(cfg), "steps", "--count", "100")
    assert steps.returncode == 0, steps.stderr
    assert "reading its store" in steps.stderr and "Traceback" not in steps.stderr
    assert len(re.findall(r"^\s+\d+ ", steps.stdout, re.MULTILINE)) >= TOTAL
    summary = areal_async("inspect", "--config", str(cfg), "summary", "--json")
    assert summary.returncode == 0, summary.stderr
    assert json.loads(summary.stdout)["streams"]["STEPS"]["messages"] >= TOTAL
    assert areal_async("inspect", "--config", str(cfg), "deadletter").returncode == 0
    tail = areal_async("inspect", "--config", str(cfg), "tail", "weights.served")
    assert tail.returncode == 2 and "Traceback" not in tail.stderr
    assert tail.stderr.splitlines()[-1].startswith("error: ConfigError: ") and "not stored" in tail.stderr
    assert server_pid(result.run_dir / "nats") is None
