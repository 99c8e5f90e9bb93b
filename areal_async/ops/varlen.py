"""Variable-length (packed-row) attention kernels and the choice between them.

A packed row holds several sequences back to back, each attending causally to itself only, with
int32 bounds `cu_seqlens` (0, the end of each sequence). `causal_varlen_attn` runs
`torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 varlen, CUDA, 16-bit) whatever its keyword
spelling in this torch release, `causal_varlen_attn_qk` the same with separate query and key bounds
(context parallelism's pieces), `sdpa_per_sequence` the exact reference everywhere else.
`pick_attention_kernel` chooses between FlashAttention and this project's Triton kernels
(`ops/attention_triton.py`); `ATTN_IMPLEMENTATIONS` names the transformers plug-in of each
(registered by `training/attention.py`).
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

import torch
import torch.nn.functional as F

from areal_async.ops import attention_triton, triton_support

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
