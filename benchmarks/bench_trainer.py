"""Benchmark the training engines (FSDP2, megatron-core): step time, tokens/s and MFU on synthetic RL batches.

Each configuration builds a training engine (`--backend`) from the trainer section a run file gets
(`TrainerConfig`: the optimizer, lr schedule and clip of `--config RUN.yaml`, or a run file's
defaults; dtype, device, budgets and kernels from the flags below), makes a batch of `--seqs` sequences
(prompt `--prompt-len`, completion lengths drawn uniformly from
`[(1 - jitter) * completion_len, completion_len]`), runs `--warmup` untimed steps, then
`--steps` timed ones. A step is what the trainer does per batch: the update with the run's loss
(`areal_async.training.learner.make_loss_fn` over `algo.loss.policy_loss`, recipe `--loss-preset`)
in one `train_step(..., compute_prox=True)`, pi_prox taken from the update's own forward as the
learner does (`--prox update`); `--prox in-step` adds the separate no-grad pi_prox pass inside the
step (`prox_pass=True`, the two-pass step), `--prox separate` runs it as `compute_logprobs` before
`train_step`. `train_s` is the update's time, the step's minus that pass's (`prox_s`, 0 without it).
MFU = 6 * params * tokens / update seconds / peak (tokens are non-pad tokens);
`mfu_with_attn` adds the causal attention matmuls (3 x forward: 2 * L * (L + 1) * heads * head_dim
per layer and sequence of length L), as PaLM-style MFU does.

  # CPU, tiny random model, fp32 and bf16 autocast
  python -m benchmarks.bench_trainer --shape tiny --dtype float32,bfloat16
  # CPU, SmolLM2-135M from a local HF directory
  python -m benchmarks.bench_trainer --model ~/.cache/areal-async/models/smollm2-135m-instruct --seqs 8 \\
      --prompt-len 64 --completion-len 192 --dtype float32,bfloat16
  # H200 baseline, Qwen2-0.5B-shaped random model (peak 989 TFLOP/s bf16 dense); micro-batches are
  # packed rows by default there (`--packed off` for padded rows)
  python -m benchmarks.bench_trainer --device cuda --shape qwen2-0.5b --dtype bfloat16 --seqs 64 \\
      --prompt-len 256 --completion-len 1792 --micro-batch-tokens 76800 --logprob-chunk-tokens 131072 \\
      --compile --packed on --steps 5

`--backend fsdp2,megatron` runs each case on both trainer backends (megatron-core's GPT model for
the second), back to back on the same batch.

Under torchrun every rank runs the case on its data-parallel shard of the batch;
`--context-parallel C` splits every packed row over runs of C ranks (`training/context_parallel.py`).
Times are the slowest rank's, `peak_mem_gb` the largest rank's, MFU per rank; rank 0 prints:

  # CPU, one 2,048-token sequence, per-rank memory with its row split over two ranks
  torchrun --nproc-per-node 2 -m benchmarks.bench_trainer --model ~/.cache/areal-async/models/smollm2-135m-instruct \
      --seqs 1 --prompt-len 64 --completion-len 1984 --jitter 0 --packed on --context-parallel 2

Prints a table; `--out FILE` writes the result (benchmarks.harness layout), `--save-baseline` makes
it the baseline of its hardware.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal_async.algo.presets import PRESETS, preset_overrides
from areal_async.config import LossConfig
from areal_async.logs import configure_logging
from areal_async.lora import LoraConfig
from areal_async.run_file import load_config
from areal_async.training.batching import TrainSequence, pack_micro_batches, pack_tokens
from areal_async.training.fsdp.engine import FSDPTrainEngine, LossFn, init_distributed
from areal_async.training.learner import global_denominator, make_loss_fn
from benchmarks import harness

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "tie_word_embeddings": True,
    },
    "qwen2-0.5b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
}

H200_BF16_DENSE_TFLOPS = 989.0

METRICS: dict[str, harness.Direction] = {
    "train_s": "lower",
    "prox_s": "lower",
    "train_tok_s": "higher",
    "rl_step_tok_s": "higher",
    "mfu": "higher",
    "mfu_with_attn": "higher",
    "peak_mem_gb": "lower",
}
"""What report --check compares (rows: one per model and dtype)."""


def build_random_model(shape: str, out_dir: Path) -> Path:
    """Write a random-init model of a named shape as an HF directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES[shape])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    return out_dir


def attention_forward_flops(config: Any, length: int) -> float:
    """Causal self-attention matmul FLOPs of one sequence's forward: QK^T and AV over the lower triangle."""
    heads = config.num_attention_heads
    width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2.0 * length * (length + 1) * width * config.num_hidden_layers


def make_batch(
    n: int, prompt_len: int, completion_len: int, jitter: float, vocab: int, seed: int
) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(seed)
    low = max(1, int(round(completion_len * (1.0 - jitter))))
    seqs = []
    for _ in range(n):
        c = int(torch.randint(low, completion_len + 1, (1,), generator=g))
        # Tensors, not lists: collate then copies them without a Python loop over tokens.
        seqs.append(
            TrainSequence(
                prompt_ids=torch.randint(0, vocab, (prompt_len,), generator=g),
                completion_ids=torch.randint(0, vocab, (c,), generator=g),
                behave_logprobs=-torch.rand(c, generator=g) * 5,
                advantages=torch.randn(c, generator=g),
            )
        )
    return seqs


def loss_config(preset: str) -> LossConfig:
    """The LossConfig a run file with ``trainer.loss.preset: <preset>`` and no other loss keys gets."""
    return LossConfig(preset=preset, **preset_overrides(preset))


def peak_memory_gb(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def largest_over_ranks(value: float) -> float:
    """`value`'s maximum over the trainer's ranks (itself without a process group)."""
    if not dist.is_initialized():
        return value
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def bench_one(
    model_dir: Path, label: str, dtype: str, backend: str, args: argparse.Namespace
) -> dict[str, Any]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    trainer = dataclasses.replace(
        load_config(args.config).trainer,  # the run file's optimizer and schedule, as a run trains
        backend=backend,
        dtype=dtype,
        device=args.device,
        num_ranks=world,
        total_steps=args.warmup + args.steps,
        micro_batch_tokens=args.micro_batch_tokens,
        gradient_checkpointing=args.gradient_checkpointing,
        compile=args.compile,
        logprob_kernel=args.logprob_kernel,
        attention_kernel=args.attention_kernel,
        context_parallel=args.context_parallel,
        lora=LoraConfig(rank=args.lora, alpha=2.0 * args.lora) if args.lora else None,
    )
    engine: Any
    if backend == "megatron":
        from areal_async.training.megatron.engine import MegatronTrainEngine

        engine = MegatronTrainEngine(  # packed rows always
            model_dir, trainer, logprob_chunk_tokens=args.logprob_chunk_tokens
        )
    else:
        engine = FSDPTrainEngine(
            model_dir,
            trainer,
            logprob_chunk_tokens=args.logprob_chunk_tokens,
            packed={"auto": None, "on": True, "off": False}[args.packed],
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    params = sum(p.numel() for p in engine.model.parameters())
    trainable = sum(p.numel() for p in engine.params)
    batch = make_batch(
        args.seqs, args.prompt_len, args.completion_len, args.jitter, engine.config.vocab_size, args.seed
    )
    real = sum(s.length for s in batch)  # the whole batch: every rank's shard
    shard = batch[engine.dp_rank :: engine.dp_size]
    if engine.packed:
        bins, padded = pack_tokens([s.length for s in batch], args.micro_batch_tokens), real
    else:
        bins = pack_micro_batches(batch, args.micro_batch_tokens)
        padded = sum(len(b) * max(batch[i].length for i in b) for b in bins)
    loss = loss_config(args.loss_preset)
    loss_fn = make_loss_fn(
        loss,
        max_new_tokens=args.completion_len,
        denominator=global_denominator(batch, loss, max_new_tokens=args.completion_len),
    )
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step_s, prox_s, last_loss = [], [], float("nan")
    for step in range(args.warmup + args.steps):
        if args.prox in ("update", "in-step"):
            metrics = engine.train_step(
                shard, loss_fn, compute_prox=loss.decoupled, prox_pass=args.prox == "in-step"
            )
            prox_seconds = metrics.get("prox_seconds", 0.0)
            update_seconds = metrics["compute_seconds"] - prox_seconds
        else:
            start = time.perf_counter()
            prox = engine.compute_logprobs(shard)
            if args.device == "cuda":
                torch.cuda.synchronize()
            prox_seconds = time.perf_counter() - start
            seqs = [dataclasses.replace(s, prox_logprobs=p) for s, p in zip(shard, prox, strict=True)]
            metrics = engine.train_step(seqs, loss_fn)
            update_seconds = metrics["compute_seconds"]
        last_loss = metrics["loss"]
        if step >= args.warmup:
            step_s.append(update_seconds)
            prox_s.append(prox_seconds)
    if args.profile:
        profile_step(engine, shard, loss_fn, args)
    train_s = statistics.median(step_s)
    fwd_s = statistics.median(prox_s)
    row: dict[str, Any] = {
        "case": f"{label} {dtype}"
        + (f" lora{args.lora}" if args.lora else "")
        + (f" cp{args.context_parallel}" if args.context_parallel > 1 else "")
        + f" {backend}",
        "ranks": world,
        "context_parallel": args.context_parallel,
        "model": label,
        "backend": backend,
        "device": args.device,
        "dtype": dtype,
        "packed": engine.packed,
        "logprob_form": getattr(engine.model.logprob_fn, "__name__", "?"),
        "attention_kernel": engine.attention_kernel if engine.packed else "sdpa",
        "prox": args.prox,
        "loss_preset": args.loss_preset,
        "params": params,
        "trainable": trainable,
        "lora_rank": args.lora,
        "seqs": len(batch),
        "tokens": real,
        "pad_frac": round(1.0 - real / padded, 4),
        "micro_batches": len(bins),
        "train_s": round(train_s, 4),
        "train_s_all": [round(s, 4) for s in step_s],
        "train_tok_s": round(real / train_s, 1),
        "prox_s": round(fwd_s, 4),
        "prox_tok_s": round(real / fwd_s, 1) if fwd_s else None,
        "rl_step_tok_s": round(real / (train_s + fwd_s), 1),
        "peak_mem_gb": round(largest_over_ranks(peak_memory_gb(args.device)), 2),
        "loss": last_loss,
    }
    peak = (
        args.peak_tflops
        if args.peak_tflops is not None
        else (H200_BF16_DENSE_TFLOPS if args.device == "cuda" else None)
    )
    if peak and not args.lora:  # 6N counts weight gradients, which frozen LoRA bases skip
        peak *= world  # MFU per rank; params counts the whole model once (its shards on every rank)
        row["train_tflops"] = round(6 * params * real / train_s / 1e12, 2)
        row["mfu"] = round(6 * params * real / train_s / (peak * 1e12), 4)
        row["rl_step_mfu"] = round(8 * params * real / (train_s + fwd_s) / (peak * 1e12), 4)
        attention = 3 * sum(attention_forward_flops(engine.config, s.length) for s in batch)
        row["mfu_with_attn"] = round((6 * params * real + attention) / train_s / (peak * 1e12), 4)
    del engine
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def profile_step(
    engine: FSDPTrainEngine, batch: list[TrainSequence], loss_fn: LossFn, args: argparse.Namespace
) -> None:
    """One more pi_prox forward and train step, each under torch.profiler; print each one's top ops
    by device time. With `--profile-out F` also write every op's self time and call count as JSON
    (the train step to F, the pi_prox forward to F with suffix `.prox.json`); with `--trace-out T`
    the timelines as Chrome traces (train step to T, pi_prox to T with `.prox` before `.json`;
    gzipped when T ends in .gz)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])

    def profiled(fn: Callable[[], Any], out: Path | None, trace: Path | None = None) -> Any:
        with profile(activities=activities) as prof:
            result = fn()
            if args.device == "cuda":
                torch.cuda.synchronize()
        key = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=args.profile))
        if out:
            attr = "self_device_time_total" if args.device == "cuda" else "self_cpu_time_total"
            ops = [
                {"name": e.key, "self_us": getattr(e, attr), "calls": e.count}
                for e in prof.key_averages()
                if getattr(e, attr) > 0
            ]
            ops.sort(key=lambda o: -o["self_us"])
            out.write_text(json.dumps(ops, indent=0))
        if trace:
            prof.export_chrome_trace(str(trace))
        return result

    prox_out = args.profile_out.with_suffix(".prox.json") if args.profile_out else None
    prox_trace = (
        args.trace_out.with_name(args.trace_out.name.replace(".json", ".prox.json", 1))
        if args.trace_out
        else None
    )
    prox = profiled(lambda: engine.compute_logprobs(batch), prox_out, prox_trace)
    seqs = [dataclasses.replace(s, prox_logprobs=p) for s, p in zip(batch, prox, strict=True)]
    profiled(lambda: engine.train_step(seqs, loss_fn), args.profile_out, args.trace_out)


TABLE_COLUMNS = (
    "model",
    "backend",
    "dtype",
    "packed",
    "ranks",
    "context_parallel",
    "params",
    "trainable",
    "tokens",
    "pad_frac",
    "micro_batches",
    "train_s",
    "train_tok_s",
    "prox_tok_s",
    "rl_step_tok_s",
    "mfu",
    "mfu_with_attn",
    "peak_mem_gb",
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape", default="tiny", help=f"comma list of random-init shapes: {', '.join(SHAPES)}"
    )
    parser.add_argument("--model", action="append", default=[], help="HF model directory (repeatable)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", default="bfloat16", help="comma list of float32, bfloat16")
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--completion-len", type=int, default=96)
    parser.add_argument("--jitter", type=float, default=0.5, help="completion length spread (0 = all equal)")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--logprob-chunk-tokens", type=int, default=4096)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    parser.add_argument(
        "--packed",
        choices=["auto", "on", "off"],
        default="auto",
        help="micro-batches as one packed row (auto: CUDA bf16) or padded rows",
    )
    parser.add_argument(
        "--logprob-kernel",
        choices=["auto", "triton", "torch"],
        default="auto",
        help="token logprob/entropy: Triton kernels (auto: where they run) or the torch forms",
    )
    parser.add_argument(
        "--attention-kernel",
        choices=["auto", "flash", "triton"],
        default="auto",
        help="packed attention on CUDA: FlashAttention-2 varlen (flash) or the Triton kernels",
    )
    parser.add_argument(
        "--prox",
        choices=["update", "in-step", "separate"],
        default="update",
        help="pi_prox from the update's forward (as the learner), from a pass inside train_step, or "
        "from a compute_logprobs call before it",
    )
    parser.add_argument(
        "--loss-preset",
        choices=sorted(PRESETS),
        default=LossConfig.preset,
        help="trainer.loss.preset of the step's loss (non-decoupled presets have no pi_prox pass in-step)",
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="train LoRA adapters of this rank (0: every weight)",
    )
    parser.add_argument(
        "--backend",
        default="fsdp2",
        help="comma list of trainer backends: fsdp2, megatron (megatron-core; no --lora, rows always packed)",
    )
    parser.add_argument(
        "--context-parallel",
        type=int,
        default=1,
        metavar="C",
        help="under torchrun: ranks each packed row is split over (fsdp2 and megatron)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="RUN.yaml",
        help="run file whose trainer.optimizer (lr, betas, eps, schedule, clip) the engines use, and "
        "trainer.megatron's model-parallel sizes (default: a run file's defaults)",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak for MFU (cuda default: 989)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile-out", type=Path, default=None, help="with --profile: every op as JSON")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="profile one extra step; print the top N ops"
    )
    parser.add_argument(
        "--trace-out", type=Path, default=None, help="with --profile: Chrome trace of the step"
    )
    harness.add_output_args(parser)
    args = parser.parse_args()
    unknown = set(args.backend.split(",")) - {"fsdp2", "megatron"}
    if unknown or ("megatron" in args.backend and args.lora):
        parser.error(f"--backend takes fsdp2 and megatron (LoRA on fsdp2 only), got {args.backend!r}")
    lead = int(os.environ.get("RANK", "0")) == 0  # under torchrun every rank runs every case
    configure_logging(level="info" if lead else "warning")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    dtypes = [d for d in args.dtype.split(",") if d]
    shapes = [s for s in args.shape.split(",") if s] if not args.model or args.shape != "tiny" else []
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        targets = [(build_random_model(s, Path(tmp) / s), s) for s in shapes]
        targets += [(Path(m).expanduser(), Path(m).name) for m in args.model]
        if "WORLD_SIZE" in os.environ:  # after the models are written: transformers saves on rank 0 only
            init_distributed(args.device)
        # fsdp2 first: the megatron engine leaves a process group behind, which FSDP2 would shard over.
        for backend in sorted(set(args.backend.split(",")), key=("fsdp2", "megatron").index):
            for model_dir, label in targets:
                for dtype in dtypes:
                    rows.append(bench_one(model_dir, label, dtype, backend, args))
                    if lead:
                        harness.print_table(rows[-1:], TABLE_COLUMNS)
    if not lead:
        return
    print()
    harness.print_table(rows, TABLE_COLUMNS)
    result = harness.make_result(
        "trainer", args, rows, METRICS, device=args.device, drop=("profile_out", "trace_out")
    )
    harness.emit(result, args.out, args.save_baseline)


if __name__ == "__main__":
    main()
