"""Training sequences, micro-batch packing and collation for the training engine.

A `TrainSequence` is one completion of one prompt with everything the loss needs per
completion token: the behaviour logprobs from the inference engine (pi_behave), the
advantages, optionally pi_prox (the trainer's no-grad logprobs at the start of the step),
reference-model logprobs, a loss weight and a loss mask. The loss mask marks the trained
tokens of a multi-turn completion (the model's own); the others (tool, user, environment
output) are context only: the model reads them, the loss and its counts do not.

Layout of a collated micro-batch (`collate`): one sequence per row, right-padded to the
longest row, every per-token tensor `[b, T]` aligned with `input_ids`. Column `t` of a
per-token tensor belongs to token `input_ids[:, t]`: its logprob is
`log p(input_ids[t] | input_ids[:t])`, read from the logits at position `t - 1`. So the
first completion token of a row sits at column `len(prompt_ids)`, and `mask` is True
exactly on the trained completion tokens (every completion token without a loss mask; never
on prompt or padding). Per-token values outside the completion tokens are zero. Position ids
are `0..T-1` on every row; right padding plus causal attention means a real token never
attends to padding, so the engine needs no attention mask.

Per-token fields accept lists, numpy arrays or 1-D tensors; arrays and tensors are
copied into the batch without a Python loop, so prefer them for long completions.

`pack_micro_batches` bins sequence indices so each micro-batch's padded size
`rows * longest_row` stays within a token budget. It sorts by length (longest first, ties
by index, so the result is deterministic) and fills bins greedily in that order, which
keeps the padding inside a bin small. A sequence longer than the budget gets a bin of its
own and a warning.

`pack_tokens` bins for packed rows instead, by total tokens, and `model_inputs` lays a
micro-batch out for the model (`ModelInputs`): collate's padded rows, or one packed row of
the sequences back to back, which wastes no compute on padding and needs attention that
keeps sequences apart (`training/attention.py`). Either way the loss sees collate's layout.

Legend: B/b rows (sequences), T padded length, C completion length, P prompt length,
N tokens of a packed row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)

_PER_TOKEN = ("behave_logprobs", "advantages", "prox_logprobs", "ref_logprobs", "loss_weights", "loss_mask")


@dataclass(kw_only=True)
class TrainSequence:
    """One prompt + completion with per-completion-token training inputs (all length C)."""

    prompt_ids: Sequence[int]
    """Prompt token ids (P >= 1; the first token has no logprob)."""

    completion_ids: Sequence[int]
    """Generated token ids (C)."""

    behave_logprobs: Sequence[float]
    """pi_behave: logprob of each completion token under the policy that sampled it."""

    advantages: Sequence[float]
    """Advantage of each completion token."""

    prox_logprobs: Sequence[float] | None = None
    """pi_prox from `FSDPTrainEngine.compute_logprobs` at the start of the step;
    None means pi_prox := pi_behave (standard PPO around the inference logprobs)."""

    ref_logprobs: Sequence[float] | None = None
    """Reference-model logprobs for a KL penalty (None: no reference)."""

    loss_weights: Sequence[float] | None = None
    """Per-token loss weight (None: 1.0 on every completion token)."""

    loss_mask: Sequence[bool] | None = None
    """True on the trained completion tokens (None: every completion token is trained)."""

    def __post_init__(self) -> None:
        if len(self.prompt_ids) < 1:
            raise ValueError(
                "a TrainSequence needs at least one prompt token (the first token has no logprob)"
            )
        n = len(self.completion_ids)
        for name in _PER_TOKEN:
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(
                    f"TrainSequence.{name} has {len(value)} values for {n} completion tokens; "
                    "pass one value per completion token"
                )

    @property
    def length(self) -> int:
        """Total tokens P + C."""
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def num_completion_tokens(self) -> int:
        """C: tokens after the prompt, trained or not."""
        return len(self.completion_ids)

    @property
    def num_loss_tokens(self) -> int:
        """Completion tokens that carry a loss (the loss mask's True entries)."""
        if self.loss_mask is None:
            return len(self.completion_ids)
        return int(torch.as_tensor(self.loss_mask, dtype=torch.bool).sum())


def pack_lengths(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Bin indices of `lengths` so each bin's `len(bin) * max(lengths in bin) <= token_budget`.

    Longest first (ties by index), greedy fill; an over-budget length gets its own bin.
    Bins list indices in descending length order; the result is deterministic.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = lengths[i]
        if n > token_budget:
            log.warning("sequence exceeds micro-batch budget", index=i, length=n, token_budget=token_budget)
            bins.append([i])
            continue
        if current and (len(current) + 1) * longest <= token_budget:
            current.append(i)
            continue
        if current:
            bins.append(current)
        current, longest = [i], n
    if current:
        bins.append(current)
    return bins


def pack_micro_batches(seqs: Sequence[TrainSequence], token_budget: int) -> list[list[int]]:
    """Bin sequence indices into micro-batches of padded size `rows * longest <= token_budget`."""
    return pack_lengths([s.length for s in seqs], token_budget)


def collate(seqs: Sequence[TrainSequence], *, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad `seqs` into `[b, T]` tensors (layout in the module docstring).

    Keys: input_ids, position_ids (int64); attention_mask, mask (bool); behave_logprobs,
    prox_logprobs (pi_behave where a sequence has none), advantages, loss_weights, and
    ref_logprobs when every sequence has them (float32).
    """
    if not seqs:
        raise ValueError("collate needs at least one sequence")
    has_ref = [s.ref_logprobs is not None for s in seqs]
    if any(has_ref) and not all(has_ref):
        raise ValueError("either every sequence in a batch has ref_logprobs or none does")
    b, t = len(seqs), max(s.length for s in seqs)
    input_ids = torch.full((b, t), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((b, t), dtype=torch.bool)
    mask = torch.zeros((b, t), dtype=torch.bool)
    names = ["behave_logprobs", "prox_logprobs", "advantages", "loss_weights"] + (
        ["ref_logprobs"] if all(has_ref) else []
    )
    per_token = {name: torch.zeros((b, t), dtype=torch.float32) for name in names}
    for row, s in enumerate(seqs):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[row, :p] = torch.as_tensor(s.prompt_ids, dtype=torch.long)
        attention_mask[row, : p + c] = True
        if c == 0:
            continue
        input_ids[row, p : p + c] = torch.as_tensor(s.completion_ids, dtype=torch.long)
        mask[row, p : p + c] = True if s.loss_mask is None else torch.as_tensor(s.loss_mask, dtype=torch.bool)
        values = {
            "behave_logprobs": s.behave_logprobs,
            "prox_logprobs": s.prox_logprobs if s.prox_logprobs is not None else s.behave_logprobs,
            "advantages": s.advantages,
            "loss_weights": s.loss_weights if s.loss_weights is not None else [1.0] * c,
            "ref_logprobs": s.ref_logprobs,
        }
        for name in names:
            per_token[name][row, p : p + c] = torch.as_tensor(values[name], dtype=torch.float32)
    position_ids = torch.arange(t, dtype=torch.long).expand(b, t).contiguous()
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "mask": mask,
        **per_token,
    }


def pack_tokens(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Bin indices of `lengths` so each bin's `sum(lengths in bin) <= token_budget` (packed rows).

    Starts with the fewest bins the total needs and puts each length, longest first (ties by
    index), into the least-filled bin it fits in, opening a bin when none has room, so bins end
    up about equally full. An over-budget length gets its own bin. Deterministic.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    fitting = sum(n for n in lengths if n <= token_budget)
    bins: list[list[int]] = [[] for _ in range(-(-fitting // token_budget))]
    loads = [0] * len(bins)
    for i in order:
        n = lengths[i]
        if n > token_budget:
            log.warning("sequence exceeds micro-batch budget", index=i, length=n, token_budget=token_budget)
            bins.append([i])
            loads.append(n)
            continue
        fits = [k for k in range(len(bins)) if loads[k] + n <= token_budget]
        if not fits:
            bins.append([])
            loads.append(0)
            fits = [len(bins) - 1]
        k = min(fits, key=lambda k: (loads[k], k))
        bins[k].append(i)
        loads[k] += n
    return [b for b in bins if b]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy to `device` without blocking; to CUDA from pinned memory, so the copy is truly
    asynchronous (it does not wait for the GPU's queue)."""
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


@dataclass(kw_only=True)
class ModelInputs:
    """What the model reads for one micro-batch, and where each completion token's logprob goes.

    Padded: `input_ids` is collate's `[b, T]`. Packed: one row `[1, N]`, the sequences back to
    back (N = their total length), position ids restarting at 0 per sequence, `cu_seqlens` the
    sequence bounds. In both, `hidden_index` indexes the flattened model rows: the hidden state
    that predicts each completion token (the token is at `hidden_index + 1`), and `target_index`
    indexes the flattened `[b, T]` layout of collate, where the token's logprob belongs.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    hidden_index: torch.Tensor
    target_index: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    """int32 `[b + 1]`: 0, then the end of each sequence in the packed row (None: padded rows)."""
    max_length: int = 0
    """Longest sequence (packed rows)."""

    def model_args(self) -> tuple[Any, ...]:
        """The model contract's positional arguments (training/loop.py), before `with_entropy`."""
        return (self.input_ids, self.position_ids, self.hidden_index, self.cu_seqlens, self.max_length)

    def to(self, device: torch.device) -> ModelInputs:
        return ModelInputs(
            input_ids=to_device(self.input_ids, device),
            position_ids=to_device(self.position_ids, device),
            hidden_index=to_device(self.hidden_index, device),
            target_index=to_device(self.target_index, device),
            cu_seqlens=to_device(self.cu_seqlens, device) if self.cu_seqlens is not None else None,
            max_length=self.max_length,
        )


def model_inputs(seqs: Sequence[TrainSequence], input_ids_BT: torch.Tensor, *, packed: bool) -> ModelInputs:
    """Model inputs for `seqs` given collate's `input_ids` (`ModelInputs` says the layouts)."""
    t = input_ids_BT.shape[1]
    lengths = [s.length for s in seqs]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    target, hidden = [], []
    for row, s in enumerate(seqs):
        p, c = len(s.prompt_ids), s.num_completion_tokens
        columns = torch.arange(p, p + c)
        target.append(row * t + columns)
        hidden.append((starts[row] if packed else row * t) + columns - 1)
    target_index, hidden_index = torch.cat(target), torch.cat(hidden)
    if not packed:
        position_ids = torch.arange(t, dtype=torch.long).expand(len(seqs), t).contiguous()
        return ModelInputs(
            input_ids=input_ids_BT,
            position_ids=position_ids,
            hidden_index=hidden_index,
            target_index=target_index,
        )
    keep = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    return ModelInputs(
        input_ids=input_ids_BT[keep][None],
        position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
        hidden_index=hidden_index,
        target_index=target_index,
        cu_seqlens=torch.tensor(starts, dtype=torch.int32),
        max_length=max(lengths),
    )
