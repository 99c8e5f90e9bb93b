"""Trainer worker: scored groups in, policy versions out.

Data flow: reward --rollout.scored--> trainer --weights.published--> weight-sync;
trainer --trainer.step / rollout.failed--> controller.

Rank 0 talks to the bus; with ``trainer.num_ranks > 1`` (torchrun) the other ranks only
compute (``Learner.follow``). Each step at trainer version ``t``:

0. check each received group at the boundary (docs/design.md section 8): its task id, kind,
   epoch, index and attempt must match the controller's ``issued.<task_id>`` record in the run
   state, else it is dead-lettered and never re-issued; its numbers must be finite and its arrays
   aligned (``workers/scored_groups.py``), else it is dead-lettered and reported ``error`` so the
   prompt is re-issued. A group of a task a committed step already trained is acked and
   reported ``duplicate``;
1. keep received groups oldest-first (by head_version, then arrival); apply the guard
   ``t - max_staleness <= head_version <= t``: a group outside the window is not trained, it is
   published as ``rollout.failed`` (``stale``/``future``) and acked so the controller
   re-issues its prompt; with dynamic sampling a group whose rewards are all equal is
   ``filtered``;
2. train on the B oldest trainable groups (pi_prox forward, decoupled PPO update): t -> t+1;
3. save ``weights/v<t+1>/`` (with ``weight_sync.transport: bus`` first into the run's weights
   bucket, ``workers/weight_bus.py``) and publish ``weights.published`` (path + manifest);
4. publish ``trainer.step`` (task ids, head versions, metrics), append ``metrics.jsonl`` and log
   the metrics (every ``metrics.rollout_every`` steps also a sample of the batch's rollouts) to the
   experiment trackers of ``metrics.loggers`` (``workers/trackers.py``), which also get the
   controller's evaluations (``metrics``) and the resolved config.

Lossless resume (docs/design.md section 8): trained groups stay unacknowledged until the next
checkpoint commits (every ``checkpoint.every_steps`` and at the end); only then are they
acked. A trainer killed between checkpoints restarts from the last one: the groups of the
lost steps are redelivered (at once: a starting trainer reclaims what its predecessor held,
``Bus.reclaim``) and trained again (or recycled by the guard), the controller
rolls back its count when it sees a repeated step number. Task ids of every committed
step are in the checkpoint, so nothing is trained twice.

Run alone: areal-worker --role trainer --config configs/arith_cpu.yaml
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus

from areal_async.algo.advantages import dynamic_sampling_keep
from areal_async.algo.staleness import StalenessStats, guard
from areal_async.config import RunConfig
from areal_async.run_file import config_to_dict
from areal_async.weight_buckets import decode_manifest, nbytes
from bus.events import (
    MetricsReport,
    RolloutFailed,
    ScoredGroup,
    TensorEntry,
    TrainerStep,
    WeightsPublished,
)
from bus.state import WEIGHTS_PUBLISHED, RunState, StateRecordError
from bus.subjects import Streams
from workers.common import (
    append_jsonl,
    resolve_model_path,
    settle_or_dead_letter,
    weights_dir,
)
from workers.runtime import WorkerContext, io_thread_affinity
from workers.scored_groups import Unfit, check_content, to_sample
from workers.trackers import ROLLOUT_COLUMNS, Trackers, open_trackers, rollout_rows
from workers.weight_bus import BusWeightWriter
from workers.weight_memory import WeightSender

log = structlog.get_logger()

EVAL_GRACE_S = 0.5
"""After run.ended, how long the trainer keeps reading ``metrics`` for the last evaluation (its
report arrived first, on the same connection)."""


@dataclass
class Held:
    """A received group and the delivery that acks it."""

    scored: ScoredGroup
    delivery: Any
    arrived: float

    @property
    def task_id(self) -> str:
        return self.scored.group.task_id

    @property
    def head_version(self) -> int:
        return self.scored.group.head_version


class RunOver(Exception):
    """The run ended (dataset exhausted) while the trainer waited for data."""


class Trainer:
    def __init__(
        self, ctx: WorkerContext, learner: Any, *, trained_ids: set[str], trackers: Trackers | None = None
    ) -> None:
        self.ctx = ctx
        self.cfg: RunConfig = ctx.cfg
        self.bus = ctx.bus
        self.run_state = RunState(ctx.bus)
        self.learner = learner
        self.pending: dict[str, Held] = {}
        self.uncommitted: dict[str, Held] = {}
        self.trained_ids = trained_ids
        self.arrived = anyio.Event()
        self.metrics_file = self.cfg.run_dir / "metrics.jsonl"
        self.weights_out, self.weights_in = anyio.create_memory_object_stream[tuple[int, Any]](1)
        self.last_write_s = 0.0
        self._bus_total = 0.0
        self.trackers = trackers
        self.started = time.time()
        transport = self.cfg.weight_sync.transport
        in_memory = transport in ("gloo", "nccl", "cuda_ipc")
        self.sender = WeightSender(self.cfg, self.cfg.trainer.device) if in_memory else None
        self.bus_writer = BusWeightWriter(self.cfg, self.bus) if transport == "bus" else None
        # In memory, the snapshot is the engines' dtype and stays on the GPU (a device copy, so the
        # step does not wait for the host); the disk copy's writer moves it to the host. On disk,
        # the float32 snapshot goes to the host (it may be several times the GPU's spare memory).
        # Through the bus, the engines' dtype on the host (the codec runs on the CPU).
        self.snapshot_options = {
            "dtype": self.cfg.model.dtype if transport != "disk" else "",
            "on_device": in_memory and self.cfg.trainer.device == "cuda",
        }

    @property
    def version(self) -> int:
        return int(self.learner.version)

    # ---- intake -------------------------------------------------------------------------------

    async def receive(self) -> None:
        async for d in self.bus.consume(Streams.SCORED, batch=64):
            await settle_or_dead_letter(d, lambda ev, d=d: self.intake(ev, d), what="rollout.scored")

    async def intake(self, scored: Any, delivery: Any) -> None:
        """Hold a received group for training, or settle it now (duplicate, unissued, unfit)."""
        if not isinstance(scored, ScoredGroup):
            raise Unfit(f"expected a ScoredGroup, got {type(scored).__name__}")
        g = scored.group
        task_id = g.task_id
        if task_id in self.trained_ids:
            # A redelivery of a group a committed step already trained, or a re-issue of one.
            await self.fail(Held(scored, delivery, 0.0), "duplicate", "a committed step already trained it")
            return
        issued = await self.run_state.issued(task_id)
        problem = (
            "the controller never issued it"
            if issued is None
            else issued.mismatch(
                task_id=task_id, kind=g.kind, epoch=g.epoch, index=g.index, attempt=g.attempt
            )
        )
        if problem or g.kind != "train":
            raise Unfit(f"not trainable: {problem or 'an eval task'}")
        held = Held(scored, delivery, time.monotonic())
        try:
            check_content(scored)
        except Unfit as exc:
            await self.fail(held, "error", str(exc), ack=False)
            await delivery.dead_letter(f"rollout.scored rejected: {exc}")
            return
        if task_id in self.uncommitted:
            self.uncommitted[task_id] = held  # newer delivery handle of a trained group
            return
        self.pending[task_id] = held
        self.arrived.set()

    async def keep_alive(self) -> None:
        """Held messages must not hit ack_wait: tell the server we are still working on them."""
        period = max(1.0, self.cfg.bus.ack_wait_s / 3)
        while True:
            await anyio.sleep(period)
            for held in [*self.pending.values(), *self.uncommitted.values()]:
                try:
                    await held.delivery.in_progress()
                except Exception as exc:
                    log.warning("in_progress failed", task_id=held.task_id, error=str(exc))

    async def fail(self, held: Held, reason: str, detail: str, *, ack: bool = True) -> None:
        g = held.scored.group
        await self.bus.publish(
            self.bus.subjects.rollout_failed,
            RolloutFailed(
                task_id=g.task_id,
                kind=g.kind,
                index=g.index,
                epoch=g.epoch,
                attempt=g.attempt,
                reason=reason,
                detail=detail,
                head_version=g.head_version,
                trainer_version=self.version,
            ),
            msg_id=f"{g.task_id}:{g.attempt}:{reason}",
        )
        if ack:
            await held.delivery.ack()
        if self.pending.get(g.task_id) is held:
            del self.pending[g.task_id]

    def verdict(self, held: Held) -> tuple[str, str]:
        """("ok", "") if ``held`` may be trained now, else (reason, detail) for rollout.failed."""
        verdict = guard(
            head_version=held.head_version,
            trainer_version=self.version,
            max_staleness=self.cfg.rollout.max_staleness,
        )
        if verdict != "ok":
            return verdict, f"head_version {held.head_version} at trainer version {self.version}"
        if self.cfg.trainer.loss.dynamic_sampling and not dynamic_sampling_keep(held.scored.rewards):
            return "filtered", "all rewards in the group are equal"
        return "ok", ""

    async def next_batch(self) -> list[Held]:
        """The B oldest trainable groups; applies the guard and the dynamic-sampling filter.

        The batch is chosen without an await after its last check, so a group that arrives
        while others are being failed is never trained unchecked.
        """
        batch_size = self.cfg.trainer.batch_size
        while True:
            unfit = [(held, *self.verdict(held)) for held in list(self.pending.values())]
            # Published together: one round trip for all, not one each (hundreds per step at scale).
            async with anyio.create_task_group() as tg:
                for held, reason, detail in unfit:
                    if reason != "ok":
                        log.info(
                            "group not trainable", task_id=held.task_id, reason=reason, head=held.head_version
                        )
                        tg.start_soon(self.fail, held, reason, detail)
            ready = sorted(
                (h for h in self.pending.values() if self.verdict(h)[0] == "ok"),
                key=lambda h: (h.head_version, h.arrived),
            )
            if len(ready) >= batch_size:
                return ready[:batch_size]
            if self.ctx.ended.is_set():
                raise RunOver
            self.ctx.set_status("waiting", f"{len(ready)}/{batch_size} groups")
            self.arrived = anyio.Event()
            await self.arrived.wait()

    # ---- one step ------------------------------------------------------------------------------

    async def step(self) -> None:
        t_wait = time.monotonic()
        batch = await self.next_batch()
        wait_s = time.monotonic() - t_wait
        async with self.ctx.working(f"training step {self.version + 1}"):
            tokens = await self.train(batch, wait_s)
        self.ctx.progressed(tokens=tokens)

    async def train(self, batch: list[Held], wait_s: float) -> int:
        """One step on `batch`: update, hand the weights out, report, checkpoint when due; returns
        the trained tokens."""
        self.ctx.set_status("busy", f"step {self.version + 1}")
        samples = [to_sample(h.scored) for h in batch]
        t0 = time.monotonic()
        metrics = await anyio.to_thread.run_sync(self.learner.step, samples)
        compute_s = time.monotonic() - t0
        version = self.version
        t1 = time.monotonic()
        tensors = await anyio.to_thread.run_sync(
            functools.partial(self.learner.snapshot_weights, **self.snapshot_options)
        )
        if self.sender is not None:  # in memory: announce now, the disk copy follows
            tensors = await anyio.to_thread.run_sync(self.sender.prepare, version, tensors)
            await self.publish_weights(version, weights_dir(self.cfg, version), None, 0.0)
        save_s = time.monotonic() - t1
        # Writing and hashing the weights overlaps the next step; versions leave in order.
        await self.weights_out.send((version, tensors))
        for held in batch:
            self.pending.pop(held.task_id, None)
            self.uncommitted[held.task_id] = held
        heads = [h.head_version for h in batch]
        staleness = StalenessStats.of(trainer_version=version - 1, head_versions=heads)
        step_s = wait_s + compute_s + save_s
        metrics.update(
            wait_s=wait_s,
            compute_s=compute_s,
            save_s=save_s,
            weights_write_s=self.last_write_s,
            step_s=step_s,
            staleness_mean=staleness.mean,
            staleness_max=float(staleness.max),
            trained_tokens_per_s=metrics.get("loss_tokens", 0.0) / step_s if step_s > 0 else 0.0,
            bus_s=self.bus_seconds(),
        )
        event = TrainerStep(
            step=version,
            policy_version=version,
            task_ids=[h.task_id for h in batch],
            head_versions=heads,
            metrics={k: float(v) for k, v in metrics.items()},
        )
        await self.bus.publish(
            self.bus.subjects.trainer_step, event, msg_id=f"step-{version}-{time.time_ns()}"
        )
        self.record(version, event, batch)
        self.ctx.policy_version = version
        log.info(
            "step done",
            step=version,
            policy_version=version,
            reward_mean=round(metrics.get("reward_mean", 0.0), 4),
            loss=round(metrics.get("loss", 0.0), 5),
            staleness_max=metrics["staleness_max"],
            wait_s=round(wait_s, 2),
            compute_s=round(compute_s, 2),
            save_s=round(save_s, 2),
        )
        every = self.cfg.checkpoint.every_steps
        if version % every == 0 or version >= self.cfg.trainer.total_steps:
            await self.commit(version)
        return int(metrics.get("loss_tokens", 0.0))

    async def write_weights(self) -> None:
        """Background writer: each new version into the weights bucket (``bus``) and as an HF
        directory, then ``weights.published``."""
        async for version, tensors in self.weights_in:
            t0 = time.monotonic()
            path = weights_dir(self.cfg, version)
            await self.write_to_bus(version, tensors)
            manifest = await anyio.to_thread.run_sync(self._write, path, tensors)
            self.last_write_s = time.monotonic() - t0
            if self.sender is None:
                await self.publish_weights(version, path, manifest, self.last_write_s)

    async def write_to_bus(self, version: int, tensors: dict[str, Any]) -> None:
        """Store ``version`` in the run's weights bucket (``weight_sync.transport: bus``)."""
        if self.bus_writer is None:
            return
        written = await self.bus_writer.write(version, tensors)
        log.info("weights written to the bus", policy_version=version, **written)

    def _write(self, path: Path, tensors: Any) -> list[dict[str, Any]]:
        """Worker-thread body: hash and write one version on the cores for ``trainer.io``, if named."""
        with io_thread_affinity("trainer"):
            return self.learner.write_weights(path, tensors)

    def bus_seconds(self) -> float:
        """Seconds this process spent publishing and decoding events since the previous step."""
        total = float(self.bus.stats["publish_s"]) + float(self.bus.stats["decode_s"])
        delta, self._bus_total = total - self._bus_total, total
        return delta

    async def publish_weights(
        self, version: int, path: Any, manifest: list[dict[str, Any]] | None, seconds: float
    ) -> None:
        """Announce ``version``: written at ``path`` (its ``manifest``), or, with ``manifest`` None,
        prepared in memory (the offer; the disk copy is still being written)."""
        offer = self.sender.offer(version) if self.sender is not None else None
        if manifest is None and offer is not None:
            entries = [TensorEntry(name=n, shape=shape, dtype=d, sha256="") for n, shape, d in offer.manifest]
            total = sum(nbytes(shape, dtype) for _, shape, dtype in decode_manifest(offer.manifest))
        else:
            entries = [TensorEntry(**m) for m in manifest or []]
            total = _tensor_bytes(Path(path))
            offer = None
        await self.run_state.record_then_publish(
            WEIGHTS_PUBLISHED,
            {"policy_version": version, "path": str(path)},
            self.bus.subjects.weights_published,
            WeightsPublished(
                policy_version=version,
                path=str(path),
                manifest=entries,
                total_bytes=total,
                seconds=seconds,
                transfer=offer,
            ),
            policy_version=version,
        )

    def record(self, version: int, event: TrainerStep, batch: list[Held]) -> None:
        line = {"step": version, "policy_version": version, "time": time.time(), **event.metrics}
        append_jsonl(self.metrics_file, line)
        if self.trackers is None or not self.trackers.names:
            return
        every, samples = self.cfg.metrics.rollout_every, self.cfg.metrics.rollout_samples
        if samples and version % every == 0:
            rows = rollout_rows(version, [h.scored for h in batch], samples=samples)
            self.trackers.log_rollouts(version, ROLLOUT_COLUMNS, rows)
        self.trackers.log_step(version, event.metrics)  # queued: a slow tracker never holds the step

    async def log_evaluations(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The controller's evaluation rounds (``eval/*`` of ``metrics`` reports) to the trackers;
        started once subscribed."""
        if self.trackers is None or not self.trackers.names:
            task_status.started()
            return
        async with self.bus.subscribe(self.bus.subjects.metrics) as reports:
            task_status.started()
            async for report in reports:
                if not isinstance(report, MetricsReport):
                    continue
                values = {k: v for k, v in report.values.items() if k.startswith("eval/")}
                if values:
                    self.trackers.log_eval(report.policy_version, values)

    async def commit(self, version: int) -> None:
        """Checkpoint, then ack what it covers (never the other way round)."""
        self.ctx.set_status("busy", f"checkpoint {version}")
        trained = self.trained_ids | set(self.uncommitted)
        t0 = time.monotonic()
        extra = {"trained_task_ids": sorted(trained), "policy_version": version}
        await anyio.to_thread.run_sync(
            self.learner.checkpoint, self.cfg.run_dir, extra, self.cfg.checkpoint.keep
        )
        self.trained_ids = trained
        for held in self.uncommitted.values():
            await held.delivery.ack()
        self.uncommitted.clear()
        log.info(
            "checkpoint committed",
            step=version,
            seconds=round(time.monotonic() - t0, 2),
            trained=len(trained),
        )


def _tensor_bytes(path: Path) -> int:
    """Bytes of a version directory's safetensors files (a model's or an adapter's)."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _restore(cfg: RunConfig, learner: Any) -> set[str]:
    mode = cfg.checkpoint.resume
    if mode == "never":
        return set()
    extra = learner.restore(cfg.run_dir)
    if extra is None:
        if mode == "must":
            raise FileNotFoundError(
                f"checkpoint.resume=must but {cfg.run_dir / 'checkpoints'} holds no checkpoint"
            )
        return set()
    log.info(
        "resumed from checkpoint", policy_version=learner.version, trained=len(extra["trained_task_ids"])
    )
    return set(extra["trained_task_ids"])


def trainer_trackers(cfg: RunConfig) -> Trackers:
    """The run's experiment trackers (``metrics.loggers``), opened or resumed in the run dir."""
    return open_trackers(cfg.metrics, root=cfg.run_dir, name=cfg.name, config=config_to_dict(cfg))


def make_learner(cfg: RunConfig) -> Any:
    """The learner of rank 0: ``Learner`` over the run's training engine, or the simulated one."""
    if cfg.trainer.backend == "simulated":
        from areal_async.training.simulated import SimulatedLearner

        return SimulatedLearner(cfg)
    from areal_async.training.learner import Learner

    return Learner(cfg, resolve_model_path(cfg.model.path))


async def serve(ctx: WorkerContext) -> None:
    cfg = ctx.cfg
    # Before the model loads: a tracker that cannot open (a missing package, a wrong URI) fails now.
    trackers = await anyio.to_thread.run_sync(trainer_trackers, cfg)
    try:
        await _serve(ctx, trackers)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(trackers.close)


async def _serve(ctx: WorkerContext, trackers: Trackers) -> None:
    cfg = ctx.cfg
    if cfg.trainer.backend != "simulated":
        from areal_async.training.learner import init_trainer_process_group

        init_trainer_process_group(cfg.trainer.device)
    learner = await anyio.to_thread.run_sync(make_learner, cfg)
    trained_ids = await anyio.to_thread.run_sync(_restore, cfg, learner)
    trainer = Trainer(ctx, learner, trained_ids=trained_ids, trackers=trackers)
    ctx.policy_version = learner.version
    try:
        published = await trainer.run_state.weights(WEIGHTS_PUBLISHED)
        behind = published is not None and published.policy_version != learner.version
    except StateRecordError as exc:
        log.error("weights.published record unusable; publishing ours", error=str(exc))
        behind = True
    if behind:
        # Restarted behind what engines serve (the lost future): bring them back to our version.
        path = weights_dir(cfg, learner.version)
        if trainer.bus_writer is not None:
            snapshot = functools.partial(learner.snapshot_weights, **trainer.snapshot_options)
            await trainer.write_to_bus(learner.version, await anyio.to_thread.run_sync(snapshot))
        manifest = await anyio.to_thread.run_sync(learner.save_weights, path)
        await trainer.publish_weights(learner.version, path, manifest, 0.0)
    # The one reader of the SCORED consumer: what an earlier trainer process held comes back now.
    await ctx.bus.reclaim(Streams.SCORED)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer.receive)
            tg.start_soon(trainer.keep_alive)
            tg.start_soon(trainer.write_weights)
            await tg.start(trainer.log_evaluations)
            if trainer.sender is not None:
                tg.start_soon(trainer.sender.serve, trainer.bus)
            tg.start_soon(_wake_on_end, ctx, trainer)
            ctx.set_status("ready")
            try:
                while trainer.version < cfg.trainer.total_steps:
                    await trainer.step()
            except RunOver:
                if trainer.uncommitted:
                    await trainer.commit(trainer.version)
            ctx.set_status("done", f"policy version {trainer.version}")
            log.info("training finished", policy_version=trainer.version)
            await ctx.ended.wait()
            if trackers.names:  # the final evaluation's report, queued before run.ended
                await anyio.sleep(EVAL_GRACE_S)
            tg.cancel_scope.cancel()
    finally:
        await anyio.to_thread.run_sync(learner.stop)


async def _wake_on_end(ctx: WorkerContext, trainer: Trainer) -> None:
    await ctx.ended.wait()
    trainer.arrived.set()


def follow(cfg: RunConfig) -> int:
    """Ranks > 0 of a torchrun trainer: compute what rank 0 broadcasts."""
    from areal_async.training.learner import Learner, init_trainer_process_group

    init_trainer_process_group(cfg.trainer.device)
    learner = Learner(cfg, resolve_model_path(cfg.model.path))
    _restore(cfg, learner)
    learner.follow()
    return 0


def is_follower() -> bool:
    return int(os.environ.get("RANK", "0")) != 0
