"""Benchmark the token-logprob forms of the trainer (forward with entropy, and backward) on CUDA.

Each form (`ops/logprobs.py`) takes `--rows` bf16 hidden states through a bf16 lm_head of
`--vocab` outputs and returns the float32 logprob of one target per row and the row entropy, as
the training step does for the completion tokens of one micro-batch. Reports median forward and
backward milliseconds (CUDA events, after two warm-ups), the bandwidth that the passes over the
bf16 logits reach beside the head's matmuls (timed alone), peak memory, and the largest
difference from the eager form.

    python -m benchmarks.bench_logprob                      # baseline: Qwen2-0.5B head, 42,000 rows
    python -m benchmarks.bench_logprob --forms fused --rows 8192 --temperature 0.7
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch

from areal_async.ops import logprob_triton, logprobs
from benchmarks import harness
from benchmarks.bench_attention import timed

METRICS: dict[str, harness.Direction] = {"fwd_ms": "lower", "bwd_ms": "lower", "peak_gb": "lower"}
"""What report --check compares (rows: one per form). The head's matmuls are in these times: the
``*_beside_head_ms`` differences move by ~3 ms between runs at 5 iterations, too much for a 5% check."""


def head_backward_seconds(head: torch.nn.Linear, hidden: torch.Tensor, iters: int) -> float:
    """Seconds of the head's forward and both backward matmuls for a random logits gradient."""
    grad_logits = torch.randn(hidden.shape[0], head.out_features, device=hidden.device, dtype=hidden.dtype)
    return timed(lambda: torch.autograd.grad(head(hidden), [hidden, head.weight], grad_logits), iters)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=42_000)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--forms", default="eager,compiled,fused")
    parser.add_argument(
        "--forward-configs",
        default="",
        help="extra fused forward launch configs to time, BLOCKxWARPS comma list (e.g. 8192x16,2048x4)",
    )
    parser.add_argument("--iters", type=int, default=5)
    harness.add_output_args(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    device, bf16 = torch.device("cuda"), torch.bfloat16
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=device, dtype=bf16)
    torch.nn.init.normal_(head.weight, std=0.02)
    hidden = (torch.randn(args.rows, args.hidden, device=device) * 2).to(bf16).requires_grad_(True)
    targets = torch.randint(0, args.vocab, (args.rows,), device=device)
    upstream = torch.randn(args.rows, device=device)
    forms = {
        "eager": logprobs.token_logprobs,
        "compiled": torch.compile(logprobs.token_logprobs_lse, dynamic=True),
        "fused": logprobs.fused_token_logprobs,
    }
    logits_gb = args.rows * args.vocab * 2 / 1e9
    matmul_fwd = timed(lambda: head(hidden), args.iters)
    matmul_bwd = head_backward_seconds(head, hidden, args.iters) - matmul_fwd
    print(json.dumps({"head_fwd_ms": round(matmul_fwd * 1e3, 2), "head_bwd_ms": round(matmul_bwd * 1e3, 2)}))
    rows: list[dict[str, Any]] = []
    reference: tuple[torch.Tensor, ...] = ()
    for name in args.forms.split(","):
        fn = forms[name]

        def forward(fn: Callable[..., Any] = fn) -> tuple[torch.Tensor, torch.Tensor]:
            return fn(hidden, targets, head, args.temperature, True)

        def both(fn: Callable[..., Any] = fn) -> None:
            lp, _ = forward(fn)
            torch.autograd.grad((lp * upstream).sum(), [hidden, head.weight])

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        fwd_s = timed(forward, args.iters)
        both_s = timed(both, args.iters)
        lp, ent = forward()
        grads = torch.autograd.grad((lp * upstream).sum(), [hidden])
        result = (lp.detach(), ent, grads[0].float())
        if not reference:
            reference = result
        row = {
            "case": name,
            "form": name,
            "fwd_ms": round(fwd_s * 1e3, 2),
            "bwd_ms": round((both_s - fwd_s) * 1e3, 2),
            "fwd_beside_head_ms": round((fwd_s - matmul_fwd) * 1e3, 2),
            "bwd_beside_head_ms": round((both_s - fwd_s - matmul_bwd) * 1e3, 2),
            "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1),
            "max_diff_logprob": (result[0] - reference[0]).abs().max().item(),
            "max_diff_entropy": (result[1] - reference[1]).abs().max().item(),
            "max_diff_grad_hidden": (result[2] - reference[2]).abs().max().item(),
        }
        row["logits_gb"] = round(logits_gb, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del lp, ent, grads, result
    for config in filter(None, args.forward_configs.split(",")):
        block, warps = (int(x) for x in config.split("x"))
        logprob_triton.FORWARD_BLOCK, logprob_triton.FORWARD_WARPS = block, warps
        fwd_s = timed(
            lambda: logprobs.fused_token_logprobs(hidden, targets, head, args.temperature, True), args.iters
        )
        case = f"fused forward {config}"
        row = {"case": case, "form": case, "fwd_ms": round(fwd_s * 1e3, 2)}
        row["fwd_beside_head_ms"] = round((fwd_s - matmul_fwd) * 1e3, 2)
        row["fwd_logits_tb_s"] = round(logits_gb / (fwd_s - matmul_fwd) / 1e3, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = harness.make_result("logprob", args, rows, METRICS, device="cuda")
    harness.emit(result, args.out, args.save_baseline)


if __name__ == "__main__":
    main()
