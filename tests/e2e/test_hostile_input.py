"""Well-formed events with wrong content, published on every subject of a running run.

Each forged event decodes (it passes the schema) but names tasks the controller never issued,
rows outside the dataset, impossible versions, mismatched lengths, non-finite numbers or huge
strings. The run must complete, train nothing unissued and nothing twice, and leave the rejected
events in the dead letters with their reasons.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import Counter
from pathlib import Path

import anyio
import pytest

from bus import ConnectOptions, connect
from bus.events import (
    Completion,
    DeadLetter,
    Heartbeat,
    MetricsReport,
    PromptTask,
    RolloutFailed,
    RolloutGroup,
    RunEnded,
    ScoredGroup,
    TrainerStep,
    WeightsLoad,
    WeightsLoaded,
    WeightsPublished,
    WeightsServed,
    pack_f32,
    pack_i32,
)
from tests.helpers.jobs import (
    committed_steps,
    finish_job,
    read_steps,
    read_stream,
    start_job,
    steps_done,
    tiny_config,
)

STEPS, BATCH = 16, 8


def _ops_options(run_dir: Path) -> ConnectOptions:
    """The run's embedded server, as the ``ops`` user when the run requires credentials."""
    url = (run_dir / "nats.url").read_text().strip()
    creds = run_dir / "nats" / "credentials.json"
    if not creds.is_file():
        return ConnectOptions(url=url, name="hostile")
    data = json.loads(creds.read_text())
    users = data.get("users", data)
    return ConnectOptions(url=url, name="hostile", user="ops", password=users["ops"])


def _group(
    task_id: str, *, index: int = 0, attempt: int = 0, kind: str = "train", head: int = 0
) -> RolloutGroup:
    completion = Completion(
        token_ids=pack_i32([5, 6, 7]),
        logprobs=pack_f32([-0.1, -0.2, -0.3]),
        versions=pack_i32([head] * 3),
        finish_reason="stop",
        text="42",
    )
    return RolloutGroup(
        task_id=task_id,
        kind=kind,
        index=index,
        epoch=0,
        attempt=attempt,
        row={"a": 1},
        engine_id="forger",
        prompt_ids=pack_i32([1, 2, 3]),
        completions=[completion] * 4,
        head_version=head,
        tail_version=head,
    )


def _scored(group: RolloutGroup, reward: float = 1.0) -> ScoredGroup:
    n = len(group.completions)
    return ScoredGroup(group=group, rewards=[reward] * n, reward_errors=[""] * n, reward_seconds=0.0)


def _forgeries(subjects) -> list[tuple[str, object]]:
    huge = "x" * 200_000
    far = 10**9
    return [
        # prompts the controller never issued: unknown id, a row far outside the dataset, a huge row
        (subjects.prompt, PromptTask(task_id="forged-p1", kind="train", index=0, epoch=0, attempt=0, row={"a": 1}, issued_at=0.0)),
        (subjects.prompt, PromptTask(task_id="e0-i999999", kind="train", index=999999, epoch=0, attempt=0, row={}, issued_at=0.0)),
        (subjects.prompt, PromptTask(task_id="forged-p2", kind="eval", index=-5, epoch=0, attempt=0, row={"q": huge}, issued_at=0.0)),
        # generated and scored groups of unissued tasks, wrong attempts, NaN/inf, far-future versions
        (subjects.rollout_generated, _group("forged-g1")),
        (subjects.rollout_scored, _scored(_group("forged-s1"))),
        (subjects.rollout_scored, _scored(_group("e0-i1", index=1, attempt=7))),
        (subjects.rollout_scored, _scored(_group("e0-i2", index=2), reward=math.nan)),
        (subjects.rollout_scored, _scored(_group("e0-i3", index=3), reward=math.inf)),
        (subjects.rollout_scored, _scored(_group("forged-s2", head=far))),
        (subjects.eval_scored, _scored(_group("eval-v999-i0", kind="eval"))),
        (subjects.eval_scored, _scored(_group("eval-nonsense", kind="eval"))),
        # failures the controller must not act on (the index-out-of-range re-issue once crashed it)
        (subjects.rollout_failed, RolloutFailed(task_id="e0-i999999", kind="train", index=999999, epoch=0, attempt=0, reason="stale", detail="")),
        (subjects.rollout_failed, RolloutFailed(task_id="forged-f1", kind="train", index=-1, epoch=0, attempt=0, reason="error", detail=huge)),
        # steps the trainer never took
        (subjects.trainer_step, TrainerStep(step=far, policy_version=far, task_ids=["forged-t1"], head_versions=[0])),
        (subjects.trainer_step, TrainerStep(step=1, policy_version=1, task_ids=["a", "b"], head_versions=[0])),
        (subjects.trainer_step, TrainerStep(step=2, policy_version=2, task_ids=[f"forged-{i}" for i in range(BATCH)], head_versions=[0] * BATCH)),
        # the weight path: outside the run dir, negative and far-future versions, unknown engines
        (subjects.weights_published, WeightsPublished(policy_version=-3, path="/etc", manifest=[], total_bytes=0, seconds=0.0)),
        (subjects.weights_published, WeightsPublished(policy_version=far, path="/etc", manifest=[], total_bytes=0, seconds=0.0)),
        (subjects.weights_load, WeightsLoad(policy_version=far, path="/etc", engine_ids=[])),
        (subjects.weights_loaded, WeightsLoaded(policy_version=far, engine_id="ghost", ok=True, seconds=0.0)),
        (subjects.weights_served, WeightsServed(policy_version=far, engine_ids=["ghost"], seconds={"total_s": math.nan})),
        (subjects.metrics, MetricsReport(step=far, policy_version=-1, values={"x": math.inf})),
        (subjects.heartbeat("generation", "ghost"), Heartbeat(role="generation", worker_id="ghost", host="h", pid=1, policy_version=-7, status="ready", load={}, sent_at=0.0)),
        # an end of run the controller did not decide
        (subjects.run_ended, RunEnded(reason="forged", policy_version=far, steps=far)),
    ]  # fmt: skip


async def _attack(run_dir: Path, run_name: str) -> int:
    bus = await connect(_ops_options(run_dir), run_name)
    try:
        sent = 0
        for subject, event in _forgeries(bus.subjects):
            await bus.publish(subject, event)
            sent += 1
        await bus.flush()
        return sent
    finally:
        await bus.close()


@pytest.mark.timeout(900)
def test_forged_events_on_every_subject_neither_stop_the_run_nor_get_trained(
    tmp_path: Path, tiny_model: Path
) -> None:
    cfg = tiny_config(
        tmp_path,
        tiny_model,
        "hostile",
        trainer__total_steps=STEPS,
        trainer__batch_size=BATCH,
        trainer__eval_every=0,
        rollout__group_size=4,
        dataset__eval_size=4,
        checkpoint__every_steps=4,
    )
    run_dir = tmp_path / "hostile"
    started = time.monotonic()
    proc = start_job(cfg)
    deadline = time.monotonic() + 300
    while steps_done(run_dir) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before the attack"
    sent = anyio.run(_attack, run_dir, "hostile", backend="asyncio")
    res = finish_job(proc, run_dir, started, timeout=600)
    assert res.returncode == 0, res.output[-4000:]

    # The stored trainer.step stream holds the forged steps too (the ops user may publish there);
    # the controller dead-lettered them, and the audit counts the trainer's own steps.
    stored = read_steps(run_dir, "hostile")
    genuine = [  # the run's task ids are e<epoch>-i<index>; it may reach a second epoch
        ev
        for ev in stored
        if len(ev.task_ids) == BATCH and all(re.fullmatch(r"e\d+-i\d+", t) for t in ev.task_ids)
    ]
    assert len(stored) - len(genuine) == 3
    final = committed_steps(genuine)
    assert sorted(final) == list(range(1, STEPS + 1))
    ids = [t for ev in final.values() for t in ev.task_ids]
    assert not [t for t, n in Counter(ids).items() if n > 1], "trained twice"
    assert {"forged-s1", "forged-s2", "e0-i999999"}.isdisjoint(ids)
    for ev in final.values():
        assert math.isfinite(ev.metrics["reward_mean"]) and ev.metrics.get("skipped", 0.0) == 0.0, ev.metrics

    letters = read_stream(run_dir, "hostile", "DEADLETTER", DeadLetter)
    reasons = Counter(letter.subject.rsplit(".", 1)[-1] for letter in letters)
    print(f"{sent} forged events; dead letters by subject: {dict(reasons)}; {res.seconds:.0f} s")
    for suffix, at_least in {"prompt": 3, "scored": 5, "failed": 2, "step": 3}.items():
        assert reasons[suffix] >= at_least, (suffix, reasons, [(d.subject, d.reason) for d in letters])
    assert any("never issued" in d.reason for d in letters if d.subject.endswith("rollout.scored"))
    assert any("non-finite" in d.reason for d in letters if d.subject.endswith("rollout.scored"))
