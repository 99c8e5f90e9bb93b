"""Experiment trackers against the real libraries: W&B in offline mode (its run files read back
record by record) and MLflow on a local file store (read back through ``MlflowClient``), driven
through ``workers/trackers.py`` and once through the trainer's step and evaluation path."""

from __future__ import annotations

import json
import shutil
import struct
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import structlog
from google.protobuf.message import DecodeError
from mlflow.tracking import MlflowClient

from areal_async.config import MetricsConfig, MlflowConfig, WandbConfig
from areal_async.errors import ConfigError
from areal_async.run_file import build_config
from bus.events import Completion, MetricsReport, RolloutGroup, ScoredGroup, pack_f32, pack_i32
from workers.runtime import WorkerContext
from workers.trackers import ROLLOUT_COLUMNS, STATE_FILE, open_trackers, rollout_rows
from workers.trainer import Held, Trainer, trainer_trackers


@pytest.fixture
def tracker_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """W&B offline with its files under tmp; MLflow's file store allowed (recent MLflow asks)."""
    wandb_dir = tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return SimpleNamespace(wandb_dir=wandb_dir, mlflow_uri=f"file:{tmp_path / 'mlruns'}")


def _metrics(env: SimpleNamespace, loggers: list[str], **options: Any) -> MetricsConfig:
    return MetricsConfig(
        loggers=loggers,
        wandb=WandbConfig(project="tests"),
        mlflow=MlflowConfig(tracking_uri=env.mlflow_uri, experiment="tests"),
        **options,
    )


def _wandb_records(path: Path) -> list[Any]:
    """The records of an offline run's ``.wandb`` file (W&B's log format: 32 KiB blocks of
    checksummed chunks), as W&B's own protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # zero padding to the end of a block
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _wandb_runs(wandb_dir: Path) -> list[SimpleNamespace]:
    """Each offline run directory in start order: run id, name, config keys, history rows."""
    runs = []
    for run_dir in sorted((wandb_dir / "wandb").glob("offline-run-*")):
        # W&B's service process writes the file, and goes on writing it after finish() returns: it
        # is read again until its last record, ``exit``, is there.
        deadline = time.monotonic() + 30
        while True:
            paths = list(run_dir.glob("run-*.wandb"))
            try:
                records = _wandb_records(paths[0]) if len(paths) == 1 else []
            except (AssertionError, DecodeError):  # not yet a header, or a chunk half written
                records = []
            if (records and records[-1].WhichOneof("record_type") == "exit") or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(paths) == 1, paths
        run = SimpleNamespace(id="", name="", config={}, history=[], files=run_dir / "files")
        for record in records:
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.id, run.name = record.run.run_id, record.run.display_name
                run.config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "config":
                run.config.update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif kind == "history":
                run.history.append(_history_row(record.history.item))
        run.config.pop("_wandb", None)
        runs.append(run)
    return runs


def _history_row(items: Any) -> dict[str, Any]:
    """A history record as a dict; a value under a nested key (a table's fields) as nested dicts."""
    row: dict[str, Any] = {}
    for item in items:
        path = [item.key] if item.key else list(item.nested_key)
        node = row
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = json.loads(item.value_json)
    return row


def _groups(count: int) -> list[ScoredGroup]:
    groups = []
    for g in range(count):
        completions = [
            Completion(
                token_ids=pack_i32([4, 5, 6][: 2 + i]),
                logprobs=pack_f32([-0.5, -0.5, -0.5][: 2 + i]),
                versions=pack_i32([0, 0, 0][: 2 + i]),
                finish_reason="stop",
                text=f"answer {g}.{i}",
            )
            for i in range(2)
        ]
        group = RolloutGroup(
            task_id=f"e0-i{g}", kind="train", index=g, epoch=0, attempt=0,
            row={"prompt": f"{g} + 1 =", "answer": str(g + 1)}, engine_id="generation-1",
            prompt_ids=pack_i32([1, 2]), completions=completions, head_version=0, tail_version=0,
        )  # fmt: skip
        groups.append(
            ScoredGroup(group=group, rewards=[1.0, 0.0], reward_errors=["", ""], reward_seconds=0.0)
        )
    return groups


def _history(rows: list[dict[str, Any]], axis: str, key: str) -> list[tuple[int, float]]:
    return [(r[axis], r[key]) for r in rows if key in r]


def test_a_wandb_offline_run_holds_steps_evaluations_config_and_a_rollout_table(
    tracker_env: SimpleNamespace, tmp_path: Path
) -> None:
    """Steps against ``train/step``, evaluations against the policy version, the config once, and a
    table of sampled rollouts (prompt, completion, reward) land in one W&B run named after the run."""
    rows = rollout_rows(3, _groups(3), samples=4)
    assert len(rows) == 4 and len({r[1] for r in rows}) >= 2  # spread over the groups
    trackers = open_trackers(
        _metrics(tracker_env, ["wandb"]),
        root=tmp_path / "run",
        name="r1",
        config={"trainer": {"batch_size": 4}},
    )
    for step in (1, 2):
        trackers.log_step(step, {"loss": 1.0 / step, "reward_mean": 0.5})
    trackers.log_eval(0, {"eval/accuracy": 0.25})
    trackers.log_rollouts(3, ROLLOUT_COLUMNS, rows)
    trackers.log_step(3, {"loss": 1.0 / 3, "reward_mean": 0.5})
    trackers.close()

    (run,) = _wandb_runs(tracker_env.wandb_dir)
    state = json.loads((tmp_path / "run" / STATE_FILE).read_text())
    assert run.id == state["wandb"]["run_id"] and run.name == "r1" and state["logged_step"] == 3
    assert run.config == {"trainer": {"batch_size": 4}}
    assert _history(run.history, "train/step", "train/loss") == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]
    assert _history(run.history, "eval/policy_version", "eval/accuracy") == [(0, 0.25)]
    (table_row,) = [r for r in run.history if "train/rollouts" in r]
    assert table_row["train/step"] == 3 and table_row["train/rollouts"]["nrows"] == 4
    table = json.loads((run.files / table_row["train/rollouts"]["path"]).read_text())
    assert table["columns"] == list(ROLLOUT_COLUMNS) and table["data"] == rows
    assert {r[3] for r in rows} <= {"0 + 1 =", "1 + 1 =", "2 + 1 ="} and rows[0][4].startswith("answer")


def test_an_mlflow_run_on_a_file_store_holds_steps_evaluations_config_and_rollout_tables(
    tracker_env: SimpleNamespace, tmp_path: Path
) -> None:
    """Metrics at their steps, evaluations at their policy versions, the config as params and a
    file, and each rollout table as an artifact, in a finished MLflow run named after the run."""
    rows = rollout_rows(2, _groups(2), samples=3)
    trackers = open_trackers(
        _metrics(tracker_env, ["mlflow"]),
        root=tmp_path / "run",
        name="r1",
        config={"trainer": {"batch_size": 4, "loss": {"preset": "ppo"}}},
    )
    trackers.log_step(1, {"loss": 1.0})
    trackers.log_rollouts(2, ROLLOUT_COLUMNS, rows)
    trackers.log_step(2, {"loss": 0.5})
    trackers.log_eval(2, {"eval/accuracy": 0.75, "eval/count": 8})
    trackers.close()

    client = MlflowClient(tracking_uri=tracker_env.mlflow_uri)
    run_id = json.loads((tmp_path / "run" / STATE_FILE).read_text())["mlflow"]["run_id"]
    run = client.get_run(run_id)
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "tests"
    assert run.data.params == {"trainer.batch_size": "4", "trainer.loss.preset": '"ppo"'}
    loss = client.get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in loss] == [(1, 1.0), (2, 0.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/accuracy")] == [(2, 0.75)]
    config = json.loads(Path(client.download_artifacts(run_id, "config.json", str(tmp_path))).read_text())
    assert config["trainer"]["batch_size"] == 4
    table_path = client.download_artifacts(run_id, "train/rollouts/step_000002.json", str(tmp_path))
    assert json.loads(Path(table_path).read_text()) == {"columns": list(ROLLOUT_COLUMNS), "data": rows}


def test_reopened_trackers_continue_their_runs_and_log_no_step_twice(
    tracker_env: SimpleNamespace, tmp_path: Path
) -> None:
    """A restarted process continues the same W&B and MLflow runs (ids from the run dir), logs the
    config only once, and skips the steps it logged before (a resumed trainer trains them again):
    every step appears once, with the value logged first."""
    root, loggers = tmp_path / "run", ["tensorboard", "wandb", "mlflow"]
    first = open_trackers(_metrics(tracker_env, loggers), root=root, name="r1", config={"seed": 1})
    for step in range(1, 5):
        assert first.log_step(step, {"loss": float(step)})
    first.close()
    second = open_trackers(_metrics(tracker_env, loggers), root=root, name="r1", config={"seed": 2})
    logged = [second.log_step(step, {"loss": 100.0 + step}) for step in range(3, 7)]
    second.close()
    assert logged == [False, False, True, True]
    want = [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 106.0)]

    runs = _wandb_runs(tracker_env.wandb_dir)
    assert len(runs) == 2 and runs[0].id == runs[1].id
    assert runs[0].config == {"seed": 1} and runs[1].config == {}
    assert sorted(p for run in runs for p in _history(run.history, "train/step", "train/loss")) == want

    client = MlflowClient(tracking_uri=tracker_env.mlflow_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    run_ids = {r.info.run_id for r in client.search_runs(experiments)}
    assert len(run_ids) == 1
    (run_id,) = run_ids
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")) == want
    assert client.get_run(run_id).data.params == {"seed": "1"}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    events = EventAccumulator(str(root / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert sorted((e.step, float(make_ndarray(e.tensor_proto))) for e in events.Tensors("train/loss")) == want


def test_a_failing_tracker_warns_once_and_the_others_go_on(
    tracker_env: SimpleNamespace, tmp_path: Path
) -> None:
    """When an open tracker starts failing (here its MLflow run vanishes from the store), no call
    raises: one warning names it, the other trackers get every step, and close reports the count."""
    root = tmp_path / "run"
    trackers = open_trackers(
        _metrics(tracker_env, ["mlflow", "tensorboard"]), root=root, name="r1", config={}
    )
    trackers.log_step(1, {"loss": 1.0})
    assert trackers.flush()
    run_id = json.loads((root / STATE_FILE).read_text())["mlflow"]["run_id"]
    (run_dir,) = (tmp_path / "mlruns").glob(f"*/{run_id}")
    shutil.rmtree(run_dir)
    with structlog.testing.capture_logs() as logs:
        for step in (2, 3, 4):
            assert trackers.log_step(step, {"loss": float(step)})
        trackers.log_eval(2, {"eval/accuracy": 0.5})
        trackers.close()
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [(w["event"], w.get("tracker")) for w in warnings] == [
        ("tracker call failed; training goes on", "mlflow"),
        ("tracker calls failed during the run", None),
    ]
    assert warnings[1]["failures"] == {"mlflow": 5} and warnings[1]["dropped"] == 0  # 3 steps, eval, close
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert [e.step for e in events.Tensors("train/loss")] == [1, 2, 3, 4]


@pytest.mark.parametrize("missing", ["wandb", "mlflow"])
def test_a_missing_tracker_package_fails_at_open_naming_the_extra(
    tracker_env: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    """Naming a tracker whose package is not installed fails before anything is opened, with the
    pip command of the extra that installs it."""
    monkeypatch.setitem(sys.modules, missing, None)  # what an absent package looks like to import
    with pytest.raises(ConfigError, match=rf"pip install 'areal-async\[{missing}\]'"):
        open_trackers(
            _metrics(tracker_env, ["tensorboard", missing]), root=tmp_path / "run", name="r1", config={}
        )
    assert not (tmp_path / "run" / "tensorboard").exists()


class ScriptedLearner:
    """What the trainer's step asks of its learner, without a model: each step's metrics are
    scripted (its loss is ``offset + version``), weights are empty, checkpoints are recorded."""

    def __init__(self, version: int, offset: float) -> None:
        self.version, self.offset, self.checkpoints = version, offset, []

    def step(self, samples: list[Any]) -> dict[str, float]:
        self.version += 1
        return {"loss": self.offset + self.version, "reward_mean": 0.5, "loss_tokens": 8.0}

    def snapshot_weights(self, **options: Any) -> dict[str, Any]:
        return {}

    def write_weights(self, path: Path, tensors: dict[str, Any]) -> list[dict[str, Any]]:
        return []

    def checkpoint(self, run_dir: Path, extra: dict[str, Any], keep: int) -> None:
        self.checkpoints.append(extra["policy_version"])


@pytest.mark.asyncio
async def test_the_trainer_logs_steps_evaluations_and_rollouts_and_a_restart_repeats_none(
    tracker_env: SimpleNamespace, bus_factory, run_name: str, tmp_path: Path
) -> None:
    """Through the trainer's own path: each step's metrics and, every ``rollout_every`` steps, a
    rollout table reach the trackers, and so does an evaluation the controller reports on
    ``metrics``. A trainer restarted from the checkpoint at step 2 trains steps 3 and 4 again;
    the tracker run holds steps 1-4 once each, step 3 with the value logged first."""
    bus = await bus_factory(provision=True)
    cfg = build_config(
        {
            "name": run_name,
            "dir": str(tmp_path / run_name),
            "dataset": {"kind": "mode_select", "eval_size": 0},
            "trainer": {"batch_size": 2, "total_steps": 10},
            "checkpoint": {"every_steps": 2},
            "metrics": {
                "loggers": ["mlflow", "wandb"],
                "rollout_every": 2,
                "rollout_samples": 3,
                "mlflow": {"tracking_uri": tracker_env.mlflow_uri},
            },
        }
    )
    cfg.run_dir.mkdir(parents=True)
    ctx = WorkerContext(cfg=cfg, role="trainer", worker_id="trainer-1", bus=bus)

    async def ack() -> None:
        pass

    def evaluations() -> list[tuple[int, float]]:
        run_id = json.loads((cfg.run_dir / STATE_FILE).read_text())["mlflow"]["run_id"]
        history = MlflowClient(tracking_uri=tracker_env.mlflow_uri).get_metric_history(
            run_id, "eval/accuracy"
        )
        return [(m.step, m.value) for m in history]

    async def run(version: int, offset: float, steps: int, *, evaluate: bool) -> None:
        """One trainer process from ``version``: trackers opened as ``serve`` opens them."""
        trackers = await anyio.to_thread.run_sync(trainer_trackers, cfg)
        trainer = Trainer(ctx, ScriptedLearner(version, offset), trained_ids=set(), trackers=trackers)
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer.write_weights)
            await tg.start(trainer.log_evaluations)
            for _ in range(steps):
                await trainer.train([Held(g, SimpleNamespace(ack=ack), 0.0) for g in _groups(2)], 0.0)
            if evaluate:
                report = MetricsReport(step=2, policy_version=2, values={"eval/accuracy": 0.75})
                await bus.publish(bus.subjects.metrics, report)
                with anyio.fail_after(10):
                    while not await anyio.to_thread.run_sync(evaluations):  # noqa: ASYNC110
                        await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
        await anyio.to_thread.run_sync(trackers.close)

    await run(0, 0.0, 3, evaluate=True)  # steps 1-3; the checkpoint is at step 2
    await run(2, 100.0, 2, evaluate=False)  # restored at 2: steps 3 and 4 again

    want = [(1, 1.0), (2, 2.0), (3, 3.0), (4, 104.0)]
    run_id = json.loads((cfg.run_dir / STATE_FILE).read_text())["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=tracker_env.mlflow_uri)
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")) == want
    assert evaluations() == [(2, 0.75)]
    tables = sorted(a.path for a in client.list_artifacts(run_id, "train/rollouts"))
    assert tables == ["train/rollouts/step_000002.json", "train/rollouts/step_000004.json"]
    assert client.get_run(run_id).data.params["trainer.batch_size"] == "2"
    runs = _wandb_runs(tracker_env.wandb_dir)
    assert len(runs) == 2 and runs[0].id == runs[1].id and runs[0].name == run_name
    assert sorted(p for r in runs for p in _history(r.history, "train/step", "train/loss")) == want
    lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 3, 4]  # the file keeps every step
