"""Micro-batch packing and collation for the training engine."""

from __future__ import annotations

import random

import pytest
import torch
from structlog.testing import capture_logs
from transformers import LlamaConfig, LlamaForCausalLM

from areal_async.training.batching import (
    TrainSequence,
    collate,
    model_inputs,
    pack_lengths,
    pack_micro_batches,
    pack_tokens,
)


def make_seq(
    prompt_len: int, completion_len: int, *, seed: int = 0, vocab: int = 64, **kw: object
) -> TrainSequence:
    g = torch.Generator().manual_seed(seed)
    return TrainSequence(
        prompt_ids=torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
        completion_ids=torch.randint(0, vocab, (completion_len,), generator=g).tolist(),
        behave_logprobs=(-torch.rand(completion_len, generator=g)).tolist(),
        advantages=torch.randn(completion_len, generator=g).tolist(),
        **kw,
    )


def test_packing_respects_the_budget_and_uses_every_index_once() -> None:
    """Every bin's padded size rows * longest stays within the budget; each index appears exactly once."""
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(200)]
    bins = pack_lengths(lengths, 256)
    assert sorted(i for b in bins for i in b) == list(range(200))
    for b in bins:
        assert len(b) * max(lengths[i] for i in b) <= 256


def test_packing_is_deterministic_and_groups_similar_lengths() -> None:
    """Same input, same bins; bins hold indices longest first, ties by index."""
    lengths = [5, 9, 5, 3, 9, 1]
    assert pack_lengths(lengths, 18) == pack_lengths(list(lengths), 18)
    assert pack_lengths(lengths, 18) == [[1, 4], [0, 2, 3], [5]]


def test_a_sequence_longer_than_the_budget_gets_its_own_bin_with_a_warning() -> None:
    """An over-budget sequence is not dropped: it trains alone and the engine logs a warning."""
    with capture_logs() as logs:
        bins = pack_lengths([4, 50, 4], 16)
    assert bins == [[1], [0, 2]]
    assert [e["event"] for e in logs] == ["sequence exceeds micro-batch budget"]


def test_pack_micro_batches_bins_by_total_sequence_length() -> None:
    """A sequence's cost is prompt + completion tokens."""
    seqs = [make_seq(3, 5, seed=1), make_seq(6, 6, seed=2), make_seq(2, 2, seed=3)]
    assert pack_micro_batches(seqs, 16) == [[1], [0, 2]]


def test_collate_masks_completion_tokens_only() -> None:
    """mask is True exactly on completion tokens; per-token values sit under their token, zero elsewhere."""
    seqs = [make_seq(3, 4, seed=1), make_seq(5, 1, seed=2), make_seq(2, 0, seed=3)]
    mb = collate(seqs, pad_token_id=7)
    assert mb["input_ids"].shape == (3, 7)
    for row, s in enumerate(seqs):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        assert mb["input_ids"][row, : p + c].tolist() == list(s.prompt_ids) + list(s.completion_ids)
        assert (mb["input_ids"][row, p + c :] == 7).all()
        assert mb["attention_mask"][row].tolist() == [True] * (p + c) + [False] * (7 - p - c)
        assert mb["mask"][row].tolist() == [False] * p + [True] * c + [False] * (7 - p - c)
        torch.testing.assert_close(
            mb["advantages"][row, p : p + c], torch.tensor(s.advantages, dtype=torch.float32)
        )
        torch.testing.assert_close(
            mb["behave_logprobs"][row, p : p + c], torch.tensor(s.behave_logprobs, dtype=torch.float32)
        )
    for name in ("advantages", "behave_logprobs", "prox_logprobs", "loss_weights"):
        assert (mb[name][~mb["mask"]] == 0).all()
    assert mb["position_ids"].tolist() == [list(range(7))] * 3


def test_collate_defaults_prox_to_behave_and_weights_to_one() -> None:
    """Without pi_prox the batch carries pi_behave in its place; loss weights default to 1 on the completion."""
    seqs = [make_seq(2, 3, seed=1), make_seq(2, 3, seed=2, prox_logprobs=[-0.5, -0.25, -0.125])]
    mb = collate(seqs)
    torch.testing.assert_close(mb["prox_logprobs"][0], mb["behave_logprobs"][0])
    assert mb["prox_logprobs"][1, 2:].tolist() == [-0.5, -0.25, -0.125]
    assert mb["loss_weights"].tolist() == [[0, 0, 1, 1, 1]] * 2
    assert "ref_logprobs" not in mb


def test_collate_rejects_a_batch_where_only_some_sequences_have_ref_logprobs() -> None:
    """Reference logprobs are all-or-nothing so a KL term never silently sees zeros."""
    with pytest.raises(ValueError, match="ref_logprobs"):
        collate([make_seq(2, 2, seed=1, ref_logprobs=[-1.0, -1.0]), make_seq(2, 2, seed=2)])


def test_train_sequence_rejects_per_token_lists_of_the_wrong_length() -> None:
    """One value per completion token, and at least one prompt token."""
    with pytest.raises(ValueError, match="advantages has 1 values for 2"):
        TrainSequence(prompt_ids=[1], completion_ids=[2, 3], behave_logprobs=[0.0, 0.0], advantages=[0.0])
    with pytest.raises(ValueError, match="at least one prompt token"):
        TrainSequence(prompt_ids=[], completion_ids=[2], behave_logprobs=[0.0], advantages=[0.0])


def test_collated_columns_line_up_with_next_token_logprobs() -> None:
    """Column t of the batch holds token t, whose logprob comes from the logits at t - 1 of its own unpadded row."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = LlamaForCausalLM(config).eval()
    seqs = [make_seq(3, 4, seed=1), make_seq(5, 2, seed=2), make_seq(1, 6, seed=3)]
    mb = collate(seqs)
    with torch.no_grad():
        logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits.float()
    logprobs_BT = torch.zeros_like(mb["advantages"])
    logprobs_BT[:, 1:] = logits[:, :-1].log_softmax(-1).gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)
    for row, s in enumerate(seqs):
        ids = torch.tensor([list(s.prompt_ids) + list(s.completion_ids)])
        with torch.no_grad():
            alone = model(input_ids=ids).logits.float()[0].log_softmax(-1)
        p = len(s.prompt_ids)
        manual = torch.stack([alone[p + j - 1, tok] for j, tok in enumerate(s.completion_ids)])
        torch.testing.assert_close(logprobs_BT[row][mb["mask"][row]], manual, atol=1e-5, rtol=1e-5)


def test_token_packing_respects_the_budget_and_keeps_bins_even() -> None:
    """Packed bins sum to at most the budget, use every index once, are as few as the total
    needs here and hold about equal token counts; the result is deterministic."""
    lengths = [300 + (i * 37) % 500 for i in range(40)]
    bins = pack_tokens(lengths, 4096)
    assert sorted(i for b in bins for i in b) == list(range(40))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert max(loads) <= 4096 and len(bins) == -(-sum(lengths) // 4096)
    assert max(loads) - min(loads) <= max(lengths)
    assert pack_tokens(lengths, 4096) == bins


def test_packed_model_inputs_line_up_with_collate() -> None:
    """A packed row holds each sequence's tokens with positions from 0; hidden_index + 1 is the
    completion token that target_index places in collate's layout."""

    def seq(prompt: list[int], completion: list[int]) -> TrainSequence:
        zeros = [0.0] * len(completion)
        return TrainSequence(
            prompt_ids=prompt, completion_ids=completion, behave_logprobs=zeros, advantages=zeros
        )

    seqs = [seq([5, 6], [7, 8, 9]), seq([1], [2]), seq([3, 4, 5], [])]
    mb = collate(seqs)
    inputs = model_inputs(seqs, mb["input_ids"], packed=True)
    assert inputs.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4, 5]]
    assert inputs.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2]]
    assert inputs.cu_seqlens.tolist() == [0, 5, 7, 10] and inputs.max_length == 5
    targets = inputs.input_ids.flatten()[inputs.hidden_index + 1]
    assert targets.tolist() == mb["input_ids"].flatten()[inputs.target_index].tolist() == [7, 8, 9, 2]
    assert mb["mask"].flatten()[inputs.target_index].all() and int(mb["mask"].sum()) == 4
    padded = model_inputs(seqs, mb["input_ids"], packed=False)
    assert torch.equal(padded.hidden_index + 1, padded.target_index) and padded.cu_seqlens is None
