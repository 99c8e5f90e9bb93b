"""The two token-logprob forms of the training engine agree (values, entropy and gradients)."""

from __future__ import annotations

import torch

from areal_async.engines.fsdp import _token_logprobs, _token_logprobs_lse


def test_logsumexp_form_matches_log_softmax_form() -> None:
    """logit[target] - logsumexp (used under torch.compile) equals the log-softmax form, with
    temperature, for logprobs, entropy and the gradient reaching the hidden states."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(7, 16, requires_grad=True)
    targets = torch.randint(0, 50, (7,))
    lp_a, ent_a = _token_logprobs(hidden, targets, head, 0.7, True)
    (grad_a,) = torch.autograd.grad(lp_a.sum(), hidden)
    lp_b, ent_b = _token_logprobs_lse(hidden, targets, head, 0.7, True)
    (grad_b,) = torch.autograd.grad(lp_b.sum(), hidden)
    torch.testing.assert_close(lp_a, lp_b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent_a, ent_b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_a, grad_b, rtol=1e-5, atol=1e-6)
    assert (lp_a <= 0).all() and (ent_a > 0).all()
