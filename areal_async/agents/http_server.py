"""A small HTTP/1.1 server on anyio for JSON endpoints (the OpenAI-compatible agent endpoint).

``serve_http(handler, host, port)`` accepts TCP connections and reads requests one after another
on each: the request line, headers and a ``Content-Length`` body (at most ``MAX_BODY_BYTES``).
Connections stay open between requests (HTTP/1.1 keep-alive; HTTP/1.0 only with ``Connection:
keep-alive``) until the client sends ``Connection: close``, closes, or stays idle ``idle_s``.
``handler(request) -> HttpResponse`` runs per request; an exception in it is logged and answered
with 500. A request that cannot be parsed (bad request line or header, a chunked body, a bad
``Content-Length``) is answered with 400 (413 for a body too large) and the connection closed.

Not supported: chunked request bodies, ``Expect: 100-continue``, TLS, streaming responses.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
from anyio.abc import SocketAttribute, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

log = structlog.get_logger(__name__)

MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 32 * 1024 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
_REASONS |= {413: "Content Too Large", 500: "Internal Server Error"}


class BadRequest(ValueError):
    """The bytes on the connection are not an HTTP/1.1 request this server reads."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, kw_only=True)
class HttpRequest:
    method: str
    path: str
    """The request target without the query string."""
    headers: Mapping[str, str]
    """Header names in lower case."""
    body: bytes = b""


@dataclass(frozen=True, kw_only=True)
class HttpResponse:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, status: int, payload: Any) -> HttpResponse:
        body = json.dumps(payload, ensure_ascii=False).encode()
        return cls(status=status, body=body, headers={"Content-Type": "application/json"})


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]


async def serve_http(
    handler: Handler,
    host: str,
    port: int,
    *,
    idle_s: float = 75.0,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``handler`` on ``host:port`` until cancelled; reports the bound port (``port=0``: any free)."""
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    async with listener:
        bound = int(listener.extra(SocketAttribute.local_port))
        log.info("http server listening", host=host, port=bound)
        task_status.started(bound)

        async def on_connection(stream: SocketStream) -> None:
            async with stream:
                await _serve_connection(stream, handler, idle_s)

        await listener.serve(on_connection)


async def _serve_connection(stream: SocketStream, handler: Handler, idle_s: float) -> None:
    reader = BufferedByteReceiveStream(stream)
    while True:
        keep_alive = False
        try:
            with anyio.move_on_after(idle_s) as idle:
                request, keep_alive = await _read_request(reader)
            if idle.cancelled_caught:
                return
            response = await _respond(handler, request)
        except (anyio.IncompleteRead, anyio.EndOfStream, anyio.BrokenResourceError):
            return  # the client closed the connection
        except BadRequest as exc:
            response = HttpResponse.json(exc.status, {"error": {"message": str(exc), "type": "bad_request"}})
        try:
            await stream.send(_encode(response, keep_alive=keep_alive))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return
        if not keep_alive:
            return


async def _respond(handler: Handler, request: HttpRequest) -> HttpResponse:
    try:
        return await handler(request)
    except Exception as exc:  # the server answers every request; the error goes to the log
        log.exception("http handler failed", method=request.method, path=request.path)
        message = f"internal error: {type(exc).__name__}: {exc}"
        return HttpResponse.json(500, {"error": {"message": message, "type": "server_error"}})


async def _read_request(reader: BufferedByteReceiveStream) -> tuple[HttpRequest, bool]:
    try:
        head = await reader.receive_until(b"\r\n\r\n", MAX_HEAD_BYTES)
    except anyio.DelimiterNotFound:
        raise BadRequest(f"request line and headers exceed {MAX_HEAD_BYTES} bytes") from None
    try:
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        method, target, version = request_line.split(" ")
    except ValueError:
        raise BadRequest("malformed request line; expected 'METHOD /path HTTP/1.1'") from None
    if not version.startswith("HTTP/1.") or not target.startswith("/") or not method.isalpha():
        raise BadRequest(f"malformed request line {request_line[:100]!r}; expected 'METHOD /path HTTP/1.1'")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(f"malformed header line {line[:100]!r}; expected 'Name: value'")
        headers[name.lower()] = value.strip()
    if "transfer-encoding" in headers:
        raise BadRequest("chunked request bodies are not supported; send the body with Content-Length")
    body = b""
    if "content-length" in headers:
        length_text = headers["content-length"]
        if not length_text.isdigit():
            raise BadRequest(f"Content-Length must be a number of bytes, got {length_text!r}")
        length = int(length_text)
        if length > MAX_BODY_BYTES:
            raise BadRequest(f"body of {length} bytes exceeds the limit of {MAX_BODY_BYTES} bytes", 413)
        body = await reader.receive_exactly(length) if length else b""
    connection = headers.get("connection", "").lower()
    keep_alive = "keep-alive" in connection if version == "HTTP/1.0" else "close" not in connection
    path = target.partition("?")[0]
    return HttpRequest(method=method.upper(), path=path, headers=headers, body=body), keep_alive


def _encode(response: HttpResponse, *, keep_alive: bool) -> bytes:
    reason = _REASONS.get(response.status, "Unknown")
    headers = {
        **response.headers,
        "Content-Length": str(len(response.body)),
        "Connection": "keep-alive" if keep_alive else "close",
    }
    lines = [f"HTTP/1.1 {response.status} {reason}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + response.body
