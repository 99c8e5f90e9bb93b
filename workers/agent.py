"""Agent worker: prompt tasks in, scored groups of multi-turn episodes out.

Data flow: controller --prompt--> agent --generate (request/reply)--> generation;
agent --rollout.scored / eval.scored--> trainer / controller.

Used when ``rollout.workflow`` is not ``single_turn``. Replicas share the ``generation`` durable
pull consumer of the prompt stream, so any number of agent workers split the tasks and may join
or leave at will. For a task the worker runs the workflow (``areal_async.agents``) once per sample
of the group (``rollout.group_size`` episodes, sampled; one greedy episode for an eval task), all
concurrently on anyio, at most ``agent.concurrency`` episodes per worker. Each model call goes to
the generation workers as a ``GenerateCall`` over NATS request/reply on a queue group, so calls
spread over every generation worker and none needs to know the agents; a call that times out or
finds no worker is retried (``agent.call_attempts``). Tools and reward functions run here, on
the agent's node (reward functions in a process pool with ``reward.timeout_s``).

An episode becomes one ``Completion``: every token after the opening prompt, with ``loss_mask``
1 on the model's tokens only (docs/design.md section 4). The group's ``head_version`` is the
oldest version among its trained tokens, and the controller's admission and the trainer's guard
apply to it as to any group. The episode reward (per-turn rewards, discounted by ``agent.gamma``)
is the completion's reward; the worker publishes the ``ScoredGroup`` itself.

Guarantees, as for single-turn groups: the scored group is published (``Nats-Msg-Id =
task_id:attempt``) before the task is acked, so a worker killed mid-episode loses nothing (the
task is redelivered; its partial episodes are never trained). A task whose workflow raises is
dead-lettered and reported ``filtered`` (its prompt is not tried again); a task whose calls find
no generation worker is handed back (nak) and tried again later.

Run alone: areal-worker --role agent --config configs/agent_cpu.yaml
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import anyio
import structlog

from areal_async.agents import Episode, WorkflowContext, make_tools, resolve_workflow
from areal_async.engines.base import GenerationResult, SamplingParams
from areal_async.errors import ConfigError
from areal_async.rewards import RewardPool
from bus import Bus, BusError, NoResponders, PayloadTooLarge
from bus.events import (
    Completion,
    GenerateCall,
    GenerateReply,
    PromptTask,
    RolloutFailed,
    ScoredGroup,
    pack_f32,
    pack_i32,
    pack_u8,
    unpack_f32,
    unpack_i32,
)
from bus.state import RunState
from bus.subjects import Streams
from workers.common import check_issued, resolve_model_path, run_sampling, run_tokenizer, task_group
from workers.runtime import WorkerContext

log = structlog.get_logger()

IN_PROGRESS_EVERY_S = 20.0


class CallsFailed(RuntimeError):
    """Every attempt of a generation call failed: no generation worker answered in time."""


class BusClient:
    """An ``InferenceClient`` whose calls go to the generation workers over the bus."""

    def __init__(self, bus: Bus, *, worker_id: str, timeout_s: float, attempts: int) -> None:
        self.bus = bus
        self.timeout_s = timeout_s
        self.attempts = attempts
        self._ids = (f"{worker_id}-{n}" for n in itertools.count())
        self.calls = 0
        self.retries = 0
        self.bus_s = 0.0
        """Seconds of answered calls not spent in a generation worker (round trip - reply.seconds)."""

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, episode_id: str = "") -> Any:
        last = ""
        for attempt in range(self.attempts):
            call = GenerateCall(
                call_id=next(self._ids),
                episode_id=episode_id,
                prompt_ids=pack_i32(prompt_ids),
                max_new_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                stop_token_ids=list(sampling.stop_token_ids),
                seed=sampling.seed,
            )
            sent = time.monotonic()
            try:
                reply = await self.bus.request(self.bus.subjects.generate, call, timeout_s=self.timeout_s)
            except (TimeoutError, NoResponders) as exc:
                last = str(exc)
                self.retries += 1
                # No worker yet (start-up) is routine; a call that timed out lost its worker.
                report = log.info if isinstance(exc, NoResponders) else log.warning
                report("generation call failed; retrying", attempt=attempt + 1, error=last)
                await anyio.sleep(min(5.0, 0.5 * 2**attempt))
                continue
            self.calls += 1
            if not isinstance(reply, GenerateReply) or reply.call_id != call.call_id:
                raise ValueError(f"unexpected reply to generation call {call.call_id}: {reply!r:.200}")
            if reply.error:
                raise ValueError(f"generation worker {reply.engine_id} refused the call: {reply.error}")
            self.bus_s += max(0.0, time.monotonic() - sent - reply.seconds)
            return GenerationResult(
                request_id=call.call_id,
                prompt_ids=tuple(prompt_ids),
                token_ids=tuple(int(t) for t in unpack_i32(reply.token_ids, "token_ids")),
                logprobs=tuple(float(x) for x in unpack_f32(reply.logprobs, "logprobs")),
                versions=tuple(int(v) for v in unpack_i32(reply.versions, "versions")),
                finish_reason=reply.finish_reason,
            )
        raise CallsFailed(f"{self.attempts} attempts of a generation call failed; last: {last}")


def episode_completion(episode: Episode) -> Completion:
    """The episode's tokens after its opening prompt as one completion, masked to the model's tokens.

    Tokens the model did not generate carry logprob 0.0 and the version of the model token before
    them (of the first model token when none precedes), so versions never decrease.
    """
    start = len(episode.prompt_ids)
    tokens = episode.token_ids[start:]
    mask = episode.loss_mask[start:]
    logprobs = episode.logprobs[start:]
    raw = episode.versions[start:]
    if not any(mask):
        raise ValueError("the episode holds no model token (did the prompt fill the context?)")
    current = next(v for v, m in zip(raw, mask, strict=True) if m)
    versions = []
    for v, m in zip(raw, mask, strict=True):
        current = v if m else current
        versions.append(current)
    finish = episode.turns[-1].finish_reason or "stop"
    text = "\n".join(t.text for t in episode.model_turns)
    return Completion(
        token_ids=pack_i32(tokens),
        logprobs=pack_f32([lp if m else 0.0 for lp, m in zip(logprobs, mask, strict=True)]),
        versions=pack_i32(versions),
        finish_reason=finish,
        text=text,
        loss_mask=pack_u8(mask),
    )


def episode_stats(episodes: list[Episode]) -> dict[str, float]:
    """Per-group means the controller reports for evaluation (``eval/episode/...``) and logs show."""
    n = max(1, len(episodes))
    model_turns = [len(e.model_turns) for e in episodes]
    first = [float(e.model_turns[0].reward > 0.5) if e.model_turns else 0.0 for e in episodes]
    calls = [sum(t.text.count("<tool_call>") for t in e.model_turns) for e in episodes]
    # tool_use records the calls it ran and those that failed; a call that ran without error was
    # well formed (closed block, JSON, a known tool, arguments that fit) and gave a result
    ran_ok = [e.info.get("tool_calls", 0) - e.info.get("tool_errors", 0) for e in episodes]
    return {
        "episode/turns": sum(model_turns) / n,
        "episode/first_try": sum(first) / n,
        "episode/tool_calls": sum(calls) / n,
        "episode/tool_use_rate": sum(c > 0 for c in calls) / n,
        "episode/tool_ok_rate": sum(ok > 0 for ok in ran_ok) / n,
    }


class Agent:
    def __init__(self, ctx: WorkerContext, tokenizer: Any, pool: RewardPool) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.bus = ctx.bus
        self.run_state = RunState(ctx.bus)
        self.tokenizer = tokenizer
        self.pool = pool
        self.workflow = resolve_workflow(self.cfg.rollout.workflow)
        a = self.cfg.agent
        self.client = BusClient(
            ctx.bus, worker_id=ctx.worker_id, timeout_s=a.call_timeout_s, attempts=a.call_attempts
        )
        self.episodes = anyio.CapacityLimiter(a.concurrency)
        # Tasks held at once: enough to keep ``concurrency`` episodes busy, not the whole queue, so
        # other agent workers get their share.
        self.tasks = anyio.CapacityLimiter(max(1, 2 * a.concurrency // self.cfg.rollout.group_size))
        self.tools = make_tools(a.tools, a.tool_timeout_s)
        self.train_sampling, self.eval_sampling = run_sampling(self.cfg, tokenizer)
        self.tasks_done = 0
        self.openai_server: Any = None
        """The OpenAI-compatible endpoint (``agent.http_port``), for ``openai_workflow`` agents."""

    async def reward(self, text: str, row: dict[str, Any]) -> float:
        """The reward pool's score; its errors (timeouts, crashes) raise, so the workflow records them
        in the episode's ``reward_errors`` and scores 0."""
        [outcome] = await self.pool.score([text], row)
        if outcome.error:
            raise RuntimeError(outcome.error)
        return float(outcome.reward)

    def context(self, kind: str, index: int) -> WorkflowContext:
        a, m = self.cfg.agent, self.cfg.model
        extra = {"feedback": a.feedback} if a.feedback is not None else {}
        return WorkflowContext(
            tokenizer=self.tokenizer,
            sampling=self.eval_sampling if kind == "eval" else self.train_sampling,
            max_turns=a.max_turns,
            tools=self.tools,
            reward_fn=self.reward,
            group_index=index,
            gamma=a.gamma,
            system_prompt=m.system_prompt,
            tool_timeout_s=a.tool_timeout_s,
            max_context_tokens=_context_limit(self.tokenizer),
            openai_server=self.openai_server,
            **extra,
        )

    async def task_loop(self, tg: anyio.abc.TaskGroup) -> None:
        async for delivery in self.bus.consume(Streams.PROMPT, batch=1):
            try:
                await check_issued(self.run_state, delivery.event)
            except ValueError as exc:  # the poison-message rule: this event, not the worker
                await delivery.dead_letter(f"prompt rejected: {exc}"[:2000])
                continue
            await self.tasks.acquire_on_behalf_of(delivery)
            tg.start_soon(self.handle_held, delivery)

    async def handle_held(self, delivery: Any) -> None:
        try:
            async with self.ctx.working("running episodes"):
                await self.handle(delivery)
            self.ctx.progressed()
        finally:
            self.tasks.release_on_behalf_of(delivery)

    async def handle(self, delivery: Any) -> None:
        task: PromptTask = delivery.event
        n = 1 if task.kind == "eval" else self.cfg.rollout.group_size
        started = time.monotonic()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_keep_alive, delivery)
                episodes: list[Episode | None] = [None] * n

                async def run(i: int) -> None:
                    async with self.episodes:
                        episodes[i] = await run_episode(
                            self.workflow,
                            self.client,
                            dict(task.row),
                            self.context(task.kind, i),
                            timeout_s=self.cfg.agent.episode_timeout_s,
                        )

                async with anyio.create_task_group() as runs:
                    for i in range(n):
                        runs.start_soon(run, i)
                tg.cancel_scope.cancel()
            done = [e for e in episodes if e is not None]
            scored = self.scored_group(task, done, time.monotonic() - started)
        except Exception as exc:  # the task group wraps what an episode raised
            cause = _first_cause(exc)
            if isinstance(cause, CallsFailed):
                log.warning(
                    "no generation worker answered; task handed back", task_id=task.task_id, error=str(cause)
                )
                await delivery.nak(delay=5.0)
            elif isinstance(cause, BusError):
                raise  # the bus, not the task: the worker restarts and the task is redelivered
            else:
                await self.give_up(delivery, task, cause)
            return
        subject = self.bus.subjects.eval_scored if task.kind == "eval" else self.bus.subjects.rollout_scored
        try:
            await self.bus.publish(
                subject,
                scored,
                msg_id=f"{task.task_id}:{task.attempt}",
                policy_version=scored.group.head_version,
            )
        except PayloadTooLarge as exc:  # this task's episodes, not the worker: give it up
            await self.give_up(delivery, task, exc)
            return
        await delivery.ack()
        self.tasks_done += 1
        self.ctx.load = {
            "tasks_done": float(self.tasks_done),
            "calls": float(self.client.calls),
            "bus_s": self.client.bus_s,
        }
        log.info(
            "episodes done",
            task_id=task.task_id,
            kind=task.kind,
            reward_mean=round(sum(scored.rewards) / len(scored.rewards), 3),
            seconds=round(scored.group.timings["generate_s"], 2),
            head_version=scored.group.head_version,
            **{
                k.split("/")[1]: round(v, 2)
                for k, v in scored.group.timings.items()
                if k.startswith("episode/")
            },
        )

    def scored_group(self, task: PromptTask, episodes: list[Episode], seconds: float) -> ScoredGroup:
        completions = [episode_completion(e) for e in episodes]
        prompts = {tuple(e.prompt_ids) for e in episodes}
        if len(prompts) != 1:
            raise ValueError(
                "the episodes of one task started from different prompts; a workflow must render the row alike"
            )
        errors = [";".join(e.info.get("reward_errors", [])) for e in episodes]
        group = task_group(
            task,
            self.ctx.worker_id,
            list(prompts.pop()),
            completions,
            head_version=min(e.head_version for e in episodes),
            tail_version=max(e.tail_version for e in episodes),
            seconds=seconds,
            stats=episode_stats(episodes),
        )
        return ScoredGroup(
            group=group, rewards=[float(e.reward) for e in episodes], reward_errors=errors, reward_seconds=0.0
        )

    async def give_up(self, delivery: Any, task: PromptTask, exc: BaseException) -> None:
        """The workflow failed on this task: dead-letter it and tell the controller, which does not
        retry it (a training task) or counts it as wrong (an evaluation task)."""
        reason = f"workflow {self.cfg.rollout.workflow} failed: {type(exc).__name__}: {exc}"[:2000]
        log.error("task dead-lettered", task_id=task.task_id, reason=reason)
        await self.bus.publish(
            self.bus.subjects.rollout_failed,
            RolloutFailed(
                task_id=task.task_id,
                kind=task.kind,
                index=task.index,
                epoch=task.epoch,
                attempt=task.attempt,
                reason="filtered",
                detail=reason,
            ),
            msg_id=f"{task.task_id}:{task.attempt}:filtered",
        )
        await delivery.dead_letter(reason)


class EpisodeTimeout(Exception):
    """An episode (user workflow code) ran past ``agent.episode_timeout_s``; its task fails."""


async def run_episode(
    workflow: Any, client: Any, row: dict[str, Any], ctx: Any, *, timeout_s: float
) -> Episode:
    """One episode of `workflow`, cut at `timeout_s`: user code that never returns fails its task
    with the reason (``EpisodeTimeout``) instead of holding the worker."""
    with anyio.move_on_after(timeout_s):
        return await workflow(client, row, ctx)
    raise EpisodeTimeout(f"episode {ctx.group_index} passed agent.episode_timeout_s={timeout_s:g}")


def _first_cause(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _context_limit(tokenizer: Any) -> int | None:
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and limit < 10**7 else None


async def _keep_alive(delivery: Any) -> None:
    while True:
        await anyio.sleep(IN_PROGRESS_EVERY_S)
        await delivery.in_progress()


async def serve(ctx: WorkerContext) -> None:
    cfg = ctx.cfg
    if not cfg.uses_agents:
        raise ConfigError(
            "rollout.workflow is 'single_turn': generation workers take the prompts themselves and an agent "
            "worker would compete with them; set rollout.workflow (multi_turn, tool_use, package.module:fn)"
        )
    simulated = cfg.rollout.engine == "simulated"
    tokenizer = run_tokenizer(cfg, "" if simulated else resolve_model_path(cfg.model.path))
    async with RewardPool(
        cfg.reward.fn, num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s
    ) as pool:
        agent = Agent(ctx, tokenizer, pool)
        ctx.set_status("ready")
        log.info("agent ready", workflow=cfg.rollout.workflow, tools=[t.name for t in agent.tools])
        async with anyio.create_task_group() as tg:
            if cfg.agent.http_port is not None:
                from areal_async.agents import EpisodeRecorder, OpenAIServer

                server = OpenAIServer(
                    agent.client, tokenizer, model_name=cfg.name, recorder=EpisodeRecorder(tokenizer)
                )
                port = await tg.start(server.serve, cfg.agent.http_host, cfg.agent.http_port)
                agent.openai_server = server
                log.info("openai endpoint listening", url=f"http://{cfg.agent.http_host}:{port}/v1")
            await agent.task_loop(tg)
