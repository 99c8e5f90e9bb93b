"""``areal-async inspect``: look inside a running (or finished) run from Python.

For machines without the NATS CLI. Nothing here consumes work: streams are read with
direct gets by sequence number, so inspecting never steals a task from a worker.

    areal-async inspect --config RUN.yaml               streams, consumers, KV state, workers
    areal-async inspect --config RUN.yaml steps         staleness of every trained step + invariant
    areal-async inspect --config RUN.yaml deadletter    dead letters with their reasons
    areal-async inspect --config RUN.yaml tail trainer.step   decoded events as JSON
    areal-async inspect --config RUN.yaml health      each worker's progress and stall state, queues,
                                                      and the run's stalls and heals so far

The URL comes from ``--url``, else ``bus.url`` of the config, else (embedded server)
``<run_dir>/nats.url`` written by ``areal-async run``. With ``--config`` inspect connects
with the run's credentials and TLS settings (``bus.user``/``token``/``creds``/``tls_*``, and
``AREAL_NATS_PASSWORD``/``AREAL_NATS_TOKEN`` from the environment), as a worker does; on an
embedded run it logs in as the run's ``ops`` user (``<run_dir>/nats/credentials.json``).

A finished embedded run (its server stopped) is read from its JetStream store: when no server
answers at the run's URL, inspect starts a temporary nats-server on ``<run_dir>/nats`` (a
private port on 127.0.0.1, the run's users), reads, and stops it. It only reads there: nothing
is published or acked, and ``tail`` shows stored streams only. The store lock of
``bus.embedded`` keeps it from opening a store that the run's launcher still holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from areal_async.config import RunConfig
from areal_async.errors import ConfigError
from areal_async.run_file import load_config

if TYPE_CHECKING:
    from bus import Bus, ConnectOptions

PACKED_INT = {"token_ids", "versions", "prompt_ids"}
PACKED_FLOAT = {"logprobs"}


def to_jsonable(event: Any) -> Any:
    """An event as plain JSON data; packed arrays become lists, other bytes a length note."""
    from bus.events import unpack_f32, unpack_i32

    def walk(value: Any, key: str = "") -> Any:
        if isinstance(value, bytes):
            if key in PACKED_INT:
                return unpack_i32(value, key).tolist()
            if key in PACKED_FLOAT:
                return [round(float(x), 5) for x in unpack_f32(value, key)]
            return f"<{len(value)} bytes>"
        if isinstance(value, dict):
            return {k: walk(v, str(k)) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, key) for v in value]
        return value

    return walk(
        msgspec.to_builtins(event, enc_hook=lambda x: x) if isinstance(event, msgspec.Struct) else event
    )


@dataclasses.dataclass(frozen=True)
class Target:
    """What to inspect and where."""

    run: str
    url: str | None
    """None: an embedded run whose ``nats.url`` is gone; read from ``store``."""
    cfg: RunConfig | None
    store: Path | None
    """The JetStream store of an embedded run (``<run_dir>/nats``), read when its server is gone."""


def resolve_target(args: argparse.Namespace) -> Target:
    run_name = args.run_name
    url = args.url
    cfg = None
    store = None
    if args.config:
        cfg = load_config(args.config, args.overrides)
        run_name = run_name or cfg.name
        if cfg.bus.url == "embedded":
            store = cfg.run_dir / "nats"
        elif url is None:
            url = cfg.bus.url
        if url is None:
            f = cfg.run_dir / "nats.url"
            if f.is_file():
                url = f.read_text().strip()
            elif not (cfg.run_dir / "nats" / "jetstream").is_dir():
                raise ConfigError(
                    f"bus.url is 'embedded' and neither {f} nor the store {store} exists: has the run "
                    "been started with `areal-async run`? Otherwise pass --url nats://HOST:PORT"
                )
    if not run_name or not (url or store):
        raise ConfigError("inspect needs --config RUN.yaml, or both --url and --run")
    return Target(run=run_name, url=url, cfg=cfg, store=store)


def embedded_login(target: Target, user: str) -> tuple[str, str] | None:
    """(user, password) on the run's embedded server: ``user``, else ``ops`` for a run whose
    credentials predate ``user`` (with a warning line); None when the run is not embedded."""
    from bus.embedded import read_credentials

    passwords = read_credentials(target.store) if target.store is not None else None
    if not passwords:
        return None
    if user not in passwords and "ops" in passwords:
        sys.stderr.write(
            f"warning: run {target.run!r} has no {user!r} user (started by an older version); "
            "logging in as 'ops', which may publish\n"
        )
        user = "ops"
    return (user, passwords[user]) if user in passwords else None


def _options(target: Target, url: str, login: tuple[str, str] | None, name: str) -> ConnectOptions:
    """How to log in at ``url``: as ``login`` on an embedded run, else as a worker of the run."""
    from bus import ConnectOptions
    from workers.runtime import connect_options

    if target.cfg is None:
        return ConnectOptions(url=url, name=name, connect_timeout_s=5.0)
    bus_cfg = dataclasses.replace(target.cfg.bus, url=url, connect_timeout_s=5.0)
    if login is not None:  # the embedded server knows only its generated users
        user, password = login
        bus_cfg = dataclasses.replace(
            bus_cfg, user=user, password=password, token=None, nkeys_seed=None, creds=None
        )
    return connect_options(bus_cfg, name=name)


@asynccontextmanager
async def open_run(
    target: Target, *, user: str = "ops", name: str = "inspect"
) -> AsyncIterator[tuple[Bus, bool]]:
    """(bus, from_store): a connection to the run's server, or to a temporary server on the store
    of a finished embedded run when none answers at its URL. On an embedded run it logs in as
    ``user`` (``embedded_login``), as the client ``name``."""
    from bus import BusConnectError, EmbeddedServer, EmbeddedServerError, connect
    from bus.embedded import read_credentials

    login = embedded_login(target, user)
    refused: BusConnectError | None = None
    if target.url is not None:
        try:
            bus = await connect(_options(target, target.url, login, name), target.run)
        except BusConnectError as exc:
            if target.store is None or not (target.store / "jetstream").is_dir():
                raise
            refused = exc
        else:
            try:
                yield bus, False
            finally:
                await bus.close()
            return
    assert target.store is not None and target.cfg is not None
    server = EmbeddedServer(
        target.store,
        max_payload=int(target.cfg.bus.max_payload_mb * 2**20),
        users=read_credentials(target.store),
        run=target.run,
    )
    try:
        await server.astart()
    except EmbeddedServerError as exc:
        if refused is None:
            raise
        raise BusConnectError(f"{refused}; reading the run's store instead failed: {exc}") from exc
    try:
        assert server.url is not None
        sys.stderr.write(
            f"note: no server of run {target.run!r} is running; reading its store {target.store}\n"
        )
        bus = await connect(_options(target, server.url, login, name), target.run)
        try:
            yield bus, True
        finally:
            await bus.close()
    finally:
        await server.astop()


async def _last_messages(bus: Any, stream_key: str, count: int) -> list[tuple[int, Any]]:
    """The last ``count`` stored messages of a stream, decoded, without consuming them."""
    from bus.events import DecodeError, decode

    spec = bus.subjects.stream(stream_key)
    info = await bus.js.stream_info(spec.name)
    first, last = info.state.first_seq, info.state.last_seq
    out: list[tuple[int, Any]] = []
    seq = last
    while seq >= max(first, 1) and len(out) < count:
        try:
            raw = await bus.js.get_msg(spec.name, seq)
        except Exception:  # deleted (acked work) or purged: skip the gap
            seq -= 1
            continue
        try:
            out.append((seq, decode(raw.data)))
        except DecodeError as e:
            out.append((seq, {"undecodable": e.reason}))
        seq -= 1
    return list(reversed(out))


async def summary(bus: Any, as_json: bool) -> int:
    from bus.events import decode
    from bus.state import CONTROLLER, RUN_ENDED, WEIGHTS_PUBLISHED, WEIGHTS_SERVED, RunState, StateRecordError
    from bus.subjects import Buckets

    run_state = RunState(bus)

    async def record(key: str) -> Any:
        try:
            return await run_state.get(key)
        except StateRecordError as exc:
            return {"unusable": str(exc)}

    report: dict[str, Any] = {"run": bus.run, "streams": {}, "state": {}, "workers": []}
    for spec in bus.subjects.streams:
        try:
            info = await bus.js.stream_info(spec.name)
        except Exception:
            report["streams"][spec.key] = {"missing": True}
            continue
        entry: dict[str, Any] = {"messages": info.state.messages, "bytes": info.state.bytes}
        if spec.consumer:
            try:
                ci = await bus.js.consumer_info(spec.name, spec.consumer)
                entry.update(
                    consumer=spec.consumer,
                    pending=ci.num_pending,
                    ack_pending=ci.num_ack_pending,
                    redelivered=ci.num_redelivered,
                    delivered=ci.delivered.stream_seq if ci.delivered else 0,
                )
            except Exception:
                entry["consumer"] = None
        report["streams"][spec.key] = entry
    for key in (WEIGHTS_PUBLISHED, WEIGHTS_SERVED, RUN_ENDED):
        report["state"][key] = await record(key)
    ctrl = await record(CONTROLLER)
    if ctrl:
        sch = ctrl.get("scheduler", {})
        report["state"]["controller"] = {
            k: sch.get(k)
            for k in ("issued", "trained", "served_version", "trainer_step", "total_issued", "failures")
        }
    now = time.time()
    for key in await bus.kv_keys(Buckets.WORKERS):
        entry = await bus.kv_get(Buckets.WORKERS, key)
        if entry is None:
            continue
        beat = decode(entry.value)
        report["workers"].append(
            {
                "role": beat.role,
                "worker_id": beat.worker_id,
                "status": beat.status,
                "detail": beat.detail,
                "policy_version": beat.policy_version,
                "age_s": round(now - beat.sent_at, 1),
                "load": beat.load,
            }
        )
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
        return 0
    out = [
        f"run {bus.run}",
        "",
        f"{'stream':<11}{'msgs':>7}{'bytes':>11}  consumer           pending  unacked  redelivered",
    ]
    for key, s in report["streams"].items():
        if s.get("missing"):
            out.append(f"{key:<11}  (not provisioned)")
            continue
        out.append(
            f"{key:<11}{s['messages']:>7}{s['bytes']:>11}  {str(s.get('consumer') or '-'):<18}"
            f"{s.get('pending', '-'):>7}  {s.get('ack_pending', '-'):>7}  {s.get('redelivered', '-'):>11}"
        )
    out += ["", "state"]
    for key, value in report["state"].items():
        out.append(f"  {key:<18} {value}")
    out += ["", f"workers ({len(report['workers'])} live)"]
    for w in sorted(report["workers"], key=lambda w: (w["role"], w["worker_id"])):
        out.append(
            f"  {w['role']:<12} {w['worker_id']:<40} v{w['policy_version']:<4} {w['status']:<8} "
            f"{w['age_s']:>5}s ago  {w['detail']}"
        )
    sys.stdout.write("\n".join(out) + "\n")
    return 0


async def health(bus: Any, cfg: RunConfig | None, as_json: bool) -> int:
    """Every live worker's state as the stall watchdog judges it from one look (no history: the
    floor thresholds), its last progress and queue depths; roles of the run without a live worker;
    the stalls and heals recorded in ``stalls.jsonl``. Exit 1 when a worker is frozen or wedged; one
    the watchdog already killed is shown ``killed`` until its entry expires, and does not count."""
    from areal_async.config import WatchdogConfig
    from bus.events import decode
    from bus.subjects import Buckets
    from workers.report import read_jsonl, stall_lines
    from workers.roles import run_roles
    from workers.watchdog import STALLED, StallTracker, undelivered

    tracker = StallTracker(cfg.watchdog if cfg is not None else WatchdogConfig())
    wall, mono = time.time(), time.monotonic()
    beats = {}
    for key in await bus.kv_keys(Buckets.WORKERS):
        entry = await bus.kv_get(Buckets.WORKERS, key)
        if entry is not None:
            beat = decode(entry.value)
            beats[(beat.role, beat.worker_id)] = beat
            tracker.beat(beat, mono - (wall - beat.sent_at))
    queues = await undelivered(bus)
    tracker.consumers(queues)
    history = read_jsonl(cfg.run_dir / "stalls.jsonl") if cfg is not None else []
    # A worker the watchdog killed keeps its entry until its heartbeat TTL ends: it is dealt with.
    killed = {
        r.get("worker_id") for r in history if r.get("event") == "RunStalled" and r.get("action") == "killed"
    }
    rows = []
    for v in sorted(tracker.check(mono), key=lambda v: (v.role, v.worker_id)):
        b = beats[(v.role, v.worker_id)]
        gone = v.state in STALLED and v.worker_id in killed
        rows.append(
            {
                "role": v.role,
                "worker_id": v.worker_id,
                "state": "killed" if gone else v.state,
                "evidence": "killed by the stall watchdog; its entry ends with its heartbeat TTL"
                if gone
                else v.evidence,
                "upstream": v.upstream,
                "phase": b.phase,
                "handled": b.handled,
                "held": b.held,
                "last_progress_s": round(wall - b.progress_at, 1) if b.progress_at else None,
                "last_beat_s": round(wall - b.sent_at, 1),
            }
        )
    expected = run_roles(cfg.uses_agents) if cfg is not None else ()
    absent = [r for r in expected if not any(row["role"] == r and row["state"] != "killed" for row in rows)]
    report = {"run": bus.run, "workers": rows, "absent_roles": absent, "queues": queues, "stalls": history}
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
    else:
        out = [f"run {bus.run}", "", f"{'role':<12} {'worker':<34} {'state':<8} {'done':>6} {'held':>5} "
               f"{'progress':>9}  phase / evidence"]  # fmt: skip
        for r in rows:
            ago = "-" if r["last_progress_s"] is None else f"{r['last_progress_s']}s ago"
            out.append(
                f"{r['role']:<12} {r['worker_id']:<34} {r['state']:<8} {r['handled']:>6} {r['held']:>5} "
                f"{ago:>9}  {r['evidence'] or r['phase']}"
            )
        out += [f"{role:<12} (no live worker)" for role in absent]
        out += ["", "queues (undelivered): " + ", ".join(f"{k} {n}" for k, n in queues.items())]
        if cfg is not None and history:
            out += ["", *stall_lines(cfg.run_dir)]
        sys.stdout.write("\n".join(out) + "\n")
    return 1 if any(r["state"] in STALLED for r in rows) else 0


async def steps(bus: Any, count: int, as_json: bool, max_staleness: int | None) -> int:
    """Staleness per trained step, and the audit; exit 1 if any step broke it.

    A step breaks the audit when a group trails ``t - max_staleness <= head_version <= t``, when it
    names a task id the controller never issued (no ``issued.<task_id>`` record) or one an earlier
    step already trained, or when its stored entry cannot be decoded.
    """
    from areal_async.algo.staleness import StalenessStats
    from bus.state import RunState

    run_state = RunState(bus)
    rows: list[dict[str, Any]] = []
    violations = 0
    trained: set[str] = set()
    for seq, ev in await _last_messages(bus, "STEPS", count):
        if isinstance(ev, dict):
            violations += 1
            rows.append({"seq": seq, "undecodable": ev.get("undecodable", "?"), "invariant_ok": False})
            continue
        stats = StalenessStats.of(trainer_version=ev.policy_version - 1, head_versions=ev.head_versions)
        unissued = [t for t in ev.task_ids if await run_state.issued(t) is None]
        twice = [t for t in ev.task_ids if t in trained]
        trained.update(ev.task_ids)
        bad = (max_staleness is not None and not stats.within(max_staleness)) or bool(unissued) or bool(twice)
        violations += bad
        rows.append(
            {
                "seq": seq,
                "step": ev.step,
                "groups": len(ev.task_ids),
                "staleness_max": stats.max,
                "staleness_mean": stats.mean,
                "reward_mean": ev.metrics.get("reward_mean"),
                "unissued": unissued,
                "trained_before": twice,
                "invariant_ok": not bad,
            }
        )
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    else:
        sys.stdout.write(
            f"{'step':>5} {'groups':>6} {'stale max':>9} {'stale mean':>10} {'reward':>7}  audit\n"
        )
        for r in rows:
            if "undecodable" in r:
                sys.stdout.write(f"  #{r['seq']} undecodable entry: {r['undecodable']}  VIOLATED\n")
                continue
            reward = r["reward_mean"] if r["reward_mean"] is not None else float("nan")
            notes = [f"{len(r['unissued'])} unissued"] if r["unissued"] else []
            notes += [f"{len(r['trained_before'])} trained before"] if r["trained_before"] else []
            verdict = "ok" if r["invariant_ok"] else "VIOLATED " + ", ".join(notes)
            sys.stdout.write(
                f"{r['step']:>5} {r['groups']:>6} {r['staleness_max']:>9} {r['staleness_mean']:>10.2f} "
                f"{reward:>7.3f}  {verdict}\n"
            )
    return 1 if violations else 0


async def deadletters(bus: Any, count: int, as_json: bool) -> int:
    rows = []
    for seq, ev in await _last_messages(bus, "DEADLETTER", count):
        if isinstance(ev, dict):
            rows.append({"seq": seq, **ev})
            continue
        rows.append(
            {
                "seq": seq,
                "subject": ev.subject,
                "reason": ev.reason,
                "bytes": len(ev.data),
                "worker_id": ev.worker_id,
            }
        )
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    else:
        for r in rows:
            sys.stdout.write(
                f"#{r['seq']} {r.get('subject', '?')} [{r.get('worker_id', '?')}] {r.get('reason')}\n"
            )
        sys.stdout.write(f"{len(rows)} dead letter(s) shown\n")
    return 0


async def tail(bus: Any, subject: str, count: int, *, stored_only: bool = False) -> int:
    """The last ``count`` events of a stream subject, or the next ``count`` of a core subject
    (refused with ``stored_only``: no server runs that could publish them)."""
    full = subject if subject.startswith(bus.subjects.prefix) else bus.subjects.prefix + subject
    spec = bus.subjects.stream_for_subject(full)
    if spec is None and stored_only:
        stored = ", ".join(s.subject.removeprefix(bus.subjects.prefix) for s in bus.subjects.streams)
        raise ConfigError(
            f"{full} is not stored and the run is not running, so there is nothing to tail; "
            f"pick a stored subject ({stored})"
        )
    if spec is not None:
        for seq, ev in await _last_messages(bus, spec.key, count):
            sys.stdout.write(json.dumps({"seq": seq, "event": to_jsonable(ev)}, default=str) + "\n")
        return 0
    seen = 0
    async with bus.subscribe(full) as sub:
        async for ev in sub:
            sys.stdout.write(json.dumps({"subject": full, "event": to_jsonable(ev)}, default=str) + "\n")
            sys.stdout.flush()
            seen += 1
            if seen >= count:
                break
    return 0


async def _inspect(args: argparse.Namespace) -> int:
    target = resolve_target(args)
    if args.what == "tail" and not args.subject:
        raise ConfigError("inspect tail needs a SUBJECT, e.g. `inspect --config RUN.yaml tail trainer.step`")
    async with open_run(target) as (bus, from_store):
        if args.what == "summary":
            return await summary(bus, args.json)
        if args.what == "steps":
            max_staleness = target.cfg.rollout.max_staleness if target.cfg is not None else None
            return await steps(bus, args.count, args.json, max_staleness)
        if args.what == "deadletter":
            return await deadletters(bus, args.count, args.json)
        if args.what == "health":
            return await health(bus, target.cfg, args.json)
        if args.what == "tail":
            return await tail(bus, args.subject, args.count, stored_only=from_store)
    return 2


def inspect_main(args: argparse.Namespace) -> int:
    from areal_async.logs import configure_logging

    configure_logging(level="warning", fmt="console")  # stdout is the report; problems go to stderr
    return anyio.run(_inspect, args, backend="asyncio")
