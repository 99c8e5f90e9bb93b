"""Shared run state: the run's latest-value facts, one home for their keys, records and readers.

A fact every role may need after a restart or a lost event (which weights were published, which are
served, that the run ended, which tasks the controller issued) lives under one key of the run's
``state`` KV bucket (docs/design.md section 7). Each is written with ``RunState.record``; a fact that is
also announced as a core-NATS event goes out with ``RunState.record_then_publish`` (key first, so the
key is never older than an event a reader has seen). A reader that acts on such an event also follows
``RunState.latest(key)``, which re-reads the key every ``every_s`` seconds and yields each new revision
once: a lost event delays it by at most ``every_s``. Reads ride out reconnects and JetStream leader
elections (a read that fails with ``StreamUnavailable`` is retried at the next tick).

Records are msgpack maps of plain fields. ``IssuedTask`` records (``issued.<task_id>``) are written by
the controller before it publishes a task; the trainer trains a group only if its task id, attempt,
kind and index match one (docs/design.md section 8).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import anyio
import msgpack

from bus.errors import StreamUnavailable
from bus.subjects import RUN_ENDED, WEIGHTS_PUBLISHED, WEIGHTS_SERVED, Buckets  # noqa: F401  (state keys)

if TYPE_CHECKING:
    from bus.client import Bus

# A fact that is also announced as an event is kept under its event's subject suffix:
# WEIGHTS_PUBLISHED {policy_version, path}: the newest version the trainer wrote (the trainer);
# WEIGHTS_SERVED {policy_version, path}: the version every live engine serves (weight-sync);
# RUN_ENDED {reason, policy_version}: the run is over (the controller).

CONTROLLER = "controller"
"""The controller's whole state (scheduler, dataset cursor, evaluation rounds)."""

ISSUED_PREFIX = "issued."
"""``issued.<task_id>``: an ``IssuedTask`` per task the controller issued (latest attempt)."""


class StateRecordError(ValueError):
    """A state record that does not hold what its key promises (corrupt or forged)."""


def pack(**fields: Any) -> bytes:
    return msgpack.packb(fields)


def unpack(entry: Any) -> dict[str, Any] | None:
    """The map stored in a KV entry (``bus.kv_get`` result or raw bytes), or None when absent.

    Raises StateRecordError when the bytes are not a msgpack map.
    """
    raw = getattr(entry, "value", entry)
    if raw is None:
        return None
    try:
        data = msgpack.unpackb(raw)
    except Exception as exc:
        raise StateRecordError(f"not a msgpack map ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise StateRecordError(f"expected a map, found {type(data).__name__}")
    return data


def _int(data: Mapping[str, Any], name: str, *, low: int = 0) -> int:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise StateRecordError(f"field {name!r} must be an integer >= {low}, found {value!r}")
    return value


def _str(data: Mapping[str, Any], name: str, *, max_len: int = 4096) -> str:
    value = data.get(name)
    if not isinstance(value, str) or len(value) > max_len:
        raise StateRecordError(
            f"field {name!r} must be a string of at most {max_len} chars, found {value!r:.80}"
        )
    return value


@dataclass(frozen=True)
class WeightsVersion:
    """``weights.published`` / ``weights.served``: a policy version and the directory holding it."""

    policy_version: int
    path: str

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> WeightsVersion:
        return cls(policy_version=_int(data, "policy_version"), path=_str(data, "path"))


@dataclass(frozen=True)
class RunEnd:
    reason: str
    policy_version: int

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> RunEnd:
        return cls(reason=_str(data, "reason", max_len=200), policy_version=_int(data, "policy_version"))


@dataclass(frozen=True)
class IssuedTask:
    """What the controller issued under one task id: its kind, dataset position and latest attempt."""

    task_id: str
    kind: str
    epoch: int
    index: int
    attempt: int

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> IssuedTask:
        kind = _str(data, "kind", max_len=16)
        if kind not in ("train", "eval"):
            raise StateRecordError(f"field 'kind' must be 'train' or 'eval', found {kind!r}")
        return cls(
            task_id=_str(data, "task_id", max_len=200),
            kind=kind,
            epoch=_int(data, "epoch"),
            index=_int(data, "index"),
            attempt=_int(data, "attempt"),
        )

    def mismatch(self, *, task_id: str, kind: str, epoch: int, index: int, attempt: int) -> str:
        """'' when an event's fields name this issue exactly; else which field differs."""
        for name, got in (
            ("task_id", task_id),
            ("kind", kind),
            ("epoch", epoch),
            ("index", index),
            ("attempt", attempt),
        ):
            want = getattr(self, name)
            if got != want:
                return f"{name} {got!r} differs from the issued {want!r}"
        return ""


def issued_key(task_id: str) -> str:
    return ISSUED_PREFIX + task_id


def finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


class RunState:
    """The run's ``state`` bucket, through one bus connection."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def get(self, key: str) -> dict[str, Any] | None:
        """The record under ``key``; None when absent. StateRecordError when it is not a map."""
        return unpack(await self.bus.kv_get(Buckets.STATE, key))

    async def record(self, key: str, **fields: Any) -> int:
        return await self.bus.kv_put(Buckets.STATE, key, pack(**fields))

    async def record_then_publish(
        self,
        key: str,
        fields: Mapping[str, Any],
        subject: str,
        event: Any,
        *,
        policy_version: int | None = None,
    ) -> None:
        """Write the record, then announce it: a reader never sees an event newer than the key."""
        await self.record(key, **fields)
        await self.bus.publish(subject, event, policy_version=policy_version)

    async def weights(self, key: str) -> WeightsVersion | None:
        data = await self.get(key)
        return None if data is None else WeightsVersion.parse(data)

    async def run_end(self) -> RunEnd | None:
        data = await self.get(RUN_ENDED)
        return None if data is None else RunEnd.parse(data)

    async def issue(self, task: IssuedTask) -> None:
        await self.record(issued_key(task.task_id), **asdict(task))

    async def issued(self, task_id: str) -> IssuedTask | None:
        """The controller's record of ``task_id``; None when it never issued it (or the key is unusable)."""
        if not task_id or len(task_id) > 200 or any(c in task_id for c in " *>\t\r\n"):
            return None
        try:
            data = await self.get(issued_key(task_id))
        except ValueError:  # a key the server refuses, or a record that is not a map
            return None
        if data is None:
            return None
        try:
            return IssuedTask.parse(data)
        except StateRecordError:
            return None

    async def latest(self, key: str, every_s: float) -> AsyncIterator[dict[str, Any] | None]:
        """Each new revision of ``key``'s record (the current one first), polled every ``every_s``.

        Survives reconnects and leader changes: a failed read is retried at the next tick. A record
        that is not a map is yielded as None (the key is unusable; writers overwrite it).
        """
        seen: int | None = -1
        while True:
            try:
                entry = await self.bus.kv_get(Buckets.STATE, key)
            except StreamUnavailable:
                entry = False
            if entry is not False:
                revision = None if entry is None else entry.revision
                if revision != seen:
                    seen = revision
                    try:
                        yield unpack(entry)
                    except StateRecordError:
                        yield None
            await anyio.sleep(every_s)
