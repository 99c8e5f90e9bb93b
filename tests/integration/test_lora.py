"""LoRA on CPU: the FSDP2 trainer trains only adapters, publishes adapter directories, checkpoints
them losslessly, and the local engine serves exactly the adapter each version holds."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from areal_async import lora
from areal_async.engines.base import GenerationRequest, SamplingParams
from areal_async.engines.local.engine import LocalEngine
from areal_async.training.batching import TrainSequence
from areal_async.training.checkpoint import load_checkpoint, save_checkpoint
from areal_async.training.fsdp.engine import FSDPTrainEngine, init_distributed
from tests.helpers.engines import fsdp_engine
from tests.helpers.fsdp_helpers import random_batch, write_tiny_llama
from tests.helpers.numerics import LINEAR_ADAM, assert_same_updates
from tests.integration.test_fsdp import pg_loss

VOCAB = 64
SPEC = lora.LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("lora-base"), vocab=VOCAB, tie=False)


def make_engine(model_dir: Path, **kw: Any) -> FSDPTrainEngine:
    options: dict[str, Any] = {
        "dtype": "float32",
        "lr": 1e-2,
        "total_steps": 10,
        "micro_batch_tokens": 64,
        "lora": SPEC,
    }
    return fsdp_engine(model_dir, **(options | kw))


def batch(seed: int = 0) -> list[TrainSequence]:
    return random_batch([(4, 8), (3, 6), (5, 7), (2, 4)], vocab=VOCAB, seed=seed, behave_base=-4.0)


def base_weights(engine: FSDPTrainEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}


def test_only_adapters_train_and_the_base_stays_frozen_in_the_training_dtype(untied: Path) -> None:
    engine = make_engine(untied, dtype="bfloat16")
    trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert trainable and all(lora.is_adapter_name(n) for n in trainable)
    assert len(trainable) == 2 * 4 * 2  # A and B of 4 modules in 2 layers
    frozen = base_weights(engine)
    assert {t.dtype for t in frozen.values()} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for n, p in engine.model.named_parameters() if p.requires_grad)
    adapters = {n: p.detach().clone() for n, p in engine.model.named_parameters() if p.requires_grad}
    engine.train_step(batch(), pg_loss)
    # Only the adapters hold optimizer state, and only they moved (B leaves zero on the first step).
    assert sum(1 for s in engine.optimizer.state.values() if s) == len(trainable)
    after = dict(engine.model.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in frozen.items())
    moved = [n for n, t in adapters.items() if not torch.equal(after[n], t)]
    assert any(".lora_B." in n for n in moved)


def test_a_version_is_an_adapter_directory_and_a_checkpoint_resumes_losslessly(
    untied: Path, tmp_path: Path
) -> None:
    engine = make_engine(untied)
    engine.train_step(batch(0), pg_loss)
    engine.version = 1
    manifest = engine.save_hf(tmp_path / "v1")
    files = sorted(p.name for p in (tmp_path / "v1").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    assert [m["name"] for m in manifest] == sorted(m["name"] for m in manifest)
    assert all(m["name"].startswith(lora.PEFT_PREFIX) for m in manifest)
    adapter = lora.read_adapter_dir(tmp_path / "v1")
    assert adapter.scale == SPEC.scale and adapter.base_model == str(untied)

    # Checkpoint: adapters and their optimizer state only; a fresh engine continues identically.
    save_checkpoint(tmp_path / "run", 1, engine=engine, extra={})
    stored = dcp.FileSystemReader(str(tmp_path / "run" / "checkpoints" / "step_1" / "engine")).read_metadata()
    names = [k.removeprefix("model.") for k in stored.state_dict_metadata if k.startswith("model.")]
    assert names and all(lora.is_adapter_name(n) for n in names), names
    resumed = make_engine(untied, seed=7)  # other random A: the checkpoint must overwrite it
    load_checkpoint(tmp_path / "run", engine=resumed)
    a, b = engine.train_step(batch(1), pg_loss), resumed.train_step(batch(1), pg_loss)
    assert a["loss"] == pytest.approx(b["loss"], abs=0), (a, b)
    ours = dict(engine.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param, ours[name]), name

    with pytest.raises(ValueError, match="trainer.lora"):
        load_checkpoint(tmp_path / "run", engine=make_engine(untied, lora=dataclasses.replace(SPEC, rank=8)))
    with pytest.raises(ValueError, match="trainer.lora"):
        load_checkpoint(tmp_path / "run", engine=make_engine(untied, lora=None))


def test_merged_weights_give_the_trainer_s_logprobs(untied: Path) -> None:
    engine = make_engine(untied)
    engine.train_step(batch(0), pg_loss)
    merged = engine.merged_hf()
    assert merged is not None and not any(".base_layer." in n or lora.is_adapter_name(n) for n in merged)
    plain = make_engine(untied, lora=None)
    plain.model.hf.load_state_dict(merged)
    seqs = batch(3)
    for x, y in zip(engine.compute_logprobs(seqs), plain.compute_logprobs(seqs), strict=True):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=0)


def test_adapters_take_pi_prox_from_the_update_as_from_a_separate_pass(untied: Path) -> None:
    """With LoRA (dropout 0) pi_prox from the update's own forward gives the two-pass step's loss,
    gradient norm and stats and the same adapters; the learner keeps the separate pass where
    adapter dropout makes the training forward random."""
    from areal_async.config import TrainerConfig
    from areal_async.training.learner import Learner
    from tests.integration.test_fsdp import ratio_loss

    engines = {way: make_engine(untied) for way in ("update", "pass")}
    for _ in range(2):
        a = engines["update"].train_step(batch(0), ratio_loss, compute_prox=True)
        b = engines["pass"].train_step(batch(0), ratio_loss, compute_prox=True, prox_pass=True)
        for key in ("loss", "grad_norm", "prox_sum", "ratio_max"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key
    ours, theirs = engines["update"].snapshot_hf(), engines["pass"].snapshot_hf()
    assert ours is not None and theirs is not None
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], atol=1e-7, rtol=0)
    with_dropout = TrainerConfig(lora=dataclasses.replace(SPEC, dropout=0.1))
    assert Learner.needs_prox_pass(with_dropout) and not Learner.needs_prox_pass(TrainerConfig(lora=SPEC))
    assert Learner.needs_prox_pass(TrainerConfig(prox_pass=True))


def test_unknown_target_module_names_the_model_s_linear_modules(untied: Path) -> None:
    with pytest.raises(ValueError, match=r"no linear module called.*q_proj"):
        make_engine(untied, lora=lora.LoraConfig(target_modules=["qkv_proj"]))


async def _greedy(engine: LocalEngine, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    request = GenerationRequest(
        request_id="probe",
        prompt_ids=tuple(prompt),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=n),
    )
    (result,) = await engine.generate([request])
    return list(result.token_ids), list(result.logprobs)


@pytest.mark.asyncio
async def test_the_local_engine_serves_each_version_s_adapter(untied: Path, tmp_path: Path) -> None:
    """After each adapter version loads, the engine's greedy tokens' logprobs equal the trainer's
    own forward at that version, and differ from the base model's by far more than the tolerance."""
    trainer = make_engine(untied)
    base = make_engine(untied, lora=None)
    prompt = [5, 9, 14, 3, 22, 7]
    async with LocalEngine(untied, max_batch_size=2, dtype="float32") as engine:
        for version in (1, 2, 3):
            trainer.train_step(batch(version), pg_loss)
            trainer.version = version
            trainer.save_hf(tmp_path / f"v{version}")
            await engine.load_weights(version, tmp_path / f"v{version}")
            assert engine.version == version
            tokens, served = await _greedy(engine, prompt, 8)
            seq = [
                TrainSequence(
                    prompt_ids=prompt, completion_ids=tokens, behave_logprobs=served, advantages=[0.0] * 8
                )
            ]
            (ours,) = trainer.compute_logprobs(seq)
            (unadapted,) = base.compute_logprobs(seq)
            torch.testing.assert_close(torch.tensor(served), ours, atol=1e-4, rtol=0)
            # The check could fail: without its adapter the engine would be 10x the tolerance off.
            assert (ours - unadapted).abs().max() > 1e-3, f"v{version}: the adapter barely moved the model"
        # Full weights after adapters: they become the base, and the next adapter applies to them.
        await engine.load_weights(4, untied)
        tokens, served = await _greedy(engine, prompt, 8)
        seq = [
            TrainSequence(
                prompt_ids=prompt, completion_ids=tokens, behave_logprobs=served, advantages=[0.0] * 8
            )
        ]
        torch.testing.assert_close(torch.tensor(served), base.compute_logprobs(seq)[0], atol=1e-4, rtol=0)


async def _served_logprobs(engine: LocalEngine, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    tokens, served = await _greedy(engine, prompt, 8)
    return tokens, torch.tensor(served)


def _trainer_logprobs(trainer: FSDPTrainEngine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    seq = TrainSequence(
        prompt_ids=prompt, completion_ids=tokens, behave_logprobs=[0.0] * 8, advantages=[0.0] * 8
    )
    return trainer.compute_logprobs([seq])[0]


@pytest.mark.asyncio
async def test_a_cpu_engine_serves_an_adapter_before_its_merge_lands(untied: Path, tmp_path: Path) -> None:
    """With the merge held back, the new version is served at once through low-rank hooks and gives
    the trainer's logprobs: v1 over the base weights, v2 over weights that hold v1 merged (the hooks
    subtract v1). Once the merge lands the hooks are gone and the logprobs are unchanged."""
    trainer = make_engine(untied)
    prompt = [5, 9, 14, 3, 22, 7]
    async with LocalEngine(untied, max_batch_size=2, dtype="float32") as engine:
        merge, gate = engine._merge_adapter, threading.Event()

        def held_merge(adapter: lora.Adapter) -> dict[str, torch.Tensor]:
            gate.wait(timeout=60)
            return merge(adapter)

        engine._merge_adapter = held_merge  # type: ignore[method-assign]
        for version in (1, 2):
            trainer.train_step(batch(version), pg_loss)
            trainer.version = version
            trainer.save_hf(tmp_path / f"v{version}")
            gate.clear()
            await engine.load_weights(version, tmp_path / f"v{version}")
            assert (await engine.health())["lora_unmerged"], "the merge landed before the gate opened"
            tokens, unmerged = await _served_logprobs(engine, prompt)
            torch.testing.assert_close(
                unmerged, _trainer_logprobs(trainer, prompt, tokens), atol=1e-4, rtol=0
            )
            gate.set()
            with anyio.fail_after(30):
                await anyio.to_thread.run_sync(engine._lora.wait_landed)
            assert not (await engine.health())["lora_unmerged"]
            merged_tokens, merged = await _served_logprobs(engine, prompt)
            assert merged_tokens == tokens
            torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)


@pytest.mark.asyncio
async def test_an_adapter_merged_before_start_is_what_the_next_version_replaces(
    untied: Path, tmp_path: Path
) -> None:
    """An engine not started yet merges an adapter straight into its weights (as a GPU engine does
    before every pause); the next version, served through hooks, takes that adapter out again."""
    trainer = make_engine(untied)
    prompt = [5, 9, 14, 3, 22, 7]
    engine = LocalEngine(untied, max_batch_size=2, dtype="float32")
    for version in (1, 2):
        trainer.train_step(batch(version), pg_loss)
        trainer.version = version
        trainer.save_hf(tmp_path / f"v{version}")
        if version == 1:
            await engine.load_weights(1, tmp_path / "v1")
            assert not (await engine.health())["lora_unmerged"]
            await engine.start()
        else:
            await engine.load_weights(2, tmp_path / "v2")
        tokens, served = await _served_logprobs(engine, prompt)
        torch.testing.assert_close(served, _trainer_logprobs(trainer, prompt, tokens), atol=1e-4, rtol=0)
    await engine.aclose()


def _two_rank_worker(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    init_distributed("cpu")
    try:
        engine = make_engine(Path(model_dir), **LINEAR_ADAM)
        seqs = batch(0)
        stats = engine.train_step(seqs[rank::2], pg_loss)
        tensors = engine.snapshot_hf()
        if rank == 0:
            torch.save({"loss": stats["loss"], "adapter": tensors}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_fsdp_ranks_train_the_same_adapters_as_one_process(untied: Path, tmp_path: Path) -> None:
    """Two gloo ranks on half the batch each make the one-process step: the same loss and the same
    adapter update (A's is zero while B starts at zero)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "two.pt"
    mp.start_processes(_two_rank_worker, args=(port, str(untied), str(out)), nprocs=2, start_method="spawn")
    two = torch.load(out)
    one = make_engine(untied, **LINEAR_ADAM)
    before = one.snapshot_hf()
    stats = one.train_step(batch(0), pg_loss)
    assert two["loss"] == pytest.approx(stats["loss"], rel=1e-5)
    ours = one.snapshot_hf()
    assert before is not None and ours is not None
    assert_same_updates(two["adapter"], ours, before, steps=1)
