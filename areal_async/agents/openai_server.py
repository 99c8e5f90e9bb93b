"""The OpenAI-compatible endpoint through which existing ``openai``-based agent code is trained.

``OpenAIServer(client, tokenizer, model_name=, recorder=)`` serves, over ``http_server``:

- ``GET /v1/models`` (also under ``/episodes/<id>/v1/models``): the one model, ``model_name``.
- ``POST /episodes/<id>/v1/chat/completions``, so ``openai.AsyncOpenAI(base_url=server.base_url(id))``
  works unchanged; ``POST /v1/chat/completions`` with the header ``X-Areal-Episode: <id>`` too.
  Body fields: ``messages`` (``openai_messages``), ``temperature``, ``top_p``, ``max_tokens`` /
  ``max_completion_tokens``, ``stop`` (a string or a list; each must be exactly one token, which
  becomes a stop id), ``n`` (n samples, n engine calls), ``tools`` (function tools: given to the
  chat template when it renders ``tools=``, else described in the system message, as
  ``ChatSession`` does), ``seed`` (sample i gets ``seed + i``). Fields left out keep the episode's
  sampling (the workflow's ``ctx.sampling``); other fields (``model``, ``tool_choice``, ...) are
  ignored; ``stream: true`` is refused. The answer is a ``chat.completion`` object; tool calls
  the model wrote as ``<tool_call>`` blocks come back as OpenAI ``tool_calls``.
- ``POST /episodes/<id>/reward`` (or ``.../v1/reward``) with ``{"reward": <finite number>}``
  ends the episode (``EpisodeRecorder.post_reward``).

A bad field is answered 400 with ``{"error": {"message", "type": "invalid_request_error",
"param"}}``; the message names the field, the value and the fix. A finished or dropped episode
id is answered 404. Every call is recorded by the ``EpisodeRecorder`` (see there for how the
calls of an episode become one training ``Episode`` and what breaks that).

``openai_workflow(solve)`` turns ``async def solve(base_url: str, row: dict) -> float | None``
into a workflow (``rollout.workflow: mypkg.agent:run`` with ``run = openai_workflow(solve)``).
It needs the agent worker's endpoint (``agent.http_port``). Per episode it opens a fresh id with
the workflow's client and sampling, runs ``solve`` on ``server.base_url(id)`` and the row, and
ends the episode with the returned reward; with None, with the reward the agent posted, or
else with ``ctx.reward_fn`` applied to the text of the last model turn.
"""

from __future__ import annotations

import inspect
import itertools
import json
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any
from urllib.parse import unquote

import anyio
import structlog

from areal_async.agents.client import InferenceClient
from areal_async.agents.episode import Episode
from areal_async.agents.http_server import HttpRequest, HttpResponse, serve_http
from areal_async.agents.openai_messages import InvalidRequest, normalize_messages, parse_tools
from areal_async.agents.openai_recorder import EpisodeRecorder, UnknownEpisode
from areal_async.agents.workflows import Workflow, WorkflowContext, score

log = structlog.get_logger(__name__)

EPISODE_HEADER = "x-areal-episode"
MAX_SAMPLES = 16
_EPISODE_ID = re.compile(r"[A-Za-z0-9._:~-]{1,200}")

AgentFn = Callable[[str, dict[str, Any]], Awaitable[float | None]]


class OpenAIServer:
    """The endpoint (module docstring). ``serve`` runs it; ``base_url`` is what agent code gets."""

    def __init__(
        self, client: InferenceClient | None, tokenizer: Any, *, model_name: str, recorder: EpisodeRecorder
    ) -> None:
        self.client = client
        """Serves episodes opened without their own client (calls straight to the endpoint)."""
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.recorder = recorder
        self.host: str | None = None
        self.port: int | None = None
        self._ids = itertools.count()

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until cancelled; reports the bound port (``port=0``: any free port)."""
        async with anyio.create_task_group() as tg:
            self.port = await tg.start(serve_http, self.handle, host, port)
            self.host = host
            task_status.started(self.port)

    def base_url(self, episode_id: str) -> str:
        """``http://host:port/episodes/<id>/v1``: the ``base_url`` of an OpenAI client for one episode."""
        if self.port is None or self.host is None:
            raise RuntimeError("the OpenAI endpoint is not serving yet; start OpenAIServer.serve first")
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(self.host, self.host)
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"http://{host}:{self.port}/episodes/{episode_id}/v1"

    # ---- routes -------------------------------------------------------------------------------

    async def handle(self, request: HttpRequest) -> HttpResponse:
        """Route one request (module docstring); every failure is an OpenAI-style error response."""
        parts = [unquote(p) for p in request.path.strip("/").split("/")]
        episode_id = None
        if len(parts) >= 3 and parts[0] == "episodes":
            episode_id, parts = parts[1], parts[2:]
        route = "/".join(parts)
        try:
            if route == "v1/models":
                _method(request, "GET")
                return HttpResponse.json(200, self._models())
            if route == "v1/chat/completions":
                _method(request, "POST")
                episode_id = episode_id or request.headers.get(EPISODE_HEADER)
                if not episode_id:
                    raise InvalidRequest(
                        "no episode: POST to /episodes/<id>/v1/chat/completions or send the header "
                        "X-Areal-Episode: <id>",
                        param="X-Areal-Episode",
                    )
                return HttpResponse.json(200, await self._chat(_episode(episode_id), _body(request)))
            if route in ("reward", "v1/reward") and episode_id is not None:
                _method(request, "POST")
                return HttpResponse.json(200, self._reward(_episode(episode_id), _body(request)))
        except InvalidRequest as exc:
            return _error(400, str(exc), "invalid_request_error", exc.param)
        except _WrongMethod as exc:
            return _error(405, str(exc), "invalid_request_error", None)
        except UnknownEpisode as exc:
            return _error(404, str(exc), "not_found_error", "episode_id")
        except Exception as exc:  # the engine failed: say so, and keep the client from repeating the call
            log.warning("chat call failed", episode_id=episode_id, exc_info=exc)
            response = _error(500, f"generation failed: {type(exc).__name__}: {exc}", "server_error", None)
            response.headers["x-should-retry"] = "false"
            return response
        routes = "GET /v1/models, POST /episodes/<id>/v1/chat/completions, POST /episodes/<id>/reward"
        return _error(
            404, f"no route {request.method} {request.path}; routes: {routes}", "not_found_error", None
        )

    def _models(self) -> dict[str, Any]:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "areal-async"}
        return {"object": "list", "data": [model]}

    async def _chat(self, episode_id: str, body: dict[str, Any]) -> dict[str, Any]:
        messages = normalize_messages(body.get("messages"))
        tools = parse_tools(body.get("tools"))
        if body.get("stream"):
            raise InvalidRequest("stream=true is not supported; call without streaming", param="stream")
        overrides = _sampling_overrides(body)
        stop_ids = _stop_ids(self.tokenizer, body.get("stop"))
        n = _number(body, "n", int, low=1, high=MAX_SAMPLES)
        prompt, choices = await self.recorder.chat(
            episode_id,
            messages,
            tools=tools,
            overrides=overrides,
            stop_ids=stop_ids,
            n=n or 1,
            client=self.client,
        )
        completion_tokens = sum(len(c.result.token_ids) for c in choices)
        log.debug(
            "chat call", episode_id=episode_id, prompt_tokens=len(prompt), completion_tokens=completion_tokens
        )
        return {
            "id": f"chatcmpl-{episode_id}-{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {"index": i, "message": c.message, "logprobs": None, "finish_reason": c.finish_reason}
                for i, c in enumerate(choices)
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt) * len(choices) + completion_tokens,
            },
        }

    def _reward(self, episode_id: str, body: dict[str, Any]) -> dict[str, Any]:
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise InvalidRequest(
                f'reward must be a finite number, got {reward!r}; send {{"reward": 1.0}}', param="reward"
            )
        try:
            episode = self.recorder.post_reward(episode_id, float(reward))
        except UnknownEpisode:
            raise
        except ValueError as exc:
            raise InvalidRequest(str(exc), param=None) from exc
        return {
            "episode_id": episode_id,
            "reward": episode.reward,
            "turns": len(episode.turns),
            "tokens": len(episode),
        }


# ---- request fields ----------------------------------------------------------------------------


class _WrongMethod(Exception):
    pass


def _method(request: HttpRequest, method: str) -> None:
    if request.method != method:
        raise _WrongMethod(f"{request.method} {request.path} is not served; use {method}")


def _episode(episode_id: str) -> str:
    if not _EPISODE_ID.fullmatch(episode_id):
        raise InvalidRequest(
            f"episode id {episode_id[:60]!r} must be 1-200 characters of letters, digits and . _ : ~ -",
            param="episode_id",
        )
    return episode_id


def _body(request: HttpRequest) -> dict[str, Any]:
    try:
        body = json.loads(request.body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the body is not valid JSON ({exc}); send a JSON object", param=None) from exc
    if not isinstance(body, dict):
        raise InvalidRequest(f"the body must be a JSON object, got {type(body).__name__}", param=None)
    return body


def _number(body: dict[str, Any], name: str, kind: type, *, low: float, high: float = math.inf) -> Any:
    """``body[name]`` checked to be a ``kind`` in [low, high]; None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, int | float) if kind is float else isinstance(value, int)
    if isinstance(value, bool) or not ok or not math.isfinite(value) or not low <= value <= high:
        what = "an integer" if kind is int else "a number"
        bound = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
        raise InvalidRequest(f"{name} must be {what} {bound}, got {value!r}", param=name)
    return value


def _sampling_overrides(body: dict[str, Any]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if (temperature := _number(body, "temperature", float, low=0)) is not None:
        overrides["temperature"] = float(temperature)
    if (top_p := _number(body, "top_p", float, low=0, high=1)) is not None:
        if top_p == 0:
            raise InvalidRequest("top_p must be in (0, 1] (1 disables it), got 0", param="top_p")
        overrides["top_p"] = float(top_p)
    max_tokens = _number(body, "max_completion_tokens", int, low=1)
    max_tokens = max_tokens if max_tokens is not None else _number(body, "max_tokens", int, low=1)
    if max_tokens is not None:
        overrides["max_new_tokens"] = max_tokens
    if (seed := _number(body, "seed", int, low=0)) is not None:
        overrides["seed"] = seed
    return overrides


def _stop_ids(tokenizer: Any, stop: Any) -> list[int]:
    if stop is None:
        return []
    texts = [stop] if isinstance(stop, str) else stop
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise InvalidRequest(f"stop must be a string or a list of strings, got {stop!r}", param="stop")
    ids = []
    for text in texts:
        encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            eos = getattr(tokenizer, "eos_token", None)
            raise InvalidRequest(
                f"stop {text!r} is {len(encoded)} tokens; this endpoint stops only at single tokens: give "
                f"stop strings that are one token each (e.g. {eos!r}) or leave stop out",
                param="stop",
            )
        ids.append(int(encoded[0]))
    return ids


def _error(status: int, message: str, kind: str, param: str | None) -> HttpResponse:
    return HttpResponse.json(
        status, {"error": {"message": message, "type": kind, "param": param, "code": None}}
    )


# ---- workflow adapter --------------------------------------------------------------------------


def openai_workflow(agent_fn: AgentFn) -> Workflow:
    """A workflow running ``async def agent_fn(base_url, row) -> float | None`` (module docstring)."""
    if not inspect.iscoroutinefunction(agent_fn):
        raise ValueError(
            f"openai_workflow needs an async function 'async def solve(base_url: str, row: dict) -> "
            f"float | None', got {agent_fn!r}"
        )
    name = getattr(agent_fn, "__qualname__", repr(agent_fn))

    async def run(client: InferenceClient, row: dict[str, Any], ctx: WorkflowContext) -> Episode:
        server = ctx.openai_server
        if server is None:
            raise ValueError(
                f"workflow around {name} needs the agent worker's OpenAI endpoint; set agent.http_port "
                "in the run config (0 picks a free port)"
            )
        recorder: EpisodeRecorder = server.recorder
        episode_id = recorder.open(
            client=client, sampling=ctx.sampling_params, gamma=ctx.gamma or 1.0, group_index=ctx.group_index
        )
        try:
            try:
                reward = await agent_fn(server.base_url(episode_id), dict(row))
            except Exception as exc:  # a failed model call surfaces as itself, so the worker can act on it
                failure = recorder.failure(episode_id)
                if failure is not None and failure is not exc:
                    raise failure from exc
                raise
            posted = recorder.take(episode_id)
            if posted is not None:
                if reward is not None:
                    raise ValueError(
                        f"{name} posted a reward and returned {reward!r}; do one of the two (return None after posting)"
                    )
                return posted
            errors: list[str] = []
            if reward is None:
                if ctx.reward_fn is None:
                    raise ValueError(
                        f"{name} returned None and posted no reward to /episodes/<id>/reward, and no reward "
                        "function is set; return the reward, post it, or set reward.fn"
                    )
                reward = await score(ctx.reward_fn, recorder.last_answer(episode_id), row, errors)
            episode = recorder.finish(episode_id, reward)
        except BaseException:
            recorder.discard(episode_id)
            raise
        return replace(episode, info={**episode.info, "reward_errors": errors}) if errors else episode

    run.__doc__ = agent_fn.__doc__
    run.__qualname__ = run.__name__ = f"openai_workflow({name})"
    return run
