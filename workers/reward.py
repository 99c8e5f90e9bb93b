"""Reward worker: turns generated rollout groups into scored groups.

Data flow: generation --rollout.generated--> reward --rollout.scored--> trainer
(eval tasks go to --eval.scored--> controller instead).

Replicas share the ``reward`` durable pull consumer, so N workers split the load.
Reward functions run in a process pool with a per-call timeout (``reward.timeout_s``).

Guarantees: exactly one ScoredGroup per RolloutGroup attempt, also when scoring raises,
hangs or returns a non-finite number (reward 0, error recorded); it is published (``Nats-Msg-Id = task_id:attempt``)
before the input is acked. No state survives a restart.

Run alone: areal-worker --role reward --config configs/arith_cpu.yaml
"""

from __future__ import annotations

import math
import time
from typing import Any

import anyio
import structlog

from areal_async.rewards import RewardPool
from bus.events import RolloutGroup, ScoredGroup
from bus.subjects import Streams
from workers.common import settle_or_dead_letter
from workers.runtime import WorkerContext

log = structlog.get_logger()


async def score_group(pool: RewardPool, group: RolloutGroup) -> ScoredGroup:
    started = time.monotonic()
    outcomes = await pool.score([c.text for c in group.completions], dict(group.row))
    rewards, errors = [], []
    for o in outcomes:
        finite = math.isfinite(o.reward)
        rewards.append(float(o.reward) if finite else 0.0)
        errors.append((o.error or "") if finite else f"reward function returned {o.reward}; scored 0")
    return ScoredGroup(
        group=group, rewards=rewards, reward_errors=errors, reward_seconds=time.monotonic() - started
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
            try:
                await settle_or_dead_letter(delivery, lambda group: score(group, delivery), what="scoring")
            finally:
                limiter.release_on_behalf_of(delivery)

        async def score(group: Any, delivery: Any) -> None:
            nonlocal scored
            if not isinstance(group, RolloutGroup):
                raise ValueError(f"expected a RolloutGroup, got {type(group).__name__}")
            async with ctx.working("scoring"):
                result = await score_group(pool, group)
                subject = bus.subjects.eval_scored if group.kind == "eval" else bus.subjects.rollout_scored
                await bus.publish(
                    subject,
                    result,
                    msg_id=f"{group.task_id}:{group.attempt}",
                    policy_version=group.head_version,
                )
                await delivery.ack()
            ctx.progressed()
            scored += 1
            errors = sum(1 for e in result.reward_errors if e)
            if errors:
                log.warning(
                    "reward errors", task_id=group.task_id, errors=errors, first=result.reward_errors[0]
                )
            ctx.load = {"groups_scored": float(scored)}

        ctx.set_status("ready")
        async with anyio.create_task_group() as tg:
            async for delivery in bus.consume(Streams.GENERATED, batch=1):
                await limiter.acquire_on_behalf_of(delivery)
                tg.start_soon(handle, delivery)
