"""RemoteEngine: the InferenceEngine on HTTP servers of any API (the contract: remote/__init__.py).

Here: the public API (start, generate, load_weights, health, aclose), the attempt loop of one request
and the HTTP control helpers. A subclass speaks one server API through the hooks `_describe`,
`_stream`, `_pause`, `_reload`, `_load_adapter`, `_unload_adapter`, `_reset_cache`, `_resume`
(optionally `_prepare_weights`, `_weights_released`, `_check_request`, `_lora_problem`). Routing and
server health: pool.py; the load gate and the open streams: gate.py; a request's progress across
attempts: continuation.py.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import structlog

from areal_async import lora
from areal_async.engines.base import (
    EngineClosedError,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
)
from areal_async.engines.remote.continuation import Attempt, Continuation
from areal_async.engines.remote.gate import Gate
from areal_async.engines.remote.pool import Server, ServerPool, Weights, adapter_name
from areal_async.engines.remote.wire import (
    Piece,
    RemoteRequestError,
    ServerUnavailable,
    iter_sse_json,
    raise_for_status,
)
from areal_async.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = structlog.get_logger(__name__)


class RemoteEngine(InferenceEngine):
    """Base of the HTTP engines; subclasses speak one server API (see engines/remote/__init__.py)."""

    kind: str = "remote"

    def __init__(
        self,
        server_urls: Sequence[str],
        *,
        engine_id: str | None = None,
        version: int = 0,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        control_timeout_s: float = 300.0,
        startup_timeout_s: float = 60.0,
        server_wait_s: float = 300.0,
        health_interval_s: float = 2.0,
        max_retries: int = 5,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        for name, value in (
            ("connect_timeout_s", connect_timeout_s),
            ("read_timeout_s", read_timeout_s),
            ("control_timeout_s", control_timeout_s),
            ("server_wait_s", server_wait_s),
            ("health_interval_s", health_interval_s),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        if startup_timeout_s < 0:
            raise ValueError(f"startup_timeout_s must be >= 0, got {startup_timeout_s!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries!r}")
        self.engine_id = engine_id or f"{self.kind}-{uuid.uuid4().hex[:8]}"
        self._log = log.bind(engine_id=self.engine_id, kind=self.kind)
        self.gate = Gate()
        self.pool = ServerPool(
            server_urls,
            kind=self.kind,
            control=self,
            gate=self.gate,
            version=version,
            health_interval_s=health_interval_s,
            log=self._log,
        )
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.control_timeout_s = control_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.server_wait_s = server_wait_s
        self.health_interval_s = health_interval_s
        self.max_retries = max_retries
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._status = "created"
        self._closing = False
        self.requests_done = 0
        self.tokens_received = 0
        self.tokens_generated = 0
        self.interruptions = 0
        self.weight_loads = 0

    # ------------------------------------------------------------- server API (subclasses)

    @abc.abstractmethod
    async def _describe(self, server: Server) -> None:
        """Check the server is up and configured as we need; fill `server.info` / `initial_path`.

        Raises ServerUnavailable when it does not answer, ConfigError when it is misconfigured.
        """

    @abc.abstractmethod
    def _stream(self, server: Server, request: GenerationRequest, attempt: Attempt) -> AsyncIterator[Piece]:
        """Stream one attempt of `request`: yields the tokens as they arrive (an async generator)."""

    @abc.abstractmethod
    async def _pause(self, server: Server) -> None:
        """Stop generating and abort every request on the server."""

    @abc.abstractmethod
    async def _reload(self, server: Server, path: str, version: int) -> None:
        """Load the safetensors checkpoint directory `path` into the (paused) server."""

    @abc.abstractmethod
    async def _load_adapter(self, server: Server, name: str, path: str) -> None:
        """Load the LoRA adapter directory `path` into the (paused) server under `name`; succeeds also
        when the server holds `name` already (a server that was only unreachable keeps its adapters)."""

    @abc.abstractmethod
    async def _unload_adapter(self, server: Server, name: str) -> None:
        """Unload the LoRA adapter `name` (no request uses it)."""

    def _lora_problem(self, server: Server, rank: int) -> str | None:
        """Why `server` cannot serve a rank-`rank` LoRA adapter, naming the fix; None: it can, as far as
        its description tells."""
        return None

    @abc.abstractmethod
    async def _reset_cache(self, server: Server) -> None:
        """Drop KV / prefix caches built with the old weights."""

    @abc.abstractmethod
    async def _resume(self, server: Server) -> None:
        """Let the server generate again."""

    async def _prepare_weights(self, path: str, version: int) -> str:
        """The directory the servers should load for checkpoint `path` (default: `path` itself)."""
        return path

    async def _weights_released(self, path: str) -> None:  # noqa: B027 (optional hook)
        """`path` (from _prepare_weights) is no longer served by any server."""

    async def _is_healthy(self, server: Server) -> bool:
        try:
            response = await self.client.get(f"{server.url}/health", timeout=self.connect_timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def _check_request(self, request: GenerationRequest) -> None:  # noqa: B027 (optional hook)
        """Reject what this server kind cannot do exactly (ValueError naming the field and the fix)."""

    # ------------------------------------------------------------------- public API

    @property
    def version(self) -> int:
        return self.pool.version

    @property
    def group_ranks(self) -> int:
        """Ranks this engine takes in a weight-transfer group: one per configured server."""
        return len(self.pool.servers)

    def group_problem(self) -> str | None:
        """Why the servers cannot receive a group transfer now (every one must be live), or None."""
        live = sum(s.alive for s in self.pool.servers)
        if live != self.group_ranks:
            return f"{live} of {self.group_ranks} servers are live; the group needs all of them"
        return None

    @property
    def servers(self) -> list[Server]:
        return self.pool.servers

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise EngineClosedError(f"engine {self.engine_id} is not started; call `await engine.start()`")
        return self._client

    async def start(self) -> None:
        if self._client is not None:
            return
        timeout = httpx.Timeout(
            connect=self.connect_timeout_s, read=self.read_timeout_s, write=30.0, pool=None
        )
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits, transport=self._transport)
        self.gate.wake()
        servers = self.servers
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                for server in servers:
                    if not server.alive:
                        await self.pool.start(server)
                if all(s.alive for s in servers):
                    break
                if time.monotonic() >= deadline:
                    if any(s.alive for s in servers):
                        break
                    raise RuntimeError(
                        f"{self.kind} engine {self.engine_id}: no server answered within "
                        f"{self.startup_timeout_s:.0f} s ({self.pool.errors()}); start the servers "
                        "(scripts/serve_vllm.sh for vLLM) or fix rollout.server_urls"
                    )
                await anyio.sleep(min(1.0, self.health_interval_s))
        except BaseException:
            await self._client.aclose()
            self._client = None
            raise
        self._status = "running"
        self._log.info(
            "engine started",
            servers=[s.url for s in servers],
            alive=[s.url for s in servers if s.alive],
            version=self.pool.version,
        )

    async def aclose(self) -> None:
        if self._status == "closed":
            return
        self._closing = True
        self.gate.wake()  # waiters wake up and see _closing
        self.gate.cancel()
        with anyio.move_on_after(10):
            await self.gate.wait_idle()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        self._status = "closed"
        self._log.info("engine closed", requests_done=self.requests_done, tokens=self.tokens_generated)

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        if not requests:
            return []
        for request in requests:
            self._check_request(request)
        self._ensure_running()
        results: list[GenerationResult | None] = [None] * len(requests)
        errors: list[BaseException] = []

        async def complete(index: int, request: GenerationRequest, tg: anyio.abc.TaskGroup) -> None:
            try:
                results[index] = await self._complete(request)
            except Exception as exc:  # the first failure fails the call; the rest are cancelled
                errors.append(exc)
                tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            for index, request in enumerate(requests):
                tg.start_soon(complete, index, request, tg)
        if errors:
            raise errors[0]
        assert all(r is not None for r in results)
        return list(results)  # type: ignore[arg-type]

    group_transports: tuple[str, ...] = ()
    """In-memory transports the servers receive versions by (``_receive``); none: disk only."""

    async def _receive(self, server: Server, call: Mapping[str, str]) -> None:
        """Have the (paused) server join the trainer's group and receive one version (``call``:
        ``areal_async.engines.vllm_worker`` arguments, ``rank_offset`` this server's rank)."""
        raise NotImplementedError(f"{type(self).__name__} receives weights only from disk")

    async def load_weights(
        self,
        version: int,
        location: str | os.PathLike[str] | Mapping[str, torch.Tensor],
        *,
        group: Mapping[str, str] | None = None,
    ) -> float:
        """Load ``location`` (a directory the servers read: full weights or a LoRA adapter, see the
        module docstring), or, with ``group``, receive the version from the trainer's process group:
        every live server takes a rank from ``group["rank_offset"]`` on (``group_ranks``), and all must
        receive it or this raises."""
        if isinstance(location, Mapping):
            raise ValueError(
                f"{type(self).__name__} loads weights from a safetensors directory the servers can read, "
                "not an in-memory state dict; save it with save_pretrained() and pass the directory"
            )
        self._ensure_running()
        pool = self.pool
        started = time.perf_counter()
        location = os.fspath(location)
        rank = await anyio.to_thread.run_sync(lora.adapter_rank, location)
        if rank is not None and group is not None:
            raise ValueError(
                f"{location} is a LoRA adapter directory; in-memory transfers carry full weights only. "
                "Load adapters from disk (weight_sync.transport: disk)"
            )
        if rank is None and group is None:
            path = await self._prepare_weights(location, version)
        else:  # an adapter, or the disk copy of a transfer (revivals reload it), as it is
            path = location
        prepared_s = time.perf_counter() - started
        async with pool.load_lock:
            if rank is None:
                weights = Weights(path)
            else:
                for server in pool.servers:
                    problem = self._lora_problem(server, rank) if server.alive else None
                    if problem is not None:
                        raise ConfigError(problem)
                base = pool.weights.full if pool.weights is not None else None
                weights = Weights(path, adapter=adapter_name(version), base=base, rank=rank)
            self.gate.close()
            try:
                interrupted = await self.gate.drain()
                drained_s = time.perf_counter() - started - prepared_s
                targets = [s for s in pool.servers if s.alive]
                problem = self.group_problem() if group is not None else None
                if problem is not None:
                    raise RuntimeError(problem)
                async with anyio.create_task_group() as tg:
                    for i, server in enumerate(targets):
                        receive = None
                        if group is not None:
                            call = {**group, "rank_offset": str(int(group["rank_offset"]) + i)}
                            receive = functools.partial(self._receive, server, call)
                        tg.start_soon(pool.sync, server, weights, version, receive)
                loaded = [s for s in targets if s.version == version]
                if group is not None and len(loaded) != len(targets):
                    raise RuntimeError(f"in-memory transfer failed on some servers: {pool.errors()}")
                if not loaded:
                    what = "a LoRA adapter directory" if rank is not None else "a safetensors directory"
                    raise RuntimeError(
                        f"{self.kind} engine {self.engine_id}: no server loaded weights v{version} from "
                        f"{path} ({pool.errors()}); the path must be {what} readable by the servers"
                    )
                pool.version = version
                previous, pool.weights = pool.weights, weights
                self.weight_loads += 1
            finally:
                self.gate.open()
        seconds = time.perf_counter() - started
        if previous is not None:  # revivals load the current weights (and their base), never these
            stale = {previous.path, previous.full} - {weights.path, weights.full}
            for old in sorted(p for p in stale if p is not None):
                await self._weights_released(old)
        self._log.info(
            "weights loaded",
            policy_version=version,
            adapter=weights.adapter,
            seconds=round(seconds, 4),
            prepare_s=round(prepared_s, 4),
            drain_s=round(drained_s, 4),
            interrupted=interrupted,
            servers=len(loaded),
            out_of_sync=[s.url for s in pool.servers if s.version != version],
        )
        return seconds

    async def health(self) -> dict[str, Any]:
        servers = self.servers
        usable = [s for s in servers if self.pool.is_usable(s)]
        if self._status == "running":
            status = "running" if len(usable) == len(servers) else ("degraded" if usable else "down")
        else:
            status = self._status
        return {
            "engine_id": self.engine_id,
            "kind": self.kind,
            "version": self.pool.version,
            "adapter": self.pool.adapter,
            "status": status,
            "inflight": self.gate.inflight,
            "requests_done": self.requests_done,
            "tokens_received": self.tokens_received,
            "tokens_generated": self.tokens_generated,
            "interruptions": self.interruptions,
            "weight_loads": self.weight_loads,
            "servers": [s.describe() for s in servers],
        }

    # ----------------------------------------------------------------- one request

    async def _complete(self, request: GenerationRequest) -> GenerationResult:
        progress = Continuation(request)
        while progress.finish is None:
            server, version, scope = await self._acquire(request)
            attempt = progress.next_attempt(self.pool.adapter)  # no await since _acquire: same version
            failed = False
            try:
                with scope:
                    async with contextlib.aclosing(self._stream(server, request, attempt)) as pieces:
                        async for piece in pieces:
                            self.tokens_received += progress.add(piece, version)
                            if progress.finish is not None or piece.finish_reason == "abort":
                                break
                        else:
                            if progress.finish is None:
                                raise ServerUnavailable("stream ended without a finish reason")
            except (ServerUnavailable, httpx.HTTPError) as exc:
                failed = True
                self.pool.mark_failed(server, exc)
            except RemoteRequestError as exc:
                raise RemoteRequestError(f"request {request.request_id}: {exc}") from None
            finally:
                self.gate.leave(server, scope)
            progress.end_attempt(interrupted=scope.cancelled_caught)
            if progress.failures_in_row > self.max_retries:
                reason = "failed" if failed else "was aborted by the server"
                raise RuntimeError(
                    f"request {request.request_id}: {progress.failures_in_row} attempts in a row {reason} "
                    f"without a new token ({self.pool.errors()}); check the servers' logs"
                )
        self.requests_done += 1
        self.tokens_generated += len(progress.tokens)
        self.interruptions += progress.interruptions
        return progress.result()

    async def _acquire(self, request: GenerationRequest) -> tuple[Server, int, anyio.CancelScope]:
        """Wait for an open gate and a usable server; count the attempt in flight (no await after)."""
        deadline: float | None = None
        while True:
            if self._closing:
                raise EngineClosedError(f"engine {self.engine_id} closed before request {request.request_id}")
            if not self.gate.is_open:
                await self.gate.wait()
                continue
            await self.pool.probe_due()
            if self._closing or not self.gate.is_open:
                continue
            server = self.pool.pick()
            if server is not None:
                return server, self.pool.version, self.gate.enter(server)
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.server_wait_s
                self._log.warning("no usable server; waiting", request_id=request.request_id)
            elif now >= deadline:
                raise RuntimeError(
                    f"request {request.request_id}: no usable {self.kind} server for "
                    f"{self.server_wait_s:.0f} s ({self.pool.errors()}); restart the servers"
                )
            await anyio.sleep(min(self.health_interval_s, max(0.01, deadline - now)))

    def _ensure_running(self) -> None:
        if self._closing or self._status == "closed":
            raise EngineClosedError(f"engine {self.engine_id} is closed")
        if self._client is None:
            raise EngineClosedError(f"engine {self.engine_id} is not started; call `await engine.start()`")

    # ------------------------------------------------------------------ HTTP helpers

    async def _post(
        self,
        server: Server,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        what: str | None = None,
        seconds: float | None = None,
    ) -> httpx.Response:
        """POST a control call (``seconds``: a limit other than ``control_timeout_s``); 4xx ->
        RemoteRequestError, 5xx/transport -> ServerUnavailable."""
        what = what or f"POST {server.url}{path}"
        try:
            response = await self.client.post(
                f"{server.url}{path}", json=body, params=params, timeout=seconds or self.control_timeout_s
            )
        except httpx.HTTPError as exc:
            raise ServerUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc
        await raise_for_status(response, what)
        return response

    @contextlib.asynccontextmanager
    async def _post_events(
        self, server: Server, path: str, body: Any
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """POST a streaming request; the JSON events of its server-sent-events reply."""
        async with self.client.stream("POST", f"{server.url}{path}", json=body) as response:
            await raise_for_status(response, f"POST {server.url}{path}")
            yield iter_sse_json(response)

    async def _get_json(self, server: Server, path: str, *, params: Mapping[str, str] | None = None) -> Any:
        what = f"GET {server.url}{path}"
        try:
            response = await self.client.get(
                f"{server.url}{path}", params=params, timeout=self.control_timeout_s
            )
        except httpx.HTTPError as exc:
            raise ServerUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc
        await raise_for_status(response, what)
        try:
            return response.json()
        except ValueError as exc:
            raise ServerUnavailable(f"{what}: not JSON: {response.text[:200]!r}") from exc
