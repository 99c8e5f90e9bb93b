"""The OpenAI-compatible endpoint: agent code written against ``openai.AsyncOpenAI`` trains unchanged.

The agents talk to a real ``OpenAIServer`` on a free local port through the real ``openai``
package. The policy is ``ScriptedClient`` (tests/unit/test_agents_workflows.py): preset replies
spelled one character-token at a time with the BPE ChatML tokenizer, ids a re-encode would
merge, so the checks see that the episode keeps the model's ids as they were produced. The last
test serves a real tiny model through ``EngineClient`` + ``LocalEngine``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import openai
import pytest
from structlog.testing import capture_logs

from areal_async.agents import (
    Calculator,
    EngineClient,
    EpisodeRecorder,
    OpenAIServer,
    UnknownEpisode,
    WorkflowContext,
    openai_workflow,
    render_tool_prompt,
)
from areal_async.engines.base import GenerationResult, SamplingParams
from tests.helpers.models import build_tiny_model, build_tokenizer
from tests.unit.test_agents_episode import EOS
from tests.unit.test_agents_workflows import CALC, ScriptedClient

MODEL = "areal-policy"
ROW = {"prompt": "What is 17 * 23?", "answer": "391"}
TOOLS = [Calculator().schema()]


class RecordingClient(ScriptedClient):
    """A ScriptedClient that also keeps the sampling parameters of every call."""

    def __init__(self, tokenizer: Any, replies: list[str], versions: list[int] | None = None) -> None:
        super().__init__(tokenizer, replies, versions)
        self.samplings: list[SamplingParams] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        self.samplings.append(sampling)
        return await super().generate(prompt_ids, sampling)


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer("bpe")


@asynccontextmanager
async def serving(client: Any, tok: Any, **recorder_options: Any) -> AsyncIterator[OpenAIServer]:
    recorder = EpisodeRecorder(tok, **recorder_options)
    server = OpenAIServer(client, tok, model_name=MODEL, recorder=recorder)
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve, "127.0.0.1", 0)
        yield server
        tg.cancel_scope.cancel()


def context(tok: Any, server: OpenAIServer | None, **options: Any) -> WorkflowContext:
    sampling = SamplingParams(max_new_tokens=256, stop_token_ids=(EOS,))
    return WorkflowContext(tokenizer=tok, sampling=sampling, openai_server=server, **options)


async def calculator_agent(base_url: str, row: dict[str, Any]) -> float:
    """Three calls: a tool call, the answer after the tool result, a confirmation after a user turn."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as llm:
        messages: list[Any] = [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": row["prompt"]},
        ]
        first = await llm.chat.completions.create(
            model="gpt-4o", messages=messages, tools=TOOLS, temperature=0.5, max_tokens=200, stop=["\n"]
        )
        assert first.choices[0].finish_reason == "tool_calls"
        message = first.choices[0].message
        [call] = message.tool_calls or []
        assert call.function.name == "calculator" and message.content is None
        assert json.loads(call.function.arguments) == {"expression": "17 * 23"}
        messages += [message, {"role": "tool", "tool_call_id": call.id, "content": "391"}]
        second = await llm.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
        assert second.choices[0].finish_reason == "stop"
        messages += [
            {"role": "assistant", "content": second.choices[0].message.content},
            {"role": "user", "content": "Are you sure?"},
        ]
        third = await llm.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
        assert third.usage is not None and third.usage.completion_tokens == len("Yes, 391.") + 1
        return float(row["answer"] in (third.choices[0].message.content or ""))


@pytest.mark.asyncio
async def test_an_openai_agent_loop_records_one_episode_of_exact_model_ids_and_template_deltas(
    tok: Any,
) -> None:
    """Tokens are the prompt, the model's ids as sampled, and the chat template's deltas between them;
    the loss mask covers the model's ids only; versions and the returned reward land on the episode."""
    client = RecordingClient(tok, [CALC, "It is 391.", "Yes, 391."], versions=[3, 4, 5])
    async with serving(None, tok) as server:
        episode = await openai_workflow(calculator_agent)(client, ROW, context(tok, server, group_index=1))

    system = "Use tools.\n\n" + render_tool_prompt([Calculator()])
    opening = [{"role": "system", "content": system}, {"role": "user", "content": ROW["prompt"]}]
    prompt_text = tok.apply_chat_template(opening, tokenize=False, add_generation_prompt=True)
    deltas = [
        "\n<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n",
    ]
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    expected = [encode(prompt_text), client.sent[0], encode(deltas[0]), client.sent[1], encode(deltas[1])]
    expected.append(client.sent[2])
    assert [t.role for t in episode.turns] == ["prompt", "model", "tool", "model", "user", "model"]
    assert [list(t.token_ids) for t in episode.turns] == expected
    assert client.prompts == [sum(expected[: 2 * k + 1], []) for k in range(3)]
    assert encode(episode.model_turns[0].text) != client.sent[0][:-1]  # a re-encode would have drifted
    assert episode.loss_mask == [
        m for t, ids in zip(episode.turns, expected, strict=True) for m in [int(t.trained)] * len(ids)
    ]
    assert [set(t.versions) for t in episode.turns] == [{-1}, {3}, {-1}, {4}, {-1}, {5}]
    assert (episode.head_version, episode.tail_version) == (3, 5)
    assert (episode.turn_rewards, episode.reward, episode.group_index) == ([0.0, 0.0, 1.0], 1.0, 1)
    newline = encode("\n")[0]
    first, later = client.samplings[0], client.samplings[1]
    assert (first.temperature, first.max_new_tokens, first.stop_token_ids) == (0.5, 200, (EOS, newline))
    assert (later.temperature, later.max_new_tokens, later.stop_token_ids) == (1.0, 256, (EOS,))
    assert server.recorder.is_closed(episode.info["episode_id"]) == "finished"


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["returned", "posted", "reward_fn"])
async def test_the_reward_is_returned_posted_or_scored_by_the_reward_function(tok: Any, how: str) -> None:
    """solve() may return the reward, post it to /episodes/<id>/reward, or leave it to ctx.reward_fn."""

    async def solve(base_url: str, row: dict[str, Any]) -> float | None:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as llm:
            reply = await llm.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}]
            )
        if how == "returned":
            return 0.25
        if how == "posted":
            async with httpx.AsyncClient() as http:
                response = await http.post(base_url.removesuffix("/v1") + "/reward", json={"reward": 0.5})
            assert response.status_code == 200 and response.json()["reward"] == 0.5
        assert reply.choices[0].message.content == "391"
        return None

    client = ScriptedClient(tok, ["391"])
    reward_fn = lambda text, row: 0.75 if text == row["answer"] else 0.0  # noqa: E731
    async with serving(None, tok) as server:
        episode = await openai_workflow(solve)(client, ROW, context(tok, server, reward_fn=reward_fn))
    assert episode.reward == {"returned": 0.25, "posted": 0.5, "reward_fn": 0.75}[how]
    assert [list(t.token_ids) for t in episode.model_turns] == client.sent


@pytest.mark.asyncio
async def test_calls_that_do_not_extend_each_other_raise_the_documented_error(tok: Any) -> None:
    """An agent that rewrites the model's answer starts a new chain (re-encoded text, other ids):
    finishing the episode raises ValueError naming the episode and the call."""
    async with serving(ScriptedClient(tok, ["It is 391.", "Sure."]), tok) as server:
        async with openai.AsyncOpenAI(base_url=server.base_url("ep-7"), api_key="x", max_retries=0) as llm:
            messages: list[Any] = [{"role": "user", "content": "What is 17 * 23?"}]
            await llm.chat.completions.create(model=MODEL, messages=messages)
            messages += [{"role": "assistant", "content": "It is 391!"}, {"role": "user", "content": "Why?"}]
            await llm.chat.completions.create(model=MODEL, messages=messages)
        assert len(server.recorder.calls("ep-7")) == 2
        with pytest.raises(ValueError, match=r"calls of episode 'ep-7' do not extend each other \(call 1"):
            server.recorder.finish("ep-7", 1.0)
        with pytest.raises(UnknownEpisode, match="'ep-7' was finished"):
            server.recorder.calls("ep-7")


@pytest.mark.asyncio
async def test_bad_requests_get_400_naming_the_field(tok: Any) -> None:
    """Each bad field is answered 400 with an OpenAI error body whose param names it; the message
    names the value; malformed HTTP gets 400 too."""
    user = [{"role": "user", "content": "Hi"}]
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"temperature": -1}, "temperature", "-1"),
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"n": 0}, "n", "0"),
        ({"seed": "x"}, "seed", "'x'"),
        ({"stop": "The answer"}, "stop", "'The answer'"),
        ({"stream": True}, "stream", "stream=true"),
        ({"tools": [{"type": "function"}]}, "tools[0]", "function"),
        ({"messages": []}, "messages", "non-empty"),
        ({"messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role", "'robot'"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "text"),
    ]
    async with serving(ScriptedClient(tok, []), tok) as server, httpx.AsyncClient() as http:
        url = server.base_url("ep-bad")
        for fields, param, shown in cases:
            response = await http.post(f"{url}/chat/completions", json={"messages": user, **fields})
            error = response.json()["error"]
            assert (response.status_code, error["param"], error["type"]) == (
                400,
                param,
                "invalid_request_error",
            )
            assert shown in error["message"], error["message"]
        base = url.removesuffix("/episodes/ep-bad/v1")
        response = await http.post(f"{base}/v1/chat/completions", json={"messages": user})
        assert (response.status_code, response.json()["error"]["param"]) == (400, "X-Areal-Episode")
        response = await http.post(f"{url.removesuffix('/v1')}/reward", content=b'{"reward": NaN}')
        assert (response.status_code, response.json()["error"]["param"]) == (400, "reward")
        response = await http.post(f"{base}/episodes/never-called/reward", json={"reward": 1.0})
        assert response.status_code == 404 and "never-called" in response.json()["error"]["message"]
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as llm:
            with pytest.raises(openai.BadRequestError) as caught:
                await llm.chat.completions.create(model=MODEL, messages=user, temperature=-1)  # type: ignore[arg-type]
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "temperature"
        async with await anyio.connect_tcp("127.0.0.1", server.port or 0) as raw:
            await raw.send(b"NOT AN HTTP REQUEST\r\n\r\n")
            assert (await raw.receive()).startswith(b"HTTP/1.1 400 ")


@pytest.mark.asyncio
async def test_models_lists_the_model_and_n_samples_are_n_seeded_calls(tok: Any) -> None:
    """/v1/models (plain and under an episode) lists the one model; n=2 gives two choices from two
    engine calls on the same prompt with seeds seed and seed + 1; ``Connection: close`` closes."""
    client = RecordingClient(tok, ["12", "13"])
    async with serving(client, tok) as server:
        async with openai.AsyncOpenAI(base_url=server.base_url("ep-n"), api_key="x", max_retries=0) as llm:
            assert [m.id for m in (await llm.models.list()).data] == [MODEL]
            reply = await llm.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Pick"}], n=2, seed=7
            )
        async with httpx.AsyncClient() as http:
            models = await http.get(server.base_url("ep-n").removesuffix("/episodes/ep-n/v1") + "/v1/models")
        assert models.json()["data"][0]["id"] == MODEL
        async with await anyio.connect_tcp("127.0.0.1", server.port or 0) as raw:
            await raw.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            received = b""
            with anyio.fail_after(5):
                while chunk := await _receive_or_eof(raw):
                    received += chunk
        assert received.startswith(b"HTTP/1.1 200 ") and b"Connection: close" in received
    assert sorted(c.message.content or "" for c in reply.choices) == ["12", "13"]
    assert sorted(s.seed or 0 for s in client.samplings) == [7, 8] and client.prompts[0] == client.prompts[1]
    assert reply.usage is not None and reply.usage.completion_tokens == 6


async def _receive_or_eof(stream: Any) -> bytes:
    try:
        return bytes(await stream.receive())
    except anyio.EndOfStream:
        return b""


@pytest.mark.asyncio
async def test_unfinished_episodes_are_dropped_after_the_ttl_and_say_so(tok: Any) -> None:
    """An episode idle longer than ttl_s is dropped at the next request, logged, and later calls
    to it are answered 404."""
    now = [0.0]
    async with serving(ScriptedClient(tok, ["ok"]), tok, ttl_s=60, clock=lambda: now[0]) as server:
        async with openai.AsyncOpenAI(base_url=server.base_url("ep-old"), api_key="x", max_retries=0) as llm:
            await llm.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
            now[0] = 61.0
            with capture_logs() as logs:
                with pytest.raises(openai.NotFoundError, match="dropped after 60 s"):
                    await llm.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "Hi"}]
                    )
    assert [(e["event"], e["episode_id"], e["calls"]) for e in logs] == [("episode dropped", "ep-old", 1)]


@pytest.mark.asyncio
async def test_a_failed_model_call_is_not_repeated_and_fails_the_workflow_with_its_own_error(
    tok: Any,
) -> None:
    """The endpoint answers a client error with 500 and x-should-retry: false (the openai client
    does not send the call again); the workflow raises the client's error, not the agent's."""

    class FailingClient:
        calls = 0

        async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult:
            FailingClient.calls += 1
            raise RuntimeError("no generation worker answered")

    async def solve(base_url: str, row: dict[str, Any]) -> float:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x") as llm:  # default retries
            with pytest.raises(openai.InternalServerError, match="no generation worker"):
                await llm.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
            raise ValueError("the agent gave up")

    async with serving(None, tok) as server:
        with pytest.raises(RuntimeError, match="no generation worker answered"):
            await openai_workflow(solve)(FailingClient(), ROW, context(tok, server))
    assert FailingClient.calls == 1


@pytest.mark.asyncio
async def test_the_workflow_without_the_endpoint_says_to_set_the_http_port(tok: Any) -> None:
    """openai_workflow needs ctx.openai_server; without it the error names agent.http_port."""
    with pytest.raises(ValueError, match="agent.http_port"):
        await openai_workflow(calculator_agent)(ScriptedClient(tok, []), ROW, context(tok, None))


@pytest.mark.asyncio
async def test_a_real_tiny_model_answers_a_chat_call_end_to_end(tmp_path: Any) -> None:
    """openai client -> endpoint -> EngineClient -> LocalEngine: the reply is the decoded sample and
    the episode holds the engine's ids, log-probs and versions."""
    from areal_async.engines.local import LocalEngine

    path = build_tiny_model(tmp_path / "tiny", seed=0, max_positions=256)
    tok = build_tokenizer("char")
    async with LocalEngine(path) as engine, serving(EngineClient(engine), tok) as server:
        async with openai.AsyncOpenAI(base_url=server.base_url("ep-real"), api_key="x", max_retries=0) as llm:
            reply = await llm.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "2+2?"}], max_tokens=12, temperature=0
            )
        [call] = server.recorder.calls("ep-real")
        episode = server.recorder.finish("ep-real", 1.0)
    ids = call.result.token_ids
    content = tok.decode(
        ids[:-1] if reply.choices[0].finish_reason == "stop" else ids, skip_special_tokens=True
    )
    assert reply.choices[0].message.content == content
    assert reply.usage is not None and reply.usage.completion_tokens == len(ids) <= 12
    assert list(episode.model_turns[0].token_ids) == ids and episode.model_turns[0].versions == (0,) * len(
        ids
    )
    assert list(episode.model_turns[0].logprobs) == call.result.logprobs and all(
        x <= 0 for x in call.result.logprobs
    )
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert episode.prompt_ids == tok(prompt, add_special_tokens=False)["input_ids"]
