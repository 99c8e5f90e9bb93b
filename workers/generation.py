"""Generation worker: prompt tasks in, rollout groups out, weights swapped mid-flight.

Data flow: controller --prompt--> generation --rollout.generated--> reward;
weight-sync --weights.load--> generation --weights.loaded--> weight-sync.

Replicas share the ``generation`` durable pull consumer, so N workers split the tasks;
a worker takes a task only when it has room for its completions (backpressure). For a
training task it samples ``rollout.group_size`` completions with the run's sampling
parameters; for an eval task one greedy completion. Every completion token carries the
policy version that produced it; the group's ``head_version`` is the oldest token version.

``weights.load`` interrupts decoding at the next step, swaps the weights, and resumes
every request from prompt + tokens so far (the engine's contract); the worker then
answers ``weights.loaded``. A worker that joins a running run first loads the version
the others serve. With ``weight_sync.transport: bus`` every load, a joining or restarted
worker's included, rebuilds the version from the run's weights bucket and checks its digest
(``workers/weight_bus.py``); a local engine takes the tensors as they are, a vLLM engine's servers
receive them from this worker over gloo (``ServerRelay``, ``workers/weight_memory.py``). When
either step fails the worker loads the disk copy if it has one, logging why.

Agents: every worker also answers ``generate`` requests (``GenerateCall`` -> ``GenerateReply``,
core NATS request/reply, queue group ``generation``: one worker answers each call). With a
workflow other than ``single_turn`` the ``agent`` workers take the prompt tasks and this worker
only answers their calls. A task or call that fails validation (not issued, unrenderable, bad
sampling values) is dead-lettered or answered with its error; the worker goes on.

Guarantees: one RolloutGroup per task attempt, published with ``Nats-Msg-Id =
task_id:attempt`` before the task is acked, so a worker killed mid-task loses nothing
(the task is redelivered) and a retried publish is stored once.

Run alone: areal-worker --role generation --config configs/arith_cpu.yaml
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import structlog

from areal_async.data import render_prompt
from areal_async.engines.base import GenerationRequest, GenerationResult, InferenceEngine, SamplingParams
from areal_async.errors import ConfigError
from bus.events import (
    Completion,
    GenerateCall,
    GenerateReply,
    PromptTask,
    RolloutGroup,
    WeightsLoad,
    WeightsLoaded,
    pack_f32,
    pack_i32,
    unpack_i32,
)
from bus.state import WEIGHTS_SERVED, RunState, StateRecordError
from bus.subjects import Streams
from workers.common import (
    check_issued,
    checked_weights_path,
    resolve_model_path,
    run_sampling,
    run_tokenizer,
    task_group,
)
from workers.runtime import WorkerContext

log = structlog.get_logger()

IN_PROGRESS_EVERY_S = 20.0


def make_engine(ctx: WorkerContext, model_path: str) -> InferenceEngine:
    cfg = ctx.cfg
    if cfg.rollout.engine == "local":
        from areal_async.engines.local import LocalEngine
        from areal_async.models import set_torch_threads

        set_torch_threads(cfg.rollout.num_threads)
        return LocalEngine(
            model_path,
            device=cfg.rollout.device,
            dtype=cfg.model.dtype,
            max_batch_size=cfg.rollout.max_batch_size,
            engine_id=ctx.worker_id,
            seed=cfg.seed,
            cuda_graphs=cfg.rollout.cuda_graphs,
            compile=cfg.rollout.compile,
            kv_after_load=cfg.rollout.kv_after_load,
        )
    if cfg.rollout.engine == "vllm":
        # The servers were started on model_path (scripts/serve_vllm.sh); weight dirs must be readable there.
        from areal_async.engines.vllm import VLLMEngine

        return VLLMEngine(cfg.rollout.server_urls, engine_id=ctx.worker_id)
    if cfg.rollout.engine == "sglang":
        from areal_async.engines.sglang import SGLangEngine

        return SGLangEngine(cfg.rollout.server_urls, engine_id=ctx.worker_id)
    if cfg.rollout.engine == "simulated":
        from areal_async.engines.simulated import SimulatedEngine
        from areal_async.simulation.profile import load_profile

        flags_dir = cfg.run_dir / "sim"
        flags_dir.mkdir(parents=True, exist_ok=True)
        return SimulatedEngine(
            load_profile(cfg.simulation.profile),
            engine_id=ctx.worker_id,
            max_batch_size=cfg.rollout.max_batch_size,
            time_scale=cfg.simulation.time_scale,
            seed=cfg.seed,
            flags_dir=flags_dir,
            kv_after_load=cfg.rollout.kv_after_load,
            token_scale=cfg.simulation.token_scale,
        )
    raise ConfigError(
        f"rollout.engine={cfg.rollout.engine!r} is not available in this build; "
        "use rollout.engine=local, vllm, sglang or simulated"
    )


def engine_transports(engine: InferenceEngine, transport: str) -> list[str]:
    """The run's in-memory transport, if this engine can receive it: local engines on a GPU take
    ``cuda_ipc`` and ``nccl``, on the CPU ``gloo``; remote engines what their servers take
    (vLLM: ``gloo``, ``nccl``; SGLang: none, it reads the disk copy)."""
    if transport == "disk":
        return []
    kind = getattr(getattr(engine, "device", None), "type", None)  # local engines
    if kind is not None:
        usable: tuple[str, ...] = ("cuda_ipc", "nccl") if kind == "cuda" else ("gloo",)
    else:
        usable = tuple(getattr(engine, "group_transports", ()))
    return [transport] if transport in usable else []


async def wait_for_weights(location: Path, timeout_s: float) -> None:
    """Wait until a version's disk copy exists (the trainer writes ``<dir>.tmp`` and renames it, so
    the directory is whole once it is there); FileNotFoundError after ``timeout_s`` (0: look once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if await anyio.Path(location).is_dir():
            return
        if time.monotonic() >= deadline:
            break
        await anyio.sleep(0.05)
    raise FileNotFoundError(f"weights {location} did not appear within {timeout_s} s")


class Generator:
    def __init__(self, ctx: WorkerContext, engine: InferenceEngine, tokenizer: Any) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.bus = ctx.bus
        self.run_state = RunState(ctx.bus)
        self.engine = engine
        self.tokenizer = tokenizer
        self.train_sampling, self.eval_sampling = run_sampling(self.cfg, tokenizer)
        # Completions in flight, not tasks: an eval task (1 completion) costs less than a group.
        self.capacity = max(2 * self.cfg.rollout.max_batch_size, self.cfg.rollout.group_size)
        self.in_flight = 0
        self.room = anyio.Event()
        self.active = 0
        self.tasks_done = 0
        self.tokens_out = 0
        self.receiver: Any = None
        self.bus_reader: Any = None
        self.relay: Any = None
        if self.cfg.weight_sync.transport == "bus":
            from workers.weight_bus import BusWeightReader

            self.bus_reader = BusWeightReader(self.cfg, ctx.bus)
            if "gloo" in getattr(engine, "group_transports", ()):  # remote servers: one hop more
                from workers.weight_memory import ServerRelay, relay_host

                host = relay_host(self.cfg.rollout.server_urls)
                self.relay = ServerRelay(self.cfg, ctx.worker_id, host)
        transports = engine_transports(engine, self.cfg.weight_sync.transport)
        if transports:
            from workers.weight_memory import WeightReceiver

            self.receiver = WeightReceiver(self.cfg, getattr(engine, "device", "cpu"), ctx.worker_id)
            ctx.transports = transports
            ctx.transfer_ranks = int(getattr(engine, "group_ranks", 1))

    # ---- weights -------------------------------------------------------------------------

    async def load(self, version: int, path: str, offer: WeightsLoad | None = None) -> None:
        """Load ``version``: in memory when ``offer`` names this engine a member, else (or when
        that fails) from its disk copy at ``path``; report ``weights.loaded`` either way."""
        async with self.ctx.working("loading weights"):
            await self._load(version, path, offer)
        self.ctx.progressed()

    async def _load(self, version: int, path: str, offer: WeightsLoad | None) -> None:
        started = time.perf_counter()
        via, fallback, digest = "disk", "", ""
        try:
            location = checked_weights_path(self.cfg, path)
            if self.bus_reader is not None:
                try:
                    digest = await self._load_from_bus(version, str(location))
                    via = "bus"
                except Exception as exc:  # the disk copy of the same version, where this host has it
                    fallback = f"{type(exc).__name__}: {exc}"
                    log.warning("weights from the bus failed; loading the disk copy", error=fallback)
            elif offer is not None and self.receiver is not None:
                try:
                    if getattr(self.engine, "group_transports", ()):  # remote servers join the group
                        await self.receiver.receive_remote(self.engine, version, str(location), offer)
                    else:
                        tensors = await anyio.to_thread.run_sync(self.receiver.receive, offer)
                        await self.engine.load_weights(version, tensors)
                    via = offer.transfer.transport if offer.transfer else "disk"
                except Exception as exc:  # the disk copy of the same version
                    fallback = f"{type(exc).__name__}: {exc}"
                    log.warning("in-memory weight transfer failed; loading the disk copy", error=fallback)
                finally:
                    tensors = None
            if via == "disk":
                # Through the bus the disk copy, if any, was written before the version was announced.
                wait_s = 0.0 if self.bus_reader is not None else self.cfg.weight_sync.timeout_s
                await wait_for_weights(location, wait_s)
                await self.engine.load_weights(version, str(location))
            ok, error = True, ""
            seconds = time.perf_counter() - started
            checked = {"digest": digest} if digest else {}
            log.info("weights loaded", policy_version=version, via=via, seconds=round(seconds, 3), **checked)
        except Exception as exc:  # report, keep serving the old weights
            seconds, ok, error = 0.0, False, f"{type(exc).__name__}: {exc}"
            log.error("weights load failed", policy_version=version, path=path, error=error)
        self.ctx.policy_version = self.engine.version
        await self.bus.publish(
            self.bus.subjects.weights_loaded,
            WeightsLoaded(
                policy_version=self.engine.version if ok else version,
                engine_id=self.ctx.worker_id,
                ok=ok,
                error=error,
                seconds=seconds,
                via=via,
                fallback=fallback,
            ),
            policy_version=self.engine.version,
        )

    async def _load_from_bus(self, version: int, location: str) -> str:
        """Rebuild ``version`` from the weights bucket (verified) and load it; returns its digest."""
        tensors, digest = await self.bus_reader.fetch(version)
        if self.relay is None:
            await self.engine.load_weights(version, tensors)
        else:
            held = self.bus_reader.held
            await self.relay.load(self.engine, version, location, held.packed(), held.manifest)
        return digest

    async def catch_up(self) -> None:
        """A worker joining a running run serves what the others serve before taking tasks."""
        try:
            served = await self.run_state.weights(WEIGHTS_SERVED)
        except StateRecordError as exc:
            log.error("weights.served record unusable; serving the initial weights", error=str(exc))
            served = None
        if served and served.policy_version > self.engine.version:
            await self.load(served.policy_version, served.path)

    async def weights_listener(self) -> None:
        async for ev in self.bus.subscribe(self.bus.subjects.weights_load):
            if not isinstance(ev, WeightsLoad):
                continue
            if ev.engine_ids and self.ctx.worker_id not in ev.engine_ids:
                continue
            member = ev.transfer is not None and self.ctx.worker_id in ev.members
            if member:  # a group transfer waits for every member: take part even when current
                await self.load(ev.policy_version, ev.path, ev)
                continue
            if ev.policy_version == self.engine.version:
                await self.bus.publish(
                    self.bus.subjects.weights_loaded,
                    WeightsLoaded(
                        policy_version=self.engine.version, engine_id=self.ctx.worker_id, ok=True, seconds=0.0
                    ),
                )
                continue
            # Loading runs beside decoding; the engine interrupts and resumes requests itself.
            # An older version is loaded too: the trainer was restored from a checkpoint.
            await self.load(ev.policy_version, ev.path)

    # ---- tasks -----------------------------------------------------------------------------

    def completions_for(self, task: PromptTask) -> int:
        return 1 if task.kind == "eval" else self.cfg.rollout.group_size

    async def reserve(self, n: int) -> None:
        """Wait for room for ``n`` more completions (backpressure: fetch no task we cannot run)."""
        while self.in_flight and self.in_flight + n > self.capacity:
            self.room = anyio.Event()
            await self.room.wait()
        self.in_flight += n

    def release(self, n: int) -> None:
        self.in_flight -= n
        self.room.set()

    async def task_loop(self, tg: anyio.abc.TaskGroup) -> None:
        async for delivery in self.bus.consume(Streams.PROMPT, batch=1):
            prompt_ids = None
            try:
                prompt_ids = await self.admit(delivery.event)
            except ValueError as exc:  # the poison-message rule: this event, not the worker
                log.warning("prompt task dead-lettered", reason=str(exc))
                await delivery.dead_letter(f"prompt rejected: {exc}"[:2000])
                continue
            await self.reserve(self.completions_for(delivery.event))
            tg.start_soon(self.handle, delivery, prompt_ids)

    async def admit(self, task: Any) -> list[int]:
        """The prompt ids of a task the controller issued; ValueError (naming why) for anything else."""
        await check_issued(self.run_state, task)
        try:
            prompt_ids = render_prompt(
                self.tokenizer,
                task.row,
                use_chat_template=self.cfg.model.use_chat_template,
                system_prompt=self.cfg.model.system_prompt,
            )
        except Exception as exc:
            raise ValueError(
                f"task {task.task_id!r}: its row cannot be rendered ({type(exc).__name__}: {exc})"
            ) from None
        return list(prompt_ids)

    async def call_loop(self, tg: anyio.abc.TaskGroup) -> None:
        """Answer agents' ``generate`` requests; each goes to one member of the ``generation`` group."""
        async with self.bus.serve(self.bus.subjects.generate, queue="generation") as requests:
            async for request in requests:
                await self.reserve(1)
                tg.start_soon(self.answer, request)

    async def answer(self, request: Any) -> None:
        """One model call: a bad call is answered with its error; an engine failure stops the worker
        (the agent's call times out and goes to another generation worker)."""
        call = request.event
        call_id = getattr(call, "call_id", "")
        arrived = time.monotonic()
        self.active += 1
        try:
            if not isinstance(call, GenerateCall):
                raise ValueError(f"expected a GenerateCall, got {type(call).__name__}")
            sampling = SamplingParams(
                temperature=call.temperature,
                top_p=call.top_p,
                top_k=call.top_k,
                max_new_tokens=call.max_new_tokens,
                stop_token_ids=tuple(call.stop_token_ids),
                seed=call.seed,
            )
            prompt = tuple(int(t) for t in unpack_i32(call.prompt_ids, "prompt_ids"))
            request_ = GenerationRequest(request_id=call.call_id, prompt_ids=prompt, sampling=sampling)
            async with self.ctx.working("answering calls"):
                [result] = await self.engine.generate([request_])
            self.ctx.progressed(tokens=len(result.token_ids))
            reply = GenerateReply(
                call_id=call_id,
                engine_id=self.ctx.worker_id,
                token_ids=pack_i32(result.token_ids),
                logprobs=pack_f32(result.logprobs),
                versions=pack_i32(result.versions),
                finish_reason=result.finish_reason,
                seconds=time.monotonic() - arrived,
            )
            self.tokens_out += len(result.token_ids)
        except ValueError as exc:
            reply = GenerateReply(
                call_id=call_id, engine_id=self.ctx.worker_id, error=f"bad call: {exc}"[:2000]
            )
        finally:
            self.active -= 1
            self.release(1)
        await request.respond(reply)

    async def handle(self, delivery: Any, prompt_ids: list[int]) -> None:
        task = delivery.event
        self.active += 1
        self.ctx.set_status("busy")
        try:
            async with self.ctx.working("generating"):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_keep_alive, delivery)
                    group = await self.generate_group(task, prompt_ids)
                    await self.bus.publish(
                        self.bus.subjects.rollout_generated,
                        group,
                        msg_id=f"{task.task_id}:{task.attempt}",
                        policy_version=group.head_version,
                    )
                    await delivery.ack()
                    tg.cancel_scope.cancel()
            self.ctx.progressed(tokens=int(group.timings["tokens"]))
            self.tasks_done += 1
            log.info(
                "group generated",
                task_id=task.task_id,
                kind=task.kind,
                tokens=int(group.timings["tokens"]),
                seconds=round(group.timings["generate_s"], 3),
                head_version=group.head_version,
                tail_version=group.tail_version,
            )
        finally:
            self.active -= 1
            self.release(self.completions_for(task))
            self.ctx.load = {"active_tasks": float(self.active), "tasks_done": float(self.tasks_done)}
            if not self.active:
                self.ctx.set_status("ready")

    async def generate_group(self, task: PromptTask, prompt_ids: list[int]) -> RolloutGroup:
        cfg = self.cfg
        is_eval = task.kind == "eval"
        n = 1 if is_eval else cfg.rollout.group_size
        sampling = self.eval_sampling if is_eval else self.train_sampling
        requests = [
            GenerationRequest(
                request_id=f"{task.task_id}:{task.attempt}:{i}", prompt_ids=prompt_ids, sampling=sampling
            )
            for i in range(n)
        ]
        started = time.monotonic()
        results = await self.engine.generate(requests)
        seconds = time.monotonic() - started
        texts = self.tokenizer.batch_decode([r.token_ids for r in results], skip_special_tokens=True)
        self.tokens_out += sum(len(r.token_ids) for r in results)
        return rollout_group(task, self.ctx.worker_id, prompt_ids, results, texts, seconds)


def rollout_group(
    task: PromptTask,
    engine_id: str,
    prompt_ids: list[int],
    results: list[GenerationResult],
    texts: list[str],
    seconds: float,
) -> RolloutGroup:
    """The group of ``task``'s completions; its head is the oldest version of any token, its tail the
    newest (versions may fall within a completion when a restored trainer republished an older one)."""
    completions = [
        Completion(
            token_ids=pack_i32(r.token_ids),
            logprobs=pack_f32(r.logprobs),
            versions=pack_i32(r.versions),
            finish_reason=r.finish_reason,
            text=text,
        )
        for r, text in zip(results, texts, strict=True)
    ]
    return task_group(
        task,
        engine_id,
        prompt_ids,
        completions,
        head_version=min(r.head_version for r in results),
        tail_version=max(r.tail_version for r in results),
        seconds=seconds,
    )


async def _keep_alive(delivery: Any) -> None:
    while True:
        await anyio.sleep(IN_PROGRESS_EVERY_S)
        await delivery.in_progress()


async def serve(ctx: WorkerContext) -> None:
    model_path = "" if ctx.cfg.rollout.engine == "simulated" else resolve_model_path(ctx.cfg.model.path)
    tokenizer = run_tokenizer(ctx.cfg, model_path)
    engine = make_engine(ctx, model_path)
    async with engine:
        gen = Generator(ctx, engine, tokenizer)
        ctx.policy_version = engine.version
        async with anyio.create_task_group() as tg:
            tg.start_soon(gen.weights_listener)
            await gen.catch_up()
            ctx.set_status("ready")
            log.info("generation ready", engine_id=engine.engine_id, policy_version=engine.version)
            tg.start_soon(gen.call_loop, tg)
            if ctx.cfg.uses_agents:  # agent workers take the prompt tasks and call us per turn
                await anyio.sleep_forever()
            await gen.task_loop(tg)
