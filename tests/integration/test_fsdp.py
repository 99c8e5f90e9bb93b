"""FSDP2 training engine on CPU: 2 ranks (gloo) agree with 1 process; HF export and sharded checkpoints round-trip."""

from __future__ import annotations

import dataclasses
import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from areal_async.training.batching import TrainSequence
from areal_async.training.checkpoint import load_checkpoint, save_checkpoint
from areal_async.training.fsdp.engine import FSDPTrainEngine, init_distributed
from areal_async.weights_file import tensor_sha256
from tests.helpers.engines import fsdp_engine
from tests.helpers.fsdp_helpers import as_torchrun_rank, random_batch, write_tiny_llama
from tests.helpers.numerics import LINEAR_ADAM, assert_same_updates

VOCAB = 64
WORLD = 2
STEPS = 2


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tied"), vocab=VOCAB, tie=True)


@pytest.fixture(scope="module")
def untied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("untied"), vocab=VOCAB, tie=False)


def make_batch() -> list[TrainSequence]:
    """Even indices are long, odd short: rank 0 packs four micro-batches, rank 1 one (so it pads with empty passes)."""
    shapes = [(4, 16), (2, 3), (6, 12), (3, 2), (8, 8), (1, 4), (2, 2)]
    return random_batch(shapes, vocab=VOCAB, behave_base=-4.0)


def pg_loss(mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain policy gradient, token mean over the global batch; one stat normalised like the loss."""
    mask = mb["mask"].float()
    loss = -(mb["advantages"] * mb["logprobs"] * mask).sum() / mb["global_tokens"]
    stats = {
        "token_share": mask.sum() / mb["global_tokens"],
        "advantage_max": torch.where(mb["mask"], mb["advantages"], -torch.inf).amax(),
    }
    return loss, stats


def ratio_loss(mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy gradient through the ratio to pi_prox; reports pi_prox's sum over completion tokens."""
    mask = mb["mask"].float()
    ratio = torch.exp(mb["logprobs"] - mb["prox_logprobs"])
    loss = -(mb["advantages"] * ratio * mask).sum() / mb["global_tokens"]
    return loss, {"prox_sum": (mb["prox_logprobs"] * mask).sum(), "ratio_max": (ratio * mask).amax()}


def with_prox(engine: FSDPTrainEngine, seqs: list[TrainSequence]) -> list[TrainSequence]:
    """`seqs` with pi_prox from a separate `compute_logprobs` pass."""
    prox = engine.compute_logprobs(seqs)
    return [dataclasses.replace(s, prox_logprobs=p) for s, p in zip(seqs, prox, strict=True)]


def make_engine(model_dir: Path, **kw: Any) -> FSDPTrainEngine:
    options: dict[str, Any] = {
        "dtype": "float32",
        "lr": 1e-3,
        "total_steps": 10,
        "micro_batch_tokens": 24,
        "grad_clip": 1.0,
    }
    return fsdp_engine(model_dir, **(options | kw))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, model_dir: Path, out_dir: Path, port: int) -> None:
    as_torchrun_rank(rank, WORLD, port)
    assert init_distributed("cpu") == (rank, WORLD)
    try:
        # Gradient checkpointing and 5-row logprob chunks must not change the numbers.
        engine = make_engine(model_dir, gradient_checkpointing=True, logprob_chunk_tokens=5, **LINEAR_ADAM)
        shard = make_batch()[rank::WORLD]
        result: dict[str, Any] = {"prox": engine.compute_logprobs(shard), "metrics": []}
        for _ in range(STEPS):
            result["metrics"].append(engine.train_step(shard, pg_loss))
        result["manifest"] = engine.save_hf(out_dir / "hf")
        result["model"] = engine.state_dict()["model"]
        save_checkpoint(out_dir / "run", STEPS, engine=engine, extra={"world": WORLD})
        resumed = make_engine(model_dir, **LINEAR_ADAM)
        result["extra"] = load_checkpoint(out_dir / "run", engine=resumed)
        result["resumed_version"] = resumed.version
        expected, actual = engine.train_step(shard, pg_loss), resumed.train_step(shard, pg_loss)
        result["resume_loss"] = (expected["loss"], actual["loss"])
        result["resume_max_diff"] = max(
            (a.to_local() - b.to_local()).abs().max().item()
            for a, b in zip(engine.model.parameters(), resumed.model.parameters(), strict=True)
        )
        # pi_prox from the update (rank 1 pads with empty passes) == a separate pass before it.
        result["prox_in_step"] = engine.train_step(shard, ratio_loss, compute_prox=True)
        result["prox_before"] = resumed.train_step(with_prox(resumed, shard), ratio_loss)
        torch.save(result, out_dir / f"rank{rank}.pt")
        # Both ranks leave their last collective before either tears the group down: a rank that
        # destroys it while its peer's gloo pair is still open can abort the peer at exit.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_fsdp_ranks_match_one_process(tied_model: Path, tmp_path: Path) -> None:
    """Each of 2 gloo ranks trains on half the batch: losses, grad norms and updated weights equal the 1-process run.

    The same run checks that pi_prox logprobs agree, that save_hf from sharded weights
    exports every tensor with a correct sha256, and that a checkpoint, written by each rank as its
    own shards, loads into fresh sharded engines that then step identically, and into one process
    whose next step on the whole batch is the one the two ranks computed.
    """
    mp.spawn(_rank_main, args=(tied_model, tmp_path, free_port()), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    torch.set_num_threads(1)
    single = make_engine(tied_model, **LINEAR_ADAM)
    before = make_engine(tied_model).state_dict()["model"]  # a state_dict() call initialises Adam's state
    batch = make_batch()
    prox = single.compute_logprobs(batch)
    for rank in range(WORLD):
        for got, want in zip(ranks[rank]["prox"], prox[rank::WORLD], strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for step in range(STEPS):
        want = single.train_step(batch, pg_loss)
        for r in ranks:
            got = r["metrics"][step]
            keys = (
                "loss",
                "grad_norm",
                "lr",
                "entropy",
                "token_share",
                "advantage_max",
                "total_tokens",
                "loss_tokens",
            )
            for key in keys:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (step, key)
        assert ranks[0]["metrics"][step]["micro_batches"] == 4

    assert ranks[1]["model"] == {}
    assert_same_updates(ranks[0]["model"], single.state_dict()["model"], before, steps=STEPS)

    manifest = ranks[0]["manifest"]
    assert manifest == ranks[1]["manifest"]
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(e["name"] for e in manifest)
        for entry in manifest:
            assert tensor_sha256(f.get_tensor(entry["name"])) == entry["sha256"]
    assert "lm_head.weight" not in {e["name"] for e in manifest}  # tied to the embedding

    step = tmp_path / "run" / "checkpoints" / f"step_{STEPS}"
    assert len(list((step / "engine").glob("*.distcp"))) == WORLD  # each rank wrote its shards
    assert "model" not in torch.load(step / "engine.pt", weights_only=True)
    alone = make_engine(tied_model, seed=5, **LINEAR_ADAM)
    assert load_checkpoint(tmp_path / "run", engine=alone) == {"world": WORLD}
    assert alone.train_step(batch, pg_loss)["loss"] == pytest.approx(ranks[0]["resume_loss"][0], rel=1e-5)

    for r in ranks:
        assert r["extra"] == {"world": WORLD}
        assert r["resumed_version"] == STEPS
        assert r["resume_loss"][0] == pytest.approx(r["resume_loss"][1], abs=1e-7)
        assert r["resume_max_diff"] <= 1e-6
        for key in ("loss", "grad_norm", "prox_sum", "ratio_max"):
            assert r["prox_in_step"][key] == pytest.approx(r["prox_before"][key], rel=1e-5, abs=1e-6), key
        assert "prox_seconds" not in r["prox_in_step"]  # no pass of its own


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_save_hf_round_trips_through_transformers(
    tied_model: Path, untied_model: Path, tmp_path: Path, tie: bool
) -> None:
    """The exported directory loads with transformers and gives the trained model's logits; the manifest matches the file."""
    model_dir = tied_model if tie else untied_model
    engine = make_engine(model_dir)
    engine.train_step(make_batch(), pg_loss)
    out = tmp_path / "weights" / "v1"
    manifest = engine.save_hf(out)

    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "manifest.json",
        "model.safetensors",
        "tokenizer_config.json",
    ]
    assert not out.with_name("v1.tmp").exists()
    assert json.loads((out / "manifest.json").read_text()) == manifest
    with safe_open(out / "model.safetensors", "pt") as f:
        for entry in manifest:
            tensor = f.get_tensor(entry["name"])
            assert list(tensor.shape) == entry["shape"] and entry["dtype"] == "float32"
            assert tensor_sha256(tensor) == entry["sha256"]

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 33, 2, 60, 7]])
    with torch.no_grad():
        trained = engine.model.hf.eval()(ids).logits
        torch.testing.assert_close(reloaded(ids).logits, trained, atol=0, rtol=0)

    # Saving again over the same directory replaces it atomically.
    engine.train_step(make_batch(), pg_loss)
    assert engine.save_hf(out) != manifest


def test_engine_logprobs_match_a_plain_forward(tied_model: Path) -> None:
    """compute_logprobs returns log p(completion token | prefix) at the sampler's temperature, in every dtype."""
    batch = make_batch()
    hf = LlamaForCausalLM.from_pretrained(tied_model, dtype=torch.float32).eval()
    for dtype, temperature, atol in (("float32", 1.0, 1e-5), ("float32", 0.7, 1e-5), ("bfloat16", 1.0, 0.1)):
        engine = make_engine(tied_model, dtype=dtype, temperature=temperature)
        got = engine.compute_logprobs(batch)
        for s, logprobs in zip(batch, got, strict=True):
            ids = torch.tensor([list(s.prompt_ids) + list(s.completion_ids)])
            with torch.no_grad():
                logits = hf(ids).logits[0].float() / temperature
            p = len(s.prompt_ids)
            want = logits[p - 1 : -1].log_softmax(-1).gather(-1, ids[0, p:, None]).squeeze(-1)
            assert logprobs.dtype == torch.float32
            torch.testing.assert_close(logprobs, want, atol=atol, rtol=0)


def test_bf16_training_raises_the_logprob_of_rewarded_tokens(tied_model: Path) -> None:
    """With autocast bf16 and fp32 master weights a few policy-gradient steps move logprobs the advantage's way."""
    engine = make_engine(tied_model, dtype="bfloat16", lr=1e-2)
    batch = make_batch()
    before = engine.compute_logprobs(batch)
    for _ in range(3):
        metrics = engine.train_step(batch, pg_loss)
        assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    after = engine.compute_logprobs(batch)
    gain = sum(
        float((torch.tensor(s.advantages) * (a - b)).sum())
        for s, a, b in zip(batch, after, before, strict=True)
    )
    assert gain > 0
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())
    assert engine.version == 3


TIMINGS = {"compute_seconds", "tokens_per_s", "prox_seconds"}


def test_prox_from_the_update_equals_a_separate_pass_and_a_given_one(tied_model: Path) -> None:
    """pi_prox from the update's own forward (train_step(compute_prox=True)), from a no-grad pass
    first (prox_pass=True, the two-pass step) and handed in by the caller (compute_logprobs before
    the step) are the same logprobs; with the decoupled policy loss the three steps report the same
    loss, gradient norm and loss stats (behaviour weights, clip fractions, ratios) and make the same
    update, two steps in a row. Only the separate pass reports its time."""
    from areal_async.config import LossConfig
    from areal_async.training.learner import global_denominator, make_loss_fn

    batch = make_batch()
    loss = LossConfig(behave_cap=5.0)
    policy = make_loss_fn(
        loss, max_new_tokens=16, denominator=global_denominator(batch, loss, max_new_tokens=16)
    )
    engines = {way: make_engine(tied_model) for way in ("update", "pass", "given")}
    for _ in range(2):
        seen: dict[str, torch.Tensor] = {}
        metrics: dict[str, dict[str, float]] = {}
        for way, engine in engines.items():
            parts: list[torch.Tensor] = []

            def recording(mb: dict[str, torch.Tensor], parts: list[torch.Tensor] = parts) -> Any:
                parts.append(mb["prox_logprobs"][mb["mask"]])
                return policy(mb)

            if way == "given":
                metrics[way] = engine.train_step(with_prox(engine, batch), recording)
            else:
                metrics[way] = engine.train_step(batch, recording, compute_prox=True, prox_pass=way == "pass")
            seen[way] = torch.cat(parts)
        for way in ("pass", "given"):
            torch.testing.assert_close(seen["update"], seen[way], atol=1e-6, rtol=0)
            assert metrics["update"].keys() - TIMINGS == metrics[way].keys() - TIMINGS
            for key in metrics["update"].keys() - TIMINGS:
                assert metrics["update"][key] == pytest.approx(metrics[way][key], rel=1e-6, abs=1e-7), key
        assert metrics["update"]["behave_weight_max"] > 1.0  # pi_prox is not pi_behave: the weights matter
        assert "prox_seconds" not in metrics["update"] and "prox_seconds" not in metrics["given"]
        assert 0 < metrics["pass"]["prox_seconds"] < metrics["pass"]["compute_seconds"]
    for way in ("pass", "given"):
        for p, q in zip(engines["update"].model.parameters(), engines[way].model.parameters(), strict=True):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_the_policy_loss_plugs_into_the_engine(tied_model: Path) -> None:
    """areal_async.algo.loss.policy_loss runs as loss_fn: at pi_theta == pi_prox the ratio is 1 and stats are global."""
    loss_module = pytest.importorskip("areal_async.algo.loss")
    engine = make_engine(tied_model)
    batch = make_batch()
    prox = engine.compute_logprobs(batch)
    seqs = [dataclasses.replace(s, prox_logprobs=p) for s, p in zip(batch, prox, strict=True)]

    def loss_fn(mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return loss_module.policy_loss(
            mb["logprobs"],
            mb["prox_logprobs"],
            mb["behave_logprobs"],
            mb["advantages"],
            mb["mask"],
            behave_cap=None,
            denominator=mb["global_tokens"],
        )

    metrics = engine.train_step(seqs, loss_fn)
    assert metrics["tokens"] == metrics["loss_tokens"] == sum(s.num_completion_tokens for s in batch)
    assert metrics["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["ratio_sum"] == pytest.approx(metrics["tokens"], rel=1e-4)
    assert metrics["grad_norm"] > 0 and engine.version == 1
