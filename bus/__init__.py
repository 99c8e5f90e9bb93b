"""The messaging layer: subjects, event schemas, NATS/JetStream plumbing, embedded server.

Knows nothing of torch, models or ``areal_async``. Workers use it like this::

    from bus import ConnectOptions, connect, events

    bus = await connect(ConnectOptions(url="nats://127.0.0.1:4222", name="reward-0"), run="r1")
    await bus.provision()                      # idempotent; every worker may call it
    async with bus.consume("GENERATED") as deliveries:
        async for d in deliveries:             # d.event is a validated RolloutGroup
            scored = score(d.event)
            await bus.publish(bus.subjects.rollout_scored, scored,
                              msg_id=f"{d.event.task_id}:{d.event.attempt}")
            await d.ack()
    await bus.close()

See ``bus.client`` for the delivery guarantees, ``bus.connection`` for connecting, ``bus.errors``
for the errors and ``bus.events`` for the wire format.
"""

from bus import events
from bus.client import Bus, Published
from bus.connection import connect
from bus.embedded import EmbeddedServer, EmbeddedServerError, find_nats_server
from bus.errors import (
    BusConnectError,
    BusError,
    BusPermissionError,
    KvConflict,
    NoResponders,
    PayloadTooLarge,
    ProvisionError,
    StreamFull,
    StreamNotFound,
    StreamUnavailable,
)
from bus.events import DecodeError, decode, encode
from bus.iterators import Consumer, Delivery, KvEntry, KvWatch, Request, Requests, Subscription
from bus.options import ConnectOptions
from bus.subjects import StreamSpec, Subjects, validate_run_name

__all__ = [
    "Bus",
    "BusConnectError",
    "BusError",
    "BusPermissionError",
    "ConnectOptions",
    "Consumer",
    "DecodeError",
    "Delivery",
    "EmbeddedServer",
    "EmbeddedServerError",
    "KvConflict",
    "KvEntry",
    "KvWatch",
    "NoResponders",
    "PayloadTooLarge",
    "ProvisionError",
    "Published",
    "Request",
    "Requests",
    "StreamFull",
    "StreamNotFound",
    "StreamSpec",
    "StreamUnavailable",
    "Subjects",
    "Subscription",
    "connect",
    "decode",
    "encode",
    "events",
    "find_nats_server",
    "validate_run_name",
]
