"""Per-token logprob and entropy of the selected completion tokens: the forms the trainer picks from.

All take the hidden states of the selected rows `[N, H]`, their targets `[N]`, the output head
and the sampling temperature, and return float32 `(logprobs [N], entropy [N])`: logprob with
gradient, entropy without (zeros unless `with_entropy`). They agree to float32 rounding
(tests/unit/test_token_logprobs.py, tests/gpu/test_logprob_triton_gpu.py, and on CPU
tests/unit/test_logprob_triton_interpreter.py under Triton's interpreter):

- `token_logprobs`: one fused log-softmax (eager; CPU and the fallback everywhere);
- `token_logprobs_lse`: logit[target] - logsumexp with a one-pass backward, for torch.compile;
- `fused_token_logprobs`: Triton kernels, one pass over the logits each way
  (`logprob_triton.py`; CUDA only).

`pick_logprob_fn(device, compile, kernel=...)` chooses: the Triton form where it can run (unless
`kernel="torch"`), else the compiled logsumexp form when compiling, else the eager one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from areal_async.ops import logprob_triton, triton_support

ENTROPY_ROWS = 1024
"""Rows per block when the torch forms compute the entropy (bounds their float32 [rows, vocab] temporaries)."""

LogprobFn = Callable[[torch.Tensor, torch.Tensor, nn.Module, float, bool], tuple[torch.Tensor, torch.Tensor]]


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits / temperature."""
    logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


def token_logprobs(
    hidden_NH: torch.Tensor, targets_N: torch.Tensor, head: nn.Module, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logprob of each target and the entropy (no grad; zeros unless `with_entropy`) of each row.

    Eager form: one fused log-softmax (its backward needs no extra [rows, vocab] temporary). Only
    the log-softmax (kept for backward) outlives this call's first lines: the float32 logits go
    once it exists, and the entropy takes one `[ENTROPY_ROWS, vocab]` block at a time.
    """
    logp_all = torch.log_softmax(scale_logits(head(hidden_NH), temperature), dim=-1)
    logprobs = logp_all.gather(-1, targets_N.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logprobs, torch.zeros_like(logprobs)
    with torch.no_grad():
        entropy = torch.cat([-block.exp().mul_(block).sum(-1) for block in logp_all.split(ENTROPY_ROWS)])
    return logprobs, entropy


class TargetLogprob(torch.autograd.Function):
    """logit[target] / T - logsumexp(logits / T) per row, float32, from `[N, V]` logits of any dtype.

    Its backward writes the logits' gradient in one pass, in their dtype: -g/T * softmax, with
    g/T * (1 - p[target]) (computed in float32) written at the target. Autograd of the plain
    formula also materialises the gather's scattered gradient as a second `[N, V]` tensor and reads
    it back. Returns (logprobs, lse); lse carries no gradient.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> Any:
        scaled = scale_logits(logits, temperature)
        lse = torch.logsumexp(scaled, dim=-1)
        logprobs = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        ctx.save_for_backward(logits, targets, lse, logprobs)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(lse)
        return logprobs, lse

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _grad_lse: torch.Tensor) -> Any:
        logits, targets, lse, logprobs = ctx.saved_tensors
        scale = grad / ctx.temperature
        probs = torch.exp(scale_logits(logits, ctx.temperature) - lse.unsqueeze(-1))
        grad_logits = (-scale.unsqueeze(-1) * probs).to(logits.dtype)
        rows = torch.arange(targets.shape[0], device=targets.device)
        at_target = scale * (1.0 - torch.exp(logprobs))
        grad_logits.index_put_((rows, targets), at_target.to(logits.dtype))
        return grad_logits, None, None


def token_logprobs_lse(
    hidden_NH: torch.Tensor, targets_N: torch.Tensor, head: nn.Module, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as `token_logprobs` as logit[target] - logsumexp(logits), for torch.compile:
    the reductions fuse, no [rows, vocab] log-softmax output is kept for backward, and the backward
    is one pass over the logits (`TargetLogprob`) (H200, Qwen2-0.5B shape: 31.9% -> 37.1% MFU,
    82 -> 61 GB peak for the fused reductions; slower in eager mode)."""
    logits = head(hidden_NH)
    logprobs, lse_N = TargetLogprob.apply(logits, targets_N, temperature)
    if not with_entropy:
        return logprobs, torch.zeros_like(logprobs)
    parts = []
    with torch.no_grad():  # scaled in row blocks: no float32 copy of all the logits
        for block, lse in zip(logits.detach().split(ENTROPY_ROWS), lse_N.split(ENTROPY_ROWS), strict=True):
            scaled = scale_logits(block, temperature)
            parts.append(lse - torch.softmax(scaled, dim=-1).mul_(scaled).sum(-1))
    return logprobs, torch.cat(parts)


def fused_token_logprobs(
    hidden_NH: torch.Tensor, targets_N: torch.Tensor, head: nn.Module, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as `token_logprobs` from the Triton kernels: one read of the logits forward
    (logsumexp, target logit and entropy together), one read and one write backward, over the
    logits themselves (they are this call's own temporary)."""
    logits = head(hidden_NH)
    return logprob_triton.target_logprob(logits, targets_N, temperature, with_entropy, overwrite_logits=True)


def pick_logprob_fn(device: torch.device, compile: bool, *, kernel: str = "auto") -> LogprobFn:
    """The form for `device`: `kernel="auto"` takes the Triton form where it runs, `"triton"`
    insists on it, `"torch"` never uses it; otherwise the compiled logsumexp form when
    compiling, else the eager one."""
    if kernel not in ("auto", "triton", "torch"):
        raise ValueError(f"logprob_kernel must be 'auto', 'triton' or 'torch', got {kernel!r}")
    if kernel == "triton":
        triton_support.require_triton(device, "logprob_kernel", "torch")
    if kernel != "torch" and triton_support.triton_available(device):
        return fused_token_logprobs
    if compile:
        return torch.compile(token_logprobs_lse, dynamic=True)
    return token_logprobs


def of_selected(
    logprob_fn: LogprobFn,
    hidden_TH: torch.Tensor,
    input_ids: torch.Tensor,
    hidden_index: torch.Tensor,
    head: nn.Module,
    temperature: float,
    with_entropy: bool,
    chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy `[n]` of the tokens at `hidden_index + 1` of the flattened `input_ids`,
    from the flattened hidden states `[T, H]`: `logprob_fn` over `chunk_tokens` rows at a time. With
    grad and more rows than one chunk, each chunk is recomputed in backward, so no `[rows, vocab]`
    logits outlive their chunk. With no rows, every parameter still enters the graph (ranks must run
    the same gradient reductions)."""
    from torch.utils.checkpoint import checkpoint

    n = hidden_index.shape[0]
    if n == 0:
        anchor = head(hidden_TH[:1]).float().sum() * 0.0
        zeros = torch.zeros(0, dtype=torch.float32, device=hidden_TH.device) + anchor
        return zeros, zeros.detach()
    # Indices come from the host: no device-to-host sync, unlike a boolean-mask select.
    hidden_NH = hidden_TH.index_select(0, hidden_index)
    targets_N = input_ids.flatten().index_select(0, hidden_index + 1)
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for start in range(0, n, chunk_tokens):
        args = (
            hidden_NH[start : start + chunk_tokens],
            targets_N[start : start + chunk_tokens],
            head,
            temperature,
            with_entropy,
        )
        if torch.is_grad_enabled() and n > chunk_tokens:
            parts.append(checkpoint(logprob_fn, *args, use_reentrant=False))
        else:
            parts.append(logprob_fn(*args))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
