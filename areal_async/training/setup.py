"""How a training engine is set up, the same for both backends: the torchrun process group, the
training dtype, and AdamW with its learning-rate schedule.

`init_distributed` joins torchrun's group (gloo on CPU, NCCL on CUDA). `resolve_train_dtype` turns
`trainer.dtype` into what autocast uses: `auto` is bfloat16 only where bf16 matmuls are native
(`fast_bf16`). `make_optimizer` builds AdamW (fused on CUDA) with `lr_factor`'s linear warm-up, then
constant or cosine decay to `min_lr_ratio` of the peak.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from typing import Literal

import structlog
import torch
import torch.distributed as dist
from torch import nn

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


def make_optimizer(
    params: list[nn.Parameter],
    device: torch.device,
    *,
    lr: float,
    betas: Sequence[float],
    eps: float,
    weight_decay: float,
    warmup_steps: int,
    total_steps: int,
    lr_schedule: Literal["constant", "cosine"],
    min_lr_ratio: float,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over `params` (fused on CUDA) and its `lr_factor` schedule."""
    optimizer = torch.optim.AdamW(
        params,
        lr=lr,
        betas=(float(betas[0]), float(betas[1])),
        eps=eps,
        weight_decay=weight_decay,
        **({"fused": True} if device.type == "cuda" else {}),
    )

    schedule = functools.partial(
        lr_factor,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        schedule=lr_schedule,
        min_lr_ratio=min_lr_ratio,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
