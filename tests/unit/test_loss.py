"""Unit tests of areal_async.algo.loss: values and gradients computed by hand on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from areal_async.algo.loss import (
    MAX_STATS,
    SUM_STATS,
    loss_denominator,
    loss_token_weights,
    merge_loss_stats,
    policy_loss,
    summarize_loss_stats,
)

LN2 = math.log(2.0)


def _logprobs_from_ratios(base: torch.Tensor, ratios: list[list[float]]) -> torch.Tensor:
    """base + log(ratio), as a leaf that records gradients."""
    logs = torch.log(torch.tensor(ratios, dtype=torch.float32))
    return (base + logs).detach().requires_grad_(True)


def _mask(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


# Shared two-row batch: row 0 has 2 valid tokens, row 1 has 1 (the rest is padding).
MASK = _mask([[1, 1, 0], [1, 0, 0]])
BEHAVE = torch.full((2, 3), -1.0)


def test_plain_ppo_token_mean_matches_the_hand_computed_surrogate() -> None:
    """Plain PPO (decoupled=False): r = pi/pi_behave, loss = sum(max(-A r, -A clip r)) / tokens.

    Ratios 1.1, 0.9, 1.0 are inside [0.8, 1.2], so pg = -A r: -1*1.1 = -1.1, -(-1)*0.9 = 0.9, -2*1.0 = -2.
    loss = (-1.1 + 0.9 - 2) / 3 = -2.2 / 3; d loss / d logp_t = -A r / 3.
    """
    logp = _logprobs_from_ratios(BEHAVE, [[1.1, 0.9, 7.0], [1.0, 3.0, 3.0]])
    adv = torch.tensor([[1.0, -1.0, 5.0], [2.0, 9.0, 9.0]])
    loss, stats = policy_loss(logp, None, BEHAVE, adv, MASK, decoupled=False)
    loss.backward()
    assert loss.item() == pytest.approx(-2.2 / 3, rel=1e-5)
    expected_grad = torch.tensor([[-1.1 / 3, 0.9 / 3, 0.0], [-2.0 / 3, 0.0, 0.0]])
    torch.testing.assert_close(logp.grad, expected_grad)
    assert stats["tokens"].item() == 3
    assert stats["clipped_tokens"].item() == 0
    assert stats["ratio_sum"].item() == pytest.approx(1.1 + 0.9 + 1.0, rel=1e-5)


def test_clipping_picks_the_pessimistic_term_and_stops_its_gradient() -> None:
    """Four tokens, eps 0.2, one per case of the PPO clip.

    A=+1, r=1.5: max(-1.5, -1.2) = -1.2 (clipped, no gradient).
    A=-1, r=0.5: max(0.5, 0.8) = 0.8 (clipped, no gradient).
    A=+1, r=0.5: max(-0.5, -0.8) = -0.5 (unclipped, gradient -A r = -0.5).
    A=-1, r=1.5: max(1.5, 1.2) = 1.5 (unclipped, gradient -A r = 1.5).
    loss = (-1.2 + 0.8 - 0.5 + 1.5) / 4 = 0.15.
    """
    behave = torch.zeros(1, 4)
    logp = _logprobs_from_ratios(behave, [[1.5, 0.5, 0.5, 1.5]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    mask = _mask([[1, 1, 1, 1]])
    loss, stats = policy_loss(logp, None, behave, adv, mask, decoupled=False)
    loss.backward()
    assert loss.item() == pytest.approx(0.15, abs=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, -0.5 / 4, 1.5 / 4]]))
    assert stats["clipped_tokens"].item() == 2


def test_clip_higher_widens_only_the_upper_bound() -> None:
    """eps_low 0.2, eps_high 0.28 (DAPO): r = 1.25 with A > 0 is no longer clipped; r = 0.75 with A < 0 still is.

    Symmetric 0.2: pg = [-1.2 (clipped), 0.8 (clipped)], loss = -0.4 / 2 = -0.2.
    Clip-higher:   pg = [-1.25 (free), 0.8 (clipped)], loss = -0.45 / 2 = -0.225, gradient [-1.25/2, 0].
    """
    behave = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    mask = _mask([[1, 1]])
    logp = _logprobs_from_ratios(behave, [[1.25, 0.75]])
    symmetric, sym_stats = policy_loss(logp, None, behave, adv, mask, decoupled=False)
    assert symmetric.item() == pytest.approx(-0.2, abs=1e-6)
    assert sym_stats["clipped_tokens"].item() == 2

    logp = _logprobs_from_ratios(behave, [[1.25, 0.75]])
    higher, high_stats = policy_loss(logp, None, behave, adv, mask, decoupled=False, eps_clip_high=0.28)
    higher.backward()
    assert higher.item() == pytest.approx(-0.225, abs=1e-6)
    assert high_stats["clipped_tokens"].item() == 1
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.25 / 2, 0.0]]))


def test_dual_clip_bounds_the_loss_of_negative_advantages_only() -> None:
    """dual_clip c = 3 caps pg at c |A| where A < 0.

    A=-1, r=5: max(5, 1.2) = 5 (the PPO clip does not bind) -> min(5, 3) = 3 (dual clipped, no gradient).
    A=+1, r=5: max(-5, -1.2) = -1.2 (ordinary clip; -1.2 < 3, untouched).
    A=-2, r=1: pg = 2 < 6, untouched, gradient -A r = 2.
    loss = (3 - 1.2 + 2) / 3.
    """
    behave = torch.zeros(1, 3)
    logp = _logprobs_from_ratios(behave, [[5.0, 5.0, 1.0]])
    adv = torch.tensor([[-1.0, 1.0, -2.0]])
    mask = _mask([[1, 1, 1]])
    loss, stats = policy_loss(logp, None, behave, adv, mask, decoupled=False, dual_clip=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(3.8 / 3, rel=1e-5)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 2.0 / 3]]))
    assert stats["dual_clipped_tokens"].item() == 1
    assert stats["clipped_tokens"].item() == 1

    no_dual, _ = policy_loss(logp.detach(), None, behave, adv, mask, decoupled=False)
    assert no_dual.item() == pytest.approx((5.0 - 1.2 + 2.0) / 3, rel=1e-5)


def test_decoupled_loss_centers_the_clip_on_prox_and_weights_by_prox_over_behave() -> None:
    """pi_prox / pi_behave = 2 and pi_theta / pi_prox = 1.1, A = 1.

    Decoupled: r = 1.1 (inside the clip), w = 2, loss = -w r = -2.2, gradient -w r = -2.2.
    Plain PPO: r = pi_theta / pi_behave = 2.2 -> clipped to 1.2, loss = -1.2, no gradient.
    """
    behave = torch.tensor([[-2.0]])
    prox = behave + LN2
    adv = torch.ones(1, 1)
    mask = _mask([[1]])
    logp = (prox + math.log(1.1)).requires_grad_(True)
    loss, stats = policy_loss(logp, prox, behave, adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx(-2.2, rel=1e-5)
    assert logp.grad.item() == pytest.approx(-2.2, rel=1e-5)
    assert stats["behave_weight_sum"].item() == pytest.approx(2.0, rel=1e-5)
    assert stats["behave_weight_max"].item() == pytest.approx(2.0, rel=1e-5)

    logp = (prox + math.log(1.1)).requires_grad_(True)
    plain, plain_stats = policy_loss(logp, prox, behave, adv, mask, decoupled=False)
    plain.backward()
    assert plain.item() == pytest.approx(-1.2, rel=1e-5)
    assert logp.grad.item() == 0.0
    assert plain_stats["behave_weight_max"].item() == 1.0


def test_behaviour_weight_carries_no_gradient_into_prox_or_behave() -> None:
    """Only pi_theta is differentiated: prox and behave logprobs that require grad get none."""
    behave = torch.tensor([[-2.0, -1.0]], requires_grad=True)
    prox = torch.tensor([[-1.5, -1.2]], requires_grad=True)
    logp = torch.tensor([[-1.4, -1.1]], requires_grad=True)
    loss, _ = policy_loss(logp, prox, behave, torch.ones(1, 2), _mask([[1, 1]]))
    loss.backward()
    assert prox.grad is None
    assert behave.grad is None
    assert logp.grad is not None


def test_cap_mask_drops_tokens_above_the_cap_but_keeps_the_original_denominator() -> None:
    """w = [2, 6, 10], cap 5, mask mode, r = 1, A = 1: per-token loss [-2, 0, 0].

    The denominator stays the original 3 tokens: loss = -2 / 3, gradient [-2/3, 0, 0].
    """
    behave = torch.zeros(1, 3)
    prox = torch.log(torch.tensor([[2.0, 6.0, 10.0]]))
    logp = prox.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, prox, behave, torch.ones(1, 3), _mask([[1, 1, 1]]), behave_cap=5.0)
    loss.backward()
    assert loss.item() == pytest.approx(-2.0 / 3, rel=1e-5)
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0 / 3, 0.0, 0.0]]))
    assert stats["capped_tokens"].item() == 2
    assert stats["tokens"].item() == 3
    assert stats["behave_weight_max"].item() == pytest.approx(10.0, rel=1e-5)
    assert stats["behave_weight_sum"].item() == pytest.approx(18.0, rel=1e-5)


def test_cap_clamp_truncates_the_weight_instead_of_dropping_the_token() -> None:
    """Same tokens, clamp mode: w -> [2, 5, 5], loss = -(2 + 5 + 5) / 3 = -4, gradient [-2, -5, -5] / 3."""
    behave = torch.zeros(1, 3)
    prox = torch.log(torch.tensor([[2.0, 6.0, 10.0]]))
    logp = prox.clone().requires_grad_(True)
    loss, stats = policy_loss(
        logp, prox, behave, torch.ones(1, 3), _mask([[1, 1, 1]]), behave_cap=5.0, behave_cap_mode="clamp"
    )
    loss.backward()
    assert loss.item() == pytest.approx(-4.0, rel=1e-5)
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, -5.0, -5.0]]) / 3)
    assert stats["capped_tokens"].item() == 2


def test_cap_none_applies_the_full_behaviour_weight() -> None:
    """behave_cap=None: w = [2, 6, 10] all applied, loss = -18 / 3 = -6."""
    behave = torch.zeros(1, 3)
    prox = torch.log(torch.tensor([[2.0, 6.0, 10.0]]))
    loss, stats = policy_loss(prox, prox, behave, torch.ones(1, 3), _mask([[1, 1, 1]]), behave_cap=None)
    assert loss.item() == pytest.approx(-6.0, rel=1e-5)
    assert stats["capped_tokens"].item() == 0


def test_cap_mask_keeps_sequence_lengths_for_the_sequence_mean() -> None:
    """seq_mean_token_mean with a capped token: row 0 = (-2 + 0) / 2 (its original L = 2), row 1 = -1 / 1.

    loss = mean over the 2 sequences = (-1 - 1) / 2 = -1.
    """
    behave = torch.zeros(2, 2)
    prox = torch.log(torch.tensor([[2.0, 9.0], [1.0, 1.0]]))
    mask = _mask([[1, 1], [1, 0]])
    loss, _ = policy_loss(prox, prox, behave, torch.ones(2, 2), mask, loss_agg="seq_mean_token_mean")
    assert loss.item() == pytest.approx(-1.0, rel=1e-5)


def test_an_overflowing_behaviour_weight_is_masked_without_nan() -> None:
    """prox - behave = 100 (w would overflow float32): the token is masked and the loss stays finite."""
    behave = torch.tensor([[-101.0, -1.0]])
    prox = torch.tensor([[-1.0, -1.0]])
    logp = prox.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, prox, behave, torch.ones(1, 2), _mask([[1, 1]]))
    loss.backward()
    assert loss.item() == pytest.approx(-0.5, rel=1e-5)
    assert torch.isfinite(logp.grad).all()
    assert torch.isfinite(stats["behave_weight_max"])


def test_padding_with_infinite_logprobs_does_not_poison_loss_or_gradient() -> None:
    """Padded positions may hold -inf or nan; they contribute nothing, also in GSPO and the KL term."""
    logp = torch.tensor([[-1.0, float("-inf")], [-0.5, float("nan")]], requires_grad=True)
    others = torch.tensor([[-1.2, float("-inf")], [-0.4, float("nan")]])
    mask = _mask([[1, 0], [1, 0]])
    adv = torch.tensor([[1.0, float("nan")], [-1.0, 3.0]])
    for level in ("token", "sequence"):
        logp.grad = None
        loss, stats = policy_loss(
            logp, others, others, adv, mask, ratio_level=level, kl_coef=0.1, ref_logprobs_BT=others
        )
        loss.backward()
        assert torch.isfinite(loss)
        assert torch.isfinite(logp.grad).all()
        assert all(torch.isfinite(v) for v in stats.values())


def test_gspo_uses_one_length_normalised_ratio_per_sequence() -> None:
    """ratio_level="sequence": s_i = exp(mean_t log(pi/pi_prox)), the same for every token of row i.

    Row 0 log-ratios [0.2, 0.0] -> s_0 = exp(0.1) = 1.10517 (inside the clip), A = 1: pg = -1.10517 twice.
    Row 1 log-ratio ln 1.5 -> s_1 = 1.5, A = 1: clipped at 1.2, pg = -1.2, no gradient.
    token_mean: loss = (-2 * 1.10517 - 1.2) / 3. Gradient of every row-0 token: -A s_0 / 3, although
    the two token ratios differ (e^0.2 and 1).
    """
    prox = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])
    logp = (prox + torch.tensor([[0.2, 0.0], [math.log(1.5), 0.0]])).requires_grad_(True)
    mask = _mask([[1, 1], [1, 0]])
    loss, stats = policy_loss(logp, prox, prox, torch.ones(2, 2), mask, ratio_level="sequence")
    loss.backward()
    s0 = math.exp(0.1)
    assert loss.item() == pytest.approx((-2 * s0 - 1.2) / 3, rel=1e-5)
    torch.testing.assert_close(logp.grad, torch.tensor([[-s0 / 3, -s0 / 3], [0.0, 0.0]]))
    assert stats["ratio_sum"].item() == pytest.approx(2 * s0 + 1.5, rel=1e-5)
    assert stats["clipped_tokens"].item() == 1


def test_gspo_gradient_equals_the_gradient_of_the_sequence_level_objective() -> None:
    """With seq_mean_token_mean, the token form s_i,t = sg[s_i] exp(logp - sg[logp]) has GSPO's gradient.

    Reference: -(1/S) sum_i min(s_i A_i, clip(s_i) A_i) with s_i = exp(mean_t(logp - prox)) differentiated
    directly. Ratios straddle the clip so both branches appear.
    """
    torch.manual_seed(0)
    prox = -torch.rand(4, 5) * 3
    mask = _mask([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    adv_B = torch.tensor([1.0, -0.5, 2.0, -1.5])
    adv = adv_B[:, None].expand(4, 5)
    logp0 = prox + torch.randn(4, 5) * 0.3

    logp = logp0.clone().requires_grad_(True)
    loss, _ = policy_loss(
        logp, prox, prox, adv, mask, ratio_level="sequence", loss_agg="seq_mean_token_mean", decoupled=False
    )
    loss.backward()

    ref = logp0.clone().requires_grad_(True)
    valid = mask.float()
    s = torch.exp(((ref - prox) * valid).sum(-1) / valid.sum(-1))
    surrogate = torch.minimum(s * adv_B, s.clamp(0.8, 1.2) * adv_B)
    ref_loss = -surrogate.mean()
    ref_loss.backward()

    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    torch.testing.assert_close(logp.grad, ref.grad * valid)


def test_seq_mean_token_mean_averages_each_sequence_then_the_sequences() -> None:
    """Per-token losses [-1.1, 0.9] and [-2] (from the plain PPO case): ((-1.1 + 0.9) / 2 + -2) / 2 = -1.05."""
    logp = _logprobs_from_ratios(BEHAVE, [[1.1, 0.9, 1.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.0, -1.0, 0.0], [2.0, 0.0, 0.0]])
    loss, _ = policy_loss(logp, None, BEHAVE, adv, MASK, decoupled=False, loss_agg="seq_mean_token_mean")
    loss.backward()
    assert loss.item() == pytest.approx(-1.05, rel=1e-5)
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.1 / 4, 0.9 / 4, 0.0], [-2.0 / 2, 0.0, 0.0]]))


def test_seq_mean_token_sum_norm_divides_token_sums_by_max_new_tokens() -> None:
    """Dr.GRPO, max_new_tokens 4: row sums -0.2 and -2 -> (-0.2 / 4 + -2 / 4) / 2 = -0.275."""
    logp = _logprobs_from_ratios(BEHAVE, [[1.1, 0.9, 1.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.0, -1.0, 0.0], [2.0, 0.0, 0.0]])
    loss, _ = policy_loss(
        logp, None, BEHAVE, adv, MASK, decoupled=False, loss_agg="seq_mean_token_sum_norm", max_new_tokens=4
    )
    assert loss.item() == pytest.approx(-0.275, rel=1e-5)


def test_loss_denominator_counts_tokens_sequences_or_sequences_times_budget() -> None:
    """MASK has 3 tokens in 2 rows; an all-padding row counts as no sequence."""
    mask = _mask([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert loss_denominator(mask, "token_mean") == 3.0
    assert loss_denominator(mask, "seq_mean_token_mean") == 2.0
    assert loss_denominator(mask, "seq_mean_token_sum_norm", max_new_tokens=8) == 16.0
    with pytest.raises(ValueError, match="max_new_tokens"):
        loss_denominator(mask, "seq_mean_token_sum_norm")


def test_loss_token_weights_are_per_row_and_zero_on_padding() -> None:
    """token_mean and Dr.GRPO weigh tokens 1; the GRPO sequence mean weighs them 1 / L_i."""
    mask = _mask([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(loss_token_weights(mask, "token_mean"), mask.float())
    torch.testing.assert_close(loss_token_weights(mask, "seq_mean_token_sum_norm"), mask.float())
    torch.testing.assert_close(
        loss_token_weights(mask, "seq_mean_token_mean"),
        torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
    )


def test_an_explicit_denominator_replaces_the_local_one() -> None:
    """Per-token losses sum to -2.2; with denominator 11 (a global count) the loss is -0.2."""
    logp = _logprobs_from_ratios(BEHAVE, [[1.1, 0.9, 1.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.0, -1.0, 0.0], [2.0, 0.0, 0.0]])
    loss, _ = policy_loss(logp, None, BEHAVE, adv, MASK, decoupled=False, denominator=11.0)
    assert loss.item() == pytest.approx(-0.2, rel=1e-5)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("cap_mode", ["mask", "clamp"])
def test_micro_batches_with_the_global_denominator_sum_to_the_whole_batch(
    loss_agg: str, ratio_level: str, cap_mode: str
) -> None:
    """Split 6 rows into micro-batches of 2 and 4 rows: losses, gradients and stats add up exactly.

    The global denominator is the sum of each micro-batch's loss_denominator (what the trainer
    all-reduces). Behaviour weights reach past the cap so masked tokens are part of the check.
    """
    torch.manual_seed(1)
    shape = (6, 7)
    behave = -torch.rand(shape) * 2
    prox = behave + torch.randn(shape) * 1.2
    logp0 = prox + torch.randn(shape) * 0.3
    adv = torch.randn(shape)
    lengths = torch.tensor([7, 3, 1, 5, 6, 2])
    mask = torch.arange(7)[None, :] < lengths[:, None]
    settings = dict(
        loss_agg=loss_agg, ratio_level=ratio_level, behave_cap_mode=cap_mode, behave_cap=2.0, dual_clip=3.0
    )

    whole_logp = logp0.clone().requires_grad_(True)
    whole, whole_stats = policy_loss(whole_logp, prox, behave, adv, mask, max_new_tokens=7, **settings)
    whole.backward()

    split_logp = logp0.clone().requires_grad_(True)
    parts = [slice(0, 2), slice(2, 6)]
    denominator = sum(loss_denominator(mask[p], loss_agg, max_new_tokens=7) for p in parts)
    total = torch.zeros(())
    part_stats = []
    for p in parts:
        part, stats = policy_loss(
            split_logp[p], prox[p], behave[p], adv[p], mask[p], denominator=denominator, **settings
        )
        total = total + part
        part_stats.append(stats)
    total.backward()

    assert total.item() == pytest.approx(whole.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(split_logp.grad, whole_logp.grad)
    merged = merge_loss_stats(*part_stats)
    assert set(merged) == set(SUM_STATS) | set(MAX_STATS)
    for key in merged:
        torch.testing.assert_close(merged[key], whole_stats[key])
    assert whole_stats["capped_tokens"].item() > 0


def test_summarized_stats_are_fractions_and_means_over_tokens() -> None:
    """capped 2 of 3 tokens, w sum 18 -> capped_frac 2/3, behave_weight_mean 6, behave_weight_max 10."""
    behave = torch.zeros(1, 3)
    prox = torch.log(torch.tensor([[2.0, 6.0, 10.0]]))
    _, stats = policy_loss(prox, prox, behave, torch.ones(1, 3), _mask([[1, 1, 1]]))
    summary = summarize_loss_stats(stats)
    assert summary["capped_frac"] == pytest.approx(2 / 3, rel=1e-5)
    assert summary["behave_weight_mean"] == pytest.approx(6.0, rel=1e-5)
    assert summary["behave_weight_max"] == pytest.approx(10.0, rel=1e-5)
    assert summary["ratio_mean"] == pytest.approx(1.0, rel=1e-5)
    assert summary["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert summary["tokens"] == 3


def test_approx_kl_stat_is_the_k3_estimate_of_kl_prox_to_theta() -> None:
    """r = pi_theta / pi_prox = 2: k3 = (r - 1) - log r = 1 - ln 2 per token."""
    prox = torch.zeros(1, 2)
    _, stats = policy_loss(prox + LN2, prox, prox, torch.zeros(1, 2), _mask([[1, 1]]))
    assert stats["approx_kl_sum"].item() == pytest.approx(2 * (1 - LN2), rel=1e-5)


def test_kl_to_the_reference_is_a_loss_term_unless_it_is_in_the_reward() -> None:
    """A = 0, log(pi / pi_ref) = ln 2, k3, kl_coef 0.5: per token 0.5 * (0.5 - 1 + ln 2) = 0.0965736.

    d k3 / d logp = 1 - exp(-ln 2) = 0.5, so the gradient is 0.5 * 0.5 / 2 tokens = 0.125 per token.
    With kl_in_reward=True the loss has no KL term.
    """
    ref = torch.full((1, 2), -1.0)
    logp = (ref + LN2).requires_grad_(True)
    mask = _mask([[1, 1]])
    kwargs = dict(ref_logprobs_BT=ref, kl_coef=0.5, kl_estimator="k3", decoupled=False)
    loss, stats = policy_loss(logp, None, logp.detach(), torch.zeros(1, 2), mask, **kwargs)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * (0.5 - 1 + LN2), rel=1e-5)
    torch.testing.assert_close(logp.grad, torch.full((1, 2), 0.125))
    assert stats["ref_kl_sum"].item() == pytest.approx(2 * (0.5 - 1 + LN2), rel=1e-5)

    in_reward, stats = policy_loss(
        logp, None, logp.detach(), torch.zeros(1, 2), mask, kl_in_reward=True, **kwargs
    )
    assert in_reward.item() == 0.0
    assert stats["ref_kl_sum"].item() == 0.0


def test_invalid_settings_are_rejected_with_the_reason() -> None:
    """Missing prox for the decoupled loss, a cap <= 1, a dual clip <= 1 and unknown modes are errors."""
    x = torch.zeros(1, 1)
    m = _mask([[1]])
    with pytest.raises(ValueError, match="prox_logprobs_BT"):
        policy_loss(x, None, x, x, m)
    with pytest.raises(ValueError, match="behave_cap"):
        policy_loss(x, x, x, x, m, behave_cap=1.0)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(x, x, x, x, m, dual_clip=0.5)
    with pytest.raises(ValueError, match="behave_cap_mode"):
        policy_loss(x, x, x, x, m, behave_cap_mode="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ratio_level"):
        policy_loss(x, x, x, x, m, ratio_level="seq")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss_agg"):
        policy_loss(x, x, x, x, m, loss_agg="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ref_logprobs_BT"):
        policy_loss(x, x, x, x, m, kl_coef=0.1)
    with pytest.raises(ValueError, match="denominator"):
        policy_loss(x, x, x, x, m, denominator=0)
