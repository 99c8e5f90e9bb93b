"""How a training engine is set up, the same for both backends: the torchrun process group, the
device and training dtype, the token-logprob kernel, and AdamW with its learning-rate schedule.

Both engines take the run file's trainer section (`TrainerConfig`, `areal_async/config_trainer.py`)
and nothing else of the run's, so an engine a test or benchmark builds trains with the settings a
run with the same section gets; the defaults are that section's, written once there.

`init_distributed` joins torchrun's group (gloo on CPU, NCCL on CUDA). `place` checks the options
that are not run-file keys and resolves the device, the autocast dtype (`resolve_train_dtype`:
`auto` is bfloat16 only where bf16 matmuls are native, `fast_bf16`) and the logprob kernel.
`make_optimizer` builds AdamW (fused on CUDA) from `trainer.optimizer` with `lr_factor`'s linear
warm-up, then constant or cosine decay to `min_lr_ratio` of the peak over `trainer.total_steps`.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Literal

import structlog
import torch
import torch.distributed as dist
from torch import nn

from areal_async.config_trainer import OptimizerConfig, TrainerConfig
from areal_async.ops import logprobs
from areal_async.ops.logprobs import LogprobFn

log = structlog.get_logger(__name__)


def init_distributed(device: str = "cpu") -> tuple[int, int]:
    """Join the torchrun process group if this process was started by torchrun.

    Returns `(rank, world_size)`; `(0, 1)` without torchrun's environment. gloo on CPU,
    NCCL on CUDA (the CUDA device is `LOCAL_RANK`).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
        return 0, 1
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def fast_bf16(device: torch.device) -> bool:
    """True where bf16 matmuls run natively: CUDA with bf16, or a CPU with AVX-512 BF16 / AMX.

    On other CPUs (AVX2 only) oneDNN emulates them: measured 43x slower than float32 for a
    SmolLM2-sized matmul on an AMD EPYC with AVX2.
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def resolve_train_dtype(dtype: str, device: torch.device) -> str:
    """``auto`` -> bfloat16 where it is fast, float32 elsewhere; a slow explicit bfloat16 warns."""
    if dtype == "float32":
        return dtype
    fast = fast_bf16(device)
    if dtype == "auto":
        return "bfloat16" if fast else "float32"
    if not fast:
        log.warning(
            "bfloat16 autocast is emulated on this device and far slower than float32",
            device=str(device),
            cpu_capability=torch.backends.cpu.get_cpu_capability(),
            fix="set trainer.dtype: auto (or float32)",
        )
    return dtype


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    schedule: Literal["constant", "cosine"],
    min_lr_ratio: float,
) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warm-up, then constant or cosine."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Placement:
    """Where and in what precision an engine trains, and how it computes token logprobs."""

    device: torch.device
    """`cuda` is this process's current CUDA device (torchrun's `LOCAL_RANK`)."""

    autocast_dtype: torch.dtype | None
    """bfloat16 autocast over float32 master weights, or None for plain float32."""

    logprob_fn: LogprobFn
    """Token logprobs and entropy over the logits (`ops/logprobs.pick_logprob_fn`)."""


def place(
    trainer: TrainerConfig,
    *,
    temperature: float,
    logprob_chunk_tokens: int,
    dtype: Literal["auto", "float32", "bfloat16"] | None = None,
) -> Placement:
    """Check the engine options a run file does not hold and resolve `trainer`'s device, dtype
    (`dtype` overrides `trainer.dtype` where a backend must) and logprob kernel."""
    if temperature <= 0:
        raise ValueError(
            f"temperature must be > 0, got {temperature}; pass the sampling temperature of the rollouts "
            "(rollout.sampling.temperature)"
        )
    if logprob_chunk_tokens < 1:
        raise ValueError(
            f"logprob_chunk_tokens must be >= 1, got {logprob_chunk_tokens}; pass the logits rows per "
            "logprob chunk (4096 by default)"
        )
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if trainer.device == "cuda"
        else torch.device(trainer.device)
    )
    train_dtype = resolve_train_dtype(dtype or trainer.dtype, device)
    return Placement(
        device=device,
        autocast_dtype=torch.bfloat16 if train_dtype == "bfloat16" else None,
        logprob_fn=logprobs.pick_logprob_fn(device, trainer.compile, kernel=trainer.logprob_kernel),
    )


def make_optimizer(
    params: list[nn.Parameter], device: torch.device, optimizer: OptimizerConfig, *, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over `params` (fused on CUDA) with `optimizer`'s settings, and its `lr_factor` schedule
    over `total_steps` optimizer steps. `optimizer.grad_clip` is the engine's to apply."""
    adamw = torch.optim.AdamW(
        params,
        lr=optimizer.lr,
        betas=(float(optimizer.betas[0]), float(optimizer.betas[1])),
        eps=optimizer.eps,
        weight_decay=optimizer.weight_decay,
        **({"fused": True} if device.type == "cuda" else {}),
    )
    schedule = functools.partial(
        lr_factor,
        warmup_steps=optimizer.warmup_steps,
        total_steps=total_steps,
        schedule=optimizer.lr_schedule,
        min_lr_ratio=optimizer.min_lr_ratio,
    )
    return adamw, torch.optim.lr_scheduler.LambdaLR(adamw, schedule)
