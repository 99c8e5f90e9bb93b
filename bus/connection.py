"""How a worker reaches NATS: ``connect()`` with ``ConnectOptions`` (``bus.options``).

Contract:

* ``await connect(options, run)`` either returns a connected ``Bus`` within
  ``options.connect_timeout_s`` or raises ``BusConnectError`` naming the URL and the fix.
  Credentials or certificates the server rejects fail at once (retrying cannot cure them).
* After the first connect the client reconnects forever (bounded exponential backoff,
  ``reconnect_wait_min_s`` .. ``reconnect_wait_max_s``, least-tried server first); losing NATS
  pauses the worker, it never kills it.
* Every permission refusal the server reports (``-ERR``) is logged (``nats permission
  denied``), counted in ``bus.stats['permission_denied']`` and fails the JetStream request
  waiting on that subject with ``BusPermissionError`` (``bus.refusals``); the connection
  stays up.

``ConnectOptions`` defaults equal those of ``areal_async.config.BusConfig`` for the settings
both have (same names); workers build their options from the run file (``workers.runtime``).
"""

from __future__ import annotations

import os
import random
import ssl
import time
from collections.abc import Callable
from typing import Any

import anyio
import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.client import Server

from bus.client import Bus
from bus.errors import BusConnectError
from bus.options import ConnectOptions
from bus.refusals import refused
from bus.subjects import validate_run_name

log = structlog.get_logger()


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
    """Connect to NATS for run ``run``; BusConnectError if it fails within connect_timeout_s."""
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
        denied = refused(e)
        if denied is not None:
            operation, subject = denied
            logger.warning("nats permission denied", subject=subject, operation=operation, user=options.user)
            if bus is not None:
                bus.permission_denied(subject)
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
        connect_timeout=min(options.connect_timeout_s, 2.0),
        reconnect_time_wait=options.reconnect_wait_min_s,
        max_reconnect_attempts=-1,
        reconnect_to_server_handler=_backoff(options.reconnect_wait_min_s, options.reconnect_wait_max_s),
        drain_timeout=options.drain_timeout_s,
        token=options.token,
        user=options.user,
        password=options.password,
        user_credentials=_check_file(options, "creds"),
        nkeys_seed=_check_file(options, "nkeys_seed"),
        tls=_tls_context(options),
    )
    t0 = time.monotonic()
    with anyio.move_on_after(options.connect_timeout_s):
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
            f"could not connect to NATS at {', '.join(urls)} within {options.connect_timeout_s:g}s ({why}); "
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
