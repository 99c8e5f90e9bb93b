"""Tiny random-init Llama checkpoints and random training batches for the FSDP engine tests."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from areal_async.training.batching import TrainSequence


def write_tiny_llama(
    path: Path, *, vocab: int, hidden: int = 64, intermediate: int = 128, tie: bool = True
) -> Path:
    """A 2-layer GQA Llama (4 query heads, 2 K/V heads) saved to `path`; deterministic."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    return path


def random_batch(
    shapes: Sequence[tuple[int, int]], *, vocab: int, seed: int = 0, behave_base: float = -6.0
) -> list[TrainSequence]:
    """One sequence per (prompt length, completion length): random tokens and advantages, behaviour
    logprobs in (behave_base - 1, behave_base]; deterministic in `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [
        TrainSequence(
            prompt_ids=torch.randint(0, vocab, (p,), generator=g).tolist(),
            completion_ids=torch.randint(0, vocab, (c,), generator=g).tolist(),
            behave_logprobs=(behave_base - torch.rand(c, generator=g)).tolist(),
            advantages=torch.randn(c, generator=g).tolist(),
        )
        for p, c in shapes
    ]


def as_torchrun_rank(rank: int, world: int, port: int) -> None:
    """Set the environment torchrun gives rank `rank` of `world` (rendezvous on localhost:`port`)
    and one torch thread, in a process spawned by a test."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
