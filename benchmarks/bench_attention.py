"""Benchmark causal attention over packed rows (forward + backward) with each kernel torch offers.

Packed micro-batches (several sequences back to back in one row, `ops/varlen.py`) need a
varlen kernel. This script times the candidates on one packed micro-batch of sequences with
lengths drawn from [--min-len, --max-len] until --tokens are filled, for each head shape in --shapes
(query heads x K/V heads x head size):

- `flash_varlen`: FlashAttention-2 varlen (`varlen.causal_varlen_attn`, what packed training rows run),
  grouped K/V in place
- `cudnn_varlen`: cuDNN ragged attention (`aten._cudnn_attention_forward/backward` with cumulative
  sequence lengths); K/V heads repeated to the query heads, their gradients summed back
  (torch's own `varlen_attn` keeps this path switched off)
- `triton_varlen`: this project's Triton kernels (`ops/attention_triton.py`), grouped K/V in
  place; `--sweep` also times each launch shape in `SWEEP` for each of its three kernels
- `cp_fused` / `cp_sdpa`: the same row split over `--context-parallel` ranks
  (`training/context_parallel.py`), every rank's queries in turn attending to the gathered keys: one
  FlashAttention-2 varlen call over the rank's pieces, or SDPA piece by piece; the times are the
  whole group's work on one GPU (a rank takes about 1/C of it)
- `flex_varlen`: FlexAttention (`torch.nn.attention.flex_attention`, compiled Triton kernels) over the
  packed row with a same-sequence causal block mask (mask built once per micro-batch, not timed)
- `cudnn_padded` / `flash_padded`: SDPA on the same sequences right-padded to the longest, batch-first
  (not counting the copies into and out of the padded layout)

TFLOP/s count causal work only: 2 * L * (L + 1) * heads * head_dim per sequence forward
(QK^T and PV over the lower triangle), 2.5x that backward.

    python -m benchmarks.bench_attention        # baseline: FA2 vs Triton, Qwen2-0.5B heads and 28x4x128
    python -m benchmarks.bench_attention --shapes 14x2x64 \\
        --kernels flash_varlen,flex_varlen,cudnn_varlen,cudnn_padded,flash_padded
    python -m benchmarks.bench_attention --kernels flash_varlen,triton_varlen --sweep
    python -m benchmarks.bench_attention --shapes 14x2x64 --kernels flash_varlen,cp_fused,cp_sdpa --context-parallel 2
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from areal_async.ops import attention_triton
from areal_async.ops.varlen import causal_varlen_attn, causal_varlen_attn_qk
from areal_async.training.context_parallel import ContextPart, attend_gathered
from benchmarks import harness

METRICS: dict[str, harness.Direction] = {"fwd_ms": "lower", "bwd_ms": "lower", "fwd_bwd_tflops": "higher"}
"""What report --check compares (rows: one per head shape and kernel)."""

SWEEP: dict[int, dict[str, list[tuple[int, int, int, int]]]] = {
    64: {
        "forward": [(64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 4), (128, 64, 4, 4)],
        "dkdv": [(32, 128, 4, 3), (32, 128, 4, 2), (32, 128, 4, 5), (32, 64, 4, 3), (16, 64, 4, 3)],
        "dq": [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 5), (128, 64, 8, 4), (128, 32, 8, 3)],
    },
    128: {
        "forward": [(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 8, 2)],
        "dkdv": [
            (32, 64, 8, 2),
            (32, 64, 4, 2),
            (16, 64, 4, 3),
            (16, 64, 8, 2),
            (32, 128, 8, 2),
            (64, 64, 8, 2),
        ],
        "dq": [
            (64, 64, 8, 2),
            (64, 64, 4, 2),
            (64, 32, 4, 3),
            (128, 64, 8, 2),
            (128, 32, 8, 2),
            (32, 32, 4, 3),
        ],
    },
}
"""Launch shapes `--sweep` tries per head size and Triton kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages)."""


def lengths_for(tokens: int, lo: int, hi: int, seed: int) -> list[int]:
    """Sequence lengths drawn uniformly from [lo, hi] whose sum is exactly `tokens`."""
    rng = random.Random(seed)
    out: list[int] = []
    while sum(out) < tokens:
        out.append(rng.randint(lo, hi))
    out[-1] -= sum(out) - tokens
    return [n for n in out if n > 0]


def causal_flops(lengths: list[int], heads: int, head_dim: int) -> float:
    return float(sum(2 * n * (n + 1) * heads * head_dim for n in lengths))


def timed(fn: Callable[[], Any], iters: int) -> float:
    """Median seconds of `fn` over `iters` runs after two warm-ups (CUDA events)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


class _CudnnVarlen(torch.autograd.Function):
    """cuDNN's ragged kernels called directly; K/V heads repeated to the query heads."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len):  # type: ignore[override]
        groups = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        out, lse, *_, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False
        )
        ctx.save_for_backward(q, k, v, out, lse, seed, offset, cu)
        ctx.max_len, ctx.groups = max_len, groups
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v, out, lse, seed, offset, cu = ctx.saved_tensors
        m = ctx.max_len
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            grad.contiguous(), q, k, v, out, lse, seed, offset, None, cu, cu, m, m, 0.0, True
        )
        dk, dv = (t.unflatten(1, (-1, ctx.groups)).sum(2) for t in (dk, dv))
        return dq, dk, dv, None, None


def cudnn_varlen(q, k, v, cu, max_len):
    return _CudnnVarlen.apply(q, k, v, cu, max_len)


def flex_varlen(lengths: list[int]) -> Callable[..., torch.Tensor]:
    """FlexAttention over the packed row: position q sees kv when both are in one sequence, kv <= q."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    sizes = torch.tensor(lengths, device="cuda")
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), sizes)

    def same_sequence_causal(_b, _h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (sequence[q_idx] == sequence[kv_idx]) & (kv_idx <= q_idx)

    n = int(sizes.sum())
    block_mask = create_block_mask(same_sequence_causal, None, None, n, n, device="cuda")
    attend = torch.compile(flex_attention)

    def run(q, k, v, _cu, _max_len):  # packed [N, H, D] -> [1, H, N, D] views
        heads_first = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        out = attend(*heads_first, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])
        return out[0].transpose(0, 1)

    return run


def context_parallel(lengths: list[int], size: int, fused: bool) -> Callable[..., torch.Tensor]:
    """Every rank's part of the row of `lengths` in turn (parts built once, not timed); returns the
    outputs in the row's order."""
    n = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    positions = torch.cat([torch.arange(m) for m in lengths])[None].cuda()
    ids, selected = torch.arange(n, device="cuda")[None], torch.arange(n - 1, device="cuda")
    parts = [ContextPart.of(None, ids, positions, selected, cu, size=size, rank=r)[0] for r in range(size)]
    order = torch.argsort(torch.cat([p.tokens() for p in parts]))
    kernel = causal_varlen_attn_qk if fused else None

    def run(q, k, v, _cu, _max_len):  # type: ignore[no-untyped-def]
        pad = parts[0].bounds[-1] - n
        q, kv = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, torch.cat([k, v], dim=-1)))
        outs = [attend_gathered(q[p.tokens()], kv[p.gathered], p, None, kernel) for p in parts]
        return torch.cat(outs)[order][:n]

    return run


def padded(backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def run(q, k, v, _cu, _max_len):  # q: [B, H, L, D]
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
            )

    return run


def to_padded(t: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[N, H, D] packed -> [B, H, Lmax, D] right-padded with zeros."""
    longest = max(lengths)
    out = t.new_zeros(len(lengths), longest, *t.shape[1:])
    start = 0
    for i, n in enumerate(lengths):
        out[i, :n] = t[start : start + n]
        start += n
    return out.transpose(1, 2).contiguous()


def measure(
    name: str,
    fn: Callable[..., torch.Tensor],
    tensors: tuple[torch.Tensor, ...],
    lengths: list[int],
    cu: torch.Tensor,
    fwd_flops: float,
    iters: int,
    reference: list[torch.Tensor],
) -> dict[str, Any]:
    """Time `fn` forward and forward + backward; compare its output to the first kernel's."""
    is_padded = name.endswith("_padded")
    q, k, v, g = (to_padded(t, lengths) if is_padded else t.clone() for t in tensors)
    for t in (q, k, v):
        t.requires_grad_(True)
    longest = max(lengths)

    def step() -> None:
        fn(q, k, v, cu, longest).backward(g)

    row: dict[str, Any] = {"kernel": name}
    try:
        fwd_s = timed(lambda: fn(q, k, v, cu, longest), iters)
        both_s = timed(step, iters)
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v, cu, longest)
        out.backward(g)
    except Exception as exc:  # a kernel this build lacks is reported, not fatal
        return row | {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    grads = [t.grad for t in (q, k, v)]
    if is_padded:
        out = torch.cat([out[i, :, :m].transpose(0, 1) for i, m in enumerate(lengths)])
        grads = [torch.cat([t[i, :, :m].transpose(0, 1) for i, m in enumerate(lengths)]) for t in grads]
    if not reference:
        reference += [t.float() for t in (out, *grads)]
    grad_diff = max((a.float() - b).abs().max().item() for a, b in zip(grads, reference[1:], strict=True))
    return row | {
        "fwd_ms": round(fwd_s * 1e3, 3),
        "bwd_ms": round((both_s - fwd_s) * 1e3, 3),
        "fwd_tflops": round(fwd_flops / fwd_s / 1e12, 1),
        "bwd_tflops": round(2.5 * fwd_flops / (both_s - fwd_s) / 1e12, 1),
        "fwd_bwd_tflops": round(3.5 * fwd_flops / both_s / 1e12, 1),
        "max_abs_diff_vs_first": round((out.float() - reference[0]).abs().max().item(), 4),
        "max_abs_grad_diff_vs_first": round(grad_diff, 4),
    }


def sweep_rows(measure_one: Callable[[str], dict[str, Any]], head_dim: int) -> list[dict[str, Any]]:
    """Time `triton_varlen` with each shape in SWEEP for one kernel, the others at their default."""
    rows = []
    config = attention_triton.CONFIG[head_dim]
    default = {name: dict(cfg) for name, cfg in config.items()}
    for kernel, shapes in SWEEP[head_dim].items():
        for block_m, block_n, warps, stages in shapes:
            config[kernel] = {
                "BLOCK_M": block_m,
                "BLOCK_N": block_n,
                "num_warps": warps,
                "num_stages": stages,
            }
            rows.append(measure_one(f"triton_varlen[{kernel}={block_m}x{block_n}w{warps}s{stages}]"))
            print(json.dumps(rows[-1]), flush=True)
        config[kernel] = default[kernel]
    return rows


def parse_shape(text: str) -> tuple[int, int, int]:
    """``14x2x64`` -> (query heads, K/V heads, head size)."""
    try:
        heads, kv_heads, head_dim = (int(x) for x in text.split("x"))
    except ValueError:
        raise SystemExit(f"--shapes entry {text!r} is not HEADSxKV_HEADSxHEAD_DIM, e.g. 14x2x64") from None
    return heads, kv_heads, head_dim


def measure_shape(shape: str, lengths: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every kernel of --kernels (and with --sweep every Triton launch shape) on one head shape."""
    heads, kv_heads, head_dim = parse_shape(shape)
    torch.manual_seed(args.seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    n, bf16 = sum(lengths), torch.bfloat16
    q0 = torch.randn(n, heads, head_dim, device="cuda", dtype=bf16)
    k0 = torch.randn(n, kv_heads, head_dim, device="cuda", dtype=bf16)
    v0 = torch.randn(n, kv_heads, head_dim, device="cuda", dtype=bf16)
    grad = torch.randn_like(q0)
    fwd_flops = causal_flops(lengths, heads, head_dim)
    kernels = {
        "flash_varlen": causal_varlen_attn,
        "triton_varlen": attention_triton.varlen_attention,
        "cudnn_varlen": cudnn_varlen,
        "cudnn_padded": padded("cudnn"),
        "flash_padded": padded("flash"),
    }
    for name, fused in (("cp_fused", True), ("cp_sdpa", False)):
        if name in args.kernels.split(","):
            kernels[name] = context_parallel(lengths, args.context_parallel, fused)
    if "flex_varlen" in args.kernels.split(","):
        kernels["flex_varlen"] = flex_varlen(lengths)  # builds the block mask: only when asked for
    rows: list[dict[str, Any]] = []
    reference: list[torch.Tensor] = []

    def measure_one(name: str) -> dict[str, Any]:
        fn = kernels[name.split("[")[0]]
        row = measure(name, fn, (q0, k0, v0, grad), lengths, cu, fwd_flops, args.iters, reference)
        repeat = sum(r["kernel"] == name for r in rows)
        return {"case": f"{shape} {name}" + (f"#{repeat + 1}" if repeat else ""), **row}

    for name in args.kernels.split(","):
        rows.append(measure_one(name))
        print(json.dumps(rows[-1]), flush=True)
    if args.sweep:
        rows += sweep_rows(measure_one, head_dim)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=51_200)
    parser.add_argument("--min-len", type=int, default=1152)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument(
        "--shapes",
        default="14x2x64,28x4x128",
        help="comma list of HEADSxKV_HEADSxHEAD_DIM (14x2x64: Qwen2-0.5B)",
    )
    parser.add_argument("--kernels", default="flash_varlen,triton_varlen", help="comma list; repeats allowed")
    parser.add_argument(
        "--context-parallel", type=int, default=2, help="ranks the cp_* kernels split the row over"
    )
    parser.add_argument("--sweep", action="store_true", help="also time each Triton launch shape in SWEEP")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    harness.add_output_args(parser)
    args = parser.parse_args()

    lengths = lengths_for(args.tokens, args.min_len, args.max_len, args.seed)
    rows = [row for shape in args.shapes.split(",") for row in measure_shape(shape, lengths, args)]
    cudnn = torch.backends.cudnn.version()
    note = f"One packed row of {sum(lengths)} tokens in {len(lengths)} sequences; cuDNN {cudnn}."
    result = harness.make_result("attention", args, rows, METRICS, device="cuda", note=note)
    harness.emit(result, args.out, args.save_baseline)


if __name__ == "__main__":
    main()
