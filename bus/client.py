"""The NATS connection of one worker: connect, provision, publish, consume, subscribe, KV.

Contract:

* ``await connect(options, run)`` either returns a connected ``Bus`` within
  ``options.connect_timeout`` or raises ``BusConnectError`` naming the URL and the fix.
  After the first connect the client reconnects forever (bounded exponential backoff,
  ``reconnect_wait_min`` .. ``reconnect_wait_max``); losing NATS pauses the worker, it
  never kills it.
* ``provision()`` creates every stream, durable consumer and KV bucket of the run. It is
  idempotent and safe to call from every worker at once; a changed setting is updated in
  place where JetStream allows it, else ``ProvisionError`` says what to delete. Requests
  that time out or get 503 (a cluster still electing its meta leader, or busy creating the
  replicas another worker asked for) are retried for up to ``options.leader_wait_s``.
* ``publish()`` sends stream subjects through JetStream (stored, acked by the server,
  deduplicated by ``msg_id``) and the rest through core NATS (at most once). A payload that
  would not fit (body + headers > server max_payload - 1 KiB, or > the stream's
  max_msg_size) is refused *before* sending with ``PayloadTooLarge``.
* A stream without a leader (a JetStream election, 6-8 s after its leader node dies) pauses
  ``publish()``, ``Consumer.start()``, consumer iteration, provisioning and the KV calls
  (get, put, delete, keys); they retry for up to
  ``options.leader_wait_s`` (30 s) and then raise ``StreamUnavailable``. ``publish()``
  retries only what cannot be stored twice: a request no stream answered, or, with a
  ``msg_id`` (dedup), one that timed out.
* A JetStream publish or KV write the server refuses for permissions raises
  ``BusPermissionError`` at once (the server only sends an ``-ERR``, never a reply); every
  refusal, also of core publishes, is logged (``nats permission denied``) and counted in
  ``bus.stats['permission_denied']``. The connection stays up.
* ``consume()`` yields ``Delivery`` objects from a stream's durable pull consumer and
  ``subscribe()`` yields events from a core subject. A payload that fails to decode or
  validate never reaches the caller: it is copied to ``deadletter`` (with the reason and the
  raw bytes, truncated with a note if too large), removed (acked), counted in
  ``bus.stats['deadletter']``, and the iterator goes on.

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

Errors (all ``BusError``)::

    BusError
    ├── BusConnectError     first connect failed (URL, reason, fix)
    ├── BusPermissionError  the server refused a publish/KV write for permissions
    ├── PayloadTooLarge     refused before sending (also a ValueError)
    ├── StreamNotFound      stream/consumer/bucket missing: call provision()
    ├── StreamUnavailable   no leader for leader_wait_s: election or lost quorum
    ├── StreamFull          work queue at its limit: back off and retry
    ├── ProvisionError      existing config cannot be changed in place
    └── KvConflict          kv_create on an existing key / stale kv_update revision
"""

from __future__ import annotations

import os
import random
import re
import socket
import ssl
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self, TypeVar

import anyio
import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.client import Server
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from bus.events import (
    HEADER_POLICY_VERSION,
    DeadLetter,
    DecodeError,
    Event,
    decode,
    encode,
    expected_type,
    headers_for,
)
from bus.subjects import StreamSpec, Subjects, subject_suffix, validate_run_name

log = structlog.get_logger()

PAYLOAD_MARGIN = 1024
"""Bytes kept free under the server's max_payload for protocol overhead."""

FETCH_BYTES_BUDGET = 16 * 2**20
"""Most bytes one fetch may pull (batch x stream max_msg_size). The server cuts a connection
that has more than max_pending (64 MB) in flight as a slow consumer, so a large batch of large
messages would lose the connection; the batch is capped to fit this budget."""

ERR_STREAM_NAME_IN_USE = 10058  # stream exists with a different config
ERR_STORE_FAILED = 10077  # e.g. maximum messages/bytes exceeded under DiscardPolicy.NEW
ERR_MESSAGE_TOO_LARGE = 10054
ERR_CLUSTER_NOT_AVAILABLE = 10008  # 503 "JetStream system temporarily unavailable" (no meta leader)

PERMISSION_DENIED = re.compile(r'permissions violation for (\w+) to "([^"]*)"', re.IGNORECASE)
"""The server's ``-ERR`` for a refused publish or subscription (nats-py lowercases it)."""

LEADERLESS = (
    TimeoutError,
    nats.js.errors.ServiceUnavailableError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
)
"""What a JetStream API request (or a KV write, a JetStream publish underneath) gets while its
stream or consumer has no leader (nats-py's TimeoutError subclasses the builtin one)."""

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# errors


class BusError(RuntimeError):
    """Base of every error raised by the bus."""


class BusConnectError(BusError):
    """The first connect did not succeed within connect_timeout."""


class BusPermissionError(BusError):
    """The server refused a publish or KV write for permissions; retrying cannot help."""

    def __init__(self, message: str, *, subject: str, user: str | None = None) -> None:
        super().__init__(message)
        self.subject = subject
        self.user = user


class PayloadTooLarge(BusError, ValueError):
    """An event would exceed max_payload or the stream's max_msg_size; nothing was sent."""


class StreamNotFound(BusError):
    """A stream, consumer or bucket of the run does not exist: provision() was not called."""


class StreamUnavailable(BusError):
    """A stream or consumer had no leader for options.leader_wait_s (election or lost quorum)."""


class StreamFull(BusError):
    """A work-queue stream hit its limits (DiscardPolicy.NEW); back off and retry."""


class ProvisionError(BusError):
    """A stream/consumer/bucket exists with a config that cannot be changed in place."""


class KvConflict(BusError):
    """kv_create on an existing key, or kv_update whose ``last`` revision is stale."""


# ---------------------------------------------------------------------------------------------
# options


@dataclass(frozen=True, kw_only=True)
class ConnectOptions:
    """How to reach NATS. Paths are files on this machine."""

    url: str | Sequence[str] = "nats://127.0.0.1:4222"
    """One server URL or several (a cluster); ``tls://`` forces TLS."""

    name: str | None = None
    """Connection name shown in server monitoring; also the worker id in dead letters."""

    token: str | None = None
    user: str | None = None
    password: str | None = None
    nkeys_seed: str | None = None
    """Path to an NKEY seed file."""

    creds: str | None = None
    """Path to a .creds file (JWT + NKEY seed)."""

    tls_ca: str | None = None
    """CA bundle that signed the server certificate."""

    tls_cert: str | None = None
    """Client certificate (mutual TLS); needs tls_key."""

    tls_key: str | None = None

    connect_timeout: float = 5.0
    """Total budget for the first connect, all servers and retries included."""

    reconnect_wait_min: float = 0.2
    """First reconnect delay; doubles per failed attempt (with jitter) up to reconnect_wait_max."""

    reconnect_wait_max: float = 5.0

    max_reconnect_attempts: int = -1
    """Reconnect attempts per server after the first connect; -1 = forever."""

    request_timeout: float = 5.0
    """JetStream API and publish-ack timeout."""

    leader_wait_s: float = 30.0
    """How long publish and consumers wait for a stream or consumer without a leader (a
    JetStream election takes 6-8 s after a node dies) before raising StreamUnavailable."""

    drain_timeout: float = 5.0
    """Upper bound of close()."""

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("ConnectOptions.url is empty; set bus.url, e.g. nats://127.0.0.1:4222")
        for name in ("connect_timeout", "reconnect_wait_min", "request_timeout", "drain_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ConnectOptions.{name} must be > 0, got {getattr(self, name)}")
        if self.leader_wait_s < 0:
            raise ValueError(f"ConnectOptions.leader_wait_s must be >= 0, got {self.leader_wait_s}")
        if self.reconnect_wait_max < self.reconnect_wait_min:
            raise ValueError(
                f"ConnectOptions.reconnect_wait_max ({self.reconnect_wait_max}) must be >= "
                f"reconnect_wait_min ({self.reconnect_wait_min})"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("ConnectOptions.tls_cert and tls_key go together; set both or neither")
        if self.user is not None and self.password is None:
            raise ValueError("ConnectOptions.user needs password")

    @property
    def urls(self) -> list[str]:
        if isinstance(self.url, str):
            return [u.strip() for u in self.url.split(",") if u.strip()]
        return list(self.url)


def _check_file(options: ConnectOptions, name: str) -> str | None:
    path = getattr(options, name)
    if path is not None and not os.path.isfile(path):
        raise ValueError(f"ConnectOptions.{name}: no such file {path!r}")
    return path


def _tls_context(options: ConnectOptions) -> ssl.SSLContext | None:
    ca = _check_file(options, "tls_ca")
    cert = _check_file(options, "tls_cert")
    key = _check_file(options, "tls_key")
    if ca is None and cert is None and not any(u.startswith("tls://") for u in options.urls):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    if cert is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


def _backoff(lo: float, hi: float) -> Callable[[list[Server], dict[str, Any]], tuple[Server | None, float]]:
    """nats-py reconnect handler: least-tried server, delay lo * 2**attempts (jittered), at most hi."""

    def choose(servers: list[Server], info: dict[str, Any]) -> tuple[Server | None, float]:
        fewest = min(s.reconnects for s in servers)
        server = random.choice([s for s in servers if s.reconnects == fewest])
        delay = min(hi, lo * 2 ** min(fewest, 16)) * random.uniform(0.8, 1.0)
        return server, delay

    return choose


async def connect(options: ConnectOptions, run: str) -> Bus:
    """Connect to NATS for run ``run``; BusConnectError if it fails within connect_timeout."""
    validate_run_name(run)
    urls = options.urls
    nc = NATS()
    connecting, connected = True, False
    last_error: list[BaseException] = []  # of the first connect; the auth error sticks
    logger = log.bind(connection=options.name)
    bus: Bus | None = None  # set once connected; error_cb hands it permission refusals

    def fatal_fix(e: BaseException) -> str | None:
        """The fix for errors that retrying cannot cure (credentials, certificates); else None."""
        if isinstance(e, nats.errors.AuthorizationError) or "authorization" in str(e).lower():
            return "check bus.token / bus.user / bus.password / bus.creds"
        if isinstance(e, ssl.SSLError):
            return "set bus.tls_ca to the CA that signed the server certificate (bus.tls_cert/tls_key for mutual TLS)"
        return None

    async def error_cb(e: Exception) -> None:
        if not connected:
            if connecting and not (last_error and fatal_fix(last_error[0])):
                last_error[:] = [e]
            if fatal_fix(e):
                nc.options["allow_reconnect"] = False  # make connect() raise now
            return
        denied = PERMISSION_DENIED.search(str(e))
        if denied is not None:
            operation, subject = denied.group(1).lower(), denied.group(2).lower()
            logger.warning("nats permission denied", subject=subject, operation=operation, user=options.user)
            if bus is not None:
                bus._permission_denied(subject)
        elif isinstance(e, nats.errors.SlowConsumerError):
            logger.warning("nats slow consumer, messages dropped", subject=e.subject)
        else:
            logger.warning("nats error", error=repr(e))

    async def disconnected_cb() -> None:
        if connected and not nc.is_closed:  # closed = our own close(), not news
            logger.warning("nats disconnected")

    async def reconnected_cb() -> None:
        logger.info("nats reconnected", url=str(nc.connected_url.geturl()) if nc.connected_url else None)

    kwargs: dict[str, Any] = dict(
        servers=urls,
        name=options.name,
        error_cb=error_cb,
        disconnected_cb=disconnected_cb,
        reconnected_cb=reconnected_cb,
        allow_reconnect=True,
        connect_timeout=min(options.connect_timeout, 2.0),
        reconnect_time_wait=options.reconnect_wait_min,
        max_reconnect_attempts=-1,
        reconnect_to_server_handler=_backoff(options.reconnect_wait_min, options.reconnect_wait_max),
        drain_timeout=options.drain_timeout,
        token=options.token,
        user=options.user,
        password=options.password,
        user_credentials=_check_file(options, "creds"),
        nkeys_seed=_check_file(options, "nkeys_seed"),
        tls=_tls_context(options),
    )
    t0 = time.monotonic()
    with anyio.move_on_after(options.connect_timeout):
        try:
            await nc.connect(**kwargs)
        except Exception as e:  # e.g. the authorization error; reported below with the URL
            if not last_error:
                last_error[:] = [e]
    connecting = False
    if not nc.is_connected:
        try:
            with anyio.move_on_after(0.25):  # after a failed TLS handshake wait_closed() can hang
                await nc.close()
        except Exception:  # a half-open client may fail to close; nothing else holds it
            pass
        transport = getattr(nc, "_transport", None)  # cancelled mid-handshake: don't leak the socket
        if transport is not None:
            transport.close()
        why = repr(last_error[0]) if last_error else "no answer"
        fix = fatal_fix(last_error[0]) if last_error else None
        if fix is not None:
            raise BusConnectError(f"could not connect to NATS at {', '.join(urls)} ({why}); {fix}")
        raise BusConnectError(
            f"could not connect to NATS at {', '.join(urls)} within {options.connect_timeout:g}s ({why}); "
            "check that nats-server is running there (`areal-async run` starts an embedded one) or set bus.url"
        )
    connected = True
    bus = Bus(nc, run, options)
    nc.options["allow_reconnect"] = True
    nc.options["max_reconnect_attempts"] = options.max_reconnect_attempts
    logger.info(
        "nats connected",
        url=nc.connected_url.geturl() if nc.connected_url else None,
        run=run,
        server_version=str(nc.connected_server_version),
        max_payload=nc.max_payload,
        seconds=round(time.monotonic() - t0, 3),
    )
    return bus


# ---------------------------------------------------------------------------------------------
# helpers


def _header_bytes(headers: Mapping[str, str] | None) -> int:
    """Bytes of the NATS/1.0 header block as the server counts it against max_payload."""
    if not headers:
        return 0
    return len("NATS/1.0\r\n") + sum(len(k) + len(v) + 4 for k, v in headers.items()) + 2


def _fmt_bytes(n: int) -> str:
    for unit, size in (("MB", 2**20), ("KB", 2**10)):
        if n >= size:
            return f"{n / size:.1f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n} B"


def _shrink_hint(subject: str) -> str:
    suffix = subject_suffix(subject) or ""
    if suffix in ("rollout.generated", "rollout.scored", "eval.scored"):
        return "lower max_new_tokens or group_size"
    if suffix == "prompt":
        return "shorten the dataset row"
    return "send less data in this event (bulk data belongs on disk, the bus carries its path)"


@dataclass(frozen=True)
class Published:
    """JetStream's acknowledgement of a stored message."""

    stream: str
    seq: int
    duplicate: bool
    """True when the msg_id was seen within the duplicate window and nothing was stored."""


@dataclass(frozen=True)
class KvEntry:
    key: str
    value: bytes | None
    """None for a delete/purge (or a key expired by TTL)."""

    revision: int
    operation: str
    """PUT, DEL or PURGE."""


# ---------------------------------------------------------------------------------------------
# delivery and iterators


@dataclass(eq=False)
class Delivery:
    """One validated JetStream message; settle it with exactly one of ack / nak / term."""

    event: Any
    subject: str
    headers: dict[str, str]
    num_delivered: int
    """1 on first delivery; more after a nak, an expired ack_wait or a dead consumer."""

    stream_seq: int
    msg: Msg = field(repr=False)
    ack_timeout: float = field(default=5.0, repr=False)

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

    async def ack_sync(self) -> None:
        """ack() and wait until the server confirms it (a double ack; bounded by request_timeout)."""
        await self.msg.ack_sync(timeout=self.ack_timeout)

    async def nak(self, delay: float | None = None) -> None:
        """Not done: redeliver (after ``delay`` seconds), possibly to another worker."""
        await self.msg.nak(delay=delay)

    async def in_progress(self) -> None:
        """Still working: restart this message's ack_wait clock."""
        await self.msg.in_progress()

    async def term(self) -> None:
        """Never redeliver (poison). Prefer publishing RolloutFailed and ack()."""
        await self.msg.term()


class Consumer:
    """Async iterator of Deliveries from one durable pull consumer; ``async with`` closes it."""

    def __init__(self, bus: Bus, spec: StreamSpec, durable: str, batch: int, fetch_timeout: float) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if fetch_timeout <= 0:
            raise ValueError(f"fetch_timeout must be > 0, got {fetch_timeout}")
        self._bus = bus
        self.spec = spec
        self.durable = durable
        self._batch = batch
        self._fetch_timeout = fetch_timeout
        self._psub: JetStreamContext.PullSubscription | None = None
        self._buffer: deque[Msg] = deque()
        self._closed = False
        self._leaderless_since: float | None = None

    async def start(self) -> Self:
        """Bind to the durable consumer; StreamNotFound if provision() never created it,
        StreamUnavailable if it has no leader for options.leader_wait_s."""
        if self._psub is None:
            what = f"consumer {self.durable!r} of stream {self.spec.name}"
            try:
                await self._bus._while_leaderless(
                    what, lambda: self._bus.js.consumer_info(self.spec.name, self.durable)
                )
            except nats.js.errors.NotFoundError:
                raise StreamNotFound(
                    f"consumer {self.durable!r} of stream {self.spec.name} does not exist; "
                    "call bus.provision() first (the controller does at start)"
                ) from None
            max_msg = await self._bus._stream_max_msg_size(self.spec)
            if max_msg <= 0:
                max_msg = self._bus.nc.max_payload
            fit = max(1, FETCH_BYTES_BUDGET // max_msg)
            if self._batch > fit:
                log.debug("fetch batch capped", stream=self.spec.name, batch=self._batch, capped=fit)
                self._batch = fit
            self._psub = await self._bus.js.pull_subscribe_bind(self.durable, stream=self.spec.name)
            self._bus._open.add(self)
        return self

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Delivery:
        if self._psub is None:
            await self.start()
        assert self._psub is not None
        while not self._closed:
            while self._buffer:
                try:
                    delivery = await self._bus._delivery(self._buffer.popleft(), self.spec)
                except nats.errors.ConnectionClosedError:
                    raise StopAsyncIteration from None
                if delivery is not None:
                    return delivery
            try:
                msgs = await self._psub.fetch(self._batch, timeout=self._fetch_timeout)
            except TimeoutError:  # nothing yet, or NATS is away (nats-py's TimeoutError too)
                continue
            except (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError) as e:
                if self._closed or self._bus.nc.is_closed:
                    break
                # The consumer is electing a leader (its node died); wait like for a timeout.
                if self._leaderless_since is None:
                    self._leaderless_since = time.monotonic()
                    log.info("consumer has no leader, waiting", consumer=self.durable, error=repr(e))
                else:
                    log.debug("consumer still has no leader", consumer=self.durable, error=repr(e))
                await anyio.sleep(random.uniform(0.1, 0.3))
                continue
            except Exception:
                if self._closed or self._bus.nc.is_closed:
                    break
                raise
            if self._leaderless_since is not None:
                log.info(
                    "consumer has a leader again",
                    consumer=self.durable,
                    seconds=round(time.monotonic() - self._leaderless_since, 1),
                )
                self._leaderless_since = None
            self._buffer.extend(msgs)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop; messages fetched but not yet handed out are nak'ed for prompt redelivery."""
        if self._closed:
            return
        self._closed = True
        self._bus._open.discard(self)
        with anyio.move_on_after(2.0, shield=True):
            while self._buffer:
                msg = self._buffer.popleft()
                try:
                    await msg.nak()
                except Exception:  # connection gone: ack_wait expiry redelivers it anyway
                    break
            if self._psub is not None and not self._bus.nc.is_closed:
                try:
                    await self._psub.unsubscribe()
                except Exception as e:  # best effort: the server drops it with the connection
                    log.debug("unsubscribe failed", error=repr(e))

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class Subscription:
    """Async iterator of decoded events from a core NATS subject (wildcards allowed).

    Use ``async with bus.subscribe(...) as sub`` to be subscribed before anything is
    published; a plain ``async for`` subscribes on the first iteration.
    """

    def __init__(self, bus: Bus, subject: str, queue: str, pending_bytes_limit: int) -> None:
        self._bus = bus
        self.subject = subject
        self._queue = queue
        self._pending_bytes_limit = pending_bytes_limit
        self._sub: NatsSubscription | None = None
        self._closed = False

    async def start(self) -> Self:
        if self._sub is None:
            self._sub = await self._bus.nc.subscribe(
                self.subject, queue=self._queue, pending_bytes_limit=self._pending_bytes_limit
            )
            self._bus._open.add(self)
        return self

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Any:
        if self._sub is None:
            await self.start()
        assert self._sub is not None
        while not self._closed:
            try:
                # A bounded wait so that aclose() from another task ends this loop.
                msg = await self._sub.next_msg(timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
                break
            try:
                return decode(msg.data, expected_type(msg.subject))
            except DecodeError as e:
                await self._bus._dead_letter(msg.subject, e.reason, msg.data, msg.headers)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._bus._open.discard(self)
        if self._sub is not None and not self._bus.nc.is_closed:
            with anyio.move_on_after(2.0, shield=True):
                try:
                    await self._sub.unsubscribe()
                except Exception as e:  # best effort: the server drops it with the connection
                    log.debug("unsubscribe failed", error=repr(e))

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class KvWatch:
    """Async iterator of KvEntry: the current values first, then every change."""

    def __init__(self, bus: Bus, bucket: str, key: str) -> None:
        self._bus = bus
        self._bucket = bucket
        self._key = key
        self._watcher: KeyValue.KeyWatcher | None = None
        self._closed = False

    async def start(self) -> Self:
        if self._watcher is None and not self._closed:
            kv = await self._bus._bucket(self._bucket)
            self._watcher = await kv.watch(self._key)
            self._bus._open.add(self)
        return self

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> KvEntry:
        await self.start()
        watcher = self._watcher
        if watcher is None:
            raise StopAsyncIteration
        while True:
            entry = await watcher.__anext__()  # StopAsyncIteration once stopped
            if entry is None:  # "initial values done" marker
                continue
            op = entry.operation or "PUT"
            return KvEntry(
                key=entry.key,
                value=entry.value if op == "PUT" else None,
                revision=entry.revision or 0,
                operation=op,
            )

    async def aclose(self) -> None:
        self._closed = True
        self._bus._open.discard(self)
        if self._watcher is not None:
            watcher, self._watcher = self._watcher, None
            with anyio.move_on_after(2.0, shield=True):
                try:
                    await watcher.stop()
                except Exception as e:  # connection gone; the server drops the consumer itself
                    log.debug("kv watch stop failed", error=repr(e))

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


# ---------------------------------------------------------------------------------------------
# the bus


@dataclass(eq=False)
class _Refusable:
    """A JetStream request in flight that a permissions ``-ERR`` for ``subject`` cancels."""

    subject: str
    """Lowercased, as nats-py reports refused subjects."""

    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    denied: bool = False


def _per_stream(value: float | int | Mapping[str, Any], key: str, default: Any) -> Any:
    if isinstance(value, Mapping):
        return value.get(key, default)
    return value


class Bus:
    """One worker's connection, bound to one run. Create with ``await connect(...)``."""

    def __init__(self, nc: NATS, run: str, options: ConnectOptions) -> None:
        self.nc = nc
        self.run = run
        self.subjects = Subjects(run)
        self.options = options
        self.js: JetStreamContext = nc.jetstream(timeout=options.request_timeout)
        self.worker_id = options.name or f"{socket.gethostname()}-{os.getpid()}"
        self.stats: Counter[str] = Counter()
        """published, consumed, deadletter, deadletter_lost, permission_denied, publish_retries;
        publish_s and decode_s (seconds spent)."""
        self._max_msg_size: dict[str, int] = {}
        self._kv: dict[str, KeyValue] = {}
        self._open: set[Consumer | Subscription | KvWatch] = set()
        self._refusable: set[_Refusable] = set()

    def __repr__(self) -> str:
        return f"Bus(run={self.run!r}, url={self.nc.connected_url.geturl() if self.nc.connected_url else None!r})"

    # -- refusals and elections ---------------------------------------------------------------

    def _permission_denied(self, subject: str) -> None:
        """The server refused ``subject`` (lowercased): fail the requests waiting on it now."""
        self.stats["permission_denied"] += 1
        for request in list(self._refusable):
            if request.subject == subject:
                request.denied = True
                request.scope.cancel()

    @contextmanager
    def _refused_raises(self, subject: str) -> Iterator[None]:
        """Raise BusPermissionError as soon as the server refuses ``subject`` for permissions.

        A refused request gets no reply, only an ``-ERR`` on the connection (error_cb); without
        this race the caller would wait request_timeout for a plain TimeoutError.
        """
        request = _Refusable(subject.lower())
        self._refusable.add(request)
        try:
            with request.scope:
                yield
        finally:
            self._refusable.discard(request)
        if request.denied:
            user = self.options.user
            raise BusPermissionError(
                f"{f'user {user!r}' if user else 'this connection'} may not publish to {subject} "
                "(the server refused it: permissions violation); grant it in the server's permissions "
                "(scripts/nats/permissions.conf) or run this worker with its role's credentials",
                subject=subject,
                user=user,
            )

    def _no_leader(self, what: str, waited: float, error: BaseException) -> StreamUnavailable:
        why = (
            "not connected to NATS (reconnecting)"
            if not self.nc.is_connected
            else "no leader: election or lost quorum; check that a majority of the NATS cluster is up"
        )
        return StreamUnavailable(f"{what} did not answer for {waited:.1f}s ({error!r}): {why}")

    async def _while_leaderless(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` (a JetStream API request), retried while ``what`` has no leader (timeout,
        503) and the client is not closed, up to options.leader_wait_s; then StreamUnavailable."""
        started = time.monotonic()
        delay, retries = 0.05, 0
        while True:
            try:
                result = await call()
            except LEADERLESS as e:
                waited = time.monotonic() - started
                if self.nc.is_closed:
                    raise
                if waited + delay > self.options.leader_wait_s:
                    raise self._no_leader(what, waited, e) from e
                if retries == 0:
                    log.info("jetstream unavailable, retrying", what=what, error=repr(e))
                else:
                    log.debug("jetstream unavailable, retrying", what=what, error=repr(e))
                retries += 1
                await anyio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(1.0, delay * 2)
                continue
            if retries:
                log.info("jetstream available again", what=what, seconds=round(time.monotonic() - started, 1))
            return result

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

    # -- provisioning -------------------------------------------------------------------------

    async def provision(
        self,
        *,
        replicas: int = 1,
        max_msg_bytes: int | None = None,
        ack_wait: float | Mapping[str, float] = 60.0,
        max_ack_pending: int | Mapping[str, int] = 1024,
        max_deliver: int = -1,
        duplicate_window: float = 600.0,
        max_stream_bytes: int = -1,
        deadletter_max_msgs: int = 100_000,
        heartbeat_ttl: float = 15.0,
        state_history: int = 16,
    ) -> None:
        """Create or update every stream, durable consumer and KV bucket of the run.

        Args:
            replicas: JetStream replicas (3 on a 3-node cluster).
            max_msg_bytes: stream max_msg_size; default the server's max_payload.
            ack_wait: seconds a consumer may hold a message unacked before redelivery; one
                value or a mapping from stream key ("PROMPT", "SCORED", ...) to seconds.
            max_ack_pending: unacked messages per consumer (same forms as ack_wait); the
                trainer's must cover everything it holds while assembling a batch.
            max_deliver: deliveries before the server gives up on a message (-1 = never).
            duplicate_window: seconds a msg_id is remembered; must exceed ack_wait + the
                time to redo a task, or a redone result is stored twice.
            max_stream_bytes: size limit per work-queue stream (-1 = none); when full,
                publish raises StreamFull (DiscardPolicy.NEW never drops work).
            deadletter_max_msgs: dead letters kept (oldest dropped beyond).
            heartbeat_ttl: seconds a key in the workers bucket lives without a refresh.
            state_history: revisions kept per key in the state bucket.
        """
        t0 = time.monotonic()
        with_consumer = {spec.key for spec in self.subjects.streams if spec.consumer}
        for name, value in (("ack_wait", ack_wait), ("max_ack_pending", max_ack_pending)):
            if isinstance(value, Mapping) and set(value) - with_consumer:
                raise ValueError(
                    f"provision({name}=...): unknown stream keys {sorted(set(value) - with_consumer)}; "
                    f"use {sorted(with_consumer)}"
                )
        server_max = self.nc.max_payload
        max_msg = server_max if max_msg_bytes is None else max_msg_bytes
        if max_msg > server_max:
            raise ValueError(
                f"max_msg_bytes {max_msg} exceeds the server's max_payload {server_max}; "
                "raise max_payload in the nats-server config or lower bus.max_msg_bytes"
            )
        for spec in self.subjects.streams:
            work_queue = spec.retention == "work_queue"
            cfg = api.StreamConfig(
                name=spec.name,
                subjects=[spec.subject],
                retention=api.RetentionPolicy.WORK_QUEUE if work_queue else api.RetentionPolicy.LIMITS,
                storage=api.StorageType.FILE,
                num_replicas=replicas,
                max_msg_size=max_msg,
                max_bytes=max_stream_bytes if work_queue else -1,
                max_msgs=deadletter_max_msgs if spec.key == "DEADLETTER" else -1,
                discard=api.DiscardPolicy.NEW if work_queue else api.DiscardPolicy.OLD,
                duplicate_window=duplicate_window,
            )
            await self._ensure_stream(cfg)
            self._max_msg_size[spec.name] = max_msg
            if spec.consumer is not None:
                await self._ensure_consumer(
                    spec,
                    api.ConsumerConfig(
                        name=spec.consumer,
                        durable_name=spec.consumer,
                        ack_policy=api.AckPolicy.EXPLICIT,
                        deliver_policy=api.DeliverPolicy.ALL,
                        ack_wait=float(_per_stream(ack_wait, spec.key, 60.0)),
                        max_ack_pending=int(_per_stream(max_ack_pending, spec.key, 1024)),
                        max_deliver=max_deliver,
                        filter_subject=spec.subject,
                        max_waiting=512,
                    ),
                )
        await self._ensure_bucket(
            api.KeyValueConfig(
                bucket=self.subjects.state_bucket,
                history=state_history,
                replicas=replicas,
                storage=api.StorageType.FILE,
            )
        )
        await self._ensure_bucket(
            api.KeyValueConfig(
                bucket=self.subjects.workers_bucket,
                history=1,
                ttl=heartbeat_ttl,
                replicas=replicas,
                storage=api.StorageType.FILE,
                limit_marker_ttl=max(1.0, heartbeat_ttl),
            )
        )
        log.info(
            "bus provisioned",
            run=self.run,
            streams=len(self.subjects.streams),
            max_msg_bytes=max_msg,
            seconds=round(time.monotonic() - t0, 3),
        )

    async def _ensure_stream(self, cfg: api.StreamConfig) -> api.StreamInfo:
        what = f"stream {cfg.name}"
        try:
            return await self._while_leaderless(what, lambda: self.js.add_stream(cfg))
        except nats.js.errors.BadRequestError as e:
            if e.err_code != ERR_STREAM_NAME_IN_USE:
                raise ProvisionError(f"cannot create stream {cfg.name}: {e.description}") from e
        try:
            info = await self._while_leaderless(what, lambda: self.js.update_stream(cfg))
        except nats.js.errors.APIError as e:
            raise ProvisionError(
                f"stream {cfg.name} exists with a config that cannot be changed in place "
                f"({e.description}); delete it (`nats stream rm {cfg.name}`) or use a new run name"
            ) from e
        log.info("stream updated", stream=cfg.name)
        return info

    async def _ensure_consumer(self, spec: StreamSpec, cfg: api.ConsumerConfig) -> None:
        try:
            await self._while_leaderless(
                f"consumer {cfg.durable_name} of {spec.name}", lambda: self.js.add_consumer(spec.name, cfg)
            )
        except nats.js.errors.APIError as e:
            raise ProvisionError(
                f"cannot create or update consumer {cfg.durable_name!r} of stream {spec.name} "
                f"({e.description}); delete it (`nats consumer rm {spec.name} {cfg.durable_name}`) "
                "and provision again"
            ) from e

    async def _ensure_bucket(self, cfg: api.KeyValueConfig) -> None:
        what = f"KV bucket {cfg.bucket}"
        try:
            self._kv[cfg.bucket] = await self._while_leaderless(what, lambda: self.js.create_key_value(cfg))
            return
        except nats.js.errors.KeyValueLimitMarkerTTLNotSupportedError:
            log.warning("kv limit markers unsupported, expiry is silent to watchers", bucket=cfg.bucket)
            return await self._ensure_bucket(cfg.evolve(limit_marker_ttl=None))
        except nats.js.errors.BadRequestError as e:
            if e.err_code != ERR_STREAM_NAME_IN_USE:
                raise ProvisionError(f"cannot create KV bucket {cfg.bucket}: {e.description}") from e
        stream = f"KV_{cfg.bucket}"
        current = (await self._while_leaderless(what, lambda: self.js.stream_info(stream))).config
        wanted = current.evolve(
            max_msgs_per_subject=cfg.history,
            max_age=cfg.ttl,
            num_replicas=cfg.replicas,
            duplicate_window=min(120.0, cfg.ttl) if cfg.ttl else 120.0,
            subject_delete_marker_ttl=cfg.limit_marker_ttl,
        )
        try:
            await self._while_leaderless(what, lambda: self.js.update_stream(wanted))
        except nats.js.errors.APIError as e:
            raise ProvisionError(
                f"KV bucket {cfg.bucket} exists with a config that cannot be changed in place "
                f"({e.description}); delete it (`nats kv rm {cfg.bucket}`) or use a new run name"
            ) from e
        self._kv[cfg.bucket] = await self._while_leaderless(what, lambda: self.js.key_value(cfg.bucket))
        log.info("kv bucket updated", bucket=cfg.bucket)

    # -- publishing ---------------------------------------------------------------------------

    async def _stream_max_msg_size(self, spec: StreamSpec) -> int:
        size = self._max_msg_size.get(spec.name)
        if size is None:
            try:
                info = await self._while_leaderless(
                    f"stream {spec.name}", lambda: self.js.stream_info(spec.name)
                )
            except nats.js.errors.NotFoundError:
                raise StreamNotFound(
                    f"stream {spec.name} for {spec.subject} does not exist; call bus.provision() first"
                ) from None
            size = info.config.max_msg_size or -1
            self._max_msg_size[spec.name] = size
        return size

    async def _check_size(self, subject: str, spec: StreamSpec | None, size: int) -> None:
        max_payload = self.nc.max_payload
        if size > max_payload - PAYLOAD_MARGIN:
            margin = (
                f" (less {_fmt_bytes(PAYLOAD_MARGIN)} kept for protocol overhead)"
                if size <= max_payload
                else ""
            )
            raise PayloadTooLarge(
                f"{subject}: {_fmt_bytes(size)} exceeds max_payload {_fmt_bytes(max_payload)}{margin}; "
                f"raise bus.max_payload or {_shrink_hint(subject)}"
            )
        if spec is not None:
            limit = await self._stream_max_msg_size(spec)
            if 0 < limit < size:
                raise PayloadTooLarge(
                    f"{subject}: {_fmt_bytes(size)} exceeds max_msg_size {_fmt_bytes(limit)} of stream "
                    f"{spec.name}; raise bus.max_msg_bytes or {_shrink_hint(subject)}"
                )

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
        Without a ``msg_id`` an ack timeout raises nats' TimeoutError after request_timeout.

        Raises PayloadTooLarge (nothing sent), StreamNotFound, StreamUnavailable, StreamFull,
        BusPermissionError (at once, naming the subject), TypeError for an event type the
        subject does not carry.
        """
        started = time.perf_counter()
        try:
            return await self._publish(subject, event, msg_id, policy_version, leader_wait_s)
        finally:
            self.stats["publish_s"] += time.perf_counter() - started

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
        await self._check_size(subject, spec, len(payload) + _header_bytes(headers))
        if spec is None:
            await self.nc.publish(subject, payload, headers=headers)
            self.stats["published"] += 1
            return None
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
                    f"{subject}: {_fmt_bytes(len(payload))} refused by stream {spec.name} "
                    f"({e.description}); raise bus.max_msg_bytes or {_shrink_hint(subject)}"
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
                with self._refused_raises(subject):
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
                raise self._no_leader(f"stream {spec.name} ({subject})", waited, error) from error
            if retries == 0:
                log.warning("stream unavailable, retrying publish", subject=subject, error=repr(error))
            retries += 1
            self.stats["publish_retries"] += 1
            await anyio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(1.0, delay * 2)

    async def flush(self) -> None:
        """Wait until the server has everything published so far (a PING/PONG round trip)."""
        await self.nc.flush(timeout=self.options.request_timeout)

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

    async def _delivery(self, msg: Msg, spec: StreamSpec) -> Delivery | None:
        meta = msg.metadata
        started = time.perf_counter()
        try:
            event = decode(msg.data, expected_type(msg.subject))
            self.stats["decode_s"] += time.perf_counter() - started
        except DecodeError as e:
            await self._dead_letter(
                msg.subject, e.reason, msg.data, msg.headers, msg_id=f"{spec.name}:{meta.sequence.stream}"
            )
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
            ack_timeout=self.options.request_timeout,
        )

    async def _dead_letter(
        self,
        subject: str,
        reason: str,
        data: bytes,
        headers: Mapping[str, str] | None,
        msg_id: str | None = None,
    ) -> None:
        """Copy a bad payload to ``deadletter``; never raises (a lost dead letter is logged)."""
        self.stats["deadletter"] += 1
        reason = reason[:2000]
        headers = {str(k): str(v) for k, v in (headers or {}).items()}
        log.warning("dead letter", subject=subject, reason=reason, size=len(data))
        letter = DeadLetter(
            subject=subject,
            reason=reason + " (data truncated from 0000000000 to 0000000000 bytes)",
            data=b"",
            headers=headers,
            worker_id=self.worker_id,
            received_at=time.time(),
        )
        overhead = len(encode(letter)) + _header_bytes(headers_for(letter, self.run, msg_id=msg_id)) + 16
        limit = self.nc.max_payload - PAYLOAD_MARGIN
        try:
            stream_limit = await self._stream_max_msg_size(self.subjects.stream("DEADLETTER"))
        except Exception:  # not provisioned or NATS away: publish() below reports it
            stream_limit = -1
        if stream_limit > 0:
            limit = min(limit, stream_limit)
        room = max(0, limit - overhead)
        if len(data) > room:
            reason = f"{reason} (data truncated from {len(data)} to {room} bytes)"
            data = data[:room]
        try:
            await self.publish(
                self.subjects.deadletter,
                DeadLetter(
                    subject=subject,
                    reason=reason,
                    data=bytes(data),
                    headers=headers,
                    worker_id=self.worker_id,
                    received_at=letter.received_at,
                ),
                msg_id=msg_id,
            )
        except Exception as e:  # a dead letter must never stop the consumer
            self.stats["deadletter_lost"] += 1
            log.error("dead letter lost", subject=subject, reason=reason, error=repr(e))

    def subscribe(
        self, subject: str, *, queue: str = "", pending_bytes_limit: int = 64 * 2**20
    ) -> Subscription:
        """Decoded events from a core subject; ``queue`` load-balances among members."""
        if subject_suffix(subject) is None or not subject.startswith(self.subjects.prefix):
            raise ValueError(f"subject {subject!r} is not under {self.subjects.prefix}; use bus.subjects")
        if self.subjects.stream_for_subject(subject) is not None:
            log.debug("core subscribe on a stream subject", subject=subject)
        return Subscription(self, subject, queue, pending_bytes_limit)

    # -- key-value ----------------------------------------------------------------------------

    async def _bucket(self, bucket: str) -> KeyValue:
        name = self.subjects.bucket(bucket)
        kv = self._kv.get(name)
        if kv is None:
            try:
                kv = await self._while_leaderless(f"KV bucket {name}", lambda: self.js.key_value(name))
            except nats.js.errors.BucketNotFoundError:
                raise StreamNotFound(f"KV bucket {name} does not exist; call bus.provision() first") from None
            self._kv[name] = kv
        return kv

    async def _kv_call(self, bucket: str, call: Callable[[KeyValue], Awaitable[T]]) -> T:
        """``call(kv)`` on the bucket's handle, riding out a leader election (``_while_leaderless``)."""
        kv = await self._bucket(bucket)
        return await self._while_leaderless(f"KV bucket {self.subjects.bucket(bucket)}", lambda: call(kv))

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
        with self._refused_raises(self._kv_subject(bucket, key)):
            revision = await self._kv_call(bucket, lambda kv: kv.put(key, value))
        return revision

    async def kv_create(self, bucket: str, key: str, value: bytes) -> int:
        """Write only if ``key`` is absent; KvConflict otherwise."""
        kv = await self._bucket(bucket)
        try:
            with self._refused_raises(self._kv_subject(bucket, key)):
                revision = await kv.create(key, value)
        except nats.js.errors.KeyWrongLastSequenceError as e:
            raise KvConflict(f"{bucket}/{key} already exists") from e
        return revision

    async def kv_update(self, bucket: str, key: str, value: bytes, *, last: int) -> int:
        """Compare-and-set: write only if ``key``'s revision is still ``last``; KvConflict otherwise."""
        kv = await self._bucket(bucket)
        try:
            with self._refused_raises(self._kv_subject(bucket, key)):
                revision = await kv.update(key, value, last=last)
        except nats.js.errors.KeyWrongLastSequenceError as e:
            raise KvConflict(f"{bucket}/{key} changed since revision {last}; re-read and retry") from e
        return revision

    async def kv_delete(self, bucket: str, key: str) -> None:
        with self._refused_raises(self._kv_subject(bucket, key)):
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
        """Close iterators, flush and disconnect; bounded by options.drain_timeout."""
        for it in list(self._open):
            await it.aclose()
        if self.nc.is_closed:
            return
        with anyio.move_on_after(self.options.drain_timeout, shield=True):
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


__all__ = [
    "Bus",
    "BusConnectError",
    "BusError",
    "BusPermissionError",
    "ConnectOptions",
    "Consumer",
    "Delivery",
    "KvConflict",
    "KvEntry",
    "KvWatch",
    "PAYLOAD_MARGIN",
    "PayloadTooLarge",
    "ProvisionError",
    "Published",
    "StreamFull",
    "StreamNotFound",
    "StreamUnavailable",
    "Subscription",
    "connect",
]
