"""LocalEngine: log-probs, interruption, continuous batching, seeds, stops, weight loading, validation.

Every check runs on tiny random-init models (2 layers, hidden 64, char vocab) on CPU. The helpers
without a `test_` prefix are shared with tests/gpu/test_local_engine_gpu.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from areal_async.engines.base import (
    EngineClosedError,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from areal_async.engines.local import (
    LocalEngine,
    cache_kwarg,
    sample_tokens,
    slot_decode_forward,
    slot_prefill_step,
)
from areal_async.engines.local.gqa_decode import PACKED_GQA_SDPA, packed_gqa_sdpa
from areal_async.engines.local.kv import _DecodeRows
from areal_async.engines.local.slots import _SlotKV
from areal_async.models import load_causal_lm
from tests.helpers.models import build_tiny_model

torch.set_num_threads(1)

TOL = 1e-4


@pytest.fixture(params=["dynamic", "slots"])
def kv_cache(request: pytest.FixtureRequest) -> str:
    """Both KV layouts must give the same guarantees."""
    return request.param


@pytest.fixture(scope="module")
def tiny_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_a"), seed=0, max_positions=256)


@pytest.fixture(scope="module")
def tiny_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_b"), seed=1, max_positions=256)


@pytest.fixture(scope="module")
def tiny_qwen_bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_qwen"), arch="qwen2", vocab="bpe", kv_heads=2, seed=2
    )


def make_requests(
    count: int,
    *,
    prompt_len: int = 5,
    vary: int = 3,
    lengths: Sequence[int] = (),
    group: int = 1,
    **sampling: Any,
) -> list[GenerationRequest]:
    """`count` requests; each run of `group` requests shares a prompt (as a GRPO group does), prompts
    of different groups differ, of length prompt_len + g % vary for group g; max_new_tokens cycles
    through `lengths` when given (mixed lengths make rows finish mid-batch and slots get reused)."""
    requests = []
    for i in range(count):
        if lengths:
            sampling["max_new_tokens"] = lengths[i % len(lengths)]
        g = i // group
        requests.append(
            GenerationRequest(
                request_id=f"r{i}",
                prompt_ids=[4 + (7 * g + j) % 90 for j in range(prompt_len + g % vary)],
                sampling=SamplingParams(**sampling),
            )
        )
    return requests


INTERRUPT_LENGTHS = (150, 90, 120, 60, 140, 100)


def teacher_forced_logits(model: torch.nn.Module, result: GenerationResult) -> torch.Tensor:
    """Raw logits [T, V] that predicted each completion token, from one unpadded forward."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(result.prompt_ids) + result.token_ids], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    prompt_len = len(result.prompt_ids)
    return logits[prompt_len - 1 : -1].cpu()


def processed_logprobs(logits_TV: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Oracle: transformers' own warpers (temperature, top-k, top-p), then log-softmax."""
    if sampling.temperature == 0:
        return logits_TV.log_softmax(-1)
    scores = TemperatureLogitsWarper(sampling.temperature)(None, logits_TV.clone())
    if sampling.top_k:
        scores = TopKLogitsWarper(sampling.top_k)(None, scores)
    if sampling.top_p < 1:
        scores = TopPLogitsWarper(sampling.top_p)(None, scores)
    return scores.log_softmax(-1)


def assert_logprobs_match(
    model: torch.nn.Module, sampling: SamplingParams, result: GenerationResult, positions: Sequence[int]
) -> None:
    """Engine log-probs at `positions` equal the oracle's under the request's sampling params."""
    expected = processed_logprobs(teacher_forced_logits(model, result), sampling)
    tokens = torch.tensor(result.token_ids)
    expected = expected.gather(1, tokens[:, None])[:, 0]
    got = torch.tensor(result.logprobs)
    index = torch.tensor(list(positions), dtype=torch.long)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[index], expected[index], atol=TOL, rtol=0)


async def wait_for_steps(engine: LocalEngine, steps: int) -> None:
    """Poll the engine's decode-step counter (it lives on the decode thread; there is no event for it)."""
    with anyio.fail_after(30):
        while engine.steps < steps:  # noqa: ASYNC110
            await anyio.sleep(0.001)


async def run_interruption(
    path_a: Path,
    path_b: Path,
    *,
    device: str = "cpu",
    location: str = "dir",
    group: int = 1,
    **engine_kwargs: Any,
) -> tuple[list[GenerationResult], torch.nn.Module, torch.nn.Module]:
    """Generate 6 requests (batch 4) with weights A, load B (version 1) mid-decode; return results."""
    model_a = load_causal_lm(path_a, device=device)
    model_b = load_causal_lm(path_b, device=device)
    requests = make_requests(6, lengths=INTERRUPT_LENGTHS, seed=None, group=group)
    source = str(path_b) if location == "dir" else {k: v.clone() for k, v in model_b.state_dict().items()}
    async with LocalEngine(path_a, device=device, max_batch_size=4, **engine_kwargs) as engine:
        async with anyio.create_task_group() as tg:
            box: list[list[GenerationResult]] = []

            async def run() -> None:
                box.append(await engine.generate(requests))

            tg.start_soon(run)
            await wait_for_steps(engine, 10)
            seconds = await engine.load_weights(1, source)
            assert seconds >= 0
            assert engine.version == 1
    return box[0], model_a, model_b


def check_interruption(
    results: list[GenerationResult], model_a: torch.nn.Module, model_b: torch.nn.Module
) -> None:
    """Versions switch 0 -> 1 once; each side's log-probs match that side's weights on the full prefix."""
    assert len(results) == 6
    switched = 0
    for result, length in zip(results, INTERRUPT_LENGTHS, strict=True):
        assert len(result.token_ids) == length and result.finish_reason == "length"
        assert result.versions == sorted(result.versions)
        assert set(result.versions) <= {0, 1}
        old = [i for i, v in enumerate(result.versions) if v == 0]
        new = [i for i, v in enumerate(result.versions) if v == 1]
        assert new, "every request must finish after the swap"
        if old:
            switched += 1
            assert result.stats["prefills"] == 2.0
            assert_logprobs_match(model_a, SamplingParams(), result, old)
        assert_logprobs_match(model_b, SamplingParams(), result, new)
    assert switched >= 4, "the first batch of 4 was decoding when the weights changed"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("model_fixture", "max_prefill_tokens"), [("tiny_a", 8192), ("tiny_a", 8), ("tiny_qwen_bpe", 8192)]
)
async def test_logprobs_match_teacher_forced_forward_at_temperature_1(
    model_fixture: str, max_prefill_tokens: int, kv_cache: str, request: pytest.FixtureRequest
) -> None:
    """At temperature 1 the reported log-prob is log_softmax of an unpadded forward, for every token,
    also when joiners are prefilled in several chunks (tiny max_prefill_tokens)."""
    path = request.getfixturevalue(model_fixture)
    requests = make_requests(7, lengths=(24, 9, 17, 5, 30), seed=None)
    async with LocalEngine(
        path, max_batch_size=3, max_prefill_tokens=max_prefill_tokens, kv_cache=kv_cache
    ) as engine:
        results = await engine.generate(requests)
    for request, result in zip(requests, results, strict=True):
        length = request.sampling.max_new_tokens
        assert len(result.token_ids) == length and result.versions == [0] * length
        assert_logprobs_match(engine.model, request.sampling, result, range(length))


@pytest.mark.asyncio
async def test_logprobs_are_under_the_processed_distribution_with_temperature_top_k_top_p(
    tiny_a: Path, kv_cache: str
) -> None:
    """With temperature/top-k/top-p the log-prob is under the filtered distribution actually sampled from."""
    settings = [
        dict(temperature=0.7, top_k=8),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=0.7, top_k=20, top_p=0.8),
        dict(temperature=1.3, top_p=0.5),
    ]
    requests = []
    for i, setting in enumerate(settings * 2):
        requests += make_requests(1, prompt_len=3 + i, max_new_tokens=8 + 3 * i, seed=i, **setting)
    requests = [
        GenerationRequest(request_id=f"q{i}", prompt_ids=r.prompt_ids, sampling=r.sampling)
        for i, r in enumerate(requests)
    ]
    async with LocalEngine(tiny_a, max_batch_size=4, kv_cache=kv_cache) as engine:
        results = await engine.generate(requests)
    for request, result in zip(requests, results, strict=True):
        sampling = request.sampling
        assert_logprobs_match(engine.model, sampling, result, range(sampling.max_new_tokens))
        if sampling.top_k:
            logits = teacher_forced_logits(engine.model, result)
            ranks = (logits > logits.gather(1, torch.tensor(result.token_ids)[:, None])).sum(1)
            assert (ranks < sampling.top_k).all(), "a token outside the top-k was sampled"


@pytest.mark.asyncio
async def test_greedy_takes_argmax_and_reports_raw_softmax_logprob(tiny_a: Path) -> None:
    """Temperature 0 picks the argmax and reports its log-prob under the unscaled, unfiltered softmax."""
    requests = make_requests(3, max_new_tokens=16, temperature=0.0, top_k=3, top_p=0.5)
    async with LocalEngine(tiny_a) as engine:
        results = await engine.generate(requests)
    for request, result in zip(requests, results, strict=True):
        logits = teacher_forced_logits(engine.model, result)
        assert result.token_ids == logits.argmax(-1).tolist()
        assert_logprobs_match(engine.model, request.sampling, result, range(16))


@pytest.mark.asyncio
async def test_weights_loaded_mid_generation_from_checkpoint_dir_switch_versions_without_losing_requests(
    tiny_a: Path, tiny_b: Path, kv_cache: str
) -> None:
    """Tokens before the swap carry version 0 and match A; after it, version 1 and B on the full prefix."""
    results, model_a, model_b = await run_interruption(tiny_a, tiny_b, location="dir", kv_cache=kv_cache)
    check_interruption(results, model_a, model_b)


@pytest.mark.asyncio
async def test_weights_loaded_mid_generation_from_state_dict_switch_versions(
    tiny_a: Path, tiny_b: Path, kv_cache: str
) -> None:
    """The in-memory state-dict path interrupts and resumes exactly like the checkpoint-dir path."""
    results, model_a, model_b = await run_interruption(
        tiny_a, tiny_b, location="state_dict", kv_cache=kv_cache
    )
    check_interruption(results, model_a, model_b)


@pytest.mark.asyncio
async def test_group_sharing_a_prompt_resumes_after_a_weight_load_with_exact_logprobs(
    tiny_a: Path, tiny_b: Path, kv_cache: str
) -> None:
    """Groups of 3 share a prompt: the prompt is prefilled once per group, then after the swap each
    row re-prefills as shared prompt + its own tokens; log-probs still match A before, B after."""
    results, model_a, model_b = await run_interruption(tiny_a, tiny_b, group=3, kv_cache=kv_cache)
    check_interruption(results, model_a, model_b)
    assert results[0].prompt_ids == results[2].prompt_ids != results[3].prompt_ids


def mixed_logprobs(
    model_a: torch.nn.Module, model_b: torch.nn.Module, result: GenerationResult, switch: int
) -> torch.Tensor:
    """Oracle for kv_after_load="keep": A computes the KV of the prompt and of the tokens before
    `switch - 1` (the last old token is not fed yet at the load); B reads the rest on top of that
    KV. Log-softmax of B's logits for completion tokens switch.. (temperature 1), on the CPU."""
    device = next(model_a.parameters()).device
    prompt = list(result.prompt_ids)
    ids = torch.tensor([prompt + result.token_ids], device=device)
    cut = len(prompt) + switch - 1
    with torch.no_grad():
        past = model_a(input_ids=ids[:, :cut], use_cache=True).past_key_values
        logits = model_b(input_ids=ids[:, cut:-1], use_cache=True, **cache_kwarg(model_b, past)).logits[0]
    logp = logits.float().log_softmax(-1).cpu()
    return logp.gather(1, torch.tensor(result.token_ids[switch:])[:, None])[:, 0]


def check_kept_kv(
    results: list[GenerationResult], model_a: torch.nn.Module, model_b: torch.nn.Module
) -> None:
    """After a load with kv_after_load="keep": nothing was re-prefilled; running requests switch to
    version 1 mid-completion, their old tokens match A and their new tokens B reading over A's KV
    (the mixed oracle), not B over the whole prefix; requests admitted after the load are pure B."""
    switched = 0
    for result, length in zip(results, INTERRUPT_LENGTHS, strict=True):
        assert len(result.token_ids) == length and result.versions == sorted(result.versions)
        assert result.stats["prefills"] == 1.0, "keep must not re-prefill"
        switch = result.versions.index(1)
        if switch == 0:
            assert_logprobs_match(model_b, SamplingParams(), result, range(length))
            continue
        switched += 1
        assert_logprobs_match(model_a, SamplingParams(), result, range(switch))
        got = torch.tensor(result.logprobs[switch:])
        torch.testing.assert_close(got, mixed_logprobs(model_a, model_b, result, switch), atol=TOL, rtol=0)
        pure_b = processed_logprobs(teacher_forced_logits(model_b, result), SamplingParams())
        pure_b = pure_b.gather(1, torch.tensor(result.token_ids)[:, None])[switch:, 0]
        assert (pure_b - got).abs().max() > 1e-3, "A's KV made no difference"
    assert switched >= 4, "the first batch of 4 was decoding when the weights changed"


@pytest.mark.asyncio
async def test_keep_kv_after_load_decodes_on_with_new_weights_over_the_old_kv(
    tiny_a: Path, tiny_b: Path, kv_cache: str
) -> None:
    """kv_after_load="keep" against the mixed oracle (`check_kept_kv`), groups of 2 sharing prompts."""
    results, model_a, model_b = await run_interruption(
        tiny_a, tiny_b, group=2, kv_cache=kv_cache, kv_after_load="keep"
    )
    check_kept_kv(results, model_a, model_b)


@pytest.mark.asyncio
async def test_finish_lets_running_requests_end_on_the_old_weights_before_loading(
    tiny_a: Path, tiny_b: Path, kv_cache: str
) -> None:
    """kv_after_load="finish": the 4 requests decoding at the load keep version 0 (and A's log-probs)
    to their last token; the queued ones are admitted only after all 4 ended, wholly on version 1 (B);
    nothing is re-prefilled."""
    results, model_a, model_b = await run_interruption(
        tiny_a, tiny_b, group=2, kv_cache=kv_cache, kv_after_load="finish"
    )
    old = [r for r in results if r.versions[0] == 0]
    new = [r for r in results if r.versions[0] == 1]
    assert len(old) == 4, "the first batch of 4 was decoding when the weights changed"
    assert new, "the requests queued at the load must run on the new weights"
    for result, length in zip(results, INTERRUPT_LENGTHS, strict=True):
        assert len(result.token_ids) == length and result.finish_reason == "length"
        assert len(set(result.versions)) == 1, "a completion never spans two versions"
        assert result.stats["prefills"] == 1.0
        model = model_a if result in old else model_b
        assert_logprobs_match(model, SamplingParams(), result, range(length))
    assert min(r.stats["admit_step"] for r in new) >= max(r.stats["finish_step"] for r in old), (
        "nothing is admitted while the running requests drain"
    )


@pytest.mark.asyncio
async def test_a_group_is_prefilled_once_and_sampled_independently(tiny_a: Path, kv_cache: str) -> None:
    """8 samples of one prompt: its tokens are computed once; completions differ; log-probs exact."""
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0)
    requests = make_requests(8, group=8, max_new_tokens=12, temperature=1.0)
    async with LocalEngine(tiny_a, max_batch_size=8, kv_cache=kv_cache) as engine:
        results = await engine.generate(requests)
        counters = engine.counters()
        assert counters["prefill_forwards"] == 1 and counters["steps"] == 11
        assert counters["prefill_tokens"] == len(requests[0].prompt_ids)
        assert counters["reprefill_tokens"] == 0 and counters["loads"] == 0
        assert counters["tokens_generated"] == 8 * 12
        assert counters["prefill_s"] > 0 and counters["decode_s"] > 0
    assert len({tuple(r.token_ids) for r in results}) > 1, "every row drew the same tokens"
    model = load_causal_lm(tiny_a)
    for result in results:
        assert_logprobs_match(model, sampling, result, range(12))


@pytest.mark.asyncio
async def test_idle_engine_serves_new_weights_after_state_dict_load(tiny_a: Path, tiny_b: Path) -> None:
    """Loading B's state dict (without lm_head, as tied checkpoints are saved) makes the engine equal to B."""
    model_b = load_causal_lm(tiny_b)
    state = {k: v for k, v in model_b.state_dict().items() if k != "lm_head.weight"}
    requests = make_requests(2, max_new_tokens=12, temperature=0.0)
    async with LocalEngine(tiny_b) as reference:
        expected = await reference.generate(requests)
    async with LocalEngine(tiny_a, version=3) as engine:
        before = await engine.generate(requests)
        await engine.load_weights(4, state)
        after = await engine.generate(requests)
        assert (await engine.health())["version"] == 4
    # random-init tied models echo tokens greedily, so compare the log-probs rather than the tokens
    assert [r.token_ids for r in after] == [r.token_ids for r in expected]
    torch.testing.assert_close(
        torch.tensor([r.logprobs for r in after]),
        torch.tensor([r.logprobs for r in expected]),
        atol=TOL,
        rtol=0,
    )
    assert not torch.allclose(
        torch.tensor([r.logprobs for r in before]), torch.tensor([r.logprobs for r in expected])
    )
    assert all(r.versions == [3] * 12 for r in before) and all(r.versions == [4] * 12 for r in after)


@pytest.mark.asyncio
async def test_short_request_frees_its_slot_for_a_queued_one_before_the_longest_ends(
    tiny_a: Path, kv_cache: str
) -> None:
    """Continuous batching: with 2 slots, a queued request is admitted when a short one finishes."""
    lengths = {"long": 60, "short": 5, "queued": 5}
    requests = [
        GenerationRequest(request_id=name, prompt_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=n))
        for name, n in lengths.items()
    ]
    async with LocalEngine(tiny_a, max_batch_size=2, kv_cache=kv_cache) as engine:
        long, short, queued = await engine.generate(requests)
    assert short.stats["finish_step"] < long.stats["finish_step"]
    assert short.stats["finish_step"] <= queued.stats["admit_step"] < long.stats["finish_step"]
    assert queued.stats["finish_step"] < long.stats["finish_step"]
    assert [len(r.token_ids) for r in (long, short, queued)] == list(lengths.values())


@pytest.mark.asyncio
async def test_prefill_waits_for_prefill_min_rows_free_slots(tiny_a: Path, kv_cache: str) -> None:
    """With 4 slots and prefill_min_rows=2, freed slots are refilled in pairs, not one by one; the
    last waiting request is admitted alone (everything waiting fits). Nothing is lost either way."""
    lengths = (4, 8, 12, 16)
    by_min: dict[int, list[GenerationResult]] = {}
    forwards: dict[int, int] = {}
    for min_rows in (1, 2):
        async with LocalEngine(
            tiny_a, max_batch_size=4, kv_cache=kv_cache, prefill_min_rows=min_rows
        ) as engine:
            by_min[min_rows] = await engine.generate(make_requests(9, lengths=lengths))
            forwards[min_rows] = engine.prefill_forwards
    # min 1: r4 joins when r0 ends (step 4), r5 when r1 ends (8), ... one prefill per freed slot
    # min 2: r4 and r5 join together once r0 and r1 have ended
    admits = {m: [int(r.stats["admit_step"]) for r in results] for m, results in by_min.items()}
    assert admits[1][4] < admits[1][5]
    assert admits[2][4] == admits[2][5] >= admits[1][5]
    assert forwards[2] < forwards[1]
    for results in by_min.values():
        assert [len(r.token_ids) for r in results] == [lengths[i % 4] for i in range(9)]


@pytest.mark.asyncio
async def test_concurrent_generate_calls_share_the_running_batch(tiny_a: Path) -> None:
    """A second generate() call joins the batch while the first call's request is still decoding."""
    first = make_requests(1, max_new_tokens=80)
    second = [
        GenerationRequest(request_id="late", prompt_ids=[9, 9], sampling=SamplingParams(max_new_tokens=4))
    ]
    async with LocalEngine(tiny_a, max_batch_size=4) as engine:
        async with anyio.create_task_group() as tg:
            out: dict[str, GenerationResult] = {}

            async def call(name: str, requests: list[GenerationRequest]) -> None:
                out[name] = (await engine.generate(requests))[0]

            tg.start_soon(call, "first", first)
            await wait_for_steps(engine, 3)
            tg.start_soon(call, "second", second)
    assert out["second"].stats["admit_step"] >= 3
    assert out["second"].stats["finish_step"] < out["first"].stats["finish_step"]


@pytest.mark.asyncio
async def test_seeded_requests_reproduce_across_runs_engines_and_batch_mates(tiny_a: Path) -> None:
    """Same seed gives the same completion, alone or batched, with either KV layout; different seeds differ."""
    requests = make_requests(4, max_new_tokens=30, seed=123)
    others = make_requests(5, prompt_len=9, max_new_tokens=17)
    async with LocalEngine(tiny_a, max_batch_size=8, seed=1) as engine:
        first = await engine.generate(requests)
        second = await engine.generate(others[:2] + requests + others[2:])
    async with LocalEngine(tiny_a, max_batch_size=2, seed=2, kv_cache="slots") as engine:
        third = await engine.generate(requests)
        reseeded = await engine.generate(make_requests(4, max_new_tokens=30, seed=124))
    tokens = [r.token_ids for r in first]
    assert [r.token_ids for r in second[2:6]] == tokens
    assert [r.token_ids for r in third] == tokens
    assert [r.token_ids for r in reseeded] != tokens


@pytest.mark.asyncio
async def test_unseeded_sampling_is_reproducible_for_the_same_engine_seed(tiny_a: Path) -> None:
    """Without request seeds, two engines with the same seed and the same workload agree."""
    requests = make_requests(5, max_new_tokens=20)
    outputs = []
    for _ in range(2):
        async with LocalEngine(tiny_a, max_batch_size=8, seed=7) as engine:
            outputs.append([r.token_ids for r in await engine.generate(requests)])
    assert outputs[0] == outputs[1]


@pytest.mark.asyncio
async def test_stop_token_ends_the_completion_and_is_included(tiny_a: Path) -> None:
    """A sampled stop id ends the completion (finish_reason 'stop'); a missing one runs to the length cap."""
    probe = make_requests(1, max_new_tokens=20, seed=3)
    async with LocalEngine(tiny_a) as engine:
        free = (await engine.generate(probe))[0]
        stop_id = free.token_ids[5]
        cut = free.token_ids.index(stop_id) + 1
        stopped_request = GenerationRequest(
            request_id="s",
            prompt_ids=probe[0].prompt_ids,
            sampling=SamplingParams(max_new_tokens=20, seed=3, stop_token_ids=(999, stop_id)),
        )
        stopped = (await engine.generate([stopped_request]))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:cut] and stopped.token_ids[-1] == stop_id
    assert len(stopped.logprobs) == len(stopped.versions) == cut


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(stop_token_ids=2), "stop_token_ids"),
        (dict(stop_token_ids=(-1,)), "stop_token_ids"),
        (dict(seed=-5), "seed"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs: dict[str, object], message: str) -> None:
    """Each invalid SamplingParams field raises ValueError naming that field."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_invalid_requests_say_what_to_fix() -> None:
    """Empty prompts, text prompts and empty ids are rejected with the request id in the message."""
    with pytest.raises(ValueError, match="r1: prompt_ids is empty"):
        GenerationRequest(request_id="r1", prompt_ids=[])
    with pytest.raises(ValueError, match="tokenize the text first"):
        GenerationRequest(request_id="r2", prompt_ids="hello")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="request_id"):
        GenerationRequest(request_id="", prompt_ids=[1])
    assert GenerationRequest(request_id="ok", prompt_ids=[1, 2]).prompt_ids == (1, 2)


@pytest.mark.asyncio
async def test_engine_rejects_requests_it_cannot_serve(tiny_a: Path) -> None:
    """Too long for the model's positions, or token ids beyond the vocab: ValueError, nothing queued."""
    too_long = GenerationRequest(
        request_id="long", prompt_ids=[5] * 200, sampling=SamplingParams(max_new_tokens=100)
    )
    bad_token = GenerationRequest(request_id="tok", prompt_ids=[5, 10_000])
    engine = LocalEngine(tiny_a)
    with pytest.raises(EngineClosedError, match="start"):
        await engine.generate(make_requests(1))
    async with engine:
        with pytest.raises(ValueError, match="exceeds the model's max positions 256"):
            await engine.generate([too_long])
        with pytest.raises(ValueError, match="vocab size"):
            await engine.generate([bad_token])
        assert (await engine.health())["waiting"] == 0
        assert len((await engine.generate(make_requests(1, max_new_tokens=3)))[0].token_ids) == 3
    with pytest.raises(EngineClosedError):
        await engine.generate(make_requests(1))


@pytest.mark.asyncio
async def test_bad_weights_are_rejected_before_pausing_and_keep_the_version(
    tiny_a: Path, tmp_path: Path
) -> None:
    """Unknown names, wrong shapes, missing tensors or an empty dir raise ValueError/FileNotFoundError."""
    state = load_causal_lm(tiny_a).state_dict()
    wrong_shape = dict(state, **{"model.norm.weight": torch.zeros(3)})
    unknown = dict(state, **{"model.extra": torch.zeros(1)})
    missing = {k: v for k, v in state.items() if "layers.1." not in k}
    async with LocalEngine(tiny_a, version=5) as engine:
        with pytest.raises(ValueError, match="shape"):
            await engine.load_weights(6, wrong_shape)
        with pytest.raises(ValueError, match="unknown"):
            await engine.load_weights(6, unknown)
        with pytest.raises(ValueError, match="miss"):
            await engine.load_weights(6, missing)
        with pytest.raises(FileNotFoundError, match="safetensors"):
            await engine.load_weights(6, str(tmp_path))
        assert engine.version == 5


@pytest.mark.asyncio
async def test_aclose_fails_pending_requests_instead_of_hanging(tiny_a: Path) -> None:
    """Closing the engine while a request decodes ends that call with EngineClosedError."""
    engine = LocalEngine(tiny_a, max_batch_size=1)
    await engine.start()
    errors: list[BaseException] = []

    async def call() -> None:
        try:
            await engine.generate(make_requests(2, max_new_tokens=200))
        except EngineClosedError as exc:
            errors.append(exc)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await wait_for_steps(engine, 2)
            await engine.aclose()
    assert len(errors) == 1
    assert (await engine.health())["status"] == "closed"


@pytest.mark.asyncio
async def test_cancelled_call_leaves_the_batch_and_others_finish(tiny_a: Path, kv_cache: str) -> None:
    """A cancelled generate() stops decoding its requests; the engine keeps serving other calls."""
    async with LocalEngine(tiny_a, max_batch_size=2, kv_cache=kv_cache) as engine:
        with anyio.move_on_after(0.05):
            await engine.generate(make_requests(2, max_new_tokens=250))
        with anyio.fail_after(30):
            result = (await engine.generate(make_requests(1, max_new_tokens=4)))[0]
        assert len(result.token_ids) == 4
        assert (await engine.health())["running"] <= 1


def test_sampler_never_picks_a_filtered_token_and_respects_per_row_params() -> None:
    """top-k 1 rows equal argmax; masked tokens never win; log-probs are finite."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(top_k=1), SamplingParams(temperature=0.5, top_p=0.01)] * 3
    fallback = torch.Generator().manual_seed(1)
    for _ in range(20):
        tokens, logprobs = sample_tokens(logits, params, torch.rand(6, generator=fallback).tolist())
        assert tokens.tolist() == logits.argmax(-1).tolist()
        torch.testing.assert_close(logprobs, torch.zeros(6), atol=1e-6, rtol=0)


def test_sampler_frequencies_follow_the_processed_distribution() -> None:
    """Empirical token frequencies match softmax(logits / T) restricted to the top-k (3 sigma)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = [SamplingParams(temperature=0.8, top_k=4)] * 4000
    fallback = torch.Generator().manual_seed(0)
    uniforms = torch.rand(4000, generator=fallback).tolist()
    tokens, logprobs = sample_tokens(logits.expand(4000, -1), params, uniforms)
    expected = (logits[0, :4] / 0.8).softmax(-1)
    counts = torch.bincount(tokens, minlength=6).float() / 4000
    assert counts[4:].sum() == 0
    torch.testing.assert_close(counts[:4], expected, atol=0.025, rtol=0)
    torch.testing.assert_close(logprobs, expected.log()[tokens], atol=1e-5, rtol=0)


@pytest.mark.asyncio
async def test_slot_cache_works_with_eager_attention(tiny_a: Path) -> None:
    """With eager attention the slot layout switches to an additive mask; log-probs still match."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_a, attn_implementation="eager").eval()
    requests = make_requests(5, max_new_tokens=12, seed=None)
    async with LocalEngine(model, max_batch_size=2, kv_cache="slots") as engine:
        results = await engine.generate(requests)
    for request, result in zip(requests, results, strict=True):
        assert_logprobs_match(model, request.sampling, result, range(12))


def test_packed_gqa_decode_attention_equals_repeated_kv_attention() -> None:
    """A one-token GQA query attends as transformers' sdpa with repeated K/V heads does, mask included."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    batch, kv_heads, groups, span, dim = 3, 2, 3, 11, 8
    query = torch.randn(batch, kv_heads * groups, 1, dim)
    key, value = torch.randn(2, batch, kv_heads, span, dim).unbind(0)
    mask = (torch.arange(span)[None, :] <= torch.tensor([4, 10, 0])[:, None])[:, None, None, :]
    module = SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)
    got, _ = packed_gqa_sdpa(module, query, key, value, mask, scaling=0.3)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        repeated = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        want = torch.nn.functional.scaled_dot_product_attention(query, *repeated, attn_mask=mask, scale=0.3)
    assert got.shape == (batch, 1, kv_heads * groups, dim)
    torch.testing.assert_close(got, want.transpose(1, 2))
    # a longer query (prefill) is transformers' sdpa itself
    prefill = torch.randn(batch, kv_heads * groups, 4, dim)
    got, _ = packed_gqa_sdpa(module, prefill, key, value, None, scaling=0.3)
    torch.testing.assert_close(got, sdpa_attention_forward(module, prefill, key, value, None, scaling=0.3)[0])


@pytest.mark.asyncio
async def test_slots_engine_decodes_a_gqa_model_with_packed_attention(tiny_qwen_bpe: Path) -> None:
    """A GQA model served from slots uses the packed decode attention and its log-probs still match an
    unpadded forward under plain sdpa."""
    reference = load_causal_lm(tiny_qwen_bpe)
    requests = make_requests(5, lengths=(14, 6, 9), seed=None)
    async with LocalEngine(tiny_qwen_bpe, max_batch_size=2, kv_cache="slots") as engine:
        assert engine.model.config._attn_implementation == PACKED_GQA_SDPA
        results = await engine.generate(requests)
    assert reference.config._attn_implementation == "sdpa"
    for request, result in zip(requests, results, strict=True):
        assert_logprobs_match(reference, request.sampling, result, range(request.sampling.max_new_tokens))


def test_engine_options_are_validated(tiny_a: Path) -> None:
    """Unknown KV layouts, CUDA graphs without slots/CUDA, compile without CUDA graphs and empty batches
    are rejected up front."""
    with pytest.raises(ValueError, match="kv_cache"):
        LocalEngine(tiny_a, kv_cache="paged")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cuda_graphs"):
        LocalEngine(tiny_a, kv_cache="slots", cuda_graphs=True)
    with pytest.raises(ValueError, match="compile=True needs cuda_graphs=True"):
        LocalEngine(tiny_a, kv_cache="slots", compile=True)
    with pytest.raises(ValueError, match="max_batch_size"):
        LocalEngine(tiny_a, max_batch_size=0)
    with pytest.raises(ValueError, match="prefill_min_rows must be in"):
        LocalEngine(tiny_a, max_batch_size=4, prefill_min_rows=5)


def _run_slots(kv: _SlotKV, model: torch.nn.Module) -> list[torch.Tensor]:
    """Prefill 3 rows, decode 3 steps, admit 2 more rows of other lengths, decode 2 steps; all logits."""
    kv.reserve(40)
    out = [kv.prefill(model, [[5, 6, 7], [8] * 9, [9, 10]], [0, 1, 2])]
    kv.rows = 3
    lengths = [3, 9, 2]
    for step in range(5):
        if step == 3:
            out.append(kv.prefill(model, [[11] * 4, [12, 13, 14, 15, 16, 17]], [3, 4]))
            kv.rows, lengths = 5, [*lengths, 4, 6]
        count = len(lengths)
        rows = _DecodeRows([20 + step] * count, lengths, [1.0] * count, [0.5] * count, [False] * count)
        logits, draws = kv.decode(model, rows, max(lengths) + 1)
        out += [logits, draws]
        lengths = [n + 1 for n in lengths]
    return out


def test_slot_steps_trace_once_with_dynamic_shapes_under_torch_compile(tiny_qwen_bpe: Path) -> None:
    """The slots prefill and decode forward trace under torch.compile (dynamo, eager backend here; the
    engine compiles with inductor on CUDA) with batch, length and span dynamic: the same logits and
    draws as uncompiled, one graph each, and other batch sizes and prompt lengths never recompile."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = load_causal_lm(tiny_qwen_bpe)
    model.set_attn_implementation(PACKED_GQA_SDPA)
    with torch.inference_mode():
        want = _run_slots(_SlotKV(model, 6, graphs=False, compile=False), model)
        kv = _SlotKV(model, 6, graphs=False, compile=False)
        kv.compile = True  # pad and mark dimensions as the compiled engine does
        kv._decode_forward = torch.compile(slot_decode_forward, backend="eager")
        kv._prefill_step = torch.compile(slot_prefill_step, backend="eager")
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = _run_slots(kv, model)
    assert counters["stats"]["unique_graphs"] == 2, "each step traces as one graph, no graph breaks"
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
