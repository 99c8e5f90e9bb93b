"""What crosses the wire between a remote engine and its servers: errors, streamed pieces, SSE, replies.

- `ServerUnavailable`: the server did not answer, answered 5xx or answered something unreadable; the
  engine marks it dead and continues the request elsewhere.
- `RemoteRequestError` (a ValueError): the server rejected the request (4xx); not retried.
- `Piece`: what one streamed chunk added (tokens, their log-probs, the server's finish reason).
- `iter_sse_json` reads `data: {...}` lines up to `data: [DONE]`; `raise_for_status` maps an HTTP status
  to the two errors above with the server's own message; `finite_logprob` rejects null / NaN log-probs.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx


class ServerUnavailable(RuntimeError):
    """A server did not answer, answered 5xx, or answered something unreadable; try another."""


class RemoteRequestError(ValueError):
    """A server rejected a request (4xx); the request, not the server, is at fault."""


@dataclass(frozen=True)
class Piece:
    """Tokens one streamed chunk added, their log-probs, and the server's finish reason so far."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    """None (more to come), "stop", "length", or "abort" (the server dropped the request)."""


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
    """The human part of an error body (OpenAI-style, FastAPI-style, SGLang's `error_message` or plain
    text), shortened."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:500]
    if isinstance(data, dict):
        inner = data.get("error", data)
        if isinstance(inner, dict):
            for key in ("message", "detail", "error", "error_message"):
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


def finite_logprob(value: Any) -> float:
    """A server's log-prob as a float; None / NaN are protocol errors, -inf is kept."""
    if value is None:
        raise ServerUnavailable("server returned a null log-prob")
    number = float(value)
    if math.isnan(number):
        raise ServerUnavailable("server returned a NaN log-prob")
    return number
