"""Core NATS events lost in a disconnect: each worker that acts on one re-reads its state key.

``weights.served``, ``weights.published`` and ``run.ended`` go out at most once (core NATS). A
worker disconnected when one is published (a NATS node dies, its clients move to another) never
gets it; before the state keys were re-read, a lost ``weights.served`` left the controller's
admission closed for good and the run stalled. Here the writers' state keys are written with no
event at all, as if every event had been lost, against a real nats-server.
"""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import msgpack
import pytest

from areal_async.config import build_config
from bus import Bus
from bus.events import WeightsLoad
from workers.common import (
    RUN_ENDED_KEY,
    WEIGHTS_PUBLISHED_KEY,
    WEIGHTS_SERVED_KEY,
    pack_record,
    unpack_record,
    weights_dir,
)
from workers.controller import Controller
from workers.runtime import WorkerContext, _watch_run_end
from workers.weight_sync import EngineState, WeightSync


def _context(bus: Bus, run_name: str, tmp_path: Path, role: str) -> WorkerContext:
    cfg = build_config(
        {
            "name": run_name,
            "dir": str(tmp_path / run_name),
            "model": {"path": str(tmp_path / "model")},
            "dataset": {"kind": "mode_select", "eval_size": 0},
            "bus": {"heartbeat_interval_s": 0.2, "heartbeat_ttl_s": 2.0},
        }
    )
    return WorkerContext(cfg=cfg, role=role, worker_id=f"{role}-1", bus=bus)


@pytest.mark.asyncio
async def test_served_and_published_versions_are_taken_from_the_state_bucket(
    bus: Bus, run_name: str, tmp_path: Path
) -> None:
    controller = Controller(_context(bus, run_name, tmp_path, "controller"))
    sync = WeightSync(_context(bus, run_name, tmp_path, "weight-sync"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(controller.on_served)
        tg.start_soon(sync.watch_published)
        with anyio.fail_after(5):
            while controller.state.served_version != 0:  # noqa: ASYNC110 (state, no event)
                await anyio.sleep(0.05)
        await bus.kv_put("state", WEIGHTS_SERVED_KEY, pack_record(policy_version=3, path="/w/v3"))
        await bus.kv_put("state", WEIGHTS_PUBLISHED_KEY, pack_record(policy_version=4, path="/w/v4"))
        with anyio.fail_after(5):
            while controller.state.served_version != 3 or sync.target != (4, "/w/v4"):  # noqa: ASYNC110
                await anyio.sleep(0.05)
        # a trainer restored from an older checkpoint publishes an older version: followed too
        await bus.kv_put("state", WEIGHTS_PUBLISHED_KEY, pack_record(policy_version=2, path="/w/v2"))
        with anyio.fail_after(5):
            while sync.target != (2, "/w/v2"):  # noqa: ASYNC110
                await anyio.sleep(0.05)
        tg.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_a_worker_stops_when_run_ended_is_only_in_the_state_bucket(
    bus: Bus, run_name: str, tmp_path: Path
) -> None:
    ctx = _context(bus, run_name, tmp_path, "reward")
    with anyio.fail_after(10), anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_run_end, ctx, scope)
            await anyio.sleep(0.5)
            assert not ctx.ended.is_set()
            await bus.kv_put("state", RUN_ENDED_KEY, msgpack.packb({"reason": "test", "policy_version": 1}))
            await ctx.ended.wait()
    assert scope.cancel_called, "a role that finishes nothing is stopped"


@pytest.mark.asyncio
async def test_an_engine_that_missed_weights_load_is_told_again(
    bus: Bus, run_name: str, tmp_path: Path
) -> None:
    """weights.load is core NATS too: an engine still lagging a heartbeat TTL later is told again,
    and once it reports the version the weights are marked served (state key and event)."""
    ctx = _context(bus, run_name, tmp_path, "weight-sync")
    sync = WeightSync(ctx)
    engine = EngineState(version=0, seen_at=time.monotonic())
    sync.engines["generation-1"] = engine
    path = str(weights_dir(ctx.cfg, 1))
    sync.target = (1, path)
    told: list[float] = []
    async with anyio.create_task_group() as tg, bus.subscribe(bus.subjects.weights_load) as loads:

        async def listen() -> None:
            async for ev in loads:
                assert isinstance(ev, WeightsLoad) and ev.engine_ids == ["generation-1"]
                told.append(time.monotonic())

        async def alive() -> None:  # the engine's heartbeats, without ever loading
            while True:
                engine.seen_at = time.monotonic()
                await anyio.sleep(0.1)

        tg.start_soon(listen)
        tg.start_soon(alive)
        tg.start_soon(sync.sync, 1, path)
        with anyio.fail_after(10):
            while len(told) < 2:  # noqa: ASYNC110 (a counter, no event)
                await anyio.sleep(0.05)
        assert told[1] - told[0] >= ctx.cfg.bus.heartbeat_ttl_s - 0.1
        engine.version = 1
        with anyio.fail_after(5):
            while sync.served != 1:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    served = unpack_record(await bus.kv_get("state", WEIGHTS_SERVED_KEY))
    assert served == {"policy_version": 1, "path": path}
