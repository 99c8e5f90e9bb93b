"""Client side shared by the HTTP inference engines (vLLM, SGLang): routing, interruption, retries.

The servers run elsewhere (their own processes, venvs, machines); we only talk HTTP to them. Contract,
on top of the `InferenceEngine` contract in engines/base.py:

- Ownership. One engine owns its servers: nothing else may pause them or reload their weights, or the
  version stamps below stop being true. Several servers behind one engine are fine.
- Routing. Each request goes to the live, in-sync server with the fewest requests in flight (ties:
  round robin) and is streamed, so the engine always knows which tokens have arrived.
- Exact versions by abort-and-continue. `load_weights` closes the gate (new attempts wait), cancels
  every open stream (tokens received so far are kept, stamped with the version that produced them),
  waits until no stream is open, then on every live server: pause (aborting what is left), reload the
  safetensors directory, drop the prefix cache, resume. It sets the new version, opens the gate, and
  every unfinished request is resubmitted as prompt + tokens so far with the remaining budget. A token
  is accepted only from a stream opened under the version it is stamped with, and no stream is open
  while any server's weights change, so no token can carry the wrong version (a request that reached a
  server only after the pause, and would run on new weights after resume, belongs to a stream that is
  already closed: nothing it produces is read). `version` is updated before any new-weights stream
  opens. Servers' own pause semantics (abort / wait / keep) do not matter for correctness.
- Dead servers. A connection error, a 5xx, a malformed reply or a read timeout on a stream marks the
  server dead; its requests continue on another server from the tokens received so far. While a server
  is dead or out of sync, requests probe it at most every `health_interval_s`; once it answers, it is
  brought to the current weights (reload, even if it never restarted) before it serves again.
- Failures. A 4xx is the request's fault: ValueError naming the request, the status and the server's
  message, not retried. A request that gets no usable server for `server_wait_s`, or fails
  `max_retries` attempts in a row without a new token, raises RuntimeError naming each server and
  its last error.
- Continuations of a seeded request use a seed derived from (seed, tokens so far), so a seeded
  completion is reproducible only if it was never interrupted.
- Each result's `stats`: `seconds`, `first_token_s`, `attempts` (streams opened), `interruptions`
  (streams cut by a weight load, or because their server failed), `prefills` (= attempts; each attempt
  re-prefills prompt + tokens).

Concurrency: all state lives on the event loop the engine was started in; use it from that loop only.
"""

from __future__ import annotations

import abc
import contextlib
import json
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import structlog

from areal_async.engines.base import (
    EngineClosedError,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
)
from areal_async.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = structlog.get_logger(__name__)

_SEED_STRIDE = 1_000_003
_SEED_MOD = 2**31 - 1


class ServerUnavailable(RuntimeError):
    """A server did not answer, answered 5xx, or answered something unreadable; try another."""


class RemoteRequestError(ValueError):
    """A server rejected a request (4xx); the request, not the server, is at fault."""


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


@dataclass(frozen=True)
class Piece:
    """Tokens one streamed chunk added, their log-probs, and the server's finish reason so far."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    """None (more to come), "stop", "length", or "abort" (the server dropped the request)."""


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


def continuation_seed(seed: int | None, tokens_so_far: int) -> int | None:
    """The request's seed for its first attempt; a derived one for a continuation."""
    if seed is None or tokens_so_far == 0:
        return seed
    return (seed + _SEED_STRIDE * tokens_so_far) % _SEED_MOD


async def iter_sse_json(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """JSON payloads of a server-sent-events stream (`data: {...}` lines) up to `data: [DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        try:
            event = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise ServerUnavailable(f"unreadable stream chunk {payload[:200]!r}") from exc
        if not isinstance(event, dict):
            raise ServerUnavailable(f"stream chunk is not a JSON object: {payload[:200]!r}")
        yield event


def error_message(body: bytes | str) -> str:
    """The human part of an error body (OpenAI-style, FastAPI-style or plain text), shortened."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:500]
    if isinstance(data, dict):
        inner = data.get("error", data)
        if isinstance(inner, dict):
            for key in ("message", "detail", "error"):
                if key in inner:
                    return str(inner[key])[:500]
        if isinstance(inner, str):
            return inner[:500]
    return text.strip()[:500]


async def raise_for_status(response: httpx.Response, what: str) -> None:
    """4xx -> RemoteRequestError, 5xx -> ServerUnavailable, with the server's own message."""
    if response.status_code < 400:
        return
    body = await response.aread()
    message = f"{what}: HTTP {response.status_code}: {error_message(body)}"
    if response.status_code < 500:
        raise RemoteRequestError(message)
    raise ServerUnavailable(message)


class RemoteEngine(InferenceEngine):
    """Base of the HTTP engines; subclasses speak one server API (see the module docstring)."""

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
        self.servers = [Server(url) for url in normalize_urls(server_urls, kind=self.kind)]
        self.engine_id = engine_id or f"{self.kind}-{uuid.uuid4().hex[:8]}"
        self._version = version
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.control_timeout_s = control_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.server_wait_s = server_wait_s
        self.health_interval_s = health_interval_s
        self.max_retries = max_retries
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._weights_path: str | None = None
        self._status = "created"
        self._closing = False
        self._gate_open = True
        self._gate = anyio.Event()
        self._inflight = 0
        self._idle = anyio.Event()
        self._scopes: dict[anyio.CancelScope, Server] = {}
        self._load_lock = anyio.Lock()
        self._probe_lock = anyio.Lock()
        self._next_server = 0
        self.requests_done = 0
        self.tokens_received = 0
        self.tokens_generated = 0
        self.interruptions = 0
        self.weight_loads = 0
        self._log = log.bind(engine_id=self.engine_id, kind=self.kind)

    # ------------------------------------------------------------- server API (subclasses)

    @abc.abstractmethod
    async def _describe(self, server: Server) -> None:
        """Check the server is up and configured as we need; fill `server.info` / `initial_path`.

        Raises ServerUnavailable when it does not answer, ConfigError when it is misconfigured.
        """

    @abc.abstractmethod
    def _stream(
        self, server: Server, request: GenerationRequest, prompt_ids: list[int], max_new_tokens: int
    ) -> AsyncIterator[Piece]:
        """Stream one attempt: yields the tokens as they arrive (an async generator)."""

    @abc.abstractmethod
    async def _pause(self, server: Server) -> None:
        """Stop generating and abort every request on the server."""

    @abc.abstractmethod
    async def _reload(self, server: Server, path: str, version: int) -> None:
        """Load the safetensors checkpoint directory `path` into the (paused) server."""

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
        return self._version

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
        self._gate.set()
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                for server in self.servers:
                    if not server.alive:
                        await self._start_server(server)
                if all(s.alive for s in self.servers):
                    break
                if time.monotonic() >= deadline:
                    if any(s.alive for s in self.servers):
                        break
                    raise RuntimeError(
                        f"{self.kind} engine {self.engine_id}: no server answered within "
                        f"{self.startup_timeout_s:.0f} s ({self._server_errors()}); start the servers "
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
            servers=[s.url for s in self.servers],
            alive=[s.url for s in self.servers if s.alive],
            version=self._version,
        )

    async def aclose(self) -> None:
        if self._status == "closed":
            return
        self._closing = True
        self._gate.set()  # waiters wake up and see _closing
        for scope in list(self._scopes):
            scope.cancel()
        with anyio.move_on_after(10):
            while self._inflight:
                self._idle = anyio.Event()
                await self._idle.wait()
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

    async def load_weights(
        self, version: int, location: str | os.PathLike[str] | Mapping[str, torch.Tensor]
    ) -> float:
        if isinstance(location, Mapping):
            raise ValueError(
                f"{type(self).__name__} loads weights from a safetensors directory the servers can read, "
                "not an in-memory state dict; save it with save_pretrained() and pass the directory"
            )
        self._ensure_running()
        started = time.perf_counter()
        path = await self._prepare_weights(os.fspath(location), version)
        prepared_s = time.perf_counter() - started
        async with self._load_lock:
            self._close_gate()
            try:
                interrupted = await self._drain()
                drained_s = time.perf_counter() - started - prepared_s
                targets = [s for s in self.servers if s.alive]
                async with anyio.create_task_group() as tg:
                    for server in targets:
                        tg.start_soon(self._sync_server, server, path, version)
                loaded = [s for s in targets if s.version == version]
                if not loaded:
                    raise RuntimeError(
                        f"{self.kind} engine {self.engine_id}: no server loaded weights v{version} from "
                        f"{path} ({self._server_errors()}); the path must be a safetensors directory "
                        "readable by the servers"
                    )
                self._version = version
                previous, self._weights_path = self._weights_path, path
                self.weight_loads += 1
            finally:
                self._open_gate()
        seconds = time.perf_counter() - started
        if previous is not None and previous != path:  # revivals load the current path, never this one
            await self._weights_released(previous)
        self._log.info(
            "weights loaded",
            policy_version=version,
            seconds=round(seconds, 4),
            prepare_s=round(prepared_s, 4),
            drain_s=round(drained_s, 4),
            interrupted=interrupted,
            servers=len(loaded),
            out_of_sync=[s.url for s in self.servers if s.version != version],
        )
        return seconds

    async def health(self) -> dict[str, Any]:
        usable = [s for s in self.servers if self._usable(s)]
        if self._status == "running":
            status = "running" if len(usable) == len(self.servers) else ("degraded" if usable else "down")
        else:
            status = self._status
        return {
            "engine_id": self.engine_id,
            "kind": self.kind,
            "version": self._version,
            "status": status,
            "inflight": self._inflight,
            "requests_done": self.requests_done,
            "tokens_received": self.tokens_received,
            "tokens_generated": self.tokens_generated,
            "interruptions": self.interruptions,
            "weight_loads": self.weight_loads,
            "servers": [s.describe() for s in self.servers],
        }

    # ----------------------------------------------------------------- one request

    async def _complete(self, request: GenerationRequest) -> GenerationResult:
        sampling = request.sampling
        stop = set(sampling.stop_token_ids)
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        started = time.perf_counter()
        first_token_s = -1.0
        attempts = interruptions = failures_in_row = 0
        finish: str | None = None
        while finish is None:
            server, version, scope = await self._acquire(request)
            attempts += 1
            before = len(tokens)
            failed = False
            prompt = list(request.prompt_ids) + tokens
            remaining = sampling.max_new_tokens - len(tokens)
            try:
                with scope:
                    async with contextlib.aclosing(
                        self._stream(server, request, prompt, remaining)
                    ) as pieces:
                        async for piece in pieces:
                            for token, logprob in zip(piece.token_ids, piece.logprobs, strict=True):
                                tokens.append(token)
                                logprobs.append(logprob)
                                versions.append(version)
                                self.tokens_received += 1
                                if token in stop:
                                    finish = "stop"
                                elif len(tokens) >= sampling.max_new_tokens:
                                    finish = "length"
                                if finish is not None:
                                    break
                            if finish is None and piece.finish_reason in ("stop", "length"):
                                finish = piece.finish_reason  # e.g. the server's context length
                            if finish is not None or piece.finish_reason == "abort":
                                break
                        else:
                            if finish is None:
                                raise ServerUnavailable("stream ended without a finish reason")
            except (ServerUnavailable, httpx.HTTPError) as exc:
                failed = True
                self._mark_failed(server, exc)
            except RemoteRequestError as exc:
                raise RemoteRequestError(f"request {request.request_id}: {exc}") from None
            finally:
                self._release(server, scope)
            if first_token_s < 0 and tokens:
                first_token_s = time.perf_counter() - started
            if scope.cancelled_caught:
                interruptions += 1
            if finish is not None:
                break
            if len(tokens) > before or scope.cancelled_caught:
                failures_in_row = 0
                continue
            failures_in_row += 1  # a failed or server-aborted attempt that produced nothing
            if failures_in_row > self.max_retries:
                reason = "failed" if failed else "was aborted by the server"
                raise RuntimeError(
                    f"request {request.request_id}: {failures_in_row} attempts in a row {reason} without a "
                    f"new token ({self._server_errors()}); check the servers' logs"
                )
        self.requests_done += 1
        self.tokens_generated += len(tokens)
        self.interruptions += interruptions
        return GenerationResult(
            request_id=request.request_id,
            prompt_ids=request.prompt_ids,
            token_ids=tokens,
            logprobs=logprobs,
            versions=versions,
            finish_reason=finish,  # type: ignore[arg-type]
            stats={
                "seconds": time.perf_counter() - started,
                "first_token_s": first_token_s,
                "attempts": float(attempts),
                "interruptions": float(interruptions),
                "prefills": float(attempts),
            },
        )

    # ---------------------------------------------------------- routing and the gate

    def _usable(self, server: Server) -> bool:
        return server.alive and server.version == self._version

    def _pick(self) -> Server | None:
        usable = [s for s in self.servers if self._usable(s)]
        if not usable:
            return None
        fewest = min(s.inflight for s in usable)
        candidates = [s for s in usable if s.inflight == fewest]
        server = candidates[self._next_server % len(candidates)]
        self._next_server += 1
        return server

    async def _acquire(self, request: GenerationRequest) -> tuple[Server, int, anyio.CancelScope]:
        """Wait for an open gate and a usable server; count the attempt in flight (no await after)."""
        deadline: float | None = None
        while True:
            if self._closing:
                raise EngineClosedError(f"engine {self.engine_id} closed before request {request.request_id}")
            if not self._gate_open:
                await self._gate.wait()
                continue
            await self._probe_due()
            if self._closing or not self._gate_open:
                continue
            server = self._pick()
            if server is not None:
                server.inflight += 1
                server.attempts += 1
                self._inflight += 1
                scope = anyio.CancelScope()
                self._scopes[scope] = server
                return server, self._version, scope
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.server_wait_s
                self._log.warning("no usable server; waiting", request_id=request.request_id)
            elif now >= deadline:
                raise RuntimeError(
                    f"request {request.request_id}: no usable {self.kind} server for "
                    f"{self.server_wait_s:.0f} s ({self._server_errors()}); restart the servers"
                )
            await anyio.sleep(min(self.health_interval_s, max(0.01, deadline - now)))

    def _release(self, server: Server, scope: anyio.CancelScope) -> None:
        server.inflight -= 1
        self._inflight -= 1
        self._scopes.pop(scope, None)
        if self._inflight == 0:
            self._idle.set()

    def _close_gate(self) -> None:
        self._gate_open = False
        self._gate = anyio.Event()

    def _open_gate(self) -> None:
        self._gate_open = True
        self._gate.set()

    async def _drain(self) -> int:
        """Cancel every open stream and wait until none is open; return how many were cut."""
        cut = len(self._scopes)
        for scope in list(self._scopes):
            scope.cancel()
        while self._inflight:
            self._idle = anyio.Event()
            await self._idle.wait()
        return cut

    def _ensure_running(self) -> None:
        if self._closing or self._status == "closed":
            raise EngineClosedError(f"engine {self.engine_id} is closed")
        if self._client is None:
            raise EngineClosedError(f"engine {self.engine_id} is not started; call `await engine.start()`")

    # ------------------------------------------------------------- server health

    async def _start_server(self, server: Server) -> None:
        """Describe the server, then load the weights this engine serves: a server used by an
        earlier run (or left paused by a crashed engine) may hold other weights."""
        try:
            await self._describe(server)
        except ServerUnavailable as exc:
            server.last_error = str(exc)
            return
        except httpx.HTTPError as exc:
            server.last_error = f"{type(exc).__name__}: {exc}"
            return
        path = self._weights_path or server.initial_path
        if path is None:
            server.last_error = "its initial checkpoint is unknown; cannot tell which weights it serves"
            return
        server.alive = True
        server.last_error = ""
        await self._sync_server(server, path, self._version)

    def _mark_failed(self, server: Server, exc: BaseException) -> None:
        server.failures += 1
        server.last_error = f"{type(exc).__name__}: {exc}"
        if server.alive:
            self._log.warning("server failed; marked dead", url=server.url, error=server.last_error)
        server.alive = False
        server.next_probe_at = time.monotonic() + self.health_interval_s
        # Its other streams may hang rather than fail: cut them now; they continue elsewhere.
        for scope, owner in list(self._scopes.items()):
            if owner is server:
                scope.cancel()

    async def _probe_due(self) -> None:
        """Probe dead / out-of-sync servers whose probe is due; bring a live one to current weights."""
        now = time.monotonic()
        due = [s for s in self.servers if not self._usable(s) and s.next_probe_at <= now]
        if not due or self._probe_lock.locked():
            return
        async with self._probe_lock:
            for server in due:
                server.next_probe_at = time.monotonic() + self.health_interval_s
                if not await self._is_healthy(server):
                    continue
                try:  # it may have restarted with another configuration
                    await self._describe(server)
                except (ServerUnavailable, RemoteRequestError, httpx.HTTPError) as exc:
                    server.last_error = f"{type(exc).__name__}: {exc}"
                    continue
                except ConfigError as exc:
                    server.last_error = str(exc)
                    self._log.error(
                        "revived server is misconfigured; not used", url=server.url, error=str(exc)
                    )
                    continue
                async with self._load_lock:
                    if self._usable(server):
                        continue
                    path = self._weights_path or server.initial_path
                    if path is None:
                        server.last_error = (
                            "revived, but its initial checkpoint is unknown; restart the engine"
                        )
                        continue
                    server.alive = True
                    await self._sync_server(server, path, self._version)
                if self._usable(server):
                    self._log.info("server revived", url=server.url, policy_version=self._version)

    async def _sync_server(self, server: Server, path: str, version: int) -> None:
        """pause -> reload -> reset cache -> resume on one server; marks it in sync or not."""
        server.version = -1
        step = "pause"
        try:
            await self._pause(server)
            step = "reload"
            await self._reload(server, path, version)
            step = "reset cache"
            await self._reset_cache(server)
            server.version = version
        except (ServerUnavailable, RemoteRequestError, httpx.HTTPError) as exc:
            server.last_error = f"{step}: {type(exc).__name__}: {exc}"
            self._log.error(
                "weights sync failed", url=server.url, policy_version=version, error=server.last_error
            )
        finally:
            try:
                await self._resume(server)
            except (ServerUnavailable, RemoteRequestError, httpx.HTTPError) as exc:
                self._mark_failed(server, exc)

    def _server_errors(self) -> str:
        parts = []
        for s in self.servers:
            state = "ok" if self._usable(s) else ("out of sync" if s.alive else "dead")
            parts.append(f"{s.url}: {state}" + (f", last error: {s.last_error}" if s.last_error else ""))
        return "; ".join(parts)

    # ------------------------------------------------------------------ HTTP helpers

    async def _post(
        self,
        server: Server,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        what: str | None = None,
    ) -> httpx.Response:
        """POST a control call; 4xx -> RemoteRequestError, 5xx/transport -> ServerUnavailable."""
        what = what or f"POST {server.url}{path}"
        try:
            response = await self.client.post(
                f"{server.url}{path}", json=body, params=params, timeout=self.control_timeout_s
            )
        except httpx.HTTPError as exc:
            raise ServerUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc
        await raise_for_status(response, what)
        return response

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


def finite_logprob(value: Any) -> float:
    """A server's log-prob as a float; None / NaN are protocol errors, -inf is kept."""
    if value is None:
        raise ServerUnavailable("server returned a null log-prob")
    number = float(value)
    if math.isnan(number):
        raise ServerUnavailable("server returned a NaN log-prob")
    return number
