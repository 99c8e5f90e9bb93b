"""``ConnectOptions``: how a worker reaches NATS (servers, credentials, TLS, timeouts).

Defaults equal those of ``areal_async.config.BusConfig`` for the settings both have (same names);
workers build their options from the run file (``workers.runtime``). Used by ``bus.connection``
(connecting) and by the ``Bus`` it returns (timeouts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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

    connect_timeout_s: float = 10.0
    """Total budget for the first connect, all servers and retries included."""

    reconnect_wait_min_s: float = 0.2
    """First reconnect delay; doubles per failed attempt (with jitter) up to reconnect_wait_max_s."""

    reconnect_wait_max_s: float = 5.0
    """Upper bound of the reconnect backoff after a connection was established."""

    max_reconnect_attempts: int = -1
    """Reconnect attempts per server after the first connect; -1 = forever."""

    request_timeout_s: float = 5.0
    """JetStream API and publish-ack timeout."""

    leader_wait_s: float = 30.0
    """How long publish and consumers wait for a stream or consumer without a leader (a
    JetStream election takes 6-8 s after a node dies) before raising StreamUnavailable."""

    drain_timeout_s: float = 5.0
    """Upper bound of close()."""

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("ConnectOptions.url is empty; set bus.url, e.g. nats://127.0.0.1:4222")
        for name in ("connect_timeout_s", "reconnect_wait_min_s", "request_timeout_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ConnectOptions.{name} must be > 0, got {getattr(self, name)}")
        if self.leader_wait_s < 0:
            raise ValueError(f"ConnectOptions.leader_wait_s must be >= 0, got {self.leader_wait_s}")
        if self.reconnect_wait_max_s < self.reconnect_wait_min_s:
            raise ValueError(
                f"ConnectOptions.reconnect_wait_max_s ({self.reconnect_wait_max_s}) must be >= "
                f"reconnect_wait_min_s ({self.reconnect_wait_min_s})"
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
