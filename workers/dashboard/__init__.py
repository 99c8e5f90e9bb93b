"""``areal-async dashboard``: a read-only web page of a running or finished run.

    areal-async dashboard --config RUN.yaml [--port 8750] [--host 127.0.0.1] [--token T]
    areal-async run RUN.yaml --dashboard [--dashboard-port 8750]

Pages: Fleet (every worker, its role, host, pid, status, version, last heartbeat, peak memory,
restarts; stalled and dead ones stand out), Steps (reward, held-out accuracy, staleness against
the bound, step phases, the weight hand-off, trained tokens/s, against step or wall time), Rollouts
(the newest scored groups: prompt, every completion with reward, tokens and version span; agent
episodes as their turns), Dead letters (and the groups the trainer refused, and stalls). Updated
by server-sent events, no reload.

It connects as ``inspect`` does (``workers.inspect.open_run``), to the run's server or, for a
finished embedded run, to a temporary server on its JetStream store, but as the run's ``viewer``
user, whom the server keeps read-only (``bus.role_permissions.VIEWER``: no publish to a run
subject, no KV write, ack, purge or delete); a run whose credentials have no ``viewer`` (started by
an older version) is read as ``ops``, with a warning. It reads only (``workers.dashboard.reader``)
and serves GET only (``workers.dashboard.app``).

Binding: 127.0.0.1 by default, reached from elsewhere through an SSH tunnel (printed). Any other
address needs a token (``--token``, else ``AREAL_DASHBOARD_TOKEN``, else one is generated and
printed); the page's URL carries it once, and every request is checked. The URL goes to stdout and
to ``<run_dir>/dashboard.url`` (mode 0600), which ``areal-async run --dashboard`` prints. On exit it
reports what it took from the bus (``dashboard bus use: {in_msgs, in_bytes, out_msgs, out_bytes}``).

Needs the ``dashboard`` extra (starlette, uvicorn); torch is never imported.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import ipaddress
import json
import os
import secrets
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio

from areal_async.errors import ConfigError

DEFAULT_PORT = 8750
TOKEN_ENV = "AREAL_DASHBOARD_TOKEN"
URL_FILE = "dashboard.url"
EXTRA_HINT = "pip install 'areal-async[dashboard]' (starlette, uvicorn)"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def choose_token(host: str, given: str | None) -> str | None:
    """The token a bind to ``host`` needs: the one given, else none on loopback, else a new one."""
    given = given or os.environ.get(TOKEN_ENV) or None
    if given is not None or is_loopback(host):
        return given
    return secrets.token_urlsafe(24)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port (0: any free one)"
        ) from None
    sock.listen(128)
    return sock


def announce(host: str, port: int, token: str | None, run: str) -> tuple[str, str]:
    """(the page's URL, the lines that say how to reach it)."""
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
    lines = [f"dashboard of run {run}: {url}"]
    if is_loopback(host):
        lines.append(
            f"  from another machine: ssh -N -L {port}:127.0.0.1:{port} {getpass.getuser()}@"
            f"{socket.gethostname()}  then open http://127.0.0.1:{port}/"
        )
    else:
        lines.append("  the token in the URL is checked on every request; keep it private")
    return url, "\n".join(lines)


def episode_decoder(cfg: Any) -> Callable[[list[int]], str] | None:
    """The run's tokenizer as ids -> text, for the turns of agent episodes (``tokenizers``, no
    torch); None for single-turn runs and where ``model.path`` has no ``tokenizer.json`` here."""
    if cfg is None or not cfg.uses_agents:
        return None
    if cfg.model.path == "smollm2":
        from areal_async.models import cache_dir

        root = cache_dir() / "models" / "smollm2-135m-instruct"
    else:
        root = Path(cfg.model.path).expanduser()
    path = root / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def _write_url(run_dir: Path, url: str) -> None:
    path = run_dir / URL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(url + "\n")


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server without its own signal handlers: SIGINT and SIGTERM end the task group
        (``_stop_on_signal``), so the run's connection closes and a store's server stops."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server


async def _stop_on_signal(
    server: Any, closing: anyio.Event, *, task_status: Any = anyio.TASK_STATUS_IGNORED
) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for _ in signals:
            closing.set()  # event streams end, so the server's graceful stop does not wait on them
            server.should_exit = True
            return


def require_extra() -> None:
    """ConfigError naming the extra to install when starlette or uvicorn cannot be imported."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"the dashboard needs the 'dashboard' extra ({exc.name} is missing): {EXTRA_HINT}"
        ) from None


async def _serve(args: argparse.Namespace) -> int:
    require_extra()
    import uvicorn

    from workers.dashboard.app import create_app
    from workers.dashboard.reader import follow, load_stored
    from workers.dashboard.view import RunView
    from workers.inspect import open_run, resolve_target

    target = resolve_target(args)
    token = choose_token(args.host, args.token)
    sock = _bind(args.host, args.port)
    cfg = target.cfg
    async with open_run(target, user="viewer", name="dashboard") as (bus, from_store):
        view = RunView(
            target.run,
            max_staleness=cfg.rollout.max_staleness if cfg else None,
            heartbeat_interval_s=cfg.bus.heartbeat_interval_s if cfg else 2.0,
            heartbeat_ttl_s=cfg.bus.heartbeat_ttl_s if cfg else 10.0,
            total_steps=cfg.trainer.total_steps if cfg else None,
            source="store" if from_store else "live",
            decode=episode_decoder(cfg),
        )
        await load_stored(bus, view, cfg.run_dir if cfg else None)
        closing = anyio.Event()
        server = _server_class()(
            uvicorn.Config(
                create_app(view, token=token, closing=closing),
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=2,  # an open event stream does not end by itself
            )
        )
        async with anyio.create_task_group() as tg:
            await tg.start(follow, bus, view)
            await tg.start(_stop_on_signal, server, closing)
            url, text = announce(args.host, sock.getsockname()[1], token, target.run)
            if cfg is not None:
                _write_url(cfg.run_dir, url)
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
            await server.serve(sockets=[sock])
            tg.cancel_scope.cancel()
        stats = {k: bus.nc.stats[k] for k in ("in_msgs", "in_bytes", "out_msgs", "out_bytes")}
        sys.stderr.write(f"dashboard bus use: {json.dumps(stats)}\n")
    return 0


def dashboard_main(args: argparse.Namespace) -> int:
    from areal_async.logs import configure_logging

    require_extra()
    configure_logging(level="warning", fmt="console")
    return anyio.run(_serve, args, backend="asyncio")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML run file (gives run name, bus URL and the run dir)")
    p.add_argument("--url", help="NATS URL (default: from the config or the run dir)")
    p.add_argument("--run", dest="run_name", help="run name (default: from the config)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free one)"
    )
    p.add_argument(
        "--token", default=None, help=f"token for non-loopback binds (default: ${TOKEN_ENV}, else generated)"
    )


def url_of(run_dir: Path) -> str | None:
    path = run_dir / URL_FILE
    return path.read_text().strip() if path.is_file() else None


__all__ = [
    "DEFAULT_PORT",
    "add_arguments",
    "announce",
    "choose_token",
    "dashboard_main",
    "is_loopback",
    "url_of",
]
