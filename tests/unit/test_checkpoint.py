"""Checkpoint commit, lookup and lossless resume of the training engine (single process, tiny model)."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from areal_async.training import checkpoint
from areal_async.training.batching import TrainSequence
from areal_async.training.checkpoint import find_latest, load_checkpoint, save_checkpoint
from areal_async.training.fsdp.engine import FSDPTrainEngine
from tests.helpers.engines import fsdp_engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def make_batch(seed: int) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(4):
        c = 3 + i
        seqs.append(
            TrainSequence(
                prompt_ids=torch.randint(0, 64, (2 + i,), generator=g).tolist(),
                completion_ids=torch.randint(0, 64, (c,), generator=g).tolist(),
                behave_logprobs=[-4.0] * c,
                advantages=torch.randn(c, generator=g).tolist(),
            )
        )
    return seqs


def pg_loss(mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = -(mb["advantages"] * mb["logprobs"] * mb["mask"]).sum() / mb["global_tokens"]
    return loss, {}


def make_engine(model_dir: Path, seed: int = 0) -> FSDPTrainEngine:
    return fsdp_engine(
        model_dir,
        dtype="float32",
        lr=1e-2,
        warmup_steps=2,
        total_steps=6,
        lr_schedule="cosine",
        weight_decay=0.1,
        micro_batch_tokens=24,
        seed=seed,
    )


def params(engine: FSDPTrainEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.named_parameters()}


def test_resume_makes_the_next_step_bit_identical(model_dir: Path, tmp_path: Path) -> None:
    """Model, AdamW moments, lr schedule, RNG and version come back: the step after a restore equals the uninterrupted one."""
    run = make_engine(model_dir)
    for step in range(2):
        run.train_step(make_batch(step), pg_loss)
    save_checkpoint(tmp_path, 2, engine=run, extra={"dataset_index": 7, "trained": ["a", "b"]})
    rng_after_save = (random.random(), np.random.rand(), torch.rand(3))
    metrics = run.train_step(make_batch(2), pg_loss)

    resumed = make_engine(model_dir, seed=123)
    extra = load_checkpoint(tmp_path, engine=resumed)
    assert extra == {"dataset_index": 7, "trained": ["a", "b"]}
    assert resumed.version == 2
    assert (random.random(), np.random.rand()) == rng_after_save[:2]
    assert torch.equal(torch.rand(3), rng_after_save[2])
    resumed_metrics = resumed.train_step(make_batch(2), pg_loss)
    assert resumed_metrics["lr"] == metrics["lr"]
    assert resumed_metrics["loss"] == metrics["loss"]
    expected, actual = params(run), params(resumed)
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def test_a_full_checkpoint_of_an_earlier_version_still_resumes(model_dir: Path, tmp_path: Path) -> None:
    """Checkpoints written before sharding held the whole state in engine.pt; they still load."""
    run = make_engine(model_dir)
    run.train_step(make_batch(0), pg_loss)
    step = save_checkpoint(tmp_path, 1, engine=run, extra={})
    assert (step / "engine" / ".metadata").is_file()
    shutil.rmtree(step / "engine")
    torch.save(run.state_dict(), step / "engine.pt")  # the earlier layout
    metrics = run.train_step(make_batch(1), pg_loss)

    resumed = make_engine(model_dir, seed=123)
    load_checkpoint(tmp_path, engine=resumed)
    assert resumed.version == 1
    assert resumed.train_step(make_batch(1), pg_loss)["loss"] == metrics["loss"]
    expected, actual = params(run), params(resumed)
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def test_a_crash_before_the_rename_leaves_the_previous_checkpoint_latest(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that dies before its atomic rename is invisible; the next save cleans up after it."""
    engine = make_engine(model_dir)
    first = save_checkpoint(tmp_path, 1, engine=engine, extra={"at": 1})
    engine.train_step(make_batch(0), pg_loss)

    def crash(src: os.PathLike[str], dst: os.PathLike[str]) -> None:
        raise OSError("simulated crash before commit")

    with monkeypatch.context() as patched:  # the commit's rename of the step directory fails
        patched.setattr(checkpoint, "replace_dir", crash)
        with pytest.raises(OSError, match="simulated crash"):
            save_checkpoint(tmp_path, 2, engine=engine, extra={"at": 2})

    assert find_latest(tmp_path) == first
    assert not (tmp_path / "checkpoints" / "step_2").exists()
    fresh = make_engine(model_dir)
    assert load_checkpoint(tmp_path, engine=fresh) == {"at": 1}
    assert fresh.version == 0

    second = save_checkpoint(tmp_path, 2, engine=engine, extra={"at": 2})
    assert find_latest(tmp_path) == second
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_only_the_last_k_checkpoints_are_kept(model_dir: Path, tmp_path: Path) -> None:
    """Older step directories are pruned; latest names the newest."""
    engine = make_engine(model_dir)
    for step in (1, 2, 3, 10):
        save_checkpoint(tmp_path, step, engine=engine, extra={}, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_10", "step_3"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_10"


def test_find_latest_follows_the_pointer_then_falls_back_to_the_highest_step(tmp_path: Path) -> None:
    """The pointer is authoritative; without a valid one the highest committed step wins; nothing gives None."""
    ckpt = tmp_path / "checkpoints"
    assert find_latest(tmp_path) is None
    for n in (2, 9, 10):
        (ckpt / f"step_{n}").mkdir(parents=True)
    (ckpt / ".tmp-step_11").mkdir()
    assert find_latest(tmp_path) == ckpt / "step_10"
    (ckpt / "latest").write_text("step_9\n")
    assert find_latest(tmp_path) == ckpt / "step_9"
    (ckpt / "latest").write_text("step_42\n")
    assert find_latest(tmp_path) == ckpt / "step_10"


def test_loading_without_a_checkpoint_says_where_it_looked(model_dir: Path, tmp_path: Path) -> None:
    """A missing checkpoint is a clear FileNotFoundError naming the directory."""
    with pytest.raises(FileNotFoundError, match="checkpoints"):
        load_checkpoint(tmp_path, engine=make_engine(model_dir))
