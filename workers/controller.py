"""Controller: dataset feeder, staleness admission, evaluation rounds, end of run.

Data flow: controller --prompt--> generation; trainer --trainer.step--> controller;
trainer --rollout.failed--> controller; weight-sync --weights.served--> controller;
reward --eval.scored--> controller.

Admission is DESIGN section 4's rule (``areal_async.scheduler``): a training task is
issued only while ``issued < (eta + v + 1) * B`` and ``issued - trained < max_inflight``,
with ``v`` the version every engine serves. Failed tasks (stale, future, error) are
re-issued with a higher attempt number; ``filtered`` ones (dynamic sampling) are not.

Evaluation: at version 0, every ``trainer.eval_every`` served versions, and at the end,
the held-out split is issued as ``eval`` tasks (greedy, one completion each, outside
admission, never trained). Their accuracy is published as ``eval/accuracy`` on
``metrics`` and appended to ``<run_dir>/eval.jsonl``.

Guarantees: a single logical instance; its state lives in the run's KV bucket after every
change, so a restarted controller continues without double-issuing (publishes carry
``Nats-Msg-Id = task_id:attempt`` and JetStream drops duplicates). The run ends (``run.ended``)
once the trainer reached ``trainer.total_steps``, the engines serve that version and the
final evaluation is in.

Run alone: areal-worker --role controller --config configs/arith_cpu.yaml
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import msgpack
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
from workers.common import RUN_ENDED_KEY, WEIGHTS_SERVED_KEY, append_jsonl, state_records, unpack_record
from workers.runtime import WorkerContext

log = structlog.get_logger()

STATE_KEY = "controller"


class Controller:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        cfg = ctx.cfg
        self.cfg = cfg
        self.bus = ctx.bus
        ds = cfg.dataset
        self.train_rows = load_dataset(ds.kind, path=ds.path, split="train", seed=ds.seed, **ds.options)
        self.eval_rows = (
            load_dataset(ds.kind, path=ds.path, split="eval", seed=ds.seed, **ds.options)[: ds.eval_size]
            if ds.eval_size
            else []
        )
        self.cursor = DatasetCursor(self.train_rows, seed=ds.seed, epochs=ds.epochs)
        self.state = SchedulerState(
            eta=cfg.rollout.max_staleness, batch_size=cfg.trainer.batch_size, max_inflight=cfg.max_inflight
        )
        self.trainer_version = 0
        self.eval_issued: set[int] = set()
        self.eval_results: dict[int, dict[str, Any]] = {}
        self.eval_done: set[int] = set()
        self.ended = False
        self.ended_event = anyio.Event()
        send, recv = anyio.create_memory_object_stream[None](1)
        self._wake_send, self._wake_recv = send, recv

    # ---- persistence -------------------------------------------------------------------

    async def load(self) -> None:
        data = unpack_record(await self.bus.kv_get("state", STATE_KEY))
        if data is None:
            log.info("fresh run", train_rows=len(self.train_rows), eval_rows=len(self.eval_rows))
            return
        rollout, trainer = self.cfg.rollout, self.cfg.trainer
        self.state = SchedulerState.from_dict(
            data["scheduler"],
            eta=rollout.max_staleness,
            batch_size=trainer.batch_size,
            max_inflight=self.cfg.max_inflight,
        )
        self.cursor.load_state_dict(data["cursor"])
        self.trainer_version = int(data.get("trainer_version", 0))
        self.eval_issued = set(data.get("eval_issued", []))
        self.eval_done = set(data.get("eval_done", []))
        self.eval_results = {int(k): v for k, v in data.get("eval_results", {}).items()}
        self.ended = bool(data.get("ended", False))
        log.info(
            "controller state restored",
            issued=self.state.issued,
            trained=self.state.trained,
            served_version=self.state.served_version,
            trainer_version=self.trainer_version,
        )

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
        await self.bus.kv_put("state", STATE_KEY, msgpack.packb(data))

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
        issued_now = 0
        while not self.ended and self.state.issued < self.train_target and self.state.can_issue():
            issue = self.state.take_retry()
            if issue is not None:
                row = self.train_rows[issue.index]
            elif self.cursor.exhausted:
                break
            else:
                epoch, index, row = self.cursor.next()
                issue = self.state.take_new(epoch, index)
            await self.publish_task(issue, row)
            await self.save()
            issued_now += 1
        if issued_now:
            self.ctx.set_status("issuing")
            log.info(
                "tasks issued",
                count=issued_now,
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
        async for d in self.bus.consume("STEPS"):
            ev = d.event
            assert isinstance(ev, TrainerStep)
            rolled_back = self.state.on_trained(ev.step, list(ev.task_ids))
            if rolled_back:
                log.warning(
                    "trainer restarted from a checkpoint; rolled back", step=ev.step, groups=rolled_back
                )
            self.trainer_version = ev.policy_version
            await self.save()
            await d.ack()
            self.wake()

    async def on_failed(self) -> None:
        async for d in self.bus.consume("FAILED"):
            ev = d.event
            assert isinstance(ev, RolloutFailed)
            if ev.kind == "train":
                again = self.state.on_failed(ev.task_id, ev.epoch, ev.index, ev.attempt, ev.reason)
                log.info("task failed", task_id=ev.task_id, reason=ev.reason, reissue=again, detail=ev.detail)
                await self.save()
            await d.ack()
            self.wake()

    async def on_served(self) -> None:
        served = unpack_record(await self.bus.kv_get("state", WEIGHTS_SERVED_KEY))
        await self._served(int(served["policy_version"]) if served else 0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._served_from_state)
            async for ev in self.bus.subscribe(self.bus.subjects.weights_served):
                if isinstance(ev, WeightsServed):
                    await self._served(ev.policy_version)
            tg.cancel_scope.cancel()

    async def _served_from_state(self) -> None:
        """A ``weights.served`` lost in a disconnect would close admission for good: the state key
        (written before the event) is the truth, re-read every heartbeat interval."""
        every = self.cfg.bus.heartbeat_interval_s
        async for served in state_records(self.bus, WEIGHTS_SERVED_KEY, every):
            if served and int(served["policy_version"]) != self.state.served_version:
                log.info(
                    "weights served, read from the state bucket", policy_version=served["policy_version"]
                )
                await self._served(int(served["policy_version"]))

    async def _served(self, version: int) -> None:
        self.state.on_served(version)
        self.ctx.policy_version = version
        await self.save()
        if self.eval_due(version):
            await self.issue_eval(version)
        self.wake()

    async def on_eval(self) -> None:
        async for d in self.bus.consume("EVAL"):
            ev = d.event
            assert isinstance(ev, ScoredGroup)
            task_id = ev.group.task_id
            try:
                version = int(task_id.split("-")[1][1:])
            except (IndexError, ValueError):
                await d.ack()
                continue
            res = self.eval_results.get(version)
            if res is not None and version not in self.eval_done:
                seen = res.setdefault("seen", [])
                if task_id not in seen:
                    seen.append(task_id)
                    res["correct"] += float(ev.rewards[0] > 0.5) if ev.rewards else 0.0
                    res["count"] += 1
                    res["versions"] += ev.group.head_version
                if res["count"] >= len(self.eval_rows):
                    await self.eval_finished(version, res)
                await self.save()
            await d.ack()

    async def eval_finished(self, version: int, res: dict[str, Any]) -> None:
        self.eval_done.add(version)
        accuracy = res["correct"] / max(1, res["count"])
        line = {
            "policy_version": version,
            "eval/accuracy": accuracy,
            "eval/count": res["count"],
            "eval/mean_head_version": res["versions"] / max(1, res["count"]),
            "eval/seconds": time.time() - res["started"],
            "time": time.time(),
        }
        res.pop("seen", None)
        append_jsonl(self.ctx.run_dir / "eval.jsonl", line)
        await self.bus.publish(
            self.bus.subjects.metrics,
            MetricsReport(step=version, policy_version=version, values={"eval/accuracy": accuracy}),
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
        await self.bus.kv_put(
            "state", RUN_ENDED_KEY, msgpack.packb({"reason": reason, "policy_version": final})
        )
        await self.bus.publish(
            self.bus.subjects.run_ended,
            RunEnded(reason=reason, policy_version=final, steps=self.trainer_version),
        )
        log.info("run ended", reason=reason, policy_version=final, issued=self.state.total_issued)
        self.ended_event.set()


async def serve(ctx: WorkerContext) -> None:
    controller = Controller(ctx)
    await controller.load()
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
