"""The poison-message rule and quarantine at start-up, against a real nats-server.

An event that decodes but cannot be acted on is dead-lettered with the reason and the worker goes
on; restored state that fails validation is quarantined (logged, kept aside, in the dead letters),
never a crash loop. A failure that is legitimate although it names a task the controller counts as
trained (a restored trainer recycling a group of a step it lost) is acted on, not dead-lettered.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import anyio
import msgpack
import pytest

from areal_async.run_file import build_config
from bus import Bus
from bus.events import (
    Completion,
    DeadLetter,
    RolloutGroup,
    ScoredGroup,
    TrainerStep,
    decode,
    pack_f32,
    pack_i32,
)
from bus.state import CONTROLLER, IssuedTask, RunState
from workers.controller import Controller
from workers.runtime import WorkerContext
from workers.trainer import Trainer


def _context(bus: Bus, run_name: str, tmp_path: Path, role: str) -> WorkerContext:
    cfg = build_config(
        {
            "name": run_name,
            "dir": str(tmp_path / run_name),
            "model": {"path": str(tmp_path / "model")},
            "dataset": {"kind": "mode_select", "eval_size": 0},
            "trainer": {"batch_size": 2, "total_steps": 3},
            "metrics": {"loggers": []},
        }
    )
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    return WorkerContext(cfg=cfg, role=role, worker_id=f"{role}-1", bus=bus)


async def _dead_letters(bus: Bus) -> list[DeadLetter]:
    spec = bus.subjects.stream("DEADLETTER")
    info = await bus.js.stream_info(spec.name)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        if info.state.messages:
            out.append(decode((await bus.js.get_msg(spec.name, seq)).data, DeadLetter))
    return out


def _scored(
    task_id: str, *, index: int, attempt: int = 0, reward: float = 1.0, version: int = 0
) -> ScoredGroup:
    completion = Completion(
        token_ids=pack_i32([4, 5]),
        logprobs=pack_f32([-0.5, -0.5]),
        versions=pack_i32([version, version]),
        finish_reason="stop",
    )
    group = RolloutGroup(
        task_id=task_id, kind="train", index=index, epoch=0, attempt=attempt, row={}, engine_id="g",
        prompt_ids=pack_i32([1]), completions=[completion, completion], head_version=version,
        tail_version=version,
    )  # fmt: skip
    return ScoredGroup(group=group, rewards=[reward, 0.0], reward_errors=["", ""], reward_seconds=0.0)


@pytest.mark.asyncio
async def test_an_unusable_controller_state_is_quarantined_not_a_crash_loop(
    bus_factory, run_name: str, tmp_path: Path
) -> None:
    """Bytes that are not the controller's state: kept aside under ``controller.quarantined``, named in
    the dead letters, and the controller starts afresh instead of dying on every restart."""
    bus = await bus_factory(provision=True)
    await bus.kv_put("state", CONTROLLER, b"\x93not-a-map")
    controller = Controller(_context(bus, run_name, tmp_path, "controller"))
    await controller.load()
    assert controller.state.issued == 0 and not controller.ended
    kept = await bus.kv_get("state", CONTROLLER + ".quarantined")
    assert kept is not None and kept.value == b"\x93not-a-map"
    letters = await _dead_letters(bus)
    assert any("controller state unusable" in d.reason for d in letters), [d.reason for d in letters]


@pytest.mark.asyncio
async def test_restored_retries_outside_the_dataset_are_dropped_and_named(
    bus_factory, run_name: str, tmp_path: Path
) -> None:
    """A retry entry naming row 10**6 (the re-issue that once raised IndexError) is dropped at restore."""
    bus = await bus_factory(provision=True)
    first = Controller(_context(bus, run_name, tmp_path, "controller"))
    first.state.retry.append(["e0-i1000000", 0, 1_000_000])
    first.state.retry.append(["e0-i3", 0, 3])
    await first.save()
    again = Controller(_context(bus, run_name, tmp_path, "controller"))
    await again.load()
    assert [list(r) for r in again.state.retry] == [["e0-i3", 0, 3]]
    assert again.dropped_on_restore == ["retry ['e0-i1000000', 0, 1000000]"]


@pytest.mark.asyncio
async def test_the_trainer_holds_only_issued_finite_groups(
    bus_factory, run_name: str, tmp_path: Path
) -> None:
    """Unissued ids, wrong attempts and NaN rewards never reach a batch; NaN is reported for re-issue."""
    bus = await bus_factory(provision=True)
    state = RunState(bus)
    for index in (1, 2, 3):
        await state.issue(IssuedTask(task_id=f"e0-i{index}", kind="train", epoch=0, index=index, attempt=0))
    trainer = Trainer(
        _context(bus, run_name, tmp_path, "trainer"), SimpleNamespace(version=0), trained_ids={"e0-i3"}
    )
    sent = [
        _scored("e0-i1", index=1),  # issued: held
        _scored("forged-1", index=1),  # never issued
        _scored("e0-i1", index=1, attempt=4),  # not the issued attempt
        _scored("e0-i2", index=2, reward=math.nan),  # issued, non-finite: dead letter + rollout.failed
        _scored("e0-i3", index=3),  # already trained by a committed step: duplicate
    ]
    for scored in sent:
        await bus.publish(bus.subjects.rollout_scored, scored)
    with anyio.move_on_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer.receive)
            while len(await _dead_letters(bus)) < 3:  # noqa: ASYNC110
                await anyio.sleep(0.05)
            await anyio.sleep(0.3)
            tg.cancel_scope.cancel()
    assert list(trainer.pending) == ["e0-i1"]
    reasons = [d.reason for d in await _dead_letters(bus)]
    assert len(reasons) == 3, reasons
    assert sum("never issued" in r for r in reasons) == 1
    assert sum("attempt" in r for r in reasons) == 1
    assert sum("non-finite" in r for r in reasons) == 1
    failed = bus.subjects.stream("FAILED")
    info = await bus.js.stream_info(failed.name)
    kinds = [
        msgpack.unpackb((await bus.js.get_msg(failed.name, s)).data)["reason"]
        for s in range(info.state.first_seq, info.state.last_seq + 1)
    ]
    assert sorted(kinds) == ["duplicate", "error"]


@pytest.mark.asyncio
async def test_a_group_a_restored_trainer_recycles_from_a_lost_step_is_reissued(
    bus_factory, run_name: str, tmp_path: Path
) -> None:
    """The controller counted steps 1 and 2; the trainer, restored at version 0, gets step 2's group
    e0-i3 back (made by version 1: ``future`` for it) before it repeats any step. The trainer recycles
    it, and the controller takes it out of step 2 and re-issues it (attempt 1) instead of
    dead-lettering the failure, which left the run one batch short for good."""
    bus = await bus_factory(provision=True)
    controller = Controller(_context(bus, run_name, tmp_path, "controller"))
    ids = [controller.state.take_new(0, i).task_id for i in range(4)]
    controller.state.on_trained(1, ids[:2])
    controller.state.on_trained(2, ids[2:])
    await RunState(bus).issue(IssuedTask(task_id="e0-i3", kind="train", epoch=0, index=3, attempt=0))
    trainer = Trainer(
        _context(bus, run_name, tmp_path, "trainer"), SimpleNamespace(version=0), trained_ids=set()
    )
    await bus.publish(bus.subjects.rollout_scored, _scored("e0-i3", index=3, version=1))
    with anyio.move_on_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer.receive)
            tg.start_soon(trainer.next_batch)
            tg.start_soon(controller.on_failed)
            while not controller.state.retry:  # noqa: ASYNC110
                await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
    assert [list(r) for r in controller.state.retry] == [["e0-i3", 0, 3]]
    assert controller.state.step_tasks[2] == ["e0-i2"] and controller.state.trained == 3
    assert controller.state.attempts["e0-i3"] == 1
    assert not await _dead_letters(bus)


@pytest.mark.asyncio
async def test_a_step_delivered_again_after_newer_ones_is_no_trainer_restart(
    bus_factory, run_name: str, tmp_path: Path
) -> None:
    """A controller stopped while holding trainer.step 1 unacked; its replacement records steps 1 and
    2 and then gets step 1's first delivery again (ack_wait ran out): ignored, nothing rolled back.
    A step 2 published anew (a trainer restored at version 1) is a restart: step 2 is rolled back."""
    bus = await bus_factory(provision=True)
    controller = Controller(_context(bus, run_name, tmp_path, "controller"))
    ids = [controller.state.take_new(0, i).task_id for i in range(4)]
    acked: list[int] = []

    def delivery(seq: int) -> SimpleNamespace:
        async def ack() -> None:
            acked.append(seq)

        return SimpleNamespace(stream_seq=seq, ack=ack)

    def step(n: int) -> TrainerStep:
        return TrainerStep(
            step=n, policy_version=n, task_ids=ids[2 * n - 2 : 2 * n], head_versions=[n - 1] * 2
        )

    await controller._trainer_step(step(1), delivery(11))
    await controller._trainer_step(step(2), delivery(12))
    await controller._trainer_step(step(1), delivery(11))  # the stopped controller's copy, again
    assert controller.state.trained == 4 and sorted(controller.state.step_tasks) == [1, 2]
    assert controller.state.trainer_step == 2 and acked == [11, 12, 11]
    await controller._trainer_step(step(2), delivery(13))  # repeated by a restored trainer
    assert controller.state.trained == 4 and controller.state.step_seq == 13
    restored = Controller(_context(bus, run_name, tmp_path, "controller"))
    await restored.load()  # the sequence is saved with the rest of the controller's state
    assert restored.state.step_seq == 13 and restored.state.trained == 4
