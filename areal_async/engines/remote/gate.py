"""The gate in front of a remote engine's servers, and the registry of every stream open through it.

- `close()` makes new attempts wait in `wait()`; `open()` lets them through. `wake()` releases the
  waiters without opening, so they re-check why they wait (the engine closing).
- A stream runs inside the cancel scope `enter(server)` returns and ends with `leave(server, scope)`;
  both count it on the gate and on its server (`inflight`, `attempts`) and never await.
- `cancel(server)` cuts the open streams of one server (of all when None); `drain()` cuts them all and
  returns once none is open. A cut stream's request keeps what it received and continues later.

Like the engine, a gate belongs to the event loop the engine runs on.
"""

from __future__ import annotations

from typing import Protocol

import anyio


class Server(Protocol):
    """What the gate counts on a server (`pool.Server` satisfies it)."""

    inflight: int
    attempts: int


class Gate:
    """Admission of new streams (closed while weights change) and the streams open now."""

    def __init__(self) -> None:
        self._open = True
        self._opened = anyio.Event()
        self._idle = anyio.Event()
        self._streams: dict[anyio.CancelScope, Server] = {}
        self.inflight = 0
        """Streams open now, on all servers."""

    @property
    def is_open(self) -> bool:
        return self._open

    def close(self) -> None:
        self._open = False
        self._opened = anyio.Event()

    def open(self) -> None:
        self._open = True
        self._opened.set()

    def wake(self) -> None:
        self._opened.set()

    async def wait(self) -> None:
        """Until the gate opens or `wake()` is called."""
        await self._opened.wait()

    def enter(self, server: Server) -> anyio.CancelScope:
        """Count a stream opened on `server`; the scope it must run in, so that it can be cut."""
        server.inflight += 1
        server.attempts += 1
        self.inflight += 1
        scope = anyio.CancelScope()
        self._streams[scope] = server
        return scope

    def leave(self, server: Server, scope: anyio.CancelScope) -> None:
        server.inflight -= 1
        self.inflight -= 1
        self._streams.pop(scope, None)
        if self.inflight == 0:
            self._idle.set()

    def cancel(self, server: Server | None = None) -> int:
        """Cut the open streams of `server` (of every server when None); how many were cut."""
        scopes = [scope for scope, owner in self._streams.items() if server is None or owner is server]
        for scope in scopes:
            scope.cancel()
        return len(scopes)

    async def wait_idle(self) -> None:
        """Until no stream is open."""
        while self.inflight:
            self._idle = anyio.Event()
            await self._idle.wait()

    async def drain(self) -> int:
        """Cut every open stream and wait until none is open; how many were cut."""
        cut = self.cancel()
        await self.wait_idle()
        return cut
