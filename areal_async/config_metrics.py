"""The ``metrics`` section of the run configuration: where the trainer's numbers go besides
``metrics.jsonl`` (re-exported by ``areal_async.config``; docs/operations.md, "Experiment trackers").

No torch here: the CLI imports this module and must start fast.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Literal

from areal_async.config_checks import non_negative, positive

LOGGERS = ("tensorboard", "wandb", "mlflow")
"""The experiment trackers ``metrics.loggers`` may name (``workers/trackers.py`` implements them)."""


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """Weights & Biases (``metrics.loggers`` includes ``wandb``; ``pip install 'areal-async[wandb]'``)."""

    project: str = "areal-async"
    """W&B project of the run."""

    entity: str | None = None
    """W&B team or user (None: the API key's default entity)."""

    mode: Literal["online", "offline"] | None = None
    """``online`` streams to the server, ``offline`` writes under ``<dir>/wandb/`` for ``wandb sync``;
    None: ``WANDB_MODE`` if set, else online. Files go to ``WANDB_DIR`` if set, else the run dir."""

    tags: list[str] = field(default_factory=list)
    """Tags of a new W&B run."""


@dataclass(frozen=True, kw_only=True)
class MlflowConfig:
    """MLflow (``metrics.loggers`` includes ``mlflow``; ``pip install 'areal-async[mlflow]'``)."""

    tracking_uri: str | None = None
    """Tracking server (``http://host:5000``), database (``sqlite:///mlflow.db``) or file store
    (``file:/path/mlruns``); None: ``MLFLOW_TRACKING_URI`` if set, else MLflow's default."""

    experiment: str = "areal-async"
    """MLflow experiment of the run (created when missing)."""


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """Experiment trackers fed by the trainer's rank 0 (and ``areal-async sft``): step metrics,
    evaluations, the resolved config once, and a sample of rollouts as a table."""

    loggers: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Trackers to write to: any of ``tensorboard``, ``wandb``, ``mlflow`` (empty: metrics.jsonl
    and eval.jsonl only). A missing package fails the trainer at start-up, naming the extra."""

    rollout_samples: int = 8
    """Completions in each rollout table (prompt, completion, reward, ...; 0: no tables)."""

    rollout_every: int = 10
    """A rollout table every this many training steps."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    """W&B options (used when ``loggers`` includes ``wandb``)."""

    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """MLflow options (used when ``loggers`` includes ``mlflow``)."""

    def __post_init__(self) -> None:
        for name in self.loggers:
            if name not in LOGGERS:
                close = difflib.get_close_matches(name, LOGGERS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"loggers: unknown logger {name!r}{hint} (choose from {', '.join(LOGGERS)})")
        repeated = sorted({name for name in self.loggers if self.loggers.count(name) > 1})
        if repeated:
            raise ValueError(f"loggers: {', '.join(repeated)} named more than once; name each logger once")
        non_negative(self, "rollout_samples")
        positive(self, "rollout_every")
