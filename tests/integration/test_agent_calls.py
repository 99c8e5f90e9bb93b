"""The agent worker's pieces against a real nats-server: generation calls and episode export."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from areal_async.agents import Episode, Turn
from areal_async.engines.base import SamplingParams
from bus import Bus
from bus.events import GenerateCall, GenerateReply, pack_f32, pack_i32, unpack_f32, unpack_i32, unpack_u8
from workers.agent import BusClient, CallsFailed, episode_completion, episode_stats


def _episode() -> Episode:
    """prompt (3) | model turn at v4 (2) | feedback (3) | model turn across a load v4 -> v5 (3)."""
    return Episode(
        turns=(
            Turn(role="prompt", token_ids=(1, 2, 3)),
            Turn(
                role="model",
                token_ids=(10, 11),
                logprobs=(-0.5, -0.25),
                versions=(4, 4),
                text="41",
                reward=0.0,
                finish_reason="stop",
            ),  # fmt: skip
            Turn(role="environment", token_ids=(20, 21, 22), text="try again"),
            Turn(
                role="model",
                token_ids=(12, 13, 14),
                logprobs=(-1.0, -0.5, -0.125),
                versions=(4, 5, 5),
                text="42",
                reward=1.0,
                finish_reason="stop",
            ),  # fmt: skip
        ),
        gamma=0.9,
    )


def test_an_episode_exports_as_one_completion_masked_to_the_model_tokens() -> None:
    """Everything after the prompt, in order; mask 1 on model tokens; context tokens carry logprob 0
    and the version of the model token before them, so versions never decrease."""
    episode = _episode()
    c = episode_completion(episode)
    assert unpack_i32(c.token_ids).tolist() == [10, 11, 20, 21, 22, 12, 13, 14]
    assert unpack_u8(c.loss_mask).tolist() == [1, 1, 0, 0, 0, 1, 1, 1]
    assert unpack_i32(c.versions).tolist() == [4, 4, 4, 4, 4, 4, 5, 5]
    assert np.allclose(unpack_f32(c.logprobs), [-0.5, -0.25, 0, 0, 0, -1.0, -0.5, -0.125])
    assert episode.head_version == 4 and episode.reward == pytest.approx(0.9)
    stats = episode_stats([episode])
    assert stats["episode/turns"] == 2 and stats["episode/first_try"] == 0.0


def test_episode_stats_count_episodes_with_a_call_that_ran() -> None:
    """tool_ok_rate: the share of episodes in which at least one tool call ran without error; a
    written call that failed (malformed, unknown tool, bad arguments) counts only in tool_use_rate."""
    model = Turn(
        role="model", token_ids=(5,), logprobs=(0.0,), versions=(0,), text="<tool_call>x</tool_call>"
    )
    prompt = Turn(role="prompt", token_ids=(1,))

    def episode(**info: int) -> Episode:
        return Episode(turns=(prompt, model), info=dict(info))

    stats = episode_stats(
        [episode(tool_calls=2, tool_errors=1), episode(tool_calls=1, tool_errors=1), episode()]
    )
    assert stats["episode/tool_use_rate"] == 1.0
    assert stats["episode/tool_ok_rate"] == pytest.approx(1 / 3)


def test_an_episode_without_a_model_token_is_refused() -> None:
    with pytest.raises(ValueError, match="no model token"):
        episode_completion(Episode(turns=(Turn(role="prompt", token_ids=(1, 2)),)))


@pytest.mark.asyncio
async def test_a_call_no_worker_answers_is_retried_on_another(bus_factory) -> None:
    """The first worker takes the call and dies silently; after the call timeout the retry reaches the
    live worker. With nobody serving at all, the call gives up after its attempts."""
    agent: Bus = await bus_factory("agent")
    client = BusClient(agent, worker_id="agent-1", timeout_s=1.0, attempts=3)
    sampling = SamplingParams(max_new_tokens=2)
    with pytest.raises(CallsFailed, match="3 attempts"):
        await client.generate([1, 2], sampling)

    seen: list[str] = []

    async def worker(name: str, answers: bool) -> None:
        bus = await bus_factory(name)
        async with bus.serve(bus.subjects.generate, queue="generation") as requests:
            async for req in requests:
                seen.append(name)
                call = req.event
                assert isinstance(call, GenerateCall)
                if answers:
                    await req.respond(
                        GenerateReply(
                            call_id=call.call_id,
                            engine_id=name,
                            token_ids=pack_i32([7, 8]),
                            logprobs=pack_f32([-0.1, -0.2]),
                            versions=pack_i32([3, 3]),
                            finish_reason="stop",
                        )
                    )
                else:
                    return  # takes one call and dies without answering

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker, "dead", False)
        await anyio.sleep(0.3)
        tg.start_soon(worker, "live", True)
        await anyio.sleep(0.3)
        results = [await client.generate([1, 2], sampling) for _ in range(4)]
        tg.cancel_scope.cancel()
    assert all(list(r.token_ids) == [7, 8] and list(r.versions) == [3, 3] for r in results)
    assert seen.count("dead") <= 1 and seen.count("live") == 4


async def _answer_calls(bus_factory, answer) -> None:
    """A generation worker stand-in on the real bus: every call gets ``await answer(call)``."""
    bus = await bus_factory("gen")
    async with bus.serve(bus.subjects.generate, queue="generation") as requests:
        async for req in requests:
            await req.respond(await answer(req.event))


@pytest.mark.asyncio
async def test_a_refused_call_raises_with_the_workers_reason(bus_factory) -> None:
    """A generation worker answers a bad call with its error; the agent raises it (no retry)."""
    agent = await bus_factory("agent")
    client = BusClient(agent, worker_id="agent-1", timeout_s=2.0, attempts=3)

    async def refuse(call: GenerateCall) -> GenerateReply:
        return GenerateReply(call_id=call.call_id, engine_id="gen", error="bad call: x")

    async with anyio.create_task_group() as tg:
        tg.start_soon(_answer_calls, bus_factory, refuse)
        await anyio.sleep(0.3)
        with pytest.raises(ValueError, match="refused the call: bad call"):
            await client.generate([1], SamplingParams(max_new_tokens=1))
        tg.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_the_bus_share_of_a_call_excludes_the_generation_workers_time(bus_factory) -> None:
    """``bus_s`` adds up each call's round trip minus the time the worker says it spent on it."""
    agent = await bus_factory("agent")
    client = BusClient(agent, worker_id="agent-1", timeout_s=5.0, attempts=1)

    async def slow(call: GenerateCall) -> GenerateReply:
        await anyio.sleep(0.25)  # the engine's time, reported in the reply
        return GenerateReply(
            call_id=call.call_id, engine_id="gen", token_ids=pack_i32([7]), logprobs=pack_f32([-0.1]),
            versions=pack_i32([0]), finish_reason="stop", seconds=0.25,
        )  # fmt: skip

    async with anyio.create_task_group() as tg:
        tg.start_soon(_answer_calls, bus_factory, slow)
        await anyio.sleep(0.3)
        started = anyio.current_time()
        for _ in range(3):
            await client.generate([1], SamplingParams(max_new_tokens=1))
        elapsed = anyio.current_time() - started
        tg.cancel_scope.cancel()
    assert client.calls == 3 and elapsed >= 0.75
    assert 0.0 < client.bus_s < elapsed - 0.7, (client.bus_s, elapsed)
