"""Hardware profiles of simulated runs: how fast modelled engines decode and a modelled trainer trains.

A profile is what `rollout.engine: simulated` and `trainer.backend: simulated` need to stand in for
real hardware while every other part of the run (controller, reward, weight-sync, agents, admission,
the guard, the audit, checkpoints, the bus) stays real. It comes from a small YAML a user writes for
their own hardware, or from a measured whole run (`benchmarks/baselines/async__<hardware>.json`,
`profile_from_baseline`):

    engine:   {decode_step_s: 0.0033, completion_tokens_mean: 1014, completion_tokens_sigma: 0.0}
    trainer:  {seconds_per_token: 1.1e-5, save_s: 0.056}
    weights:  {bytes: 804000000, bandwidth_gb_s: 50.0}
    device:   {shared: true, train_slowdown: 1.69, decode_slowdown: 1.69}

Time model (docs/benchmarks.md "scale_summary"). An engine decodes its running completions in lock-step:
one decode step takes `decode_step_s + decode_step_per_seq_s * batch` and gives every running
completion one token; a new request first pays `prefill_s_per_token` per prompt token. Completion
lengths are lognormal with the given mean and sigma (sigma 0: every completion the mean), capped at
`rollout.sampling.max_new_tokens`: the cap is where the long tail lands. A weight load pauses
decoding for `weights.bytes / bandwidth + load_s`. A training step takes `step_overhead_s +
seconds_per_token * tokens / (ranks * rank_efficiency ** log2(ranks))`, the hand-off `save_s`.
With `device.shared` (engine and trainer on one accelerator) each runs `slowdown` times slower while
the other is busy. Every modelled duration is multiplied by `simulation.time_scale`.

No torch and no numpy here: the config, the CLI and hundreds of simulated engines import it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from areal_async.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class EngineProfile:
    """One inference engine's speed."""

    decode_step_s: float
    """Seconds of one decode step (one token for every running completion) at batch size 1."""

    decode_step_per_seq_s: float = 0.0
    """Seconds each running completion adds to a decode step (0: memory-bound decoding, where the
    step time does not depend on the batch)."""

    prefill_s_per_token: float = 0.0
    """Seconds per prompt token when a request joins the batch (the batch waits meanwhile)."""

    completion_tokens_mean: float = 64.0
    """Mean completion length before the `max_new_tokens` cap."""

    completion_tokens_sigma: float = 0.0
    """Sigma of the lognormal completion length (0: every completion has the mean length; 1: a long
    tail, the p99 about 6x the median)."""

    prompt_tokens: int = 0
    """Prompt length the simulated tokenizer gives every prompt (0: one token per byte of its text)."""

    load_s: float = 0.0
    """The engine's own pause to install a version, besides moving its bytes."""

    def __post_init__(self) -> None:
        _check(self, "decode_step_s", positive=True)
        for name in ("decode_step_per_seq_s", "prefill_s_per_token", "completion_tokens_sigma", "load_s"):
            _check(self, name)
        _check(self, "completion_tokens_mean", positive=True)
        if self.prompt_tokens < 0:
            raise ConfigError(f"profile engine.prompt_tokens must be >= 0, got {self.prompt_tokens}")

    def decode_step(self, batch: int) -> float:
        return self.decode_step_s + self.decode_step_per_seq_s * batch


@dataclass(frozen=True, kw_only=True)
class TrainerProfile:
    """The trainer's speed (one data-parallel rank's, scaled to `trainer.num_ranks`)."""

    seconds_per_token: float
    """Seconds per trained completion token on one rank (forward with pi_prox, backward, optimizer)."""

    step_overhead_s: float = 0.0
    """Seconds every step costs besides its tokens."""

    rank_efficiency: float = 0.9
    """Scaling per doubling of ranks: R ranks are R * rank_efficiency ** log2(R) times as fast as one."""

    save_s: float = 0.0
    """The step's weight snapshot before the next step may start (the rest is written behind it)."""

    def __post_init__(self) -> None:
        _check(self, "seconds_per_token", positive=True)
        _check(self, "step_overhead_s")
        _check(self, "save_s")
        if not 0 < self.rank_efficiency <= 1:
            raise ConfigError(
                f"profile trainer.rank_efficiency must be in (0, 1], got {self.rank_efficiency}"
            )

    def step_seconds(self, tokens: int, ranks: int) -> float:
        speedup = ranks * self.rank_efficiency ** math.log2(max(ranks, 1))
        return self.step_overhead_s + self.seconds_per_token * tokens / speedup


@dataclass(frozen=True, kw_only=True)
class WeightsProfile:
    """One policy version's hand-off from the trainer to an engine."""

    bytes: int = 0
    """Size of one version as engines load it."""

    bandwidth_gb_s: float = 10.0
    """GB/s from the trainer's copy to one engine (disk, PCIe, network: the slowest hop)."""

    def __post_init__(self) -> None:
        if self.bytes < 0:
            raise ConfigError(f"profile weights.bytes must be >= 0, got {self.bytes}")
        _check(self, "bandwidth_gb_s", positive=True)

    @property
    def transfer_s(self) -> float:
        return self.bytes / (self.bandwidth_gb_s * 1e9)


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """Whether engines and the trainer share one accelerator, and what sharing costs."""

    shared: bool = False
    """True: engine and trainer run on the same device (one host); each slows while the other works."""

    train_slowdown: float = 1.0
    """Factor on training time while an engine decodes (shared device only)."""

    decode_slowdown: float = 1.0
    """Factor on decode time while the trainer trains (shared device only)."""

    def __post_init__(self) -> None:
        for name in ("train_slowdown", "decode_slowdown"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"profile device.{name} must be >= 1 (a slowdown), got {getattr(self, name)}"
                )


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Everything a simulated run models; the rest of the run is real."""

    engine: EngineProfile
    trainer: TrainerProfile
    weights: WeightsProfile = field(default_factory=WeightsProfile)
    device: DeviceProfile = field(default_factory=DeviceProfile)
    source: str = ""
    """Where the numbers came from (a file, a baseline row)."""


def _check(section: Any, name: str, *, positive: bool = False) -> None:
    value = getattr(section, name)
    kind = type(section).__name__.removesuffix("Profile").lower()
    if (
        not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"profile {kind}.{name} must be a number {bound}, got {value!r}")


_SECTIONS = {
    "engine": EngineProfile,
    "trainer": TrainerProfile,
    "weights": WeightsProfile,
    "device": DeviceProfile,
}


def profile_from_dict(data: dict[str, Any], source: str = "") -> Profile:
    """A `Profile` from plain data (a parsed YAML); unknown keys are errors naming the known ones."""
    unknown = set(data) - set(_SECTIONS)
    if unknown:
        raise ConfigError(
            f"{source}: unknown profile section(s) {sorted(unknown)}; known: {sorted(_SECTIONS)}"
        )
    for needed in ("engine", "trainer"):
        if needed not in data:
            raise ConfigError(f"{source}: the profile needs an {needed!r} section")
    built: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        if name not in data:
            continue
        known = {f.name for f in fields(cls)}
        extra = set(data[name] or {}) - known
        if extra:
            raise ConfigError(
                f"{source}: unknown key(s) {sorted(extra)} in profile {name}; known: {sorted(known)}"
            )
        try:
            built[name] = cls(**(data[name] or {}))
        except TypeError as exc:
            raise ConfigError(f"{source}: profile {name}: {exc}") from None
    return Profile(**built, source=source)


def load_profile(spec: str) -> Profile:
    """The profile `simulation.profile` names: a YAML file, or a whole-run baseline JSON
    (`benchmarks/baselines/async__<hardware>.json`; `PATH#<row>` picks the synchronous row to read,
    by default `max_staleness0`)."""
    path_text, _, row = spec.partition("#")
    path = Path(path_text)
    if not path.is_file():
        raise ConfigError(
            f"simulation.profile: {path_text!r} is not a file; give a profile YAML or a "
            "benchmarks/baselines/async__<hardware>.json baseline"
        )
    if path.suffix == ".json":
        return profile_from_baseline(json.loads(path.read_text()), row=row or "max_staleness0", source=spec)
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"simulation.profile: {path} must hold a mapping of sections")
    return profile_from_dict(data, source=str(path))


def profile_from_baseline(doc: dict[str, Any], *, row: str = "max_staleness0", source: str = "") -> Profile:
    """Derive a profile from a measured `bench_async` whole run (`benchmarks/harness.py` layout).

    From its synchronous row (`max_staleness0`, where generation and training never overlap): the
    step's trained tokens (`trained_tokens_per_s * seconds_per_step`) over its `B x G` completions
    give the mean completion length; the trainer's wait for data (`wait_s`, or `t_gen`), less the
    weight hand-off (`served_s`), over that length gives the decode step of a batch holding the whole
    step's completions; `compute_s` (or `t_train`) over the tokens gives the seconds per token, and
    `save_s` the hand-off. On a shared device (the run's note says "one GPU shared") the one figure
    taken from the asynchronous row is how much the update slows while it shares the device
    (`compute_s` of the largest `max_staleness` over the synchronous `compute_s`); decoding is
    assumed to slow by the same factor.
    """
    rows = {r.get("label", r.get("case")): r for r in doc.get("results", [])}
    if row not in rows:
        raise ConfigError(f"{source}: the baseline has no row {row!r}; it has {sorted(rows)}")
    sync = rows[row]
    cfg = _baseline_config(doc)
    batch, group, max_new = cfg["batch_size"], cfg["group_size"], cfg["max_new_tokens"]
    step_s = float(sync["seconds_per_step"])
    tokens = float(sync["trained_tokens_per_s"]) * step_s
    length = tokens / (batch * group)
    handoff = float(sync.get("served_s") or 0.0)
    wait = float(sync.get("wait_s", sync["t_gen"]))
    compute = float(sync.get("compute_s", sync["t_train"] - float(sync.get("save_s") or 0.0)))
    save = float(sync.get("save_s") or 0.0)
    engine_load = float(sync.get("engine_load_s") or 0.0)
    shared = "one GPU shared" in str(doc.get("note", ""))
    slowdown = 1.0
    if shared:
        others = [r for r in doc["results"] if r.get("max_staleness", 0) > 0 and r.get("compute_s")]
        if others:
            busiest = max(others, key=lambda r: r["max_staleness"])
            slowdown = max(1.0, float(busiest["compute_s"]) / compute)
    data = {
        "engine": {
            "decode_step_s": max(wait - handoff, 1e-6) / math.ceil(length),
            "completion_tokens_mean": min(length, max_new),
            "completion_tokens_sigma": 0.0,
            "load_s": engine_load,
        },
        "trainer": {"seconds_per_token": compute / tokens, "save_s": save},
        "weights": {"bytes": 0},
        "device": {"shared": shared, "train_slowdown": slowdown, "decode_slowdown": slowdown},
    }
    return profile_from_dict(data, source=source or f"baseline row {row}")


BASELINE_SHAPES = {
    "configs/arith_cpu.yaml": {"batch_size": 4, "group_size": 8, "max_new_tokens": 16},
    "configs/gsm8k_gpu.yaml": {"batch_size": 16, "group_size": 8, "max_new_tokens": 1024},
}
"""Step shapes of the run files the whole-run baselines were measured with (their `--set`
overrides of `rollout.sampling.max_new_tokens` are applied on top)."""


def _baseline_config(doc: dict[str, Any]) -> dict[str, int]:
    params = doc.get("params", {})
    config = str(params.get("config", ""))
    shape = dict(BASELINE_SHAPES.get(config) or _read_shape(config))
    for item in params.get("set", []):
        key, _, value = str(item).partition("=")
        if key == "rollout.sampling.max_new_tokens":
            shape["max_new_tokens"] = int(value)
        elif key == "trainer.batch_size":
            shape["batch_size"] = int(value)
        elif key == "rollout.group_size":
            shape["group_size"] = int(value)
    return shape


def _read_shape(config: str) -> dict[str, int]:
    from areal_async.run_file import load_config

    try:
        cfg = load_config(config, [])
    except Exception as exc:
        raise ConfigError(
            f"the baseline's run file {config!r} cannot be read for its step shape: {exc}"
        ) from None
    return {
        "batch_size": cfg.trainer.batch_size,
        "group_size": cfg.rollout.group_size,
        "max_new_tokens": cfg.rollout.sampling.max_new_tokens,
    }
