"""Sequence parallelism of the Megatron backend (`trainer.megatron.sequence_parallel`): with T
tensor-parallel ranks, the hidden states between the tensor-parallel regions hold 1/T of the
packed row's tokens on each rank (rank r the r-th contiguous block), so the embedding output,
norms and residual adds, and the hidden states sent between pipeline stages, take 1/T of the
memory they take under plain tensor parallelism.

Regions (plain tensor parallelism in brackets):

- embedding (`embed`): each rank looks up the whole row in its vocabulary slice (zeros for the
  other tokens) and a reduce-scatter sums the slices into each rank's block [all-reduce];
- column-parallel linear layers, QKV and fc1 (`GatheredColumnLinear`): the input rows are
  all-gathered over the group, and the input gradient reduce-scattered in backward [identity
  forward, all-reduce backward]. Only the rank's block is kept for backward and gathered again
  there for the weight gradient, as megatron-core's own sequence parallelism does, so no layer
  holds the whole row's `[t, hidden]` input between forward and backward;
- row-parallel linear layers, attention output and fc2 (`ScatteredRowLinear`): the partial
  outputs are reduce-scattered, and the gradient all-gathered in backward [all-reduce forward,
  identity backward];
- head (`gather_selected`): the final norm runs on the rank's block; the rows whose logprobs are
  wanted are all-gathered (each rank's in row order) for the vocabulary-parallel logprobs, and
  their gradient reduce-scattered in backward [identity forward, all-reduce backward].

An all-gather and a reduce-scatter move what one all-reduce moves, so each region communicates as
much as under plain tensor parallelism; the weight-gradient gather in the column layers' backward
is the one addition, the price of not keeping their whole input.

Gradients. A parameter replicated over the tensor-parallel group that sees only the rank's tokens
gets a partial gradient on each rank, so its gradients are summed over the group
(`summed_over_tensor_parallel`): every norm (input, pre-MLP and final). The q/k norms (Qwen3) run
after QKV, on every token but only the rank's heads, and are summed with or without sequence
parallelism.

Padding (`context_parallel.pad_row`). The packed row is padded to a multiple of T tokens (2 C T under context
parallelism, so each context part of `training/context_parallel.py` splits evenly over the
tensor-parallel ranks), the padding one extra sequence that no real token attends to.

megatron-core builds the layers with `sequence_parallel=False`; only the four linear layers of the
layer spec are replaced (`use_sequence_parallel`) by subclasses whose forward communicates as above. Weights,
names, shards and checkpoints stay megatron-core's. Its own sequence-parallel code allocates its
buffers on `torch.cuda.current_device()` and its torch norm refuses sequence parallelism, so it
would not run on CPU; these functions allocate like their inputs and run on both.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from areal_async.training.context_parallel import all_gather_counted, all_gather_rows, reduce_scatter_rows
from areal_async.training.megatron import layout as megatron_layout

try:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
except ImportError:  # the classes below are only built with megatron-core installed
    ColumnParallelLinear = RowParallelLinear = nn.Module  # type: ignore[assignment,misc]

QK_NORMS = ("q_layernorm.weight", "k_layernorm.weight")


def pad_multiple(tensor_parallel: int, context_parallel: int) -> int:
    """Packed rows are padded to a multiple of this many tokens under sequence parallelism."""
    return tensor_parallel * (2 * context_parallel if context_parallel > 1 else 1)


def summed_over_tensor_parallel(name: str, sequence_parallel: bool) -> bool:
    """True for the megatron-named parameters (whole or stage-local names) whose gradients are summed
    over the tensor-parallel group: replicated there, but each rank's copy sees other inputs."""
    if megatron_layout.tp_split(name):
        return False
    return sequence_parallel or name.endswith(QK_NORMS)


class ScatterRows(torch.autograd.Function):
    """Reduce-scatter `[t, ...]` along dim 0 over a group (rank r keeps the r-th block of the sum);
    backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx: Any, whole: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter_rows(whole, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_rows(grad, ctx.group), None


def embed(embedding: nn.Module, input_ids: torch.Tensor, group: Any) -> torch.Tensor:
    """megatron-core's `LanguageModelEmbedding` (no position embedding, no dropout in this backend)
    of the row `[1, t]`, this rank's block of it: `[t / T, 1, hidden]`."""
    words = embedding.word_embeddings
    outside = (input_ids < words.vocab_start_index) | (input_ids >= words.vocab_end_index)
    local = (input_ids - words.vocab_start_index).masked_fill(outside, 0)
    partial = F.embedding(local, words.weight).masked_fill(outside[..., None], 0.0)
    return ScatterRows.apply(partial.transpose(0, 1).contiguous(), group)


class _GatheredLinear(torch.autograd.Function):
    """`all_gather(rows) @ weight.T + bias` for this rank's block `rows` `[t / T, b, in]`; keeps
    only the block for backward (module docstring)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(
        ctx: Any, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Any
    ) -> torch.Tensor:
        ctx.save_for_backward(rows, weight)
        ctx.group, ctx.with_bias = group, bias is not None
        out = torch.matmul(all_gather_rows(rows, group), weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, None]:
        rows, weight = ctx.saved_tensors
        grad_rows = reduce_scatter_rows(grad.matmul(weight), ctx.group)
        whole = all_gather_rows(rows, ctx.group)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_2d.t().matmul(whole.reshape(-1, whole.shape[-1]))
        grad_bias = grad_2d.sum(0) if ctx.with_bias else None
        return grad_rows, grad_weight, grad_bias, None


class GatheredColumnLinear(ColumnParallelLinear):  # type: ignore[misc,valid-type]
    """megatron-core's column-parallel linear layer taking this rank's block of the rows."""

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert weight is None and not (runtime_gather_output or self.gather_output), "not used by GPTModel"
        device = input_.device.type
        if torch.is_autocast_enabled(device):  # gather the rows in the dtype the matmul takes
            input_ = input_.to(torch.get_autocast_dtype(device))
        bias = None if self.skip_bias_add else self.bias
        out = _GatheredLinear.apply(input_, self.weight, bias, self.tp_group)
        return out, self.bias if self.skip_bias_add else None


class ScatteredRowLinear(RowParallelLinear):  # type: ignore[misc,valid-type]
    """megatron-core's row-parallel linear layer returning this rank's block of the rows."""

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = ScatterRows.apply(F.linear(input_, self.weight), self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return out, self.bias if self.skip_bias_add else None
        return out + self.bias, None


def use_sequence_parallel(spec: Any) -> None:
    """Swap the linear layers of megatron-core's GPT layer spec for the sequence-parallel ones."""
    attention, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    attention.linear_qkv, mlp.linear_fc1 = GatheredColumnLinear, GatheredColumnLinear
    attention.linear_proj, mlp.linear_fc2 = ScatteredRowLinear, ScatteredRowLinear


class _GatherCounted(torch.autograd.Function):
    """Every rank's `[n_r, ...]` rows concatenated in rank order (`counts`: n_r of each rank);
    backward sums the gradient over the group and keeps this rank's rows."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, counts: list[int], group: Any) -> torch.Tensor:
        ctx.counts, ctx.group, ctx.width = counts, group, max(counts)
        return all_gather_counted(rows, counts, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        padded = grad.new_zeros((ctx.width * len(ctx.counts), *grad.shape[1:]))
        for r, piece in enumerate(grad.split(ctx.counts)):
            padded[r * ctx.width : r * ctx.width + piece.shape[0]] = piece
        mine = reduce_scatter_rows(padded, ctx.group)
        return mine[: ctx.counts[dist.get_rank(ctx.group)]], None, None


def gather_selected(
    hidden_TH: torch.Tensor, hidden_index: torch.Tensor, targets: torch.Tensor, group: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From this rank's block `[t / T, H]` of the row's hidden states: the selected rows of the
    whole row (`hidden_index`, ascending), every rank's, with their targets, laid out for
    `logprobs.of_selected` as `(hidden, targets, index)`. With no row selected anywhere the block
    is returned as it is (`of_selected` still puts every parameter in the graph)."""
    size, rank, rows = dist.get_world_size(group), dist.get_rank(group), hidden_TH.shape[0]
    edges = torch.arange(size + 1, device=hidden_index.device) * rows
    cuts = torch.bucketize(edges, hidden_index).tolist()  # selected rows before each block edge
    counts = [cuts[r + 1] - cuts[r] for r in range(size)]
    if max(counts) == 0:
        return hidden_TH, targets, hidden_index
    mine = hidden_index[cuts[rank] : cuts[rank + 1]] - rank * rows
    selected = _GatherCounted.apply(hidden_TH.index_select(0, mine), counts, group)
    targets_N = targets.flatten().index_select(0, hidden_index + 1)
    index = torch.arange(targets_N.shape[0], device=hidden_index.device)
    return selected, torch.cat([targets_N[:1], targets_N]), index
