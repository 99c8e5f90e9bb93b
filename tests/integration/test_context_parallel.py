"""Context parallelism on the FSDP2 backend (gloo, CPU): 4 ranks as 2 data-parallel pairs, each pair
splitting every packed row between its ranks, train exactly as one process on the whole batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areal_async.config import TrainerConfig
from areal_async.training.fsdp.engine import init_distributed
from tests.helpers.fsdp_helpers import as_torchrun_rank, write_tiny_llama
from tests.helpers.numerics import LINEAR_ADAM, assert_same_updates
from tests.integration.test_fsdp import STEPS, VOCAB, free_port, make_batch, make_engine, pg_loss, ratio_loss

WORLD, CONTEXT = 4, 2


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tied"), vocab=VOCAB, tie=True)


def _rank_main(rank: int, model_dir: Path, out_dir: Path, port: int) -> None:
    as_torchrun_rank(rank, WORLD, port)
    init_distributed("cpu")
    try:
        # Activation checkpointing (which re-runs the gathers in backward) and 5-row logprob chunks.
        engine = make_engine(
            model_dir,
            num_ranks=WORLD,
            context_parallel=CONTEXT,
            gradient_checkpointing=True,
            logprob_chunk_tokens=5,
            **LINEAR_ADAM,
        )
        shard = make_batch()[engine.dp_rank :: engine.dp_size]
        result: dict[str, Any] = {"dp_rank": engine.dp_rank, "prox": engine.compute_logprobs(shard)}
        result["metrics"] = [engine.train_step(shard, pg_loss) for _ in range(STEPS)]
        result["weights"] = engine.snapshot_hf()
        result["prox_step"] = engine.train_step(shard, ratio_loss, compute_prox=True)
        torch.save(result, out_dir / f"cp-rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_context_parallel_pairs_train_as_one_process(tied_model: Path, tmp_path: Path) -> None:
    """Ranks 0-1 and 2-3 are context-parallel pairs holding half of every packed row each (sequences
    cut between them, queries attending to the other rank's keys); the pairs are data-parallel. Every
    rank reports the logprobs of its pair's shard and the losses, grad norms and token counts of one
    process on the whole batch, and rank 0's weights after the steps are that process's. A further
    step with pi_prox from the update's own forward reports what that process's two-pass step
    (pi_prox from a separate pass) does."""
    mp.spawn(_rank_main, args=(tied_model, tmp_path, free_port()), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"cp-rank{r}.pt", weights_only=False) for r in range(WORLD)]
    assert [r["dp_rank"] for r in ranks] == [0, 0, 1, 1]

    torch.set_num_threads(1)
    single = make_engine(tied_model, **LINEAR_ADAM)
    before = single.snapshot_hf()
    batch = make_batch()
    prox = single.compute_logprobs(batch)
    wants = [single.train_step(batch, pg_loss) for _ in range(STEPS)]
    after = single.snapshot_hf()
    two_pass = single.train_step(batch, ratio_loss, compute_prox=True, prox_pass=True)
    for r in ranks:
        for got, want in zip(r["prox"], prox[r["dp_rank"] :: 2], strict=True):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        for got, want in zip(r["metrics"], wants, strict=True):
            for key in ("loss", "grad_norm", "entropy", "token_share", "loss_tokens", "total_tokens"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        for key in ("loss", "grad_norm", "prox_sum", "ratio_max"):
            assert r["prox_step"][key] == pytest.approx(two_pass[key], rel=1e-5, abs=1e-6), key
    assert ranks[1]["weights"] is None
    assert_same_updates(ranks[0]["weights"], after, before, steps=STEPS)


def test_context_parallel_must_divide_the_ranks_on_fsdp2() -> None:
    """On fsdp2 a context-parallel group is a run of consecutive ranks of one node; on megatron the
    same key sizes megatron-core's groups, which the engine checks against the whole world."""
    with pytest.raises(ValueError, match=r"trainer.context_parallel=2 does not divide trainer.num_ranks=3"):
        TrainerConfig(num_ranks=3, context_parallel=2)
    TrainerConfig(num_ranks=4, context_parallel=2)
    assert TrainerConfig(backend="megatron", num_ranks=2, context_parallel=2).context_parallel == 2
