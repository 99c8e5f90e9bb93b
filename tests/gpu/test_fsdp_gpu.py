"""Training engine on one CUDA GPU: bf16 autocast steps are sane and logprobs match a plain forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from areal_async.training.batching import TrainSequence
from areal_async.training.fsdp.engine import FSDPTrainEngine
from tests.helpers.engines import fsdp_engine
from tests.helpers.fsdp_helpers import random_batch, write_tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

VOCAB = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), vocab=VOCAB, hidden=128, intermediate=256)


def make_batch() -> list[TrainSequence]:
    return random_batch([(8, 40), (5, 17), (12, 64), (3, 9), (7, 30), (9, 1)], vocab=VOCAB)


def pg_loss(mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = -(mb["advantages"] * mb["logprobs"] * mb["mask"]).sum() / mb["global_tokens"]
    return loss, {}


def make_engine(model_dir: Path, **kw: object) -> FSDPTrainEngine:
    options: dict[str, object] = {
        "dtype": "bfloat16",
        "lr": 1e-2,
        "micro_batch_tokens": 128,
        "device": "cuda",
    }
    return fsdp_engine(model_dir, **(options | kw))


def test_bf16_steps_on_cuda_move_logprobs_the_advantage_way(model_dir: Path, tmp_path: Path) -> None:
    """Autocast bf16 with fp32 master weights on CUDA: finite losses, a real gradient, and rewarded tokens gain."""
    engine = make_engine(model_dir)
    batch = make_batch()
    before = engine.compute_logprobs(batch)
    for _ in range(3):
        metrics = engine.train_step(batch, pg_loss)
        assert torch.isfinite(torch.tensor([metrics["loss"], metrics["grad_norm"]])).all()
        assert metrics["grad_norm"] > 0 and metrics["micro_batches"] > 1
    after = engine.compute_logprobs(batch)
    gain = sum(
        float((torch.tensor(s.advantages) * (a - b)).sum())
        for s, a, b in zip(batch, after, before, strict=True)
    )
    assert gain > 0
    assert all(p.is_cuda and p.dtype == torch.float32 for p in engine.model.parameters())
    manifest = engine.save_hf(tmp_path / "v3")
    assert (tmp_path / "v3" / "model.safetensors").is_file() and manifest


def test_cuda_logprobs_match_a_plain_fp32_forward(model_dir: Path) -> None:
    """Engine logprobs (bf16 autocast, chunked) agree with an fp32 HF forward within bf16 precision."""
    batch = make_batch()
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    engine = make_engine(model_dir, logprob_chunk_tokens=16)
    got = engine.compute_logprobs(batch)
    for s, logprobs in zip(batch, got, strict=True):
        ids = torch.tensor([list(s.prompt_ids) + list(s.completion_ids)], device="cuda")
        with torch.no_grad():
            logits = hf(ids).logits[0].float()
        p = len(s.prompt_ids)
        want = logits[p - 1 : -1].log_softmax(-1).gather(-1, ids[0, p:, None]).squeeze(-1).cpu()
        torch.testing.assert_close(logprobs, want, atol=0.1, rtol=0)


def test_chunked_logprob_recompute_gives_the_same_step_on_cuda(model_dir: Path) -> None:
    """Recomputing the lm_head in chunks during backward changes neither the loss nor the gradient norm."""
    batch = make_batch()
    whole = make_engine(model_dir, dtype="float32").train_step(batch, pg_loss)
    chunked = make_engine(model_dir, dtype="float32", logprob_chunk_tokens=7).train_step(batch, pg_loss)
    assert chunked["loss"] == pytest.approx(whole["loss"], rel=1e-4, abs=1e-6)
    assert chunked["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-3)


@pytest.mark.parametrize("attention_kernel", ["flash", "triton"])
@pytest.mark.parametrize("compile", [False, True])
def test_packed_varlen_rows_train_like_padded_rows_on_cuda(
    model_dir: Path, compile: bool, attention_kernel: str
) -> None:
    """One packed row per micro-batch through a varlen kernel (FlashAttention-2 or the Triton
    kernels) gives the padded rows' logprobs and gradient, within bf16 precision, compiled or not."""
    from areal_async.ops.varlen import varlen_available

    assert varlen_available(torch.device("cuda"), torch.bfloat16)
    batch = make_batch()
    # eps >> |grad|: Adam's first update is lr * grad / (|grad| + eps), proportional to the gradient.
    options: dict[str, object] = {"lr": 1e3, "eps": 1e3, "grad_clip": 0.0, "compile": compile}
    padded = make_engine(model_dir, packed=False, **options)
    packed = make_engine(model_dir, attention_kernel=attention_kernel, **options)
    assert packed.packed and packed.attention_kernel == attention_kernel
    for a, b in zip(padded.compute_logprobs(batch), packed.compute_logprobs(batch), strict=True):
        torch.testing.assert_close(b, a, atol=0.05, rtol=0)
    before = torch.cat([p.detach().flatten() for p in packed.params])
    metrics_a, metrics_b = padded.train_step(batch, pg_loss), packed.train_step(batch, pg_loss)
    assert metrics_b["loss"] == pytest.approx(metrics_a["loss"], rel=2e-2, abs=1e-4)
    assert metrics_b["grad_norm"] == pytest.approx(metrics_a["grad_norm"], rel=2e-2)
    step_a = torch.cat([p.detach().flatten() for p in padded.params]) - before
    step_b = torch.cat([p.detach().flatten() for p in packed.params]) - before
    assert float(torch.nn.functional.cosine_similarity(step_a, step_b, dim=0)) > 0.99


def test_pi_prox_from_the_update_matches_a_separate_pass_in_bf16(model_dir: Path) -> None:
    """bf16 autocast on CUDA, packed rows: pi_prox taken from the update's own forward equals a
    separate no-grad pass (the two-pass step), and the two steps report the same loss, gradient
    norm and pi_prox sum, two steps in a row."""
    from tests.integration.test_fsdp import ratio_loss

    batch = make_batch()
    engines = {way: make_engine(model_dir, packed=True) for way in ("update", "pass")}
    for _ in range(2):
        seen: dict[str, torch.Tensor] = {}
        metrics = {}
        for way, engine in engines.items():
            parts: list[torch.Tensor] = []

            def recording(mb: dict[str, torch.Tensor], parts: list[torch.Tensor] = parts) -> object:
                parts.append(mb["prox_logprobs"][mb["mask"]].float())
                return ratio_loss(mb)

            metrics[way] = engine.train_step(batch, recording, compute_prox=True, prox_pass=way == "pass")
            seen[way] = torch.cat(parts)
        torch.testing.assert_close(seen["update"], seen["pass"], atol=2e-2, rtol=0)
        for key in ("loss", "grad_norm", "prox_sum"):
            assert metrics["update"][key] == pytest.approx(metrics["pass"][key], rel=1e-2, abs=1e-3), key
        assert "prox_seconds" in metrics["pass"] and "prox_seconds" not in metrics["update"]
