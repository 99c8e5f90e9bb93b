"""LocalEngine on CUDA: log-probs match a teacher-forced forward and weight swaps interrupt correctly.

Same checks as tests/unit/test_local_engine.py (whose helpers this module reuses), on the GPU, fp32,
for every KV layout including CUDA graphs of the `torch.compile`d decode step (`compile=True`).
TF32 is switched off so fp32 matmuls are exact enough for the 1e-4 tolerance.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from areal_async.engines.base import GenerationRequest, SamplingParams
from areal_async.engines.local import LocalEngine, decode_draws
from areal_async.models import load_causal_lm
from tests.helpers.models import build_tiny_model
from tests.unit.test_local_engine import (
    assert_logprobs_match,
    check_interruption,
    check_kept_kv,
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
    "slots+graphs+compile": {"kv_cache": "slots", "cuda_graphs": True, "compile": True},
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
async def test_cuda_weight_swap_with_kept_kv_continues_over_the_old_kv(
    tiny_a: Path, tiny_b: Path, engine_options: dict[str, Any]
) -> None:
    """kv_after_load="keep" on CUDA, every layout (CUDA graphs too): no re-prefill, new tokens are B
    reading over A's KV (`check_kept_kv`)."""
    results, model_a, model_b = await run_interruption(
        tiny_a, tiny_b, device="cuda", group=2, kv_after_load="keep", **engine_options
    )
    check_kept_kv(results, model_a, model_b)


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


@pytest.mark.asyncio
async def test_cuda_compiled_bfloat16_engine_matches_its_forward_within_bf16_noise(tiny_a: Path) -> None:
    """Compiled + graphs in bf16 (GQA, packed decode attention, fused draws): every log-prob is within
    bf16 noise of a teacher-forced forward of the same weights, and tokens are never out of range."""
    requests = make_requests(40, lengths=(32, 7, 19, 3), seed=None) + make_requests(
        8, prompt_len=9, max_new_tokens=24, temperature=0.0
    )
    options = LAYOUTS["slots+graphs+compile"]
    async with LocalEngine(tiny_a, device="cuda", dtype="bfloat16", max_batch_size=16, **options) as engine:
        results = await engine.generate(requests)
        model = engine.model
    for request, result in zip(requests, results, strict=True):
        assert len(result.token_ids) == request.sampling.max_new_tokens
        ids = torch.tensor([list(result.prompt_ids) + result.token_ids], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(result.prompt_ids) - 1 : -1].float()
        tokens = torch.tensor(result.token_ids, device="cuda")
        expected = logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
        got = torch.tensor(result.logprobs, device="cuda")
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, atol=0.1, rtol=0)
        if request.sampling.temperature == 0:
            ranks = (logits > logits.gather(1, tokens[:, None])).sum(1)
            assert (ranks == 0).float().mean() > 0.9, "greedy rows take the argmax (up to bf16 ties)"


@pytest.mark.asyncio
async def test_cuda_compiled_steps_compile_once_for_every_batch_and_prompt_length(tiny_a: Path) -> None:
    """The decode step and the prefill are each compiled once: batches that drain through every graph
    bucket, prompts of many lengths, group copies and a weight load never trigger a recompile."""
    torch._dynamo.reset()
    requests = make_requests(30, prompt_len=3, vary=11, lengths=(40, 5, 22, 1, 13), seed=None, group=2)
    options = LAYOUTS["slots+graphs+compile"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        async with LocalEngine(tiny_a, device="cuda", max_batch_size=12, **options) as engine:
            first = await engine.generate(requests)
            await engine.load_weights(1, {k: v.clone() for k, v in engine.model.state_dict().items()})
            second = await engine.generate(requests[:5])
        async with LocalEngine(tiny_a, device="cuda", max_batch_size=5, **options) as engine:
            third = await engine.generate(requests[5:12])
    assert [len(r.token_ids) for r in first] == [r.sampling.max_new_tokens for r in requests]
    assert len(second) == 5 and len(third) == 7
    model = load_causal_lm(tiny_a, device="cuda")
    for request, result in zip(requests, first, strict=True):
        assert_logprobs_match(model, request.sampling, result, range(request.sampling.max_new_tokens))


def test_cuda_decode_draws_over_a_full_vocabulary_report_their_logprobs_and_greedy_argmax() -> None:
    """The fused decode draws over a 152k vocabulary in bf16 report each token's log-prob under
    softmax(logits / T) and take the first argmax on greedy rows (found without an arg-reduction)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    for batch in (64, 200):
        logits = (3 * torch.randn(batch, 151_936, device="cuda", generator=generator)).bfloat16()
        inputs = torch.zeros(batch, 5, device="cuda")
        inputs[:, 2] = torch.tensor([0.7, 1.0, 1.3], device="cuda").repeat(batch)[:batch]
        inputs[:, 3] = torch.rand(batch, device="cuda", generator=generator)
        greedy = torch.arange(batch, device="cuda") % 5 == 0
        inputs[greedy, 2], inputs[:, 4] = 1.0, greedy.float()
        got = decode_draws(logits, inputs)
        tokens = got[0].long()
        logprobs = (logits.float() / inputs[:, 2:3]).log_softmax(-1)
        torch.testing.assert_close(
            got[1], logprobs.gather(1, tokens[:, None])[:, 0].double(), atol=1e-4, rtol=0
        )
        assert tokens[greedy].tolist() == logits[greedy].argmax(-1).tolist()
