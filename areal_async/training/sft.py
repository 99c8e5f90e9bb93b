"""Supervised fine-tuning on the trainer's engines: the loop behind ``areal-async sft``.

No second training loop: each step is the engine's ``train_step`` (micro-batching, packed rows,
kernels, the optimizer and its schedule, exactly as in RL) with ``algo.loss.sft_loss`` as the loss
and each example as a ``TrainSequence`` whose ``loss_mask`` marks the model's tokens (behaviour
logprobs and advantages are zeros, which the loss never reads). The engine's default denominator,
the trained tokens of the whole step over all ranks, makes the step loss the mean negative
log-likelihood per trained token. ``eval_loss`` is the same mean over the held-out examples, from
``compute_logprobs``.

Ranks (SPMD). Every rank runs this loop over the same examples in the same order and trains its
share of each batch (``learner.shard``, balanced by tokens; ``dp_rank`` of ``dp_size``), so N ranks
train the one-process batch and the collectives line up without a driver.

Order. Epoch e visits the training examples in the order of ``random.Random(seed + e)``'s shuffle;
step s (0-based) is batch ``s % steps_per_epoch`` of epoch ``s // steps_per_epoch``, ``batch_size``
examples (the last batch of an epoch may hold fewer). A step's batch is a function of its number
alone, so a resumed run trains the batches the uninterrupted one would have.

Checkpoints (``training/checkpoint.py``) go under ``root`` every ``every_steps`` steps and after the
last; their ``extra`` holds the step and a digest of the training examples' tokens, and resuming
from one trained on other rows is refused.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch

from areal_async.algo.loss import sft_loss
from areal_async.config import CheckpointConfig
from areal_async.data.sft import SFTExample
from areal_async.training.base import TrainEngine
from areal_async.training.batching import TrainSequence
from areal_async.training.checkpoint import find_latest, load_checkpoint, save_checkpoint
from areal_async.training.learner import shard

log = structlog.get_logger(__name__)


def to_sequence(example: SFTExample) -> TrainSequence:
    """The ``TrainSequence`` of an example: its tokens and loss mask, zeros where the loss reads nothing."""
    n = len(example.completion_ids)
    zeros = torch.zeros(n, dtype=torch.float32)
    return TrainSequence(
        prompt_ids=torch.as_tensor(example.prompt_ids, dtype=torch.long),
        completion_ids=torch.as_tensor(example.completion_ids, dtype=torch.long),
        behave_logprobs=zeros,
        advantages=zeros,
        loss_mask=torch.as_tensor(example.loss_mask, dtype=torch.bool),
    )


def loss_fn(mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``sft_loss`` as the engine's ``loss_fn(mb)`` (the loss contract of ``training/loop.py``)."""
    return sft_loss(mb["logprobs"], mb["mask"], denominator=mb["global_tokens"])


def examples_digest(examples: Sequence[SFTExample]) -> str:
    """sha256 over the examples' tokens and masks, in order: what a checkpoint was trained on."""
    h = hashlib.sha256()
    for e in examples:
        h.update(repr((e.prompt_ids, e.completion_ids, e.loss_mask)).encode())
    return h.hexdigest()


class SFTTrainer:
    """The steps, evaluation and checkpoints of one warm start on one rank (module docstring)."""

    def __init__(
        self,
        engine: TrainEngine,
        train: Sequence[SFTExample],
        held_out: Sequence[SFTExample] = (),
        *,
        batch_size: int,
        epochs: int,
        seed: int,
    ) -> None:
        if not train:
            raise ValueError("no training examples: sft.data holds no row that can be trained")
        self.engine = engine
        self.train = [to_sequence(e) for e in train]
        self.held_out = [to_sequence(e) for e in held_out]
        self.batch_size = batch_size
        self.epochs = epochs
        self.seed = seed
        self.digest = examples_digest(train)

    @staticmethod
    def count_steps(num_examples: int, *, batch_size: int, epochs: int) -> int:
        """Optimizer steps of a warm start: ``epochs`` x batches per epoch (the engine's ``total_steps``)."""
        return epochs * -(-num_examples // batch_size)

    @property
    def steps_per_epoch(self) -> int:
        return -(-len(self.train) // self.batch_size)

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def batch(self, step: int) -> list[int]:
        """Indices of the training examples of step ``step`` (0-based)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        order = list(range(len(self.train)))
        random.Random(self.seed + epoch).shuffle(order)
        return order[index * self.batch_size : (index + 1) * self.batch_size]

    def step(self, step: int) -> dict[str, float]:
        """Train step ``step`` (0-based) on this rank's share of its batch; the step's metrics."""
        seqs = [self.train[i] for i in self.batch(step)]
        mine = shard(seqs, self.engine.dp_size)[self.engine.dp_rank]
        started = time.perf_counter()
        metrics = self.engine.train_step(mine, loss_fn)
        return {
            "step": step + 1,
            "epoch": step // self.steps_per_epoch,
            "loss": metrics["loss"],
            "tokens": metrics["loss_tokens"],
            "total_tokens": metrics["total_tokens"],
            "seconds": time.perf_counter() - started,
            "lr": metrics["lr"],
            "grad_norm": metrics["grad_norm"],
        }

    def eval_loss(self) -> float | None:
        """Mean negative log-likelihood per trained token of the held-out examples (None: none)."""
        if not self.held_out:
            return None
        mine = shard(self.held_out, self.engine.dp_size)[self.engine.dp_rank]
        nll = tokens = 0.0
        for seq, logprobs in zip(mine, self.engine.compute_logprobs(mine), strict=True):
            mask = torch.as_tensor(seq.loss_mask, dtype=torch.bool)
            nll -= float(logprobs[mask].double().sum())
            tokens += float(mask.sum())
        nll, tokens = self.engine.sum_over_ranks([nll, tokens])
        return nll / max(tokens, 1.0)

    def restore(self, root: Path, resume: str) -> int:
        """Load the latest checkpoint under ``root`` per ``checkpoint.resume``; the steps already done."""
        if resume == "never" or find_latest(root) is None:
            if resume == "must":
                raise FileNotFoundError(
                    f"checkpoint.resume=must but {root / 'checkpoints'} holds no checkpoint"
                )
            return 0
        extra = load_checkpoint(root, engine=self.engine)
        if extra.get("examples_digest") != self.digest:
            raise ValueError(
                f"the checkpoint under {root / 'checkpoints'} was trained on other rows than sft.data "
                "renders now; restore those rows, delete that directory to start over, or set "
                "checkpoint.resume: never"
            )
        done = int(extra["step"])
        log.info("resumed from checkpoint", step=done, total_steps=self.total_steps)
        return done

    def run(
        self,
        root: Path,
        checkpoint: CheckpointConfig,
        *,
        start: int,
        eval_every: int,
        on_metrics: Callable[[dict[str, Any]], None],
    ) -> int:
        """Train from step ``start`` (``restore``'s) to the last step, checkpointing under ``root``;
        ``on_metrics`` gets one record per step (and a step-0 ``eval_loss`` on a fresh start).
        Returns the steps done."""
        done = start
        if done == 0 and self.held_out:
            on_metrics({"step": 0, "eval_loss": self.eval_loss()})
        while done < self.total_steps:
            record = self.step(done)
            done += 1
            if done == self.total_steps or (eval_every and done % eval_every == 0):
                loss = self.eval_loss()
                if loss is not None:
                    record["eval_loss"] = loss
            on_metrics(record)
            if done == self.total_steps or done % checkpoint.every_steps == 0:
                extra = {"step": done, "examples_digest": self.digest}
                save_checkpoint(root, done, engine=self.engine, extra=extra, keep=checkpoint.keep)
        return done
