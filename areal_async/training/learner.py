"""Learner: turns scored rollout groups into one decoupled-PPO step on the training engine.

Pipeline of one step (docs/design.md section 6), on B groups of G completions:

1. advantages from the outcome rewards (``algo.advantages.compute_advantages`` with the
   run's LossConfig: shaping, group baseline/std, batch normalisation, overlong penalty);
2. the batch is split over the trainer ranks (``shard``); each rank computes reference
   logprobs (when KL is on);
3. the engine's ``train_step`` (``trainer.backend``: FSDP2 or megatron) with ``policy_loss`` as
   the loss: when the decoupled loss is on, pi_prox is the logprobs of the weights the step starts
   from, taken from each micro-batch's own update forward (``compute_prox``; a separate no-grad
   pass first with ``trainer.prox_pass``, or LoRA dropout); the denominator is the global one
   (``loss_denominator`` summed over every sequence), so the result is the exact token mean over
   the whole batch on every rank count.

Loss masks (multi-turn completions): only tokens the model generated are trained. Advantages,
their statistics, the denominator, ``completion_len_mean`` and the overlong penalty count trained
tokens only; the model still reads every token as context (pi_prox, pi_theta).

``Learner`` holds the engines of one rank. Rank 0 drives; with several ranks it
broadcasts each command (``LearnerCommand``) and the other ranks run ``follow()``.
No bus here: the trainer worker converts events into ``GroupSample``s.

Legend: B sequences, T tokens, N groups, G group size.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from areal_async.algo.advantages import compute_advantages
from areal_async.algo.loss import loss_denominator, policy_loss
from areal_async.config import LossConfig, RunConfig, TrainerConfig
from areal_async.models import set_torch_threads
from areal_async.training.batching import TrainSequence
from areal_async.training.fsdp.engine import FSDPTrainEngine, LossFn
from areal_async.training.samples import GroupSample

if TYPE_CHECKING:
    from areal_async.training.base import TrainEngine


def _trained_mask(lengths: Sequence[int], masks: Sequence[Sequence[int] | None]) -> torch.Tensor:
    """``[B, longest]`` bool: True on the trained tokens of each completion (all of them without a mask)."""
    mask_BT = torch.zeros((len(lengths), max(lengths, default=1)), dtype=torch.bool)
    for i, (n, mask) in enumerate(zip(lengths, masks, strict=True)):
        mask_BT[i, :n] = True if mask is None else torch.as_tensor(mask, dtype=torch.bool)
    return mask_BT


def build_sequences(
    groups: Sequence[GroupSample], loss: LossConfig, *, max_new_tokens: int
) -> tuple[list[TrainSequence], dict[str, float]]:
    """Advantages for every completion and the matching ``TrainSequence``s (group-major)."""
    sizes = {len(g.completions) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"all groups of a step need the same group size, got sizes {sorted(sizes)}")
    (group_size,) = sizes
    rewards_NG = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
    lengths = [len(c) for g in groups for c in g.completions]
    masks = [m for g in groups for m in (g.loss_masks or [None] * len(g.completions))]
    mask_BT = _trained_mask(lengths, masks)
    masked = any(m is not None for m in masks)
    adv_BT = compute_advantages(
        rewards_NG,
        mask_BT,
        reward_bias=loss.reward_bias,
        reward_scale=loss.reward_scale,
        reward_clip=loss.reward_clip,
        group_baseline=loss.group_baseline,
        group_std=loss.group_std,
        batch_adv_norm=loss.batch_adv_norm,
        overlong_buffer=loss.overlong_buffer,
        overlong_penalty=loss.overlong_penalty,
        max_new_tokens=max_new_tokens,
    )
    # Tensors, not lists: the engine collates each sequence twice per step (pi_prox, update), and
    # copying a tensor costs a fraction of converting a list. Clones, so a shard pickled to another
    # rank carries its own values, not the whole advantage matrix.
    seqs: list[TrainSequence] = []
    row = 0
    for g in groups:
        prompt = torch.as_tensor(g.prompt_ids, dtype=torch.long)
        for completion, behave in zip(g.completions, g.behave_logprobs, strict=True):
            n = len(completion)
            seqs.append(
                TrainSequence(
                    prompt_ids=prompt,
                    completion_ids=torch.as_tensor(completion, dtype=torch.long),
                    behave_logprobs=torch.as_tensor(behave, dtype=torch.float32),
                    advantages=adv_BT[row, :n].clone(),
                    loss_mask=mask_BT[row, :n].clone() if masked else None,
                )
            )
            row += 1
    valid = adv_BT[mask_BT]
    stats = {
        "reward_mean": float(rewards_NG.mean()),
        "reward_std": float(rewards_NG.std()) if rewards_NG.numel() > 1 else 0.0,
        "adv_mean": float(valid.mean()),
        "adv_std": float(valid.std()) if valid.numel() > 1 else 0.0,
        "adv_abs_max": float(valid.abs().max()),
        "no_eos_ratio": sum(r == "length" for g in groups for r in g.finish_reasons) / max(1, len(lengths)),
        "completion_len_mean": float(mask_BT.sum()) / len(lengths),
        "group_size": float(group_size),
    }
    return seqs, stats


def global_denominator(seqs: Sequence[TrainSequence], loss: LossConfig, *, max_new_tokens: int) -> float:
    """The step's ``loss_denominator`` over every sequence of every rank (trained tokens only)."""
    mask_BT = _trained_mask([s.num_completion_tokens for s in seqs], [s.loss_mask for s in seqs])
    return loss_denominator(mask_BT, loss.loss_agg, max_new_tokens)


def make_loss_fn(loss: LossConfig, *, max_new_tokens: int, denominator: float) -> LossFn:
    """``policy_loss`` with the run's loss settings, as the engine's ``loss_fn(mb) -> (loss, stats)``.

    ``denominator`` is the step's global one (``global_denominator``)."""

    def loss_fn(mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return policy_loss(
            mb["logprobs"],
            mb["prox_logprobs"] if loss.decoupled else None,
            mb["behave_logprobs"],
            mb["advantages"],
            mb["mask"],
            eps_clip_low=loss.eps_clip_low,
            eps_clip_high=loss.eps_clip_high,
            dual_clip=loss.dual_clip,
            decoupled=loss.decoupled,
            behave_cap=loss.behave_cap,
            behave_cap_mode=loss.behave_cap_mode,
            ratio_level=loss.ratio_level,
            loss_agg=loss.loss_agg,
            max_new_tokens=max_new_tokens,
            denominator=denominator,
            ref_logprobs_BT=mb.get("ref_logprobs"),
            kl_coef=0.0 if loss.kl_in_reward else loss.kl_coef,
            kl_estimator=loss.kl_estimator,
            kl_in_reward=loss.kl_in_reward,
        )

    return loss_fn


def make_engine(cfg: RunConfig, model_path: str, *, temperature: float | None = None) -> TrainEngine:
    """The training engine of one rank that ``trainer.backend`` names, built from the trainer section,
    the run's seed and ``temperature`` (None: the rollouts' sampling temperature, the policy whose
    logprobs RL trains; supervised fine-tuning passes 1)."""
    t = cfg.trainer
    temperature = temperature or cfg.rollout.sampling.temperature or 1.0
    if t.backend == "megatron":
        from areal_async.training.megatron.engine import MegatronTrainEngine

        return MegatronTrainEngine(model_path, t, seed=cfg.seed, temperature=temperature)
    return FSDPTrainEngine(model_path, t, seed=cfg.seed, temperature=temperature)


def shard(seqs: Sequence[TrainSequence], world_size: int) -> list[list[TrainSequence]]:
    """Round-robin split, balanced by token count (longest first)."""
    shards: list[list[TrainSequence]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for s in sorted(seqs, key=lambda s: -s.length):
        r = loads.index(min(loads))
        shards[r].append(s)
        loads[r] += s.length
    return shards


@dataclass(frozen=True)
class LearnerCommand:
    """What rank 0 broadcasts: ``step``, ``save_weights``, ``snapshot``, ``checkpoint`` or ``stop``."""

    op: str
    shards: list[list[TrainSequence]] | None = None
    denominator: float = 0.0
    path: str = ""
    extra: dict[str, Any] | None = None
    keep: int = 2
    dtype: str = ""
    on_device: bool = False


class Learner:
    """The engines of one trainer rank and the loss of the run."""

    def __init__(self, cfg: RunConfig, model_path: str) -> None:
        t = cfg.trainer
        self.cfg = cfg
        self.loss = t.loss
        self.prox_pass = self.needs_prox_pass(t)
        self.max_new_tokens = cfg.rollout.sampling.max_new_tokens
        temperature = cfg.rollout.sampling.temperature or 1.0
        set_torch_threads(t.num_threads)
        self.engine = make_engine(cfg, model_path)
        self.ref: FSDPTrainEngine | None = None
        if self.loss.kl_coef > 0:
            # Forward only, on FSDP2 on both backends: no adapters, compilation or recomputation, and
            # context-parallel groups of FSDP2's layout on fsdp2 runs only.
            ref_trainer = replace(
                t,
                backend="fsdp2",
                lora=None,
                compile=False,
                gradient_checkpointing=False,
                context_parallel=t.context_parallel if t.backend == "fsdp2" else 1,
            )
            self.ref = FSDPTrainEngine(t.ref_model or model_path, ref_trainer, temperature=temperature)
        self.rank = self.engine.rank
        self.world_size = self.engine.world_size

    @staticmethod
    def needs_prox_pass(t: TrainerConfig) -> bool:
        """A separate pi_prox pass: asked for (``trainer.prox_pass``), or needed where the training
        forward is random (LoRA dropout), so that it cannot stand for the policy's logprobs."""
        return t.prox_pass or (t.lora is not None and t.lora.dropout > 0)

    @property
    def version(self) -> int:
        return self.engine.version

    # ---- one rank's work ----------------------------------------------------------------

    def _step_local(self, seqs: list[TrainSequence], denominator: float) -> dict[str, float]:
        started = time.perf_counter()
        if self.ref is not None:
            for s, ref in zip(seqs, self.ref.compute_logprobs(seqs), strict=True):
                s.ref_logprobs = ref
        ref_s = time.perf_counter() - started
        loss_fn = make_loss_fn(self.loss, max_new_tokens=self.max_new_tokens, denominator=denominator)
        # pi_prox comes from the update's own forward (train_step's compute_prox), or a pass first.
        metrics = self.engine.train_step(
            seqs, loss_fn, compute_prox=self.loss.decoupled, prox_pass=self.prox_pass
        )
        metrics["ref_seconds"] = ref_s
        return metrics

    def execute(self, cmd: LearnerCommand) -> Any:
        if cmd.op == "step":
            assert cmd.shards is not None
            return self._step_local(cmd.shards[self.engine.dp_rank], cmd.denominator)
        if cmd.op == "save_weights":
            return self.engine.save_hf(cmd.path)
        if cmd.op == "snapshot":
            dtype = getattr(torch, cmd.dtype) if cmd.dtype else None
            return self.engine.snapshot_hf(dtype=dtype, on_device=cmd.on_device)
        if cmd.op == "checkpoint":
            from areal_async.training.checkpoint import save_checkpoint

            return save_checkpoint(
                cmd.path, self.engine.version, engine=self.engine, extra=cmd.extra or {}, keep=cmd.keep
            )
        if cmd.op == "stop":
            return None
        raise ValueError(f"unknown learner command {cmd.op!r}")

    # ---- rank 0 drives ----------------------------------------------------------------------

    def run(self, cmd: LearnerCommand) -> Any:
        """Execute ``cmd`` on every rank (rank 0 only calls this)."""
        if self.world_size > 1:
            box: list[Any] = [cmd]
            dist.broadcast_object_list(box, src=0)
        return self.execute(cmd)

    def follow(self) -> None:
        """Ranks > 0: execute what rank 0 broadcasts until ``stop``."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            cmd = box[0]
            self.execute(cmd)
            if cmd.op == "stop":
                return

    def step(self, groups: Sequence[GroupSample]) -> dict[str, float]:
        seqs, stats = build_sequences(groups, self.loss, max_new_tokens=self.max_new_tokens)
        denominator = global_denominator(seqs, self.loss, max_new_tokens=self.max_new_tokens)
        metrics = self.run(
            LearnerCommand(op="step", shards=shard(seqs, self.engine.dp_size), denominator=denominator)
        )
        return {**stats, **summarize(metrics)}

    def save_weights(self, path: Path) -> list[dict[str, Any]]:
        return self.run(LearnerCommand(op="save_weights", path=str(path)))

    def snapshot_weights(self, *, dtype: str = "", on_device: bool = False) -> dict[str, torch.Tensor]:
        """Copies of the current weights (rank 0; in ``dtype`` if named, on the training device with
        ``on_device``); write them with ``write_weights`` in any thread."""
        return self.run(LearnerCommand(op="snapshot", dtype=dtype, on_device=on_device))

    def write_weights(self, path: Path, tensors: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
        """Write a snapshot as an HF directory; returns its manifest. Consumes ``tensors``: the dict
        is emptied once written, so the copies (as large as the model) are freed then even where a
        caller still holds the dict, instead of living on through the next step."""
        try:
            return self.engine.write_hf(path, tensors)
        finally:
            tensors.clear()

    def checkpoint(self, root: Path, extra: dict[str, Any], keep: int) -> Path:
        """Commit model, optimizer, scheduler, RNG, version and ``extra`` under ``root/checkpoints``."""
        return self.run(LearnerCommand(op="checkpoint", path=str(root), extra=extra, keep=keep))

    def restore(self, root: Path) -> dict[str, Any] | None:
        """Load the latest checkpoint under ``root`` (every rank calls this); its ``extra`` or None."""
        from areal_async.training.checkpoint import find_latest, load_checkpoint

        if find_latest(root) is None:
            return None
        return load_checkpoint(root, engine=self.engine)

    def stop(self) -> None:
        if self.world_size > 1:
            self.run(LearnerCommand(op="stop"))


def summarize(m: dict[str, float]) -> dict[str, float]:
    """Engine metrics plus the summed loss stats turned into means and fractions per loss token."""
    n = max(m.get("loss_tokens", 0.0), 1.0)
    raw = {"clipped_tokens", "dual_clipped_tokens", "capped_tokens", "sequences"}
    out = {k: v for k, v in m.items() if not k.endswith("_sum") and k not in raw}
    out["clip_fraction"] = m.get("clipped_tokens", 0.0) / n
    out["dual_clip_fraction"] = m.get("dual_clipped_tokens", 0.0) / n
    out["behave_capped_fraction"] = m.get("capped_tokens", 0.0) / n
    out["behave_weight_mean"] = m.get("behave_weight_sum", n) / n
    out["ratio_mean"] = m.get("ratio_sum", n) / n
    out["approx_kl"] = m.get("approx_kl_sum", 0.0) / n
    out["ref_kl"] = m.get("ref_kl_sum", 0.0) / n
    return out


def init_trainer_process_group(device: str) -> None:
    """Under torchrun (WORLD_SIZE > 1) create the process group; a no-op for one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        from areal_async.training.fsdp.engine import init_distributed

        init_distributed(device)
