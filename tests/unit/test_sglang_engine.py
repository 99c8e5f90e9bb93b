"""SGLangEngine against tests/helpers/fake_sglang.py: log-probs, stops, interruption, dead and revived
servers, LoRA adapter versions.

The fake runs a tiny random-init model in-process behind SGLang's HTTP shapes (no real SGLang: it has
no CPU build). Log-probs are checked against a teacher-forced forward of the same weights (for a LoRA
version: peft's model of its adapter); versions against the fake's own record of which weights
produced each token.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_async import lora
from areal_async.engines.base import EngineClosedError, GenerationRequest, GenerationResult, SamplingParams
from areal_async.engines.sglang import SGLangEngine
from tests.helpers.adapters import peft_reference, write_random_adapter
from tests.helpers.fake_sglang import FakeSGLangServer
from tests.helpers.models import build_tiny_model

torch.set_num_threads(1)

TOL = 1e-4
LORA = lora.LoraConfig(rank=4, alpha=8.0)
FAST = dict(health_interval_s=0.05, startup_timeout_s=5.0, server_wait_s=20.0)


@pytest.fixture(scope="module")
def tiny_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("sgl_a"), seed=0, max_positions=512)


@pytest.fixture(scope="module")
def tiny_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("sgl_b"), seed=1, max_positions=512)


@pytest.fixture(scope="module")
def models(tiny_a: Path, tiny_b: Path) -> dict[int, torch.nn.Module]:
    """Teacher-forcing oracles: policy version -> weights."""
    return {
        v: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
        for v, p in ((0, tiny_a), (1, tiny_b))
    }


@pytest.fixture(scope="module")
def adapters(tiny_a: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Two LoRA adapter versions of tiny_a (all seven linear modules, rank 4)."""
    root = tmp_path_factory.mktemp("sgl_lora")
    return {v: write_random_adapter(tiny_a, root / f"v{v}", LORA, seed=v, relative=0.5) for v in (1, 2)}


@pytest.fixture
def fake(tiny_a: Path) -> Iterator[FakeSGLangServer]:
    with FakeSGLangServer(tiny_a) as server:
        yield server


def make_requests(count: int, *, prompt_len: int = 5, **sampling: object) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            request_id=f"r{i}",
            prompt_ids=[4 + (7 * i + j) % 90 for j in range(prompt_len + i % 3)],
            sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
        )
        for i in range(count)
    ]


def expected_logprobs(
    model: torch.nn.Module, result: GenerationResult, sampling: SamplingParams
) -> torch.Tensor:
    """Log-prob of each completion token under the distribution it was sampled from (one full forward)."""
    ids = torch.tensor([list(result.prompt_ids) + result.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(result.prompt_ids) - 1 : -1].float()
    if sampling.temperature == 0:
        scores = logits
    else:
        scores = logits / sampling.temperature
        if sampling.top_k:
            kth = scores.topk(sampling.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
    return scores.log_softmax(-1).gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]


def logprob_gaps(
    models: dict[int, torch.nn.Module], result: GenerationResult, sampling: SamplingParams
) -> torch.Tensor:
    """|reported - teacher-forced| per token, under the weights `models` gives its stamped version."""
    gaps = torch.zeros(len(result.token_ids))
    for version in set(result.versions):
        index = torch.tensor([i for i, v in enumerate(result.versions) if v == version])
        want = expected_logprobs(models[version], result, sampling)
        gaps[index] = (torch.tensor(result.logprobs)[index] - want[index]).abs()
    return gaps


def assert_logprobs_match(
    models: dict[int, torch.nn.Module], result: GenerationResult, sampling: SamplingParams
) -> None:
    """Every token's log-prob equals the teacher-forced one under the weights of its stamped version."""
    gaps = logprob_gaps(models, result, sampling)
    assert float(gaps.max()) < TOL, f"{result.request_id}: max log-prob gap {float(gaps.max()):.2e}"


def served_versions(fakes: list[FakeSGLangServer], result: GenerationResult) -> list[int]:
    """Ground truth from the fakes: the weights that produced each completion token of `result`."""
    prompt = list(result.prompt_ids)
    versions: list[int] = []
    while len(versions) < len(result.token_ids):
        done = len(versions)
        context = prompt + result.token_ids[:done]
        best: list[int] = []
        for fake in fakes:  # several attempts may share a context; take the one that produced the tokens
            for rid, ids in fake.attempts.items():
                if ids != context:
                    continue
                found: list[int] = []
                for token, weights in [(t, w) for r, t, w in fake.token_log if r == rid]:
                    if (
                        done + len(found) == len(result.token_ids)
                        or token != result.token_ids[done + len(found)]
                    ):
                        break
                    found.append(0 if weights == "default" else int(weights))
                best = max(best, found, key=len)
        assert best, f"no attempt produced token {done} of {result.request_id}"
        versions += best
    return versions


async def wait_for_tokens(fakes: list[FakeSGLangServer], count: int) -> None:
    with anyio.fail_after(30):
        while sum(len(f.token_log) for f in fakes) < count:  # noqa: ASYNC110 (the fake has no event)
            await anyio.sleep(0.005)


async def load_mid_generation(
    engine: Any, fakes: list[FakeSGLangServer], requests: Any, version: int, path: Any, *, tokens: int
) -> tuple[list[GenerationResult], float]:
    """Generate ``requests`` and load ``path`` as ``version`` once the fakes have decoded ``tokens``
    tokens; returns the results and the load's seconds."""
    box: list[list[GenerationResult]] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            box.append(await engine.generate(requests))

        tg.start_soon(run)
        await wait_for_tokens(fakes, tokens)
        seconds = await engine.load_weights(version, str(path))
    return box[0], seconds


@pytest.mark.asyncio
@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=0.0)],
    ids=["t1", "t0.7-k5", "greedy"],
)
async def test_logprobs_match_a_teacher_forced_forward(
    tiny_a: Path, models: dict[int, torch.nn.Module], incremental: bool, sampling: dict[str, float]
) -> None:
    """Reported log-probs are those of the sampling distribution, with either streaming mode."""
    requests = make_requests(5, max_new_tokens=20, seed=7, **sampling)
    with FakeSGLangServer(tiny_a, incremental=incremental) as fake:
        async with SGLangEngine([fake.url], **FAST) as engine:
            results = await engine.generate(requests)
    for request, result in zip(requests, results, strict=True):
        assert result.request_id == request.request_id
        assert len(result.token_ids) == 20 and result.finish_reason == "length"
        assert result.versions == [0] * 20
        assert_logprobs_match(models, result, request.sampling)
        if request.sampling.top_k:
            logits = models[0](input_ids=torch.tensor([list(result.prompt_ids) + result.token_ids])).logits
            logits = logits[0, len(result.prompt_ids) - 1 : -1]
            ranks = (logits > logits.gather(1, torch.tensor(result.token_ids)[:, None])).sum(1)
            assert (ranks < request.sampling.top_k).all(), "a token outside the top-k was sampled"


@pytest.mark.asyncio
async def test_a_stop_token_ends_the_completion_and_is_included(fake: FakeSGLangServer) -> None:
    """The first stop token ends the completion, is part of it, and gives finish_reason stop."""
    [probe] = make_requests(1, max_new_tokens=30, temperature=0.0)
    async with SGLangEngine([fake.url], **FAST) as engine:
        [free] = await engine.generate([probe])
        stop = free.token_ids[10]
        request = GenerationRequest(
            request_id="s",
            prompt_ids=probe.prompt_ids,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=(stop,)),
        )
        [result] = await engine.generate([request])
    first = free.token_ids.index(stop)
    assert result.token_ids == free.token_ids[: first + 1]
    assert result.finish_reason == "stop"


@pytest.mark.asyncio
async def test_weight_load_mid_generation_stamps_every_token_with_its_weights(
    tiny_a: Path, tiny_b: Path, models: dict[int, torch.nn.Module]
) -> None:
    """Pause -> update -> continue: no request lost, versions exact per token, outputs change."""
    sampling = dict(max_new_tokens=60, temperature=1.0)
    requests = make_requests(6, **sampling)
    probe = make_requests(1, prompt_len=9, max_new_tokens=12, seed=3)
    with FakeSGLangServer(tiny_a, step_delay_s=0.002) as fake:
        async with SGLangEngine([fake.url], **FAST) as engine:
            [before] = await engine.generate(probe)
            results, seconds = await load_mid_generation(engine, [fake], requests, 1, tiny_b, tokens=12 + 60)
            assert engine.version == 1 and seconds > 0
            [after] = await engine.generate(probe)
            health = await engine.health()
        assert fake.weight_version == "1" and fake.updates == 2  # start-up sync to version 0, then the load
    assert [r.request_id for r in results] == [r.request_id for r in requests]
    switched = 0
    for result in results:
        assert len(result.token_ids) == 60 and result.finish_reason == "length"
        assert result.versions == sorted(result.versions) and set(result.versions) <= {0, 1}
        assert result.versions == served_versions([fake], result)
        assert_logprobs_match(models, result, SamplingParams(**sampling))  # type: ignore[arg-type]
        switched += len(set(result.versions)) == 2
        assert result.stats["attempts"] == 1 + result.stats["interruptions"]
    assert switched >= 1, "some request was decoding when the weights changed"
    assert before.versions == [0] * 12 and after.versions == [1] * 12
    assert before.logprobs != after.logprobs, "the same seeded request must come out different"
    assert health["interruptions"] >= switched and health["weight_loads"] == 1


@pytest.mark.asyncio
async def test_requests_on_a_dead_server_continue_on_another(
    tiny_a: Path, models: dict[int, torch.nn.Module]
) -> None:
    """Killing one of two servers mid-stream loses no request and no token; it is marked dead."""
    sampling = SamplingParams(max_new_tokens=50, temperature=1.0)
    requests = [
        GenerationRequest(request_id=r.request_id, prompt_ids=r.prompt_ids, sampling=sampling)
        for r in make_requests(8)
    ]
    with FakeSGLangServer(tiny_a, step_delay_s=0.002) as alive:
        doomed = FakeSGLangServer(tiny_a, step_delay_s=0.002).start()
        try:
            async with SGLangEngine([doomed.url, alive.url], **FAST) as engine:
                box: list[list[GenerationResult]] = []
                async with anyio.create_task_group() as tg:

                    async def run() -> None:
                        box.append(await engine.generate(requests))

                    tg.start_soon(run)
                    await wait_for_tokens([doomed], 40)
                    doomed.kill()
                health = await engine.health()
        finally:
            doomed.kill()
    results = box[0]
    moved = [r for r in results if r.stats["attempts"] > 1]
    assert moved, "requests that were on the killed server were resubmitted"
    for result in results:
        assert len(result.token_ids) == 50 and result.finish_reason == "length"
        assert result.versions == [0] * 50
        assert_logprobs_match(models, result, sampling)
    dead, live = health["servers"]
    assert not dead["alive"] and dead["failures"] >= 1 and dead["last_error"]
    assert live["alive"] and health["status"] == "degraded"


@pytest.mark.asyncio
async def test_a_revived_server_gets_the_current_weights_before_serving(tiny_a: Path, tiny_b: Path) -> None:
    """A server that comes back after a weight load is reloaded to the current version, then used."""
    first = FakeSGLangServer(tiny_a).start()
    port = first.port
    with FakeSGLangServer(tiny_a) as other:
        try:
            async with SGLangEngine([first.url, other.url], **FAST) as engine:
                first.kill()
                await engine.generate(make_requests(2, max_new_tokens=4))  # notices the death
                await engine.load_weights(1, str(tiny_b))
                assert other.weight_version == "1"
                with FakeSGLangServer(tiny_a, port=port) as revived:
                    await anyio.sleep(0.1)
                    results = await engine.generate(make_requests(8, max_new_tokens=4))
                    assert revived.weight_version == "1" and revived.updates == 1
                    assert revived.attempts, "the revived server serves requests again"
                    health = await engine.health()
        finally:
            first.kill()
    assert all(r.versions == [1] * 4 for r in results)
    assert health["status"] == "running"
    assert [s["version"] for s in health["servers"]] == [1, 1]


@pytest.mark.asyncio
async def test_invalid_requests_fail_with_the_request_and_the_fix(fake: FakeSGLangServer) -> None:
    """top_p < 1 is refused before sending; a 400 from the server names the request and its message."""
    async with SGLangEngine([fake.url], **FAST) as engine:
        with pytest.raises(ValueError, match="top_p=0.9 is not supported"):
            await engine.generate(make_requests(1, temperature=1.0, top_p=0.9))
        bad = GenerationRequest(request_id="oov", prompt_ids=[1, 10_000], sampling=SamplingParams())
        with pytest.raises(ValueError, match="request oov: .*HTTP 400.*outside the vocabulary"):
            await engine.generate([bad])
        with pytest.raises(ValueError, match="safetensors directory"):
            await engine.load_weights(1, {"w": torch.zeros(1)})
        with pytest.raises(RuntimeError, match="no server loaded weights v1"):
            await engine.load_weights(1, "/nonexistent/weights")
        assert engine.version == 0


@pytest.mark.asyncio
async def test_start_fails_when_no_server_answers() -> None:
    """No live server within startup_timeout_s: RuntimeError naming the URL and the fix."""
    engine = SGLangEngine(["http://127.0.0.1:9"], startup_timeout_s=0.2, health_interval_s=0.05)
    with pytest.raises(RuntimeError, match=r"127\.0\.0\.1:9.*start the servers"):
        await engine.start()
    with pytest.raises(EngineClosedError):
        await engine.generate(make_requests(1))


@pytest.mark.asyncio
async def test_closing_the_engine_fails_pending_requests(tiny_a: Path) -> None:
    """aclose() while a generate() call waits: the call raises EngineClosedError promptly."""
    with FakeSGLangServer(tiny_a, step_delay_s=0.01) as fake:
        engine = SGLangEngine([fake.url], **FAST)
        await engine.start()
        errors: list[BaseException] = []
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                try:
                    await engine.generate(make_requests(2, max_new_tokens=500))
                except EngineClosedError as exc:
                    errors.append(exc)

            tg.start_soon(run)
            await wait_for_tokens([fake], 5)
            with anyio.fail_after(10):
                await engine.aclose()
    assert len(errors) == 1


@pytest.mark.asyncio
async def test_lora_versions_are_served_by_name_and_continuations_use_the_new_adapter(
    tiny_a: Path, tiny_b: Path, models: dict[int, torch.nn.Module], adapters: dict[int, Path]
) -> None:
    """An adapter version is a runtime adapter: every token matches peft's model of the adapter it is
    stamped with (not the base model, not the other adapter), requests cut by the next version continue
    on it, the previous adapter is unloaded, and a full directory brings plain weights back."""
    references = {
        1: peft_reference(tiny_a, adapters[1]),
        2: peft_reference(tiny_a, adapters[2]),
        3: models[1],
    }
    sampling = SamplingParams(max_new_tokens=60, temperature=1.0)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    requests = [
        GenerationRequest(request_id=r.request_id, prompt_ids=r.prompt_ids, sampling=sampling)
        for r in make_requests(6)
    ]
    probe = [GenerationRequest(request_id="probe", prompt_ids=[50, 40, 30, 20, 10], sampling=greedy)]
    with FakeSGLangServer(tiny_a, step_delay_s=0.002, enable_lora=True) as fake:
        async with SGLangEngine([fake.url], **FAST) as engine:
            await engine.load_weights(1, str(adapters[1]))
            [on_v1] = await engine.generate(probe)
            results, _ = await load_mid_generation(engine, [fake], requests, 2, adapters[2], tokens=12 + 60)
            [on_v2] = await engine.generate(probe)
            loaded = set(fake.loras.loaded)
            await engine.load_weights(3, str(tiny_b))
            [on_full] = await engine.generate(probe)
            loaded_after_full = set(fake.loras.loaded)
    switched = 0
    for result in results:
        assert len(result.token_ids) == 60 and result.finish_reason == "length"
        assert result.versions == sorted(result.versions) and set(result.versions) <= {1, 2}
        assert_logprobs_match(references, result, sampling)
        for wrong in ({1: models[0], 2: models[0]}, {1: references[2], 2: references[1]}):
            assert float(logprob_gaps(wrong, result, sampling).mean()) > 100 * TOL, "other weights fit"
        switched += len(set(result.versions)) == 2
    assert switched >= 1, "some request was decoding when v2 was loaded"
    # Prompts have at most 7 tokens, so a longer input is a continuation (all come after the v2 load).
    continued = [rid for rid, ids in fake.attempts.items() if len(ids) > 7]
    assert continued and {fake.adapters[rid] for rid in continued} == {"areal-v2"}
    for result, version in ((on_v1, 1), (on_v2, 2), (on_full, 3)):
        assert result.versions == [version] * 12
        assert_logprobs_match(references, result, greedy)
    assert loaded == {"areal-v2"}, "v1 was unloaded once v2 served"
    assert loaded_after_full == set()


@pytest.mark.asyncio
async def test_a_revived_server_gets_the_base_and_the_adapter_it_missed(
    tiny_a: Path, tiny_b: Path, adapters: dict[int, Path]
) -> None:
    """A server that restarts after an adapter version (on top of a full version) is brought back to
    that full version and then that adapter before it serves."""
    reference = {3: peft_reference(tiny_b, adapters[2])}
    first = FakeSGLangServer(tiny_a, enable_lora=True).start()
    port = first.port
    with FakeSGLangServer(tiny_a, enable_lora=True) as other:
        try:
            async with SGLangEngine([first.url, other.url], **FAST) as engine:
                await engine.load_weights(1, str(tiny_b))
                await engine.load_weights(2, str(adapters[1]))
                first.kill()
                await engine.generate(make_requests(2, max_new_tokens=4))  # notices the death
                await engine.load_weights(3, str(adapters[2]))
                assert set(other.loras.loaded) == {"areal-v3"}
                with FakeSGLangServer(tiny_a, port=port, enable_lora=True) as revived:
                    await anyio.sleep(0.1)
                    results = await engine.generate(make_requests(8, max_new_tokens=6, temperature=1.0))
                    assert revived.model_path == str(tiny_b) and set(revived.loras.loaded) == {"areal-v3"}
                    assert revived.attempts and set(revived.adapters.values()) == {"areal-v3"}
                    health = await engine.health()
        finally:
            first.kill()
    for result in results:
        assert result.versions == [3] * 6
        assert_logprobs_match(reference, result, SamplingParams(max_new_tokens=6, temperature=1.0))
    assert health["status"] == "running" and [s["version"] for s in health["servers"]] == [3, 3]


@pytest.mark.asyncio
async def test_lora_errors_name_the_fix(tiny_a: Path, adapters: dict[int, Path]) -> None:
    """A server without LoRA, or with a lower --max-lora-rank, refuses an adapter version with the flag
    to set, and the engine goes on serving the version it had. A request naming an adapter the server
    never loaded, or any adapter without LoRA, gets SGLang's error in its stream."""
    plain = FakeSGLangServer(tiny_a).start()
    small = FakeSGLangServer(tiny_a, enable_lora=True, max_lora_rank=2).start()
    try:
        for fake, flag in (
            (plain, "restart the SGLang server with --enable-lora"),
            (small, "--max-lora-rank"),
        ):
            async with SGLangEngine([fake.url], **FAST) as engine:
                with pytest.raises(RuntimeError, match=f"no server loaded weights v1 .*{flag}"):
                    await engine.load_weights(1, str(adapters[1]))
                [result] = await engine.generate(make_requests(1, max_new_tokens=4))
                assert engine.version == 0 and result.versions == [0] * 4
        body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 2}, "stream": True}
        async with httpx.AsyncClient() as client:
            for fake, message in (
                (plain, "LoRA adapter 'nope' was requested, but LoRA is not enabled"),
                (small, "Got LoRA adapter that has never been loaded: nope"),
            ):
                response = await client.post(f"{fake.url}/generate", json={**body, "lora_path": "nope"})
                assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
                assert message in response.text
    finally:
        plain.kill()
        small.kill()
