"""The rollout path alone: prompt tasks -> generation workers -> reward worker -> scored groups."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from bus import ConnectOptions, connect
from bus.events import PromptTask, ScoredGroup, unpack_f32, unpack_i32
from bus.state import IssuedTask, RunState
from tests.helpers.jobs import REPO, tiny_config


def _worker(role: str, config: Path, url: str, worker_id: str) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "workers.cli", "--role", role, "--config", str(config)]
    args += ["--set", f"bus.url={url}", "--worker-id", worker_id]
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_n_tasks_give_exactly_n_scored_groups_even_when_a_generator_dies(
    tmp_path: Path, tiny_model: Path, nats_url: str, run_name: str
) -> None:
    """Two generation workers share the prompt queue; one is SIGKILLed mid-run. Every task still
    yields exactly one ScoredGroup with group_size completions (redelivery + Nats-Msg-Id dedup)."""
    n, group_size = 12, 4
    cfg = tiny_config(
        tmp_path,
        tiny_model,
        run_name,
        rollout__group_size=group_size,
        rollout__sampling__max_new_tokens=48,
        bus__ack_wait_s=4,
        bus__heartbeat_interval_s=0.5,
        bus__heartbeat_ttl_s=3,
    )
    procs = [
        _worker("generation", cfg, nats_url, "gen-a"),
        _worker("generation", cfg, nats_url, "gen-b"),
        _worker("reward", cfg, nats_url, "reward-a"),
    ]
    bus = await connect(ConnectOptions(url=nats_url, name="test"), run_name)
    try:
        await bus.provision(ack_wait=4)
        run_state = RunState(bus)
        for i in range(n):
            # As the controller does: record the issue first; workers serve only recorded tasks.
            await run_state.issue(IssuedTask(task_id=f"t{i}", kind="train", epoch=0, index=i, attempt=0))
            task = PromptTask(
                task_id=f"t{i}",
                kind="train",
                index=i,
                epoch=0,
                row={"prompt": f"{i % 10}+1=", "answer": "1"},
                issued_at=time.time(),
            )
            await bus.publish(bus.subjects.prompt, task, msg_id=f"t{i}:0")
        seen: dict[str, ScoredGroup] = {}
        killed = False
        with anyio.fail_after(240):
            async with bus.consume("SCORED", batch=4, fetch_timeout=0.5) as consumer:
                async for d in consumer:
                    group = d.event
                    assert isinstance(group, ScoredGroup)
                    assert group.group.task_id not in seen, f"{group.group.task_id} scored twice"
                    seen[group.group.task_id] = group
                    await d.ack()
                    if not killed:
                        os.kill(procs[0].pid, signal.SIGKILL)
                        killed = True
                    if len(seen) == n:
                        break
        # Nothing more arrives once all are done (a late duplicate would show up here).
        with anyio.move_on_after(6):
            async with bus.consume("SCORED", batch=4, fetch_timeout=0.5) as consumer:
                async for d in consumer:
                    pytest.fail(f"duplicate scored group {d.event.group.task_id}")
    finally:
        await bus.close()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = [p.wait(30) for p in procs]
    assert sorted(seen) == sorted(f"t{i}" for i in range(n))
    for g in seen.values():
        assert len(g.group.completions) == group_size and len(g.rewards) == group_size
        for c in g.group.completions:
            tokens, logprobs = unpack_i32(c.token_ids), unpack_f32(c.logprobs)
            assert len(tokens) == len(logprobs) == len(unpack_i32(c.versions)) >= 1
            assert (logprobs <= 0).all()
    assert codes[1:] == [0, 0], "surviving workers stop cleanly on SIGTERM"
