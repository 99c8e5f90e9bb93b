"""Experiment trackers: step metrics, evaluations, the resolved config and samples of rollouts, to
TensorBoard, Weights & Biases and MLflow (``metrics.loggers``; docs/operations.md, "Experiment
trackers"). The trainer's rank 0 and ``areal-async sft`` write through this module; ``metrics.jsonl``
stays the record of every step either way.

    trackers = open_trackers(cfg.metrics, root=cfg.run_dir, name=cfg.name, config=config_to_dict(cfg))
    trackers.log_step(7, {"loss": 0.31, "reward_mean": 0.6})      # train/loss, train/reward_mean
    trackers.log_eval(6, {"eval/accuracy": 0.55})                  # against the policy version
    trackers.log_rollouts(7, ROLLOUT_COLUMNS, rows)
    trackers.close()

Guarantees:

- Opening is the start-up check, made before the caller loads a model: a tracker whose package is
  missing raises ``ConfigError`` naming the extra to install, and one that cannot be opened (a
  wrong URI, a refused server) raises what its library raised. A new tracker run gets the
  resolved config once.
- Once open, a call never blocks and never raises: it is queued (bounded, ``QUEUE_SIZE``) for one
  background thread that makes the trackers' calls in order, so a slow or unreachable server
  does not hold up training. A call that fails (the network, a full disk) is logged as a warning
  the first time per tracker and counted after that (the counts are logged at close); a full
  queue drops calls, with one warning. ``metrics.jsonl`` has everything meanwhile.
- Resume: ``<root>/trackers.json`` keeps each tracker's run id and the last step logged (written
  just before the step's calls). A restarted process continues the same W&B and MLflow runs and
  logs no step twice: a trainer resumed from a checkpoint trains the steps after it again, and
  the trackers keep the values they logged first (a W&B history only moves forward); a process
  killed outright loses at most the steps it had queued.
- ``flush()`` waits for the calls queued so far; ``close()`` waits for them (up to
  ``close_timeout_s``), then closes each tracker.

No torch here.
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import structlog

from areal_async.config import MetricsConfig, MlflowConfig, WandbConfig
from areal_async.errors import ConfigError
from areal_async.files import write_text_atomic
from bus.events import ScoredGroup

log = structlog.get_logger(__name__)

STATE_FILE = "trackers.json"
"""Under the caller's root: each tracker's run id and the last step logged."""

CLOSE_TIMEOUT_S = 60.0
"""Longest wait at close for the queued calls and the trackers' own finishing (a W&B upload)."""

QUEUE_SIZE = 1000
"""Calls waiting for the background thread at most (a thousand steps' metrics, tables, evaluations)."""

EVAL_STEP = "eval/policy_version"
"""The x axis of evaluations: the policy version they measured."""

ROLLOUT_COLUMNS = (
    "step",
    "task_id",
    "head_version",
    "prompt",
    "completion",
    "answer",
    "reward",
    "finish_reason",
    "tokens",
)
"""Columns of a rollout table (``rollout_rows``)."""


class Tracker(Protocol):
    """One experiment tracker. ``log_step`` keys are bare (``loss``; the tracker files them under
    its section, ``train/loss``); ``log_eval`` keys are whole (``eval/accuracy``)."""

    name: str
    run_id: str | None
    """What resumes this tracker's run in a later process (None: nothing to resume)."""

    def log_config(self, config: Mapping[str, Any]) -> None: ...
    def log_step(self, step: int, values: Mapping[str, float]) -> None: ...
    def log_eval(self, policy_version: int, values: Mapping[str, float]) -> None: ...
    def log_rollouts(self, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None: ...
    def close(self) -> None: ...


def _require(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"metrics.loggers includes {extra!r} but the {module} package is not installed; "
            f"pip install 'areal-async[{extra}]', or remove {extra!r} from metrics.loggers"
        ) from exc


# --------------------------------------------------------------------------------------
# The three trackers
# --------------------------------------------------------------------------------------


class TensorBoardTracker:
    """Scalars into ``<root>/tensorboard/`` (the config is in ``<run_dir>/config/``; no tables)."""

    name = "tensorboard"
    run_id = None

    def __init__(self, *, root: Path, section: str) -> None:
        try:
            from tensorboard.summary import Writer
        except ImportError as exc:
            raise ConfigError(
                "metrics.loggers includes 'tensorboard' but the tensorboard package is not installed "
                "(a dependency of areal-async); reinstall areal-async, or remove 'tensorboard' from "
                "metrics.loggers"
            ) from exc
        self.section = section
        self.writer = Writer(str(root / "tensorboard"))

    def log_config(self, config: Mapping[str, Any]) -> None:
        pass

    def log_step(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"{self.section}/{key}", value, step)
        self.writer.flush()

    def log_eval(self, policy_version: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, policy_version)
        self.writer.flush()

    def log_rollouts(self, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        pass

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run named after the run; ``<section>/*`` plotted against ``<section>/step`` and
    ``eval/*`` against the policy version, so evaluations finishing late land in place."""

    name = "wandb"

    def __init__(
        self, options: WandbConfig, *, root: Path, name: str, run_id: str | None, section: str
    ) -> None:
        wandb = _require("wandb", "wandb")
        self.wandb = wandb
        self.section = section
        self.step_key = f"{section}/step"
        self.run = wandb.init(
            project=options.project,
            entity=options.entity,
            mode=options.mode,
            name=name,
            id=run_id,
            resume="allow",
            tags=list(options.tags) or None,
            dir=os.environ.get("WANDB_DIR") or str(root),
            settings=wandb.Settings(console="off"),
            reinit="create_new",
        )
        self.run_id: str | None = self.run.id
        self.run.define_metric(self.step_key)
        self.run.define_metric(f"{section}/*", step_metric=self.step_key)
        self.run.define_metric(EVAL_STEP)
        self.run.define_metric("eval/*", step_metric=EVAL_STEP)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log_step(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log({self.step_key: step, **{f"{self.section}/{k}": v for k, v in values.items()}})

    def log_eval(self, policy_version: int, values: Mapping[str, float]) -> None:
        self.run.log({EVAL_STEP: policy_version, **values})

    def log_rollouts(self, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        table = self.wandb.Table(columns=list(columns), data=[list(r) for r in rows])
        self.run.log({self.step_key: step, f"{self.section}/rollouts": table})

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run named after the run in ``mlflow.experiment``; metrics at the step (evaluations
    at the policy version), the config as params and ``config.json``, each rollout table as
    ``<section>/rollouts/step_<N>.json`` (MLflow's table layout: columns and data)."""

    name = "mlflow"
    PARAMS_PER_CALL = 100
    """MLflow's limit of params in one ``log_batch``."""
    PARAM_CHARS = 6000
    """MLflow's limit of a param value's length."""

    def __init__(self, options: MlflowConfig, *, name: str, run_id: str | None, section: str) -> None:
        _require("mlflow", "mlflow")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric, self.Param = Metric, Param
        self.section = section
        self.client = MlflowClient(tracking_uri=options.tracking_uri)
        if run_id is not None:
            try:
                run = self.client.get_run(run_id)
            except Exception as exc:
                raise ConfigError(
                    f"MLflow run {run_id} of {STATE_FILE} is not at {self.client.tracking_uri} ({exc}); "
                    f"point metrics.mlflow.tracking_uri at it again, or delete its entry to start a new run"
                ) from exc
            if run.info.status != "RUNNING":
                self.client.update_run(run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(options.experiment)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(options.experiment)
            )
            run = self.client.create_run(experiment_id, run_name=name)
        self.run_id: str | None = run.info.run_id

    def _metrics(self, values: Mapping[str, float], step: int, prefix: str) -> list[Any]:
        now = int(time.time() * 1000)
        return [self.Metric(f"{prefix}{k}", float(v), now, step) for k, v in values.items()]

    def log_config(self, config: Mapping[str, Any]) -> None:
        assert self.run_id is not None
        params = [
            self.Param(key, json.dumps(value)[: self.PARAM_CHARS]) for key, value in _flatten(config).items()
        ]
        for i in range(0, len(params), self.PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i : i + self.PARAMS_PER_CALL])
        self.client.log_dict(self.run_id, dict(config), "config.json")

    def log_step(self, step: int, values: Mapping[str, float]) -> None:
        assert self.run_id is not None
        self.client.log_batch(self.run_id, metrics=self._metrics(values, step, f"{self.section}/"))

    def log_eval(self, policy_version: int, values: Mapping[str, float]) -> None:
        assert self.run_id is not None
        self.client.log_batch(self.run_id, metrics=self._metrics(values, policy_version, ""))

    def log_rollouts(self, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        assert self.run_id is not None
        table = {"columns": list(columns), "data": [list(r) for r in rows]}
        self.client.log_dict(self.run_id, table, f"{self.section}/rollouts/step_{step:06d}.json")

    def close(self) -> None:
        assert self.run_id is not None
        self.client.set_terminated(self.run_id)


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# --------------------------------------------------------------------------------------
# The fan-out
# --------------------------------------------------------------------------------------


class Trackers:
    """Every configured tracker behind one set of calls; see the module docstring's guarantees."""

    def __init__(self, trackers: Sequence[Tracker], *, state_path: Path, state: dict[str, Any]) -> None:
        self.trackers = list(trackers)
        self.state_path = state_path
        self.state = state
        self.logged_through = int(state.get("logged_step", -1))
        """The last step queued (by this process) or logged (by an earlier one): skipped up to it."""
        self.failures: dict[str, int] = {}
        self.dropped = 0
        self.lock = threading.Lock()
        self.calls: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=QUEUE_SIZE)
        self.thread: threading.Thread | None = None
        if self.trackers:
            self.thread = threading.Thread(target=self._run_calls, name="trackers", daemon=True)
            self.thread.start()

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    def _run_calls(self) -> None:
        """The background thread: each queued call in order, until ``None``."""
        while (call := self.calls.get()) is not None:
            call()

    def _submit(self, call: Callable[[], None]) -> None:
        try:
            self.calls.put_nowait(call)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("trackers fall behind; dropping calls", queued=QUEUE_SIZE, trackers=self.names)

    def _each(self, call: Callable[[Tracker], None], what: str) -> None:
        for tracker in self.trackers:
            try:
                call(tracker)
            except Exception as exc:
                count = self.failures.get(tracker.name, 0)
                self.failures[tracker.name] = count + 1
                if count == 0:
                    log.warning(
                        "tracker call failed; training goes on",
                        tracker=tracker.name,
                        call=what,
                        error=f"{type(exc).__name__}: {exc}"[:500],
                    )

    def log_step(self, step: int, values: Mapping[str, float]) -> bool:
        """Queue one step's metrics (numbers only); False when ``step`` was logged already."""
        numbers = {k: float(v) for k, v in values.items() if isinstance(v, int | float)}
        with self.lock:
            if step <= self.logged_through or not self.trackers:
                return False
            self.logged_through = step

            def call() -> None:
                # Recorded first: a process killed in between loses this step from the trackers
                # rather than logging it twice after its restart.
                self.state["logged_step"] = step
                _write_state(self.state_path, self.state)
                self._each(lambda t: t.log_step(step, numbers), "log_step")

            self._submit(call)
            return True

    def log_eval(self, policy_version: int, values: Mapping[str, float]) -> None:
        """Queue an evaluation's values (whole keys, ``eval/accuracy``) at its policy version."""
        numbers = {k: float(v) for k, v in values.items() if isinstance(v, int | float)}
        if self.trackers:
            self._submit(lambda: self._each(lambda t: t.log_eval(policy_version, numbers), "log_eval"))

    def log_rollouts(self, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """Queue a table of rollouts, unless ``step`` was logged already."""
        with self.lock:
            if step <= self.logged_through or not rows or not self.trackers:
                return
        self._submit(lambda: self._each(lambda t: t.log_rollouts(step, columns, rows), "log_rollouts"))

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until the calls queued so far are made; False when ``timeout_s`` passed first."""
        if self.thread is None:
            return True
        done = threading.Event()
        try:
            self.calls.put(done.set, timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def close(self, close_timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Make the queued calls (waiting up to ``close_timeout_s``), then close every tracker."""
        if self.thread is None:
            return
        thread, self.thread = self.thread, None
        self._submit(lambda: self._each(lambda t: t.close(), "close"))
        self.calls.put(None)
        thread.join(close_timeout_s)
        if thread.is_alive():
            log.warning("trackers still busy at close; leaving them", waited_s=close_timeout_s)
        failed = {name: n for name, n in self.failures.items() if n}
        if failed or self.dropped:
            log.warning("tracker calls failed during the run", failures=failed, dropped=self.dropped)
        self.trackers = []


def require_trackers(metrics: MetricsConfig) -> None:
    """Raise ``ConfigError`` naming the extra to install when a package ``metrics.loggers`` needs is
    missing; reads and writes nothing."""
    for logger in metrics.loggers:
        if logger in ("wandb", "mlflow"):
            _require(logger, logger)


def open_trackers(
    metrics: MetricsConfig,
    *,
    root: Path,
    name: str,
    config: Mapping[str, Any],
    section: str = "train",
) -> Trackers:
    """Open ``metrics.loggers`` for the run ``name``, continuing the tracker runs that
    ``<root>/trackers.json`` names; a new tracker run gets ``config``. Raises at once on a missing
    package or a tracker that cannot be opened (having closed the ones it opened)."""
    require_trackers(metrics)  # every package first: nothing is opened when one is missing
    root.mkdir(parents=True, exist_ok=True)
    state_path = root / STATE_FILE
    state = _read_state(state_path)
    opened: list[Tracker] = []
    try:
        for logger in metrics.loggers:
            previous = state.get(logger, {}).get("run_id")
            tracker: Tracker
            if logger == "tensorboard":
                tracker = TensorBoardTracker(root=root, section=section)
            elif logger == "wandb":
                tracker = WandbTracker(metrics.wandb, root=root, name=name, run_id=previous, section=section)
            else:
                tracker = MlflowTracker(metrics.mlflow, name=name, run_id=previous, section=section)
            opened.append(tracker)
            if tracker.run_id is not None:
                if previous is None:
                    tracker.log_config(config)
                state[logger] = {"run_id": tracker.run_id}
                _write_state(state_path, state)
    except BaseException:
        for tracker in opened:
            try:
                tracker.close()
            except Exception:
                log.warning("tracker close failed", tracker=tracker.name, exc_info=True)
        raise
    if opened:
        log.info(
            "trackers open",
            loggers=[t.name for t in opened],
            resumed_after_step=state.get("logged_step"),
        )
    return Trackers(opened, state_path=state_path, state=state)


def _read_state(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); delete it to start new tracker runs") from exc
    if not isinstance(state, dict):
        raise ConfigError(f"{path} holds {type(state).__name__}, not a mapping; delete it")
    return state


def _write_state(path: Path, state: Mapping[str, Any]) -> None:
    write_text_atomic(path, json.dumps(state, indent=1, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------
# Rollout tables
# --------------------------------------------------------------------------------------


def rollout_rows(step: int, groups: Sequence[ScoredGroup], *, samples: int) -> list[list[Any]]:
    """Up to ``samples`` completions of ``groups`` (a seeded choice, spread over the groups), one
    row each in ``ROLLOUT_COLUMNS`` order."""
    picks = [(g, i) for g in groups for i in range(len(g.group.completions))]
    chosen = sorted(random.Random(step).sample(range(len(picks)), min(samples, len(picks))))
    rows = []
    for k in chosen:
        scored, i = picks[k]
        group, completion = scored.group, scored.group.completions[i]
        rows.append(
            [
                step,
                group.task_id,
                group.head_version,
                _prompt_text(group.row),
                completion.text,
                str(group.row.get("answer", "")),
                float(scored.rewards[i]),
                completion.finish_reason,
                completion.num_tokens,
            ]
        )
    return rows


def _prompt_text(row: Mapping[str, Any]) -> str:
    """The row's prompt, or the last message of a chat row."""
    if isinstance(row.get("prompt"), str):
        return row["prompt"]
    messages = row.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], Mapping):
        return str(messages[-1].get("content", ""))
    return ""
