"""Token sampling of the local engine: one token per row and its exact log-prob.

Per row: temperature, then top-k, then top-p shape the distribution, and a token is drawn from it
by inverse CDF with a uniform the caller supplies (so a seeded request's tokens depend only on its
own uniforms). The reported log-prob is under exactly that distribution. Temperature 0 is greedy and
reports the log-prob under the raw (temperature 1, unfiltered) softmax.

`sample_tokens` handles every row; `decode_draws` is the device-side form a slots decode step runs
(and a CUDA graph captures), valid for rows without top-k / top-p (`is_filtered`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from areal_async.engines.base import SamplingParams

_NO_TOP_P = 2.0  # a top_p the cumulative mass never reaches, so float rounding never filters a token


def draw_tokens(
    scores_BV: torch.Tensor, uniforms_B: torch.Tensor, greedy_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of softmax(scores) by inverse CDF with `uniforms_B`, the argmax where `greedy_B`;
    returns (token ids [B], their log-probs under softmax(scores) [B]).

    A greedy row walks the CDF of its maximal scores with u = 0, which lands on the first of them (as
    `argmax` does) without an arg-reduction over the vocabulary. A zero-probability token never raises
    the CDF, so `right=True` never lands on it."""
    logprobs_BV = scores_BV.log_softmax(dim=-1)
    top_B1 = scores_BV.amax(dim=-1, keepdim=True)
    weights_BV = torch.where(greedy_B[:, None], (scores_BV == top_B1).float(), logprobs_BV.exp())
    cdf_BV = weights_BV.cumsum(dim=-1)
    # keep u * total strictly below the total despite float32 rounding
    u_B = torch.where(greedy_B, 0.0, uniforms_B.clamp(max=1 - 1e-6))
    tokens_B = torch.searchsorted(cdf_BV, u_B[:, None] * cdf_BV[:, -1:], right=True)[:, 0]
    tokens_B = tokens_B.clamp(max=scores_BV.shape[-1] - 1)
    return tokens_B, logprobs_BV.gather(1, tokens_B[:, None])[:, 0]


def is_filtered(params: SamplingParams, vocab: int) -> bool:
    """Whether top-k or top-p cut this request's distribution (never for greedy rows)."""
    if params.temperature == 0:
        return False
    return bool(params.top_k and params.top_k < vocab) or params.top_p < 1


def sample_tokens(
    logits_BV: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (token ids [B], log-probs [B] under the sampled distribution).

    Per row: temperature, then top-k, then top-p, then inverse-CDF sampling from the processed
    distribution with that row's uniform in [0, 1). Temperature 0 rows take the argmax and report the
    log-prob under the raw softmax.
    """
    logits_BV = logits_BV.float()
    vocab = logits_BV.shape[1]
    device = logits_BV.device
    greedy = [p.temperature == 0 for p in params]
    temps = torch.tensor(
        [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)], device=device
    )
    scores_BV = logits_BV / temps[:, None]
    if any(is_filtered(p, vocab) for p in params):
        top_k = [p.top_k if p.top_k and not g else vocab for g, p in zip(greedy, params, strict=True)]
        top_p = [p.top_p if p.top_p < 1 and not g else _NO_TOP_P for g, p in zip(greedy, params, strict=True)]
        sorted_BV, order_BV = scores_BV.sort(dim=-1, descending=True)
        kth_B1 = sorted_BV.gather(1, torch.tensor(top_k, device=device)[:, None].clamp(max=vocab) - 1)
        sorted_BV = sorted_BV.masked_fill(sorted_BV < kth_B1, float("-inf"))
        probs_BV = sorted_BV.softmax(dim=-1)
        mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV
        drop_sorted_BV = mass_before_BV >= torch.tensor(top_p, device=device)[:, None]
        drop_sorted_BV |= sorted_BV == float("-inf")
        drop_sorted_BV[:, 0] = False
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(1, order_BV, drop_sorted_BV)
        scores_BV = scores_BV.masked_fill(drop_BV, float("-inf"))
    return draw_tokens(
        scores_BV,
        torch.tensor(list(uniforms), dtype=torch.float32, device=device),
        torch.tensor(greedy, device=device),
    )


def decode_draws(logits_BV: torch.Tensor, inputs_B5: torch.Tensor) -> torch.Tensor:
    """One draw per row of `slot_decode_forward`'s logits from its tempered, unfiltered distribution
    (`draw_tokens`); returns token ids and their log-probs [2, B] as float64 (one copy to the host).
    Rows with top-k / top-p are sampled from the logits instead."""
    tokens_B, logprobs_B = draw_tokens(
        logits_BV.float() / inputs_B5[:, 2:3], inputs_B5[:, 3], inputs_B5[:, 4] > 0
    )
    return torch.stack([tokens_B.double(), logprobs_B.double()])
