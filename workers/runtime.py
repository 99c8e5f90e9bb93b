"""The shared process shell of every worker role.

``run_role(cfg, role=..., serve=...)`` configures logging (console or JSON, plus a JSON
file per worker under ``<run_dir>/logs/``), writes the resolved config, connects to the
bus, provisions streams/consumers/buckets (idempotent), and runs ``serve(ctx)`` inside
an anyio task group beside:

- a heartbeat task: ``heartbeat.<role>.<id>`` on core NATS plus a KV entry with TTL, so
  ``inspect`` and the weight-sync worker see who is alive and on which version;
- a signal task: SIGTERM/SIGINT cancel the group; ``serve`` gets ``shutdown_grace_s``
  to finish what it holds (unacked work is redelivered to another worker anyway);
- a run-end task: ``run.ended`` from the controller stops the worker.

Exit code 0 when the run ended or the worker was asked to stop, 1 on a failure, 2 when
the server refuses the worker a publish for permissions (a restart cannot fix that;
systemd's ``RestartPreventExitStatus=2`` stops the restart loop).
"""

from __future__ import annotations

import ctypes
import os
import re
import resource
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec
import structlog

from areal_async.config import BusConfig, RunConfig
from areal_async.logs import configure_logging
from areal_async.run_file import write_resolved_config
from bus import (
    Bus,
    BusConnectError,
    BusPermissionError,
    ConnectOptions,
    ProvisionError,
    StreamUnavailable,
    connect,
)
from bus.events import Heartbeat, RunEnded, encode
from bus.state import RUN_ENDED, RunState
from bus.subjects import Buckets
from workers.watchdog import start_self_watchdog

log = structlog.get_logger()

SHUTDOWN_GRACE_S = 10.0
FINISHING_ROLES = frozenset({"trainer"})


@dataclass
class WorkerContext:
    """What a role's ``serve`` gets: config, identity, the bus, and a status for heartbeats."""

    cfg: RunConfig
    role: str
    worker_id: str
    bus: Bus
    status: str = "starting"
    detail: str = ""
    policy_version: int = -1
    load: dict[str, float] = field(default_factory=dict)
    ended: anyio.Event = field(default_factory=anyio.Event)
    transports: list[str] = field(default_factory=list)
    """In-memory weight transports this worker receives (its heartbeat tells weight-sync)."""
    transfer_ranks: int = 1
    handled: int = 0
    """Units of work finished (``progressed``); heartbeats carry it with the fields below."""
    tokens: int = 0
    progress_at: float = 0.0
    """Wall time of the last finished unit of work; 0 before the first."""
    busy_in: dict[str, int] = field(default_factory=dict)
    """Work the loop holds now, by phase: how many units of each are under way (``working``)."""
    busy_at: float = 0.0
    """Wall time the loop last went from idle to busy; 0 while idle."""
    started_at: float = field(default_factory=time.time)
    beat_at: tuple[float, float] = field(default_factory=lambda: (time.time(), time.monotonic()))
    """Wall and monotonic time of the heartbeat task's last beat (its event loop was alive)."""

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir

    def progressed(self, units: int = 1, *, tokens: int = 0) -> None:
        """The work loop finished `units` of work (a group, a step, a hand-off); called by the
        loop itself, never by a timer, so that a stuck loop stops advancing ``progress_at``."""
        self.handled += units
        self.tokens += tokens
        self.progress_at = time.time()

    @asynccontextmanager
    async def working(self, phase: str) -> AsyncIterator[None]:
        """Mark a unit of work under way (the worker is ``busy`` in `phase`) until the block ends."""
        if not self.busy_in:
            self.busy_at = time.time()
        self.busy_in[phase] = self.busy_in.get(phase, 0) + 1
        try:
            await _injected_wedge(self.role, phase)
            yield
        finally:
            left = self.busy_in[phase] - 1
            if left:
                self.busy_in[phase] = left
            else:
                del self.busy_in[phase]
                if not self.busy_in:
                    self.busy_at = 0.0

    def set_status(self, status: str, detail: str = "") -> None:
        if (status, detail) != (self.status, self.detail):
            log.info("status", status=status, detail=detail or None)
        self.status, self.detail = status, detail

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            role=self.role,
            worker_id=self.worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            policy_version=self.policy_version,
            status=self.status,
            detail=self.detail,
            load=dict(self.load),
            sent_at=time.time(),
            transports=list(self.transports),
            transfer_ranks=self.transfer_ranks,
            handled=self.handled,
            tokens=self.tokens,
            progress_at=self.progress_at,
            busy_at=self.busy_at,
            phase=", ".join(sorted(self.busy_in)) or self.status,
            held=self.bus.held,
            started_at=self.started_at,
            peak_rss=peak_rss(),
            restarts=_int_env(RESTARTS_ENV),
        )


RESTARTS_ENV = "AREAL_RESTARTS"
"""Set by ``areal-async run`` on each worker it starts: how often that role's slot was restarted."""


def peak_rss() -> int:
    """Largest resident set of this process so far, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _int_env(name: str) -> int:
    try:
        return max(0, int(os.environ.get(name, "0")))
    except ValueError:
        return 0


WEDGE_ENV = "AREAL_FAULT_WEDGE"
"""Fault injection for stall tests and drills: ``ROLE:PHASE:MARKER``. The first worker of ROLE to
start a unit of work whose phase begins with PHASE creates the file MARKER (holding its pid), and
from then on no unit of that phase finishes in that process, while its heartbeats go on: a wedged
work loop. Workers started later (its replacement) are not affected."""


async def _injected_wedge(role: str, phase: str) -> None:
    spec = os.environ.get(WEDGE_ENV, "")
    if spec.count(":") < 2:
        return
    wedged_role, wedged_phase, marker = spec.split(":", 2)
    if role == wedged_role and phase.startswith(wedged_phase) and _claim_wedge(marker):
        log.warning("fault injected: this unit of work never finishes", env=WEDGE_ENV, phase=phase)
        await anyio.sleep_forever()


def _claim_wedge(marker: str) -> bool:
    """True when this process is the wedged one: it creates `marker` now or created it before."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return Path(marker).read_text().strip() == str(os.getpid())
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def connect_options(bus_cfg: BusConfig, *, name: str) -> ConnectOptions:
    """Translate the run's bus section into client options (secrets may come from the environment)."""
    if bus_cfg.url == "embedded":
        url = os.environ.get("AREAL_BUS_URL")
        if not url:
            raise BusConnectError(
                "bus.url is 'embedded', which only `areal-async run` can start; run the whole job with "
                "`areal-async run RUN.yaml`, or point this worker at a server with --set bus.url=nats://HOST:4222"
            )
    else:
        url = bus_cfg.url
    return ConnectOptions(
        url=[u.strip() for u in url.split(",") if u.strip()],
        name=name,
        token=bus_cfg.token or os.environ.get("AREAL_NATS_TOKEN"),
        user=bus_cfg.user,
        password=bus_cfg.password or os.environ.get("AREAL_NATS_PASSWORD"),
        nkeys_seed=bus_cfg.nkeys_seed,
        creds=bus_cfg.creds,
        tls_ca=bus_cfg.tls_ca,
        tls_cert=bus_cfg.tls_cert,
        tls_key=bus_cfg.tls_key,
        connect_timeout_s=bus_cfg.connect_timeout_s,
        reconnect_wait_max_s=bus_cfg.reconnect_wait_max_s,
    )


async def open_bus(cfg: RunConfig, *, name: str) -> Bus:
    bus = await connect(connect_options(cfg.bus, name=name), cfg.name)
    await bus.provision(
        replicas=cfg.bus.replicas,
        ack_wait=cfg.bus.ack_wait_s,
        max_ack_pending=cfg.bus.max_ack_pending,
        heartbeat_ttl=cfg.bus.heartbeat_ttl_s,
        weights_bucket=cfg.weight_sync.transport == "bus",
    )
    return bus


def default_worker_id(role: str) -> str:
    """``role-host-pid`` with anything that cannot be a subject token replaced by '-'."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())
    return f"{role}-{host}-{os.getpid()}"


AFFINITY_ENV = "AREAL_CPU_AFFINITY"


def parse_affinity(spec: str, env: str = AFFINITY_ENV, unit: str = "core") -> dict[str, set[int]]:
    """Every entry of an ``AREAL_CPU_AFFINITY`` value (or of ``env``'s, counting ``unit``s), checked:
    ``{name: ids}`` (the last entry of a name wins).

    Format ``name=ids;name=ids`` with ids like ``0``, ``0,1`` or ``2-5``. A name is a role
    (``trainer``: the whole process) or ``<role>.io`` (the role's background I/O threads: the
    trainer's weight writer, which hashes and writes every new version). E.g.
    ``generation=0;trainer=1;trainer.io=0``.
    """
    found: dict[str, set[int]] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        key, sep, ids = part.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(
                f"{env}: entry {part!r} is not NAME={unit.upper()}S; write e.g. 'generation=0;trainer=1'"
            )
        chosen: set[int] = set()
        for item in ids.split(","):
            lo, _, hi = item.strip().partition("-")
            try:
                first, last = int(lo), int(hi or lo)
            except ValueError:
                raise ValueError(
                    f"{env}: {key}={ids!r} has {unit} {item.strip()!r}, which is not a "
                    f"number or a range; write {unit}s like 0, 0,1 or 2-5"
                ) from None
            if first < 0 or last < first:
                raise ValueError(
                    f"{env}: {key}={ids!r} has the empty or negative range "
                    f"{item.strip()!r}; write a range as LOW-HIGH with 0 <= LOW <= HIGH"
                )
            chosen.update(range(first, last + 1))
        found[key] = chosen
    return found


CUDA_DEVICES_ENV = "AREAL_CUDA_DEVICES"


def cuda_devices(role: str, spec: str | None = None) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for ``role`` from ``AREAL_CUDA_DEVICES`` (or ``spec``), e.g.
    ``generation=0;trainer=1-2`` puts generation on GPU 0 and the trainer's ranks on GPUs 1 and 2
    (its ``LOCAL_RANK`` counts the visible ones); None for a role it does not name."""
    found = parse_affinity(
        os.environ.get(CUDA_DEVICES_ENV, "") if spec is None else spec, CUDA_DEVICES_ENV, "device"
    )
    ids = found.get(role)
    return None if ids is None else ",".join(str(i) for i in sorted(ids))


def cpu_affinity(name: str, spec: str | None = None) -> set[int] | None:
    """The cores ``AREAL_CPU_AFFINITY`` (or ``spec``) names for ``name``; None when it names none.
    Any malformed entry raises, whichever name it is for (`parse_affinity`)."""
    return parse_affinity(os.environ.get(AFFINITY_ENV, "") if spec is None else spec).get(name)


def pin_cpus(role: str) -> None:
    """Pin this process to the cores named for its role in ``AREAL_CPU_AFFINITY``.

    On one machine, ``generation=0;trainer=1`` makes generation and training behave like separate
    devices (benchmarks). Roles not named keep every core. The whole value is checked here, at
    start-up, so a bad ``<role>.io`` entry is refused before any background thread reads it.
    """
    cpus = cpu_affinity(role)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter number of the arena cap (malloc.h)."""


def limit_malloc_arenas(arenas: int) -> bool:
    """Cap this process's glibc malloc arenas at ``arenas`` (``trainer.malloc_arenas``); call it
    before the threads that allocate start. Not applied, returning False, for 0, where
    ``MALLOC_ARENA_MAX`` is set (the environment decides) or where the C library is not glibc."""
    if arenas == 0 or "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_ARENA_MAX, arenas))


@contextmanager
def io_thread_affinity(role: str) -> Iterator[None]:
    """Run the calling thread on the cores named for ``<role>.io`` while inside; restore them after.

    Background I/O of a pinned role (hashing and writing weights) would otherwise take time from
    the cores its compute is pinned to. On Linux the affinity of pid 0 is the calling thread's.
    """
    cpus = cpu_affinity(f"{role}.io")
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _start_logging(cfg: RunConfig, role: str, worker_id: str | None, *, rank: int) -> str:
    """Log to ``<run_dir>/logs/<worker id>.jsonl`` (and the console); returns the worker id
    (``worker_id``, else ``AREAL_WORKER_ID``, else a new one)."""
    worker_id = worker_id or os.environ.get("AREAL_WORKER_ID") or default_worker_id(role)
    logs_dir = cfg.run_dir / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    configure_logging(
        level=cfg.logging.level,
        fmt=cfg.logging.format,
        json_file=logs_dir / f"{worker_id}.jsonl",
        role=role,
        worker_id=worker_id,
        rank=rank,
    )
    return worker_id


def run_role(
    cfg: RunConfig,
    *,
    role: str,
    serve: Callable[[WorkerContext], Awaitable[None]],
    worker_id: str | None = None,
) -> int:
    """Run one role until it finishes, the run ends, or a signal arrives; return the exit code."""
    worker_id = _start_logging(cfg, role, worker_id, rank=int(os.environ.get("RANK", "0")))
    write_resolved_config(cfg, role)
    try:
        pin_cpus(role)
    except ValueError as exc:
        log.error("bad cpu affinity", error=str(exc))
        return 2
    try:
        code = anyio.run(_main, cfg, role, worker_id, serve, backend="asyncio")
    except BusConnectError as exc:
        log.error("bus unavailable", error=str(exc))
        code = 1
    except (ProvisionError, StreamUnavailable) as exc:
        log.error("bus provisioning failed", error=str(exc))
        code = 1
    except KeyboardInterrupt:
        code = 130
    _exit_on_stop_signal(code)
    return code


def _exit_on_stop_signal(code: int) -> None:
    """The worker has stopped; a SIGTERM/SIGINT during interpreter teardown ends it with ``code``.

    Teardown (torch, thread pools) can take seconds; without this a stop request arriving then would
    kill the process by the default action and report -15 for a worker that stopped cleanly.
    """

    def _exit(_signum: int, _frame: object) -> None:
        os._exit(code)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _exit)


def run_fleet(
    cfg: RunConfig,
    *,
    role: str,
    serve: Callable[[WorkerContext], Awaitable[None]],
    count: int,
    worker_id: str | None = None,
) -> int:
    """Run ``count`` workers of ``role`` in this process, each with its own bus connection, worker
    id (``<worker_id>-<i>``) and heartbeat: as many bus clients as separate processes would be,
    for roles whose work is cheap (simulated engines). One failing worker stops the others; the
    exit code is the highest."""
    worker_id = _start_logging(cfg, role, worker_id, rank=0)
    write_resolved_config(cfg, role)

    async def fleet() -> int:
        codes: list[int] = []

        async def one(i: int) -> None:
            structlog.contextvars.bind_contextvars(worker_id=f"{worker_id}-{i}")
            codes.append(await _main(cfg, role, f"{worker_id}-{i}", serve, handle_signals=False))

        async with anyio.create_task_group() as tg:
            tg.start_soon(_signals, tg.cancel_scope)
            async with anyio.create_task_group() as workers:
                for i in range(count):
                    workers.start_soon(one, i)
            tg.cancel_scope.cancel()
        return max(codes, default=0)

    try:
        code = anyio.run(fleet, backend="asyncio")
    except KeyboardInterrupt:
        code = 130
    _exit_on_stop_signal(code)
    return code


async def _main(
    cfg: RunConfig,
    role: str,
    worker_id: str,
    serve: Callable[[WorkerContext], Awaitable[None]],
    *,
    handle_signals: bool = True,
) -> int:
    bus = await open_bus(cfg, name=worker_id)
    ctx = WorkerContext(cfg=cfg, role=role, worker_id=worker_id, bus=bus)
    log.info("worker started", run=cfg.name, run_dir=str(cfg.run_dir), pid=os.getpid())
    code = 0
    try:
        async with anyio.create_task_group() as tg:
            if handle_signals:
                tg.start_soon(_signals, tg.cancel_scope)
            tg.start_soon(_heartbeats, ctx)
            start_self_watchdog(cfg, lambda: _own_beat(ctx))
            tg.start_soon(_watch_run_end, ctx, tg.cancel_scope)
            await serve(ctx)
            tg.cancel_scope.cancel()
    except Exception as exc:
        denied = _permission_error(exc)
        if denied is not None:
            log.error("bus permission denied", subject=denied.subject, user=denied.user, error=str(denied))
            code = 2
        else:
            log.exception("worker failed")
            code = 1
    finally:
        with anyio.move_on_after(SHUTDOWN_GRACE_S, shield=True):
            ctx.status = "stopped"
            try:
                await bus.publish(bus.subjects.heartbeat(role, worker_id), ctx.heartbeat())
                await bus.kv_delete(Buckets.WORKERS, f"{role}.{worker_id}")
            except Exception as exc:  # the bus may be the reason we stop
                log.warning("could not announce stop", error=str(exc))
            await bus.close()
    log.info("worker stopped", code=code)
    return code


def _permission_error(exc: BaseException) -> BusPermissionError | None:
    """The BusPermissionError in ``exc``, also inside the task group's exception group."""
    if isinstance(exc, BusPermissionError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _permission_error(inner)) is not None:
                return found
    return None


async def _signals(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("signal received, shutting down", signal=signal.Signals(signum).name)
            scope.cancel()
            return


def _own_beat(ctx: WorkerContext) -> tuple[Heartbeat, float]:
    """This worker's heartbeat as its own watchdog sees it: sent when its event loop last beat."""
    wall, mono = ctx.beat_at
    return msgspec.structs.replace(ctx.heartbeat(), sent_at=wall), mono


async def _heartbeats(ctx: WorkerContext) -> None:
    subject = ctx.bus.subjects.heartbeat(ctx.role, ctx.worker_id)
    key = f"{ctx.role}.{ctx.worker_id}"
    while True:
        ctx.beat_at = (time.time(), time.monotonic())
        beat = ctx.heartbeat()
        try:
            await ctx.bus.publish(subject, beat)
            await ctx.bus.kv_put(Buckets.WORKERS, key, encode(beat))
        except Exception as exc:  # a lost connection pauses beats; nats-py reconnects underneath
            log.warning("heartbeat failed", error=str(exc))
        await anyio.sleep(ctx.cfg.bus.heartbeat_interval_s)


async def _watch_run_end(ctx: WorkerContext, scope: anyio.CancelScope) -> None:
    """``run.ended`` stops the worker; a role that must finish something (the trainer's last
    checkpoint) watches ``ctx.ended`` itself and returns from ``serve``."""
    if ctx.role == "controller":
        return  # the controller decides when the run ends
    run_state = RunState(ctx.bus)
    if await ctx.bus.kv_get(Buckets.STATE, RUN_ENDED) is None:
        async with anyio.create_task_group() as tg, ctx.bus.subscribe(ctx.bus.subjects.run_ended) as sub:

            async def from_state() -> None:  # the event may be lost in a disconnect; the key is not
                async for record in run_state.latest(RUN_ENDED, ctx.cfg.bus.heartbeat_interval_s):
                    if record is not None:
                        log.info("run ended, read from the state bucket", reason=record.get("reason"))
                        tg.cancel_scope.cancel()

            tg.start_soon(from_state)
            async for event in sub:
                # The controller records the end before announcing it: an event without the record is
                # not the controller's (docs/design.md section 8) and stops nothing.
                if isinstance(event, RunEnded):
                    if await ctx.bus.kv_get(Buckets.STATE, RUN_ENDED) is None:
                        log.warning(
                            "run.ended without the run state's record; ignored", reason=event.reason[:200]
                        )
                        continue
                    log.info("run ended", reason=event.reason, policy_version=event.policy_version)
                    break
            tg.cancel_scope.cancel()
    else:
        log.info("run already ended")
    ctx.ended.set()
    if ctx.role not in FINISHING_ROLES:
        scope.cancel()
