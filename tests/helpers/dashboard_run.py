"""A synthetic finished run for dashboard tests and its benchmark: a run file and a JetStream store
holding what a real run leaves there (steps, heartbeats, scored groups, a dead letter, a refusal,
the controller's evaluation record, the end of the run), written without any worker."""

from __future__ import annotations

import math
import time
from pathlib import Path

import anyio
import yaml

from bus import ConnectOptions, EmbeddedServer, connect
from bus import events as ev
from bus.state import CONTROLLER, RUN_ENDED, WEIGHTS_PUBLISHED, WEIGHTS_SERVED, RunState
from bus.subjects import Buckets


def synthetic_config(tmp: Path, name: str) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "dir": str(tmp / name), "trainer": {"total_steps": 1000}}))
    return path


def _group(index: int, version: int, *, episode: bool = False) -> ev.ScoredGroup:
    """Four completions; the first started a version before the others. ``episode``: each is a
    multi-turn episode (model, tool result, model) with a tool call in its text."""
    completions = [
        ev.Completion(
            token_ids=ev.pack_i32([5, 6, 7]),
            logprobs=ev.pack_f32([-0.5, 0.0 if episode else -0.25, -0.125]),
            versions=ev.pack_i32([version - (k == 0), version, version]),
            finish_reason="stop",
            text=f'<tool_call>{{"name": "add"}}</tool_call>\n{index % 9 + k}'
            if episode
            else f"{index % 9 + k}",
            loss_mask=ev.pack_u8([1, 0, 1]) if episode else b"",
        )
        for k in range(4)
    ]
    group = ev.RolloutGroup(
        task_id=f"e0-i{index}",
        kind="train",
        index=index,
        epoch=0,
        attempt=0,
        row={"prompt": f"{index % 9}+1=", "answer": str(index % 9 + 1)},
        engine_id="generation-synthetic",
        prompt_ids=ev.pack_i32([1, 2, 3]),
        completions=completions,
        head_version=version - 1,
        tail_version=version,
    )
    rewards = [1.0 if k == 1 else 0.0 for k in range(4)]
    return ev.ScoredGroup(group=group, rewards=rewards, reward_errors=[""] * 4, reward_seconds=0.01)


async def fill(url: str, run: str, steps: int, *, password: str | None = None) -> None:
    """Provision ``run`` at ``url`` and store ``steps`` steps and the rest of a finished run (as the
    run's ``ops`` user when ``password`` is given)."""
    login = {"user": "ops", "password": password} if password else {}
    bus = await connect(ConnectOptions(url=url, name="synthetic-run", **login), run)  # type: ignore[arg-type]
    try:
        await bus.provision()
        state = RunState(bus)
        now = time.time()
        for s in range(1, steps + 1):
            metrics = {
                "reward_mean": 0.5 + 0.4 * math.tanh(s / 200),
                "staleness_mean": 1.2,
                "staleness_max": 2.0,
                "wait_s": 0.4,
                "compute_s": 2.0,
                "save_s": 0.3,
                "step_s": 2.7,
                "trained_tokens_per_s": 900.0 + s % 50,
                "loss": 0.01,
            }
            step = ev.TrainerStep(
                step=s, policy_version=s, task_ids=[f"e0-i{s}"], head_versions=[s - 1], metrics=metrics
            )
            await bus.publish(bus.subjects.trainer_step, step, msg_id=f"step-{s}")
        for i in range(8):
            group = _group(i, steps, episode=i == 7)
            await bus.publish(bus.subjects.rollout_scored, group, msg_id=f"e0-i{i}:0")
        await bus.publish(
            bus.subjects.rollout_failed,
            ev.RolloutFailed(
                task_id="e0-i99", kind="train", index=99, epoch=0, attempt=0, reason="stale",
                detail="head 1 < 5 - 2", head_version=1, trainer_version=5,
            ),
            msg_id="e0-i99:0:failed",
        )  # fmt: skip
        await bus.dead_letter(bus.subjects.rollout_generated, "undecodable msgpack: synthetic", b"\xc1", {})
        beat = ev.Heartbeat(
            role="trainer", worker_id="trainer-synthetic", host="h", pid=1, status="done", sent_at=now,
            peak_rss=2**30, restarts=1,
        )  # fmt: skip
        await bus.kv_put(Buckets.WORKERS, "trainer.trainer-synthetic", ev.encode(beat))
        evals = {str(v): {"correct": 10.0 * v / steps, "count": 10} for v in range(0, steps + 1, 100)}
        await state.record(CONTROLLER, eval_done=[int(v) for v in evals], eval_results=evals)
        await state.record(WEIGHTS_PUBLISHED, policy_version=steps, path="w")
        await state.record(WEIGHTS_SERVED, policy_version=steps, path="w")
        await state.record(RUN_ENDED, reason="total_steps reached", policy_version=steps)
    finally:
        await bus.close()


def synthetic_run(tmp: Path, name: str, steps: int) -> Path:
    """The run file of a finished run of ``steps`` steps whose store lies in its run dir."""
    config = synthetic_config(tmp, name)
    server = EmbeddedServer(tmp / name / "nats")
    server.start()
    try:
        assert server.url is not None
        anyio.run(fill, server.url, name, steps, backend="asyncio")
    finally:
        server.stop()
    return config
