"""``areal-async run``: a whole run on one machine.

Starts an embedded nats-server (store under ``<run_dir>/nats``), then one process per
role (``areal-worker --role ROLE``; the trainer under torchrun when
``trainer.num_ranks > 1``), streams their output with role prefixes, and supervises:

- the server requires per-run credentials: one user per role, ``viewer`` (the dashboard,
  read only) and ``ops`` (``inspect``, the watchdog), random passwords in ``<run_dir>/nats/credentials.json`` (mode 0600; a resumed
  run reuses them), each confined to its role's permissions (``bus.role_permissions``)
  on this run. A worker gets ``--set bus.user=ROLE`` and its password in
  ``AREAL_NATS_PASSWORD`` (never on a command line); these win over ``bus.user``,
  ``bus.password``, ``bus.token``, ``bus.nkeys_seed`` and ``bus.creds`` of the run file;
- a nats-server that dies (killed, OOM) is restarted on the same port, store and config
  (up to ``MAX_RESTARTS`` times); the workers' connections reconnect with back-off;
- a worker that crashes is restarted (up to ``MAX_RESTARTS`` times); the bus redelivers
  whatever it held and the trainer resumes from its last checkpoint;
- when the controller exits cleanly the run is over: the others get ``RUN_END_GRACE_S``
  to stop on their own, then SIGTERM;
- a worker that stops making progress without dying (frozen: no heartbeat; wedged: beats but
  finishes nothing while work waits) is found by the watchdog (``workers.watchdog``, as the ``ops``
  user), which SIGKILLs its process tree; the crash path above restarts it. Stalls and heals are
  announced (``run.stalled``, ``run.healed``), printed, and listed in the summary;
- Ctrl-C (SIGINT) or SIGTERM stops every worker (SIGTERM, then SIGKILL after a grace
  period) and the server. Running the same command again resumes the run.

Exit code: 0 when the run ended, 1 when a role (or the server) failed more than
``MAX_RESTARTS`` times, 130 when stopped by a signal.

Every ``RSS_SAMPLE_S`` the resident memory of each role's process tree (the worker and its
descendants, e.g. torchrun ranks) is sampled from ``/proc``; the peak per role is shown
live and in the summary. At the end a plot and a one-screen summary are produced from the
run dir.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from areal_async.config import RunConfig
from areal_async.errors import ConfigError
from areal_async.run_file import load_config
from bus.embedded import EmbeddedServer, EmbeddedServerError, run_credentials
from workers.runtime import CUDA_DEVICES_ENV, RESTARTS_ENV, cuda_devices

MAX_RESTARTS = 3
RUN_END_GRACE_S = 30.0
STOP_GRACE_S = 20.0
RSS_SAMPLE_S = 1.0
SERVER_ROLE = "nats-server"
"""Name of the embedded server in the resource table."""

EMBEDDED_OVERRIDES = ("bus.password=null", "bus.token=null", "bus.nkeys_seed=null", "bus.creds=null")
"""What the generated credentials replace in a worker's config (besides ``bus.user``)."""


@dataclass
class Child:
    role: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    peak_rss: int = 0
    """Largest resident set (bytes) of the role's process tree seen so far, over all restarts."""


def _worker_argv(
    cfg: RunConfig, role: str, config_path: str, overrides: Sequence[str], url: str, *, embedded: bool
) -> list[str]:
    sets: list[str] = []
    own = [f"bus.user={role}", *EMBEDDED_OVERRIDES] if embedded else []
    for o in [*overrides, f"bus.url={url}", *own]:
        sets += ["--set", o]
    base = ["--role", role, "--config", config_path, *sets]
    if role == "trainer" and cfg.trainer.num_ranks > 1 and cfg.trainer.backend != "simulated":
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


def _worker_env(base: Mapping[str, str], role: str, passwords: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(base)
    visible = cuda_devices(role, base.get(CUDA_DEVICES_ENV, ""))
    if visible is not None:  # this role's GPUs (AREAL_CUDA_DEVICES, checked in launch)
        env["CUDA_VISIBLE_DEVICES"] = _within(visible, base.get("CUDA_VISIBLE_DEVICES", ""), role)
    if passwords is not None:  # the role's own password only; no shared token
        env.pop("AREAL_NATS_TOKEN", None)
        env["AREAL_NATS_PASSWORD"] = passwords[role]
    return env


def _within(chosen: str, inherited: str, role: str) -> str:
    """``chosen`` device indices counted within the devices this launcher may use: the inherited
    ``CUDA_VISIBLE_DEVICES`` (Slurm sets it to the allocated GPUs), or the machine's when unset."""
    allowed = [d.strip() for d in inherited.split(",") if d.strip()]
    if not allowed:
        return chosen
    picked = []
    for index in (int(i) for i in chosen.split(",")):
        if index >= len(allowed):
            raise ConfigError(
                f"{CUDA_DEVICES_ENV} gives {role} device {index}, but CUDA_VISIBLE_DEVICES={inherited!r} "
                f"holds {len(allowed)}; count devices from 0 within CUDA_VISIBLE_DEVICES"
            )
        picked.append(allowed[index])
    return ",".join(picked)


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
    env = {**child.env, RESTARTS_ENV: str(child.restarts)}  # its heartbeats tell the dashboard
    child.proc = subprocess.Popen(
        child.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
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


# ---- resident memory ------------------------------------------------------------------------


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    parents = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        parents[int(entry.name)] = int(stat[stat.rindex(b")") + 2 :].split()[1])
    return parents


def _rss(pid: int) -> int:
    """VmRSS of ``pid`` in bytes (0 for a zombie or a process that is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def process_tree(root: int, parents: Mapping[int, int]) -> list[int]:
    """``root`` and all its descendants (``parents``: pid -> parent pid), whatever their session:
    torchrun starts each rank in a session of its own."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def tree_rss(roots: Sequence[int], parents: Mapping[int, int] | None = None) -> dict[int, int]:
    """Resident bytes of each root pid's process tree (the process and all its descendants)."""
    parents = _parents() if parents is None else parents
    return {root: sum(_rss(pid) for pid in process_tree(root, parents)) for root in roots}


class RssSampler:
    """Peak resident memory per role, sampled at most every ``RSS_SAMPLE_S``."""

    def __init__(self, children: Sequence[Child], server: EmbeddedServer | None) -> None:
        self.children = children
        self.server = server
        self.server_peak = 0
        self.next = 0.0

    def sample(self) -> None:
        if time.monotonic() < self.next:
            return
        self.next = time.monotonic() + RSS_SAMPLE_S
        live = {c.proc.pid: c for c in self.children if c.proc is not None and c.proc.poll() is None}
        server_pid = self.server.pid if self.server is not None and self.server.running else None
        roots = [*live, *([server_pid] if server_pid else [])]
        if not roots:
            return
        totals = tree_rss(roots)
        for pid, child in live.items():
            child.peak_rss = max(child.peak_rss, totals[pid])
        if server_pid:
            self.server_peak = max(self.server_peak, totals[server_pid])

    def peaks(self) -> dict[str, int]:
        peaks = {c.role: c.peak_rss for c in self.children}
        if self.server is not None:
            peaks[SERVER_ROLE] = self.server_peak
        return peaks


# ---- the run -------------------------------------------------------------------------------


def _start_bus(cfg: RunConfig) -> tuple[EmbeddedServer | None, str, dict[str, str] | None]:
    """(server, URL, passwords): the run's embedded server with its credentials, or the configured URL."""
    if cfg.bus.url != "embedded":
        return None, cfg.bus.url, None
    store = cfg.run_dir / "nats"
    passwords = run_credentials(store)
    server = EmbeddedServer(
        store_dir=store,
        max_payload=int(cfg.bus.max_payload_mb * 1024 * 1024),
        users=passwords,
        run=cfg.name,
    ).start()
    assert server.url is not None
    (cfg.run_dir / "nats.url").write_text(server.url + "\n")
    return server, server.url, passwords


def launch(
    config_path: str,
    overrides: Sequence[str],
    *,
    roles: Sequence[str] | None = None,
    live: bool = True,
    dashboard_port: int | None = None,
) -> int:
    """Run the job described by ``config_path``; returns the exit code."""
    from workers.roles import ROLES, run_roles

    unknown = [r for r in roles or () if r not in ROLES]
    if unknown:
        raise ConfigError(f"--roles: unknown role(s) {unknown}; choose from {list(ROLES)}")
    cfg = load_config(config_path, overrides)
    roles = list(roles) if roles else list(run_roles(cfg.uses_agents))
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = list(overrides)
    try:  # checked before anything starts; each role's CUDA_VISIBLE_DEVICES comes from it
        cuda_devices("", os.environ.get(CUDA_DEVICES_ENV, ""))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    model_path = _prepare_model(cfg, roles)
    if model_path is not None:
        overrides.append(f"model.path={model_path}")

    server, url, passwords = _start_bus(cfg)
    out_lock = threading.Lock()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "AREAL_BUS_URL": url}
    children = [
        Child(
            role=r,
            argv=_worker_argv(cfg, r, config_path, overrides, url, embedded=server is not None),
            env=_worker_env(env, r, passwords),
        )
        for r in roles
    ]
    stopping = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        stopping.set()

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    live = live and sys.stdout.isatty()
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rss = RssSampler(children, server)
    display = _LiveDisplay(run_dir, children) if live else None
    watching = threading.Event()
    watcher = None
    dashboard = None
    try:
        for c in children:
            _start(c, out_lock, not live, logs)
        watcher = _watch(cfg, url, passwords, children, watching, out_lock)
        if dashboard_port is not None:
            dashboard = _start_dashboard(config_path, overrides, run_dir, dashboard_port, out_lock)
        if display is not None:
            display.start()

        def tick() -> None:
            rss.sample()
            if display is not None:
                display.refresh()

        code = _supervise(children, server, stopping, tick, lambda c: _start(c, out_lock, not live, logs))
    finally:
        watching.set()
        if display is not None:
            display.stop()
        if dashboard is not None:
            _end_process(dashboard, 5.0)
        _stop(children, STOP_GRACE_S)
        if watcher is not None:  # before the server stops, so that its connection closes cleanly
            watcher.join(timeout=10)
        if server is not None:
            server.stop()
        for s, h in old.items():
            signal.signal(s, h)
    _finish(cfg, time.monotonic() - started, rss.peaks())
    return code


def _start_dashboard(
    config_path: str, overrides: Sequence[str], run_dir: Path, port: int, out_lock: threading.Lock
) -> subprocess.Popen[bytes]:
    """``areal-async dashboard`` of this run in a process of its own (a page load never slows the
    supervision loop); its URL and how to reach it are printed once it listens. It reads the
    run as its ``ops`` user; it is not restarted."""
    from workers.dashboard import URL_FILE

    (run_dir / URL_FILE).unlink(missing_ok=True)
    sets = [a for o in overrides for a in ("--set", o)]
    out = run_dir / "logs" / "dashboard.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workers",
                "dashboard",
                "--config",
                config_path,
                *sets,
                "--port",
                str(port),
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def tell() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / URL_FILE).is_file():
                with out_lock:
                    sys.stderr.write(out.read_text())
                    sys.stderr.flush()
                return
            time.sleep(0.2)
        with out_lock:
            sys.stderr.write(f"warning: the dashboard did not start; see {out}\n")

    threading.Thread(target=tell, daemon=True).start()
    return proc


def _end_process(proc: subprocess.Popen[bytes], grace: float) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _watch(
    cfg: RunConfig,
    url: str,
    passwords: Mapping[str, str] | None,
    children: Sequence[Child],
    done: threading.Event,
    out_lock: threading.Lock,
) -> threading.Thread | None:
    """Start the stall watchdog's thread (unless ``watchdog.enabled`` is false); it ends once
    ``done`` is set."""
    if not cfg.watchdog.enabled:
        return None
    from bus import ConnectOptions
    from workers import watchdog
    from workers.runtime import connect_options

    if passwords is not None:
        options = ConnectOptions(url=url, name="watchdog", user="ops", password=passwords["ops"])
    else:
        options = connect_options(cfg.bus, name="watchdog")

    def act(verdict: watchdog.Verdict) -> str:
        """SIGKILL the stalled worker's whole process tree (its torchrun ranks too) if it is one of
        ours and alive; the supervision loop then restarts it."""
        parents = _parents()
        if verdict.pid not in parents:
            return "gone"
        for c in children:
            if c.role == verdict.role and c.proc and c.proc.poll() is None:
                tree = process_tree(c.proc.pid, parents)
                if verdict.pid in tree:
                    for pid in tree:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    return "killed"
        return "none"  # not a process of this launcher (another host, another supervisor)

    def warn(line: str) -> None:
        with out_lock:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    return watchdog.start_thread(cfg, options, act, stop=done, warn=warn)


def _supervise(
    children: Sequence[Child],
    server: EmbeddedServer | None,
    stopping: threading.Event,
    tick: Callable[[], None],
    restart: Callable[[Child], None],
) -> int:
    """Watch the server and the workers until the run ends (0), a part fails for good (1), or a
    stop signal arrives (130)."""
    server_restarts = 0
    while not stopping.is_set():
        time.sleep(0.2)
        tick()
        if server is not None and not server.running:
            if server_restarts >= MAX_RESTARTS:
                sys.stderr.write(
                    f"error: nats-server failed {server_restarts + 1} times (exit {server.returncode}); "
                    "stopping the run\n"
                )
                return 1
            server_restarts += 1
            sys.stderr.write(
                f"warning: nats-server exited with {server.returncode}; "
                f"restart {server_restarts}/{MAX_RESTARTS} on {server.url}\n"
            )
            try:
                server.restart()
            except EmbeddedServerError as exc:
                sys.stderr.write(f"error: nats-server did not restart: {exc}\n")
                return 1
        controller = next((c for c in children if c.role == "controller"), None)
        if controller and controller.proc and controller.proc.poll() == 0:
            _wait_others(children, RUN_END_GRACE_S, tick)
            return 0
        for c in children:
            rc = c.proc.poll() if c.proc else None
            if rc is None or (rc == 0 and c.role != "controller"):
                continue
            if c.restarts >= MAX_RESTARTS:
                sys.stderr.write(
                    f"error: {c.role} failed {c.restarts + 1} times (exit {rc}); stopping the run\n"
                )
                return 1
            c.restarts += 1
            sys.stderr.write(f"warning: {c.role} exited with {rc}; restart {c.restarts}/{MAX_RESTARTS}\n")
            restart(c)
        if not any(c.proc and c.proc.poll() is None for c in children):
            return 0
    return 130


class _LiveDisplay:
    """rich Live table refreshed about once a second from the run dir."""

    def __init__(self, run_dir: Path, children: Sequence[Child]) -> None:
        from rich.live import Live

        self.run_dir = run_dir
        self.children = {c.role: c for c in children}
        self.started = time.time()
        self.live = Live(auto_refresh=False)
        self.last = 0.0

    def _proc(self, role: str) -> tuple[bool, int, int]:
        c = self.children[role]
        return (c.proc is not None and c.proc.poll() is None), c.restarts, c.peak_rss

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


def _wait_others(children: Sequence[Child], grace: float, tick: Callable[[], None]) -> None:
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(c.proc and c.proc.poll() is None for c in children):
        time.sleep(0.2)
        tick()


def _prepare_model(cfg: RunConfig, roles: Sequence[str]) -> Path | None:
    """Convert the bundled model once, before the workers start (they would race otherwise); for
    any other ``model.path``, check that it can be loaded here before starting the roles that load
    it (every role reads at least its tokenizer but reward and weight-sync)."""
    simulated = cfg.rollout.engine == "simulated" and cfg.trainer.backend == "simulated"
    if simulated:  # no role loads the model or its tokenizer
        return None
    if cfg.model.path != "smollm2":
        if set(roles) - {"reward", "weight-sync"}:
            check_model_available(cfg.model.path)
        return None
    from areal_async.models import prepare_smollm2

    return prepare_smollm2(None, dtype="float32")


def check_model_available(path: str) -> None:
    """A local file or directory, or a hub id already in the Hugging Face cache; ConfigError naming
    how to get it otherwise (the workers would each fail on it, later and less clearly)."""
    if Path(path).expanduser().exists():
        return
    looks_like_id = path.count("/") == 1 and not path.startswith((".", "/", "~"))
    if looks_like_id:
        try:
            from huggingface_hub import snapshot_download

            snapshot_download(path, local_files_only=True, allow_patterns=["config.json"])
            return
        except Exception:  # not cached (or no huggingface_hub): say how to get it
            pass
    how = (
        f"download it where there is internet (`hf download {path} --local-dir models/{path.split('/')[-1]}`) "
        "and set model.path to that directory, or fill the Hugging Face cache (HF_HOME) beforehand"
        if looks_like_id
        else "set model.path to an HF model directory, a .gguf file, a hub id in the Hugging Face cache, or smollm2"
    )
    raise ConfigError(f"model.path {path!r} is neither on disk here nor in the Hugging Face cache; {how}")


def _finish(cfg: RunConfig, wall_s: float, peak_rss: Mapping[str, int]) -> None:
    from workers.report import write_report

    write_report(cfg.run_dir, wall_s=wall_s, peak_rss=peak_rss)
