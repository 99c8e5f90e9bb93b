"""Attention plug-ins registered in transformers' `AttentionInterface`: packed rows, packed GQA decode.

Packed rows: several sequences in one row, each attending causally to itself only. The training
engine can pack a micro-batch into one row `[1, N]` without padding, with position ids that
restart at 0 for every sequence, and call the decoder with the keyword arguments transformers
hands down to the attention function of every layer:
`cu_seq_lens_q` / `cu_seq_lens_k` (int32 `[S + 1]`: 0, the end of each sequence in the row)
and `max_length_q` / `max_length_k` (the longest sequence).

`packed_attention_forward` is registered in transformers' `AttentionInterface` twice, one name
per CUDA kernel (`ATTN_IMPLEMENTATIONS`): `areal_packed` runs `torch.nn.attention.varlen.varlen_attn`
(FlashAttention-2 varlen kernels, causal) and `areal_packed_triton` this project's Triton kernels
(`engines/attention_triton.py`); both read grouped K/V heads in place, not repeated. Elsewhere
(CPU, float32) either runs causal SDPA on each sequence in turn: exact, one call per sequence.
Under autocast q, k and v are cast to the autocast dtype first, as SDPA would. No mask function
is registered under the names, so transformers builds no attention mask for them.

Packed GQA decode: `packed_gqa_sdpa`, registered as `PACKED_GQA_SDPA` with transformers' sdpa
mask, is what the local engine's "slots" KV layout gives a grouped-query sdpa model. A one-token
query runs with its query heads grouped under their K/V head, so the K/V heads are never repeated
per query head; every other call goes to transformers' sdpa unchanged.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from areal_async.engines import attention_triton, context_parallel, triton_support

AttentionKernel = Literal["flash", "triton"]

ATTN_IMPLEMENTATIONS: dict[AttentionKernel, str] = {"flash": "areal_packed", "triton": "areal_packed_triton"}
"""`attn_implementation` name of `packed_attention_forward` for each CUDA kernel."""


def varlen_available(device: torch.device, dtype: torch.dtype | None) -> bool:
    """True where packed rows run on a fused varlen kernel: CUDA with `torch.nn.attention.varlen`,
    attention in 16 bits (`dtype`: the autocast dtype; None: float32)."""
    fp16 = dtype in (torch.float16, torch.bfloat16)
    return device.type == "cuda" and fp16 and _VARLEN_KWARGS is not None


def pick_attention_kernel(device: torch.device, kernel: str, head_dim: int) -> AttentionKernel:
    """The packed-attention kernel for `kernel` (`auto`, `flash` or `triton`) on `device`.

    `auto` is `triton` where it runs (CUDA, importable Triton) for the head sizes its launch
    shapes were tuned for (`attention_triton.TUNED_HEAD_DIMS`), else `flash`. `triton` needs a
    CUDA device, Triton and a supported head size; asking for it without them raises a
    ValueError that says what is missing (CPU packed rows run SDPA per sequence anyway)."""
    if kernel not in ("auto", "flash", "triton"):
        raise ValueError(f"attention_kernel must be 'auto', 'flash' or 'triton', got {kernel!r}")
    if kernel == "triton":
        triton_support.require_triton(device, "attention_kernel", "flash")
        if head_dim not in attention_triton.HEAD_DIMS:
            raise ValueError(
                f"attention_kernel='triton' supports head_dim {sorted(attention_triton.HEAD_DIMS)}, the model "
                f"has {head_dim}; set trainer.attention_kernel=auto (or flash)"
            )
        return "triton"
    tuned = head_dim in attention_triton.TUNED_HEAD_DIMS
    return "triton" if kernel == "auto" and tuned and triton_support.triton_available(device) else "flash"


def _varlen_kwargs() -> dict[str, Any] | None:
    """Keyword arguments that make `varlen_attn` causal and accept grouped K/V heads: its signature
    moved between torch releases. None without a usable `varlen_attn`."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}  # older releases: always on
    if "window_size" in params:
        return {"window_size": (-1, 0), **gqa}
    if "is_causal" in params:
        return {"is_causal": True, **gqa}
    return None


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
    if part is not None:  # this rank's part of the row (engines/context_parallel.py)
        pieces = causal_varlen_attn_qk if fused else None
        out_NHD = context_parallel.attend(q_NHD, k_NHD, v_NHD, part, scaling, pieces)
    elif fused:
        attend = attention_triton.varlen_attention if kernel == "triton" else causal_varlen_attn
        out_NHD = attend(q_NHD, k_NHD, v_NHD, cu_seqlens, kwargs["max_length_q"], scaling)
    else:
        out_NHD = sdpa_per_sequence(query, key, value, cu_seqlens.tolist(), scaling)
    return out_NHD.unsqueeze(0), None


def causal_varlen_attn(
    q_NHD: torch.Tensor,
    k_NHD: torch.Tensor,
    v_NHD: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_length: int,
    scale: float | None = None,
) -> torch.Tensor:
    """`varlen_attn`, causal within each sequence of a packed row (`[N, heads, D]`, grouped K/V heads
    read in place), whatever its keyword spelling in this torch release; CUDA, 16-bit inputs."""
    return causal_varlen_attn_qk(q_NHD, k_NHD, v_NHD, cu_seqlens, cu_seqlens, max_length, max_length, scale)


def causal_varlen_attn_qk(
    q_NHD: torch.Tensor,
    k_NHD: torch.Tensor,
    v_NHD: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float | None = None,
) -> torch.Tensor:
    """`causal_varlen_attn` with separate query and key bounds: query block i attends to key block i,
    causally aligned at the bottom right (its last query sees every key; context parallelism's pieces)."""
    from torch.nn.attention.varlen import varlen_attn

    causal = _VARLEN_KWARGS
    assert causal is not None, "torch.nn.attention.varlen.varlen_attn is missing"
    q, k, v = (t.contiguous() for t in (q_NHD, k_NHD, v_NHD))
    return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale=scale, **causal)


def sdpa_per_sequence(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int], scaling: float | None
) -> torch.Tensor:
    """Reference path: causal SDPA on each `[start, end)` slice of the row; `[N, heads, D]`."""
    gqa = key.shape[1] != query.shape[1]
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scaling, enable_gqa=gqa
        )
        for s, e in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(outs, dim=2)[0].transpose(0, 1)


_VARLEN_KWARGS = _varlen_kwargs()  # resolved once, outside any torch.compile'd layer
for _kernel, _name in ATTN_IMPLEMENTATIONS.items():
    AttentionInterface.register(_name, functools.partial(packed_attention_forward, kernel=_kernel))


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
