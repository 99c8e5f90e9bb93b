"""``Bus``: one worker's NATS connection, bound to one run: publish, consume, subscribe, KV.

Create it with ``await connect(options, run)`` (``bus.connection``) and create the run's
streams with ``await bus.provision()`` (``bus.provision``). Contract:

* ``publish()`` sends stream subjects through JetStream (stored, acked by the server,
  deduplicated by ``msg_id``) and the rest through core NATS (at most once). A payload that
  would not fit (body + headers > server max_payload - 1 KiB, or > the stream's
  max_msg_size) is refused *before* sending with ``PayloadTooLarge`` (``bus.payload``).
* A stream without a leader (a JetStream election, 6-8 s after its leader node dies) pauses
  ``publish()``, ``Consumer.start()``, consumer iteration, provisioning and the KV calls
  (get, put, delete, keys); they retry for up to ``options.leader_wait_s`` (30 s) and then
  raise ``StreamUnavailable`` (``bus.elections``). ``publish()`` retries only what cannot be
  stored twice: a request no stream answered, or, with a ``msg_id`` (dedup), one that timed out.
* A JetStream publish or KV write the server refuses for permissions raises
  ``BusPermissionError`` at once (``bus.refusals``); every refusal, also of core publishes,
  is logged (``nats permission denied``) and counted in ``bus.stats['permission_denied']``.
  The connection stays up.
* ``consume()`` yields ``Delivery`` objects from a stream's durable pull consumer and
  ``subscribe()`` yields events from a core subject (``bus.iterators``). A payload that fails
  to decode or validate never reaches the caller: it is copied to ``deadletter`` (with the
  reason and the raw bytes, truncated with a note if too large), removed (acked), counted in
  ``bus.stats['deadletter']``, and the iterator goes on. A worker whose handling of a decoded
  event raises does the same with ``Delivery.dead_letter(reason)`` (the poison-message rule).

Exactly-once-ish processing (at-least-once delivery + dedup), the pattern every worker uses::

    async with bus.consume("PROMPT") as deliveries:
        async for d in deliveries:
            result = await work(d.event)                       # d.in_progress() if slow
            await bus.publish(subjects.rollout_generated, result,
                              msg_id=f"{d.event.task_id}:{d.event.attempt}")
            await d.ack()                                      # only after the result is stored

A crash between publish and ack redelivers the task (after ack_wait); the re-published result
carries the same msg_id and is dropped by the stream's duplicate window (``provision``'s
``duplicate_window`` must exceed ack_wait plus the time to redo the work). Readers of the
result still tolerate rare duplicates (dedup by task id).

Errors are the ``BusError`` tree of ``bus.errors``.
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

import anyio
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from bus.elections import ERR_CLUSTER_NOT_AVAILABLE, LEADERLESS, no_leader, while_leaderless
from bus.errors import KvConflict, NoResponders, PayloadTooLarge, StreamFull, StreamNotFound
from bus.events import DeadLetter, DecodeError, Event, decode, encode, expected_type, headers_for
from bus.iterators import (
    BusIterator,
    Consumer,
    Delivery,
    KvEntry,
    KvWatch,
    Requests,
    Subscription,
    dead_letter_id,
)
from bus.payload import (
    PAYLOAD_MARGIN,
    check_payload,
    check_stream_limit,
    fit_dead_letter,
    fmt_bytes,
    header_bytes,
    shrink_hint,
)
from bus.provision import provision_run
from bus.refusals import Refusals
from bus.subjects import Streams, StreamSpec, Subjects, subject_suffix

if TYPE_CHECKING:
    from bus.options import ConnectOptions

log = structlog.get_logger()

T = TypeVar("T")

ERR_STORE_FAILED = 10077  # e.g. maximum messages/bytes exceeded under DiscardPolicy.NEW
ERR_MESSAGE_TOO_LARGE = 10054


@dataclass(frozen=True)
class Published:
    """JetStream's acknowledgement of a stored message."""

    stream: str
    seq: int
    duplicate: bool
    """True when the msg_id was seen within the duplicate window and nothing was stored."""


class Bus:
    """One worker's connection, bound to one run. Create with ``await connect(...)``."""

    def __init__(self, nc: NATS, run: str, options: ConnectOptions) -> None:
        self.nc = nc
        self.run = run
        self.subjects = Subjects(run)
        self.options = options
        self.js: JetStreamContext = nc.jetstream(timeout=options.request_timeout_s)
        self.worker_id = options.name or f"{socket.gethostname()}-{os.getpid()}"
        self.stats: Counter[str] = Counter()
        """published, consumed, deadletter, deadletter_lost, permission_denied, publish_retries;
        publish_s (wall seconds while any publish or request was in flight: concurrent ones count
        once) and decode_s (seconds spent decoding)."""
        self._in_flight = 0
        self._in_flight_since = 0.0
        self._max_msg_size: dict[str, int] = {}
        self._kv: dict[str, KeyValue] = {}
        self.open_iterators: set[BusIterator[Any]] = set()
        """Consumers, subscriptions and watches started and not yet closed; ``close()`` closes them."""
        self.held = 0
        """Deliveries handed out and not yet acked, nak'd or termed (heartbeats report it)."""
        self._refusals = Refusals(options.user)

    def __repr__(self) -> str:
        return f"Bus(run={self.run!r}, url={self.nc.connected_url.geturl() if self.nc.connected_url else None!r})"

    provision = provision_run  # bus.provision: streams, consumers, KV buckets

    def refusable(self, subject: str) -> AbstractContextManager[None]:
        """A block whose JetStream request to ``subject`` raises ``BusPermissionError`` at once
        when the server refuses it (for requests made on ``js`` directly)."""
        return self._refusals.raises(subject)

    def permission_denied(self, subject: str) -> None:
        """The server refused ``subject`` (lowercased): fail the requests waiting on it now."""
        self.stats["permission_denied"] += 1
        self._refusals.deny(subject)

    # -- publishing ---------------------------------------------------------------------------

    @staticmethod
    def _not_provisioned(spec: StreamSpec, subject: str) -> StreamNotFound:
        return StreamNotFound(
            f"stream {spec.name} for {subject} does not exist; call bus.provision() first "
            "(the controller does at start)"
        )

    async def _stream_missing(self, spec: StreamSpec) -> bool:
        """True only when JetStream says the stream does not exist; a leaderless one times out or
        answers 503, which is not "missing"."""
        try:
            await self.js.stream_info(spec.name)
        except nats.js.errors.NotFoundError:
            self._max_msg_size.pop(spec.name, None)
            return True
        except (*LEADERLESS, nats.js.errors.APIError):
            return False
        return False

    def remember_stream_limit(self, stream: str, max_msg_size: int) -> None:
        """Cache ``stream``'s max_msg_size, as provisioning set it."""
        self._max_msg_size[stream] = max_msg_size

    def remember_bucket(self, name: str, kv: KeyValue) -> None:
        """Cache the handle of KV bucket ``name`` (its full name), as provisioning opened it."""
        self._kv[name] = kv

    async def stream_max_msg_size(self, spec: StreamSpec) -> int:
        """The stream's max_msg_size (asked of the server once, then cached)."""
        size = self._max_msg_size.get(spec.name)
        if size is None:
            try:
                info = await while_leaderless(
                    self, f"stream {spec.name}", lambda: self.js.stream_info(spec.name)
                )
            except nats.js.errors.NotFoundError:
                raise self._not_provisioned(spec, spec.subject) from None
            size = info.config.max_msg_size or -1
            self._max_msg_size[spec.name] = size
        return size

    async def publish(
        self,
        subject: str,
        event: Event,
        *,
        msg_id: str | None = None,
        policy_version: int | None = None,
        leader_wait_s: float | None = None,
    ) -> Published | None:
        """Publish ``event``; returns the stream ack for JetStream subjects, None for core ones.

        ``msg_id`` (JetStream only) makes a re-publish within the duplicate window a no-op
        (``Published.duplicate``). While the stream has no leader the publish is retried with
        backoff for up to ``leader_wait_s`` (default options.leader_wait_s), then
        StreamUnavailable: always when no stream answered (nothing was stored), after an ack
        timeout only with a ``msg_id`` (the message may have been stored; the id dedups it).
        Without a ``msg_id`` an ack timeout raises nats' TimeoutError after request_timeout_s.

        Raises PayloadTooLarge (nothing sent), StreamNotFound, StreamUnavailable, StreamFull,
        BusPermissionError (at once, naming the subject), TypeError for an event type the
        subject does not carry.
        """
        with self._publishing():
            return await self._publish(subject, event, msg_id, policy_version, leader_wait_s)

    @contextmanager
    def _publishing(self) -> Iterator[None]:
        """Count the wall time while at least one publish or request is in flight into ``publish_s``."""
        if not self._in_flight:
            self._in_flight_since = time.perf_counter()
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self.stats["publish_s"] += time.perf_counter() - self._in_flight_since

    async def _publish(
        self,
        subject: str,
        event: Event,
        msg_id: str | None,
        policy_version: int | None,
        leader_wait_s: float | None,
    ) -> Published | None:
        suffix = self.subjects.suffix(subject)
        if suffix is None:
            raise ValueError(f"subject {subject!r} is not under {self.subjects.prefix}; use bus.subjects")
        expected = expected_type(subject)
        if expected is not None and not isinstance(event, expected):
            raise TypeError(f"{subject} carries {expected.__name__} events, got {type(event).__name__}")
        payload = encode(event)
        headers = headers_for(event, self.run, policy_version, msg_id)
        spec = self.subjects.stream_for_subject(subject)
        size = len(payload) + header_bytes(headers)
        check_payload(subject, size, self.nc.max_payload)
        if spec is None:
            await self.nc.publish(subject, payload, headers=headers)
            self.stats["published"] += 1
            return None
        check_stream_limit(subject, size, spec.name, await self.stream_max_msg_size(spec))
        try:
            ack = await self._js_publish(subject, spec, payload, headers, msg_id, leader_wait_s)
        except nats.js.errors.APIError as e:
            if e.err_code == ERR_STORE_FAILED:
                raise StreamFull(
                    f"{spec.name} is full ({e.description}); its readers are behind: back off and "
                    "retry, or raise bus.max_stream_bytes"
                ) from e
            if e.err_code == ERR_MESSAGE_TOO_LARGE:
                self._max_msg_size.pop(spec.name, None)
                raise PayloadTooLarge(
                    f"{subject}: {fmt_bytes(len(payload))} refused by stream {spec.name} "
                    f"({e.description}); raise bus.max_msg_bytes or {shrink_hint(subject)}"
                ) from e
            raise
        self.stats["published"] += 1
        return Published(stream=ack.stream, seq=ack.seq, duplicate=bool(ack.duplicate))

    async def _js_publish(
        self,
        subject: str,
        spec: StreamSpec,
        payload: bytes,
        headers: dict[str, str],
        msg_id: str | None,
        leader_wait_s: float | None,
    ) -> api.PubAck:
        """``js.publish`` riding out a leader election (see publish())."""
        budget = self.options.leader_wait_s if leader_wait_s is None else leader_wait_s
        started = time.monotonic()
        delay, retries = 0.05, 0
        while True:
            try:
                with self._refusals.raises(subject):
                    ack = await self.js.publish(subject, payload, headers=headers)
                if retries:
                    log.info(
                        "publish resumed",
                        subject=subject,
                        retries=retries,
                        seconds=round(time.monotonic() - started, 1),
                    )
                return ack
            except (nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError) as e:
                if isinstance(e, nats.js.errors.APIError) and e.err_code not in (
                    None,
                    ERR_CLUSTER_NOT_AVAILABLE,
                ):
                    raise  # a real answer, e.g. the 503 of a full stream (StreamFull)
                error: Exception = e  # refused before storing: a retry cannot store it twice
                if retries == 0 and await self._stream_missing(spec):
                    raise self._not_provisioned(spec, subject) from None
            except TimeoutError as e:
                if msg_id is None:
                    raise  # it may have been stored: without a msg id a retry could store it twice
                error = e
            waited = time.monotonic() - started
            if waited + delay > budget:
                if await self._stream_missing(spec):
                    raise self._not_provisioned(spec, subject) from None
                raise no_leader(self, f"stream {spec.name} ({subject})", waited, error) from error
            if retries == 0:
                log.warning("stream unavailable, retrying publish", subject=subject, error=repr(error))
            retries += 1
            self.stats["publish_retries"] += 1
            await anyio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(1.0, delay * 2)

    async def flush(self) -> None:
        """Wait until the server has everything published so far (a PING/PONG round trip)."""
        await self.nc.flush(timeout=self.options.request_timeout_s)

    # -- consuming ----------------------------------------------------------------------------

    def consume(
        self,
        stream_or_consumer: str,
        *,
        consumer: str | None = None,
        batch: int = 16,
        fetch_timeout: float = 1.0,
    ) -> Consumer:
        """Deliveries from a stream's durable pull consumer.

        ``stream_or_consumer``: a stream key ("PROMPT"), stream name ("AREAL_r1_PROMPT") or
        durable name ("generation"). ``consumer`` overrides the durable (limits streams only,
        e.g. an inspect durable on STEPS, created beforehand). ``batch`` messages are fetched
        at once and wait, unacked, until handed out: keep it small when work is slow. The batch
        is capped so that batch x max_msg_size stays within FETCH_BYTES_BUDGET (16 MiB).
        One task iterates a Consumer; replicas share work through the durable, not the object.
        """
        spec = self.subjects.stream(stream_or_consumer)
        durable = consumer or spec.consumer
        if durable is None:
            raise ValueError(f"stream {spec.name} has no durable consumer; pass consumer=...")
        if consumer is not None and consumer != spec.consumer and spec.retention == "work_queue":
            raise ValueError(
                f"work-queue stream {spec.name} allows only its own consumer {spec.consumer!r}, "
                f"got {consumer!r}"
            )
        return Consumer(self, spec, durable, batch, fetch_timeout)

    async def reclaim(self, stream_or_consumer: str) -> bool:
        """Deliver again, now, every message a work-queue stream's consumer has out unacked.

        For a consumer with one reader at a time (the trainer's), called by a reader that starts
        after its predecessor stopped: killed, crashed, or frozen and replaced. Without it, what
        the predecessor held comes back only when its ``ack_wait`` runs out. It is a JetStream
        consumer reset: the consumer starts again at the stream's first message, and on a
        work-queue stream every message still stored is one nobody acked, so exactly those are
        delivered again (``num_delivered`` restarts at 1). A live reader of the same consumer
        would see its unacked messages delivered twice: never call it beside one.

        Returns False, logged, where the server refuses or lacks the reset (it came with
        nats-server 2.14); the messages then come back after ``ack_wait`` as before.
        """
        spec = self.subjects.stream(stream_or_consumer)
        if spec.retention != "work_queue" or spec.consumer is None:
            raise ValueError(
                f"reclaim needs a work-queue stream with a durable consumer; {spec.name} is "
                f"{spec.retention} with consumer {spec.consumer!r}"
            )
        subject = f"$JS.API.CONSUMER.RESET.{spec.name}.{spec.consumer}"
        try:
            reply = await self.nc.request(subject, b"", timeout=self.options.request_timeout_s)
            error = json.loads(reply.data).get("error")
        except (nats.errors.Error, ValueError) as exc:
            error = repr(exc)
        if error:
            log.warning(
                "consumer reset refused; unacked messages return after ack_wait",
                consumer=spec.consumer,
                stream=spec.name,
                error=error,
            )
            return False
        return True

    async def delivery(self, msg: Msg) -> Delivery | None:
        """The Delivery of a fetched message; None (dead-lettered and acked) if it does not decode."""
        meta = msg.metadata
        started = time.perf_counter()
        try:
            event = decode(msg.data, expected_type(msg.subject))
            self.stats["decode_s"] += time.perf_counter() - started
        except DecodeError as e:
            await self.dead_letter(msg.subject, e.reason, msg.data, msg.headers, msg_id=dead_letter_id(msg))
            await msg.ack()
            return None
        self.stats["consumed"] += 1
        return Delivery(
            event=event,
            subject=msg.subject,
            headers=dict(msg.headers or {}),
            num_delivered=meta.num_delivered,
            stream_seq=meta.sequence.stream,
            msg=msg,
            bus=self,
        )

    async def dead_letter(
        self,
        subject: str,
        reason: str,
        data: bytes,
        headers: Mapping[str, str] | None = None,
        *,
        msg_id: str | None = None,
    ) -> None:
        """Copy a message to the run's ``deadletter`` stream with ``reason``; never raises.

        For what no handler can use: payloads that do not decode (the iterators send them) and
        events whose handling raises (``Delivery.dead_letter``). Data too large to copy whole
        is truncated, with a note in the reason. A copy that cannot be stored is logged (``dead
        letter lost``) and counted in ``stats['deadletter_lost']``; ``msg_id`` dedups copies
        of one message (a redelivery).
        """
        self.stats["deadletter"] += 1
        reason = reason[:2000]
        log.warning("dead letter", subject=subject, reason=reason, size=len(data))
        letter = DeadLetter(
            subject=subject,
            reason=reason,
            data=b"",
            headers={str(k): str(v) for k, v in (headers or {}).items()},
            worker_id=self.worker_id,
            received_at=time.time(),
        )
        try:
            letter = fit_dead_letter(letter, data, await self._dead_letter_limit(), self.run, msg_id)
            await self.publish(self.subjects.deadletter, letter, msg_id=msg_id)
        except Exception as e:  # a dead letter must never stop the worker
            self.stats["deadletter_lost"] += 1
            log.error("dead letter lost", subject=subject, reason=reason, error=repr(e))

    async def _dead_letter_limit(self) -> int:
        """Most bytes a dead letter may take: max_payload less the margin, within the stream's limit."""
        limit = self.nc.max_payload - PAYLOAD_MARGIN
        try:
            stream_limit = await self.stream_max_msg_size(self.subjects.stream(Streams.DEADLETTER))
        except Exception:  # not provisioned or NATS away: publish() reports it
            return limit
        return min(limit, stream_limit) if stream_limit > 0 else limit

    def subscribe(
        self, subject: str, *, queue: str = "", pending_bytes_limit: int = 64 * 2**20
    ) -> Subscription:
        """Decoded events from a core subject; ``queue`` load-balances among members."""
        if subject_suffix(subject) is None or not subject.startswith(self.subjects.prefix):
            raise ValueError(f"subject {subject!r} is not under {self.subjects.prefix}; use bus.subjects")
        if self.subjects.stream_for_subject(subject) is not None:
            log.debug("core subscribe on a stream subject", subject=subject)
        return Subscription(self, subject, queue, pending_bytes_limit)

    def serve(self, subject: str, *, queue: str) -> Requests:
        """Requests on a core subject, each delivered to one member of the ``queue`` group."""
        if not subject.startswith(self.subjects.prefix):
            raise ValueError(f"subject {subject!r} is not under {self.subjects.prefix}; use bus.subjects")
        return Requests(self, subject, queue, 64 * 2**20)

    async def request(self, subject: str, event: Event, *, timeout_s: float) -> Any:
        """Send ``event`` to one member of the subject's queue group and return its decoded reply.

        Raises NoResponders when nobody serves the subject, TimeoutError when no reply came within
        ``timeout_s`` (the server may have died mid-request: retry), DecodeError for a bad reply.
        """
        if not subject.startswith(self.subjects.prefix):
            raise ValueError(f"subject {subject!r} is not under {self.subjects.prefix}; use bus.subjects")
        payload = encode(event)
        headers = headers_for(event, self.run, None, None)
        check_payload(subject, len(payload) + header_bytes(headers), self.nc.max_payload)
        try:
            with self._publishing():
                msg = await self.nc.request(subject, payload, timeout=timeout_s, headers=headers)
        except nats.errors.NoRespondersError:
            raise NoResponders(f"nobody serves {subject}; start a worker that answers it") from None
        except nats.errors.TimeoutError:
            raise TimeoutError(f"no reply on {subject} within {timeout_s:g} s") from None
        self.stats["published"] += 1
        return decode(msg.data)

    # -- key-value ----------------------------------------------------------------------------

    async def bucket(self, bucket: str) -> KeyValue:
        """The handle of the run's KV bucket ``bucket`` (its short name), opened once."""
        name = self.subjects.bucket(bucket)
        kv = self._kv.get(name)
        if kv is None:
            try:
                kv = await while_leaderless(self, f"KV bucket {name}", lambda: self.js.key_value(name))
            except nats.js.errors.BucketNotFoundError:
                raise StreamNotFound(f"KV bucket {name} does not exist; call bus.provision() first") from None
            self._kv[name] = kv
        return kv

    async def _kv_call(self, bucket: str, call: Callable[[KeyValue], Awaitable[T]]) -> T:
        """``call(kv)`` on the bucket's handle, riding out a leader election (``while_leaderless``)."""
        kv = await self.bucket(bucket)
        return await while_leaderless(self, f"KV bucket {self.subjects.bucket(bucket)}", lambda: call(kv))

    async def kv_get(self, bucket: str, key: str) -> KvEntry | None:
        """The current entry of ``key``; None if absent, deleted or expired."""
        try:
            entry = await self._kv_call(bucket, lambda kv: kv.get(key))
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None or entry.operation in ("DEL", "PURGE"):
            return None  # includes the TTL limit-marker window (value None, no KV-Operation)
        return KvEntry(key=key, value=entry.value, revision=entry.revision or 0, operation="PUT")

    def _kv_subject(self, bucket: str, key: str) -> str:
        return f"$KV.{self.subjects.bucket(bucket)}.{key}"

    async def kv_put(self, bucket: str, key: str, value: bytes) -> int:
        """Write ``value``; returns the new revision. KV writes raise BusPermissionError at once
        when the server refuses them."""
        with self._refusals.raises(self._kv_subject(bucket, key)):
            revision = await self._kv_call(bucket, lambda kv: kv.put(key, value))
        return revision

    async def kv_create(self, bucket: str, key: str, value: bytes) -> int:
        """Write only if ``key`` is absent; KvConflict otherwise."""
        kv = await self.bucket(bucket)
        try:
            with self._refusals.raises(self._kv_subject(bucket, key)):
                revision = await kv.create(key, value)
        except nats.js.errors.KeyWrongLastSequenceError as e:
            raise KvConflict(f"{bucket}/{key} already exists") from e
        return revision

    async def kv_update(self, bucket: str, key: str, value: bytes, *, last: int) -> int:
        """Compare-and-set: write only if ``key``'s revision is still ``last``; KvConflict otherwise."""
        kv = await self.bucket(bucket)
        try:
            with self._refusals.raises(self._kv_subject(bucket, key)):
                revision = await kv.update(key, value, last=last)
        except nats.js.errors.KeyWrongLastSequenceError as e:
            raise KvConflict(f"{bucket}/{key} changed since revision {last}; re-read and retry") from e
        return revision

    async def kv_delete(self, bucket: str, key: str) -> None:
        with self._refusals.raises(self._kv_subject(bucket, key)):
            await self._kv_call(bucket, lambda kv: kv.delete(key))

    async def kv_keys(self, bucket: str) -> list[str]:
        """Keys that currently have a value (deleted and expired keys excluded), sorted."""
        try:
            keys = await self._kv_call(bucket, lambda kv: kv.keys())
        except nats.js.errors.NoKeysError:
            return []
        return sorted(keys)

    def kv_watch(self, bucket: str, key: str = ">") -> KvWatch:
        """Current values of ``key`` (a pattern), then live changes; use ``async with``."""
        return KvWatch(self, bucket, key)

    # -- shutdown -----------------------------------------------------------------------------

    async def close(self) -> None:
        """Close iterators, flush and disconnect; bounded by options.drain_timeout_s."""
        for it in list(self.open_iterators):
            await it.aclose()
        if self.nc.is_closed:
            return
        with anyio.move_on_after(self.options.drain_timeout_s, shield=True):
            try:
                await self.nc.drain()
            except Exception as e:  # e.g. already disconnected; close() below still runs
                log.debug("drain failed", error=repr(e))
        if not self.nc.is_closed:
            await self.nc.close()
        log.info("nats closed", run=self.run, **dict(self.stats))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


__all__ = ["Bus", "Published"]
