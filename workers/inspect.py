"""``areal-async inspect``: look inside a running (or finished) run from Python.

For machines without the NATS CLI. Nothing here consumes work: streams are read with
direct gets by sequence number, so inspecting never steals a task from a worker.

    areal-async inspect --config RUN.yaml               streams, consumers, KV state, workers
    areal-async inspect --config RUN.yaml steps         staleness of every trained step + invariant
    areal-async inspect --config RUN.yaml deadletter    dead letters with their reasons
    areal-async inspect --config RUN.yaml tail trainer.step   decoded events as JSON

The URL comes from ``--url``, else ``bus.url`` of the config, else (embedded server)
``<run_dir>/nats.url`` written by ``areal-async run``. With ``--config`` inspect connects
with the run's credentials and TLS settings (``bus.user``/``token``/``creds``/``tls_*``, and
``AREAL_NATS_PASSWORD``/``AREAL_NATS_TOKEN`` from the environment), as a worker does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

import anyio
import msgspec

from areal_async.config import RunConfig, load_config
from areal_async.errors import ConfigError

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


def _resolve(args: argparse.Namespace) -> tuple[str, str, RunConfig | None]:
    run_name = args.run_name
    url = args.url
    cfg = None
    if args.config:
        cfg = load_config(args.config, args.overrides)
        run_name = run_name or cfg.name
        if url is None and cfg.bus.url != "embedded":
            url = cfg.bus.url
        if url is None:
            f = cfg.run_dir / "nats.url"
            if not f.is_file():
                raise ConfigError(
                    f"bus.url is 'embedded' and {f} does not exist: is the run started with "
                    "`areal-async run`? Otherwise pass --url nats://HOST:PORT"
                )
            url = f.read_text().strip()
    if not run_name or not url:
        raise ConfigError("inspect needs --config RUN.yaml, or both --url and --run")
    return url, run_name, cfg


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
    from workers.common import RUN_ENDED_KEY, WEIGHTS_PUBLISHED_KEY, WEIGHTS_SERVED_KEY, unpack_record

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
    for key in (WEIGHTS_PUBLISHED_KEY, WEIGHTS_SERVED_KEY, RUN_ENDED_KEY):
        report["state"][key] = unpack_record(await bus.kv_get("state", key))
    ctrl = unpack_record(await bus.kv_get("state", "controller"))
    if ctrl:
        sch = ctrl.get("scheduler", {})
        report["state"]["controller"] = {
            k: sch.get(k)
            for k in ("issued", "trained", "served_version", "trainer_step", "total_issued", "failures")
        }
    now = time.time()
    for key in await bus.kv_keys("workers"):
        entry = await bus.kv_get("workers", key)
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


async def steps(bus: Any, count: int, as_json: bool, eta: int | None) -> int:
    """Staleness per trained step; exit 1 if a step broke t - eta <= head_version <= t."""
    rows = []
    violations = 0
    for _seq, ev in await _last_messages(bus, "STEPS", count):
        if isinstance(ev, dict):
            continue
        t = ev.policy_version - 1
        stale = [t - h for h in ev.head_versions]
        bad = eta is not None and any(s < 0 or s > eta for s in stale)
        violations += bad
        rows.append(
            {
                "step": ev.step,
                "groups": len(ev.task_ids),
                "staleness_max": max(stale, default=0),
                "staleness_mean": sum(stale) / max(1, len(stale)),
                "reward_mean": ev.metrics.get("reward_mean"),
                "invariant_ok": not bad,
            }
        )
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    else:
        sys.stdout.write(
            f"{'step':>5} {'groups':>6} {'stale max':>9} {'stale mean':>10} {'reward':>7}  invariant\n"
        )
        for r in rows:
            reward = r["reward_mean"] if r["reward_mean"] is not None else float("nan")
            sys.stdout.write(
                f"{r['step']:>5} {r['groups']:>6} {r['staleness_max']:>9} {r['staleness_mean']:>10.2f} "
                f"{reward:>7.3f}  {'ok' if r['invariant_ok'] else 'VIOLATED'}\n"
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


async def tail(bus: Any, subject: str, count: int) -> int:
    full = subject if subject.startswith(bus.subjects.prefix) else bus.subjects.prefix + subject
    spec = bus.subjects.stream_for_subject(full)
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
    from bus.client import ConnectOptions, connect
    from workers.runtime import connect_options

    url, run_name, cfg = _resolve(args)
    if cfg is not None:  # the run's user, creds, TLS and environment secrets
        options = connect_options(dataclasses.replace(cfg.bus, url=url), name="inspect")
    else:
        options = ConnectOptions(url=url, name="inspect")
    bus = await connect(dataclasses.replace(options, connect_timeout=5.0), run_name)
    try:
        if args.what == "summary":
            return await summary(bus, args.json)
        if args.what == "steps":
            eta = cfg.rollout.max_staleness if cfg is not None else None
            return await steps(bus, args.count, args.json, eta)
        if args.what == "deadletter":
            return await deadletters(bus, args.count, args.json)
        if args.what == "tail":
            if not args.subject:
                raise ConfigError(
                    "inspect tail needs a SUBJECT, e.g. `inspect --config RUN.yaml tail trainer.step`"
                )
            return await tail(bus, args.subject, args.count)
    finally:
        await bus.close()
    return 2


def inspect_main(args: argparse.Namespace) -> int:
    return anyio.run(_inspect, args, backend="asyncio")
