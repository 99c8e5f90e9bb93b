"""Simulated hardware: profiles, and the simulated engine's contract (interruption, versions, lengths)."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from areal_async.engines.base import GenerationRequest, SamplingParams
from areal_async.engines.simulated import SimulatedEngine
from areal_async.errors import ConfigError
from areal_async.simulation.profile import load_profile, profile_from_dict

REPO = Path(__file__).resolve().parents[2]


def test_a_baseline_profile_reproduces_its_synchronous_phases() -> None:
    """The CPU demo's synchronous row gives back its completion length, its generation time for the
    step's 32 completions and its training time for the step's tokens."""
    doc = json.loads((REPO / "benchmarks/baselines/async__cpu-amx-2c.json").read_text())
    sync = next(r for r in doc["results"] if r["label"] == "max_staleness0")
    p = load_profile(str(REPO / "benchmarks/baselines/async__cpu-amx-2c.json"))
    tokens = sync["trained_tokens_per_s"] * sync["seconds_per_step"]
    assert p.engine.completion_tokens_mean == pytest.approx(tokens / 32)
    assert p.engine.decode_step_s * 16 == pytest.approx(sync["t_gen"], rel=0.02)
    assert p.trainer.step_seconds(round(tokens), 1) == pytest.approx(sync["t_train"], rel=0.01)
    assert not p.device.shared


def test_a_shared_gpu_baseline_models_the_update_slowing_beside_decoding() -> None:
    """On one GPU shared by engine and trainer, the async run's slower update becomes the slowdown."""
    p = load_profile(str(REPO / "benchmarks/baselines/async__h200.json"))
    assert p.device.shared
    assert p.device.train_slowdown == pytest.approx(2.9077 / 1.2737, rel=0.01)


def test_a_profile_with_an_unknown_key_names_it_and_the_known_ones() -> None:
    """A typo in a user's profile is an error naming the key, not a silent default."""
    with pytest.raises(ConfigError, match=r"decode_step_sec.*known"):
        profile_from_dict({"engine": {"decode_step_sec": 0.1}, "trainer": {"seconds_per_token": 1e-4}})
    with pytest.raises(ConfigError, match="decode_step_s must be a number > 0"):
        profile_from_dict({"engine": {"decode_step_s": 0}, "trainer": {"seconds_per_token": 1e-4}})


def test_ranks_divide_the_step_time_with_their_efficiency() -> None:
    """8 ranks at efficiency 0.9 are 8 * 0.9^3 times as fast as one, plus the fixed overhead."""
    p = profile_from_dict(
        {"engine": {"decode_step_s": 0.01}, "trainer": {"seconds_per_token": 1e-3, "step_overhead_s": 0.5}}
    )
    assert p.trainer.step_seconds(8000, 8) == pytest.approx(0.5 + 8.0 / (8 * 0.9**3))


@pytest.mark.asyncio
async def test_a_weight_load_mid_decode_splits_a_completion_between_two_versions() -> None:
    """A load asked for while a completion decodes pauses it at a step boundary; the tokens after it
    carry the new version, none is lost, and the versions never fall."""
    p = profile_from_dict(
        {
            "engine": {"decode_step_s": 0.02, "completion_tokens_mean": 20},
            "trainer": {"seconds_per_token": 1e-3},
        }
    )
    async with SimulatedEngine(p, engine_id="e0", max_batch_size=4) as engine:
        request = GenerationRequest(
            request_id="r", prompt_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=20)
        )
        results = []
        async with anyio.create_task_group() as tg:

            async def generate() -> None:
                results.extend(await engine.generate([request, request]))

            tg.start_soon(generate)
            await anyio.sleep(0.1)  # modelled time: five of the twenty decode steps
            await engine.load_weights(1, "unused")
        assert engine.version == 1
    for r in results:
        assert len(r.token_ids) == len(r.versions) == len(r.logprobs) == 20
        assert r.versions == sorted(r.versions) and r.head_version == 0 and r.tail_version == 1
        assert r.finish_reason == "length"


@pytest.mark.asyncio
async def test_completion_lengths_have_a_long_tail_capped_at_max_new_tokens() -> None:
    """Lognormal lengths: their mean near the profile's, a tail that reaches the cap, and stop-finished
    completions end with the stop id."""
    p = profile_from_dict(
        {
            "engine": {"decode_step_s": 1e-4, "completion_tokens_mean": 40, "completion_tokens_sigma": 1.0},
            "trainer": {"seconds_per_token": 1e-3},
        }
    )
    sampling = SamplingParams(max_new_tokens=200, stop_token_ids=(2,))
    requests = [GenerationRequest(request_id=str(i), prompt_ids=(1,), sampling=sampling) for i in range(400)]
    async with SimulatedEngine(p, engine_id="e0", max_batch_size=512, time_scale=0.01) as engine:
        results = await engine.generate(requests)
    lengths = [len(r.token_ids) for r in results]
    assert 30 < sum(lengths) / len(lengths) < 45
    assert max(lengths) == 200 and min(lengths) < 15
    assert all(r.token_ids[-1] == 2 for r in results if r.finish_reason == "stop")


@pytest.mark.asyncio
async def test_token_scale_carries_fewer_tokens_for_the_same_modelled_decode() -> None:
    """With token_scale 10 a 100-token completion travels as 10 tokens and still takes 100 decode
    steps of modelled time."""
    p = profile_from_dict(
        {
            "engine": {"decode_step_s": 0.001, "completion_tokens_mean": 100},
            "trainer": {"seconds_per_token": 1e-3},
        }
    )
    request = GenerationRequest(request_id="r", prompt_ids=(1,), sampling=SamplingParams(max_new_tokens=64))
    async with SimulatedEngine(p, engine_id="e0", max_batch_size=4, token_scale=10) as engine:
        [result] = await engine.generate([request])
    assert len(result.token_ids) == 10
    assert engine.busy_s >= 100 * 0.001


@pytest.mark.asyncio
async def test_a_multi_turn_session_runs_on_the_simulated_engine_and_tokenizer() -> None:
    """Agent workflows render conversations with the simulated tokenizer's stand-in chat template:
    a model turn from the simulated engine, then feedback, extend one token sequence whose model
    tokens carry versions."""
    from areal_async.agents.client import ChatSession, EngineClient
    from areal_async.engines.simulated import SimulatedTokenizer

    p = profile_from_dict(
        {
            "engine": {"decode_step_s": 1e-4, "completion_tokens_mean": 6},
            "trainer": {"seconds_per_token": 1e-3},
        }
    )
    session = ChatSession(SimulatedTokenizer(), [{"role": "user", "content": "3+4="}])
    start = len(session.token_ids)
    async with SimulatedEngine(p, engine_id="e0", max_batch_size=4) as engine:
        client = EngineClient(engine)
        await session.generate(client, SamplingParams(max_new_tokens=8))
        session.add_messages([{"role": "user", "content": "try again"}], role="environment")
        await session.generate(client, SamplingParams(max_new_tokens=8))
    assert len(session.token_ids) > start + 12
    assert sum(t.trained for t in session.turns) == 2
