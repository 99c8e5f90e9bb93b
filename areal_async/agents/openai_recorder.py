"""Recording the chat calls of agent episodes and turning them into one ``Episode`` without drift.

Every chat call is recorded under its episode id with its prompt token ids and its
``GenerationResult`` (ids, log-probs, policy versions). The prompt of a call is built so that
the model's own tokens are reused exactly: per episode the recorder keeps chains, each a
``ChatSession`` plus the OpenAI messages it represents. A call whose messages extend a chain's
(the same earlier messages, by ``message_key``; the assistant messages equal what the endpoint
replied, text and tool calls; only new user / tool / system messages after them) appends just
the new messages to that session (``ChatSession.add_messages``: the chat template's delta).
Any other call (edited history, a different ``tools`` list, a branch from an earlier point)
starts a new chain whose prompt is rendered from the messages as text.

``finish(episode_id, reward)`` ends the episode and returns one ``Episode``: its turns are the
first call's prompt, then per call the model's tokens, and between two calls the tokens the
later prompt adds after the earlier prompt + completion (a ``tool`` turn when the new messages
were all tool results, else ``user``). This needs every call's prompt ids to extend the
previous call's prompt + completion, checked token by token; otherwise finish raises ValueError
("calls of episode X do not extend each other (call k)..."). Exporting such an episode as
several sequences is not supported, so a trained agent must keep one conversation per episode
and ask for one sample per call (``n`` > 1 records n calls from one prompt, which never chain).
The reward goes on the last model turn.

Episodes are opened by ``open()`` (the ``openai_workflow`` does, with its client and sampling)
or by their first call. Finished episodes stay refused (``UnknownEpisode``) for later calls.
An episode without calls in flight that sees no call and is not finished for ``ttl_s`` is
dropped, and so is a finished one nobody took; both are logged (``episode dropped``).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import structlog

from areal_async.agents.client import ChatSession, InferenceClient
from areal_async.agents.episode import Episode, Turn
from areal_async.agents.openai_messages import InvalidRequest, assistant_reply, message_key, session_messages
from areal_async.agents.tools import Tool
from areal_async.engines.base import GenerationResult, SamplingParams
from areal_async.errors import AreaLError

log = structlog.get_logger(__name__)

DEFAULT_TTL_S = 1800.0
MAX_CLOSED_IDS = 10_000


class UnknownEpisode(AreaLError, LookupError):
    """The episode id was finished or dropped (or never opened, where opening is needed)."""


@dataclass(frozen=True, kw_only=True)
class CallRecord:
    """One sampled completion of an episode: the prompt it completed and what the engine returned."""

    prompt_ids: tuple[int, ...]
    result: GenerationResult
    context_role: str
    """Role of the context turn that precedes this call's model tokens (``user`` or ``tool``)."""
    text: str
    """The model's text, decoded for reading and for the reward function."""


@dataclass(frozen=True, kw_only=True)
class Choice:
    """One answer of a chat call: the OpenAI ``message`` and ``finish_reason``, and its tokens."""

    message: dict[str, Any]
    finish_reason: str
    result: GenerationResult


@dataclass(kw_only=True)
class _Chain:
    session: ChatSession
    keys: list[tuple[Any, ...]]
    tools_key: str
    tool_names: dict[str, str]
    busy: bool = True


@dataclass(kw_only=True)
class _EpisodeState:
    client: InferenceClient | None
    sampling: SamplingParams | None
    gamma: float
    group_index: int
    active_at: float
    calls: list[CallRecord] = field(default_factory=list)
    chains: list[_Chain] = field(default_factory=list)
    in_flight: int = 0
    failure: Exception | None = None


class EpisodeRecorder:
    """The calls of every open episode (module docstring); one per endpoint."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        sampling: SamplingParams | None = None,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s!r}")
        self.tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        self.sampling = sampling or SamplingParams(stop_token_ids=(eos,) if eos is not None else ())
        """Sampling of episodes opened without their own (request fields override it per call)."""
        self.ttl_s = ttl_s
        self._clock = clock
        self._episodes: dict[str, _EpisodeState] = {}
        self._results: dict[str, tuple[float, Episode | ValueError]] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()

    # ---- lifecycle ----------------------------------------------------------------------------

    def open(
        self,
        episode_id: str | None = None,
        *,
        client: InferenceClient | None = None,
        sampling: SamplingParams | None = None,
        gamma: float = 1.0,
        group_index: int = 0,
    ) -> str:
        """Start an episode (a fresh id when None); its calls use ``client`` and ``sampling`` when given."""
        self._sweep()
        episode_id = episode_id or uuid.uuid4().hex
        if episode_id in self._episodes or episode_id in self._closed:
            raise ValueError(f"episode {episode_id!r} was already used; every episode needs a new id")
        self._episodes[episode_id] = _EpisodeState(
            client=client, sampling=sampling, gamma=gamma, group_index=group_index, active_at=self._clock()
        )
        return episode_id

    def finish(self, episode_id: str, reward: float) -> Episode:
        """End the episode; its calls as one ``Episode`` with ``reward`` on the last model turn."""
        if not isinstance(reward, int | float) or isinstance(reward, bool) or not math.isfinite(reward):
            raise ValueError(f"reward of episode {episode_id!r} must be a finite number, got {reward!r}")
        state = self._pop(episode_id, "finished")
        return self._episode(episode_id, state, float(reward))

    def post_reward(self, episode_id: str, reward: float) -> Episode:
        """``finish`` on behalf of the agent (``POST .../reward``); ``take`` hands the result over."""
        self._sweep()
        try:
            episode: Episode | ValueError = self.finish(episode_id, reward)
        except UnknownEpisode:
            raise
        except ValueError as exc:
            self._results[episode_id] = (self._clock(), exc)
            raise
        self._results[episode_id] = (self._clock(), episode)
        return episode

    def take(self, episode_id: str) -> Episode | None:
        """The episode a posted reward finished (its error raised again); None when none was posted."""
        _, outcome = self._results.pop(episode_id, (0.0, None))
        if isinstance(outcome, ValueError):
            raise outcome
        return outcome

    def discard(self, episode_id: str) -> None:
        """Forget an episode that is open or awaits ``take`` (its workflow failed)."""
        if self._episodes.pop(episode_id, None) is not None or self._results.pop(episode_id, None):
            self._remember_closed(episode_id, "discarded")

    def calls(self, episode_id: str) -> list[CallRecord]:
        """The calls recorded so far for an open episode."""
        return list(self._state(episode_id).calls)

    def is_closed(self, episode_id: str) -> str | None:
        """Why the episode no longer takes calls (``finished``, ``dropped ...``); None while it may."""
        return self._closed.get(episode_id)

    def failure(self, episode_id: str) -> Exception | None:
        """The last error of the inference client in this open episode (None when there was none)."""
        state = self._episodes.get(episode_id)
        return state.failure if state is not None else None

    def last_answer(self, episode_id: str) -> str:
        """The text of the episode's last model turn ("" before any call)."""
        calls = self._state(episode_id).calls
        return calls[-1].text if calls else ""

    # ---- calls --------------------------------------------------------------------------------

    async def chat(
        self,
        episode_id: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Tool] = (),
        overrides: Mapping[str, Any] | None = None,
        stop_ids: Sequence[int] = (),
        n: int = 1,
        client: InferenceClient | None = None,
    ) -> tuple[list[int], list[Choice]]:
        """Sample ``n`` answers to normalized ``messages``; returns the prompt ids and the choices.

        ``overrides`` replace fields of the episode's ``SamplingParams``; ``stop_ids`` add to its stops.
        The episode's own client (from ``open``) is used, else ``client``.
        """
        self._sweep()
        state = self._episodes.get(episode_id)
        if state is None:
            if episode_id in self._closed:
                raise UnknownEpisode(self._unknown(episode_id))
            self.open(episode_id)
            state = self._episodes[episode_id]
        client = state.client or client
        if client is None:
            raise ValueError(f"episode {episode_id!r} has no inference client; pass client= to open()")
        base = state.sampling or self.sampling
        stops = tuple(dict.fromkeys((*base.stop_token_ids, *stop_ids)))
        sampling = replace(base, **dict(overrides or {}), stop_token_ids=stops)
        chain, role = self._claim(state, messages, tools)
        prompt = chain.session.token_ids
        state.in_flight += 1
        try:
            results = await _sample(client, prompt, sampling, n)
        except BaseException as exc:
            state.chains.remove(chain)  # its session holds the new messages but no model turn
            if isinstance(exc, Exception):
                state.failure = exc
            raise
        finally:
            state.in_flight -= 1
            state.active_at = self._clock()
        choices = []
        for result in results:
            ids = list(result.token_ids)
            content = self._decode(ids[:-1] if result.finish_reason == "stop" else ids)
            call_ids = f"call_{len(state.calls)}"
            message, finish = assistant_reply(content, result.finish_reason, tools, call_ids=call_ids)
            choices.append(Choice(message=message, finish_reason=finish, result=result))
            record = CallRecord(
                prompt_ids=tuple(prompt), result=result, context_role=role, text=self._decode(ids)
            )
            state.calls.append(record)
        chain.session.add_model_turn(results[0])
        chain.keys.append(message_key(choices[0].message))
        chain.tool_names.update(_tool_names([choices[0].message]))
        chain.busy = False
        return prompt, choices

    def _claim(
        self, state: _EpisodeState, messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool]
    ) -> tuple[_Chain, str]:
        """The chain this call continues (its new messages appended), or a new one; and the turn role."""
        keys = [message_key(m) for m in messages]
        tools_key = json.dumps([tool.schema() for tool in tools], sort_keys=True)
        try:
            for chain in reversed(state.chains):
                known = len(chain.keys)
                new = messages[known:]
                if (
                    chain.busy
                    or chain.tools_key != tools_key
                    or keys[:known] != chain.keys
                    or not new
                    or any(m["role"] == "assistant" for m in new)
                ):
                    continue
                turn = chain.session.add_messages(session_messages(new, chain.tool_names))
                chain.keys, chain.busy = keys, True
                return chain, turn.role
            names = _tool_names(messages)
            session = ChatSession(self.tokenizer, session_messages(messages, names), tools=tools)
        except ValueError as exc:  # ChatTemplateError included
            raise InvalidRequest(
                f"the chat template cannot render these messages: {exc}", param="messages"
            ) from exc
        chain = _Chain(session=session, keys=keys, tools_key=tools_key, tool_names=names)
        state.chains.append(chain)
        return chain, "user"

    # ---- the episode --------------------------------------------------------------------------

    def _episode(self, episode_id: str, state: _EpisodeState, reward: float) -> Episode:
        calls = state.calls
        if not calls:
            raise ValueError(
                f"episode {episode_id!r} made no chat calls; the agent must call the model through its base_url"
            )
        turns = [Turn(role="prompt", token_ids=calls[0].prompt_ids, text=self._decode(calls[0].prompt_ids))]
        for k, call in enumerate(calls):
            if k:
                before = (*calls[k - 1].prompt_ids, *calls[k - 1].result.token_ids)
                at = _first_difference(call.prompt_ids, before)
                if at is not None:
                    raise ValueError(
                        f"calls of episode {episode_id!r} do not extend each other (call {k}: its prompt "
                        f"leaves call {k - 1}'s prompt + completion at token {at}); export as separate "
                        "sequences is not supported: keep one conversation per episode, with n=1"
                    )
                added = call.prompt_ids[len(before) :]
                if added:
                    turns.append(Turn(role=call.context_role, token_ids=added, text=self._decode(added)))  # type: ignore[arg-type]
            turns.append(Turn.from_result(call.result, text=call.text))
        turns[-1] = turns[-1].with_reward(reward)
        info = {"episode_id": episode_id, "calls": len(calls)}
        return Episode(
            turns=tuple(turns),
            gamma=state.gamma,
            group_index=state.group_index,
            stop_reason="answer",
            info=info,
        )

    # ---- bookkeeping --------------------------------------------------------------------------

    def _state(self, episode_id: str) -> _EpisodeState:
        state = self._episodes.get(episode_id)
        if state is None:
            raise UnknownEpisode(self._unknown(episode_id))
        return state

    def _pop(self, episode_id: str, reason: str) -> _EpisodeState:
        state = self._state(episode_id)
        del self._episodes[episode_id]
        self._remember_closed(episode_id, reason)
        return state

    def _unknown(self, episode_id: str) -> str:
        if episode_id in self._closed:
            return f"episode {episode_id!r} was {self._closed[episode_id]}; start a new episode id"
        return f"unknown episode {episode_id!r}; it has no calls yet (open it or call the model first)"

    def _remember_closed(self, episode_id: str, reason: str) -> None:
        self._closed[episode_id] = reason
        self._closed.move_to_end(episode_id)
        while len(self._closed) > MAX_CLOSED_IDS:
            self._closed.popitem(last=False)

    def _sweep(self) -> None:
        now = self._clock()
        for episode_id, state in list(self._episodes.items()):
            idle_s = now - state.active_at
            if state.in_flight == 0 and idle_s > self.ttl_s:
                del self._episodes[episode_id]
                self._remember_closed(
                    episode_id, f"dropped after {self.ttl_s:g} s without a call or a reward"
                )
                log.warning(
                    "episode dropped",
                    episode_id=episode_id,
                    calls=len(state.calls),
                    idle_s=round(idle_s, 1),
                    ttl_s=self.ttl_s,
                    reason="not finished",
                )
        for episode_id, (finished_at, _) in list(self._results.items()):
            if now - finished_at > self.ttl_s:
                del self._results[episode_id]
                log.warning(
                    "episode dropped",
                    episode_id=episode_id,
                    ttl_s=self.ttl_s,
                    reason="reward posted, never taken",
                )

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))


async def _sample(
    client: InferenceClient, prompt: list[int], sampling: SamplingParams, n: int
) -> list[GenerationResult]:
    if n == 1:
        return [await client.generate(list(prompt), sampling)]
    results: list[GenerationResult | None] = [None] * n

    async def one(i: int) -> None:
        seeded = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i)
        results[i] = await client.generate(list(prompt), seeded)

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    return [r for r in results if r is not None]


def _tool_names(messages: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """tool_call_id -> function name over the assistant messages (normalized or reply form)."""
    names = {}
    for m in messages:
        if m["role"] == "assistant":
            for call in m.get("tool_calls") or ():
                names[call["id"]] = call["function"]["name"] if "function" in call else call["name"]
    return names


def _first_difference(prompt: Sequence[int], before: Sequence[int]) -> int | None:
    """Where ``prompt`` stops extending ``before`` (None when it extends it)."""
    for i, token in enumerate(before):
        if i >= len(prompt) or prompt[i] != token:
            return i
    return None
