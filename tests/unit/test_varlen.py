"""Packed-row attention on CPU: exact per-sequence causal SDPA, and refusals for what it cannot do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from areal_async.ops.varlen import ATTN_IMPLEMENTATIONS
from areal_async.training.attention import packed_attention_forward


def _inputs(lengths: list[int], heads: int = 4, kv_heads: int = 2, dim: int = 8):
    torch.manual_seed(0)
    n = sum(lengths)
    q = torch.randn(1, heads, n, dim)
    k, v = torch.randn(1, kv_heads, n, dim), torch.randn(1, kv_heads, n, dim)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, {"cu_seq_lens_q": cu, "max_length_q": max(lengths)}


@pytest.mark.parametrize("kernel", sorted(ATTN_IMPLEMENTATIONS))
def test_each_sequence_attends_causally_to_itself_only(kernel: str) -> None:
    """The packed row's output equals causal attention run on every sequence alone (K/V heads
    repeated), whichever CUDA kernel the name stands for: CPU runs SDPA per sequence."""
    lengths = [3, 1, 6]
    q, k, v, kw = _inputs(lengths)
    out, weights = packed_attention_forward(nn.Module(), q, k, v, None, scaling=0.5, kernel=kernel, **kw)
    assert weights is None and out.shape == (1, sum(lengths), 4, 8)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        want = F.scaled_dot_product_attention(
            q[:, :, part], k[:, :, part].repeat_interleave(2, 1), v[:, :, part].repeat_interleave(2, 1),
            is_causal=True, scale=0.5,
        )  # fmt: skip
        torch.testing.assert_close(out[:, part], want.transpose(1, 2))
        start += n


def test_features_it_does_not_compute_are_refused_by_name() -> None:
    q, k, v, kw = _inputs([4, 4])
    layer = nn.Module()
    cases = [
        ({"sliding_window": 4096}, "sliding-window attention"),
        ({"dropout": 0.1}, "attention dropout"),
        ({"softcap": 50.0}, "logit soft-capping"),
        ({"s_aux": torch.zeros(4)}, "attention sinks"),
    ]
    for extra, feature in cases:
        with pytest.raises(ValueError, match=rf"uses {feature}.*packed=False"):
            packed_attention_forward(layer, q, k, v, None, **(kw | extra))
    layer.is_causal = False
    with pytest.raises(ValueError, match="uses non-causal attention"):
        packed_attention_forward(layer, q, k, v, None, **kw)
    with pytest.raises(ValueError, match="needs one packed row and cu_seq_lens_q"):
        packed_attention_forward(nn.Module(), q, k, v, None)
