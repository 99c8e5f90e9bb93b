"""LocalEngine on CUDA: log-probs match a teacher-forced forward and weight swaps interrupt correctly.

Same checks as tests/unit/test_local_engine.py (whose helpers this module reuses), on the GPU, fp32.
TF32 is switched off so fp32 matmuls are exact enough for the 1e-4 tolerance.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from areal_async.engines.base import GenerationRequest, SamplingParams
from areal_async.engines.local import LocalEngine
from areal_async.models import build_tiny_model
from tests.unit.test_local_engine import (
    assert_logprobs_match,
    check_interruption,
    make_requests,
    run_interruption,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


LAYOUTS = {
    "dynamic": {"kv_cache": "dynamic"},
    "slots": {"kv_cache": "slots"},
    "slots+graphs": {"kv_cache": "slots", "cuda_graphs": True},
}


@pytest.fixture(params=list(LAYOUTS))
def engine_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Every KV layout, including the CUDA-graph decode path."""
    return LAYOUTS[request.param]


@pytest.fixture(autouse=True)
def exact_fp32() -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def tiny_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("gpu_a"), hidden=128, layers=4, heads=4, kv_heads=2, seed=0
    )


@pytest.fixture(scope="module")
def tiny_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("gpu_b"), hidden=128, layers=4, heads=4, kv_heads=2, seed=1
    )


@pytest.mark.asyncio
async def test_cuda_logprobs_match_teacher_forced_forward(
    tiny_a: Path, engine_options: dict[str, Any]
) -> None:
    """On CUDA, temperature 1 and temperature 0.7 + top-k + top-p log-probs match the oracle."""
    plain = make_requests(24, lengths=(40, 13, 27, 6), seed=None)
    filtered = [
        GenerationRequest(
            request_id=f"f{i}",
            prompt_ids=r.prompt_ids,
            sampling=SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=40, seed=i),
        )
        for i, r in enumerate(make_requests(8, prompt_len=11))
    ]
    requests = plain + filtered
    async with LocalEngine(tiny_a, device="cuda", max_batch_size=16, **engine_options) as engine:
        results = await engine.generate(requests)
        model = engine.model
    assert next(model.parameters()).device.type == "cuda"
    for request, result in zip(requests, results, strict=True):
        length = request.sampling.max_new_tokens
        assert len(result.token_ids) == length
        assert_logprobs_match(model, request.sampling, result, range(length))


@pytest.mark.asyncio
@pytest.mark.parametrize("location", ["dir", "state_dict"])
async def test_cuda_weight_swap_mid_generation_switches_versions_and_loses_nothing(
    tiny_a: Path, tiny_b: Path, location: str, engine_options: dict[str, Any]
) -> None:
    """On CUDA, tokens before the swap carry version 0 (match A), after it version 1 (match B);
    with CUDA graphs the in-place weight copy keeps the captured graphs valid."""
    results, model_a, model_b = await run_interruption(
        tiny_a, tiny_b, device="cuda", location=location, **engine_options
    )
    check_interruption(results, model_a, model_b)


@pytest.mark.asyncio
async def test_cuda_bfloat16_engine_produces_finite_logprobs_close_to_its_forward(tiny_a: Path) -> None:
    """A bf16 engine still reports finite log-probs within bf16 noise of its own teacher-forced pass."""
    requests = make_requests(16, max_new_tokens=32)
    async with LocalEngine(tiny_a, device="cuda", dtype="bfloat16", max_batch_size=8) as engine:
        results = await engine.generate(requests)
        model = engine.model
    for result in results:
        ids = torch.tensor([list(result.prompt_ids) + result.token_ids], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(result.prompt_ids) - 1 : -1].float()
        expected = logits.log_softmax(-1).gather(1, torch.tensor(result.token_ids, device="cuda")[:, None])[
            :, 0
        ]
        got = torch.tensor(result.logprobs, device="cuda")
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, atol=0.1, rtol=0)
