"""Advantages for outcome-reward RL: shaping, group and batch normalisation, KL to a reference.

Shape suffixes: N prompt groups, G completions per group, B = N * G completion rows (group-major:
row ``n * G + g`` is completion ``g`` of group ``n``), T token positions (padded). ``mask_BT`` is 1 on
the completion tokens that carry loss and 0 on prompt and padding.

Pipeline of ``compute_advantages`` (AReaL's order, gamma = lambda = 1, no critic):

1. DAPO overlong penalty added to the raw reward (``overlong_buffer > 0``);
2. shaping ``clip((r + reward_bias) * reward_scale, -reward_clip, reward_clip)``;
3. group advantage: ``r - baseline`` (group mean, leave-one-out mean, or none), divided by the
   group's reward std (unbiased) when ``group_std``;
4. the sequence advantage is placed on the last completion token and, with ``kl_in_reward``, a per-token
   ``-kl_coef * KL`` is added; the token advantage is the return-to-go. Without the KL this is the
   sequence advantage broadcast over the completion tokens;
5. ``batch_adv_norm``: masked mean/std normalisation over every valid token of the batch.

Every output is 0 outside ``mask_BT``. Dynamic sampling is not applied here: the trainer drops a group
before batching when ``dynamic_sampling_keep`` says so. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

Baseline = Literal["mean", "loo", "none"]
KLEstimator = Literal["k1", "k2", "k3"]

ADVANTAGE_FIELDS: tuple[str, ...] = (
    "reward_bias",
    "reward_scale",
    "reward_clip",
    "group_baseline",
    "group_std",
    "batch_adv_norm",
    "kl_coef",
    "kl_estimator",
    "kl_in_reward",
    "overlong_buffer",
    "overlong_penalty",
)
"""LossConfig fields that ``compute_advantages`` takes as keywords of the same name."""

_MAX_ABS_LOG_RATIO = 20.0


def shape_rewards(
    rewards: Tensor, bias: float = 0.0, scale: float = 1.0, clip: float | None = None
) -> Tensor:
    """``clip((rewards + bias) * scale, -clip, clip)`` in float32; ``clip=None`` leaves it unclipped."""
    shaped = (rewards.float() + bias) * scale
    if clip is not None:
        if clip <= 0:
            raise ValueError(f"reward clip must be > 0 or None, got {clip}")
        shaped = shaped.clamp(-clip, clip)
    return shaped


def group_advantages(
    rewards_NG: Tensor, baseline: Baseline = "mean", use_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Group-relative advantages over the last dimension (one group of G completions).

    ``mean``: r - mean(group); ``loo``: r - mean(others) (RLOO); ``none``: r. With ``use_std`` the result
    is divided by ``std(group) + eps`` (unbiased std), so a group of equal rewards gets 0 everywhere.
    Accepts ``[G]`` or ``[..., G]``.
    """
    rewards = rewards_NG.float()
    size = rewards.shape[-1]
    if baseline == "mean":
        adv = rewards - rewards.mean(-1, keepdim=True)
    elif baseline == "loo":
        if size < 2:
            raise ValueError(f"the leave-one-out baseline needs groups of >= 2, got {size}")
        adv = rewards - (rewards.sum(-1, keepdim=True) - rewards) / (size - 1)
    elif baseline == "none":
        adv = rewards.clone()
    else:
        raise ValueError(f"group baseline must be 'mean', 'loo' or 'none', got {baseline!r}")
    if use_std:
        if size < 2:
            raise ValueError(f"group std needs groups of >= 2, got {size}")
        adv = adv / (rewards.std(-1, keepdim=True) + eps)
    return adv


def place_outcome_rewards(rewards_B: Tensor, mask_BT: Tensor) -> Tensor:
    """Token rewards: ``rewards_B[b]`` on the last valid token of row b, 0 elsewhere (and on empty rows)."""
    mask = mask_BT.bool()
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    last_B = (mask * positions).amax(-1) - 1  # -1 on rows without a valid token
    rows = last_B >= 0
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    out[rows, last_B[rows]] = rewards_B.float()[rows]
    return out


def returns_to_go(rewards_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Undiscounted return: sum of the valid token rewards from t to the end of the row, 0 off-mask."""
    mask = mask_BT.float()
    flipped = torch.flip(rewards_BT.float() * mask, dims=[-1])
    return torch.flip(torch.cumsum(flipped, dim=-1), dims=[-1]) * mask


def batch_normalize(adv_BT: Tensor, mask_BT: Tensor, eps: float = 1e-6) -> Tensor:
    """``(adv - mean) / (std + eps)`` with mean and unbiased std over the valid tokens; 0 off-mask.

    With fewer than two valid tokens the std is taken as 0.
    """
    mask = mask_BT.float()
    count = mask.sum()
    mean = (adv_BT.float() * mask).sum() / count.clamp(min=1.0)
    centered = (adv_BT.float() - mean) * mask
    var = (centered**2).sum() / (count - 1.0).clamp(min=1.0)
    return centered / (var.sqrt() + eps)


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: KLEstimator = "k1") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL divergence").

    With ``log r = logprobs - ref_logprobs`` (clamped to [-20, 20] so k3 stays finite):
    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r. Differentiable in both inputs.
    """
    log_ratio = (logprobs.float() - ref_logprobs.float()).clamp(-_MAX_ABS_LOG_RATIO, _MAX_ABS_LOG_RATIO)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"kl estimator must be 'k1', 'k2' or 'k3', got {kind!r}")


def apply_kl_penalty(
    rewards_BT: Tensor,
    logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor,
    mask_BT: Tensor,
    *,
    kl_coef: float,
    kind: KLEstimator = "k1",
) -> Tensor:
    """Token rewards minus ``kl_coef * KL`` on the valid tokens (the KL-in-reward of PPO-RLHF)."""
    mask = mask_BT.bool()
    kl = kl_estimate(
        torch.where(mask, logprobs_BT.float(), 0.0), torch.where(mask, ref_logprobs_BT.float(), 0.0), kind
    )
    return torch.where(mask, rewards_BT.float() - kl_coef * kl, 0.0)


def overlong_penalty(
    lengths: Tensor | Sequence[int], max_new_tokens: int, buffer: int, factor: float
) -> Tensor:
    """DAPO's soft overlong penalty per completion length (float32, same shape as ``lengths``).

    0 up to ``max_new_tokens - buffer``, then linear down to ``-factor`` at ``max_new_tokens`` (and
    ``-factor`` beyond). ``buffer = 0`` turns it off.
    """
    lengths_t = torch.as_tensor(lengths).float()
    if buffer <= 0:
        return torch.zeros_like(lengths_t)
    if buffer > max_new_tokens:
        raise ValueError(
            f"overlong_buffer {buffer} exceeds max_new_tokens {max_new_tokens}; set trainer.loss.overlong_buffer "
            f"<= rollout.sampling.max_new_tokens (DAPO used 20% of the budget)"
        )
    over = (lengths_t - (max_new_tokens - buffer)).clamp(min=0.0)
    return (-over / buffer * factor).clamp(min=-factor)


# compute_advantages has a keyword named overlong_penalty (the LossConfig field); keep the function reachable.
_overlong_penalty = overlong_penalty


def dynamic_sampling_keep(rewards_G: Tensor | Sequence[float]) -> bool:
    """DAPO dynamic sampling: False when every reward of the group is equal (no learning signal)."""
    rewards = torch.as_tensor(rewards_G).flatten()
    if rewards.numel() == 0:
        return False
    return bool((rewards != rewards[0]).any())


def compute_advantages(
    rewards_NG: Tensor,
    mask_BT: Tensor,
    *,
    reward_bias: float = 0.0,
    reward_scale: float = 1.0,
    reward_clip: float | None = None,
    group_baseline: Baseline = "mean",
    group_std: bool = True,
    batch_adv_norm: bool = True,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k1",
    kl_in_reward: bool = False,
    overlong_buffer: int = 0,
    overlong_penalty: float = 1.0,
    max_new_tokens: int | None = None,
    lengths_B: Tensor | None = None,
    logprobs_BT: Tensor | None = None,
    ref_logprobs_BT: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """Token advantages ``adv_BT`` for a batch of groups (see the module docstring for the pipeline).

    ``rewards_NG``: raw outcome rewards, one row per group. ``mask_BT``: B = N * G rows, group-major.
    Keywords named like LossConfig fields take those fields (``ADVANTAGE_FIELDS``). ``max_new_tokens``
    is needed with ``overlong_buffer > 0``; completion lengths default to ``mask_BT.sum(-1)``.
    With ``kl_in_reward`` and ``kl_coef > 0``, ``logprobs_BT`` (behaviour) and ``ref_logprobs_BT`` are
    needed. Other KL settings are ignored here (``policy_loss`` adds the KL as a loss term).
    """
    if rewards_NG.ndim != 2:
        raise ValueError(f"rewards_NG must be [groups, group_size], got shape {tuple(rewards_NG.shape)}")
    num_groups, group_size = rewards_NG.shape
    if mask_BT.ndim != 2 or mask_BT.shape[0] != num_groups * group_size:
        raise ValueError(
            f"mask_BT must have groups * group_size = {num_groups * group_size} rows, got shape {tuple(mask_BT.shape)}"
        )
    mask = mask_BT.bool()
    rewards = rewards_NG.float()
    if overlong_buffer > 0:
        if max_new_tokens is None:
            raise ValueError("overlong_buffer > 0 needs max_new_tokens")
        lengths = mask.sum(-1) if lengths_B is None else lengths_B
        penalty = _overlong_penalty(lengths, max_new_tokens, overlong_buffer, overlong_penalty)
        rewards = rewards + penalty.to(rewards.device).view(num_groups, group_size)
    rewards = shape_rewards(rewards, reward_bias, reward_scale, reward_clip)
    seq_adv_B = group_advantages(rewards, group_baseline, group_std, eps).flatten()

    if kl_in_reward and kl_coef > 0:
        if logprobs_BT is None or ref_logprobs_BT is None:
            raise ValueError("kl_in_reward with kl_coef > 0 needs logprobs_BT and ref_logprobs_BT")
        token_rewards = place_outcome_rewards(seq_adv_B, mask)
        token_rewards = apply_kl_penalty(
            token_rewards, logprobs_BT, ref_logprobs_BT, mask, kl_coef=kl_coef, kind=kl_estimator
        )
        adv_BT = returns_to_go(token_rewards, mask)
    else:
        adv_BT = seq_adv_B[:, None] * mask.float()

    if batch_adv_norm:
        adv_BT = batch_normalize(adv_BT, mask, eps)
    return adv_BT
