"""Integration fixtures on top of tests/conftest.py: a dead address and private servers.

* ``dead_url``: a loopback URL where nothing listens (connect must fail fast there).
* ``server_factory``: ``server_factory(**kwargs)`` starts an EmbeddedServer owned by one test
  (to stop, restart or reconfigure it); every one is stopped at teardown.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bus import EmbeddedServer


@pytest.fixture
def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"nats://127.0.0.1:{port}"


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., EmbeddedServer]]:
    servers: list[EmbeddedServer] = []

    def start(store_dir: Path | None = None, **kwargs: object) -> EmbeddedServer:
        server = EmbeddedServer(store_dir or tmp_path / f"nats{len(servers)}", **kwargs)  # type: ignore[arg-type]
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()
