"""The modules the Megatron backend adds to megatron-core's GPT model: packed causal attention with
the model's own rotary embedding, and the token-logprob root module (`training/megatron/engine.py` builds them).

`PackedCoreAttention` replaces the `core_attention` of megatron-core's pure-PyTorch layer spec
(whose attention does not take packed sequences). It receives q `[t, heads, d]` and grouped k/v
`[t, kv_heads, d]` of one packed row (`qkv_format="thd"`), applies the Hugging Face rotary
embedding of the model (cos/sin computed once per micro-batch from the position ids, so every
`rope_scaling` the HF model supports is applied exactly as the engines apply it), and attends
causally within each sequence: the project's Triton kernels or FlashAttention-2 varlen on CUDA
in 16 bits (`ops/varlen.py`), SDPA per sequence elsewhere; under context parallelism each rank
holds a part of the row and attends to the group's gathered keys (`training/context_parallel.py`).
Megatron-core's own RoPE is off (`position_embedding_type="none"`); it also needs CUDA.

`MegatronLogprobModel` follows the training loop's model contract (`training/loop.py`):
embedding -> decoder (with the final norm) -> hidden states of the selected rows -> logprob and
entropy of their targets, `chunk_tokens` rows at a time. With pipeline stages, `stage_forward` runs
one model chunk of the stage (a stage holds several when stages are interleaved;
`training/megatron/pipeline.py` passes the hidden states between them). With one tensor-parallel rank the head
runs the trainer's logprob kernels (`ops/logprobs.py`); with several, each rank holds a slice
of the vocabulary and `vocab_parallel_logprobs` combines the slices. Under context parallelism
each rank computes the logprobs of the selected rows in its part and returns the group's, gathered.
Under sequence parallelism (`training/megatron/sequence_parallel.py`) the row is padded to split evenly, each
tensor-parallel rank embeds into and holds its block of the row's hidden states, and the head
gathers the selected rows of every block.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from areal_async.ops import attention_triton, logprobs, varlen
from areal_async.training.context_parallel import (
    ContextPart,
    attend,
    gather_logprobs,
    local_tokens,
    pad_row,
    padded_tokens,
)
from areal_async.training.megatron import sequence_parallel


def hf_rotary_embedding(hf_config: Any, architecture: str) -> nn.Module:
    """The HF model family's rotary embedding module for `hf_config` (cos/sin from position ids)."""
    family = architecture.removesuffix("ForCausalLM")  # Llama, Qwen2, Qwen3
    module = importlib.import_module(f"transformers.models.{family.lower()}.modeling_{family.lower()}")
    return getattr(module, f"{family}RotaryEmbedding")(config=hf_config)


try:
    from megatron.core.packed_seq_params import PackedSeqParams as _PackedSeqParams
except ImportError:  # the classes below are only built with megatron-core installed
    _PackedSeqParams = object  # type: ignore[assignment,misc]


@dataclass
class RotaryPackedParams(_PackedSeqParams):  # type: ignore[misc,valid-type]
    """megatron-core's `PackedSeqParams` (THD) plus the micro-batch's rotary cos/sin `[t, d]` and
    the CUDA attention kernel; megatron hands it unchanged to every layer's core attention."""

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    kernel: str = "flash"
    context: ContextPart | None = None
    """This rank's part of the row under context parallelism (`training/context_parallel.py`)."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class PackedCoreAttention(nn.Module):
    """`core_attention` of megatron-core's attention layer for packed rows; see the module docstring."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: Any, **kw: Any):
        super().__init__()
        self.scale: float | None = kw.get("softmax_scale")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: RotaryPackedParams | None = None,
    ) -> torch.Tensor:
        p = packed_seq_params
        if p is None or p.cos is None or query.dim() != 3:
            raise ValueError("PackedCoreAttention needs packed rows (MegatronLogprobModel builds them)")
        cos, sin = p.cos.unsqueeze(1), p.sin.unsqueeze(1)  # [t, 1, d]
        query = query * cos + _rotate_half(query) * sin
        key = key * cos + _rotate_half(key) * sin
        device = query.device.type
        if torch.is_autocast_enabled(device):  # float32 cos/sin promote q and k; attend in 16 bits
            dtype = torch.get_autocast_dtype(device)
            query, key, value = (t.to(dtype) for t in (query, key, value))
        fused = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
        if p.context is not None:
            out = attend(
                query, key, value, p.context, self.scale, varlen.causal_varlen_attn_qk if fused else None
            )
        elif fused:
            kernel = attention_triton.varlen_attention if p.kernel == "triton" else varlen.causal_varlen_attn
            out = kernel(query, key, value, p.cu_seqlens_q, p.max_seqlen_q, self.scale)
        else:
            q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
            out = varlen.sdpa_per_sequence(q, k, v, p.cu_seqlens_q.tolist(), self.scale)
        return out.reshape(out.shape[0], -1)


def vocab_parallel_logprobs(
    hidden_NH: torch.Tensor,
    targets_N: torch.Tensor,
    head: nn.Module,
    temperature: float,
    with_entropy: bool,
    rows_gathered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logprobs.LogprobFn` over a vocabulary split across the tensor-parallel group: `head` gives
    this rank's logits slice; float32 logprob (with grad) and entropy (no grad) of the whole vocab.
    The rows' gradients are summed over the group here, or, with `rows_gathered` (sequence
    parallelism), by the backward of `sequence_parallel.gather_selected`, which gathered them."""
    from megatron.core import parallel_state, tensor_parallel

    group = parallel_state.get_tensor_model_parallel_group()
    if not rows_gathered:
        hidden_NH = tensor_parallel.copy_to_tensor_model_parallel_region(hidden_NH)
    logits = logprobs.scale_logits(head(hidden_NH), temperature)
    entropy = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    if with_entropy:
        with torch.no_grad():
            top = logits.max(dim=-1).values
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            shifted = logits - top[:, None]
            exp = shifted.exp()
            total = exp.sum(-1)
            weighted = (exp * shifted).sum(-1)
            sums = torch.stack([total, weighted])
            dist.all_reduce(sums, group=group)
            entropy = sums[0].log() - sums[1] / sums[0]
    # megatron's cross entropy works on its input in place: hand it its own copy.
    return -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), targets_N), entropy


class _Head(nn.Module):
    """The output projection as a callable module: `hidden @ weight.T` (weight shared when tied)."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self._gpt = [gpt]  # not a submodule: the weight belongs to the GPT model

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gpt = self._gpt[0]
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
        return F.linear(hidden, weight if weight is not None else gpt.output_layer.weight)


class MegatronLogprobModel(nn.Module):
    """Root module of the Megatron backend; the training loop's model contract (module docstring)."""

    def __init__(
        self,
        chunks: list[nn.Module],
        rotary: nn.Module,
        *,
        temperature: float,
        chunk_tokens: int,
        logprob_fn: logprobs.LogprobFn,
        attention_kernel: str,
        context_group: Any = None,
        sequence_group: Any = None,
        pad_token_id: int = 0,
    ) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        """This stage's GPT model chunks (one unless pipeline stages are interleaved)."""
        self.rotary = rotary
        self.head = _Head(chunks[-1])
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens
        self.logprob_fn = logprob_fn
        self.attention_kernel = attention_kernel
        self.context_group = context_group
        """The context-parallel group (None: every rank holds whole rows)."""
        self.context_size = dist.get_world_size(context_group) if context_group is not None else 1
        self.sequence_group = sequence_group
        """The tensor-parallel group under sequence parallelism (None: every rank holds all tokens)."""
        self.sequence_size = dist.get_world_size(sequence_group) if sequence_group is not None else 1
        self.pad_multiple = sequence_parallel.pad_multiple(self.sequence_size, self.context_size)
        self.pad_token_id = pad_token_id

    def stage_tokens(self, tokens: int) -> int:
        """Rows of a stage's hidden states `[rows, 1, h]` for a packed row of `tokens`."""
        if self.sequence_group is not None:
            tokens = padded_tokens(tokens, self.pad_multiple)
        if self.context_size > 1:
            tokens = local_tokens(tokens, self.context_size)
        return tokens // self.sequence_size

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        hidden_index: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_length: int = 0,
        with_entropy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.stage_forward(input_ids, position_ids, hidden_index, cu_seqlens, max_length, with_entropy)
        assert isinstance(out, tuple), "a model without pipeline stages returns logprobs"
        return out

    def stage_forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        hidden_index: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        max_length: int,
        with_entropy: bool,
        stage_input: torch.Tensor | None = None,
        chunk: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """Model chunk `chunk` of this pipeline stage: the first (chunk 0 of stage 0) embeds
        `input_ids`, a later one starts from `stage_input` (the previous one's output `[t, 1, h]`);
        the last returns logprobs and entropy, the others their hidden states."""
        if cu_seqlens is None or input_ids.shape[0] != 1:
            raise ValueError(
                "the Megatron backend trains packed rows only (batching.model_inputs(packed=True))"
            )
        gpt = self.chunks[chunk]
        sequence_group = self.sequence_group
        if sequence_group is not None:
            input_ids, position_ids, cu_seqlens, pad = pad_row(
                input_ids, position_ids, cu_seqlens, self.pad_multiple, self.pad_token_id
            )
            max_length = max(max_length, pad)
        part, targets = None, input_ids
        if self.context_group is not None:
            part, input_ids, position_ids, hidden_index, targets = ContextPart.of(
                self.context_group, input_ids, position_ids, hidden_index, cu_seqlens, self.pad_token_id
            )
        if gpt.pre_process and sequence_group is not None:
            hidden = sequence_parallel.embed(gpt.embedding, input_ids, sequence_group)  # [t / T, 1, h]
        elif gpt.pre_process:
            hidden = gpt.embedding(input_ids=input_ids, position_ids=position_ids)  # [t, 1, h]
        elif stage_input is None:
            raise ValueError("a pipeline stage after the first needs the previous stage's output")
        else:
            hidden = stage_input
            gpt.decoder.set_input_tensor(stage_input)
        with torch.autocast(input_ids.device.type, enabled=False):
            cos, sin = self.rotary(hidden.float().transpose(0, 1), position_ids)
        params = RotaryPackedParams(
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=max_length,
            max_seqlen_kv=max_length,
            cos=cos[0],
            sin=sin[0],
            kernel=self.attention_kernel,
            context=part,
        )
        hidden = gpt.decoder(hidden_states=hidden, attention_mask=None, packed_seq_params=params)
        if not gpt.post_process:
            return hidden
        hidden_TH = hidden.squeeze(1)
        if sequence_group is not None:
            hidden_TH, targets, hidden_index = sequence_parallel.gather_selected(
                hidden_TH, hidden_index, targets, sequence_group
            )
        logprobs_N, entropy_N = logprobs.of_selected(
            self.logprob_fn,
            hidden_TH,
            targets,
            hidden_index,
            self.head,
            self.temperature,
            with_entropy,
            self.chunk_tokens,
        )
        if part is None:
            return logprobs_N, entropy_N
        return gather_logprobs(part, logprobs_N, entropy_N)
