"""Helpers for tests that run whole jobs: write a run file, run it, read what it left behind.

A job runs as real processes (``python -m workers run``: an embedded nats-server and one
process per role). After it ends, ``read_steps`` restarts a nats-server on the run's own
JetStream store and reads every ``trainer.step`` event back, so assertions check the
events the controller saw, not a side file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import yaml

from bus import ConnectOptions, EmbeddedServer, connect
from bus.events import TrainerStep

REPO = Path(__file__).resolve().parents[2]


def tiny_config(tmp: Path, model_dir: Path, name: str, **sections: Any) -> Path:
    """A run file for the tiny mode-select task; ``sections`` override nested keys."""
    cfg: dict[str, Any] = {
        "name": name,
        "dir": str(tmp / name),
        "model": {"path": str(model_dir), "use_chat_template": False},
        "dataset": {
            "kind": "mode_select",
            "eval_size": 30,
            "epochs": 1000,
            "options": {"eval_fraction": 0.3},
        },
        "rollout": {
            "group_size": 8,
            "max_staleness": 2,
            "max_batch_size": 64,
            "sampling": {"max_new_tokens": 4},
        },
        "reward": {"fn": "arithmetic_strict", "num_workers": 1, "timeout_s": 5},
        "trainer": {
            "batch_size": 16,
            "total_steps": 20,
            "micro_batch_tokens": 4096,
            "eval_every": 5,
            "num_threads": 1,
            "optimizer": {"lr": 3.0e-4},
        },
        "checkpoint": {"every_steps": 5},
        "bus": {"ack_wait_s": 15},
        "logging": {"format": "json"},
        "metrics": {"loggers": ["tensorboard"]},
    }
    for key, value in sections.items():
        node = cfg
        *path, last = key.split("__")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@dataclass
class JobResult:
    run_dir: Path
    returncode: int
    output: str
    seconds: float

    def metrics(self) -> list[dict[str, Any]]:
        return _jsonl(self.run_dir / "metrics.jsonl")

    def evals(self) -> list[dict[str, Any]]:
        return _jsonl(self.run_dir / "eval.jsonl")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def start_job(config: Path, *overrides: str, flags: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """``areal-async run`` of `config` (with `flags`, e.g. ``--dashboard``) in the background. Its
    output goes to a temporary file as it comes (a pipe nobody reads would fill and block the
    launcher, and the workers behind it); ``finish_job`` moves it to ``<run_dir>/job.out``."""
    args = [sys.executable, "-m", "workers", "run", str(config), "--no-live", *flags]
    for o in overrides:
        args += ["--set", o]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with tempfile.NamedTemporaryFile(prefix=f"{config.stem}-", suffix=".out", delete=False) as out:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    proc.output_path = Path(out.name)  # type: ignore[attr-defined]
    return proc


def finish_job(proc: subprocess.Popen[bytes], run_dir: Path, started: float, timeout: float) -> JobResult:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.wait(timeout=60)
    output: Path = proc.output_path  # type: ignore[attr-defined]
    text = output.read_text(errors="replace")
    output.unlink()
    (run_dir / "job.out").parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.out").write_text(text)
    return JobResult(run_dir, proc.returncode, text, time.monotonic() - started)


def run_job(config: Path, *overrides: str, timeout: float = 600) -> JobResult:
    from areal_async.run_file import load_config

    run_dir = load_config(config, overrides).run_dir
    started = time.monotonic()
    return finish_job(start_job(config, *overrides), run_dir, started, timeout)


def worker_log(run_dir: Path, role: str, event: str) -> list[dict[str, Any]]:
    """Every JSON log record of ``event`` by the workers of ``role``, with its log file's name."""
    lines = []
    for path in sorted((run_dir / "logs").glob(f"{role}-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("event") == event:
                lines.append({**record, "file": path.name})
    return lines


def start_extra_generation(config: Path, run_dir: Path, worker_id: str) -> subprocess.Popen[bytes]:
    """A generation worker of the running job of ``config``, started by hand as an operator would
    (the run's URL and its generation user's password), beside the launcher's own."""
    from bus.embedded import read_credentials

    url = (run_dir / "nats.url").read_text().strip()
    password = read_credentials(run_dir / "nats")["generation"]
    return subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "--role", "generation", "--config", str(config)]
        + ["--set", f"bus.url={url}", "--set", "bus.user=generation", "--worker-id", worker_id],
        cwd=REPO,
        env={**os.environ, "AREAL_NATS_PASSWORD": password},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def steps_done(run_dir: Path) -> int:
    """Training steps the trainer has logged so far (lines of ``metrics.jsonl``)."""
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def read_stream(run_dir: Path, run_name: str, key: str, event_type: type[Any] | None = None) -> list[Any]:
    """Every event stored in one of the run's JetStream streams (``key``: STEPS, DEADLETTER, ...)."""
    from nats.js.errors import NotFoundError

    from bus.events import decode

    async def _read(url: str) -> list[Any]:
        bus = await connect(ConnectOptions(url=url, name="test-reader"), run_name)
        try:
            spec = bus.subjects.stream(key)
            info = await bus.js.stream_info(spec.name)
            out = []
            if not info.state.messages:  # an empty stream reports first_seq 0 (or last_seq + 1)
                return out
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                try:
                    raw = await bus.js.get_msg(spec.name, seq)
                except NotFoundError:  # a message removed by the stream's limits
                    continue
                out.append(decode(raw.data, event_type) if event_type else decode(raw.data))
            return out
        finally:
            await bus.close()

    server = EmbeddedServer(run_dir / "nats")
    server.start()
    try:
        assert server.url is not None
        return anyio.run(_read, server.url, backend="asyncio")
    finally:
        server.stop()


def read_steps(run_dir: Path, run_name: str) -> list[TrainerStep]:
    """Every trainer.step event stored in the run's JetStream store, in publish order."""
    return read_stream(run_dir, run_name, "STEPS", TrainerStep)


def committed_steps(steps: list[TrainerStep]) -> dict[int, TrainerStep]:
    """The surviving step of each number: a restarted trainer re-publishes lost step numbers."""
    final: dict[int, TrainerStep] = {}
    for ev in steps:
        for lost in [s for s in final if s >= ev.step]:
            del final[lost]
        final[ev.step] = ev
    return final


def steps_clear_of_lost_versions(steps: list[TrainerStep]) -> tuple[list[TrainerStep], set[int]]:
    """The committed steps of a max_staleness 0 run whose groups hold no token of a lost version, and
    the lost versions: those a killed trainer published after its checkpoint, trained again under the
    same numbers. A group trained at step h + 1 started under version h and, interrupted by a newer
    version, may have finished under h + 1, so a step is clear when neither h nor h + 1 was lost."""
    lost = {n for n, count in Counter(ev.step for ev in steps).items() if count > 1}
    clear = [
        ev for ev in committed_steps(steps).values() if not any({h, h + 1} & lost for h in ev.head_versions)
    ]
    return clear, lost
