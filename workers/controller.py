"""Controller: dataset feeder, staleness admission, evaluation rounds, end of run.

Data flow: controller --prompt--> generation; trainer --trainer.step--> controller;
trainer --rollout.failed--> controller; weight-sync --weights.served--> controller;
reward --eval.scored--> controller.

Admission is the rule of docs/design.md section 5 (``areal_async.algo.staleness`` via
``areal_async.scheduler``): a training task is issued only while
``issued < (max_staleness + v + 1) * B`` and ``issued - trained < max_inflight``, with ``v`` the
version every engine serves. Failed tasks (stale, future, error) are re-issued with a higher
attempt number; ``filtered`` and ``duplicate`` ones are not.

Before a task is published, its ``issued.<task_id>`` record (kind, epoch, index, attempt) is
written to the run state (``bus.state``); generation workers and the trainer act only on tasks
matching one. The controller acts only on events about tasks it has in flight, with their
epoch, index and attempt; an event that fails these checks, or whose handling raises, is
dead-lettered with the reason and the controller goes on (docs/design.md section 8). Restored
state that fails validation is quarantined (logged, kept aside, in the dead letters), never a
crash loop.

Evaluation: at version 0, every ``trainer.eval_every`` served versions, and at the end,
the held-out split is issued as ``eval`` tasks (greedy, one completion each, outside
admission, never trained). Their accuracy (``eval/accuracy``, with ``eval/count`` and the
other ``eval/*`` values) is appended to ``<run_dir>/eval.jsonl`` and published on ``metrics``,
where the trainer hands it to the experiment trackers.

Guarantees: a single logical instance; its state lives in the run's KV bucket after every
change, so a restarted controller continues without double-issuing (publishes carry
``Nats-Msg-Id = task_id:attempt`` and JetStream drops duplicates). The run ends (``run.ended``)
once the trainer reached ``trainer.total_steps``, the engines serve that version and the
final evaluation is in.

Run alone: areal-worker --role controller --config configs/arith_cpu.yaml
"""

from __future__ import annotations

import math
import time
from typing import Any

import anyio
import structlog

from areal_async.data import DatasetCursor, load_dataset
from areal_async.scheduler import Issue, SchedulerState
from bus.events import (
    MetricsReport,
    PromptTask,
    RolloutFailed,
    RunEnded,
    ScoredGroup,
    TrainerStep,
    WeightsServed,
)
from bus.state import CONTROLLER, RUN_ENDED, WEIGHTS_SERVED, IssuedTask, RunState, StateRecordError
from bus.subjects import Buckets, Streams
from workers.common import append_jsonl, settle_or_dead_letter
from workers.runtime import WorkerContext

log = structlog.get_logger()

ISSUE_CONCURRENCY = 64
"""Tasks of one issue burst recorded and published at once (each is two round trips to the server)."""


class Rejected(ValueError):
    """An event about a task this controller did not issue, or with fields its records contradict."""


class Controller:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        cfg = ctx.cfg
        self.cfg = cfg
        self.bus = ctx.bus
        self.run_state = RunState(ctx.bus)
        ds = cfg.dataset
        self.train_rows = load_dataset(ds.kind, path=ds.path, split="train", seed=ds.seed, **ds.options)
        self.eval_rows = (
            load_dataset(ds.kind, path=ds.path, split="eval", seed=ds.seed, **ds.options)[: ds.eval_size]
            if ds.eval_size
            else []
        )
        self._reset()
        self.ended_event = anyio.Event()
        self.dropped_on_restore: list[str] = []
        send, recv = anyio.create_memory_object_stream[None](1)
        self._wake_send, self._wake_recv = send, recv

    def _reset(self) -> None:
        """The state of a fresh run."""
        cfg, ds = self.cfg, self.cfg.dataset
        self.cursor = DatasetCursor(self.train_rows, seed=ds.seed, epochs=ds.epochs)
        self.state = SchedulerState(
            max_staleness=cfg.rollout.max_staleness,
            batch_size=cfg.trainer.batch_size,
            max_inflight=cfg.max_inflight,
        )
        self.trainer_version = 0
        self.eval_issued: set[int] = set()
        self.eval_results: dict[int, dict[str, Any]] = {}
        self.eval_done: set[int] = set()
        self.ended = False

    # ---- persistence -------------------------------------------------------------------

    async def load(self) -> None:
        try:
            data = await self.run_state.get(CONTROLLER)
            if data is None:
                log.info("fresh run", train_rows=len(self.train_rows), eval_rows=len(self.eval_rows))
                return
            self._restore(data)
        except (StateRecordError, KeyError, TypeError, ValueError, AttributeError) as exc:
            entry = await self.bus.kv_get(Buckets.STATE, CONTROLLER)
            raw = entry.value if entry is not None and entry.value is not None else b""
            await self.bus.kv_put(Buckets.STATE, CONTROLLER + ".quarantined", raw)
            await self._quarantine(
                f"controller state unusable ({type(exc).__name__}: {exc}); kept under "
                f"'{CONTROLLER}.quarantined', starting afresh",
                raw,
            )
            self._reset()
            return
        log.info(
            "controller state restored",
            issued=self.state.issued,
            trained=self.state.trained,
            served_version=self.state.served_version,
            trainer_version=self.trainer_version,
        )

    def _restore(self, data: dict[str, Any]) -> None:
        rollout, trainer = self.cfg.rollout, self.cfg.trainer
        self.state = SchedulerState.from_dict(
            data["scheduler"],
            max_staleness=rollout.max_staleness,
            batch_size=trainer.batch_size,
            max_inflight=self.cfg.max_inflight,
        )
        self.cursor.load_state_dict(data["cursor"])
        self.trainer_version = int(data.get("trainer_version", 0))
        self.eval_issued = {int(v) for v in data.get("eval_issued", [])}
        self.eval_done = {int(v) for v in data.get("eval_done", [])}
        self.eval_results = {int(k): dict(v) for k, v in data.get("eval_results", {}).items()}
        self.ended = bool(data.get("ended", False))
        self.dropped_on_restore = self._drop_out_of_range()

    def _drop_out_of_range(self) -> list[str]:
        """Retry and in-flight entries naming rows this dataset does not have (another dataset, a corrupt
        or forged state): dropped, each named in the log and the dead letters by ``load``'s caller."""
        rows = len(self.train_rows)
        dropped = [f"retry {r}" for r in self.state.retry if not 0 <= int(r[2]) < rows]
        self.state.retry = type(self.state.retry)(r for r in self.state.retry if 0 <= int(r[2]) < rows)
        if self.state.inflight is not None:
            bad = [t for t, (_e, i, _a) in self.state.inflight.items() if not 0 <= i < rows]
            for task_id in bad:
                del self.state.inflight[task_id]
            dropped += [f"in-flight {t}" for t in bad]
        return dropped

    async def _quarantine(self, reason: str, data: bytes = b"") -> None:
        log.error("controller state quarantined", reason=reason)
        await self.bus.dead_letter(self.bus.subjects.prefix + "state." + CONTROLLER, reason, data)

    async def save(self) -> None:
        data = {
            "scheduler": self.state.to_dict(),
            "cursor": self.cursor.state_dict(),
            "trainer_version": self.trainer_version,
            "eval_issued": sorted(self.eval_issued),
            "eval_done": sorted(self.eval_done),
            "eval_results": {str(k): v for k, v in self.eval_results.items()},
            "ended": self.ended,
        }
        await self.run_state.record(CONTROLLER, **data)

    def wake(self) -> None:
        try:
            self._wake_send.send_nowait(None)
        except anyio.WouldBlock:
            pass

    # ---- issuing -----------------------------------------------------------------------

    @property
    def train_target(self) -> int:
        return self.cfg.trainer.total_steps * self.cfg.trainer.batch_size

    async def publish_task(self, issue: Issue, row: dict[str, Any], kind: str = "train") -> None:
        """Record the issue in the run state, then publish the task (the trainer checks the record)."""
        await self.run_state.issue(
            IssuedTask(
                task_id=issue.task_id, kind=kind, epoch=issue.epoch, index=issue.index, attempt=issue.attempt
            )
        )
        task = PromptTask(
            task_id=issue.task_id,
            kind=kind,
            index=issue.index,
            epoch=issue.epoch,
            attempt=issue.attempt,
            row=row,
            issued_at=time.time(),
        )
        await self.bus.publish(
            self.bus.subjects.prompt,
            task,
            msg_id=f"{issue.task_id}:{issue.attempt}",
            policy_version=self.state.served_version,
        )

    async def issue_loop(self) -> None:
        async for _ in self._wake_recv:
            await self.issue_ready()

    async def issue_ready(self) -> None:
        """Issue every task admission allows now, as one burst: the tasks are recorded and published
        concurrently (at most ``ISSUE_CONCURRENCY`` round trips in flight), then the state is saved
        once. A controller that dies mid-burst restarts from the state before it and issues the same
        ``task_id:attempt`` again, which JetStream drops as duplicates."""
        started = time.monotonic()
        burst: list[tuple[Issue, dict[str, Any]]] = []
        while not self.ended and self.state.issued < self.train_target and self.state.can_issue():
            issue = self.state.take_retry()
            if issue is not None:
                row = self.train_rows[issue.index]  # in range: checked on failure and on restore
            elif self.cursor.exhausted:
                break
            else:
                epoch, index, row = self.cursor.next()
                issue = self.state.take_new(epoch, index)
            burst.append((issue, row))
        issued_now = len(burst)
        if burst:
            async with self.ctx.working("issuing"):
                limiter = anyio.CapacityLimiter(ISSUE_CONCURRENCY)

                async def publish(issue: Issue, row: dict[str, Any]) -> None:
                    async with limiter:
                        await self.publish_task(issue, row)

                async with anyio.create_task_group() as tg:
                    for issue, row in burst:
                        tg.start_soon(publish, issue, row)
                await self.save()
        if issued_now:
            self.ctx.progressed(issued_now)
            self.ctx.set_status("issuing")
            log.info(
                "tasks issued",
                count=issued_now,
                seconds=round(time.monotonic() - started, 4),
                issued=self.state.issued,
                trained=self.state.trained,
                served_version=self.state.served_version,
            )
        elif not self.ended:
            self.ctx.set_status("waiting", self._waiting_for())
        await self.maybe_finish()

    def _waiting_for(self) -> str:
        if self.state.issued >= self.train_target:
            return "all training tasks issued; waiting for the trainer"
        if self.cursor.exhausted and not self.state.retry:
            return "dataset exhausted; waiting for in-flight tasks"
        return "admission closed; waiting for training progress or new weights"

    async def issue_eval(self, version: int) -> None:
        if version in self.eval_issued or not self.eval_rows:
            return
        self.eval_issued.add(version)
        self.eval_results[version] = {"correct": 0.0, "count": 0, "versions": 0.0, "started": time.time()}
        for i, row in enumerate(self.eval_rows):
            await self.publish_task(Issue(f"eval-v{version}-i{i}", 0, i, 0), row, kind="eval")
        await self.save()
        log.info("eval issued", policy_version=version, prompts=len(self.eval_rows))

    def eval_due(self, version: int) -> bool:
        every = self.cfg.trainer.eval_every
        return version == 0 or version == self.cfg.trainer.total_steps or (every > 0 and version % every == 0)

    # ---- event handlers ------------------------------------------------------------------

    async def on_trainer_steps(self) -> None:
        async for d in self.bus.consume(Streams.STEPS):
            async with self.ctx.working("recording a step"):
                await settle_or_dead_letter(d, lambda ev, d=d: self._trainer_step(ev, d), what="trainer.step")
            self.ctx.progressed()

    async def _trainer_step(self, ev: Any, delivery: Any) -> None:
        if not isinstance(ev, TrainerStep):
            raise Rejected(f"expected a TrainerStep, got {type(ev).__name__}")
        total = self.cfg.trainer.total_steps
        if ev.policy_version != ev.step or not 1 <= ev.step <= total:
            raise Rejected(
                f"step {ev.step} / policy_version {ev.policy_version} outside 1..{total} or unequal"
            )
        if len(ev.head_versions) != len(ev.task_ids) or len(ev.task_ids) != self.cfg.trainer.batch_size:
            raise Rejected(
                f"{len(ev.task_ids)} task ids and {len(ev.head_versions)} head versions; "
                f"expected trainer.batch_size={self.cfg.trainer.batch_size} of each"
            )
        if delivery.stream_seq <= self.state.step_seq:
            # Delivered again after newer steps were recorded: a stopped controller held it unacked and
            # the consumer redelivers it once ack_wait ends. A trainer restarted from a checkpoint
            # publishes its repeated steps anew, with higher sequence numbers (rolled back below).
            log.info("trainer.step delivered again; already recorded", step=ev.step, seq=delivery.stream_seq)
            await delivery.ack()
            return
        problem = self.state.check_trained(ev.step, list(ev.task_ids))
        if problem:
            raise Rejected(problem)
        rolled_back = self.state.on_trained(ev.step, list(ev.task_ids))
        self.state.step_seq = delivery.stream_seq
        if rolled_back:
            log.warning("trainer restarted from a checkpoint; rolled back", step=ev.step, groups=rolled_back)
        self.trainer_version = ev.policy_version
        await self.save()
        await delivery.ack()
        self.wake()

    async def on_failed(self) -> None:
        async for d in self.bus.consume(Streams.FAILED):
            async with self.ctx.working("recycling a failed task"):
                await settle_or_dead_letter(d, lambda ev, d=d: self._failed(ev, d), what="rollout.failed")
            self.ctx.progressed()

    async def _failed(self, ev: Any, delivery: Any) -> None:
        if not isinstance(ev, RolloutFailed):
            raise Rejected(f"expected a RolloutFailed, got {type(ev).__name__}")
        if ev.kind == "train":
            # A trainer's failure may recycle a group of a step it lost; a duplicate never does.
            trainer_version = ev.trainer_version if ev.reason != "duplicate" else -1
            problem = self.state.check_failed(ev.task_id, ev.epoch, ev.index, ev.attempt, trainer_version)
            if problem and ev.reason == "duplicate":  # a redelivery of a group already counted
                await delivery.ack()
                return
            if problem:
                raise Rejected(problem)
            lost = self.state.lost_step(ev.task_id, trainer_version)
            again = self.state.on_failed(
                ev.task_id, ev.epoch, ev.index, ev.attempt, ev.reason, trainer_version
            )
            log.info(
                "task failed",
                task_id=ev.task_id,
                reason=ev.reason,
                reissue=again,
                lost_step=lost,
                detail=ev.detail[:200],
            )
            await self.save()
        else:  # an evaluation task that produced nothing (its workflow failed) counts as wrong
            await self._eval_result(ev.task_id, correct=0.0, head_version=ev.head_version, stats={})
        await delivery.ack()
        self.wake()

    async def on_served(self) -> None:
        try:
            served = await self.run_state.weights(WEIGHTS_SERVED)
        except StateRecordError as exc:
            await self._quarantine(f"{WEIGHTS_SERVED} record unusable ({exc}); waiting for the next one")
            served = None
        await self._served(served.policy_version if served else 0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._served_from_state)
            async for ev in self.bus.subscribe(self.bus.subjects.weights_served):
                if isinstance(ev, WeightsServed):
                    await self._served(ev.policy_version)
            tg.cancel_scope.cancel()

    async def _served_from_state(self) -> None:
        """A ``weights.served`` lost in a disconnect would close admission for good: the state key
        (written before the event) is the truth, re-read every heartbeat interval."""
        async for served in self.run_state.latest(WEIGHTS_SERVED, self.cfg.bus.heartbeat_interval_s):
            version = served.get("policy_version") if served else None
            if isinstance(version, int) and version != self.state.served_version:
                log.info("weights served, read from the state bucket", policy_version=version)
                await self._served(version)

    async def _served(self, version: int) -> None:
        """A version every engine serves; one beyond what the trainer can have made is ignored."""
        if not 0 <= version <= self.cfg.trainer.total_steps:
            log.error("ignoring weights.served outside 0..total_steps", policy_version=version)
            return
        self.state.on_served(version)
        self.ctx.policy_version = version
        await self.save()
        if self.eval_due(version):
            await self.issue_eval(version)
        self.wake()

    async def on_eval(self) -> None:
        async for d in self.bus.consume(Streams.EVAL):
            async with self.ctx.working("recording an evaluation"):
                await settle_or_dead_letter(d, lambda ev, d=d: self._eval_scored(ev, d), what="eval.scored")
            self.ctx.progressed()

    async def _eval_scored(self, ev: Any, delivery: Any) -> None:
        if not isinstance(ev, ScoredGroup):
            raise Rejected(f"expected a ScoredGroup, got {type(ev).__name__}")
        if ev.group.kind != "eval" or not all(math.isfinite(r) for r in ev.rewards):
            raise Rejected(f"eval task {ev.group.task_id!r}: not an eval group, or non-finite rewards")
        correct = float(ev.rewards[0] > 0.5) if ev.rewards else 0.0
        await self._eval_result(
            ev.group.task_id, correct=correct, head_version=ev.group.head_version, stats=ev.group.timings
        )
        await delivery.ack()

    async def _eval_result(
        self, task_id: str, *, correct: float, head_version: int, stats: dict[str, float]
    ) -> None:
        """Count one evaluation prompt (once); the round ends when every prompt is in."""
        version, index = _eval_position(task_id)
        res = self.eval_results.get(version)
        if res is None or not 0 <= index < len(self.eval_rows):
            raise Rejected(f"eval task {task_id!r} was not issued by this controller")
        if version in self.eval_done:
            return
        seen = res.setdefault("seen", [])
        if task_id not in seen:
            seen.append(task_id)
            res["correct"] += correct
            res["count"] += 1
            res["versions"] += max(0, head_version)
            sums = res.setdefault("episode", {})  # agent workers' per-episode statistics
            for key, value in stats.items():
                if key.startswith("episode/") and math.isfinite(value):
                    sums[key] = sums.get(key, 0.0) + value
        if res["count"] >= len(self.eval_rows):
            await self.eval_finished(version, res)
        await self.save()

    async def eval_finished(self, version: int, res: dict[str, Any]) -> None:
        self.eval_done.add(version)
        accuracy = res["correct"] / max(1, res["count"])
        line = {
            "policy_version": version,
            "eval/accuracy": accuracy,
            "eval/count": res["count"],
            "eval/mean_head_version": res["versions"] / max(1, res["count"]),
            "eval/seconds": time.time() - res["started"],
            **{f"eval/{k}": v / max(1, res["count"]) for k, v in res.get("episode", {}).items()},
            "time": time.time(),
        }
        res.pop("seen", None)
        append_jsonl(self.ctx.run_dir / "eval.jsonl", line)
        await self.bus.publish(
            self.bus.subjects.metrics,
            MetricsReport(
                step=version,
                policy_version=version,
                values={k: float(v) for k, v in line.items() if k.startswith("eval/")},
            ),
        )
        log.info("eval done", policy_version=version, accuracy=round(accuracy, 4), count=res["count"])
        self.wake()

    async def maybe_finish(self) -> None:
        total = self.cfg.trainer.total_steps
        done_training = self.trainer_version >= total and self.state.served_version >= total
        starved = self.cursor.exhausted and not self.state.retry and self.state.trained >= self.state.issued
        if self.ended or not (done_training or starved):
            return
        final = self.state.served_version
        if self.eval_rows and final not in self.eval_done:
            await self.issue_eval(final)
            return
        self.ended = True
        await self.save()
        reason = "total_steps reached" if done_training else "dataset exhausted"
        await self.run_state.record_then_publish(
            RUN_ENDED,
            {"reason": reason, "policy_version": final},
            self.bus.subjects.run_ended,
            RunEnded(reason=reason, policy_version=final, steps=self.trainer_version),
        )
        log.info("run ended", reason=reason, policy_version=final, issued=self.state.total_issued)
        self.ended_event.set()


def _eval_position(task_id: str) -> tuple[int, int]:
    """``(version, index)`` of an eval task id ``eval-v<version>-i<index>``; Rejected otherwise."""
    parts = task_id.split("-")
    if len(parts) != 3 or parts[0] != "eval" or parts[1][:1] != "v" or parts[2][:1] != "i":
        raise Rejected(f"{task_id!r} is not an eval task id")
    try:
        return int(parts[1][1:]), int(parts[2][1:])
    except ValueError:
        raise Rejected(f"{task_id!r} is not an eval task id") from None


async def serve(ctx: WorkerContext) -> None:
    controller = Controller(ctx)
    await controller.load()
    for entry in controller.dropped_on_restore:
        await controller._quarantine(f"restored {entry} names a row outside the dataset; dropped")
    if controller.ended:
        log.info("run already ended; nothing to do")
        return
    ctx.set_status("ready")
    async with anyio.create_task_group() as tg:
        tg.start_soon(controller.issue_loop)
        tg.start_soon(controller.on_trainer_steps)
        tg.start_soon(controller.on_failed)
        tg.start_soon(controller.on_served)
        tg.start_soon(controller.on_eval)
        controller.wake()
        await controller.ended_event.wait()
        tg.cancel_scope.cancel()
