"""The dashboard's web app (Starlette): one page, its JSON, and a server-sent event stream.

Routes, all GET (any other method is answered 405 before routing: nothing can change the run):

    /                 the page (static/index.html; Fleet, Steps, Rollouts, Dead letters)
    /static/...       its script and style
    /api/snapshot     everything the page draws, JSON (``RunView.snapshot``)
    /api/events       server-sent events: ``update`` with what changed since the page's cursor
                      (``RunView.since``), at most one per ``PUSH_INTERVAL_S``, and at least every
                      ``IDLE_PUSH_S`` (the fleet's silences grow without events)

With a token every request must carry it: ``?token=`` (the page's first load; the answer sets a
same-site, HTTP-only cookie the page's later requests carry, the event stream included) or
``Authorization: Bearer``. Compared in constant time; a miss is 401 with no body worth reading.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from workers.dashboard.view import RunView

STATIC = Path(__file__).parent / "static"
PUSH_INTERVAL_S = 1.0
IDLE_PUSH_S = 2.0
COOKIE = "areal_dashboard"
READ_METHODS = frozenset({"GET", "HEAD"})

_json = msgspec.json.Encoder()


LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


class ReadOnlyGuard:
    """Refuses every method but GET and HEAD, then checks the token (when one is set); without a
    token only loopback host names are served (a page elsewhere cannot reach the dashboard through a
    name it rebinds to 127.0.0.1)."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        if request.method not in READ_METHODS:
            response: Response = PlainTextResponse(
                "the dashboard is read-only", status_code=405, headers={"Allow": "GET, HEAD"}
            )
            await response(scope, receive, send)
            return
        if self.token is None:
            if (request.url.hostname or "").strip("[]") not in LOOPBACK_NAMES:
                response = PlainTextResponse("open the dashboard as http://127.0.0.1:PORT/", 421)
                await response(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        given = request.query_params.get("token")
        header = request.headers.get("authorization", "")
        for candidate in (given, header.removeprefix("Bearer ").strip() or None, request.cookies.get(COOKIE)):
            if candidate is not None and hmac.compare_digest(candidate.encode(), self.token.encode()):
                break
        else:
            response = PlainTextResponse("a token is needed: open the URL the dashboard printed", 401)
            await response(scope, receive, send)
            return
        if given is None:
            await self.app(scope, receive, send)
            return

        async def send_with_cookie(message: Any) -> None:
            if message["type"] == "http.response.start":
                cookie = f"{COOKIE}={self.token}; Path=/; HttpOnly; SameSite=Strict"
                message["headers"] = [*message.get("headers", []), (b"set-cookie", cookie.encode())]
            await send(message)

        await self.app(scope, receive, send_with_cookie)


def _json_response(data: Any) -> Response:
    return Response(_json.encode(data), media_type="application/json", headers={"Cache-Control": "no-store"})


def create_app(view: RunView, *, token: str | None = None, closing: anyio.Event | None = None) -> ASGIApp:
    """The ASGI app over ``view``; ``token`` None leaves it open (loopback binds only). Setting
    ``closing`` ends every event stream within a push interval (the server can then stop)."""
    closing = closing or anyio.Event()

    async def index(_request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    async def snapshot(_request: Request) -> Response:
        return _json_response(view.snapshot())

    async def events(request: Request) -> Response:
        cursor = {
            k: int(v)
            for k in ("steps", "step_rewrites", "rollouts", "letters")
            if (v := request.query_params.get(k, "0")).isdigit()
        }

        async def stream() -> AsyncIterator[bytes]:
            nonlocal cursor
            seen = view.revision
            yield b"retry: 2000\n\n"
            while not closing.is_set():
                idle = 0.0
                while view.revision == seen and idle < IDLE_PUSH_S and not closing.is_set():
                    with anyio.move_on_after(PUSH_INTERVAL_S):
                        await closing.wait()
                    idle += PUSH_INTERVAL_S
                if closing.is_set():
                    return
                seen = view.revision
                update = view.since(cursor)
                cursor = update["cursor"]
                yield b"event: update\ndata: " + _json.encode(update) + b"\n\n"

        return StreamingResponse(
            stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    app = Starlette(
        routes=[
            Route("/", index),
            Route("/api/snapshot", snapshot),
            Route("/api/events", events),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ]
    )
    return ReadOnlyGuard(GZipMiddleware(app, minimum_size=2048), token)
