"""Reward worker: turns generated rollout groups into scored groups.

Data flow: generation --rollout.generated--> reward --rollout.scored--> trainer
(eval tasks go to --eval.scored--> controller instead).

Replicas share the ``reward`` durable pull consumer, so N workers split the load.
Reward functions run in a process pool with a per-call timeout (``reward.timeout_s``).

Guarantees: exactly one ScoredGroup per RolloutGroup attempt, also when scoring raises
or hangs (reward 0, error recorded); it is published (``Nats-Msg-Id = task_id:attempt``)
before the input is acked. No state survives a restart.

Run alone: areal-worker --role reward --config configs/arith_cpu.yaml
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import structlog

from areal_async.rewards import RewardPool
from bus.events import RolloutGroup, ScoredGroup
from workers.runtime import WorkerContext

log = structlog.get_logger()


async def score_group(pool: RewardPool, group: RolloutGroup) -> ScoredGroup:
    started = time.monotonic()
    outcomes = await pool.score([c.text for c in group.completions], dict(group.row))
    return ScoredGroup(
        group=group,
        rewards=[float(o.reward) for o in outcomes],
        reward_errors=[o.error or "" for o in outcomes],
        reward_seconds=time.monotonic() - started,
    )


async def serve(ctx: WorkerContext) -> None:
    cfg = ctx.cfg
    bus = ctx.bus
    scored = 0
    async with RewardPool(
        cfg.reward.fn, num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s
    ) as pool:
        limiter = anyio.CapacityLimiter(max(2, 2 * cfg.reward.num_workers))

        async def handle(delivery: Any) -> None:
            nonlocal scored
            try:
                group = delivery.event
                assert isinstance(group, RolloutGroup)
                result = await score_group(pool, group)
                subject = bus.subjects.eval_scored if group.kind == "eval" else bus.subjects.rollout_scored
                await bus.publish(
                    subject,
                    result,
                    msg_id=f"{group.task_id}:{group.attempt}",
                    policy_version=group.head_version,
                )
                await delivery.ack()
                scored += 1
                errors = sum(1 for e in result.reward_errors if e)
                if errors:
                    log.warning(
                        "reward errors", task_id=group.task_id, errors=errors, first=result.reward_errors[0]
                    )
                ctx.load = {"groups_scored": float(scored)}
            finally:
                limiter.release_on_behalf_of(delivery)

        ctx.set_status("ready")
        async with anyio.create_task_group() as tg:
            async for delivery in bus.consume("GENERATED", batch=1):
                await limiter.acquire_on_behalf_of(delivery)
                tg.start_soon(handle, delivery)
