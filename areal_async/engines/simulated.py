"""Simulated inference engine: the real engine contract at a modelled speed, without a model.

`rollout.engine: simulated` gives generation workers this engine, so that every path of a run but
the math runs for real (the generation worker, prompts, admission, interruption on weight loads,
per-token versions, the bus) at the speed of a `Profile` (`areal_async/simulation/profile.py`),
and hundreds of engines fit on a few CPU cores.

How time passes. Running completions decode in lock-step, one token each per decode step of
`profile.engine.decode_step(batch)` seconds (times `time_scale`; with `token_scale` k each simulated
token stands for k modelled ones: lengths are divided by k, the time of a token multiplied by k). The engine does not wake per token:
it sleeps until the first running completion ends, and wakes early only when a request arrives or a
weight load is asked for; then it credits the whole steps that fit in the time slept. A request joins
at the next step boundary, after its prefill. `load_weights` pauses decoding at the next step
boundary for the modelled transfer and load, sets `version` before decoding resumes, and continues
every completion from its tokens so far (each token stamped with the version it was decoded with),
so completions span versions exactly as with a real engine. With a shared device
(`profile.device.shared`) the engine keeps a flag file while it decodes and slows by
`decode_slowdown` while the trainer's flag is present; it then wakes at most every `SHARED_SLICE_S`.

Tokens are random ids (never the stop id before the end), log-probs a constant -1.0; a completion
whose drawn length is below `max_new_tokens` ends with the first stop id (finish "stop"), else
"length". `SimulatedTokenizer` stands in for the tokenizer: one token per prompt byte, or every
prompt `profile.engine.prompt_tokens` long.

No torch, no numpy: a simulated engine is a few hundred bytes of state and one task.
"""

from __future__ import annotations

import array
import contextlib
import math
import random
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from areal_async.engines.base import EngineClosedError, GenerationRequest, GenerationResult, InferenceEngine
from areal_async.simulation.profile import Profile

SHARED_SLICE_S = 0.05
"""Longest modelled time between two looks at the other side's busy flag on a shared device."""

TRAINING_FLAG = "training"
"""File a simulated trainer keeps in the flags directory while it trains (shared device)."""

DECODING_FLAG_PREFIX = "decoding."
"""Prefix of the file each simulated engine keeps in the flags directory while it decodes."""

EOS_ID = 2
LOGPROB = -1.0


class SimulatedTokenizer:
    """The slice of the Hugging Face tokenizer interface that generation and agent workers use."""

    eos_token_id = EOS_ID
    chat_template = "simulated"
    """A stand-in name: `apply_chat_template` renders `<|role|>content` lines (agent workflows)."""
    model_max_length = 1 << 20

    def __init__(self, prompt_tokens: int = 0) -> None:
        self.prompt_tokens = prompt_tokens

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """One token per byte; with `prompt_tokens`, a whole prompt (special tokens added, as
        `render_prompt` asks) is repeated or cut to that length."""
        ids = [256 + b for b in text.encode()] or [256]
        if self.prompt_tokens and add_special_tokens:
            ids = (ids * (self.prompt_tokens // len(ids) + 1))[: self.prompt_tokens]
        return {"input_ids": ids}

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        **_: Any,
    ) -> str:
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self(text, add_special_tokens)["input_ids"]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(t - 256) if 256 <= t < 384 else "" for t in ids)

    def batch_decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]


@dataclass
class _Running:
    request: GenerationRequest
    length: int
    done: anyio.Event = field(default_factory=anyio.Event)
    tokens: int = 0
    spans: list[list[int]] = field(default_factory=list)
    """[version, count] runs of the completion's tokens."""
    result: GenerationResult | None = None
    queued_at: float = field(default_factory=time.monotonic)

    def advance(self, count: int, version: int) -> None:
        if count <= 0:
            return
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][1] += count
        else:
            self.spans.append([version, count])
        self.tokens += count


class SimulatedEngine(InferenceEngine):
    """See the module docstring. `flags_dir`: where shared-device busy flags live (the run dir's
    `sim/`); required when the profile's device is shared."""

    def __init__(
        self,
        profile: Profile,
        *,
        engine_id: str,
        max_batch_size: int,
        time_scale: float = 1.0,
        seed: int = 0,
        flags_dir: Path | None = None,
        kv_after_load: str = "recompute",
        token_scale: int = 1,
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        if profile.device.shared and flags_dir is None:
            raise ValueError("a shared-device profile needs flags_dir (where engine and trainer flag busy)")
        self.profile = profile
        self.engine_id = engine_id
        self.max_batch_size = max_batch_size
        self.scale = time_scale
        self.kv_after_load = kv_after_load
        self.token_scale = token_scale
        self.rng = random.Random(f"{seed}:{engine_id}")
        self.flags_dir = flags_dir
        self._version = 0
        self._queue: deque[_Running] = deque()
        self._running: list[_Running] = []
        self._wake = anyio.Event()
        self._load_wanted: int | None = None
        self._loads_done: list[anyio.Event] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = True
        self._decoding_flag = False
        self.tokens_out = 0
        self.busy_s = 0.0

    @property
    def version(self) -> int:
        return self._version

    async def start(self) -> None:
        if self._tg is not None:
            return
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._closed = False
        self._tg.start_soon(self._drive)

    async def aclose(self) -> None:
        if self._tg is None:
            return
        self._closed = True
        self._tg.cancel_scope.cancel()
        with contextlib.suppress(Exception):
            await self._tg.__aexit__(None, None, None)
        self._tg = None
        self._set_decoding(False)
        for r in [*self._running, *self._queue]:
            r.done.set()
        for done in self._loads_done:
            done.set()

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        if self._closed:
            raise EngineClosedError(f"engine {self.engine_id} is closed")
        entries = [_Running(r, self._draw_length(r.sampling.max_new_tokens)) for r in requests]
        self._queue.extend(entries)
        self._wake.set()
        for e in entries:
            await e.done.wait()
        if any(e.result is None for e in entries):
            raise EngineClosedError(f"engine {self.engine_id} closed while requests were decoding")
        return [e.result for e in entries]  # type: ignore[misc]

    async def load_weights(self, version: int, location: str | Any | Mapping[str, Any]) -> float:
        if self._closed:
            raise EngineClosedError(f"engine {self.engine_id} is closed")
        started = time.monotonic()
        done = anyio.Event()
        self._loads_done.append(done)
        self._load_wanted = version
        self._wake.set()
        await done.wait()
        if self._closed:
            raise EngineClosedError(f"engine {self.engine_id} closed during a weight load")
        return time.monotonic() - started

    async def health(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "version": self._version,
            "status": "closed" if self._closed else "ready",
            "running": len(self._running),
            "queued": len(self._queue),
        }

    # ---- the modelled decode loop ------------------------------------------------------------

    def _draw_length(self, cap: int) -> int:
        """A completion's length in simulated tokens (modelled tokens / token_scale, rounded up)."""
        e = self.profile.engine
        if e.completion_tokens_sigma <= 0:
            length = round(e.completion_tokens_mean)
        else:
            sigma = e.completion_tokens_sigma
            mu = math.log(e.completion_tokens_mean) - sigma * sigma / 2
            length = round(self.rng.lognormvariate(mu, sigma))
        return max(1, min(cap, math.ceil(length / self.token_scale)))

    async def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            await anyio.sleep(seconds * self.scale)

    async def _drive(self) -> None:
        e = self.profile.engine
        while True:
            if self._load_wanted is not None:
                await self._apply_load()
                continue
            prefill = 0
            while self._queue and len(self._running) < self.max_batch_size:
                entry = self._queue.popleft()
                self._running.append(entry)
                prefill += len(entry.request.prompt_ids)
            if not self._running:
                self._set_decoding(False)
                self._wake = anyio.Event()
                if not self._queue and self._load_wanted is None:
                    await self._wake.wait()
                continue
            self._set_decoding(True)
            await self._sleep(prefill * e.prefill_s_per_token * self.token_scale)
            step = e.decode_step(len(self._running)) * self._slowdown() * self.token_scale
            horizon = min(r.length - r.tokens for r in self._running)
            if self.profile.device.shared:
                horizon = max(1, min(horizon, int(SHARED_SLICE_S / step)))
            self._wake = anyio.Event()
            started = time.monotonic()
            with anyio.move_on_after(horizon * step * self.scale):
                await self._wake.wait()
            steps = horizon
            if self._wake.is_set():  # woken early: finish the step under way, then stop at its boundary
                elapsed = time.monotonic() - started
                steps = min(horizon, math.ceil(elapsed / (step * self.scale)))
                await anyio.sleep(max(0.0, steps * step * self.scale - elapsed))
            self.busy_s += time.monotonic() - started
            self._advance(steps)

    def _advance(self, steps: int) -> None:
        version = self._version
        still = []
        for r in self._running:
            r.advance(steps, version)
            if r.tokens >= r.length:
                r.result = self._result(r)
                self.tokens_out += r.tokens
                r.done.set()
            else:
                still.append(r)
        self._running = still

    async def _apply_load(self) -> None:
        version, self._load_wanted = self._load_wanted, None
        e, w = self.profile.engine, self.profile.weights
        pause = w.transfer_s + e.load_s
        if self.kv_after_load == "recompute":  # re-prefill prompt + tokens so far with the new weights
            redo = sum(len(r.request.prompt_ids) + r.tokens for r in self._running)
            pause += e.prefill_s_per_token * redo * self.token_scale
        await self._sleep(pause)
        assert version is not None
        self._version = version
        done, self._loads_done = self._loads_done, []
        for d in done:
            d.set()

    def _result(self, r: _Running) -> GenerationResult:
        sampling = r.request.sampling
        n = r.tokens
        raw = array.array("H", self.rng.randbytes(2 * n))
        ids = [t | 256 for t in raw]
        stop = n < sampling.max_new_tokens and bool(sampling.stop_token_ids)
        if stop:
            ids[-1] = sampling.stop_token_ids[0]
        versions: list[int] = []
        for version, count in r.spans:
            versions.extend([version] * count)
        return GenerationResult(
            request_id=r.request.request_id,
            prompt_ids=r.request.prompt_ids,
            token_ids=ids,
            logprobs=[LOGPROB] * n,
            versions=versions,
            finish_reason="stop" if stop else "length",
            stats={"seconds": time.monotonic() - r.queued_at},
        )

    # ---- shared device -------------------------------------------------------------------------

    def _slowdown(self) -> float:
        d = self.profile.device
        if d.shared and self.flags_dir is not None and (self.flags_dir / TRAINING_FLAG).exists():
            return d.decode_slowdown
        return 1.0

    def _set_decoding(self, busy: bool) -> None:
        if not self.profile.device.shared or self.flags_dir is None or busy == self._decoding_flag:
            return
        self._decoding_flag = busy
        flag = self.flags_dir / f"{DECODING_FLAG_PREFIX}{self.engine_id}"
        if busy:
            flag.touch()
        else:
            flag.unlink(missing_ok=True)
