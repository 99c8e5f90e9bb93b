"""Policy versions through the run's JetStream object store (``weight_sync.transport: bus``).

Layout. The bucket ``areal_<run>_weights`` (``Subjects.weights_bucket``) holds a fixed ring of
objects in the NATS object store format (chunks on ``$O.<bucket>.C.<slot>``, the object's info
on ``$O.<bucket>.M.<base64url slot>``): ``anchor-0`` and ``anchor-1``, the two newest anchors,
and ``delta-0`` ... ``delta-<D-1>``, the newest deltas (``delta_slots``). Each object's
``metadata["areal-record"]`` is its ``Record``: the policy version, anchor or delta, the base
it applies to (version and digest), the version's sha256, its manifest, and one sha256 per chunk.

Writer (trainer, ``BusWeightWriter.write``, before ``weights.published`` names the version):
version v is an anchor when the writer holds no previous version (a new or restarted trainer)
or ``weight_sync.anchor_every`` versions passed since the last one; every version the writer can
diff also gets a delta (at an anchor version too, so the chain from the older anchor stays
whole: the fallback when the newest anchor is damaged). An object's first chunk carries
``Nats-Rollup: sub``, which drops the slot's previous chunks; its info is written last (rollup
too), so a reader sees the old object or the whole new one, never a mix it would accept.

Retention is the ring: the bucket holds at most 2 anchors and D deltas, whatever the length of
the run. D = 2 * anchor_every + max_staleness + 2 keeps every version from the older anchor on,
which covers a joining engine (the newest anchor and the deltas after it), the fallback to the
older anchor, and an engine lagging by up to max_staleness versions (the deltas since its own).
A restarted trainer writes an anchor of its checkpoint's version first, so nothing older is
needed for a resume. Nothing is deleted, so no role needs purge rights: only the trainer writes
the bucket; the generation role may only read it (``bus/role_permissions.py``).

Reader (generation, ``BusWeightReader.fetch``): read every slot's record (one direct get each),
plan the chain to the target version (its newest record's digest): deltas back to the version
the reader holds when it can, else back to an anchor. Each object is read through an ephemeral
pull consumer; every chunk is checked against its digest, the rebuilt version against the
version digest. A failed object is logged with the reason, its slot excluded, and the chain
planned again (the older anchor); with no chain left ``BusWeightsUnavailable`` sends the caller
to the disk copy. Nothing unverified is returned. A vLLM engine's servers get the rebuilt
version from the generation worker in memory (``ServerRelay``, ``workers/weight_memory.py``).

JetStream requests that time out or get 503 while the bucket's stream has no leader are retried
for up to the connection's ``leader_wait_s`` (``bus.elections``); a put is made again whole.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import nats.errors
import nats.js.errors
import numpy as np
import structlog
import torch
from nats.js import api

from areal_async import weight_codec as codec
from areal_async.config import RunConfig
from areal_async.weight_buckets import (
    decode_manifest,
    encode_manifest,
    manifest_of,
    pack,
    plan_buckets,
    unpack,
)
from bus import Bus
from bus.elections import while_leaderless

log = structlog.get_logger()

RECORD_KEY = "areal-record"
ANCHOR_SLOTS = ("anchor-0", "anchor-1")
HEADROOM = 4096
"""Bytes of a chunk message left for headers under the server's max_payload."""

FETCH_BATCH = 16
"""Chunks asked for per pull request."""


class BusWeightsUnavailable(RuntimeError):
    """No verified chain to the version: the caller loads the disk copy (the message says why)."""


class ObjectRefused(BusWeightsUnavailable):
    """One stored object failed its checks; the reader plans around its slot."""

    def __init__(self, slot: str, reason: str) -> None:
        super().__init__(reason)
        self.slot = slot


def delta_slots(cfg: RunConfig) -> int:
    """D: deltas the bucket keeps (module docstring)."""
    return 2 * cfg.weight_sync.anchor_every + cfg.rollout.max_staleness + 2


def slot_names(cfg: RunConfig) -> tuple[str, ...]:
    """Every object of the ring: the anchor slots, then ``delta-<i>`` for i < D."""
    return (*ANCHOR_SLOTS, *(f"delta-{i}" for i in range(delta_slots(cfg))))


@dataclass(frozen=True)
class Record:
    """One stored object: a version's anchor or its delta against ``base_version``."""

    policy_version: int
    kind: str
    digest: str
    size: int
    word_bytes: int
    manifest: list[list[Any]]
    chunks: list[str]
    payload_bytes: int
    seq: int
    """Write order, across trainer restarts: the newest record of a version wins."""
    base_version: int = -1
    base_digest: str = ""
    slot: str = field(default="", compare=False)

    def to_json(self) -> str:
        body = asdict(self)
        del body["slot"]
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def from_info(cls, slot: str, info: dict[str, Any]) -> Record:
        body = json.loads((info.get("metadata") or {})[RECORD_KEY])
        return cls(**body, slot=slot)


def chunk_subject(bucket: str, slot: str) -> str:
    return f"$O.{bucket}.C.{slot}"


def meta_subject(bucket: str, slot: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(slot.encode()).decode()}"


def plan_chain(records: list[Record], target: int, held: tuple[int, str] | None = None) -> list[Record]:
    """The objects that rebuild ``target`` (its newest record's content), in apply order: deltas
    from ``held`` (version, digest) when they reach it, else from an anchor. [] when ``held`` is
    the target already. ``BusWeightsUnavailable`` when no chain is whole."""
    newest = max((r for r in records if r.policy_version == target), key=lambda r: r.seq, default=None)
    if newest is None:
        raise BusWeightsUnavailable(f"the bucket holds no record of version {target}")

    def find(kind: str, version: int, digest: str) -> Record | None:
        same = [r for r in records if r.kind == kind and (r.policy_version, r.digest) == (version, digest)]
        return max(same, key=lambda r: r.seq, default=None)

    want = (target, newest.digest)
    if held is not None:
        chain: list[Record] = []
        step = want
        while step != held and len(chain) <= len(records):
            delta = find("delta", *step)
            if delta is None:
                break
            chain.append(delta)
            step = (delta.base_version, delta.base_digest)
        if step == held:
            return chain[::-1]
    chain, step = [], want
    while len(chain) <= len(records):
        anchor = find("anchor", *step)
        if anchor is not None:
            return [anchor, *chain[::-1]]
        delta = find("delta", *step)
        if delta is None:
            break
        chain.append(delta)
        step = (delta.base_version, delta.base_digest)
    raise BusWeightsUnavailable(
        f"no whole chain to version {target}: version {step[0]} (digest {step[1][:12]}) is in no anchor or delta"
    )


class BusStore:
    """Object reads and writes in the run's weights bucket (the layout of the module docstring)."""

    def __init__(self, bus: Bus, slots: tuple[str, ...]) -> None:
        self.bus = bus
        self.bucket = bus.subjects.weights_bucket
        self.stream = bus.subjects.weights_stream
        self.slots = slots

    async def records(self) -> list[Record]:
        """Every slot's current record (slots never written, or unreadable, are left out)."""
        out = []
        for slot in self.slots:
            subject = meta_subject(self.bucket, slot)
            try:
                msg = await while_leaderless(
                    self.bus,
                    f"the record of {slot} in {self.bucket}",
                    lambda subject=subject: self.bus.js.get_last_msg(self.stream, subject, direct=True),
                )
                info = json.loads(msg.data or b"{}")
                if not info.get("deleted"):
                    out.append(Record.from_info(slot, info))
            except nats.js.errors.NotFoundError:
                continue
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("weights bucket: unreadable record skipped", slot=slot, error=repr(exc))
        return out

    async def put(self, slot: str, payload: bytes, record: Record, chunk_bytes: int) -> None:
        """Write ``payload`` into ``slot``: chunks (the first drops the slot's previous ones), then
        its info. ValueError, before anything is written, when the info (which holds a digest per
        chunk) would not fit the server's max_payload."""
        whole = base64.urlsafe_b64encode(hashlib.sha256(payload).digest()).decode()
        info = {
            "name": slot,
            "bucket": self.bucket,
            "nuid": slot,
            "size": len(payload),
            "mtime": datetime.datetime.now(datetime.UTC).isoformat(),
            "chunks": len(record.chunks),
            "digest": f"SHA-256={whole}",
            "options": {"max_chunk_size": chunk_bytes},
            "metadata": {RECORD_KEY: record.to_json()},
        }
        meta = json.dumps(info).encode()
        if len(meta) > self.bus.nc.max_payload - HEADROOM:
            raise ValueError(
                f"the record of {slot} (version {record.policy_version}, {len(record.chunks)} chunks) is "
                f"{len(meta)} bytes, over the server's max_payload ({self.bus.nc.max_payload}); raise "
                "weight_sync.chunk_kb (fewer chunks) or the server's max_payload"
            )
        subject = chunk_subject(self.bucket, slot)
        for i, start in enumerate(range(0, max(len(payload), 1), chunk_bytes)):
            headers = {"Nats-Rollup": "sub"} if i == 0 else None
            with self.bus.refusable(subject):
                await self.bus.js.publish(subject, payload[start : start + chunk_bytes], headers=headers)
        subject = meta_subject(self.bucket, slot)
        with self.bus.refusable(subject):
            await self.bus.js.publish(subject, meta, headers={"Nats-Rollup": "sub"})

    async def get(self, record: Record, timeout_s: float) -> bytes:
        """The object in ``record.slot``, every chunk checked against the record; ``BusWeightsUnavailable``
        naming the first chunk that differs, is missing or does not arrive within ``timeout_s``."""
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.ALL,
            inactive_threshold=max(5.0, timeout_s),
            mem_storage=True,
        )
        subject = chunk_subject(self.bucket, record.slot)
        sub = await while_leaderless(
            self.bus,
            f"a reader of {record.slot} in {self.bucket}",
            lambda: self.bus.js.pull_subscribe(subject, stream=self.stream, config=config),
        )
        parts: list[bytes] = []
        try:
            with anyio.fail_after(timeout_s):
                while len(parts) < len(record.chunks):
                    batch = min(FETCH_BATCH, len(record.chunks) - len(parts))
                    for msg in await sub.fetch(batch, timeout=timeout_s):
                        i = len(parts)
                        if i >= len(record.chunks):
                            raise BusWeightsUnavailable(f"{record.slot} holds more chunks than its record")
                        if hashlib.sha256(msg.data).hexdigest() != record.chunks[i]:
                            raise BusWeightsUnavailable(
                                f"chunk {i} of {record.slot} (version {record.policy_version} {record.kind}) "
                                "differs from its digest"
                            )
                        parts.append(msg.data)
        except (TimeoutError, nats.errors.TimeoutError):
            raise BusWeightsUnavailable(
                f"{record.slot} (version {record.policy_version} {record.kind}): chunks missing after {timeout_s} s"
            ) from None
        finally:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass
        payload = b"".join(parts)
        if len(payload) != record.payload_bytes:
            raise BusWeightsUnavailable(
                f"{record.slot} holds {len(payload)} bytes, its record {record.payload_bytes}"
            )
        return payload


def flatten(tensors: dict[str, torch.Tensor]) -> tuple[np.ndarray, list[list[Any]], int]:
    """A version's tensors packed in name order: bytes, manifest (encoded), codec word width."""
    manifest = manifest_of(tensors)
    (bucket,) = plan_buckets(manifest, None)
    flat = pack(bucket, tensors, "cpu").numpy()
    word_bytes = codec.word_bytes_of(t.element_size() for t in tensors.values())
    return flat, encode_manifest(manifest), word_bytes


def tensors_of(flat: np.ndarray, manifest: list[list[Any]]) -> dict[str, torch.Tensor]:
    """Views of a version's tensors inside its packed bytes."""
    (bucket,) = plan_buckets(decode_manifest(manifest), None)
    return unpack(bucket, torch.from_numpy(flat))


@dataclass
class Held:
    """The version a writer diffs against, or a reader applies deltas to."""

    policy_version: int
    digest: str
    flat: np.ndarray
    manifest: list[list[Any]]

    def packed(self) -> torch.Tensor:
        """``flat`` as a 1-D uint8 tensor (the same memory)."""
        return torch.from_numpy(self.flat)


class BusWeightWriter:
    """The trainer's side: ``write(version, tensors)`` stores the version before it is announced."""

    def __init__(self, cfg: RunConfig, bus: Bus) -> None:
        self.cfg = cfg
        self.bus = bus
        self.anchor_every = cfg.weight_sync.anchor_every
        self.deltas = delta_slots(cfg)
        self.store = BusStore(bus, slot_names(cfg))
        self.chunk_bytes = cfg.weight_sync.chunk_kb * 1024
        self.held: Held | None = None
        self.since_anchor = 0
        self.seq: int | None = None
        self.anchor_slot = 0

    async def _start(self) -> None:
        """Continue the write order of an earlier trainer; the next anchor replaces the older one."""
        room = self.bus.nc.max_payload - HEADROOM
        if self.chunk_bytes > room:
            raise ValueError(
                f"weight_sync.chunk_kb ({self.cfg.weight_sync.chunk_kb}) does not fit the server's "
                f"max_payload ({self.bus.nc.max_payload} bytes) with {HEADROOM} bytes to spare; "
                f"lower chunk_kb to at most {room // 1024}"
            )
        records = await self.store.records()
        self.seq = max((r.seq for r in records), default=-1) + 1
        anchors = {r.slot: r.seq for r in records if r.kind == "anchor"}
        self.anchor_slot = min(range(len(ANCHOR_SLOTS)), key=lambda i: anchors.get(ANCHOR_SLOTS[i], -1))

    async def write(self, version: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Store ``version`` (its delta, and its anchor when one is due); returns what was written
        (``digest``, ``anchor_bytes``, ``delta_bytes``, ``encode_s``, ``write_s``) for the log."""
        if self.seq is None:
            await self._start()
        t0 = time.perf_counter()
        flat, manifest, word_bytes = await anyio.to_thread.run_sync(flatten, tensors)
        digest = await anyio.to_thread.run_sync(codec.version_digest, flat)
        base = self.held if self.held is not None and self.held.flat.size == flat.size else None
        anchor_due = base is None or self.since_anchor + 1 >= self.anchor_every
        objects: list[tuple[str, bytes, str, Held | None]] = []
        if base is not None:
            payload = await anyio.to_thread.run_sync(codec.encode_delta, flat, base.flat, word_bytes)
            objects.append((f"delta-{version % self.deltas}", payload, "delta", base))
        if anchor_due:
            payload = await anyio.to_thread.run_sync(codec.encode_anchor, flat, word_bytes)
            objects.append((ANCHOR_SLOTS[self.anchor_slot], payload, "anchor", None))
        encode_s = time.perf_counter() - t0
        sizes = {"anchor_bytes": 0, "delta_bytes": 0}
        for slot, payload, kind, based_on in objects:
            assert self.seq is not None
            record = Record(
                policy_version=version,
                kind=kind,
                digest=digest,
                size=int(flat.size),
                word_bytes=word_bytes,
                manifest=manifest,
                chunks=codec.piece_digests(payload, self.chunk_bytes),
                payload_bytes=len(payload),
                seq=self.seq,
                base_version=based_on.policy_version if based_on else -1,
                base_digest=based_on.digest if based_on else "",
            )
            self.seq += 1
            # A put that an election interrupts is made again from its first chunk, whose rollup
            # drops whatever part of it was stored.
            await while_leaderless(
                self.bus,
                f"{slot} of {self.store.bucket}",
                lambda slot=slot, payload=payload, record=record: self.store.put(
                    slot, payload, record, self.chunk_bytes
                ),
            )
            sizes[f"{kind}_bytes"] = len(payload)
        if anchor_due:
            self.anchor_slot = (self.anchor_slot + 1) % len(ANCHOR_SLOTS)
            self.since_anchor = 0
        else:
            self.since_anchor += 1
        self.held = Held(version, digest, flat, manifest)
        return {
            "digest": digest,
            "bytes": int(flat.size),
            **sizes,
            "encode_s": round(encode_s, 4),
            "write_s": round(time.perf_counter() - t0 - encode_s, 4),
        }


class BusWeightReader:
    """A generation worker's side: ``fetch(version)`` rebuilds and verifies a stored version."""

    def __init__(self, cfg: RunConfig, bus: Bus) -> None:
        self.store = BusStore(bus, slot_names(cfg))
        self.timeout_s = cfg.weight_sync.transfer_timeout_s
        self.held: Held | None = None

    async def fetch(self, version: int) -> tuple[dict[str, torch.Tensor], str]:
        """``version``'s tensors (views of one buffer this reader keeps to apply the next deltas
        to) and its digest, or ``BusWeightsUnavailable`` saying why not."""
        failed: set[str] = set()
        reasons: list[str] = []
        while True:
            records = [r for r in await self.store.records() if r.slot not in failed]
            held = (self.held.policy_version, self.held.digest) if self.held else None
            try:
                chain = plan_chain(records, version, held)
            except BusWeightsUnavailable as exc:
                raise BusWeightsUnavailable("; ".join([*reasons, str(exc)])) from None
            try:
                self.held = await self._rebuild(chain)
            except ObjectRefused as exc:
                failed.add(exc.slot)
                reasons.append(str(exc))
                log.warning(
                    "weights bucket object refused; planning around it", slot=exc.slot, reason=str(exc)
                )
                continue
            return tensors_of(self.held.flat, self.held.manifest), self.held.digest

    async def _rebuild(self, chain: list[Record]) -> Held:
        """Apply ``chain`` (to the held version when it starts with a delta). Each object is
        fetched (every chunk checked as it arrives) while the one before it decodes; only the
        rebuilt target's digest is computed. If it differs, the chain is applied again checking
        each step's digest, to name the object that went wrong."""
        if not chain:
            assert self.held is not None
            return self.held
        start = self.held.flat if self.held is not None and chain[0].kind == "delta" else None
        payloads: list[bytes | BaseException | None] = [None] * len(chain)
        arrived = [anyio.Event() for _ in chain]

        async def fetch(i: int) -> None:
            try:
                payloads[i] = await self.store.get(chain[i], self.timeout_s)
            except BusWeightsUnavailable as exc:
                payloads[i] = exc
            arrived[i].set()

        async def payload(i: int) -> bytes:
            await arrived[i].wait()
            got = payloads[i]
            if isinstance(got, BaseException):
                raise ObjectRefused(chain[i].slot, str(got))
            assert got is not None
            return got

        refused: ObjectRefused | None = None
        flat = start
        async with anyio.create_task_group() as tg:
            tg.start_soon(fetch, 0)
            try:
                for i, record in enumerate(chain):
                    if i + 1 < len(chain):  # the next object arrives while this one decodes
                        tg.start_soon(fetch, i + 1)
                    flat = await self._apply(record, await payload(i), flat)
            except ObjectRefused as exc:  # raised outside the group: the other fetches are stopped
                refused = exc
                tg.cancel_scope.cancel()
        if refused is not None:
            raise refused
        last = chain[-1]
        assert flat is not None
        if (digest := await anyio.to_thread.run_sync(codec.version_digest, flat)) != last.digest:
            if len(chain) == 1:
                raise ObjectRefused(last.slot, self._wrong_digest(last, digest))
            flat = start
            for i, record in enumerate(chain):  # step by step, to name the object
                flat = await self._apply(record, await payload(i), flat)
                if (digest := await anyio.to_thread.run_sync(codec.version_digest, flat)) != record.digest:
                    raise ObjectRefused(record.slot, self._wrong_digest(record, digest))
        assert flat is not None
        return Held(last.policy_version, last.digest, flat, last.manifest)

    @staticmethod
    async def _apply(record: Record, payload: bytes, flat: np.ndarray | None) -> np.ndarray:
        """``record``'s object decoded (an anchor) or applied to ``flat`` (a delta)."""
        try:
            if record.kind == "anchor":
                return await anyio.to_thread.run_sync(
                    codec.decode_anchor, payload, record.size, record.word_bytes
                )
            assert flat is not None
            return await anyio.to_thread.run_sync(codec.apply_delta, flat, payload, record.word_bytes)
        except codec.CodecError as exc:
            raise ObjectRefused(record.slot, str(exc)) from None

    @staticmethod
    def _wrong_digest(record: Record, digest: str) -> str:
        return (
            f"version {record.policy_version} rebuilt through {record.slot} has digest "
            f"{digest[:12]}, its record says {record.digest[:12]}"
        )
