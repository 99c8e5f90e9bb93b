"""Megatron backend on CPU (gloo): megatron-core's GPT model trained by the shared loop agrees with the
FSDP2 engine on Llama, Qwen2 and Qwen3 models, at tensor_parallel 1 and 2 (with and without sequence
parallelism), over 2 and 3 pipeline stages, with context and data parallelism, a step with pi_prox
from the update's own forward equals FSDP2's two-pass step on every layout, and its sharded
checkpoints resume losslessly at another tensor-parallel, pipeline or data-parallel size.

megatron-core keeps global parallel state and needs a process group, so every Megatron engine runs in
spawned processes; the FSDP2 reference runs in the test process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from areal_async.config import MegatronConfig
from areal_async.training.batching import TrainSequence
from areal_async.training.checkpoint import load_checkpoint, save_checkpoint
from areal_async.training.fsdp.engine import FSDPTrainEngine
from tests.helpers.engines import fsdp_engine, megatron_engine
from tests.helpers.fsdp_helpers import as_torchrun_rank, random_batch
from tests.helpers.numerics import LINEAR_ADAM, assert_same_updates
from tests.integration.test_fsdp import free_port, pg_loss, ratio_loss

pytest.importorskip("megatron.core")

VOCAB = 64
STEPS = 2
OPTIONS: dict[str, Any] = {"dtype": "float32", "total_steps": 10, "micro_batch_tokens": 24, **LINEAR_ADAM}
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def write_model(path: Path, family: str) -> Path:
    """Tied Llama with llama3 rope scaling; untied Qwen2 (q/k/v biases); tied Qwen3 (q/k norms)."""
    torch.manual_seed(0)
    if family == "llama":
        config = LlamaConfig(**SHAPE, tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE, rope_theta=5e5)
        model: Any = LlamaForCausalLM(config)
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=False))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=True))
    model.save_pretrained(path)
    return path


FAMILIES = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {f: write_model(tmp_path_factory.mktemp(f), f) for f in FAMILIES}


def make_batch() -> list[TrainSequence]:
    return random_batch([(4, 16), (2, 3), (6, 12), (3, 2), (8, 8), (1, 4)], vocab=VOCAB, behave_base=-4.0)


def run_engine(engine: Any, seqs: list[TrainSequence]) -> dict[str, Any]:
    """Logprobs, STEPS train steps and the weights after them."""
    out: dict[str, Any] = {"logprobs": engine.compute_logprobs(seqs)}
    out["metrics"] = [engine.train_step(seqs, pg_loss) for _ in range(STEPS)]
    out["weights"] = engine.snapshot_hf()
    return out


def _rank_main(rank: int, world: int, port: int, out: Path, jobs: list[dict[str, Any]]) -> None:
    from megatron.core import parallel_state

    as_torchrun_rank(rank, world, port)
    try:
        layout = None
        for job in jobs:
            # Jobs of one spawn share its processes (one start-up); another layout needs megatron-core's
            # parallel state set up anew.
            if layout is not None and layout != (job["tp"], job.get("pp", 1), job.get("cp", 1)):
                parallel_state.destroy_model_parallel()
            layout = (job["tp"], job.get("pp", 1), job.get("cp", 1))
            megatron = MegatronConfig(
                tensor_parallel=job["tp"],
                pipeline_parallel=job.get("pp", 1),
                virtual_pipeline=job.get("vpp", 1),
                sequence_parallel=job.get("sp", False),
            )
            # Activation checkpointing (which re-runs collectives in backward) and 5-row logprob
            # chunks must not change the numbers.
            split = job["tp"] > 1 or job.get("cp", 1) > 1
            extra = {"gradient_checkpointing": True, "logprob_chunk_tokens": 5} if split else {}
            engine = megatron_engine(
                job["model"],
                num_ranks=world,
                megatron=megatron,
                context_parallel=job.get("cp", 1),
                **OPTIONS,
                **extra,
            )
            seqs = make_batch()
            if engine.dp_size > 1:
                seqs = seqs[engine.dp_rank :: engine.dp_size]
            result: dict[str, Any] = {
                "dp_rank": engine.dp_rank,
                "stage": engine.stages.rank,
                "chunks": engine.stages.chunks,
                "cp_rank": engine.cp_rank,
            }
            if "resume_from" in job:  # a checkpoint of another tensor-parallel size, then one step
                load_checkpoint(job["resume_from"], engine=engine)
                result["resumed"] = engine.train_step(seqs, pg_loss)
                result["version"] = engine.version
                result["weights_after"] = engine.snapshot_hf()  # the update used the restored moments
            else:
                result |= run_engine(engine, seqs)
                if "checkpoint" in job:
                    save_checkpoint(job["checkpoint"], STEPS, engine=engine, extra={})
                    result["next"] = engine.train_step(seqs, pg_loss)
                    result["weights_after"] = engine.snapshot_hf()
                else:  # pi_prox from the update's own forward, on every layout
                    result["prox_step"] = engine.train_step(seqs, ratio_loss, compute_prox=True)
            torch.save(result, out / f"{job['name']}-rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(world: int, out: Path, jobs: list[dict[str, Any]]) -> None:
    mp.spawn(_rank_main, args=(world, free_port(), out, jobs), nprocs=world, join=True)


def reference(model: Path) -> tuple[FSDPTrainEngine, dict[str, Any]]:
    """One FSDP2 process: `run_engine`, then a two-pass step (pi_prox from a separate pass)."""
    torch.set_num_threads(1)
    engine = fsdp_engine(model, **OPTIONS)
    before = engine.snapshot_hf()
    out = run_engine(engine, make_batch()) | {"before": before}
    out["prox_step"] = engine.train_step(make_batch(), ratio_loss, compute_prox=True, prox_pass=True)
    return engine, out


def assert_same_run(got: dict[str, Any], want: dict[str, Any], seqs_of_rank: slice = slice(None)) -> None:
    for g, w in zip(got["logprobs"], want["logprobs"][seqs_of_rank], strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)
    for step in range(STEPS):
        for key in ("loss", "grad_norm", "entropy", "loss_tokens", "total_tokens", "token_share"):
            assert got["metrics"][step][key] == pytest.approx(
                want["metrics"][step][key], rel=1e-5, abs=1e-6
            ), (
                step,
                key,
            )
    if got["weights"] is not None:
        assert_same_updates(got["weights"], want["weights"], want["before"], steps=STEPS)
    if "prox_step" in got:  # pi_prox from the update == the reference's separate pass
        for key in ("loss", "grad_norm", "prox_sum", "ratio_max"):
            assert got["prox_step"][key] == pytest.approx(want["prox_step"][key], rel=1e-5, abs=1e-6), key


def test_megatron_matches_fsdp2_on_each_family_and_tensor_parallel_resumes_at_tp1(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """One process per family: logprobs, two steps' loss/grad norm and the updated HF weights equal FSDP2's
    (float32). Two tensor-parallel ranks on Qwen2 and on Qwen3 (whose q/k norms see different heads on
    each rank) give the same run; the Qwen2 checkpoint resumes in one process (tensor_parallel 1) and the
    next step's loss is the one the TP=2 run computed."""
    ckpt = tmp_path / "tp2-run"
    spawn(
        2,
        tmp_path,
        [
            {"name": "tp2", "model": models["qwen2"], "tp": 2, "checkpoint": ckpt},
            {"name": "tp2-qwen3", "model": models["qwen3"], "tp": 2},
        ],
    )
    jobs = [{"name": f, "model": models[f], "tp": 1} for f in FAMILIES]
    jobs.append({"name": "resume", "model": models["qwen2"], "tp": 1, "resume_from": ckpt})
    spawn(1, tmp_path, jobs)

    for family in FAMILIES:
        _, want = reference(models[family])
        got = torch.load(tmp_path / f"{family}-rank0.pt", weights_only=False)
        assert_same_run(got, want)
        if family == "qwen2":
            assert "lm_head.weight" in got["weights"]
        else:
            assert "lm_head.weight" not in got["weights"]  # tied to the embedding

    _, want = reference(models["qwen2"])
    tp = [torch.load(tmp_path / f"tp2-rank{r}.pt", weights_only=False) for r in range(2)]
    assert tp[1]["weights"] is None  # rank 0 gathers the slices
    for r in tp:
        assert_same_run({**r, "weights": r["weights"] if r is tp[0] else None}, want)
    _, want = reference(models["qwen3"])  # q/k norms: one weight for the heads of both ranks
    qwen3 = [torch.load(tmp_path / f"tp2-qwen3-rank{r}.pt", weights_only=False) for r in range(2)]
    for r in qwen3:
        assert_same_run({**r, "weights": r["weights"] if r is qwen3[0] else None}, want)
    resumed = torch.load(tmp_path / "resume-rank0.pt", weights_only=False)
    assert resumed["version"] == STEPS + 1
    for key in ("loss", "grad_norm"):
        assert resumed["resumed"][key] == pytest.approx(tp[0]["next"][key], rel=1e-5, abs=1e-7), key
    # The same update: moments and schedule restored.
    assert_same_updates(resumed["weights_after"], tp[0]["weights_after"], tp[0]["weights"], steps=1)


def test_two_data_parallel_ranks_match_one_fsdp2_process(models: dict[str, Path], tmp_path: Path) -> None:
    """tensor_parallel 1 on 2 ranks: each trains on half the batch, gradients are summed across them,
    and losses, grad norms, logprobs and weights equal one FSDP2 process on the whole batch. Their
    sharded checkpoint resumes at tensor_parallel 2, and the next step is the one they computed."""
    ckpt = tmp_path / "dp2-run"
    spawn(
        2,
        tmp_path,
        [
            {"name": "dp2", "model": models["llama"], "tp": 1, "checkpoint": ckpt},
            {"name": "dp2-tp2", "model": models["llama"], "tp": 2, "resume_from": ckpt},
        ],
    )
    _, want = reference(models["llama"])
    for rank in range(2):
        got = torch.load(tmp_path / f"dp2-rank{rank}.pt", weights_only=False)
        assert got["dp_rank"] == rank
        assert_same_run(got, want, slice(rank, None, 2))
    step = ckpt / "checkpoints" / f"step_{STEPS}"
    assert (step / "engine" / ".metadata").is_file()  # written by every rank, not gathered
    replicated = torch.load(step / "engine.pt", weights_only=True)
    assert "model" not in replicated and replicated["format"] == "sharded"
    dp2 = torch.load(tmp_path / "dp2-rank0.pt", weights_only=False)
    for rank in range(2):
        resumed = torch.load(tmp_path / f"dp2-tp2-rank{rank}.pt", weights_only=False)
        assert resumed["version"] == STEPS + 1
        for key in ("loss", "grad_norm"):
            assert resumed["resumed"][key] == pytest.approx(dp2["next"][key], rel=1e-5, abs=1e-7), key
    after = torch.load(tmp_path / "dp2-tp2-rank0.pt", weights_only=False)["weights_after"]
    assert_same_updates(after, dp2["weights_after"], dp2["weights"], steps=1)  # moments and schedule restored


def test_checkpoints_refuse_the_other_backend(models: dict[str, Path], tmp_path: Path) -> None:
    engine, _ = reference(models["llama"])
    with pytest.raises(ValueError, match="trainer.backend=megatron, this run uses fsdp2"):
        engine.load_state_dict({"backend": "megatron"})


def test_bf16_on_cpu_is_refused_before_anything_starts(models: dict[str, Path]) -> None:
    with pytest.raises(
        ValueError, match="trainer.dtype=bfloat16 with trainer.backend=megatron needs trainer.device=cuda"
    ):
        megatron_engine(models["llama"], dtype="bfloat16")
    assert not dist.is_initialized()  # refused before megatron-core's process group


def test_pipeline_stages_match_fsdp2_and_resume_in_one_stage(models: dict[str, Path], tmp_path: Path) -> None:
    """pipeline_parallel 2 on the tied Llama (one layer per stage), 3 on a three-layer untied Qwen2
    (a middle stage), and 2 stages of two interleaved chunks each on a four-layer tied Llama (layers
    0 and 2 on the first stage, 1 and 3 on the second; megatron's interleaved schedule): the last
    stage's logprobs, every stage's losses and grad norms, and the weights rank 0 gathers from all
    stages equal FSDP2's (the tied embedding's two copies stay one); the two Llama checkpoints
    resume in one process and the next step's loss is the one the pipeline computed."""
    qwen2, llama4 = tmp_path / "qwen2-3", tmp_path / "llama-4"
    torch.manual_seed(0)
    Qwen2ForCausalLM(
        Qwen2Config(**{**SHAPE, "num_hidden_layers": 3}, tie_word_embeddings=False)
    ).save_pretrained(qwen2)
    LlamaForCausalLM(
        LlamaConfig(**{**SHAPE, "num_hidden_layers": 4}, tie_word_embeddings=True)
    ).save_pretrained(llama4)
    ckpt, vckpt = tmp_path / "pp2-run", tmp_path / "vpp-run"
    spawn(
        2,
        tmp_path,
        [
            {"name": "pp-llama", "model": models["llama"], "tp": 1, "pp": 2, "checkpoint": ckpt},
            {"name": "pp-llama4", "model": llama4, "tp": 1, "pp": 2, "vpp": 2, "checkpoint": vckpt},
        ],
    )
    spawn(3, tmp_path, [{"name": "pp-qwen2", "model": qwen2, "tp": 1, "pp": 3}])
    spawn(
        1,
        tmp_path,
        [
            {"name": "pp-resume", "model": models["llama"], "tp": 1, "resume_from": ckpt},
            {"name": "vpp-resume", "model": llama4, "tp": 1, "resume_from": vckpt},
        ],
    )
    for name, model, size in (("llama", models["llama"], 2), ("qwen2", qwen2, 3), ("llama4", llama4, 2)):
        _, want = reference(model)
        ranks = [torch.load(tmp_path / f"pp-{name}-rank{r}.pt", weights_only=False) for r in range(size)]
        assert [r["stage"] for r in ranks] == list(range(size))
        assert {r["chunks"] for r in ranks} == {2 if name == "llama4" else 1}  # llama4: interleaved
        first, last = ranks[0], ranks[-1]
        assert all(r["weights"] is None for r in ranks[1:])  # rank 0 gathers the stages
        assert_same_run(last | {"weights": first["weights"]}, want)
        for r in ranks[:-1]:
            assert_same_run(r | {"logprobs": last["logprobs"], "weights": None}, want)
            assert all(not lp.any() for lp in r["logprobs"])  # only the last stage computes logprobs
    for resumed_name, run in (("pp-resume", "pp-llama"), ("vpp-resume", "pp-llama4")):
        resumed = torch.load(tmp_path / f"{resumed_name}-rank0.pt", weights_only=False)
        pipeline = torch.load(tmp_path / f"{run}-rank0.pt", weights_only=False)
        for key in ("loss", "grad_norm"):
            assert resumed["resumed"][key] == pytest.approx(pipeline["next"][key], rel=1e-5, abs=1e-7), key


def test_context_parallel_matches_fsdp2_and_resumes_without_it(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """context_parallel 2: each rank holds half of every packed row (sequences cut between the ranks,
    whose queries attend to the other rank's keys) and both report the logprobs, losses and grad norms
    of one FSDP2 process, with activation checkpointing re-running the gathers in backward; rank 0's
    weights after two steps are FSDP2's. With two pipeline stages as well (4 ranks, the tied Llama)
    and with two tensor-parallel ranks (4 ranks, Qwen3) the same holds. The Qwen2 checkpoint resumes in one process and the next step is the one the
    context-parallel pair computed."""
    ckpt = tmp_path / "cp2-run"
    spawn(2, tmp_path, [{"name": "cp2", "model": models["qwen2"], "tp": 1, "cp": 2, "checkpoint": ckpt}])
    spawn(
        4,
        tmp_path,
        [
            {"name": "cp2-pp2", "model": models["llama"], "tp": 1, "pp": 2, "cp": 2},
            {"name": "cp2-tp2", "model": models["qwen3"], "tp": 2, "cp": 2},
        ],
    )
    spawn(1, tmp_path, [{"name": "cp-resume", "model": models["qwen2"], "tp": 1, "resume_from": ckpt}])

    _, want = reference(models["qwen2"])
    pair = [torch.load(tmp_path / f"cp2-rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["cp_rank"] for r in pair] == [0, 1] and [r["dp_rank"] for r in pair] == [0, 0]
    assert pair[1]["weights"] is None
    for r in pair:
        assert_same_run(r, want)
    resumed = torch.load(tmp_path / "cp-resume-rank0.pt", weights_only=False)
    for key in ("loss", "grad_norm"):
        assert resumed["resumed"][key] == pytest.approx(pair[0]["next"][key], rel=1e-5, abs=1e-7), key
    assert_same_updates(resumed["weights_after"], pair[0]["weights_after"], pair[0]["weights"], steps=1)

    _, want = reference(models["llama"])
    ranks = [torch.load(tmp_path / f"cp2-pp2-rank{r}.pt", weights_only=False) for r in range(4)]
    assert [(r["stage"], r["cp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in ranks[2:]:  # the last stage's pair
        assert_same_run(r | {"weights": ranks[0]["weights"] if r is ranks[2] else None}, want)

    _, want = reference(models["qwen3"])
    ranks = [torch.load(tmp_path / f"cp2-tp2-rank{r}.pt", weights_only=False) for r in range(4)]
    assert sorted(r["cp_rank"] for r in ranks) == [0, 0, 1, 1]
    for r in ranks:
        assert_same_run(r | {"weights": r["weights"] if r is ranks[0] else None}, want)


def test_sequence_parallel_matches_fsdp2_alone_and_with_context_or_pipeline_parallel(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """tensor_parallel 2 with sequence_parallel: each rank holds half of every packed row between the
    tensor-parallel layers (rows of odd length padded), and both report FSDP2's logprobs, losses and
    grad norms, with activation checkpointing re-running the gathers in backward; rank 0's weights
    after two steps are FSDP2's, so the norms (input, pre-MLP, final, and Qwen3's q/k norms), which
    see only the rank's tokens, got the gradients of all of them; Qwen2's q/k/v biases and untied
    head train as FSDP2's too. The same holds on the tied Llama
    with two context-parallel ranks as well (rows padded to 8-token multiples, each context part
    split over the tensor-parallel pair) and with two pipeline stages (which pass half rows)."""
    spawn(
        2,
        tmp_path,
        [{"name": f"sp-{f}", "model": models[f], "tp": 2, "sp": True} for f in ("qwen3", "qwen2")],
    )
    spawn(
        4,
        tmp_path,
        [
            {"name": "sp-cp2", "model": models["llama"], "tp": 2, "cp": 2, "sp": True},
            {"name": "sp-pp2", "model": models["llama"], "tp": 2, "pp": 2, "sp": True},
        ],
    )

    for family in ("qwen3", "qwen2"):
        _, want = reference(models[family])
        ranks = [torch.load(tmp_path / f"sp-{family}-rank{r}.pt", weights_only=False) for r in range(2)]
        for r in ranks:
            assert_same_run(r | {"weights": r["weights"] if r is ranks[0] else None}, want)

    _, want = reference(models["llama"])
    ranks = [torch.load(tmp_path / f"sp-cp2-rank{r}.pt", weights_only=False) for r in range(4)]
    assert sorted(r["cp_rank"] for r in ranks) == [0, 0, 1, 1]
    for r in ranks:
        assert_same_run(r | {"weights": r["weights"] if r is ranks[0] else None}, want)
    ranks = [torch.load(tmp_path / f"sp-pp2-rank{r}.pt", weights_only=False) for r in range(4)]
    assert sorted(r["stage"] for r in ranks) == [0, 0, 1, 1]
    last = [r for r in ranks if r["stage"] == 1]
    for r in last:
        assert_same_run(r | {"weights": ranks[0]["weights"] if r is last[0] else None}, want)
