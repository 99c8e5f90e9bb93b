"""Weight-sync worker: moves each new policy version from the trainer to every engine.

Data flow: trainer --weights.published--> weight-sync --weights.load--> generation
--weights.loaded--> weight-sync --weights.served (+ KV)--> controller.

Protocol (docs/design.md section 7): on a newer published version, tell every live engine that
serves an older one to load it, wait until each live engine reports it (an engine whose
heartbeat expires is dropped from the wait; one that joins later is told too), then
publish ``weights.served`` and record it in the KV key the controller and joining
engines read. Versions published while a sync is running are coalesced: the newest wins.
Weight directories older than every served version (keeping ``weight_sync.keep_versions``
recent ones) are deleted.

Phase timings (``load_<engine>_s``, ``wait_s``, ``total_s``) travel on ``weights.served``.

Run alone: areal-worker --role weight-sync --config configs/arith_cpu.yaml
"""

from __future__ import annotations

import hashlib
import shutil
import time
from dataclasses import dataclass

import anyio
import structlog

from bus.events import Heartbeat, TransferOffer, WeightsLoad, WeightsLoaded, WeightsPublished, WeightsServed
from bus.state import WEIGHTS_PUBLISHED, WEIGHTS_SERVED, RunState, StateRecordError, WeightsVersion
from workers.common import checked_weights_path, weights_root
from workers.runtime import WorkerContext

log = structlog.get_logger()


@dataclass
class EngineState:
    version: int
    seen_at: float
    load_s: float = 0.0
    transports: tuple[str, ...] = ()
    ranks: int = 1
    via: str = ""


class WeightSync:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.bus = ctx.bus
        self.run_state = RunState(ctx.bus)
        self.engines: dict[str, EngineState] = {}
        self.target: tuple[int, str] | None = None
        self.served = -1
        self.changed = anyio.Event()
        self.offer: tuple[int, TransferOffer] | None = None
        self.epoch = 0  # a new group after a failed transfer
        self.fallbacks = 0

    def poke(self) -> None:
        self.changed.set()

    def live_engines(self) -> dict[str, EngineState]:
        ttl = self.cfg.bus.heartbeat_ttl_s
        now = time.monotonic()
        return {k: e for k, e in self.engines.items() if now - e.seen_at <= ttl}

    def heard_lately(self, engine_id: str) -> bool:
        """Heard from within two heartbeat intervals: fit to join an in-memory group. An engine
        killed without a word stays live until its TTL ends; in a group it would hold every
        member for ``transfer_timeout_s`` and fail the transfer."""
        state = self.engines.get(engine_id)
        window = 2 * self.cfg.bus.heartbeat_interval_s
        return state is not None and time.monotonic() - state.seen_at <= window

    async def watch_published(self) -> None:
        try:
            served = await self.run_state.weights(WEIGHTS_SERVED)
        except StateRecordError as exc:
            log.error("weights.served record unusable; re-serving the published version", error=str(exc))
            served = None
        if served:
            self.served = served.policy_version
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._published_from_state)
            async for ev in self.bus.subscribe(self.bus.subjects.weights_published):
                if isinstance(ev, WeightsPublished):
                    if ev.transfer is not None:
                        self.offer = (ev.policy_version, ev.transfer)
                    self._publish_seen(ev.policy_version, ev.path)
            tg.cancel_scope.cancel()

    async def _published_from_state(self) -> None:
        """A ``weights.published`` lost in a disconnect would leave the engines on old weights and
        the run waiting: the state key (written before the event) is re-read every heartbeat interval."""
        async for raw in self.run_state.latest(WEIGHTS_PUBLISHED, self.cfg.bus.heartbeat_interval_s):
            try:
                record = None if raw is None else WeightsVersion.parse(raw)
            except StateRecordError as exc:
                log.error("weights.published record unusable; ignored", error=str(exc))
                continue
            if record is not None:
                self._publish_seen(record.policy_version, record.path)

    def _publish_seen(self, version: int, path: str) -> None:
        # A trainer restored from an older checkpoint publishes an older version: follow it.
        if version < 0:
            log.error("ignoring weights.published with a negative version", policy_version=version)
            return
        if self.target is None or version != self.target[0]:
            self.target = (version, path)
            log.info("weights published", policy_version=version, path=path)
            self.poke()

    async def watch_heartbeats(self) -> None:
        async for ev in self.bus.subscribe(self.bus.subjects.heartbeat_all):
            if not isinstance(ev, Heartbeat) or ev.role != "generation":
                continue
            if ev.status == "stopped":
                self.engines.pop(ev.worker_id, None)
            else:
                state = self.engines.setdefault(ev.worker_id, EngineState(ev.policy_version, 0.0))
                state.seen_at = time.monotonic()
                state.version = ev.policy_version
                state.transports = tuple(ev.transports)
                state.ranks = max(1, ev.transfer_ranks)
            self.poke()

    async def watch_loaded(self) -> None:
        async for ev in self.bus.subscribe(self.bus.subjects.weights_loaded):
            if not isinstance(ev, WeightsLoaded):
                continue
            state = self.engines.get(ev.engine_id)
            if state is None:  # engines announce themselves by heartbeat first
                log.warning(
                    "weights.loaded from an engine without a heartbeat; ignored", engine_id=ev.engine_id
                )
                continue
            state.seen_at = time.monotonic()
            if ev.fallback:  # the group is not trusted again: the next transfer forms a new one
                self.epoch += 1
                self.fallbacks += 1
                log.warning("engine fell back to the disk copy", engine_id=ev.engine_id, reason=ev.fallback)
            if ev.ok:
                state.version = ev.policy_version
                state.load_s = ev.seconds
                state.via = ev.via
            else:
                log.error("engine failed to load weights", engine_id=ev.engine_id, error=ev.error)
            self.poke()

    async def sync_loop(self) -> None:
        while True:
            await self.changed.wait()
            self.changed = anyio.Event()
            if self.target is None:
                continue
            version, path = self.target
            live = self.live_engines()
            if not live:
                self.ctx.set_status("waiting", "no live generation workers")
                continue
            lagging = [k for k, e in live.items() if e.version != version]
            if lagging:
                async with self.ctx.working(f"handing out v{version}"):
                    await self.sync(version, path)
                self.ctx.progressed()
            elif self.served != version:
                await self.mark_served(version, path, {"total_s": 0.0})
                self.ctx.progressed()

    async def sync(self, version: int, path: str) -> None:
        try:
            checked_weights_path(self.cfg, path)
        except Exception as exc:
            log.error("refusing weights outside the run dir", path=path, error=str(exc))
            self.target = None
            return
        self.ctx.set_status("busy", f"syncing v{version}")
        started = time.monotonic()
        # An engine still lagging a heartbeat TTL after it was told is told again: a weights.load
        # published while it was disconnected never reached it (core NATS).
        retell_s = self.cfg.bus.heartbeat_ttl_s
        told: dict[str, float] = {}
        members: list[str] = []
        with anyio.move_on_after(self.cfg.weight_sync.timeout_s) as scope:
            while self.target == (version, path):
                live = self.live_engines()
                lagging = sorted(k for k, e in live.items() if e.version != version)
                now = time.monotonic()
                tell = [k for k in lagging if now - told.get(k, -retell_s) >= retell_s]
                if tell:
                    # The first word of a version goes in memory where it can; a retelling reads disk.
                    load = self.load_event(version, path, tell, in_memory=not told)
                    members = members or list(load.members)
                    await self.bus.publish(self.bus.subjects.weights_load, load, policy_version=version)
                    told.update(dict.fromkeys(tell, now))
                if live and not lagging:
                    break
                await anyio.sleep(0.05)
        live = self.live_engines()
        if any(k not in live for k in members):  # a member died: the next transfer forms a new group
            self.epoch += 1
        if self.target != (version, path):
            return  # superseded by a newer version; the loop picks it up
        if scope.cancelled_caught:
            log.warning("weight sync timed out; serving with the engines that loaded", policy_version=version)
        timings = {f"load_{k}_s": e.load_s for k, e in live.items() if e.version == version}
        timings["total_s"] = time.monotonic() - started
        timings["fallbacks"] = float(self.fallbacks)
        await self.mark_served(version, path, timings)

    def load_event(self, version: int, path: str, tell: list[str], *, in_memory: bool) -> WeightsLoad:
        """``weights.load`` for the engines in ``tell``; those that take the version's in-memory
        offer and were heard from lately become the members of the transfer (a group named for its
        members, its sender and the epoch, so consecutive versions reuse it while nothing changes);
        the others load the disk copy."""
        offer = self.offer[1] if self.offer is not None and self.offer[0] == version else None
        members = [
            k
            for k in tell
            if offer is not None and offer.transport in self.engines[k].transports and self.heard_lately(k)
        ]
        if not in_memory or not members or offer is None:
            return WeightsLoad(policy_version=version, path=path, engine_ids=tell)
        ranks = [self.engines[k].ranks for k in members]
        group = ""
        if offer.transport in ("gloo", "nccl"):
            key = f"{offer.address}|{self.epoch}|{','.join(members)}|{ranks}"
            group = hashlib.sha256(key.encode()).hexdigest()[:16]
        return WeightsLoad(
            policy_version=version,
            path=path,
            engine_ids=tell,
            transfer=offer,
            group=group,
            members=members,
            ranks=ranks,
        )

    async def mark_served(self, version: int, path: str, timings: dict[str, float]) -> None:
        engines = sorted(k for k, e in self.live_engines().items() if e.version == version)
        self.served = version
        self.ctx.policy_version = version
        await self.run_state.record_then_publish(
            WEIGHTS_SERVED,
            {"policy_version": version, "path": path},
            self.bus.subjects.weights_served,
            WeightsServed(policy_version=version, engine_ids=engines, seconds=timings),
            policy_version=version,
        )
        log.info(
            "weights served",
            policy_version=version,
            engines=len(engines),
            **{k: round(v, 3) for k, v in timings.items() if k == "total_s"},
        )
        self.ctx.set_status("ready")
        self.cleanup(version)

    def cleanup(self, served: int) -> None:
        """Delete weight dirs no engine serves and not among the newest ``keep_versions``."""
        root = weights_root(self.cfg)
        if not root.is_dir():
            return
        versions = sorted(
            int(p.name[1:])
            for p in root.iterdir()
            if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit()
        )
        in_use = {e.version for e in self.live_engines().values()} | {served}
        keep = set(versions[-self.cfg.weight_sync.keep_versions :]) | in_use
        for v in versions:
            if v not in keep and v < served:
                shutil.rmtree(root / f"v{v}", ignore_errors=True)


async def serve(ctx: WorkerContext) -> None:
    sync = WeightSync(ctx)
    ctx.set_status("ready")
    async with anyio.create_task_group() as tg:
        tg.start_soon(sync.watch_heartbeats)
        tg.start_soon(sync.watch_loaded)
        tg.start_soon(sync.watch_published)
        await sync.sync_loop()
