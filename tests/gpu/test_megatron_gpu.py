"""Megatron backend on CUDA: bf16 logprobs and a training step agree with FSDP2 on the same weights and
batch (packed rows, Triton logprob kernels, packed attention), compiled layers included; and a whole run
with the trainer on megatron-core serves every version it publishes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("megatron.core")

OPTIONS: dict[str, Any] = {
    "lr": 1e-5,
    "total_steps": 10,
    "micro_batch_tokens": 4096,
    "grad_clip": 1.0,
    "device": "cuda",
    "dtype": "bfloat16",
}


def _model(path: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def _batch() -> list[Any]:
    from tests.helpers.fsdp_helpers import random_batch

    return random_batch([(64, 300), (32, 120), (100, 500), (16, 40)], vocab=4096, behave_base=-8.0)


def _pg_loss(mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    mask = mb["mask"].float()
    return -(mb["advantages"] * mb["logprobs"] * mask).sum() / mb["global_tokens"], {}


def _run(engine: Any) -> dict[str, Any]:
    seqs = _batch()
    out = {"logprobs": [t.float() for t in engine.compute_logprobs(seqs)]}
    out["metrics"] = [engine.train_step(seqs, _pg_loss) for _ in range(2)]
    return out


def _megatron(rank: int, model: Path, out: Path, compile: bool) -> None:
    from tests.helpers.engines import megatron_engine

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(out / "inductor"))
    engine = megatron_engine(model, compile=compile, **OPTIONS)
    torch.save(_run(engine), out / f"megatron-compile{int(compile)}.pt")


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_megatron_matches_fsdp2_in_bf16(tmp_path: Path, compile: bool) -> None:
    from tests.helpers.engines import fsdp_engine

    model = _model(tmp_path / "model")
    mp.spawn(_megatron, args=(model, tmp_path, compile), nprocs=1, join=True)
    got = torch.load(tmp_path / f"megatron-compile{int(compile)}.pt", weights_only=False)
    want = _run(fsdp_engine(model, packed=True, **OPTIONS))
    diffs = torch.cat([(g - w).abs() for g, w in zip(got["logprobs"], want["logprobs"], strict=True)])
    assert diffs.mean() < 2e-2 and diffs.max() < 0.5, (diffs.mean(), diffs.max())
    for g, w in zip(got["metrics"], want["metrics"], strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=2e-2)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=5e-2)
        assert g["loss_tokens"] == w["loss_tokens"]


@pytest.mark.timeout(900)
def test_whole_run_with_the_trainer_on_megatron_serves_every_version(tmp_path: Path) -> None:
    """max_staleness 0, float32 on both sides: pi_prox (megatron-core on CUDA) equals pi_behave (the
    local engine on CUDA) for every token of every step, and the run trains each task once."""
    from tests.e2e.test_e2e import _check_exactly_once
    from tests.e2e.tiny_task import warm_start_mode_select
    from tests.helpers.jobs import committed_steps, read_steps, run_job, tiny_config

    model = warm_start_mode_select(tmp_path / "model")
    total, batch = 6, 4
    cfg = tiny_config(
        tmp_path,
        model,
        "megatron-gpu",
        rollout__group_size=4,
        rollout__max_staleness=0,
        rollout__device="cuda",
        model__dtype="float32",
        trainer__dtype="float32",
        trainer__device="cuda",
        trainer__backend="megatron",
        trainer__total_steps=total,
        trainer__batch_size=batch,
        trainer__eval_every=0,
        dataset__eval_size=4,
    )
    res = run_job(cfg, timeout=600)
    assert res.returncode == 0, res.output[-4000:]
    steps = read_steps(tmp_path / "megatron-gpu", "megatron-gpu")
    _check_exactly_once(steps, total, batch)
    for ev in committed_steps(steps).values():
        assert abs(ev.metrics["behave_weight_mean"] - 1.0) < 2e-3, (ev.step, ev.metrics)
