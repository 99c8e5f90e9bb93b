"""Unit tests of areal_async.algo.advantages: every option against arithmetic written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from areal_async.algo.advantages import (
    apply_kl_penalty,
    batch_normalize,
    compute_advantages,
    dynamic_sampling_keep,
    group_advantages,
    kl_estimate,
    overlong_penalty,
    place_outcome_rewards,
    returns_to_go,
    shape_rewards,
)

LN2 = math.log(2.0)
INV_SQRT3 = 1.0 / math.sqrt(3.0)


def _mask(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def test_shape_rewards_adds_bias_then_scales_then_clips() -> None:
    """Binary {0, 1} with bias -0.5 and scale 10 becomes {-5, +5} (AReaL's recipe); clip 3 gives {-3, 3}."""
    rewards = torch.tensor([0.0, 1.0])
    torch.testing.assert_close(shape_rewards(rewards, bias=-0.5, scale=10.0), torch.tensor([-5.0, 5.0]))
    torch.testing.assert_close(
        shape_rewards(rewards, bias=-0.5, scale=10.0, clip=3.0), torch.tensor([-3.0, 3.0])
    )
    torch.testing.assert_close(shape_rewards(rewards), rewards)
    with pytest.raises(ValueError, match="clip"):
        shape_rewards(rewards, clip=0.0)


def test_group_mean_std_normalises_with_the_unbiased_group_std() -> None:
    """r = [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 1/sqrt(3); adv = +-0.5 * sqrt(3)."""
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    half_sqrt3 = 0.5 * math.sqrt(3.0)
    torch.testing.assert_close(adv, torch.tensor([half_sqrt3, -half_sqrt3, -half_sqrt3, half_sqrt3]))


def test_group_mean_without_std_only_centers() -> None:
    """r = [3, 1, 2]: mean 2, adv = [1, -1, 0]."""
    adv = group_advantages(torch.tensor([3.0, 1.0, 2.0]), use_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0]))


def test_leave_one_out_baseline_is_the_mean_of_the_other_completions() -> None:
    """r = [1, 0, 0, 0]: the first sees others' mean 0 -> 1; each other sees 1/3 -> -1/3 (RLOO)."""
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), baseline="loo", use_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))


def test_leave_one_out_is_the_mean_baseline_scaled_by_g_over_g_minus_one() -> None:
    """r_i - mean(others) = G / (G - 1) * (r_i - mean(all)) for any group."""
    rewards = torch.tensor([0.3, -1.2, 2.0, 0.7, 0.1])
    loo = group_advantages(rewards, baseline="loo", use_std=False)
    mean = group_advantages(rewards, baseline="mean", use_std=False)
    torch.testing.assert_close(loo, mean * 5 / 4)


def test_no_baseline_keeps_rewards_and_optionally_divides_by_std() -> None:
    """baseline none: r = [2, 4] unchanged; with std (sqrt 2): [2, 4] / sqrt 2."""
    rewards = torch.tensor([2.0, 4.0])
    torch.testing.assert_close(group_advantages(rewards, baseline="none", use_std=False), rewards)
    torch.testing.assert_close(
        group_advantages(rewards, baseline="none", use_std=True, eps=0.0), rewards / math.sqrt(2.0)
    )


def test_a_group_of_equal_rewards_gets_zero_advantage_not_nan() -> None:
    """std = 0: (r - mean) / (0 + eps) = 0 for every completion."""
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0]))
    torch.testing.assert_close(adv, torch.zeros(3))


def test_groups_are_normalised_row_by_row() -> None:
    """[[1, 0], [5, 5]]: row 0 -> +-0.5 / std(1/sqrt 2) = +-1/sqrt 2; row 1 -> 0."""
    adv = group_advantages(torch.tensor([[1.0, 0.0], [5.0, 5.0]]))
    s = 1 / math.sqrt(2.0)
    torch.testing.assert_close(adv, torch.tensor([[s, -s], [0.0, 0.0]]), atol=1e-5, rtol=1e-5)


def test_group_options_reject_what_they_cannot_compute() -> None:
    """One completion cannot have a leave-one-out baseline or a std; unknown baselines are errors."""
    with pytest.raises(ValueError, match="leave-one-out"):
        group_advantages(torch.tensor([1.0]), baseline="loo", use_std=False)
    with pytest.raises(ValueError, match="std"):
        group_advantages(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="baseline"):
        group_advantages(torch.tensor([1.0, 2.0]), baseline="median")  # type: ignore[arg-type]


def test_outcome_reward_sits_on_the_last_valid_token() -> None:
    """Row 0's completion ends at position 2, row 1's at 0; an empty row gets nothing."""
    mask = _mask([[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    placed = place_outcome_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    torch.testing.assert_close(
        placed, torch.tensor([[0.0, 0.0, 2.0, 0.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    )


def test_returns_to_go_sum_the_remaining_valid_rewards() -> None:
    """Token rewards [1, 2, 3, 9(padding)] -> returns [6, 5, 3, 0]."""
    returns = returns_to_go(torch.tensor([[1.0, 2.0, 3.0, 9.0]]), _mask([[1, 1, 1, 0]]))
    torch.testing.assert_close(returns, torch.tensor([[6.0, 5.0, 3.0, 0.0]]))


def test_batch_normalize_uses_masked_mean_and_unbiased_std() -> None:
    """Valid values [1, 1, 3]: mean 5/3, var (4/9 + 4/9 + 16/9) / 2 = 4/3 -> [-1, -1, 2] / sqrt 3; padding 0."""
    adv = torch.tensor([[1.0, 1.0, 7.0], [3.0, -4.0, 0.0]])
    out = batch_normalize(adv, _mask([[1, 1, 0], [1, 0, 0]]), eps=0.0)
    expected = torch.tensor([[-INV_SQRT3, -INV_SQRT3, 0.0], [2 * INV_SQRT3, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)


def test_batch_normalize_of_constant_advantages_is_zero() -> None:
    """All-equal valid advantages have std 0; the result is 0 rather than nan."""
    out = batch_normalize(torch.full((2, 2), 3.0), _mask([[1, 1], [1, 0]]))
    torch.testing.assert_close(out, torch.zeros(2, 2))


def test_kl_estimators_follow_schulman() -> None:
    """log r = ln 2: k1 = ln 2, k2 = (ln 2)^2 / 2, k3 = 1/2 - 1 + ln 2; log r = -ln 2: k3 = 2 - 1 - ln 2."""
    logp = torch.tensor([LN2, -LN2])
    ref = torch.zeros(2)
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([LN2, -LN2]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.5 * LN2**2, 0.5 * LN2**2]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([LN2 - 0.5, 1.0 - LN2]))
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(logp, ref, "k4")  # type: ignore[arg-type]


def test_k3_is_non_negative_and_zero_only_when_policies_agree() -> None:
    """k3 = e^-x - 1 + x >= 0 for every x, with equality at x = 0."""
    x = torch.linspace(-5, 5, 101)
    k3 = kl_estimate(x, torch.zeros_like(x), "k3")
    assert (k3 >= 0).all()
    assert k3[50].item() == pytest.approx(0.0, abs=1e-7)


def test_kl_penalty_subtracts_coef_times_kl_on_valid_tokens() -> None:
    """Token rewards [0, 0, 1], log r = [ln 2, 0, -ln 2], k1, coef 0.1 -> [-0.1 ln 2, 0, 1 + 0.1 ln 2]."""
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    logp = torch.tensor([[LN2, 0.0, -LN2, 5.0]])
    ref = torch.zeros(1, 4)
    out = apply_kl_penalty(rewards, logp, ref, _mask([[1, 1, 1, 0]]), kl_coef=0.1)
    torch.testing.assert_close(out, torch.tensor([[-0.1 * LN2, 0.0, 1 + 0.1 * LN2, 0.0]]))


def test_overlong_penalty_is_linear_in_the_buffer_and_zero_before_it() -> None:
    """max 16, buffer 4, factor 1: free up to 12, then -(len - 12) / 4, -1 at 16 and beyond."""
    penalty = overlong_penalty(
        torch.tensor([10, 12, 13, 14, 16, 20]), max_new_tokens=16, buffer=4, factor=1.0
    )
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    half = overlong_penalty([14], max_new_tokens=16, buffer=4, factor=0.5)
    torch.testing.assert_close(half, torch.tensor([-0.25]))


def test_overlong_penalty_is_off_with_a_zero_buffer_and_rejects_a_buffer_past_the_budget() -> None:
    """buffer 0 -> all zeros; a buffer larger than max_new_tokens is a configuration error."""
    torch.testing.assert_close(overlong_penalty([16, 40], 16, 0, 1.0), torch.zeros(2))
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_penalty([4], max_new_tokens=16, buffer=32, factor=1.0)


def test_dynamic_sampling_drops_groups_whose_rewards_are_all_equal() -> None:
    """All correct or all wrong carries no group-relative signal; any difference keeps the group."""
    assert dynamic_sampling_keep(torch.tensor([1.0, 1.0, 1.0])) is False
    assert dynamic_sampling_keep([0.0, 0.0, 0.0, 0.0]) is False
    assert dynamic_sampling_keep([0.0, 1.0, 0.0]) is True
    assert dynamic_sampling_keep([0.5, 0.5, 0.50001]) is True
    assert dynamic_sampling_keep([]) is False


def test_compute_advantages_broadcasts_the_group_advantage_over_completion_tokens() -> None:
    """One group r = [1, 0]: mean 0.5, std 1/sqrt 2 -> +-1/sqrt 2 on every completion token, 0 on padding."""
    mask = _mask([[1, 1, 0], [1, 0, 0]])
    adv = compute_advantages(torch.tensor([[1.0, 0.0]]), mask, batch_adv_norm=False)
    s = 1 / math.sqrt(2.0)
    torch.testing.assert_close(adv, torch.tensor([[s, s, 0.0], [-s, 0.0, 0.0]]), atol=1e-5, rtol=1e-5)


def test_compute_advantages_batch_norm_is_over_tokens_not_sequences() -> None:
    """Tokens [a, a, -a] (row 0 has two tokens): mean a/3, unbiased std (2a / sqrt 3) -> [1, 1, -2] / sqrt 3."""
    mask = _mask([[1, 1, 0], [1, 0, 0]])
    adv = compute_advantages(torch.tensor([[1.0, 0.0]]), mask)
    expected = torch.tensor([[INV_SQRT3, INV_SQRT3, 0.0], [-2 * INV_SQRT3, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)


def test_compute_advantages_shapes_rewards_before_the_group_baseline() -> None:
    """r = [0, 1], bias -0.5, scale 10, clip 3 -> [-3, 3]; baseline none, no std: advantages [-3, 3]."""
    mask = _mask([[1, 1], [1, 0]])
    adv = compute_advantages(
        torch.tensor([[0.0, 1.0]]),
        mask,
        reward_bias=-0.5,
        reward_scale=10.0,
        reward_clip=3.0,
        group_baseline="none",
        group_std=False,
        batch_adv_norm=False,
    )
    torch.testing.assert_close(adv, torch.tensor([[-3.0, -3.0], [3.0, 0.0]]))


def test_compute_advantages_with_rloo_and_no_std() -> None:
    """Two groups of three: [[1, 0, 0], [0, 0, 0]] -> loo [[1, -0.5, -0.5], [0, 0, 0]], one token each."""
    mask = torch.ones(6, 1, dtype=torch.bool)
    adv = compute_advantages(
        torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
        mask,
        group_baseline="loo",
        group_std=False,
        batch_adv_norm=False,
    )
    torch.testing.assert_close(adv.flatten(), torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0]))


def test_compute_advantages_applies_the_overlong_penalty_to_the_raw_reward() -> None:
    """Both correct (r = 1); row 0 used all 4 tokens of max_new_tokens 4 with buffer 2 -> penalty -1 -> r = 0.

    Group mean 0.5, no std: advantages [-0.5, 0.5].
    """
    mask = _mask([[1, 1, 1, 1], [1, 1, 0, 0]])
    adv = compute_advantages(
        torch.tensor([[1.0, 1.0]]),
        mask,
        group_std=False,
        batch_adv_norm=False,
        overlong_buffer=2,
        overlong_penalty=1.0,
        max_new_tokens=4,
    )
    torch.testing.assert_close(adv, torch.tensor([[-0.5, -0.5, -0.5, -0.5], [0.5, 0.5, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="max_new_tokens"):
        compute_advantages(torch.tensor([[1.0, 1.0]]), mask, overlong_buffer=2)


def test_compute_advantages_with_kl_in_reward_uses_the_return_to_go() -> None:
    """r = [1, 0], mean baseline, no std: sequence advantages [0.5, -0.5] on the last token.

    Row 0 has log(pi / pi_ref) = [ln 2, 0], k1, coef 0.1: token rewards [-0.1 ln 2, 0.5] ->
    returns [0.5 - 0.1 ln 2, 0.5]. Row 1 agrees with the reference: [-0.5, -0.5].
    """
    mask = torch.ones(2, 2, dtype=torch.bool)
    logp = torch.tensor([[LN2, 0.0], [0.0, 0.0]])
    ref = torch.zeros(2, 2)
    kwargs = dict(group_std=False, batch_adv_norm=False, kl_coef=0.1, logprobs_BT=logp, ref_logprobs_BT=ref)
    adv = compute_advantages(torch.tensor([[1.0, 0.0]]), mask, kl_in_reward=True, **kwargs)
    torch.testing.assert_close(adv, torch.tensor([[0.5 - 0.1 * LN2, 0.5], [-0.5, -0.5]]))

    in_loss = compute_advantages(torch.tensor([[1.0, 0.0]]), mask, kl_in_reward=False, **kwargs)
    torch.testing.assert_close(in_loss, torch.tensor([[0.5, 0.5], [-0.5, -0.5]]))

    with pytest.raises(ValueError, match="ref_logprobs_BT"):
        compute_advantages(torch.tensor([[1.0, 0.0]]), mask, kl_in_reward=True, kl_coef=0.1)


def test_return_to_go_of_a_last_token_reward_is_the_broadcast_advantage() -> None:
    """With a zero KL the KL-in-reward path (place, add, return-to-go) equals the plain broadcast."""
    torch.manual_seed(0)
    rewards = torch.randint(0, 2, (3, 4)).float()
    lengths = torch.randint(1, 7, (12,))
    mask = torch.arange(6)[None, :] < lengths[:, None]
    logp = -torch.rand(12, 6)
    with_kl = compute_advantages(
        rewards, mask, kl_in_reward=True, kl_coef=0.5, logprobs_BT=logp, ref_logprobs_BT=logp
    )
    torch.testing.assert_close(with_kl, compute_advantages(rewards, mask))


def test_compute_advantages_checks_the_group_layout() -> None:
    """rewards must be [groups, group_size] and the mask must have groups * group_size rows."""
    with pytest.raises(ValueError, match="rewards_NG"):
        compute_advantages(torch.tensor([1.0, 0.0]), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="rows"):
        compute_advantages(torch.tensor([[1.0, 0.0]]), torch.ones(3, 3, dtype=torch.bool))
