"""Loss masks of multi-turn completions, from the event to the loss: only the model's tokens train.

The engine tests run one decoupled-PPO step on a tiny model (CPU, padded and packed rows) and
compare it with a loss written by hand over the trained tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch

from areal_async.config import LossConfig
from areal_async.training.batching import TrainSequence, collate
from areal_async.training.learner import GroupSample, build_sequences, global_denominator, make_loss_fn
from bus import events as ev
from tests.conftest import make_sample_events
from tests.helpers.engines import fsdp_engine
from tests.helpers.models import build_tiny_model
from workers.scored_groups import Unfit, check_content, to_sample

MAX_NEW_TOKENS = 16
LOSS = LossConfig(behave_cap=None)
"""Decoupled PPO (ratio to pi_prox, behaviour weight to pi_behave) without the cap."""

# 1 = the model's token, 0 = a tool's output between two turns.
MASKS = [[1, 1, 1, 0, 0, 0, 1, 1, 1], [1, 1, 0, 0, 1, 1, 1], [1, 0, 0, 0, 0, 1, 1, 1, 0, 1]]
PROMPTS = [3, 5, 2]
TRAINED = sum(map(sum, MASKS))

StepResult = tuple[dict[str, float], list[torch.Tensor]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=32, heads=4, kv_heads=2)


def episodes(seed: int = 0) -> list[TrainSequence]:
    """Three multi-turn completions with random tokens, advantages and behaviour logprobs."""
    g = torch.Generator().manual_seed(seed)
    return [
        TrainSequence(
            prompt_ids=torch.randint(4, 60, (p,), generator=g),
            completion_ids=torch.randint(4, 60, (len(mask),), generator=g),
            behave_logprobs=-4.0 - torch.rand(len(mask), generator=g),
            advantages=torch.randn(len(mask), generator=g),
            loss_mask=torch.tensor(mask, dtype=torch.bool),
        )
        for p, mask in zip(PROMPTS, MASKS, strict=True)
    ]


def one_step(model_dir: Path, seqs: list[TrainSequence], loss_fn: Callable, *, packed: bool) -> StepResult:
    """Metrics and parameter change of one step from the initial weights. Adam's eps >> |grad| makes
    the first update lr * grad / (|grad| + eps) ~ grad, so the change shows the gradient itself."""
    engine = fsdp_engine(
        model_dir,
        dtype="float32",
        lr=1e3,
        eps=1e3,
        grad_clip=0.0,
        weight_decay=0.0,
        micro_batch_tokens=24,
        packed=packed,
    )
    before = [p.detach().clone() for p in engine.params]
    metrics = engine.train_step(seqs, loss_fn, compute_prox=True)
    return metrics, [p.detach() - b for p, b in zip(engine.params, before, strict=True)]


def masked_step(model_dir: Path, seqs: list[TrainSequence], *, packed: bool) -> StepResult:
    """The learner's path: masks in the sequences, its global denominator and loss."""
    denominator = global_denominator(seqs, LOSS, max_new_tokens=MAX_NEW_TOKENS)
    loss_fn = make_loss_fn(LOSS, max_new_tokens=MAX_NEW_TOKENS, denominator=denominator)
    return one_step(model_dir, seqs, loss_fn, packed=packed)


def by_hand(mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO at pi_theta == pi_prox (the clip is inactive), summed over the tokens marked in
    `loss_weights` and divided by their global count."""
    keep = mb["loss_weights"] > 0
    weight = torch.exp(mb["prox_logprobs"] - mb["behave_logprobs"])
    ratio = torch.exp(mb["logprobs"] - mb["prox_logprobs"])
    per_token = torch.where(keep, -mb["advantages"] * weight * ratio, 0.0)
    return per_token.sum() / TRAINED, {"trained_entropy_sum": (mb["entropy"] * keep).sum()}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_masked_tokens_train_like_tokens_dropped_from_the_loss(model_dir: Path, packed: bool) -> None:
    """The masked step equals a hand-written loss over the trained tokens only (same sequences, every
    token still read as context): loss, gradient, entropy and token counts; training every token
    instead would differ."""
    seqs = episodes()
    masked, masked_delta = masked_step(model_dir, seqs, packed=packed)
    reference = [
        dataclasses.replace(s, loss_mask=None, loss_weights=s.loss_mask.float())  # type: ignore[union-attr]
        for s in seqs
    ]
    ref, ref_delta = one_step(model_dir, reference, by_hand, packed=packed)
    assert masked["loss_tokens"] == masked["tokens"] == TRAINED
    assert masked["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    assert masked["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5) and masked["grad_norm"] > 0
    assert masked["entropy"] == pytest.approx(ref["trained_entropy_sum"] / TRAINED, rel=1e-5)
    for a, b in zip(masked_delta, ref_delta, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    unmasked, _ = masked_step(
        model_dir, [dataclasses.replace(s, loss_mask=None) for s in seqs], packed=packed
    )
    assert unmasked["loss_tokens"] == sum(map(len, MASKS))
    assert unmasked["grad_norm"] != pytest.approx(masked["grad_norm"], rel=1e-3)


def test_what_masked_tokens_carry_does_not_change_the_gradient(model_dir: Path) -> None:
    """Advantages and behaviour logprobs of masked tokens (which the loss would weight hugely) leave
    the loss and the update bit for bit unchanged."""
    seqs = episodes()
    altered = []
    for s in seqs:
        off = ~s.loss_mask  # type: ignore[operator]
        altered.append(
            dataclasses.replace(
                s,
                advantages=torch.where(off, 50.0, s.advantages),  # type: ignore[arg-type]
                behave_logprobs=torch.where(off, -30.0, s.behave_logprobs),  # type: ignore[arg-type]
            )
        )
    base, base_delta = masked_step(model_dir, seqs, packed=False)
    other, other_delta = masked_step(model_dir, altered, packed=False)
    assert other["loss"] == base["loss"] and other["grad_norm"] == base["grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(base_delta, other_delta, strict=True))


def test_collate_marks_only_trained_completion_tokens() -> None:
    """`mask` is True on the trained completion tokens; the model still reads every token."""
    s = episodes()[1]
    mb = collate([s, dataclasses.replace(s, loss_mask=None)])
    p = PROMPTS[1]
    assert mb["mask"][0].tolist() == [False] * p + [bool(m) for m in MASKS[1]]
    assert mb["mask"][1].tolist() == [False] * p + [True] * len(MASKS[1])
    assert mb["attention_mask"].all() and torch.equal(mb["input_ids"][0], mb["input_ids"][1])
    assert (s.num_loss_tokens, s.num_completion_tokens) == (sum(MASKS[1]), len(MASKS[1]))
    with pytest.raises(ValueError, match="loss_mask has 2 values for 7 completion tokens"):
        dataclasses.replace(s, loss_mask=[True, False])


def group(task_id: str, rewards: list[float], masks: list[list[int]] | None) -> GroupSample:
    lengths = [len(m) for m in masks] if masks else [4, 6]
    return GroupSample(
        task_id=task_id,
        prompt_ids=[1, 2, 3],
        completions=[[7] * n for n in lengths],
        behave_logprobs=[[-1.0] * n for n in lengths],
        rewards=rewards,
        finish_reasons=["stop"] * len(lengths),
        head_version=0,
        loss_masks=masks,
    )


def test_build_sequences_counts_trained_tokens_only() -> None:
    """Advantages, their statistics, completion_len_mean and the global denominator see only the
    trained tokens; untrained tokens get advantage 0."""
    loss = LossConfig(batch_adv_norm=False, group_std=False)
    masked = group("a", [1.0, 0.0], [[1, 1, 0, 0, 0, 0, 1], [1, 0, 0, 0, 0, 0, 0, 0, 0]])
    plain = group("b", [0.0, 1.0], None)
    seqs, stats = build_sequences([masked, plain], loss, max_new_tokens=MAX_NEW_TOKENS)
    trained = [3, 1, 4, 6]
    assert [s.num_loss_tokens for s in seqs] == trained
    assert seqs[0].advantages.tolist() == [0.5, 0.5, 0, 0, 0, 0, 0.5]  # type: ignore[union-attr]
    assert seqs[1].advantages.tolist() == [-0.5] + [0.0] * 8  # type: ignore[union-attr]
    assert seqs[2].loss_mask is not None and all(seqs[2].loss_mask)  # every token of an unmasked group
    assert stats["completion_len_mean"] == sum(trained) / 4
    # token advantages over trained tokens: 3 x 0.5, 1 x -0.5, 4 x -0.5, 6 x 0.5
    assert stats["adv_mean"] == pytest.approx((1.5 - 0.5 - 2.0 + 3.0) / 14)
    assert global_denominator(seqs, loss, max_new_tokens=MAX_NEW_TOKENS) == sum(trained)
    per_seq = dataclasses.replace(loss, loss_agg="seq_mean_token_sum_norm")
    assert global_denominator(seqs, per_seq, max_new_tokens=MAX_NEW_TOKENS) == 4 * MAX_NEW_TOKENS
    normed, normed_stats = build_sequences([masked, plain], LossConfig(), max_new_tokens=MAX_NEW_TOKENS)
    trained_adv = torch.cat([s.advantages[s.loss_mask] for s in normed])  # type: ignore[index]
    assert normed_stats["adv_mean"] == pytest.approx(0.0, abs=1e-6) == float(trained_adv.mean())
    assert float(trained_adv.std()) == pytest.approx(1.0, abs=1e-4)
    assert not normed[0].advantages[~normed[0].loss_mask].any()  # type: ignore[index, operator]
    unmasked, _ = build_sequences([plain, plain], loss, max_new_tokens=MAX_NEW_TOKENS)
    assert all(s.loss_mask is None for s in unmasked)
    with pytest.raises(ValueError, match="loss mask lengths"):
        dataclasses.replace(masked, loss_masks=[[1], [1]])


def scored(*completions: ev.Completion) -> ev.ScoredGroup:
    sample: ev.RolloutGroup = make_sample_events()["RolloutGroup"]  # type: ignore[assignment]
    g = msgspec.structs.replace(sample, completions=list(completions), head_version=2)
    n = len(completions)
    return ev.ScoredGroup(group=g, rewards=[1.0] * n, reward_errors=[""] * n, reward_seconds=0.0)


def completion(tokens: int, mask: list[int] | None = None) -> ev.Completion:
    return ev.Completion(
        token_ids=ev.pack_i32([5] * tokens),
        logprobs=ev.pack_f32([-1.0] * tokens),
        versions=ev.pack_i32([2] * tokens),
        finish_reason="stop",
        loss_mask=ev.pack_u8(mask) if mask else b"",
    )


def test_the_trainer_passes_masks_through_and_refuses_groups_that_train_nothing() -> None:
    """to_sample: no masks -> None, one masked completion -> a mask for each; check_content: a group
    whose completions have no token to train is unfit."""
    plain = scored(completion(3), completion(2))
    assert to_sample(plain).loss_masks is None
    mixed = scored(completion(3, [1, 0, 1]), completion(2))
    check_content(mixed)
    assert to_sample(mixed).loss_masks == [[1, 0, 1], [1, 1]]
    with pytest.raises(Unfit, match="no completion has a token to train"):
        check_content(scored(completion(0), completion(0)))


def test_a_completion_whose_versions_fall_is_stamped_with_its_oldest_token() -> None:
    """A trainer restored from a checkpoint republishes an older version, so an engine mid-request goes
    3 -> 2: the group's head is 2 (not the first token's 3), its tail 3, and the trainer accepts it."""
    from areal_async.engines.base import GenerationResult
    from workers.generation import rollout_group

    task: ev.PromptTask = make_sample_events()["PromptTask"]  # type: ignore[assignment]

    def result(versions: list[int]) -> GenerationResult:
        n = len(versions)
        return GenerationResult(
            request_id="r", prompt_ids=(1,), token_ids=[5] * n, logprobs=[-1.0] * n,
            versions=versions, finish_reason="stop",
        )  # fmt: skip

    falling, steady = result([3, 3, 2, 2]), result([3, 3])
    assert (falling.head_version, falling.tail_version) == (2, 3)
    group = rollout_group(task, "gen-0", [1], [steady, falling], ["a", "b"], 0.1)
    assert (group.head_version, group.tail_version) == (2, 3)
    check_content(ev.ScoredGroup(group=group, rewards=[1.0, 0.0], reward_errors=["", ""], reward_seconds=0.0))
