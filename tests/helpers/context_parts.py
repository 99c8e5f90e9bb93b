"""Context-parallel parts of a packed row for every rank of a group, built without a process group."""

from __future__ import annotations

from typing import Any

import torch

from areal_async.training.context_parallel import ContextPart


def parts_of(lengths: list[int], size: int, device: str = "cpu") -> list[ContextPart]:
    """Every rank's part of a row of sequences of `lengths` (every token selected but the last)."""
    n = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(length) for length in lengths])[None].to(device)
    parts = []
    for rank in range(size):
        ids = torch.arange(n, device=device)[None]
        parts.append(
            ContextPart.of(
                None, ids, positions, torch.arange(n - 1, device=device), cu, size=size, rank=rank
            )[0]
        )
    return parts


def padded_rows(part: ContextPart, *tensors: torch.Tensor) -> list[Any]:
    """`[N, ...]` row tensors padded with zeros to the part's padded row length."""
    total = part.bounds[-1]
    return [torch.cat([t, t.new_zeros((total - t.shape[0], *t.shape[1:]))]) for t in tensors]
