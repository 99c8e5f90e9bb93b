"""Riding out JetStream leader elections.

A stream or consumer whose leader node died has no leader for the 6-8 s of an election (longer
when a cluster lost its quorum). JetStream requests meanwhile time out or get 503.
``while_leaderless`` retries such a request with jittered exponential backoff (50 ms doubling
to 1 s) for up to ``options.leader_wait_s``, then raises ``StreamUnavailable`` saying whether
the client is disconnected or the cluster has no leader. A closed client is not waited for.

Used for provisioning, consumer start, stream info and the KV calls; ``Bus.publish`` has its
own loop because a publish that timed out may have been stored.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import anyio
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS

from bus.errors import StreamUnavailable
from bus.options import ConnectOptions

log = structlog.get_logger()

T = TypeVar("T")


class Connected(Protocol):
    """What riding out an election needs of a ``Bus``: its connection and options."""

    nc: NATS
    options: ConnectOptions


ERR_CLUSTER_NOT_AVAILABLE = 10008  # 503 "JetStream system temporarily unavailable" (no meta leader)

LEADERLESS = (
    TimeoutError,
    nats.js.errors.ServiceUnavailableError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
)
"""What a JetStream API request (or a KV write, a JetStream publish underneath) gets while its
stream or consumer has no leader (nats-py's TimeoutError subclasses the builtin one)."""


def no_leader(bus: Connected, what: str, waited: float, error: BaseException) -> StreamUnavailable:
    why = (
        "not connected to NATS (reconnecting)"
        if not bus.nc.is_connected
        else "no leader: election or lost quorum; check that a majority of the NATS cluster is up"
    )
    return StreamUnavailable(f"{what} did not answer for {waited:.1f}s ({error!r}): {why}")


async def while_leaderless(bus: Connected, what: str, call: Callable[[], Awaitable[T]]) -> T:
    """``call()`` (a JetStream API request), retried while ``what`` has no leader (timeout,
    503) and the client is not closed, up to options.leader_wait_s; then StreamUnavailable."""
    started = time.monotonic()
    delay, retries = 0.05, 0
    while True:
        try:
            result = await call()
        except LEADERLESS as e:
            waited = time.monotonic() - started
            if bus.nc.is_closed:
                raise
            if waited + delay > bus.options.leader_wait_s:
                raise no_leader(bus, what, waited, e) from e
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
