"""Context parallelism of both trainer backends (`trainer.context_parallel`; groups of consecutive
ranks on FSDP2, megatron-core's on Megatron): every packed micro-batch row is split over the C
ranks of a context-parallel group, so each rank's activations hold 1/C of its tokens.

Split (`ContextPart.of`). The ranks of a group hold the same data shard and collate the same
micro-batches. The packed row of N tokens is padded to 2C chunks of equal length (the padding is
one extra sequence, so no real token attends to it) and rank r keeps chunks r and 2C - 1 - r
(the zigzag layout): embedding, norms and every linear layer run on those only, and under causal
attention every rank gets about the same work, since a chunk late in a sequence (many keys) is
paired with an early one (few).

Attention (`attend`). Each layer's rotated keys and values are all-gathered over the group (in
backward their gradients are reduce-scattered back to the ranks that own them), and the rank's
queries attend causally, within their own sequence, to the keys up to their position. The rank's
queries fall into pieces (`ContextPart.pieces`): the tokens of one sequence within one of its two
chunks, which attend to the keys from their sequence's start to the piece's end, aligned at the
bottom right (the piece's last query sees every key). On CUDA in 16 bits the pieces run as one
FlashAttention-2 varlen call with separate query and key bounds (`varlen` argument), elsewhere as
SDPA per piece with the same mask.

Logprobs (`gather_logprobs`). Each rank computes the logprob and entropy of the selected rows
(`hidden_index`) that fall in its part; they are all-gathered into the micro-batch's whole `[n]`,
and in backward each rank keeps the gradient of its own part. The loss therefore runs unchanged and
identically on every rank of the group, as on tensor-parallel ranks, and its sums are counted once
(the training loop sums over the data-parallel group only); parameter gradients, each rank's share
of the tokens, are summed over the data-parallel x context-parallel ranks (FSDP2 reduces over every
rank; `training/megatron/engine.py` over its data-parallel x context-parallel group).

`groups(size)` builds the groups for a backend without megatron-core's parallel state: the
context-parallel groups are runs of `size` consecutive ranks, the data-parallel groups take one
rank of each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def padded_tokens(tokens: int, multiple: int) -> int:
    """`tokens` rounded up to a multiple of `multiple`."""
    return -(-tokens // multiple) * multiple


def local_tokens(tokens: int, size: int) -> int:
    """Tokens each of `size` ranks holds of a packed row of `tokens`: two chunks of the padded row."""
    return padded_tokens(tokens, 2 * size) // size


def pad_row(
    input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, multiple: int,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """The packed row `[1, N]` padded to a multiple of `multiple` tokens by one extra sequence of
    `pad_token_id` (which no real token attends to): `(input_ids, position_ids, cu_seqlens, pad)`."""
    n = int(input_ids.shape[1])
    pad = padded_tokens(n, multiple) - n
    if pad == 0:
        return input_ids, position_ids, cu_seqlens, 0
    input_ids = torch.cat([input_ids, input_ids.new_full((1, pad), pad_token_id)], dim=1)
    position_ids = torch.cat([position_ids, torch.arange(pad, device=position_ids.device)[None]], dim=1)
    cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_full((1,), n + pad)])
    return input_ids, position_ids, cu_seqlens, pad


def _ranges(rank: int, size: int, chunk: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two `[start, end)` token ranges of `rank` in a padded row of `2 size` chunks."""
    last = 2 * size - 1 - rank
    return (rank * chunk, (rank + 1) * chunk), (last * chunk, (last + 1) * chunk)


def _tokens(rank: int, size: int, chunk: int) -> torch.Tensor:
    """The padded row's indices of `rank`'s tokens, in its local order."""
    (a, b), (c, d) = _ranges(rank, size, chunk)
    return torch.cat([torch.arange(a, b), torch.arange(c, d)])


@dataclass(frozen=True)
class ContextPart:
    """This rank's tokens of one padded packed row, and what the group's collectives need."""

    group: Any
    rank: int
    size: int
    chunk: int
    """Tokens per chunk: the padded row is `2 * size` chunks; rank r holds r and 2 size - 1 - r."""
    bounds: list[int]
    """Sequence bounds of the padded row (cu_seqlens as host ints, the padding its own sequence)."""
    order: torch.Tensor
    """Gathered selected rows (rank by rank, each in its local order) -> the row's order."""
    counts: list[int]
    """Selected rows (`hidden_index`) in each rank's part."""
    gathered: torch.Tensor
    """The row's index of each token of a gathered `[2 chunk * size]` tensor (rank by rank)."""

    def ranges(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """This rank's two `[start, end)` token ranges in the padded row."""
        return _ranges(self.rank, self.size, self.chunk)

    def tokens(self) -> torch.Tensor:
        """The padded row's positions of this rank's tokens, in its local order."""
        return _tokens(self.rank, self.size, self.chunk).to(self.gathered.device)

    @cached_property
    def pieces(self) -> list[tuple[int, int, int]]:
        """`(start, q0, q1)` for every run of this rank's tokens that lies in one sequence, in local
        order: tokens `[q0, q1)` of the sequence that starts at `start` (padded row positions)."""
        out = []
        for lo, hi in self.ranges():
            for a, b in zip(self.bounds[:-1], self.bounds[1:], strict=True):
                if max(a, lo) < min(b, hi):
                    out.append((a, max(a, lo), min(b, hi)))
        return out

    @cached_property
    def varlen_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """The pieces as one varlen call: the index into the gathered keys of every piece's keys (from
        its sequence's start to the piece's end, piece after piece), the int32 query and key bounds,
        and the longest query and key span."""
        q_spans = [q1 - q0 for _, q0, q1 in self.pieces]
        k_spans = [q1 - a for a, _, q1 in self.pieces]
        device = self.gathered.device
        keys = torch.cat([torch.arange(a, q1) for a, _, q1 in self.pieces]).to(device)
        keys = torch.argsort(self.gathered)[keys]  # row positions -> positions in the gathered tensor
        cu_q, cu_k = (
            torch.tensor([0, *accumulate(spans)], dtype=torch.int32, device=device)
            for spans in (q_spans, k_spans)
        )
        return keys, cu_q, cu_k, max(q_spans), max(k_spans)

    @classmethod
    def of(
        cls, group: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, hidden_index: torch.Tensor,
        cu_seqlens: torch.Tensor, pad_token_id: int = 0, *, size: int | None = None, rank: int | None = None,
    ) -> tuple[ContextPart, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Split the packed row `[1, N]`: returns the part, this rank's `input_ids` and
        `position_ids` `[1, 2 chunk]`, its selected rows (indices into its part) and their targets
        laid out for `logprobs.of_selected` (entry `i + 1` is local row i's next token). `size` and
        `rank` default to the group's (given: a layout without a process group, as tests use)."""
        size = dist.get_world_size(group) if size is None else size
        rank = dist.get_rank(group) if rank is None else rank
        input_ids, position_ids, cu_seqlens, _ = pad_row(
            input_ids, position_ids, cu_seqlens, 2 * size, pad_token_id
        )
        ids, positions = input_ids.flatten(), position_ids.flatten()
        chunk = ids.shape[0] // (2 * size)
        bounds = [int(b) for b in cu_seqlens.tolist()]
        edges = torch.arange(2 * size + 1, device=hidden_index.device) * chunk
        cuts = torch.bucketize(edges, hidden_index).tolist()  # selected rows before each chunk edge
        per_chunk = [hidden_index[cuts[k] : cuts[k + 1]] for k in range(2 * size)]
        picked = [torch.cat([per_chunk[r], per_chunk[2 * size - 1 - r]]) for r in range(size)]
        part = cls(
            group=group,
            rank=rank,
            size=size,
            chunk=chunk,
            bounds=bounds,
            order=torch.argsort(torch.cat(picked)),
            counts=[int(p.shape[0]) for p in picked],
            gathered=torch.cat([_tokens(r, size, chunk) for r in range(size)]).to(ids.device),
        )
        (a, _), (c, _) = part.ranges()
        local = part.tokens()
        mine = torch.cat([per_chunk[rank] - a, per_chunk[2 * size - 1 - rank] - c + chunk])
        following = ids[(local + 1).clamp(max=ids.shape[0] - 1)]
        targets = torch.cat([following[:1], following])
        return part, ids[local][None], positions[local][None], mine, targets


def all_gather_rows(part: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's equal `[t, ...]` part, concatenated along dim 0 in rank order (no autograd)."""
    out = part.new_empty((part.shape[0] * dist.get_world_size(group), *part.shape[1:]))
    dist.all_gather_into_tensor(out, part.contiguous(), group=group)
    return out


def reduce_scatter_rows(whole: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's `1/size` block of rows (along dim 0) of `whole` summed over the group (no autograd)."""
    out = whole.new_empty((whole.shape[0] // dist.get_world_size(group), *whole.shape[1:]))
    dist.reduce_scatter_tensor(out, whole.contiguous(), group=group)
    return out


def all_gather_counted(rows: torch.Tensor, counts: list[int], group: Any) -> torch.Tensor:
    """Every rank's `[counts[r], ...]` rows concatenated along dim 0 in rank order (no autograd): one
    all-gather of the rows padded to the largest count."""
    width = max(counts)
    padded = rows.new_zeros((width, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    whole = all_gather_rows(padded, group)
    return torch.cat([whole[r * width : r * width + c] for r, c in enumerate(counts)])


class GatherRows(torch.autograd.Function):
    """All-gather `[t, ...]` parts along dim 0 over a group; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return all_gather_rows(part, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return reduce_scatter_rows(grad, ctx.group), None


VarlenKernel = Callable[..., torch.Tensor]
"""`(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale) -> out`: causal attention of packed
queries to packed keys with separate bounds, bottom-right aligned (`varlen.causal_varlen_attn`)."""


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    part: ContextPart,
    scale: float | None,
    varlen: VarlenKernel | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries `[t, heads, d]` to the group's keys and values (this
    rank's `[t, kv_heads, d]`, gathered), within each sequence; returns `[t, heads, d]`. `varlen`, a
    fused kernel that runs every piece in one call, is passed by callers where it runs (CUDA, 16
    bits); without it SDPA runs piece by piece."""
    kv = GatherRows.apply(torch.cat([key, value], dim=-1), part.group)
    return attend_gathered(query, kv, part, scale, varlen)


def attend_gathered(
    query: torch.Tensor, kv: torch.Tensor, part: ContextPart, scale: float | None, varlen: VarlenKernel | None
) -> torch.Tensor:
    """`attend` after the gather: `kv` holds every rank's keys and values (concatenated on the last
    dim), rank by rank."""
    d = kv.shape[-1] // 2
    if varlen is not None:
        keys_index, cu_q, cu_k, max_q, max_k = part.varlen_layout
        kv = kv.index_select(0, keys_index)
        return varlen(query, kv[..., :d], kv[..., d:], cu_q, cu_k, max_q, max_k, scale)
    row = torch.empty_like(kv).index_copy(0, part.gathered, kv)  # in the row's order
    keys, values = row[..., :d], row[..., d:]
    gqa = keys.shape[1] != query.shape[1]
    outs, offset = [], 0
    for a, q0, q1 in part.pieces:
        q = query[offset : offset + q1 - q0].transpose(0, 1)[None]
        k, v = (t[a:q1].transpose(0, 1)[None] for t in (keys, values))
        own = torch.arange(q0 - a, q1 - a, device=query.device)[:, None]
        mask = torch.arange(q1 - a, device=query.device)[None, :] <= own  # key position <= query's
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa))
        offset += q1 - q0
    return torch.cat(outs, dim=2)[0].transpose(0, 1)


class _GatherSelected(torch.autograd.Function):
    """The `[n_r, ...]` values of every rank, concatenated in rank order; backward keeps this rank's
    part of the (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, part: ContextPart) -> torch.Tensor:
        ctx.part = part
        return all_gather_counted(values, part.counts, part.group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        part = ctx.part
        first = sum(part.counts[: part.rank])
        return grad[first : first + part.counts[part.rank]], None


def gather_logprobs(
    part: ContextPart, logprobs_N: torch.Tensor, entropy_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole micro-batch's `[n]` logprobs (with grad) and entropy (without) from each rank's
    selected rows, in one collective (see the module docstring)."""
    if max(part.counts) == 0:
        return logprobs_N, entropy_N  # nothing selected anywhere: every rank has the same empty tensors
    both = torch.stack([logprobs_N, entropy_N.detach()], dim=1)
    both = _GatherSelected.apply(both, part).index_select(0, part.order.to(both.device))
    return both[:, 0], both[:, 1].detach()


def groups(size: int) -> tuple[Any, Any, int, int]:
    """(this rank's context-parallel group, its data-parallel group, data-parallel rank and size)
    for context-parallel groups of `size` consecutive ranks. Collective: every rank builds every
    group, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(
            f"trainer.context_parallel={size} does not divide the trainer's {world} ranks "
            "(trainer.num_ranks x nodes); choose a size that divides it"
        )
    context = data = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            context = group
    for offset in range(size):
        group = dist.new_group(list(range(offset, world, size)))
        if rank % size == offset:
            data = group
    return context, data, rank // size, world // size
