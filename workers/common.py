"""Small pieces several roles share: model resolution, weight-path checks, the poison-message rule.

Weight locations arrive in events; before anything is loaded they are checked to lie
inside ``<run_dir>/weights`` (or the configured model path for version 0), so a forged
event cannot make a worker read arbitrary files. Nothing on the wire is ever unpickled.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from nats.errors import Error as NatsError

from areal_async.config import RunConfig
from areal_async.engines.base import SamplingParams
from areal_async.errors import ConfigError
from bus.errors import BusError
from bus.events import Completion, PromptTask, RolloutGroup, pack_i32
from bus.state import RunState

log = structlog.get_logger()


def resolve_model_path(path: str) -> str:
    """``smollm2`` means the converted copy of the bundled GGUF; anything else is used as given."""
    if path == "smollm2":
        from areal_async.models import prepare_smollm2

        return str(prepare_smollm2(None))
    return path


def run_tokenizer(cfg: RunConfig, model_path: str) -> Any:
    """The tokenizer of ``model_path``, or the simulated one when ``rollout.engine`` is simulated."""
    if cfg.rollout.engine == "simulated":
        from areal_async.engines.simulated import SimulatedTokenizer
        from areal_async.simulation.profile import load_profile

        return SimulatedTokenizer(load_profile(cfg.simulation.profile).engine.prompt_tokens)
    from areal_async.models import load_tokenizer

    return load_tokenizer(model_path)


def weights_root(cfg: RunConfig) -> Path:
    return cfg.weights_root.resolve()


def weights_dir(cfg: RunConfig, version: int) -> Path:
    return weights_root(cfg) / f"v{version}"


def checked_weights_path(cfg: RunConfig, path: str) -> Path:
    """``path`` resolved, if it lies inside the run's weights root; ConfigError otherwise."""
    resolved = Path(path).resolve()
    root = weights_root(cfg)
    if resolved != root and root not in resolved.parents:
        raise ConfigError(
            f"weights location {path!r} is outside the run's weights root {root}; refusing to load it "
            "(weights.* events must point into weight_sync.dir, default <run_dir>/weights)"
        )
    return resolved


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line (small and synchronous: a line per step or eval round)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


async def settle_or_dead_letter(
    delivery: Any, handle: Callable[[Any], Awaitable[None]], *, what: str
) -> None:
    """The poison-message rule: run ``handle(delivery.event)``; if it raises, the event is copied to
    the run's ``deadletter`` stream with the exception text and acked, and the worker goes on.

    Bus failures (lost connection, no leader) are not the event's fault: they propagate, the worker
    restarts and the event is redelivered. ``handle`` settles the delivery itself on success.
    """
    try:
        await handle(delivery.event)
    except (BusError, NatsError, OSError, TimeoutError):
        raise
    except Exception as exc:
        reason = f"{what} failed: {type(exc).__name__}: {exc}"[:2000]
        if isinstance(exc, ValueError):  # a check refused the event: the reason says it all
            log.warning("event dead-lettered", subject=delivery.subject, reason=reason)
        else:
            log.exception("event dead-lettered", subject=delivery.subject, reason=reason)
        await delivery.dead_letter(reason)


def run_sampling(cfg: RunConfig, tokenizer: Any) -> tuple[SamplingParams, SamplingParams]:
    """The run's (training, evaluation) sampling: ``rollout.sampling``, and greedy for evaluation;
    both stop at the tokenizer's EOS and at ``rollout.sampling.stop_token_ids``."""
    s = cfg.rollout.sampling
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stop = tuple(dict.fromkeys([*eos, *s.stop_token_ids]))
    train = SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_new_tokens=s.max_new_tokens,
        stop_token_ids=stop,
    )
    return train, SamplingParams(temperature=0.0, max_new_tokens=s.max_new_tokens, stop_token_ids=stop)


async def check_issued(run_state: RunState, task: Any) -> None:
    """ValueError (naming why) unless ``task`` is a PromptTask the controller issued, as issued."""
    if not isinstance(task, PromptTask):
        raise ValueError(f"expected a PromptTask, got {type(task).__name__}")
    issued = await run_state.issued(task.task_id)
    if issued is None:
        raise ValueError(f"task {task.task_id[:80]!r} was never issued by the controller")
    problem = issued.mismatch(
        task_id=task.task_id, kind=task.kind, epoch=task.epoch, index=task.index, attempt=task.attempt
    )
    if problem:
        raise ValueError(f"task {task.task_id!r}: {problem}")


def task_group(
    task: PromptTask,
    engine_id: str,
    prompt_ids: list[int],
    completions: list[Completion],
    *,
    head_version: int,
    tail_version: int,
    seconds: float,
    stats: dict[str, float] | None = None,
) -> RolloutGroup:
    """The rollout group answering ``task``: its completions, versions and timings (generate and queue
    seconds, tokens, plus ``stats``)."""
    return RolloutGroup(
        task_id=task.task_id,
        kind=task.kind,
        index=task.index,
        epoch=task.epoch,
        attempt=task.attempt,
        row=task.row,
        engine_id=engine_id,
        prompt_ids=pack_i32(list(prompt_ids)),
        completions=completions,
        head_version=head_version,
        tail_version=tail_version,
        timings={
            "generate_s": seconds,
            "queue_s": max(0.0, time.time() - task.issued_at - seconds),
            "tokens": float(sum(c.num_tokens for c in completions)),
            **(stats or {}),
        },
    )
