"""LoRA versions on a CUDA local engine: each adapter is merged before the pause (no hooks), and the
engine's logprobs are the trainer's at that version."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from areal_async.engines.local.engine import LocalEngine
from tests.helpers.fsdp_helpers import write_tiny_llama
from tests.integration.test_fsdp import pg_loss
from tests.integration.test_lora import VOCAB, _served_logprobs, _trainer_logprobs, batch, make_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("lora-base"), vocab=VOCAB, tie=False)


@pytest.mark.asyncio
async def test_a_cuda_engine_serves_each_adapter_merged(untied: Path, tmp_path: Path) -> None:
    trainer = make_engine(untied)
    prompt = [5, 9, 14, 3, 22, 7]
    async with LocalEngine(untied, device="cuda", max_batch_size=2, dtype="float32") as engine:
        for version in (1, 2, 3):
            trainer.train_step(batch(version), pg_loss)
            trainer.version = version
            trainer.save_hf(tmp_path / f"v{version}")
            await engine.load_weights(version, tmp_path / f"v{version}")
            assert not (await engine.health())["lora_unmerged"]
            tokens, served = await _served_logprobs(engine, prompt)
            want = _trainer_logprobs(trainer, prompt, tokens)
            torch.testing.assert_close(served, want, atol=1e-3, rtol=0)
