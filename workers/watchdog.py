"""Stall watchdog: tells a worker that is alive but stuck from one that is slow, names it, and acts.

Inputs, all from the run's bus: every worker's heartbeat (``heartbeat.<role>.<id>``), which carries
what its work loop reports (``handled``, ``progress_at``, ``busy_at``, ``phase``, ``held``; set by the
loop itself, never by the heartbeat task), and every durable consumer's undelivered messages.

States of a worker at time ``now``:

- ``frozen``: no heartbeat for ``watchdog.frozen_after_s`` while its process lives (SIGSTOP, a hung
  event loop, a machine gone).
- ``wedged``: it beats, work waits for it (it is busy, or its consumer holds undelivered messages)
  and its last finished unit of work is older than its threshold.
- ``starved``: it would be wedged, but a role it waits on (``WAITS_ON``) is frozen or wedged: that
  role is named and nothing is done to this one.
- ``slow``: no progress for over twice the longest gap its role has shown, below the threshold.
- ``healthy`` (progressing or idle).

Threshold of a role: ``max(wedged_floor_s, history_factor x the longest gap between two units of
work of that role among the last ``GAPS_KEPT``)``; before a worker's first unit, ``first_progress_s``
from its start. Ages are measured on the worker's own clock (``sent_at - progress_at``) plus the
time since its beat arrived, so clock skew between hosts does not matter.

``StallTracker`` is the pure part (unit-tested): feed it beats and consumer depths, ask it for
``check(now)``. ``watch`` runs it on a bus: a new frozen or wedged worker gets ``act(verdict)`` (the
launcher kills its process group; the supervisor restarts it), a ``run.stalled`` event and a warning
line; the role's next progress gets ``run.healed`` with the stall's duration. Both are appended to
``<run_dir>/stalls.jsonl`` for the summary.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog

from areal_async.config import RunConfig, WatchdogConfig
from bus import Bus
from bus.events import Heartbeat, RunHealed, RunStalled

log = structlog.get_logger()

GAPS_KEPT = 20
"""Progress gaps remembered per role: an old long gap stops widening the threshold."""

WAITS_ON: Mapping[str, tuple[str, ...]] = {
    "controller": ("trainer",),
    "generation": ("controller", "weight-sync"),
    "agent": ("controller", "generation"),
    "reward": ("generation",),
    "trainer": ("reward", "agent", "generation"),
    "weight-sync": ("trainer", "generation"),
}
"""Roles whose stall can leave a role without work or blocked (a trainer's in-memory hand-off and a
weight-sync wait on the generation workers that load the weights)."""

CONSUMER_ROLES: Mapping[str, tuple[str, ...]] = {
    "generation": ("generation", "agent"),
    "reward": ("reward",),
    "trainer": ("trainer",),
    "controller-eval": ("controller",),
    "controller-failed": ("controller",),
    "controller-steps": ("controller",),
}
"""Durable consumer -> the roles that read it (agent workers take the prompts in agent runs)."""

STALLED = ("frozen", "wedged")
"""States the watchdog acts on."""


@dataclass
class _Seen:
    beat: Heartbeat
    received: float
    """Local time the beat arrived."""


@dataclass(frozen=True)
class Verdict:
    role: str
    worker_id: str
    pid: int
    state: str
    evidence: str
    upstream: str = ""
    stalled_since: float = 0.0
    """Local time of the worker's last sign of life (frozen) or last unit of work (wedged)."""


@dataclass
class _Stall:
    verdict: Verdict
    detected_at: float


@dataclass
class StallTracker:
    """Per-worker and per-role bookkeeping of liveness and progress; see the module docstring."""

    cfg: WatchdogConfig
    workers: dict[tuple[str, str], _Seen] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)
    """Undelivered messages waiting for each role, from its consumers."""
    gaps: dict[str, deque[float]] = field(default_factory=dict)
    stalls: dict[tuple[str, str], _Stall] = field(default_factory=dict)
    """Workers found frozen or wedged and not yet healed."""
    last_progress: dict[str, float] = field(default_factory=dict)
    """Local time of each role's newest unit of work, from any of its workers (a stopped one too)."""
    view_since: float = float("-inf")
    """Local time since which the watchdog has heard the bus without a gap (its own connection was
    down before): silence before it is no evidence against a worker."""

    def beat(self, beat: Heartbeat, now: float) -> None:
        key = (beat.role, beat.worker_id)
        if beat.progress_at > 0:
            at = now - (beat.sent_at - beat.progress_at)
            self.last_progress[beat.role] = max(at, self.last_progress.get(beat.role, at))
        if beat.status == "stopped":
            self.workers.pop(key, None)
            return
        seen = self.workers.get(key)
        if seen is not None and beat.progress_at > seen.beat.progress_at > 0:
            self.gaps.setdefault(beat.role, deque(maxlen=GAPS_KEPT)).append(
                beat.progress_at - seen.beat.progress_at
            )
        self.workers[key] = _Seen(beat, now)

    def consumers(self, undelivered: Mapping[str, int]) -> None:
        """Undelivered message counts by durable consumer name."""
        pending: dict[str, int] = {}
        for durable, count in undelivered.items():
            for role in CONSUMER_ROLES.get(durable, ()):
                pending[role] = pending.get(role, 0) + count
        self.pending = pending

    def forget(self, role: str, worker_id: str) -> None:
        """A worker that is gone (killed, exited): its beats no longer count."""
        self.workers.pop((role, worker_id), None)

    def threshold(self, role: str) -> float:
        gaps = self.gaps.get(role)
        longest = max(gaps) if gaps else 0.0
        return max(self.cfg.wedged_floor_s, self.cfg.history_factor * longest)

    def _classify(self, seen: _Seen, now: float) -> Verdict:
        b = seen.beat
        silent = now - max(seen.received, self.view_since)
        base = Verdict(role=b.role, worker_id=b.worker_id, pid=b.pid, state="healthy", evidence="")
        if seen.received < self.view_since and silent <= self.cfg.frozen_after_s:
            return base  # not heard since the watchdog's view came back: too early to tell
        if silent > self.cfg.frozen_after_s:
            last = seen.received - (b.sent_at - b.progress_at) if b.progress_at > 0 else seen.received
            return _with(
                base,
                state="frozen",
                evidence=f"no heartbeat for {silent:.1f} s (limit {self.cfg.frozen_after_s:g} s); "
                f"last phase: {b.phase or b.status}",
                stalled_since=last,
            )
        busy = b.busy_at > 0
        waiting = self.pending.get(b.role, 0)
        if not (busy or waiting):
            return base
        first = b.progress_at <= 0
        # Work waits since the loop went busy, or (queued work only) since it started; never
        # before its last unit of work.
        since_progress = b.sent_at - max(b.progress_at, b.busy_at if busy else b.started_at) + silent
        limit = self.cfg.first_progress_s if first else self.threshold(b.role)
        work = f"busy in {b.phase}" if busy else f"{waiting} messages wait in its queue"
        if since_progress > limit:
            what = "no unit of work yet" if first else "no unit of work"
            return _with(
                base,
                state="wedged",
                evidence=f"{what} for {since_progress:.1f} s (limit {limit:.0f} s) while {work}; "
                f"{b.handled} done, {b.held} deliveries held",
                stalled_since=now - since_progress,
            )
        gaps = self.gaps.get(b.role)
        if gaps and since_progress > 2 * max(gaps):
            return _with(base, state="slow", evidence=f"no unit of work for {since_progress:.1f} s; {work}")
        return base

    def check(self, now: float) -> list[Verdict]:
        """Every known worker's verdict; a wedged one whose upstream role is stalled is ``starved``."""
        verdicts = [self._classify(seen, now) for seen in self.workers.values()]
        stuck = {v.role for v in verdicts if v.state in STALLED}
        out = []
        for v in verdicts:
            blocker = next((r for r in WAITS_ON.get(v.role, ()) if r in stuck and r != v.role), "")
            if v.state == "wedged" and blocker:
                v = _with(v, state="starved", upstream=blocker, evidence=f"{v.evidence}; {blocker} is stuck")
            out.append(v)
        return out

    def new_stalls(self, verdicts: list[Verdict], now: float) -> list[Verdict]:
        """The frozen or wedged verdicts not reported before (each stall is reported once)."""
        fresh = []
        for v in verdicts:
            key = (v.role, v.worker_id)
            if v.state in STALLED and key not in self.stalls:
                self.stalls[key] = _Stall(v, now)
                fresh.append(v)
        return fresh

    def healed(self) -> list[tuple[Verdict, float]]:
        """Stalls whose role has finished a unit of work since they were detected: (the stall's
        verdict, seconds from its last progress to the first progress after it)."""
        out = []
        for key, stall in list(self.stalls.items()):
            progress = self.last_progress.get(stall.verdict.role, 0.0)
            if progress > stall.detected_at:
                del self.stalls[key]
                out.append((stall.verdict, progress - stall.verdict.stalled_since))
        return out


def _with(v: Verdict, **changes: Any) -> Verdict:
    return Verdict(**(asdict(v) | changes))


# ---- on a bus -----------------------------------------------------------------------------------


async def undelivered(bus: Bus) -> dict[str, int]:
    """Undelivered message counts of the run's durable consumers (absent ones are skipped)."""
    counts = {}
    for spec in bus.subjects.streams:
        if spec.consumer is None:
            continue
        try:
            info = await bus.js.consumer_info(spec.name, spec.consumer)
        except Exception:  # not provisioned yet, or a leader election: next round
            continue
        counts[spec.consumer] = int(info.num_pending or 0)
    return counts


async def watch(
    bus: Bus,
    cfg: RunConfig,
    act: Callable[[Verdict], str],
    *,
    stop: threading.Event,
    warn: Callable[[str], None],
) -> None:
    """Watch the run until ``stop`` is set; see the module docstring. ``act`` returns what it did
    (``killed`` or ``none``); ``warn`` prints a line for the operator."""
    tracker = StallTracker(cfg.watchdog)
    interval = cfg.bus.heartbeat_interval_s
    journal = cfg.run_dir / "stalls.jsonl"

    async def read_beats() -> None:
        async with bus.subscribe(bus.subjects.heartbeat_all) as beats:
            async for beat in beats:
                if isinstance(beat, Heartbeat):
                    tracker.beat(beat, time.monotonic())

    async with anyio.create_task_group() as tg:
        tg.start_soon(read_beats)
        while not stop.is_set():
            if await anyio.to_thread.run_sync(stop.wait, interval):  # set: a stop is seen at once
                break
            if not bus.nc.is_connected:  # blind: what is not heard now says nothing of the workers
                tracker.view_since = time.monotonic()
                continue
            tracker.consumers(await undelivered(bus))
            now = time.monotonic()
            verdicts = tracker.check(now)
            for v in tracker.new_stalls(verdicts, now):
                action = act(v) if cfg.watchdog.action == "kill" else "none"
                if action == "gone":  # exited on its own; the supervisor already knows
                    tracker.stalls.pop((v.role, v.worker_id), None)
                    tracker.forget(v.role, v.worker_id)
                    continue
                if action == "killed":
                    tracker.forget(v.role, v.worker_id)
                warn(
                    f"warning: {v.role} worker {v.worker_id} (pid {v.pid}) is {v.state}: {v.evidence}; action: {action}"
                )
                event = RunStalled(
                    role=v.role,
                    worker_id=v.worker_id,
                    pid=v.pid,
                    state=v.state,
                    evidence=v.evidence,
                    action=action,
                    upstream=v.upstream,
                    detected_at=time.time(),
                )
                await _announce(bus, bus.subjects.run_stalled, event, journal)
            for v, stalled_s in tracker.healed():
                warn(f"{v.role} makes progress again after {stalled_s:.1f} s ({v.state})")
                event = RunHealed(
                    role=v.role,
                    worker_id=v.worker_id,
                    state=v.state,
                    stalled_s=stalled_s,
                    healed_at=time.time(),
                )
                await _announce(bus, bus.subjects.run_healed, event, journal)
        tg.cancel_scope.cancel()


async def _announce(bus: Bus, subject: str, event: RunStalled | RunHealed, journal: Path) -> None:
    record = {"event": type(event).__name__, **{k: getattr(event, k) for k in event.__struct_fields__}}
    with journal.open("a") as f:
        f.write(json.dumps(record) + "\n")
    try:
        await bus.publish(subject, event)
    except Exception as exc:  # the journal has it; the bus may be what is stuck
        log.warning("stall event not published", error=str(exc))


def start_thread(
    cfg: RunConfig,
    options: Any,
    act: Callable[[Verdict], str],
    *,
    stop: threading.Event,
    warn: Callable[[str], None],
) -> threading.Thread:
    """Run ``watch`` in a daemon thread with its own event loop and connection (``options``:
    ``bus.ConnectOptions``, the ``ops`` user under ``areal-async run``) until ``stop`` (a
    ``threading.Event``) is set. A lost connection is retried; the watchdog never stops the run."""
    from bus import connect

    async def main() -> None:
        while not stop.is_set():
            try:
                async with await connect(options, cfg.name) as bus:
                    await watch(bus, cfg, act, stop=stop, warn=warn)
            except Exception as exc:
                log.warning("watchdog lost its bus connection; retrying", error=str(exc))
                await anyio.sleep(cfg.bus.heartbeat_interval_s)

    thread = threading.Thread(target=anyio.run, args=(main,), daemon=True, name="watchdog")
    thread.start()
    return thread


# ---- a worker's own watchdog (systemd, Slurm) ---------------------------------------------------

STALLED_EXIT = 3
"""Exit code of a worker whose own watchdog found it stalled (the Slurm entry scripts restart it)."""

SELF_WATCHDOG_ENV = "AREAL_SELF_WATCHDOG"
"""``exit``: a worker that finds itself stalled exits with ``STALLED_EXIT`` (set by the Slurm entry
scripts). Under systemd (``NOTIFY_SOCKET`` and ``WATCHDOG_USEC`` set) it stops notifying instead."""


def sd_notify(message: str) -> None:
    """Send `message` (``READY=1``, ``WATCHDOG=1``) to systemd's notify socket, if there is one."""
    path = os.environ.get("NOTIFY_SOCKET", "")
    if not path:
        return
    address = "\0" + path[1:] if path.startswith("@") else path  # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(message.encode())


def start_self_watchdog(
    cfg: RunConfig, beat: Callable[[], tuple[Heartbeat, float]]
) -> threading.Thread | None:
    """Judge this worker with ``StallTracker`` from a thread, so that a blocked event loop is seen
    too. ``beat()`` returns the worker's current heartbeat, stamped with the wall time its event
    loop last beat, and that time on the monotonic clock. Healthy: ``WATCHDOG=1`` to systemd.
    Frozen or wedged: exit with ``STALLED_EXIT`` (``AREAL_SELF_WATCHDOG=exit``), or stop
    notifying so that systemd's ``WatchdogSec`` kills and restarts the worker. Returns the thread,
    or None when neither applies."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    systemd = bool(os.environ.get("NOTIFY_SOCKET")) and usec.isdigit()
    exit_on_stall = os.environ.get(SELF_WATCHDOG_ENV) == "exit"
    if os.environ.get("NOTIFY_SOCKET"):
        sd_notify("READY=1")
    if not cfg.watchdog.enabled or not (systemd or exit_on_stall):
        return None
    period = cfg.bus.heartbeat_interval_s
    if systemd:
        period = min(period, int(usec) / 2e6)

    def judge() -> None:
        tracker = StallTracker(cfg.watchdog)
        while True:
            current, beat_at = beat()
            tracker.beat(current, beat_at)
            [v] = tracker.check(time.monotonic()) or [None]
            if v is not None and v.state in STALLED:
                log.error(
                    "this worker is stalled", state=v.state, evidence=v.evidence, exit_code=STALLED_EXIT
                )
                if exit_on_stall:
                    os._exit(STALLED_EXIT)
                return  # no more WATCHDOG=1: systemd kills the worker after WatchdogSec
            if systemd:
                sd_notify("WATCHDOG=1")
            time.sleep(period)

    thread = threading.Thread(target=judge, daemon=True, name="self-watchdog")
    thread.start()
    return thread
