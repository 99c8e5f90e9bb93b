"""Context-parallel attention on one rank's part of a packed row, after the keys are gathered: the
pieces (a sequence's tokens within one chunk) attend as the whole row would, whether they run piece
by piece (SDPA) or as one varlen call laid out by `ContextPart.varlen_layout`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from areal_async.ops.varlen import sdpa_per_sequence
from areal_async.training.context_parallel import attend_gathered
from tests.helpers.context_parts import padded_rows, parts_of

LENGTHS = [5, 1, 13, 2, 9]  # 30 tokens: pieces start inside sequences at every size below
HEADS, KV_HEADS, DIM, SCALE = 4, 2, 8, 0.4


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):  # noqa: ANN001, ANN201
    """Varlen attention as the fused kernels define it: query block i attends to key block i,
    causal, aligned at the bottom right (query j of Lq sees keys up to j + Lk - Lq)."""
    outs = []
    for i in range(cu_q.shape[0] - 1):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        lq, lk = qs.stop - qs.start, ks.stop - ks.start
        assert lq <= max_q and lk <= max_k
        mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + lk - lq
        out = F.scaled_dot_product_attention(
            q[qs].transpose(0, 1), k[ks].transpose(0, 1), v[ks].transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )  # fmt: skip
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_ranks_pieces_attend_as_the_whole_row(size: int) -> None:
    """Each rank's queries, attending to the gathered keys, give the whole row's causal attention at
    its tokens, piece by piece and as one varlen call; both give the same gradients."""
    torch.manual_seed(0)
    parts = parts_of(LENGTHS, size)
    n = sum(LENGTHS)
    q_row = torch.randn(n, HEADS, DIM)
    kv_row = torch.randn(n, KV_HEADS, 2 * DIM)
    q_row, kv_row = padded_rows(parts[0], q_row, kv_row)
    bounds = parts[0].bounds
    whole = sdpa_per_sequence(
        q_row.transpose(0, 1)[None], *(t.transpose(0, 1)[None] for t in (kv_row[..., :DIM], kv_row[..., DIM:])),
        bounds, SCALE,
    )  # fmt: skip
    assert sum(len(p.pieces) for p in parts) >= len(LENGTHS) + 1
    for part in parts:
        mine = part.tokens()
        grads = []
        for varlen in (None, reference_varlen):
            query = q_row[mine].clone().requires_grad_()
            kv = kv_row[part.gathered].clone().requires_grad_()
            out = attend_gathered(query, kv, part, SCALE, varlen)
            torch.testing.assert_close(out, whole[mine])
            out.pow(2).sum().backward()
            grads.append((query.grad, kv.grad))
        torch.testing.assert_close(grads[0], grads[1])


def test_the_varlen_layout_has_one_block_per_piece() -> None:
    """Block i's queries are piece i's tokens and its keys run from the piece's sequence start to
    the piece's end."""
    part = parts_of(LENGTHS, 2)[1]
    keys, cu_q, cu_k, max_q, max_k = part.varlen_layout
    spans = [(q1 - q0, q1 - a) for a, q0, q1 in part.pieces]
    assert cu_q.dtype == cu_k.dtype == torch.int32
    assert cu_q.diff().tolist() == [s[0] for s in spans] and cu_k.diff().tolist() == [s[1] for s in spans]
    assert (max_q, max_k) == (max(s[0] for s in spans), max(s[1] for s in spans))
    row_of_key = part.gathered[keys]
    want = torch.cat([torch.arange(a, q1) for a, _, q1 in part.pieces])
    assert torch.equal(row_of_key, want)
