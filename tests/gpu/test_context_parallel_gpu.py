"""Context-parallel attention on CUDA: the fused varlen call over a rank's pieces (FlashAttention-2
with separate query and key bounds, bottom-right causal) matches piece-by-piece SDPA in float32."""

from __future__ import annotations

import pytest
import torch

from areal_async.ops.varlen import causal_varlen_attn_qk, varlen_available
from areal_async.training.context_parallel import attend_gathered
from tests.helpers.context_parts import padded_rows, parts_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("size", [1, 2, 4])
def test_fused_pieces_match_float32_sdpa(size: int) -> None:
    """Every rank's bf16 output and gradients through the fused call are within bf16 noise of the
    float32 piece-by-piece attention; the sequences cross chunk edges at every size."""
    assert varlen_available(torch.device("cuda"), torch.bfloat16)
    torch.manual_seed(0)
    lengths = [700, 33, 1210, 5, 400, 1]
    parts = parts_of(lengths, size, "cuda")
    q_row = torch.randn(sum(lengths), 14, 64, device="cuda")
    kv_row = torch.randn(sum(lengths), 2, 128, device="cuda")
    q_row, kv_row = padded_rows(parts[0], q_row, kv_row)
    for part in parts:
        mine = part.tokens()
        results = []
        for dtype, kernel in ((torch.float32, None), (torch.bfloat16, causal_varlen_attn_qk)):
            query = q_row[mine].to(dtype).requires_grad_()
            kv = kv_row[part.gathered].to(dtype).requires_grad_()
            out = attend_gathered(query, kv, part, 0.125, kernel)
            out.float().pow(2).sum().backward()
            results.append([t.float() for t in (out, query.grad, kv.grad)])
        for want, got in zip(*results, strict=True):
            err = (got - want).abs().mean() / want.abs().mean()
            assert err < 2e-2, f"rank {part.rank} of {size}: relative error {err:.3g}"
