"""The Triton packed-attention kernels on CUDA agree with a float64 reference, as closely as
FlashAttention-2 varlen does, in the output and in all three gradients; compiled and eager alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from areal_async.ops import attention_triton
from areal_async.ops.varlen import causal_varlen_attn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# Lengths on and around the block edges (64, 128), a single token, and a 2,048-token sequence.
LENGTHS = [1, 63, 64, 65, 127, 128, 129, 300, 17, 2048, 1000, 2]


def reference(q, k, v, lengths, scale):  # type: ignore[no-untyped-def]
    """Causal SDPA per sequence in float64, K/V heads repeated to the query heads."""
    groups = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n].transpose(0, 1).double() for t in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(outs)


def run(fn, q, k, v, cu, longest, scale, grad):  # type: ignore[no-untyped-def]
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves, cu, longest, scale)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def rel_errors(got, want):  # type: ignore[no-untyped-def]
    return [float((a.double() - b).norm() / b.norm()) for a, b in zip(got, want, strict=True)]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (28, 4, 128), (8, 8, 32)])
def test_triton_matches_float64_as_closely_as_flash_attention(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(heads)
    n = sum(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(n, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(q)
    scale = 0.9 / head_dim**0.5
    leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    want_out = reference(*leaves, LENGTHS, scale)
    want_out.backward(grad.double())
    want = [want_out.detach()] + [t.grad for t in leaves]
    triton_err = rel_errors(
        run(attention_triton.varlen_attention, q, k, v, cu, max(LENGTHS), scale, grad), want
    )
    flash_err = rel_errors(run(causal_varlen_attn, q, k, v, cu, max(LENGTHS), scale, grad), want)
    for name, t_err, f_err in zip(["out", "dq", "dk", "dv"], triton_err, flash_err, strict=True):
        assert t_err < 1e-2, (name, t_err)
        assert t_err <= 1.5 * f_err + 1e-4, (name, t_err, f_err)


def test_every_row_is_written_and_a_longer_max_length_changes_nothing() -> None:
    """Outputs and gradients land on every token (NaN-poisoned buffers would show), and passing a
    max_length above the longest sequence (extra, empty programs) gives the same bits."""
    torch.manual_seed(1)
    lengths = [5, 200, 77]
    n = sum(lengths)
    cu = torch.tensor([0, 5, 205, 282], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(n, h, 64, device="cuda", dtype=torch.bfloat16) for h in (6, 3, 3))
    grad = torch.randn_like(q)
    a = run(attention_triton.varlen_attention, q, k, v, cu, 200, None, grad)
    b = run(attention_triton.varlen_attention, q, k, v, cu, 1024, None, grad)
    for x, y in zip(a, b, strict=True):
        assert torch.isfinite(x).all()
        assert torch.equal(x, y)


def test_compiled_caller_gets_the_eager_result() -> None:
    """Under torch.compile the kernels are one opaque custom op: same output and gradients."""
    torch.manual_seed(2)
    lengths = [300, 129, 1]
    cu = torch.tensor([0, 300, 429, 430], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(430, h, 64, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    grad = torch.randn_like(q)

    def block(q, k, v, cu, longest, scale):  # type: ignore[no-untyped-def]
        return attention_triton.varlen_attention(q * 1.5, k, v, cu, longest, scale) * 2.0

    eager = run(block, q, k, v, cu, max(lengths), None, grad)
    compiled = run(torch.compile(block, fullgraph=True), q, k, v, cu, max(lengths), None, grad)
    for x, y in zip(eager, compiled, strict=True):
        torch.testing.assert_close(y, x, atol=2e-2, rtol=2e-2)


def test_bad_inputs_are_refused_with_the_reason() -> None:
    q = torch.randn(10, 6, 64, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(10, 4, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 10], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="multiple of K/V heads"):
        attention_triton.varlen_attention(q, kv, kv, cu, 10)
    with pytest.raises(ValueError, match="int32"):
        attention_triton.varlen_attention(q, q, q, cu.long(), 10)
    odd = torch.randn(10, 2, 48, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim 48"):
        attention_triton.varlen_attention(odd, odd, odd, cu, 10)
