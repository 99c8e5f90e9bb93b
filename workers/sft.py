"""``areal-async sft RUN.yaml``: a supervised warm start on the trainer's engines, before RL.

    areal-async sft RUN.yaml [--set sft.epochs=2 ...]                  # one process
    torchrun --nproc-per-node N -m workers sft RUN.yaml [--set ...]    # N ranks (each runs this)

Reads the run file's ``sft`` section (rows, held-out split, epochs, batch size, evaluation, output,
``max_tokens``, ``on_bad_row``) and takes everything else from the sections the RL run reads: the
engine is the trainer role's (``learner.make_engine``: ``model.path``, ``trainer.backend``, LoRA,
optimizer, ``micro_batch_tokens``, dtype), built with ``trainer.total_steps`` set to the warm
start's steps (so warm-up and cosine span it) and temperature 1; rows are rendered as the agent
path renders an episode (``areal_async/data/sft.py``) with ``model.system_prompt`` and, in a
``tool_use`` run, the tools of ``agent.tools``. The loop is ``areal_async/training/sft.py``.

Writes (rank 0; every rank its checkpoint shards), beside the RL run's files in ``<run_dir>``:

    config/sft.yaml         the resolved run file
    sft/metrics.jsonl       a line per step: step, epoch, loss, eval_loss (when evaluated), tokens
                            (trained), total_tokens, seconds, lr, grad_norm; a step-0 line holds the
                            starting eval_loss
    sft/tensorboard/        the same values as sft/<key> (with tensorboard in metrics.loggers; W&B
                            and MLflow get them too, as a run named <name>-sft: workers/trackers.py)
    sft/checkpoints/        every checkpoint.every_steps steps and after the last (checkpoint.keep)
    <sft.out>               the trained model: a full HF directory (config, tokenizer files,
                            model.safetensors in float32, LoRA adapters merged in) for model.path

Resume: rerunning the same command continues from the latest checkpoint (``checkpoint.resume``:
auto, never, must) with the same batches, so the curve goes on as if never stopped; lines of
steps after that checkpoint are dropped from metrics.jsonl first.

Prints one JSON line on stdout at the end: the model directory, steps, last loss and eval_loss,
and the bad rows skipped by kind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import structlog

from areal_async.config import RunConfig
from areal_async.errors import ConfigError
from areal_async.files import write_text_atomic
from workers.common import append_jsonl, resolve_model_path
from workers.trackers import Trackers, open_trackers, require_trackers

log = structlog.get_logger(__name__)


def run_sft(cfg: RunConfig) -> dict[str, Any]:
    """Train ``cfg.sft`` to the end (or on from its latest checkpoint) and write the model; returns
    the summary line's fields. Every rank of a torchrun job calls this."""
    if cfg.sft is None:
        raise ConfigError(
            "the run file has no sft section; add one, e.g. sft: {data: transcripts.jsonl}, "
            "or pass --set sft.data=PATH"
        )
    from areal_async.logs import configure_logging
    from areal_async.training.learner import init_trainer_process_group

    init_trainer_process_group(cfg.trainer.device)
    rank = int(os.environ.get("RANK", "0"))
    configure_logging(level=cfg.logging.level, fmt=cfg.logging.format, role="sft", rank=rank)
    if rank == 0:  # a missing tracker package fails before anything is read or written
        require_trackers(cfg.metrics)
    return _train(cfg, rank)


def _train(cfg: RunConfig, rank: int) -> dict[str, Any]:
    from areal_async.data.sft import load_examples
    from areal_async.models import load_tokenizer, set_torch_threads
    from areal_async.run_file import config_to_dict, write_resolved_config
    from areal_async.training.learner import make_engine
    from areal_async.training.sft import SFTTrainer

    sft = cfg.sft
    assert sft is not None
    set_torch_threads(cfg.trainer.num_threads)
    model_path = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(model_path)
    options = render_options(cfg)
    max_tokens = sft.max_tokens or context_limit(tokenizer, model_path)
    train, skipped = load_examples(
        sft.data, tokenizer, options, max_tokens=max_tokens, on_bad_row=sft.on_bad_row
    )
    if sft.eval_data is not None:
        held_out, eval_skipped = load_examples(
            sft.eval_data, tokenizer, options, max_tokens=max_tokens, on_bad_row=sft.on_bad_row
        )
        skipped.update({f"eval_{kind}": n for kind, n in eval_skipped.items()})
    else:
        train, held_out = split_held_out(train, sft.eval_fraction, seed=cfg.seed)
    if skipped:
        log.warning("bad rows skipped", **skipped)
    steps = SFTTrainer.count_steps(len(train), batch_size=sft.batch_size, epochs=sft.epochs)
    engine_cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, total_steps=max(steps, 1)))
    engine = make_engine(engine_cfg, model_path, temperature=1.0)
    trainer = SFTTrainer(engine, train, held_out, batch_size=sft.batch_size, epochs=sft.epochs, seed=cfg.seed)
    root = cfg.sft_dir
    trackers: Trackers | None = None
    if rank == 0:  # the rows are good: now the run's folder and its tracker runs may be made
        root.mkdir(parents=True, exist_ok=True)
        write_resolved_config(cfg, "sft")
        trackers = open_trackers(
            cfg.metrics, root=root, name=f"{cfg.name}-sft", config=config_to_dict(cfg), section="sft"
        )
    try:
        return _steps(
            cfg,
            rank,
            trainer,
            engine,
            trackers,
            train_rows=len(train),
            held_out_rows=len(held_out),
            skipped=skipped,
        )
    finally:
        if trackers is not None:
            trackers.close()


def _steps(
    cfg: RunConfig,
    rank: int,
    trainer: Any,
    engine: Any,
    trackers: Trackers | None,
    *,
    train_rows: int,
    held_out_rows: int,
    skipped: dict[str, int],
) -> dict[str, Any]:
    """Train from the latest checkpoint to the end, log each step, write the model."""
    root = cfg.sft_dir
    assert cfg.sft is not None
    start = trainer.restore(root, cfg.checkpoint.resume)
    log.info(
        "sft start",
        rows=train_rows,
        held_out=held_out_rows,
        steps=trainer.total_steps,
        start_step=start,
        ranks=engine.world_size,
    )
    writer = MetricsWriter(root, start=start, trackers=trackers) if rank == 0 else None

    def on_metrics(record: dict[str, Any]) -> None:
        if writer is not None:
            writer.write(record)
        log.info(
            "sft step done", **{k: round(v, 5) if isinstance(v, float) else v for k, v in record.items()}
        )

    done = trainer.run(
        root, cfg.checkpoint, start=start, eval_every=cfg.sft.eval_every, on_metrics=on_metrics
    )
    out = cfg.sft_out
    engine.save_merged_hf(out)
    last = writer.last if writer is not None else {}
    summary = {
        "out": str(out),
        "steps": done,
        "loss": last.get("loss"),
        "eval_loss": last.get("eval_loss"),
        "rows": train_rows,
        "held_out": held_out_rows,
        "skipped": dict(skipped),
    }
    log.info("sft done", **summary)
    return summary


def render_options(cfg: RunConfig) -> Any:
    """How the run's rollouts render rows: its system prompt, chat-template switch, and the tools a
    ``tool_use`` run offers."""
    from areal_async.agents.workflows import make_tools
    from areal_async.data.sft import RenderOptions

    tools = (
        make_tools(cfg.agent.tools, cfg.agent.tool_timeout_s) if cfg.rollout.workflow == "tool_use" else ()
    )
    return RenderOptions(
        tools=tools, system_prompt=cfg.model.system_prompt, use_chat_template=cfg.model.use_chat_template
    )


def context_limit(tokenizer: Any, model_path: str) -> int | None:
    """The model's context in tokens: the tokenizer's ``model_max_length`` when it is set, else the
    config's ``max_position_embeddings``; None when neither says."""
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and limit < 10**7:
        return limit
    config = Path(model_path) / "config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("max_position_embeddings")
        return int(value) if isinstance(value, int) else None
    return None


def split_held_out(examples: list[Any], fraction: float, *, seed: int) -> tuple[list[Any], list[Any]]:
    """(train, held out): a seeded choice of ``fraction`` of the examples (at least one when
    ``fraction`` > 0, never all) held out, both in file order."""
    if fraction <= 0 or not examples:
        return examples, []
    count = min(max(1, round(len(examples) * fraction)), len(examples) - 1)
    if count < 1:
        raise ValueError(
            f"sft.eval_fraction={fraction} needs at least two rows to hold one out, got {len(examples)}; "
            "add rows or set sft.eval_fraction: 0"
        )
    chosen = set(random.Random(seed).sample(range(len(examples)), count))
    train = [e for i, e in enumerate(examples) if i not in chosen]
    return train, [e for i, e in enumerate(examples) if i in chosen]


class MetricsWriter:
    """``sft/metrics.jsonl`` and the experiment trackers, as a run writes its trainer's (rank 0 only).

    On a resumed start the lines of steps after ``start`` (trained before the kill, not in the
    checkpoint, and trained again now) are dropped, so every step has one line; the trackers skip
    the steps they logged before the kill (``workers/trackers.py``)."""

    def __init__(self, root: Path, *, start: int, trackers: Trackers | None) -> None:
        self.path = root / "metrics.jsonl"
        self.last: dict[str, Any] = {}
        """The latest value of each key so far, resumed lines included (for the summary)."""
        if self.path.is_file():
            lines = self.path.read_text().splitlines() if start > 0 else []
            kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= start]
            write_text_atomic(self.path, "".join(f"{line}\n" for line in kept))
            for line in kept:
                self.last.update(json.loads(line))
        self.trackers = trackers

    def write(self, record: dict[str, Any]) -> None:
        self.last.update(record)
        append_jsonl(self.path, record)
        if self.trackers is not None:
            self.trackers.log_step(record["step"], {k: v for k, v in record.items() if k != "step"})


def sft_main(config: str, overrides: list[str]) -> int:
    """The ``areal-async sft`` command: train, then one JSON summary line on stdout (rank 0)."""
    from areal_async.run_file import load_config

    cfg = load_config(config, overrides)
    from workers.runtime import limit_malloc_arenas  # before torch starts its threads

    limit_malloc_arenas(cfg.trainer.malloc_arenas)
    summary = run_sft(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        sys.stdout.write(json.dumps(summary) + "\n")
    _leave_process_group()
    return 0


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank leaves its last collective before the group goes
        dist.destroy_process_group()
