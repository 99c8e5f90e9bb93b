"""The training-engine contract: what the learner, checkpoints and workers may call on a trainer
backend. `fsdp.engine.FSDPTrainEngine` and `megatron.engine.MegatronTrainEngine` satisfy it; code
outside a backend is typed against `TrainEngine`, never against a backend class.

Every method is collective (all ranks of the trainer call it in the same order) unless it says
otherwise. Ranks: `rank` / `world_size` over the whole trainer, `dp_rank` / `dp_size` over the ranks
that take different data (tensor, pipeline and context-parallel peers share a shard).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from areal_async.training.batching import TrainSequence
from areal_async.training.loop import LossFn


class TrainEngine(Protocol):
    version: int
    """Policy version of the weights: optimizer steps taken since version 0 (the base model)."""
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    distributed: bool

    def train_step(
        self,
        seqs: Sequence[TrainSequence],
        loss_fn: LossFn,
        *,
        global_tokens: int | float | None = None,
        compute_prox: bool = False,
        prox_pass: bool = False,
    ) -> dict[str, float]:
        """One optimizer step on this rank's shard `seqs`; metrics reduced over ranks. pi_prox
        (`compute_prox`) comes from the update's own forward, or from a separate pass first
        (`prox_pass`)."""
        ...

    def compute_logprobs(self, seqs: Sequence[TrainSequence]) -> list[torch.Tensor]:
        """No-grad float32 logprobs of each sequence's completion tokens."""
        ...

    def sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        """Sums of per-rank values computed from each rank's shard over the trainer, each data shard
        counted once."""
        ...

    def snapshot_hf(
        self, *, dtype: torch.dtype | None = None, on_device: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """HF-named copies of the weights (the adapters under LoRA) on rank 0, None elsewhere."""
        ...

    def merged_hf(self, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        """Full HF weights on rank 0 with any LoRA adapters merged in, None elsewhere."""
        ...

    def save_hf(
        self, path: str | os.PathLike[str], *, dtype: torch.dtype | None = None
    ) -> list[dict[str, Any]]:
        """Write an HF (or adapter) directory atomically; its manifest on every rank."""
        ...

    def save_merged_hf(
        self, path: str | os.PathLike[str], *, dtype: torch.dtype | None = None
    ) -> list[dict[str, Any]]:
        """Write a full HF model directory atomically, any LoRA adapters merged in; its manifest on
        every rank."""
        ...

    def write_hf(
        self, path: str | os.PathLike[str], tensors: dict[str, torch.Tensor]
    ) -> list[dict[str, Any]]:
        """Write `snapshot_hf`'s tensors as a directory; rank 0 only, no collectives."""
        ...

    def save_sharded(self, path: Path) -> dict[str, Any]:
        """Every rank writes its own shards of weights and optimizer state under `path`; returns the
        small replicated rest for the caller to store."""
        ...

    def load_sharded(self, path: Path, state: Mapping[str, Any]) -> None:
        """Restore `save_sharded`'s checkpoint, at any world size or parallel layout."""
        ...
