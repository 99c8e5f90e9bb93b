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

The names below load their module on first use, so that importing one light module of the package
(``bus.subjects``, ``bus.role_permissions``) does not import the NATS client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_HOMES = {
    "Bus": "bus.client",
    "BusConnectError": "bus.errors",
    "BusError": "bus.errors",
    "BusPermissionError": "bus.errors",
    "ConnectOptions": "bus.options",
    "Consumer": "bus.iterators",
    "DecodeError": "bus.events",
    "Delivery": "bus.iterators",
    "EmbeddedServer": "bus.embedded",
    "EmbeddedServerError": "bus.embedded",
    "KvConflict": "bus.errors",
    "KvEntry": "bus.iterators",
    "KvWatch": "bus.iterators",
    "NoResponders": "bus.errors",
    "PayloadTooLarge": "bus.errors",
    "ProvisionError": "bus.errors",
    "Published": "bus.client",
    "Request": "bus.iterators",
    "Requests": "bus.iterators",
    "StreamFull": "bus.errors",
    "StreamNotFound": "bus.errors",
    "StreamSpec": "bus.subjects",
    "StreamUnavailable": "bus.errors",
    "Subjects": "bus.subjects",
    "Subscription": "bus.iterators",
    "connect": "bus.connection",
    "decode": "bus.events",
    "encode": "bus.events",
    "events": "bus.events",
    "find_nats_server": "bus.embedded",
    "validate_run_name": "bus.subjects",
}
"""Each exported name -> the module that defines it."""


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'bus' has no attribute {name!r}")
    module = importlib.import_module(home)
    value = module if name == "events" else getattr(module, name)
    globals()[name] = value
    return value


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
