"""Policy loss: decoupled PPO (AReaL eq. 5) with the switches for PPO, GRPO, Dr.GRPO, DAPO and GSPO.

Shape suffixes: B sequences (rows), T token positions (padded). ``mask_BT`` is 1 on the completion
tokens that carry loss, 0 on prompt and padding. Log-probabilities are of the sampled tokens.

Per valid token t of sequence i (computed in float32):

    r    = exp(logp - prox)                  ratio to pi_prox; to pi_behave when decoupled=False
    w    = exp(prox - behave), no gradient   behaviour weight; 1 when decoupled=False
    pg   = max(-A * r, -A * clip(r, 1 - eps_clip_low, 1 + eps_clip_high))
    pg   = min(pg, dual_clip * |A|)          dual clip, binds only where A < 0
    loss = w * pg  (+ kl_coef * KL(pi_theta || pi_ref) when the KL is a loss term)

Behaviour cap (``behave_cap``, None = uncapped): ``mask`` gives tokens with w > cap a loss of 0 (PG
and KL term) but keeps them in the denominator, so dropping tokens never inflates the others'
gradients; ``clamp`` uses min(w, cap). GSPO (``ratio_level="sequence"``): r is replaced by
``s_i,t = sg[s_i] * exp(logp_t - sg[logp_t])`` with ``s_i = exp(mean_t(logp - prox))`` over the
sequence's valid tokens: every token has the value s_i, and the gradient of token t is s_i * grad logp_t,
which is GSPO's gradient. The behaviour weight stays per token (AReaL Prop. 1 is token-wise).

Aggregation, exact across micro-batches and ranks:

    loss = sum_{i,t} loss_i,t * weight_i,t / denominator

| loss_agg                  | weight_i,t | loss_denominator           | meaning                          |
|---------------------------|------------|----------------------------|----------------------------------|
| ``token_mean``            | 1          | valid tokens               | mean over all tokens (DAPO, AReaL) |
| ``seq_mean_token_mean``   | 1 / L_i    | sequences                  | GRPO: mean of per-sequence means |
| ``seq_mean_token_sum_norm`` | 1        | sequences * max_new_tokens | Dr.GRPO: token sum / constant    |

``weight_i,t`` depends only on sequence i and ``loss_denominator`` is a sum over sequences. The trainer
sums ``loss_denominator`` of every micro-batch of every rank (one all-reduce) and passes that global
value as ``denominator`` to every ``policy_loss`` call; the losses (and gradients) of all micro-batches
on all ranks then add up to exactly the loss of the whole batch. L_i is always the original valid count.
Data-parallel gradient reduction that averages over ranks (FSDP's default) divides this sum by the world
size: scale the loss by the world size, or reduce gradients by sum.

Supervised fine-tuning (``sft_loss``, ``areal-async sft``) uses the same contract with the plain
negative log-likelihood: ``loss = -sum_{i,t} logp_i,t * mask_i,t / denominator``, the denominator
being the trained tokens of the whole step, so the step loss is the mean NLL per trained token.

Stats (detached float32 0-d tensors): keys in ``MAX_STATS`` combine by max (all-reduce MAX), every other
key by sum (all-reduce SUM); ``merge_loss_stats`` and ``summarize_loss_stats`` do this on one process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from torch import Tensor

from areal_async.algo.advantages import KLEstimator, kl_estimate

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
CapMode = Literal["mask", "clamp"]
RatioLevel = Literal["token", "sequence"]

LOSS_AGGS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")

SUM_STATS: tuple[str, ...] = (
    "tokens",  # valid tokens (original mask)
    "sequences",  # rows with at least one valid token
    "clipped_tokens",  # tokens where the PPO clip chose the clipped term
    "dual_clipped_tokens",  # tokens where the dual clip bound the loss
    "capped_tokens",  # tokens with w > behave_cap (dropped in mask mode, clamped in clamp mode)
    "behave_weight_sum",  # sum of the uncapped w over valid tokens
    "ratio_sum",  # sum of r (s_i for GSPO) over valid tokens
    "approx_kl_sum",  # sum of k3 estimates of KL(pi_prox || pi_theta) over valid tokens
    "ref_kl_sum",  # sum of the reference KL estimate over valid tokens (0 unless it is a loss term)
)
"""Stats that combine across micro-batches and ranks by sum."""

MAX_STATS: tuple[str, ...] = (
    "behave_weight_max",  # largest uncapped w (0 when there are no valid tokens)
    "ratio_max",  # largest r (0 when there are no valid tokens)
)
"""Stats that combine across micro-batches and ranks by max."""

# Keeps w and its stats finite; far above any sensible cap.
_MAX_LOG_BEHAVE_WEIGHT = 20.0


def loss_token_weights(mask_BT: Tensor, loss_agg: LossAgg = "token_mean") -> Tensor:
    """Per-token aggregation weights (float32, 0 off-mask); depend only on the token's own row."""
    mask = mask_BT.float()
    if loss_agg in ("token_mean", "seq_mean_token_sum_norm"):
        return mask
    if loss_agg == "seq_mean_token_mean":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1.0)
    raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")


def loss_denominator(
    mask_BT: Tensor, loss_agg: LossAgg = "token_mean", max_new_tokens: int | None = None
) -> float:
    """This micro-batch's share of the global denominator; sum it over micro-batches and ranks.

    ``token_mean``: valid tokens; ``seq_mean_token_mean``: rows with a valid token;
    ``seq_mean_token_sum_norm``: those rows times ``max_new_tokens``.
    """
    mask = mask_BT.bool()
    if loss_agg == "token_mean":
        return float(mask.sum())
    sequences = float(mask.any(-1).sum())
    if loss_agg == "seq_mean_token_mean":
        return sequences
    if loss_agg == "seq_mean_token_sum_norm":
        if max_new_tokens is None or max_new_tokens <= 0:
            raise ValueError(
                f"loss_agg 'seq_mean_token_sum_norm' needs max_new_tokens > 0, got {max_new_tokens}"
            )
        return sequences * max_new_tokens
    raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")


def policy_loss(
    logprobs_BT: Tensor,
    prox_logprobs_BT: Tensor | None,
    behave_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    dual_clip: float | None = None,
    decoupled: bool = True,
    behave_cap: float | None = 5.0,
    behave_cap_mode: CapMode = "mask",
    ratio_level: RatioLevel = "token",
    loss_agg: LossAgg = "token_mean",
    max_new_tokens: int | None = None,
    denominator: float | Tensor | None = None,
    ref_logprobs_BT: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k1",
    kl_in_reward: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO loss of one micro-batch and its summable stats (see the module docstring).

    ``logprobs_BT`` carries the gradient (pi_theta); ``prox_logprobs_BT`` (pi_prox, may be None when
    ``decoupled=False``) and ``behave_logprobs_BT`` (pi_behave, from the engine) are constants.
    ``denominator``: the global ``loss_denominator`` (summed over micro-batches and ranks); None uses
    this micro-batch's own, which is right only when it is the whole batch. ``max_new_tokens`` is used
    only then, for ``seq_mean_token_sum_norm``. The KL to ``ref_logprobs_BT`` is added as a loss term
    when ``kl_coef > 0`` and not ``kl_in_reward`` (then the advantages already hold it).
    """
    _check_settings(
        eps_clip_low, eps_clip_high, dual_clip, behave_cap, behave_cap_mode, ratio_level, loss_agg
    )
    mask = mask_BT.bool()
    valid = mask.float()
    logp = logprobs_BT.float()
    behave = behave_logprobs_BT.float()
    if decoupled:
        if prox_logprobs_BT is None:
            raise ValueError("decoupled=True needs prox_logprobs_BT (one no-grad forward before the update)")
        center = prox_logprobs_BT.float().detach()
    else:
        center = behave.detach()
    # Padding may hold garbage (even -inf); zero it before exp so neither values nor gradients see it.
    log_ratio = torch.where(mask, logp - center, 0.0)
    if ratio_level == "token":
        ratio = torch.exp(log_ratio)
    else:
        seq_log_ratio = log_ratio.detach().sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1.0)
        ratio = torch.exp(seq_log_ratio + torch.where(mask, logp - logp.detach(), 0.0))
    adv = torch.where(mask, advantages_BT.float(), 0.0)

    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clipped = mask & (pg_clipped > pg_unclipped)
    dual_clipped = torch.zeros_like(mask)
    if dual_clip is not None:
        bound = dual_clip * adv.abs()
        dual_clipped = mask & (pg > bound)
        pg = torch.minimum(pg, bound)

    keep = mask
    capped = torch.zeros_like(mask)
    if decoupled:
        log_w = torch.where(mask, center - behave, 0.0).clamp(max=_MAX_LOG_BEHAVE_WEIGHT)
        raw_weight = torch.exp(log_w).detach()
        weight = raw_weight
        if behave_cap is not None:
            capped = mask & (raw_weight > behave_cap)
            if behave_cap_mode == "mask":
                keep = mask & ~capped
                weight = torch.where(capped, 0.0, raw_weight)
            else:
                weight = raw_weight.clamp(max=behave_cap)
    else:
        raw_weight = valid
        weight = valid
    per_token = weight * pg

    ref_kl = torch.zeros_like(valid)
    if kl_coef > 0 and not kl_in_reward:
        if ref_logprobs_BT is None:
            raise ValueError("kl_coef > 0 with kl_in_reward=False needs ref_logprobs_BT")
        ref_kl = kl_estimate(
            torch.where(mask, logp, 0.0), torch.where(mask, ref_logprobs_BT.float(), 0.0), kl_estimator
        )
        per_token = per_token + kl_coef * ref_kl
    per_token = torch.where(keep, per_token, 0.0)

    if denominator is None:
        denominator = loss_denominator(mask, loss_agg, max_new_tokens)
    if isinstance(denominator, int | float) and denominator <= 0:
        raise ValueError(f"denominator must be > 0 (the global token or sequence count), got {denominator}")
    loss = (per_token * loss_token_weights(mask, loss_agg)).sum() / denominator

    with torch.no_grad():
        ratio_d = ratio.detach()
        approx_kl = kl_estimate(torch.where(mask, center, 0.0), torch.where(mask, logp.detach(), 0.0), "k3")
        stats = {
            "tokens": valid.sum(),
            "sequences": mask.any(-1).float().sum(),
            "clipped_tokens": clipped.float().sum(),
            "dual_clipped_tokens": dual_clipped.float().sum(),
            "capped_tokens": capped.float().sum(),
            "behave_weight_sum": (raw_weight * valid).sum(),
            "ratio_sum": (ratio_d * valid).sum(),
            "approx_kl_sum": (approx_kl * valid).sum(),
            "ref_kl_sum": (ref_kl.detach() * valid).sum(),
            "behave_weight_max": _masked_max(raw_weight, mask),
            "ratio_max": _masked_max(ratio_d, mask),
        }
    return loss, stats


def sft_loss(
    logprobs_BT: Tensor, mask_BT: Tensor, *, denominator: Tensor | float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative log-likelihood of the trained tokens (``mask_BT``) divided by the step's global
    ``denominator`` (its trained tokens), and the stat ``sequences`` (rows with a trained token)."""
    mask = mask_BT.to(logprobs_BT.dtype)
    loss = -(logprobs_BT * mask).sum() / denominator
    return loss, {"sequences": (mask.sum(-1) > 0).sum().detach().float()}


def merge_loss_stats(*stats: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Combine the stats of several micro-batches (sum, or max for ``MAX_STATS``)."""
    merged: dict[str, Tensor] = {}
    for part in stats:
        for key, value in part.items():
            if key not in merged:
                merged[key] = value.detach().clone()
            elif key in MAX_STATS:
                merged[key] = torch.maximum(merged[key], value.detach())
            else:
                merged[key] = merged[key] + value.detach()
    return merged


def summarize_loss_stats(stats: Mapping[str, Tensor]) -> dict[str, float]:
    """Per-token means and fractions for logging, from combined (global) stats."""
    tokens = max(float(stats["tokens"]), 1.0)
    return {
        "clip_frac": float(stats["clipped_tokens"]) / tokens,
        "dual_clip_frac": float(stats["dual_clipped_tokens"]) / tokens,
        "capped_frac": float(stats["capped_tokens"]) / tokens,
        "behave_weight_mean": float(stats["behave_weight_sum"]) / tokens,
        "behave_weight_max": float(stats["behave_weight_max"]),
        "ratio_mean": float(stats["ratio_sum"]) / tokens,
        "ratio_max": float(stats["ratio_max"]),
        "approx_kl": float(stats["approx_kl_sum"]) / tokens,
        "ref_kl": float(stats["ref_kl_sum"]) / tokens,
        "tokens": float(stats["tokens"]),
        "sequences": float(stats["sequences"]),
    }


def _masked_max(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    # Values are positive (weights, ratios), so 0 stands for "no valid token" and no host sync is needed.
    return torch.where(mask_BT, values_BT, 0.0).amax()


def _check_settings(
    eps_clip_low: float,
    eps_clip_high: float,
    dual_clip: float | None,
    behave_cap: float | None,
    behave_cap_mode: str,
    ratio_level: str,
    loss_agg: str,
) -> None:
    if not 0.0 <= eps_clip_low < 1.0:
        raise ValueError(f"eps_clip_low must be in [0, 1), got {eps_clip_low}")
    if eps_clip_high < 0.0:
        raise ValueError(f"eps_clip_high must be >= 0, got {eps_clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 or None, got {dual_clip}")
    if behave_cap is not None and behave_cap <= 1.0:
        raise ValueError(f"behave_cap must be > 1 or None, got {behave_cap}")
    if behave_cap_mode not in ("mask", "clamp"):
        raise ValueError(f"behave_cap_mode must be 'mask' or 'clamp', got {behave_cap_mode!r}")
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"ratio_level must be 'token' or 'sequence', got {ratio_level!r}")
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
