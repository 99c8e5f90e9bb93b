"""The two token-logprob forms of the training engine agree (values, entropy and gradients)."""

from __future__ import annotations

import pytest
import torch

from areal_async.ops import logprobs
from areal_async.ops.logprobs import pick_logprob_fn, token_logprobs, token_logprobs_lse


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logsumexp_form_matches_log_softmax_form(temperature: float) -> None:
    """logit[target] - logsumexp (used under torch.compile, with its own one-pass backward) equals
    the log-softmax form for logprobs, entropy and the gradients reaching the hidden states and the
    head, under uneven upstream gradients, including a row whose target takes almost all the mass."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(7, 16)
    hidden[3] = head.weight[11].detach() * 200.0  # row 3: target 11 is near-certain
    hidden.requires_grad_(True)
    targets = torch.randint(0, 50, (7,))
    targets[3] = 11
    upstream = torch.randn(7)
    results = []
    for form in (token_logprobs, token_logprobs_lse):
        lp, ent = form(hidden, targets, head, temperature, True)
        grads = torch.autograd.grad((lp * upstream).sum(), [hidden, head.weight])
        results.append((lp, ent, *grads))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    lp, ent = results[0][:2]
    assert (lp <= 0).all() and (ent > 0).all()
    assert lp[3] > -1e-2, "row 3 was meant to be near-certain"


@pytest.mark.parametrize("form", [token_logprobs, token_logprobs_lse])
def test_entropy_in_row_blocks_equals_the_whole_matrix_formula(
    form: logprobs.LogprobFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With more rows than one entropy block, every row's entropy is still -sum(p log p) of its own
    logits at the temperature (blocks of the logits and of their logsumexp stay aligned)."""
    monkeypatch.setattr(logprobs, "ENTROPY_ROWS", 3)
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(8, 16)
    targets = torch.randint(0, 50, (8,))
    _, entropy = form(hidden, targets, head, 0.7, True)
    logp = torch.log_softmax(head(hidden) / 0.7, dim=-1)
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1), rtol=1e-5, atol=1e-6)


def test_cpu_picks_the_torch_forms_and_refuses_the_triton_kernel() -> None:
    """Without CUDA the eager form is used (compiled logsumexp form when compiling); asking for the
    Triton kernels there is an error that names the setting to change."""
    cpu = torch.device("cpu")
    assert pick_logprob_fn(cpu, compile=False) is token_logprobs
    assert pick_logprob_fn(cpu, compile=False, kernel="torch") is token_logprobs
    assert pick_logprob_fn(cpu, compile=True) is not token_logprobs  # the compiled wrapper
    with pytest.raises(ValueError, match="trainer.logprob_kernel=auto"):
        pick_logprob_fn(cpu, compile=False, kernel="triton")
    with pytest.raises(ValueError, match="logprob_kernel must be 'auto', 'triton' or 'torch', got 'fast'"):
        pick_logprob_fn(cpu, compile=False, kernel="fast")
