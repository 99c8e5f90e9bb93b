"""The servers behind one remote engine, the weights they must serve, and their health.

- `version` / `weights`: the weights every server must hold to serve: a full checkpoint directory, or
  a LoRA adapter directory served under its own name on top of a base (`Weights`). A server is usable
  when it is alive and holds `version`; `pick()` returns the usable one with the fewest streams in
  flight (ties: round robin).
- `mark_failed()`: the server is dead; its open streams are cut (their requests continue elsewhere from
  the tokens received so far) and it is probed again `health_interval_s` later.
- `probe_due()`: dead or out-of-sync servers whose probe is due are probed (one prober at a time); one
  that answers is described again (it may have restarted with another configuration) and brought to
  the current weights under `load_lock` before it serves.
- `start()` / `sync()`: describe a server, then pause -> install the weights -> reset cache -> resume it.
  It is in sync only if every step before resume succeeded; a failed resume marks it dead. Server
  errors are recorded on the server (`last_error`), never raised. A described server is taken to hold
  the checkpoint it reports (`initial_path`), so a restarted one gets its base reloaded before the
  current adapter; the adapter it served before is unloaded (a failure there is only logged).

The control calls themselves (`ServerControl`) belong to the engine of each server API.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import httpx

from areal_async.engines.remote.wire import RemoteRequestError, ServerUnavailable
from areal_async.errors import ConfigError

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from areal_async.engines.remote.gate import Gate


def adapter_name(version: int) -> str:
    """The name version `version`'s LoRA adapter has on the servers (what requests name)."""
    return f"areal-v{version}"


@dataclass(frozen=True)
class Weights:
    """What every server must hold to serve a version."""

    path: str
    """A full safetensors checkpoint directory, or with `adapter` a LoRA adapter directory."""
    adapter: str | None = None
    """The name requests use for the adapter at `path`; None: `path` holds full weights."""
    base: str | None = None
    """With an adapter: the full weights it applies to (None: each server's start-up checkpoint)."""
    rank: int = 0
    """With an adapter: its rank (servers cap the rank they accept)."""

    @property
    def full(self) -> str | None:
        """The full weights servers hold under these weights (None: their start-up checkpoints)."""
        return self.base if self.adapter is not None else self.path


@dataclass(eq=False)
class Server:
    """What the engine knows about one server. `version` = -1: its weights are unknown."""

    url: str
    alive: bool = False
    version: int = -1
    inflight: int = 0
    attempts: int = 0
    failures: int = 0
    last_error: str = ""
    initial_path: str | None = None
    """The checkpoint the server was started with (re-loaded on revival before any load_weights)."""
    base: str | None = None
    """The full weights the server holds now (None: unknown)."""
    adapter: str | None = None
    """The adapter this engine last had the server load (None: none)."""
    next_probe_at: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "alive": self.alive,
            "version": self.version,
            "inflight": self.inflight,
            "attempts": self.attempts,
            "failures": self.failures,
            "last_error": self.last_error,
        }


class ServerControl(Protocol):
    """The control calls of one server API (RemoteEngine's hooks; see engines/remote/engine.py)."""

    async def _describe(self, server: Server) -> None: ...
    async def _is_healthy(self, server: Server) -> bool: ...
    async def _pause(self, server: Server) -> None: ...
    async def _reload(self, server: Server, path: str, version: int) -> None: ...
    async def _load_adapter(self, server: Server, name: str, path: str) -> None: ...
    async def _unload_adapter(self, server: Server, name: str) -> None: ...
    def _lora_problem(self, server: Server, rank: int) -> str | None: ...
    async def _reset_cache(self, server: Server) -> None: ...
    async def _resume(self, server: Server) -> None: ...


def normalize_urls(server_urls: Sequence[str], *, kind: str) -> list[str]:
    """Validated, de-duplicated base URLs without a trailing slash."""
    if isinstance(server_urls, str):
        server_urls = [server_urls]
    urls = [str(u).strip().rstrip("/") for u in server_urls]
    if not urls:
        raise ConfigError(
            f"rollout.server_urls is empty; rollout.engine={kind} needs at least one server URL, "
            "e.g. --set 'rollout.server_urls=[\"http://127.0.0.1:8011\"]'"
        )
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"rollout.server_urls: {url!r} is not an http(s) URL (e.g. http://host:8011)")
    if len(set(urls)) != len(urls):
        raise ConfigError(f"rollout.server_urls lists a server twice: {urls}")
    return urls


class ServerPool:
    """The servers of one engine and the weights (`version`, `weights`) they must serve."""

    def __init__(
        self,
        server_urls: Sequence[str],
        *,
        kind: str,
        control: ServerControl,
        gate: Gate,
        version: int,
        health_interval_s: float,
        log: FilteringBoundLogger,
    ) -> None:
        self.servers = [Server(url) for url in normalize_urls(server_urls, kind=kind)]
        self.version = version
        self.weights: Weights | None = None
        """What the servers were last told to load (None: each keeps its start-up checkpoint)."""
        self.load_lock = anyio.Lock()
        """Held while servers' weights change, by a weight load or a revival."""
        self.health_interval_s = health_interval_s
        self._control = control
        self._gate = gate
        self._log = log
        self._probe_lock = anyio.Lock()
        self._next_server = 0

    def is_usable(self, server: Server) -> bool:
        return server.alive and server.version == self.version

    def pick(self) -> Server | None:
        usable = [s for s in self.servers if self.is_usable(s)]
        if not usable:
            return None
        fewest = min(s.inflight for s in usable)
        candidates = [s for s in usable if s.inflight == fewest]
        server = candidates[self._next_server % len(candidates)]
        self._next_server += 1
        return server

    @property
    def adapter(self) -> str | None:
        """The adapter name requests must use now (None: the served model itself)."""
        return self.weights.adapter if self.weights is not None else None

    def weights_for(self, server: Server) -> Weights | None:
        """What `server` must load to serve the current version (None: unknown)."""
        if self.weights is not None:
            return self.weights
        return Weights(server.initial_path) if server.initial_path else None

    def errors(self) -> str:
        """Each server's state and last error, for error messages."""
        parts = []
        for s in self.servers:
            state = "ok" if self.is_usable(s) else ("out of sync" if s.alive else "dead")
            parts.append(f"{s.url}: {state}" + (f", last error: {s.last_error}" if s.last_error else ""))
        return "; ".join(parts)

    def mark_failed(self, server: Server, exc: BaseException) -> None:
        server.failures += 1
        server.last_error = f"{type(exc).__name__}: {exc}"
        if server.alive:
            self._log.warning("server failed; marked dead", url=server.url, error=server.last_error)
        server.alive = False
        server.next_probe_at = time.monotonic() + self.health_interval_s
        # Its other streams may hang rather than fail: cut them now; they continue elsewhere.
        self._gate.cancel(server)

    async def start(self, server: Server) -> None:
        """Describe the server, then load the weights this engine serves: a server used by an
        earlier run (or left paused by a crashed engine) may hold other weights."""
        try:
            await self._control._describe(server)
        except ServerUnavailable as exc:
            server.last_error = str(exc)
            return
        except httpx.HTTPError as exc:
            server.last_error = f"{type(exc).__name__}: {exc}"
            return
        server.base = server.initial_path
        weights = self.weights_for(server)
        if weights is None:
            server.last_error = "its initial checkpoint is unknown; cannot tell which weights it serves"
            return
        server.alive = True
        server.last_error = ""
        await self.sync(server, weights, self.version)

    async def probe_due(self) -> None:
        """Probe dead / out-of-sync servers whose probe is due; bring a live one to current weights."""
        now = time.monotonic()
        due = [s for s in self.servers if not self.is_usable(s) and s.next_probe_at <= now]
        if not due or self._probe_lock.locked():
            return
        async with self._probe_lock:
            for server in due:
                server.next_probe_at = time.monotonic() + self.health_interval_s
                if not await self._control._is_healthy(server):
                    continue
                try:  # it may have restarted with another configuration
                    await self._control._describe(server)
                except (ServerUnavailable, RemoteRequestError, httpx.HTTPError) as exc:
                    server.last_error = f"{type(exc).__name__}: {exc}"
                    continue
                except ConfigError as exc:
                    server.last_error = str(exc)
                    self._log.error(
                        "revived server is misconfigured; not used", url=server.url, error=str(exc)
                    )
                    continue
                async with self.load_lock:
                    if self.is_usable(server):
                        continue
                    server.base = server.initial_path
                    weights = self.weights_for(server)
                    if weights is None:
                        server.last_error = (
                            "revived, but its initial checkpoint is unknown; restart the engine"
                        )
                        continue
                    server.alive = True
                    await self.sync(server, weights, self.version)
                if self.is_usable(server):
                    self._log.info("server revived", url=server.url, policy_version=self.version)

    async def sync(
        self,
        server: Server,
        weights: Weights,
        version: int,
        receive: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """pause -> install `weights` (``receive()`` when given: an in-memory transfer) -> reset cache
        -> resume on one server; marks it in sync or not."""
        server.version = -1
        step = "pause"
        try:
            await self._control._pause(server)
            step = "load"
            if receive is not None:
                await receive()
                server.base, server.adapter = weights.path, None
            else:
                await self._install(server, weights, version)
            step = "reset cache"
            await self._control._reset_cache(server)
            server.version = version
        except (ServerUnavailable, RemoteRequestError, httpx.HTTPError) as exc:
            server.last_error = f"{step}: {type(exc).__name__}: {exc}"
            self._log.error(
                "weights sync failed", url=server.url, policy_version=version, error=server.last_error
            )
        finally:
            try:
                await self._control._resume(server)
            except (ServerUnavailable, RemoteRequestError, httpx.HTTPError) as exc:
                self.mark_failed(server, exc)

    async def _install(self, server: Server, weights: Weights, version: int) -> None:
        """Bring the (paused) server to `weights`: reload full weights, or load the adapter (after its
        base, where the server holds other full weights); then unload the adapter it served before."""
        control = self._control
        if weights.adapter is None:
            await control._reload(server, weights.path, version)
            server.base = weights.path
        else:
            problem = control._lora_problem(server, weights.rank)
            if problem is not None:
                raise RemoteRequestError(problem)
            base = weights.base or server.initial_path
            if base is not None and server.base != base:
                await control._reload(server, base, version)
                server.base = base
            await control._load_adapter(server, weights.adapter, weights.path)
        previous, server.adapter = server.adapter, weights.adapter
        if previous is not None and previous != weights.adapter:
            try:
                await control._unload_adapter(server, previous)
            except (ServerUnavailable, RemoteRequestError, httpx.HTTPError) as exc:  # e.g. it restarted
                self._log.warning("adapter not unloaded", url=server.url, adapter=previous, error=str(exc))
