"""Feeding a ``RunView`` from the bus: what is stored first, then what happens.

Read only. Nothing is published, acked or written: stored messages are read by direct get, the two
kept streams (STEPS, DEADLETTER) through an ordered consumer (ephemeral, server-side, deleted when
the dashboard leaves; limits streams admit it beside the controller's durable, and it never takes a
message from anyone), core subjects by plain subscriptions, and a payload that does not decode is
skipped (a worker's subscription would dead-letter it; the dashboard must not publish).

| page | stored (a finished run too) | live |
|---|---|---|
| Fleet | workers bucket (the newest heartbeat per live worker), `stalls.jsonl` | `heartbeat.>`, `run.stalled`, `run.healed` |
| Steps | STEPS (every step, its metrics and stored time); the controller's state key (held-out accuracy per version); the history of `weights.published` / `weights.served` (the last 16 hand-offs) | STEPS, `metrics`, `weights.published`, `weights.served` |
| Rollouts | groups still stored in SCORED and EVAL (the trainer's uncommitted ones) | `rollout.scored`, `eval.scored` |
| Dead letters | DEADLETTER, FAILED | DEADLETTER, `rollout.failed`, `run.stalled` |

Subscribing to ``rollout.scored`` makes the server send every scored group once more (to the
dashboard): that, and a heartbeat per worker per interval, is the dashboard's cost on the bus
(docs/benchmarks-log.md).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import structlog
from nats.js.api import DeliverPolicy

from bus.events import (
    DeadLetter,
    DecodeError,
    Heartbeat,
    MetricsReport,
    RolloutFailed,
    RunEnded,
    RunHealed,
    RunStalled,
    ScoredGroup,
    TrainerStep,
    WeightsPublished,
    WeightsServed,
    decode,
)
from bus.state import CONTROLLER, RUN_ENDED, WEIGHTS_PUBLISHED, WEIGHTS_SERVED, StateRecordError, unpack
from bus.subjects import Buckets, Streams
from workers.dashboard.view import ROLLOUTS_KEPT, RunView

log = structlog.get_logger()

STORED_ROLLOUTS = 50
"""Stored groups read at start from each of SCORED and EVAL (the newest)."""


def _decoded(data: bytes, expected: type[Any]) -> Any | None:
    try:
        return decode(data, expected)
    except DecodeError:
        return None


async def _stored(bus: Any, key: str, count: int) -> list[tuple[int, bytes, float]]:
    """(seq, data, stored time) of up to ``count`` of the newest messages of a stream, oldest first
    (among the last ``4 * count`` sequence numbers: a work queue's acked messages leave gaps)."""
    spec = bus.subjects.stream(key)
    try:
        info = await bus.js.stream_info(spec.name)
    except Exception:  # not provisioned (the run never started that far)
        return []
    if not info.state.messages:
        return []
    out = []
    seq = info.state.last_seq
    lowest = max(info.state.first_seq, 1, seq - 4 * count)  # acked gaps: look no further back
    while seq >= lowest and len(out) < count:
        try:
            raw = await bus.js.get_msg(spec.name, seq)
        except Exception:  # acked (work queue) or removed by limits
            seq -= 1
            continue
        out.append((seq, raw.data or b"", raw.time.timestamp() if raw.time else time.time()))
        seq -= 1
    return out[::-1]


async def _history(bus: Any, key: str) -> list[tuple[dict[str, Any], float]]:
    """Every kept revision of a state key: (record, time written)."""
    try:
        kv = await bus.bucket(Buckets.STATE)
        entries = await kv.history(key)
    except Exception:  # no such key yet
        return []
    out = []
    for e in entries:
        try:
            record = unpack(e.value) if e.value else None
        except StateRecordError:
            continue
        if record is not None and e.created is not None:
            out.append((record, e.created.timestamp()))
    return out


async def load_stored(bus: Any, view: RunView, run_dir: Path | None) -> None:
    """Everything the run has stored, into ``view`` (the start of a page, and all of a finished run)."""
    for key in await bus.kv_keys(Buckets.WORKERS):
        entry = await bus.kv_get(Buckets.WORKERS, key)
        beat = _decoded(entry.value, Heartbeat) if entry is not None else None
        if beat is not None:
            view.heartbeat(beat, heard_at=beat.sent_at)
    try:
        controller = unpack(await bus.kv_get(Buckets.STATE, CONTROLLER))
    except StateRecordError:
        controller = None
    if controller:
        results = controller.get("eval_results", {})
        for version in controller.get("eval_done", []):
            res = results.get(str(version), {})
            if res.get("count"):
                view.evaluation(int(version), float(res["correct"]) / float(res["count"]))
    for record, at in await _history(bus, WEIGHTS_PUBLISHED):
        view.published(int(record.get("policy_version", -1)), at)
    for record, at in await _history(bus, WEIGHTS_SERVED):
        view.served(int(record.get("policy_version", -1)), at)
    ended = await _history(bus, RUN_ENDED)
    if ended:
        record = ended[-1][0]
        view.run_ended(str(record.get("reason", "")), int(record.get("policy_version", -1)))
    if run_dir is not None:
        from workers.report import read_jsonl

        for record in read_jsonl(run_dir / "stalls.jsonl"):
            view.stall(record)
    for key in (Streams.SCORED, Streams.EVAL):
        for _, data, at in await _stored(bus, key, STORED_ROLLOUTS):
            if (group := _decoded(data, ScoredGroup)) is not None:
                view.scored(group, at)
    for _, data, at in await _stored(bus, Streams.FAILED, ROLLOUTS_KEPT):
        if (failed := _decoded(data, RolloutFailed)) is not None:
            view.refused(failed, at)


async def follow(bus: Any, view: RunView, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
    """Keep ``view`` current: STEPS and DEADLETTER from their first message on, core events as
    they come. Started once the stored state is loaded; runs until cancelled."""
    nc, subjects = bus.nc, bus.subjects

    def on(expected: type[Any], handle: Callable[[Any, Any], None]) -> Callable[[Any], Awaitable[None]]:
        async def cb(msg: Any) -> None:
            event = _decoded(msg.data, expected)
            if event is not None:
                handle(event, msg)

        return cb

    def stored_at(msg: Any) -> float:
        try:
            return msg.metadata.timestamp.timestamp()
        except Exception:  # not a JetStream delivery
            return time.time()

    def on_metrics(ev: MetricsReport, _msg: Any) -> None:
        if "eval/accuracy" in ev.values:
            view.evaluation(ev.policy_version, ev.values["eval/accuracy"])

    def on_stall(ev: Any, _msg: Any) -> None:
        view.stall(ev)

    core = [
        (subjects.heartbeat_all, Heartbeat, lambda ev, _m: view.heartbeat(ev)),
        (subjects.rollout_scored, ScoredGroup, lambda ev, _m: view.scored(ev, time.time())),
        (subjects.eval_scored, ScoredGroup, lambda ev, _m: view.scored(ev, time.time())),
        (subjects.rollout_failed, RolloutFailed, lambda ev, _m: view.refused(ev, time.time())),
        (subjects.metrics, MetricsReport, on_metrics),
        (
            subjects.weights_published,
            WeightsPublished,
            lambda ev, _m: view.published(ev.policy_version, time.time()),
        ),
        (subjects.weights_served, WeightsServed, lambda ev, _m: view.served(ev.policy_version, time.time())),
        (subjects.run_ended, RunEnded, lambda ev, _m: view.run_ended(ev.reason, ev.policy_version)),
        (subjects.run_stalled, RunStalled, on_stall),
        (subjects.run_healed, RunHealed, on_stall),
    ]
    subs = [await nc.subscribe(subject, cb=on(tp, handle)) for subject, tp, handle in core]
    subs.append(
        await bus.js.subscribe(
            subjects.trainer_step,
            cb=on(TrainerStep, lambda ev, m: view.step(ev, stored_at(m))),
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )
    )
    subs.append(
        await bus.js.subscribe(
            subjects.deadletter,
            cb=on(DeadLetter, lambda ev, m: view.dead_letter(ev, m.metadata.sequence.stream)),
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )
    )
    task_status.started()
    try:
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            for sub in subs:
                try:
                    await sub.unsubscribe()
                except Exception:  # the connection is closing anyway
                    pass
