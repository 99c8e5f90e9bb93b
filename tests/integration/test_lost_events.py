"""Core NATS events lost in a disconnect: each worker that acts on one re-reads its state key.

``weights.served``, ``weights.published`` and ``run.ended`` go out at most once (core NATS). A
worker disconnected when one is published (a NATS node dies, its clients move to another) never
gets it, so each reader also re-reads the writer's state key every heartbeat interval; without
that, a lost ``weights.served`` would leave the controller's admission closed for good. Here the
state keys are written with no event at all, as if every event had been lost, against a real
nats-server.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import msgpack
import pytest

from areal_async.run_file import build_config
from bus import Bus
from bus.events import WeightsLoad
from bus.state import RUN_ENDED, WEIGHTS_PUBLISHED, WEIGHTS_SERVED, pack, unpack
from workers.common import weights_dir
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


async def _settle(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``condition`` (worker state: no event to wait on) until it holds or ``timeout_s`` passes.

    It does not raise: the caller asserts the state it expected, so a miss names what was missing.
    """
    with anyio.move_on_after(timeout_s):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.05)


@pytest.mark.asyncio
async def test_served_and_published_versions_are_taken_from_the_state_bucket(
    bus: Bus, run_name: str, tmp_path: Path
) -> None:
    """The controller's served version and weight-sync's target follow the state keys alone, also
    back to an older version (a trainer restored from an older checkpoint)."""
    controller = Controller(_context(bus, run_name, tmp_path, "controller"))
    sync = WeightSync(_context(bus, run_name, tmp_path, "weight-sync"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(controller.on_served)
        tg.start_soon(sync.watch_published)
        await anyio.sleep(0.5)  # both past their first read (no keys yet): the keys come by re-reads
        assert (controller.state.served_version, sync.target) == (0, None)
        await bus.kv_put("state", WEIGHTS_SERVED, pack(policy_version=3, path="/w/v3"))
        await bus.kv_put("state", WEIGHTS_PUBLISHED, pack(policy_version=4, path="/w/v4"))
        await _settle(lambda: controller.state.served_version == 3 and sync.target == (4, "/w/v4"))
        assert controller.state.served_version == 3, (
            f"controller did not take served version 3 from the state key {WEIGHTS_SERVED!r}; "
            f"it has {controller.state.served_version}"
        )
        assert sync.target == (4, "/w/v4"), (
            f"weight-sync did not take published version 4 from the state key {WEIGHTS_PUBLISHED!r}; "
            f"its target is {sync.target}"
        )
        await bus.kv_put("state", WEIGHTS_PUBLISHED, pack(policy_version=2, path="/w/v2"))
        await _settle(lambda: sync.target == (2, "/w/v2"))
        assert sync.target == (2, "/w/v2"), (
            f"weight-sync did not follow back to version 2; target {sync.target}"
        )
        tg.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_a_worker_stops_when_run_ended_is_only_in_the_state_bucket(
    bus: Bus, run_name: str, tmp_path: Path
) -> None:
    """A reward worker whose run.ended event was lost reads the state key, sets ``ended`` and stops."""
    ctx = _context(bus, run_name, tmp_path, "reward")
    with anyio.move_on_after(10), anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_run_end, ctx, scope)
            await anyio.sleep(0.5)
            assert not ctx.ended.is_set(), "ended before any run.ended was written"
            await bus.kv_put("state", RUN_ENDED, msgpack.packb({"reason": "test", "policy_version": 1}))
            await ctx.ended.wait()
    assert ctx.ended.is_set(), f"the worker did not read the state key {RUN_ENDED!r} within 10 s"
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
        await _settle(lambda: len(told) >= 2, timeout_s=10)
        assert len(told) >= 2, (
            f"weights.load went out {len(told)} time(s) in 10 s; a lagging engine is told again"
        )
        assert told[1] - told[0] >= ctx.cfg.bus.heartbeat_ttl_s - 0.1
        engine.version = 1
        await _settle(lambda: sync.served == 1)
        assert sync.served == 1, (
            f"weight-sync did not mark version 1 served once the engine had it: {sync.served}"
        )
        tg.cancel_scope.cancel()
    served = unpack(await bus.kv_get("state", WEIGHTS_SERVED))
    assert served == {"policy_version": 1, "path": path}


@pytest.mark.asyncio
async def test_latest_keeps_following_a_key_across_a_server_restart(tmp_path: Path) -> None:
    """``RunState.latest`` is the reader of shared run state: it rides out the server dying under it
    (the client reconnects to the restarted server, same port and store) and yields the next record."""
    from bus import ConnectOptions, EmbeddedServer, connect
    from bus.state import RunState

    server = EmbeddedServer(tmp_path / "nats").start()
    try:
        bus = await connect(
            ConnectOptions(url=server.url, name="reader", reconnect_wait_max_s=0.5), "restart"
        )
        await bus.provision()
        state = RunState(bus)
        seen: list[int] = []

        async def follow() -> None:
            async for record in state.latest(WEIGHTS_SERVED, 0.1):
                if record is not None:
                    seen.append(int(record["policy_version"]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(follow)
            await state.record(WEIGHTS_SERVED, policy_version=1, path="/w/v1")
            await _settle(lambda: seen == [1])
            os.kill(server.pid, signal.SIGKILL)
            await anyio.sleep(0.5)
            await anyio.to_thread.run_sync(server.restart)
            with anyio.fail_after(20):
                while True:
                    try:
                        await state.record(WEIGHTS_SERVED, policy_version=2, path="/w/v2")
                        break
                    except Exception:  # still reconnecting
                        await anyio.sleep(0.2)
            await _settle(lambda: seen[-1:] == [2], timeout_s=10)
            tg.cancel_scope.cancel()
        await bus.close()
    finally:
        server.stop()
    assert seen == [1, 2], f"latest() yielded {seen}; expected version 1, then 2 after the restart"
