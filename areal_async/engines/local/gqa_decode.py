"""Packed GQA decode: an sdpa attention plug-in for the local engine's "slots" KV layout.

`packed_gqa_sdpa`, registered in transformers' `AttentionInterface` as `PACKED_GQA_SDPA` with
transformers' sdpa mask (on import), is what the slots layout gives a grouped-query sdpa model. A
one-token query runs with its query heads grouped under their K/V head, so the K/V heads are never
repeated per query head; every other call goes to transformers' sdpa unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_GQA_SDPA = "areal_packed_gqa_sdpa"
"""Attention implementation name a slots engine gives a GQA model that uses sdpa."""


def packed_gqa_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """sdpa attention; a one-token query of a GQA layer runs on the K/V heads without repeating them.

    Query head h attends with K/V head h // groups (transformers' `repeat_kv` order), so the query
    [B, heads, 1, D] is viewed as [B, kv_heads, groups, D]: each K/V head answers its `groups` query
    heads as a `groups`-long query, and the mask [B, 1, 1, span] broadcasts over them. Anything else
    (prefill, no GQA, extra options) goes to transformers' sdpa unchanged.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_length, dim = query.shape
    if q_length != 1 or groups == 1 or dropout or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    grouped = query.reshape(batch, heads // groups, groups, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(batch, 1, heads, dim), None


AttentionInterface.register(PACKED_GQA_SDPA, packed_gqa_sdpa)
AttentionMaskInterface.register(PACKED_GQA_SDPA, sdpa_mask)
