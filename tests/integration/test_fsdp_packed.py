"""Packed micro-batches (one row, attention kept within each sequence) train exactly like padded rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from areal_async.training.batching import TrainSequence
from areal_async.training.fsdp.engine import FSDPTrainEngine
from tests.helpers.engines import fsdp_engine
from tests.helpers.fsdp_helpers import random_batch, write_tiny_llama

VOCAB = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), vocab=VOCAB)


def make_batch() -> list[TrainSequence]:
    """Lengths from 3 to 20, one completion of a single token and one with no completion."""
    shapes = [(4, 16), (2, 3), (6, 12), (3, 0), (8, 8), (1, 4), (2, 1), (5, 9)]
    return random_batch(shapes, vocab=VOCAB, seed=1, behave_base=-4.0)


def pg_loss(mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    mask = mb["mask"].float()
    loss = -(mb["advantages"] * mb["logprobs"] * mask).sum() / mb["global_tokens"]
    return loss, {"rows": torch.tensor(float(mask.shape[0]))}


def make_engine(model_dir: Path, **kw: Any) -> FSDPTrainEngine:
    # eps >> |grad|: Adam's first update is lr * grad / (|grad| + eps) ~ grad, so the
    # parameter change shows the gradient itself, not only its sign.
    options: dict[str, Any] = {
        "dtype": "float32",
        "lr": 1e3,
        "eps": 1e3,
        "grad_clip": 0.0,
        "micro_batch_tokens": 30,
    }
    return fsdp_engine(model_dir, **(options | kw))


def test_packed_logprobs_and_gradients_match_padded_rows(model_dir: Path) -> None:
    """Packing changes neither pi_prox, nor the loss, entropy, gradient norm or parameter update:
    a token never attends across a sequence boundary and positions restart per sequence (on CPU
    the packed attention runs per sequence; tests/gpu covers the varlen kernel)."""
    batch = make_batch()
    padded, packed = make_engine(model_dir, packed=False), make_engine(model_dir, packed=True)
    assert packed.packed and not padded.packed
    prox_a, prox_b = padded.compute_logprobs(batch), packed.compute_logprobs(batch)
    for s, a, b in zip(batch, prox_a, prox_b, strict=True):
        assert a.shape == b.shape == (s.num_completion_tokens,)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    before = [p.detach().clone() for p in packed.params]
    metrics_a, metrics_b = padded.train_step(batch, pg_loss), packed.train_step(batch, pg_loss)
    assert metrics_b["micro_batches"] < metrics_a["micro_batches"]  # no padding: fewer passes
    assert metrics_b["rows"] == len(batch)
    for key in ("loss", "entropy", "grad_norm", "total_tokens"):
        assert metrics_b[key] == pytest.approx(metrics_a[key], rel=1e-5, abs=1e-7), key
    assert metrics_b["grad_norm"] > 0
    for a, b, b0 in zip(padded.params, packed.params, before, strict=True):
        torch.testing.assert_close(b - b0, a.detach() - b0, rtol=1e-4, atol=1e-6)


def test_a_cross_sequence_token_would_change_the_logprobs(model_dir: Path) -> None:
    """The equality above is not vacuous: the same tokens as one unbroken sequence score differently."""
    batch = make_batch()[:2]
    engine = make_engine(model_dir, packed=True)
    joined = TrainSequence(
        prompt_ids=[*batch[0].prompt_ids, *batch[0].completion_ids, *batch[1].prompt_ids],
        completion_ids=batch[1].completion_ids,
        behave_logprobs=batch[1].behave_logprobs,
        advantages=batch[1].advantages,
    )
    separate, together = engine.compute_logprobs(batch)[1], engine.compute_logprobs([joined])[0]
    assert not torch.allclose(separate, together, atol=1e-3)
