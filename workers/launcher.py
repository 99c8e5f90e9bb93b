"""``areal-async run``: a whole run on one machine.

Starts an embedded nats-server (store under ``<run_dir>/nats``), then one process per
role (``areal-worker --role ROLE``; the trainer under torchrun when
``trainer.num_ranks > 1``), streams their output with role prefixes, and supervises:

- a worker that crashes is restarted (up to ``MAX_RESTARTS`` times); the bus redelivers
  whatever it held and the trainer resumes from its last checkpoint;
- when the controller exits cleanly the run is over: the others get ``RUN_END_GRACE_S``
  to stop on their own, then SIGTERM;
- Ctrl-C (SIGINT) or SIGTERM stops every worker (SIGTERM, then SIGKILL after a grace
  period) and the server. Running the same command again resumes the run.

At the end a plot and a one-screen summary are produced from the run dir.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from areal_async.config import RunConfig, load_config
from areal_async.errors import ConfigError

MAX_RESTARTS = 3
RUN_END_GRACE_S = 30.0
STOP_GRACE_S = 20.0


@dataclass
class Child:
    role: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    lines: list[str] = field(default_factory=list)


def _worker_argv(
    cfg: RunConfig, role: str, config_path: str, overrides: Sequence[str], url: str
) -> list[str]:
    sets: list[str] = []
    for o in [*overrides, f"bus.url={url}"]:
        sets += ["--set", o]
    base = ["--role", role, "--config", config_path, *sets]
    if role == "trainer" and cfg.trainer.num_ranks > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={cfg.trainer.num_ranks}",
            "-m",
            "workers.cli",
            *base,
        ]
    return [sys.executable, "-m", "workers.cli", *base]


def _pump(child: Child, stream: object, out_lock: threading.Lock, echo: bool, sink: Path) -> None:
    width = 12
    with open(sink, "ab") as out:
        for raw in iter(stream.readline, b""):  # type: ignore[attr-defined]
            out.write(raw)
            out.flush()
            if echo:
                line = raw.decode(errors="replace").rstrip()
                with out_lock:
                    sys.stdout.write(f"{child.role:>{width}} | {line}\n")
                    sys.stdout.flush()


def _start(child: Child, out_lock: threading.Lock, echo: bool, logs: Path) -> None:
    child.proc = subprocess.Popen(
        child.argv, env=child.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    sink = logs / f"{child.role}.out"
    threading.Thread(target=_pump, args=(child, child.proc.stdout, out_lock, echo, sink), daemon=True).start()


def _stop(children: Sequence[Child], grace: float) -> None:
    for c in children:
        if c.proc and c.proc.poll() is None:
            try:
                os.killpg(c.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for c in children:
        if not c.proc:
            continue
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(c.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            c.proc.wait()


def launch(config_path: str, overrides: Sequence[str], *, roles: Sequence[str], live: bool = True) -> int:
    """Run the job described by ``config_path``; returns the exit code."""
    from bus.embedded import EmbeddedServer
    from workers.cli import ROLES

    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise ConfigError(f"--roles: unknown role(s) {unknown}; choose from {list(ROLES)}")
    cfg = load_config(config_path, overrides)
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = list(overrides)
    model_path = _prepare_model(cfg)
    if model_path is not None:
        overrides.append(f"model.path={model_path}")

    server = None
    if cfg.bus.url == "embedded":
        server = EmbeddedServer(
            store_dir=run_dir / "nats", max_payload=int(cfg.bus.max_payload_mb * 1024 * 1024)
        )
        server.start()
        url = server.url
        (run_dir / "nats.url").write_text(url + "\n")
    else:
        url = cfg.bus.url
    out_lock = threading.Lock()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "AREAL_BUS_URL": url}
    children = [
        Child(role=r, argv=_worker_argv(cfg, r, config_path, overrides, url), env={**env}) for r in roles
    ]
    stopping = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        stopping.set()

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    code = 0
    live = live and sys.stdout.isatty()
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    display = _LiveDisplay(run_dir, children) if live else None
    try:
        for c in children:
            _start(c, out_lock, not live, logs)
        if display is not None:
            display.start()
        while not stopping.is_set():
            time.sleep(0.2)
            if display is not None:
                display.refresh()
            controller = next((c for c in children if c.role == "controller"), None)
            if controller and controller.proc and controller.proc.poll() == 0:
                _wait_others(children, RUN_END_GRACE_S)
                break
            for c in children:
                rc = c.proc.poll() if c.proc else None
                if rc is None or (rc == 0 and c.role != "controller"):
                    continue
                if c.restarts >= MAX_RESTARTS:
                    sys.stderr.write(
                        f"error: {c.role} failed {c.restarts + 1} times (exit {rc}); stopping the run\n"
                    )
                    code = 1
                    stopping.set()
                    break
                c.restarts += 1
                sys.stderr.write(f"warning: {c.role} exited with {rc}; restart {c.restarts}/{MAX_RESTARTS}\n")
                _start(c, out_lock, not live, logs)
            if not any(c.proc and c.proc.poll() is None for c in children):
                break
        else:
            code = 130
    finally:
        if display is not None:
            display.stop()
        _stop(children, STOP_GRACE_S)
        if server is not None:
            server.stop()
        for s, h in old.items():
            signal.signal(s, h)
    _finish(cfg, time.monotonic() - started)
    return code


class _LiveDisplay:
    """rich Live table refreshed about once a second from the run dir."""

    def __init__(self, run_dir: Path, children: Sequence[Child]) -> None:
        from rich.live import Live

        self.run_dir = run_dir
        self.children = {c.role: c for c in children}
        self.started = time.time()
        self.live = Live(auto_refresh=False)
        self.last = 0.0

    def _proc(self, role: str) -> tuple[bool, int]:
        c = self.children[role]
        return (c.proc is not None and c.proc.poll() is None), c.restarts

    def start(self) -> None:
        self.live.start()

    def refresh(self) -> None:
        if time.monotonic() - self.last < 1.0:
            return
        from workers.live import render

        self.last = time.monotonic()
        self.live.update(render(self.run_dir, list(self.children), self._proc, self.started), refresh=True)

    def stop(self) -> None:
        self.last = 0.0
        self.refresh()
        self.live.stop()


def _wait_others(children: Sequence[Child], grace: float) -> None:
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(c.proc and c.proc.poll() is None for c in children):
        time.sleep(0.2)


def _prepare_model(cfg: RunConfig) -> Path | None:
    """Convert the bundled model once, before the workers start (they would race otherwise)."""
    if cfg.model.path != "smollm2":
        return None
    from areal_async.models import prepare_smollm2

    return prepare_smollm2(None, dtype="float32")


def _finish(cfg: RunConfig, wall_s: float) -> None:
    from workers.report import write_report

    write_report(cfg.run_dir, wall_s=wall_s)
