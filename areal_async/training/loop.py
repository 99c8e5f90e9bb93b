"""The training loop both trainer backends share: micro-batching, pi_prox, the loss, the optimizer step.

`TrainLoop` is the part of a training engine that does not depend on how the model is built or
sharded. A backend (`training/fsdp/engine.py`: FSDP2 over a Hugging Face model; `training/megatron/engine.py`:
megatron-core with tensor parallelism) sets the state it reads (`model`, `params`, `optimizer`,
`scheduler`, `device`, `autocast_dtype`, `packed`, `micro_batch_tokens`, `pad_token_id`,
`grad_clip`, `version`, the ranks) and may override `_clip_gradients`.

Process model. Ranks that hold different data form the data-parallel group (`dp_group`, None =
every rank; `dp_rank`, `dp_size`). Ranks of one tensor-parallel group get the same shard and
compute the same logprobs, so token counts, losses and stats are summed over `dp_group` only.

Data contract. The caller scatters the batch: each data-parallel rank passes its own shard of
`TrainSequence`s to `compute_logprobs` / `train_step`, and every rank must call these (and the
backend's weight methods) in the same order, because they run collectives. Ranks may hold
different numbers of sequences (also none); the loop pads with empty micro-batches so all
ranks run the same number of forward/backward passes.

Loss contract (docs/design.md section 9). `train_step(seqs, loss_fn)` packs each rank's shard
into micro-batches by token budget and calls `loss_fn(mb) -> (loss, stats)` once
per micro-batch. `mb` holds the `[b, T]` tensors of `batching.collate` (input_ids, mask,
behave_logprobs, prox_logprobs, advantages, loss_weights, ref_logprobs?) plus
`logprobs` (pi_theta, float32, with grad), `entropy` (float32, no grad) and the 0-d
tensor `global_tokens`: the loss denominator of the whole step over all ranks (argument
of `train_step`; by default the trained completion tokens of all ranks, all-reduced: those
under `mask`, which leaves out tokens a loss mask excludes). `loss` must
already be divided by it, so that summing the micro-batch losses of all ranks gives the
step loss; gradients are summed across data-parallel ranks the same way (no averaging).
Stats are summed over micro-batches and ranks, except keys ending in `_max` (maximum).

Model contract. `model(input_ids, position_ids, hidden_index, cu_seqlens, max_length,
with_entropy)` returns float32 logprobs (with grad) and entropy (no grad) `[n]` of the tokens at
`hidden_index + 1` (`batching.ModelInputs`); with `packed` the micro-batch is one row of its
sequences back to back and `cu_seqlens` bounds them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import nn

from areal_async.training.batching import (
    ModelInputs,
    TrainSequence,
    collate,
    model_inputs,
    pack_lengths,
    pack_tokens,
    to_device,
)

log = structlog.get_logger(__name__)

LossFn = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, Mapping[str, float | torch.Tensor]]]
"""`loss_fn(mb) -> (loss, stats)`; see the loss contract in the module docstring."""
Prox = tuple[dict[str, torch.Tensor], ModelInputs, torch.Tensor] | None
"""One bin of `_logprob_pass`: its loss batch, model inputs and `[b, T]` logprobs (None: empty pass)."""
UpdateSums = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]
"""Summed loss, summed entropy of trained tokens, and loss_fn's stats (summed; `_max` keys maximal)."""


class _StepClock:
    """Seconds from the start of a step to one marked point, read once the step has synced: CUDA
    events on CUDA, so marking adds no host-device sync; the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.start = self._now()
        self.end: Any = None

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self) -> None:
        self.end = self._now()

    def seconds(self) -> float:
        if self.cuda:
            return self.start.elapsed_time(self.end) / 1e3
        return self.end - self.start


class TrainLoop:
    """Micro-batched logprob passes and optimizer steps; see the module docstring."""

    model: nn.Module
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    device: torch.device
    autocast_dtype: torch.dtype | None
    packed: bool
    micro_batch_tokens: int
    pad_token_id: int
    grad_clip: float
    version: int
    rank: int
    world_size: int
    distributed: bool
    dp_group: Any = None
    """Process group of the data-parallel ranks (None: every rank)."""
    dp_rank: int = 0
    dp_size: int = 1

    # ----------------------------------------------------------------- helpers

    def autocast(self) -> torch.autocast:
        return torch.autocast(
            self.device.type,
            dtype=self.autocast_dtype or torch.float32,
            enabled=self.autocast_dtype is not None,
        )

    def _all_reduce(
        self, values: list[float], op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> list[float]:
        """Sums over the data-parallel group; other ops (MAX) over every rank."""
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op, group=self.dp_group if op == dist.ReduceOp.SUM else None)
        return t.tolist()

    def _micro_batches(self, seqs: Sequence[TrainSequence]) -> list[list[int] | None]:
        """This rank's bins, padded with None (an empty pass) to the largest bin count of any rank."""
        pack = pack_tokens if self.packed else pack_lengths
        bins: list[list[int] | None] = list(pack([s.length for s in seqs], self.micro_batch_tokens))
        total = int(self._all_reduce([float(len(bins))], dist.ReduceOp.MAX)[0])
        return bins + [None] * (total - len(bins))

    def _forward(
        self, mb: dict[str, torch.Tensor], inputs: ModelInputs, *, with_entropy: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`[b, T]` logprobs and entropy of `mb`'s completion tokens (collate's layout), zero elsewhere."""
        with self.autocast():
            logprobs_N, entropy_N = self.model(*inputs.model_args(), with_entropy)
        return self.to_BT(mb["input_ids"].shape, inputs, logprobs_N, entropy_N)

    def to_BT(
        self, shape: torch.Size, inputs: ModelInputs, logprobs_N: torch.Tensor, entropy_N: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's `[n]` logprobs and entropy placed at their tokens of the `[b, T]` batch."""
        base = torch.zeros(shape.numel(), dtype=torch.float32, device=self.device)
        logprobs_BT = base.index_put((inputs.target_index,), logprobs_N).view(shape)
        entropy_BT = base.index_put((inputs.target_index,), entropy_N).view(shape)
        return logprobs_BT, entropy_BT

    def empty_batch(self) -> tuple[dict[str, torch.Tensor], ModelInputs]:
        """A two-token pass with no completion token (keeps ranks' collectives in step)."""
        ids = torch.full((1, 2), self.pad_token_id, dtype=torch.long, device=self.device)
        none = torch.zeros(0, dtype=torch.long, device=self.device)
        inputs = ModelInputs(
            input_ids=ids,
            position_ids=torch.arange(2, device=self.device)[None],
            hidden_index=none,
            target_index=none,
            cu_seqlens=torch.tensor([0, 2], dtype=torch.int32, device=self.device) if self.packed else None,
            max_length=2,
        )
        return {"input_ids": ids}, inputs

    def collate_batch(self, seqs: Sequence[TrainSequence]) -> tuple[dict[str, torch.Tensor], ModelInputs]:
        """The loss batch (collate's `[b, T]` tensors) and the model's inputs, on the device."""
        mb = collate(seqs, pad_token_id=self.pad_token_id)
        inputs = model_inputs(seqs, mb["input_ids"], packed=self.packed).to(self.device)
        mb = {k: to_device(v, self.device) for k, v in mb.items()}
        return mb, inputs

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def loss_batch(
        self, seqs: Sequence[TrainSequence], bin_: list[int], done: Prox
    ) -> tuple[dict[str, torch.Tensor], ModelInputs]:
        """The loss batch and model inputs of `bin_`: `_logprob_pass`'s (with its pi_prox as
        `prox_logprobs`) when `done` holds them, else collated now."""
        if done is None:
            return self.collate_batch([seqs[i] for i in bin_])
        mb, inputs, prox_BT = done
        mb["prox_logprobs"] = prox_BT
        return mb, inputs

    def add_loss(
        self, sums: UpdateSums, mb: dict[str, torch.Tensor], loss_fn: LossFn, denominator: torch.Tensor
    ) -> torch.Tensor:
        """Run `loss_fn` on `mb` (which holds `logprobs` and `entropy`) and add its loss, the trained
        tokens' entropy and its stats to `sums`; returns the loss (to backpropagate)."""
        mb["global_tokens"] = denominator
        loss, stats = loss_fn(mb)
        loss_sum, entropy_sum, stats_acc = sums
        loss_sum += loss.detach().double()
        entropy_sum += (mb["entropy"] * mb["mask"]).sum().double()
        for key, value in stats.items():
            v = torch.as_tensor(value).detach().to(device=self.device, dtype=torch.float64)
            if key not in stats_acc:
                stats_acc[key] = v
            elif key.endswith("_max"):
                stats_acc[key] = torch.maximum(stats_acc[key], v)
            else:
                stats_acc[key] = stats_acc[key] + v
        return loss

    def new_sums(self) -> UpdateSums:
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        return zero, zero.clone(), {}

    def _update_passes(
        self,
        seqs: Sequence[TrainSequence],
        bins: list[list[int] | None],
        prox: list[Prox],
        loss_fn: LossFn,
        denominator: torch.Tensor,
        *,
        prox_from_update: bool = False,
    ) -> UpdateSums:
        """Forward, loss and backward of every bin (an empty pass for None), in order; returns the
        summed loss, the summed entropy of trained tokens and loss_fn's accumulated stats.

        `prox_from_update`: pi_prox of each micro-batch is its own forward's logprobs, detached,
        which are those of a separate no-grad pass: the weights do not change before the step's one
        optimizer step (`train_step`)."""
        sums = self.new_sums()
        self.model.train()
        for k, bin_ in enumerate(bins):
            if bin_ is None:
                logprobs_BT, _ = self._forward(*self.empty_batch())
                (logprobs_BT.sum() * 0.0).backward()
                continue
            done, prox[k] = prox[k], None  # each batch lives until its update only
            mb, inputs = self.loss_batch(seqs, bin_, done)
            logprobs_BT, entropy_BT = self._forward(mb, inputs)
            if prox_from_update:
                mb["prox_logprobs"] = logprobs_BT.detach()
            mb.update(logprobs=logprobs_BT, entropy=entropy_BT)
            self.add_loss(sums, mb, loss_fn, denominator).backward()
        return sums

    # ------------------------------------------------------------------ public

    @torch.no_grad()
    def _logprob_pass(self, seqs: Sequence[TrainSequence], bins: list[list[int] | None]) -> list[Prox]:
        """No-grad forward of every bin of `_micro_batches` (an empty pass for None): per bin its
        collated batch, model inputs and `[b, T]` float32 logprobs (None for an empty pass)."""
        self.model.eval()
        out: list[Prox] = []
        for bin_ in bins:
            if bin_ is None:
                self._forward(*self.empty_batch(), with_entropy=False)
                out.append(None)
                continue
            mb, inputs = self.collate_batch([seqs[i] for i in bin_])
            logprobs_BT, _ = self._forward(mb, inputs, with_entropy=False)
            out.append((mb, inputs, logprobs_BT))
        return out

    def compute_logprobs(self, seqs: Sequence[TrainSequence]) -> list[torch.Tensor]:
        """No-grad float32 logprobs of each sequence's completion tokens (CPU tensors of length C).

        Used for reference-model logprobs (and pi_prox outside `train_step(compute_prox=True)`).
        Collective.
        """
        bins = self._micro_batches(seqs)
        order: list[int] = []
        parts: list[torch.Tensor] = []
        for bin_, done in zip(bins, self._logprob_pass(seqs, bins), strict=True):
            if bin_ is None or done is None:
                continue
            _, inputs, logprobs_BT = done
            # Completion tokens of the bin's rows in row order; one copy to the host at the end.
            parts.append(logprobs_BT.flatten().index_select(0, inputs.target_index))
            order += bin_
        flat = torch.cat(parts).cpu() if parts else torch.zeros(0)
        out: list[torch.Tensor] = [torch.zeros(0)] * len(seqs)
        for i, values in zip(order, flat.split([seqs[i].num_completion_tokens for i in order]), strict=True):
            out[i] = values.clone()
        return out

    def train_step(
        self,
        seqs: Sequence[TrainSequence],
        loss_fn: LossFn,
        *,
        global_tokens: int | float | None = None,
        compute_prox: bool = False,
        prox_pass: bool = False,
    ) -> dict[str, float]:
        """One optimizer step on this rank's shard `seqs`; returns metrics reduced over ranks.

        `global_tokens` is the loss denominator of the whole step, handed to `loss_fn` as
        `mb["global_tokens"]`; None means the trained completion tokens of all ranks (token mean).
        Pass the global sequence count (etc.) for sequence-mean aggregations.

        `compute_prox`: pi_prox is the logprobs of the weights this step starts from, in
        `mb["prox_logprobs"]`, replacing the sequences' own. The step makes one optimizer step
        after all its micro-batches, so each micro-batch's own forward gives them (detached): no
        extra pass. With `prox_pass` a no-grad forward of every micro-batch computes them first
        (what `compute_logprobs` returns; each micro-batch is collated and copied to the device
        once) and adds the metric prox_seconds (from the start of the step to the end of that
        pass, slowest rank; part of compute_seconds): the two-pass step, for checking, and for
        models whose training forward differs from an evaluation one (dropout).

        Metrics: loss (sum over micro-batches and ranks), grad_norm (global, before
        clipping), lr (used by this step), entropy (mean over trained completion tokens),
        loss_tokens (trained completion tokens), total_tokens (non-pad tokens), tokens_per_s
        (total_tokens / compute_seconds), compute_seconds (slowest rank), micro_batches,
        skipped (1 when the gradient norm was not finite and the update was dropped), and
        every key of loss_fn's stats, summed over micro-batches and ranks (keys ending in
        `_max`: maximum). A stat named like an engine metric is reported as
        `loss_fn/<key>`. Collective.
        """
        self._sync()
        start = time.perf_counter()
        clock = _StepClock(self.device)
        local_loss_tokens = sum(s.num_loss_tokens for s in seqs)
        local_tokens = sum(s.length for s in seqs)
        if global_tokens is None:
            global_tokens = self._all_reduce([float(local_loss_tokens)])[0]
        denominator = torch.tensor(float(max(global_tokens, 1)), device=self.device)
        self.optimizer.zero_grad(set_to_none=True)
        bins = self._micro_batches(seqs)
        separate = compute_prox and prox_pass
        prox = self._logprob_pass(seqs, bins) if separate else [None] * len(bins)
        if separate:
            clock.mark()
        loss_sum, entropy_sum, stats_acc = self._update_passes(
            seqs, bins, prox, loss_fn, denominator, prox_from_update=compute_prox and not prox_pass
        )

        grad_norm = self._clip_gradients()
        lr = float(self.optimizer.param_groups[0]["lr"])
        skipped = not math.isfinite(grad_norm)
        if skipped:
            log.warning(
                "non-finite gradient norm, update skipped", grad_norm=grad_norm, policy_version=self.version
            )
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.version += 1
        self._sync()
        seconds = time.perf_counter() - start

        engine_sums = [loss_sum, entropy_sum, float(local_tokens), float(local_loss_tokens)]
        engine_maxes = [seconds] + ([clock.seconds()] if separate else [])
        sums, maxes = self._reduce_stats(stats_acc, engine_sums, engine_maxes)
        loss_value, entropy_total, total_tokens, loss_tokens = (sums.pop(k) for k in range(4))
        seconds = maxes.pop(0)
        prox_seconds = maxes.pop(1) if separate else None
        metrics: dict[str, float] = {
            "loss": loss_value,
            "grad_norm": grad_norm,
            "lr": lr,
            "entropy": entropy_total / max(loss_tokens, 1.0),
            "loss_tokens": loss_tokens,
            "total_tokens": total_tokens,
            "tokens_per_s": total_tokens / seconds if seconds > 0 else 0.0,
            "compute_seconds": seconds,
            "micro_batches": float(len(bins)),
            "skipped": float(skipped),
        }
        if prox_seconds is not None:
            metrics["prox_seconds"] = prox_seconds
        for key, value in (sums | maxes).items():
            metrics[f"loss_fn/{key}" if key in metrics else key] = value
        log.debug("train step done", policy_version=self.version, **metrics)
        return metrics

    def _reduce_stats(
        self, stats: dict[str, torch.Tensor], sums: list[torch.Tensor | float], maxes: list[float]
    ) -> tuple[dict[Any, float], dict[Any, float]]:
        """All-reduce `sums` + summed stats (SUM over `dp_group`) and `maxes` + `_max` stats (MAX) in
        two collectives.

        Returns dicts keyed by position for the engine values and by name for the stats.
        """
        keys = sorted(stats)
        if self.distributed:
            gathered: list[list[str]] = [[] for _ in range(self.world_size)]
            dist.all_gather_object(gathered, keys)  # every rank: TP ranks hold the same keys
            keys = sorted(set().union(*gathered))
        sum_keys = [k for k in keys if not k.endswith("_max")]
        max_keys = [k for k in keys if k.endswith("_max")]

        def as_tensor(value: torch.Tensor | float) -> torch.Tensor:
            return torch.as_tensor(value, dtype=torch.float64, device=self.device).reshape(())

        sum_t = torch.stack([as_tensor(v) for v in sums] + [as_tensor(stats.get(k, 0.0)) for k in sum_keys])
        max_t = torch.stack(
            [as_tensor(v) for v in maxes] + [as_tensor(stats.get(k, -math.inf)) for k in max_keys]
        )
        if self.distributed:
            self._sum_over_ranks(sum_t)
            dist.all_reduce(max_t, op=dist.ReduceOp.MAX)
        sum_list, max_list = sum_t.tolist(), max_t.tolist()
        out_sums: dict[Any, float] = dict(enumerate(sum_list[: len(sums)]))
        out_sums.update(zip(sum_keys, sum_list[len(sums) :], strict=True))
        out_maxes: dict[Any, float] = dict(enumerate(max_list[: len(maxes)]))
        out_maxes.update(zip(max_keys, max_list[len(maxes) :], strict=True))
        return out_sums, out_maxes

    def sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        """Sums of per-rank values computed from each rank's shard (losses, token counts) over the
        trainer, each data shard counted once, as a step's sums are. Collective."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if self.distributed:
            self._sum_over_ranks(t)
        return t.tolist()

    def _sum_over_ranks(self, values: torch.Tensor) -> None:
        """In place: the step's sums (losses, token counts, stats) over the ranks that hold different
        data, each counted once."""
        dist.all_reduce(values, group=self.dp_group)

    def _clip_gradients(self) -> float:
        """Global gradient norm over all ranks (before clipping); clips in place when grad_clip > 0."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return 0.0
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.grad_clip, total)
        return float(total)
