"""What a worker receives: ``Delivery`` and the iterators that yield it and other messages.

* ``Consumer`` (from ``bus.consume``) yields ``Delivery`` objects from a stream's durable pull
  consumer; each is settled with exactly one of ack / nak / term / dead_letter.
* ``Subscription`` (from ``bus.subscribe``) yields decoded events from a core subject.
* ``KvWatch`` (from ``bus.kv_watch``) yields ``KvEntry`` values: the current ones, then changes.

All three share one lifecycle (``BusIterator``): ``start()`` subscribes (``async with`` does it
before the body runs, a plain ``async for`` on the first iteration), ``aclose()`` unsubscribes
within 2 s and is idempotent, and ``bus.close()`` closes every iterator still open. A closed
iterator ends (StopAsyncIteration). One task iterates an iterator.

A payload that fails to decode never reaches the caller: it goes to ``deadletter`` (see
``Bus.dead_letter``) and the iterator goes on.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar

import anyio
import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from bus.elections import Connected, while_leaderless
from bus.errors import StreamNotFound
from bus.events import HEADER_POLICY_VERSION, DecodeError, decode, expected_type
from bus.subjects import StreamSpec

log = structlog.get_logger()

Item = TypeVar("Item")

FETCH_BYTES_BUDGET = 16 * 2**20
"""Most bytes one fetch may pull (batch x stream max_msg_size). The server cuts a connection
that has more than max_pending (64 MB) in flight as a slow consumer, so a large batch of large
messages would lose the connection; the batch is capped to fit this budget."""

CLOSE_TIMEOUT_S = 2.0
"""Upper bound of an iterator's aclose(); what is left is dropped with the connection."""


class IteratorHost(Connected, Protocol):
    """What the iterators need of ``bus.client.Bus``: JetStream, the registry of open iterators,
    decoding a fetched message, stream limits, KV handles and dead letters."""

    js: JetStreamContext
    open_iterators: set[BusIterator[Any]]
    held: int

    async def delivery(self, msg: Msg) -> Delivery | None: ...
    async def stream_max_msg_size(self, spec: StreamSpec) -> int: ...
    async def bucket(self, bucket: str) -> KeyValue: ...
    async def dead_letter(
        self,
        subject: str,
        reason: str,
        data: bytes,
        headers: Mapping[str, str] | None = None,
        *,
        msg_id: str | None = None,
    ) -> None: ...


@dataclass(frozen=True)
class KvEntry:
    key: str
    value: bytes | None
    """None for a delete/purge (or a key expired by TTL)."""

    revision: int
    operation: str
    """PUT, DEL or PURGE."""


@dataclass(eq=False)
class Delivery:
    """One validated JetStream message; settle it with exactly one of ack / nak / term / dead_letter."""

    event: Any
    subject: str
    headers: dict[str, str]
    num_delivered: int
    """1 on first delivery; more after a nak, an expired ack_wait or a dead consumer."""

    stream_seq: int
    msg: Msg = field(repr=False)
    bus: IteratorHost = field(repr=False)
    _open: bool = field(default=True, repr=False)

    def __post_init__(self) -> None:
        self.bus.held += 1

    def _settle(self) -> None:
        """Count this delivery out of ``bus.held`` once, whichever settling call comes first."""
        if self._open:
            self._open = False
            self.bus.held -= 1

    @property
    def data(self) -> bytes:
        return self.msg.data

    @property
    def policy_version(self) -> int | None:
        v = self.headers.get(HEADER_POLICY_VERSION)
        return int(v) if v is not None and v.lstrip("-").isdigit() else None

    async def ack(self) -> None:
        """Done: the message is removed from a work-queue stream."""
        await self.msg.ack()
        self._settle()

    async def ack_sync(self) -> None:
        """ack() and wait until the server confirms it (a double ack; bounded by request_timeout_s)."""
        await self.msg.ack_sync(timeout=self.bus.options.request_timeout_s)
        self._settle()

    async def nak(self, delay: float | None = None) -> None:
        """Not done: redeliver (after ``delay`` seconds), possibly to another worker."""
        await self.msg.nak(delay=delay)
        self._settle()

    async def in_progress(self) -> None:
        """Still working: restart this message's ack_wait clock."""
        await self.msg.in_progress()

    async def term(self) -> None:
        """Never redeliver (poison). Prefer publishing RolloutFailed and ack()."""
        await self.msg.term()
        self._settle()

    async def dead_letter(self, reason: str) -> None:
        """Poison: copy this message (raw data, subject, headers) to ``deadletter`` with
        ``reason``, then ack it so that it is never redelivered.

        For an event that decodes but whose handling raises (``reason``: the exception text).
        The copy never raises (see ``Bus.dead_letter``); the ack raises like ``ack()``. A crash
        between copy and ack redelivers the message; its second copy is dropped as a duplicate
        (within the stream's duplicate_window).
        """
        await self.bus.dead_letter(
            self.subject, reason, self.msg.data, self.headers, msg_id=dead_letter_id(self.msg)
        )
        await self.ack()


def dead_letter_id(msg: Msg) -> str:
    """The msg id of a stream message's dead letter: a redelivered message is copied once."""
    meta = msg.metadata
    return f"{meta.stream}:{meta.sequence.stream}"


class BusIterator(Generic[Item]):
    """The lifecycle shared by Consumer, Subscription and KvWatch (see the module docstring).

    Subclasses implement ``_subscribe`` (called once, by ``start``), ``_unsubscribe`` (called
    once, by ``aclose``, only after a successful start) and ``_next``: the next item, None
    when there is none yet (asked again unless closed), StopAsyncIteration at the end.
    """

    def __init__(self, bus: IteratorHost) -> None:
        self._bus = bus
        self._started = False
        self._closed = False

    async def _subscribe(self) -> None:
        raise NotImplementedError

    async def _unsubscribe(self) -> None:
        raise NotImplementedError

    async def _next(self) -> Item | None:
        raise NotImplementedError

    async def start(self) -> Self:
        """Subscribe now (idempotent; a no-op once closed)."""
        if not self._started and not self._closed:
            await self._subscribe()
            self._started = True
            self._bus.open_iterators.add(self)
        return self

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Item:
        await self.start()
        while not self._closed:
            item = await self._next()
            if item is not None:
                return item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop; an iteration waiting in another task ends."""
        if self._closed:
            return
        self._closed = True
        self._bus.open_iterators.discard(self)
        if not self._started or self._bus.nc.is_closed:
            return
        with anyio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
            try:
                await self._unsubscribe()
            except Exception as e:  # best effort: the server drops it with the connection
                log.debug("unsubscribe failed", iterator=type(self).__name__, error=repr(e))

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class Consumer(BusIterator[Delivery]):
    """Async iterator of Deliveries from one durable pull consumer.

    ``start()`` raises StreamNotFound if provision() never created the consumer and
    StreamUnavailable if it has no leader for options.leader_wait_s. While the consumer has no
    leader later on, iteration waits. aclose() naks messages fetched but not yet handed out,
    for prompt redelivery.
    """

    def __init__(
        self, bus: IteratorHost, spec: StreamSpec, durable: str, batch: int, fetch_timeout: float
    ) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if fetch_timeout <= 0:
            raise ValueError(f"fetch_timeout must be > 0, got {fetch_timeout}")
        super().__init__(bus)
        self.spec = spec
        self.durable = durable
        self._batch = batch
        self._fetch_timeout = fetch_timeout
        self._psub: JetStreamContext.PullSubscription | None = None
        self._buffer: deque[Msg] = deque()
        self._leaderless_since: float | None = None

    async def _subscribe(self) -> None:
        bus = self._bus
        what = f"consumer {self.durable!r} of stream {self.spec.name}"
        try:
            await while_leaderless(bus, what, lambda: bus.js.consumer_info(self.spec.name, self.durable))
        except nats.js.errors.NotFoundError:
            raise StreamNotFound(
                f"consumer {self.durable!r} of stream {self.spec.name} does not exist; "
                "call bus.provision() first (the controller does at start)"
            ) from None
        max_msg = await bus.stream_max_msg_size(self.spec)
        if max_msg <= 0:
            max_msg = bus.nc.max_payload
        fit = max(1, FETCH_BYTES_BUDGET // max_msg)
        if self._batch > fit:
            log.debug("fetch batch capped", stream=self.spec.name, batch=self._batch, capped=fit)
            self._batch = fit
        self._psub = await bus.js.pull_subscribe_bind(self.durable, stream=self.spec.name)

    async def _unsubscribe(self) -> None:
        while self._buffer:
            try:
                await self._buffer.popleft().nak()
            except Exception:  # connection gone: ack_wait expiry redelivers it anyway
                break
        assert self._psub is not None
        await self._psub.unsubscribe()

    async def _next(self) -> Delivery | None:
        """A buffered message (None if it went to deadletter), else None after one fetch."""
        assert self._psub is not None
        if self._buffer:
            try:
                return await self._bus.delivery(self._buffer.popleft())
            except nats.errors.ConnectionClosedError:
                raise StopAsyncIteration from None
        try:
            msgs = await self._psub.fetch(self._batch, timeout=self._fetch_timeout)
        except TimeoutError:  # nothing yet, or NATS is away (nats-py's TimeoutError too)
            return None
        except (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError) as e:
            if self._closed or self._bus.nc.is_closed:
                raise StopAsyncIteration from None
            self._wait_for_leader(e)
            await anyio.sleep(random.uniform(0.1, 0.3))
            return None
        except Exception:
            if self._closed or self._bus.nc.is_closed:
                raise StopAsyncIteration from None
            raise
        if self._leaderless_since is not None:
            log.info(
                "consumer has a leader again",
                consumer=self.durable,
                seconds=round(time.monotonic() - self._leaderless_since, 1),
            )
            self._leaderless_since = None
        self._buffer.extend(msgs)
        return None

    def _wait_for_leader(self, error: Exception) -> None:
        """The consumer is electing a leader (its node died): wait as for a fetch timeout."""
        if self._leaderless_since is None:
            self._leaderless_since = time.monotonic()
            log.info("consumer has no leader, waiting", consumer=self.durable, error=repr(error))
        else:
            log.debug("consumer still has no leader", consumer=self.durable, error=repr(error))


class Subscription(BusIterator[Any]):
    """Async iterator of decoded events from a core NATS subject (wildcards allowed).

    Use ``async with bus.subscribe(...) as sub`` to be subscribed before anything is
    published; a plain ``async for`` subscribes on the first iteration.
    """

    def __init__(self, bus: IteratorHost, subject: str, queue: str, pending_bytes_limit: int) -> None:
        super().__init__(bus)
        self.subject = subject
        self._queue = queue
        self._pending_bytes_limit = pending_bytes_limit
        self._sub: NatsSubscription | None = None

    async def _subscribe(self) -> None:
        self._sub = await self._bus.nc.subscribe(
            self.subject, queue=self._queue, pending_bytes_limit=self._pending_bytes_limit
        )

    async def _unsubscribe(self) -> None:
        assert self._sub is not None
        await self._sub.unsubscribe()

    async def _next(self) -> Any:
        assert self._sub is not None
        try:
            # A bounded wait so that aclose() from another task ends the iteration.
            msg = await self._sub.next_msg(timeout=1.0)
        except nats.errors.TimeoutError:
            return None
        except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
            raise StopAsyncIteration from None
        try:
            event = decode(msg.data, expected_type(msg.subject))
        except DecodeError as e:
            await self._bus.dead_letter(msg.subject, e.reason, msg.data, msg.headers)
            return None
        return self._item(event, msg)

    def _item(self, event: Any, msg: Msg) -> Any:
        """What the iterator yields for a decoded message: the event itself."""
        return event


@dataclass(eq=False)
class Request:
    """One request received on a core subject (``Bus.serve``); answer it once with ``respond``."""

    event: Any
    subject: str
    msg: Msg
    bus: IteratorHost

    async def respond(self, event: Any) -> None:
        """Send ``event`` to the requester's inbox; a requester that gave up is not an error."""
        from bus.events import encode

        if self.msg.reply:
            await self.bus.nc.publish(self.msg.reply, encode(event))


class Requests(Subscription):
    """Async iterator of ``Request`` objects from a core subject, shared by a queue group."""

    def _item(self, event: Any, msg: Msg) -> Request:
        return Request(event=event, subject=msg.subject, msg=msg, bus=self._bus)


class KvWatch(BusIterator[KvEntry]):
    """Async iterator of KvEntry: the current values first, then every change."""

    def __init__(self, bus: IteratorHost, bucket: str, key: str) -> None:
        super().__init__(bus)
        self._bucket = bucket
        self._key = key
        self._watcher: KeyValue.KeyWatcher | None = None

    async def _subscribe(self) -> None:
        kv = await self._bus.bucket(self._bucket)
        self._watcher = await kv.watch(self._key)

    async def _unsubscribe(self) -> None:
        assert self._watcher is not None
        await self._watcher.stop()

    async def _next(self) -> KvEntry | None:
        assert self._watcher is not None
        entry = await self._watcher.__anext__()  # StopAsyncIteration once stopped
        if entry is None:  # "initial values done" marker
            return None
        op = entry.operation or "PUT"
        return KvEntry(
            key=entry.key,
            value=entry.value if op == "PUT" else None,
            revision=entry.revision or 0,
            operation=op,
        )
