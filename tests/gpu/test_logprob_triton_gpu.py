"""The Triton logprob kernels agree with the eager log-softmax form on CUDA."""

from __future__ import annotations

import pytest
import torch

from areal_async.ops import logprob_triton
from areal_async.ops.logprobs import fused_token_logprobs, pick_logprob_fn, token_logprobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def results(form, hidden, targets, head, temperature, upstream):  # type: ignore[no-untyped-def]
    lp, ent = form(hidden, targets, head, temperature, True)
    grads = torch.autograd.grad((lp * upstream).sum(), [hidden, head.weight])
    return lp.detach(), ent, *grads


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("vocab", [50, logprob_triton.FORWARD_BLOCK * 2 + 13, 151_936])
def test_fused_kernels_match_the_log_softmax_form(vocab: int, temperature: float) -> None:
    """Logprobs, entropy and the gradients reaching hidden states and head agree for float32 logits,
    for vocabularies smaller than one block, not a multiple of a block, and Qwen2's, with a
    near-certain row and uneven upstream gradients."""
    torch.manual_seed(0)
    head = torch.nn.Linear(32, vocab, bias=False, device="cuda")
    hidden = torch.randn(37, 32, device="cuda")
    hidden[3] = head.weight[11].detach() * 200.0  # row 3: target 11 is near-certain
    hidden.requires_grad_(True)
    targets = torch.randint(0, vocab, (37,), device="cuda")
    targets[3] = 11
    upstream = torch.randn(37, device="cuda")
    expected = results(token_logprobs, hidden, targets, head, temperature, upstream)
    got = results(fused_token_logprobs, hidden, targets, head, temperature, upstream)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)
    assert got[0][3] > -1e-2, "row 3 was meant to be near-certain"


def test_fused_kernels_on_bf16_logits_write_a_bf16_gradient() -> None:
    """Under autocast the head gives bf16 logits: the kernels read them as float32 values and write
    the logits' gradient in bf16, matching the eager form computed from the same bf16 logits."""
    torch.manual_seed(1)
    head = torch.nn.Linear(64, 3000, bias=False, device="cuda")
    hidden = torch.randn(200, 64, device="cuda", requires_grad=True)
    targets = torch.randint(0, 3000, (200,), device="cuda")
    upstream = torch.randn(200, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = head(hidden)
    assert logits.dtype == torch.bfloat16
    leaf = logits.detach().requires_grad_(True)
    lp, ent = logprob_triton.target_logprob(leaf, targets, 1.0, True)
    (grad,) = torch.autograd.grad((lp * upstream).sum(), [leaf])
    assert grad.dtype == torch.bfloat16 and lp.dtype == ent.dtype == torch.float32
    ref_leaf = logits.detach().float().requires_grad_(True)
    ref_lp = torch.log_softmax(ref_leaf, -1).gather(-1, targets[:, None]).squeeze(-1)
    (ref_grad,) = torch.autograd.grad((ref_lp * upstream).sum(), [ref_leaf])
    ref_ent = -(torch.softmax(ref_leaf, -1) * torch.log_softmax(ref_leaf, -1)).sum(-1)
    torch.testing.assert_close(lp, ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad.float(), ref_grad, rtol=1e-2, atol=1e-4)


def test_without_entropy_the_entropy_is_zero_and_the_engine_picks_the_kernels() -> None:
    head = torch.nn.Linear(8, 100, bias=False, device="cuda")
    hidden, targets = torch.randn(5, 8, device="cuda"), torch.randint(0, 100, (5,), device="cuda")
    lp, ent = fused_token_logprobs(hidden, targets, head, 1.0, False)
    assert (ent == 0).all() and (lp < 0).all()
    assert pick_logprob_fn(torch.device("cuda"), compile=True) is fused_token_logprobs
    with pytest.raises(ValueError, match=r"logits must be \[N, V\]"):
        logprob_triton.target_logprob(torch.zeros(2, 3, 4, device="cuda"), targets[:2], 1.0, True)
