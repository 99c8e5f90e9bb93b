"""Packed-row attention for the training engines, registered in transformers' `AttentionInterface`.

Packed rows: several sequences in one row, each attending causally to itself only. The training
engine can pack a micro-batch into one row `[1, N]` without padding, with position ids that
restart at 0 for every sequence, and call the decoder with the keyword arguments transformers
hands down to the attention function of every layer:
`cu_seq_lens_q` / `cu_seq_lens_k` (int32 `[S + 1]`: 0, the end of each sequence in the row)
and `max_length_q` / `max_length_k` (the longest sequence).

`packed_attention_forward` is registered on import twice, one name per CUDA kernel
(`ops.varlen.ATTN_IMPLEMENTATIONS`): `areal_packed` runs `torch.nn.attention.varlen.varlen_attn`
(FlashAttention-2 varlen kernels, causal) and `areal_packed_triton` this project's Triton kernels
(`ops/attention_triton.py`); both read grouped K/V heads in place, not repeated. Elsewhere
(CPU, float32) either runs causal SDPA on each sequence in turn: exact, one call per sequence.
Under autocast q, k and v are cast to the autocast dtype first, as SDPA would. No mask function
is registered under the names, so transformers builds no attention mask for them. A context-parallel
rank's part of a row (`context_part`) goes to `training/context_parallel.py`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface

from areal_async.ops import attention_triton
from areal_async.ops.varlen import (
    ATTN_IMPLEMENTATIONS,
    AttentionKernel,
    causal_varlen_attn,
    causal_varlen_attn_qk,
    sdpa_per_sequence,
)
from areal_async.training import context_parallel


def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    *,
    kernel: AttentionKernel = "flash",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence: `[1, heads, N, D]` in, `[1, N, heads, D]` out."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None or query.shape[0] != 1:
        raise ValueError(
            f"attn_implementation {ATTN_IMPLEMENTATIONS[kernel]!r} needs one packed row and cu_seq_lens_q; "
            "call the decoder with packed inputs (batching.model_inputs(..., packed=True))"
        )
    unsupported = {
        "sliding-window attention": sliding_window is not None,
        "attention dropout": dropout != 0.0,
        "logit soft-capping (softcap)": kwargs.get("softcap") is not None,
        "attention sinks (s_aux)": kwargs.get("s_aux") is not None,
        "non-causal attention": not getattr(module, "is_causal", True),
    }
    if any(unsupported.values()):
        features = ", ".join(name for name, used in unsupported.items() if used)
        raise ValueError(
            f"{ATTN_IMPLEMENTATIONS[kernel]!r} computes plain causal attention; this model's layer uses "
            f"{features}. Train it with padded rows (FSDPTrainEngine(packed=False))"
        )
    device = query.device.type
    if torch.is_autocast_enabled(device):
        # A custom op escapes autocast, and rotary embeddings in float32 promote q and k to it.
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    q_NHD, k_NHD, v_NHD = (t[0].transpose(0, 1) for t in (query, key, value))
    part = kwargs.get("context_part")
    fused = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
    if part is not None:  # this rank's part of the row (training/context_parallel.py)
        pieces = causal_varlen_attn_qk if fused else None
        out_NHD = context_parallel.attend(q_NHD, k_NHD, v_NHD, part, scaling, pieces)
    elif fused:
        attend = attention_triton.varlen_attention if kernel == "triton" else causal_varlen_attn
        out_NHD = attend(q_NHD, k_NHD, v_NHD, cu_seqlens, kwargs["max_length_q"], scaling)
    else:
        out_NHD = sdpa_per_sequence(query, key, value, cu_seqlens.tolist(), scaling)
    return out_NHD.unsqueeze(0), None


for _kernel, _name in ATTN_IMPLEMENTATIONS.items():
    AttentionInterface.register(_name, functools.partial(packed_attention_forward, kernel=_kernel))
