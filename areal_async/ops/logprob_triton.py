"""Token logprob and entropy over `[rows, vocab]` logits in one pass each way (Triton, CUDA).

The training step needs, per completion token, logit[target] / T - logsumexp(logits / T) (with
gradient) and the entropy of the row (a metric, no gradient). Over Qwen2's 152k vocabulary the
logits of one micro-batch are ~13 GB of bf16, so each pass over them costs milliseconds and the
number of passes is what matters:

- forward (`_forward_kernel`, one program per row): a single read of the row keeps, per lane, a
  running max m, s = sum exp(x - m) and t = sum exp(x - m) * x, rescaled whenever m grows
  (online softmax); then lse = M + log S and entropy = lse - T / S. The compiled torch form needs
  one pass for the logsumexp and more for the entropy (`logprobs.token_logprobs_lse`).
- backward (`_backward_kernel`, one program per row and vocabulary block): reads the logits once
  and writes their gradient g / T * (onehot(target) - softmax) once, in the logits' dtype.

`triton_support.triton_available(device)` says whether this path can run (CUDA and an
importable Triton); `target_logprob(logits, targets, temperature, with_entropy)` is the autograd entry point.
"""

from __future__ import annotations

from typing import Any

import torch

from areal_async.ops.triton_support import tl, triton

FORWARD_BLOCK = 2048
"""Vocabulary entries one forward program reads per loop iteration (H200, 42k x 152k bf16 logits:
2048 x 4 warps and 4096 x 16 warps 5.5 ms, 4096 x 8 6.4 ms, 8192 x 8 8.7 ms; benchmarks/bench_logprob.py)."""

FORWARD_WARPS = 4
"""Warps per forward program (one program per row)."""

BACKWARD_BLOCK = 8192
"""Vocabulary entries one backward program writes."""


if triton is not None:

    @triton.jit
    def _forward_kernel(
        logits_ptr,
        row_stride,
        targets_ptr,
        logprobs_ptr,
        lse_ptr,
        entropy_ptr,
        vocab,
        temperature,
        WITH_ENTROPY: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * row_stride
        neg_inf = -float("inf")
        m = tl.full([BLOCK], neg_inf, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        t = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < vocab
            x = tl.load(row_ptr + cols, mask=valid, other=neg_inf).to(tl.float32) / temperature
            m_new = tl.maximum(m, x)
            # A lane that has seen only padding keeps m = -inf; avoid exp(-inf - -inf).
            alpha = tl.where(m_new == neg_inf, 0.0, tl.exp(m - m_new))
            e = tl.where(valid, tl.exp(x - m_new), 0.0)
            s = s * alpha + e
            if WITH_ENTROPY:
                t = t * alpha + tl.where(valid, e * x, 0.0)
            m = m_new
        top = tl.max(m, 0)
        weight = tl.where(m == neg_inf, 0.0, tl.exp(m - top))
        total = tl.sum(s * weight, 0)
        lse = top + tl.log(total)
        target = tl.load(targets_ptr + row)
        target_logit = tl.load(row_ptr + target).to(tl.float32) / temperature
        tl.store(logprobs_ptr + row, target_logit - lse)
        tl.store(lse_ptr + row, lse)
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, lse - tl.sum(t * weight, 0) / total)
        else:
            tl.store(entropy_ptr + row, 0.0)

    @triton.jit
    def _backward_kernel(
        logits_ptr,
        row_stride,
        grad_logits_ptr,
        targets_ptr,
        lse_ptr,
        grad_ptr,
        vocab,
        temperature,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = cols < vocab
        x = tl.load(logits_ptr + row * row_stride + cols, mask=valid, other=0.0).to(tl.float32) / temperature
        scale = tl.load(grad_ptr + row) / temperature
        probs = tl.exp(x - tl.load(lse_ptr + row))
        onehot = tl.where(cols == tl.load(targets_ptr + row), 1.0, 0.0)
        out = scale * (onehot - probs)
        tl.store(grad_logits_ptr + row * vocab + cols, out.to(grad_logits_ptr.dtype.element_ty), mask=valid)


class _FusedTargetLogprob(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        overwrite_logits: bool,
    ) -> Any:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        targets = targets.contiguous()
        rows, vocab = logits.shape
        logprobs, lse, entropy = (
            torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3)
        )
        if rows:
            _forward_kernel[(rows,)](
                logits,
                logits.stride(0),
                targets,
                logprobs,
                lse,
                entropy,
                vocab,
                float(temperature),
                WITH_ENTROPY=with_entropy,
                BLOCK=FORWARD_BLOCK,
                num_warps=FORWARD_WARPS,
            )
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = float(temperature)
        ctx.overwrite_logits = overwrite_logits and logits.is_contiguous()
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _grad_entropy: torch.Tensor) -> Any:
        logits, targets, lse = ctx.saved_tensors
        rows, vocab = logits.shape
        # Each element is read before it is written, by the same program: in place is safe.
        grad_logits = (
            logits
            if ctx.overwrite_logits
            else torch.empty_like(logits, memory_format=torch.contiguous_format)
        )
        if rows:
            _backward_kernel[(rows, triton.cdiv(vocab, BACKWARD_BLOCK))](
                logits,
                logits.stride(0),
                grad_logits,
                targets,
                lse,
                grad.float().contiguous(),
                vocab,
                ctx.temperature,
                BLOCK=BACKWARD_BLOCK,
                num_warps=8,
            )
        return grad_logits, None, None, None, None


def target_logprob(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    *,
    overwrite_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logit[target] / T - logsumexp(logits / T) per row (with grad) and the row entropy
    (no grad; zeros unless `with_entropy`), from `[N, V]` logits of any float dtype on CUDA.

    `overwrite_logits`: backward writes the logits' gradient over the logits themselves (saves a
    `[N, V]` buffer); only for logits nothing else reads after this call, such as a head output
    made for it."""
    if triton is None:
        raise RuntimeError("target_logprob needs Triton; check triton_support.triton_available(device) first")
    if logits_NV.dim() != 2 or targets_N.shape != logits_NV.shape[:1]:
        raise ValueError(
            f"logits must be [N, V] and targets [N], got {tuple(logits_NV.shape)} and {tuple(targets_N.shape)}"
        )
    return _FusedTargetLogprob.apply(logits_NV, targets_N, temperature, with_entropy, overwrite_logits)
