"""Creating the run's JetStream resources: every stream, durable consumer and KV bucket.

Contract: ``bus.provision()`` (``provision_run``) is idempotent and safe to call from every
worker at once. A changed setting is updated in place where JetStream allows it, else
``ProvisionError`` says what to delete. Requests that time out or get 503 (a cluster still
electing its meta leader, or busy creating the replicas another worker asked for) are retried
for up to ``options.leader_wait_s``, then ``StreamUnavailable``.

What is created comes from ``bus.subjects`` (``Subjects.streams``, ``state_bucket``,
``workers_bucket``, and ``weights_bucket`` when asked for): work-queue streams discard new messages when full (work is never dropped,
``publish`` raises StreamFull), limits streams drop the oldest.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

import nats.js.errors
import structlog
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from bus.elections import Connected, while_leaderless
from bus.errors import ProvisionError
from bus.subjects import Streams, StreamSpec, Subjects


class Provisioning(Connected, Protocol):
    """What provisioning needs of a ``Bus``: JetStream, the run's names, and where to cache what
    it created."""

    js: JetStreamContext
    run: str
    subjects: Subjects

    def remember_stream_limit(self, stream: str, max_msg_size: int) -> None: ...
    def remember_bucket(self, name: str, kv: KeyValue) -> None: ...


log = structlog.get_logger()

ERR_STREAM_NAME_IN_USE = 10058  # stream exists with a different config


def _per_stream(value: float | int | Mapping[str, Any], key: str, default: Any) -> Any:
    if isinstance(value, Mapping):
        return value.get(key, default)
    return value


async def provision_run(
    bus: Provisioning,
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
    weights_bucket: bool = False,
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
        weights_bucket: also create the object store of the policy versions
            (``weight_sync.transport: bus``).
    """
    t0 = time.monotonic()
    with_consumer = {spec.key for spec in bus.subjects.streams if spec.consumer}
    for name, value in (("ack_wait", ack_wait), ("max_ack_pending", max_ack_pending)):
        if isinstance(value, Mapping) and set(value) - with_consumer:
            raise ValueError(
                f"provision({name}=...): unknown stream keys {sorted(set(value) - with_consumer)}; "
                f"use {sorted(with_consumer)}"
            )
    server_max = bus.nc.max_payload
    max_msg = server_max if max_msg_bytes is None else max_msg_bytes
    if max_msg > server_max:
        raise ValueError(
            f"max_msg_bytes {max_msg} exceeds the server's max_payload {server_max}; "
            "raise max_payload in the nats-server config or lower bus.max_msg_bytes"
        )
    for spec in bus.subjects.streams:
        work_queue = spec.retention == "work_queue"
        cfg = api.StreamConfig(
            name=spec.name,
            subjects=[spec.subject],
            retention=api.RetentionPolicy.WORK_QUEUE if work_queue else api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            num_replicas=replicas,
            max_msg_size=max_msg,
            max_bytes=max_stream_bytes if work_queue else -1,
            max_msgs=deadletter_max_msgs if spec.key == Streams.DEADLETTER else -1,
            discard=api.DiscardPolicy.NEW if work_queue else api.DiscardPolicy.OLD,
            duplicate_window=duplicate_window,
        )
        await _ensure_stream(bus, cfg)
        bus.remember_stream_limit(spec.name, max_msg)
        if spec.consumer is not None:
            await _ensure_consumer(
                bus,
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
    await _ensure_bucket(
        bus,
        api.KeyValueConfig(
            bucket=bus.subjects.state_bucket,
            history=state_history,
            replicas=replicas,
            storage=api.StorageType.FILE,
        ),
    )
    await _ensure_bucket(
        bus,
        api.KeyValueConfig(
            bucket=bus.subjects.workers_bucket,
            history=1,
            ttl=heartbeat_ttl,
            replicas=replicas,
            storage=api.StorageType.FILE,
            limit_marker_ttl=max(1.0, heartbeat_ttl),
        ),
    )
    if weights_bucket:
        await _ensure_object_store(bus, bus.subjects.weights_bucket, replicas)
    log.info(
        "bus provisioned",
        run=bus.run,
        streams=len(bus.subjects.streams),
        max_msg_bytes=max_msg,
        seconds=round(time.monotonic() - t0, 3),
    )


async def _ensure_stream(bus: Provisioning, cfg: api.StreamConfig) -> api.StreamInfo:
    what = f"stream {cfg.name}"
    try:
        return await while_leaderless(bus, what, lambda: bus.js.add_stream(cfg))
    except nats.js.errors.BadRequestError as e:
        if e.err_code != ERR_STREAM_NAME_IN_USE:
            raise ProvisionError(f"cannot create stream {cfg.name}: {e.description}") from e
    try:
        info = await while_leaderless(bus, what, lambda: bus.js.update_stream(cfg))
    except nats.js.errors.APIError as e:
        raise ProvisionError(
            f"stream {cfg.name} exists with a config that cannot be changed in place "
            f"({e.description}); delete it (`nats stream rm {cfg.name}`) or use a new run name"
        ) from e
    log.info("stream updated", stream=cfg.name)
    return info


async def _ensure_consumer(bus: Provisioning, spec: StreamSpec, cfg: api.ConsumerConfig) -> None:
    try:
        await while_leaderless(
            bus, f"consumer {cfg.durable_name} of {spec.name}", lambda: bus.js.add_consumer(spec.name, cfg)
        )
    except nats.js.errors.APIError as e:
        raise ProvisionError(
            f"cannot create or update consumer {cfg.durable_name!r} of stream {spec.name} "
            f"({e.description}); delete it (`nats consumer rm {spec.name} {cfg.durable_name}`) "
            "and provision again"
        ) from e


async def _ensure_bucket(bus: Provisioning, cfg: api.KeyValueConfig) -> None:
    what = f"KV bucket {cfg.bucket}"
    try:
        bus.remember_bucket(
            cfg.bucket, await while_leaderless(bus, what, lambda: bus.js.create_key_value(cfg))
        )
        return
    except nats.js.errors.KeyValueLimitMarkerTTLNotSupportedError:
        log.warning("kv limit markers unsupported, expiry is silent to watchers", bucket=cfg.bucket)
        return await _ensure_bucket(bus, cfg.evolve(limit_marker_ttl=None))
    except nats.js.errors.BadRequestError as e:
        if e.err_code != ERR_STREAM_NAME_IN_USE:
            raise ProvisionError(f"cannot create KV bucket {cfg.bucket}: {e.description}") from e
    stream = f"KV_{cfg.bucket}"
    current = (await while_leaderless(bus, what, lambda: bus.js.stream_info(stream))).config
    wanted = current.evolve(
        max_msgs_per_subject=cfg.history,
        max_age=cfg.ttl,
        num_replicas=cfg.replicas,
        duplicate_window=min(120.0, cfg.ttl) if cfg.ttl else 120.0,
        subject_delete_marker_ttl=cfg.limit_marker_ttl,
    )
    try:
        await while_leaderless(bus, what, lambda: bus.js.update_stream(wanted))
    except nats.js.errors.APIError as e:
        raise ProvisionError(
            f"KV bucket {cfg.bucket} exists with a config that cannot be changed in place "
            f"({e.description}); delete it (`nats kv rm {cfg.bucket}`) or use a new run name"
        ) from e
    bus.remember_bucket(cfg.bucket, await while_leaderless(bus, what, lambda: bus.js.key_value(cfg.bucket)))
    log.info("kv bucket updated", bucket=cfg.bucket)


async def _ensure_object_store(bus: Provisioning, bucket: str, replicas: int) -> None:
    """The object store ``bucket`` (stream ``OBJ_<bucket>``); one that exists is kept as it is."""
    what = f"object store {bucket}"
    try:
        await while_leaderless(bus, what, lambda: bus.js.object_store(bucket))
        return
    except nats.js.errors.BucketNotFoundError:
        pass
    config = api.ObjectStoreConfig(bucket=bucket, replicas=replicas, storage=api.StorageType.FILE)
    try:
        await while_leaderless(bus, what, lambda: bus.js.create_object_store(bucket, config))
    except nats.js.errors.BadRequestError as e:
        if e.err_code != ERR_STREAM_NAME_IN_USE:  # another worker created it first
            raise ProvisionError(f"cannot create {what}: {e.description}") from e
