"""The decode thread of the local engine: scheduling, prefill, decode, sampling and completion.

`DecodeLoop` is the half of `LocalEngine` that runs on its dedicated decode thread (`_run`). It
moves requests from the `_cond`-guarded queues into the batch, applies weight loads at step
boundaries, prefills joiners, decodes every row, and hands results and errors back by setting
anyio Events in the event loop that started the engine (`_signal`). The other half (`engine.py`)
queues requests and loads and waits on those Events; it reads the counters and `_rows` / `_waiting`
only for `health()`. `_Call`, `_Sequence` and `_WeightLoad` are what the two halves pass.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import anyio
import anyio.from_thread
import anyio.lowlevel
import structlog
import torch
from transformers import DynamicCache, PreTrainedModel

from areal_async import lora
from areal_async.engines.base import EngineClosedError, GenerationRequest, GenerationResult, SamplingParams
from areal_async.engines.local.kv import _STAND_IN, _BatchKV, _DecodeRows, _left_padded, cache_kwarg
from areal_async.engines.local.lora_serving import AdapterServing
from areal_async.engines.local.sampling import is_filtered, sample_tokens
from areal_async.engines.local.slots import _SlotKV

_UNIFORM_BLOCK = 64  # a seeded request draws its sampling uniforms this many at a time


@dataclass(eq=False)
class _Call:
    """One generate() call: its results and the event its caller awaits."""

    results: list[GenerationResult | None]
    remaining: int
    done: anyio.Event
    error: BaseException | None = None
    cancelled: bool = False


@dataclass(eq=False)
class _Sequence:
    request: GenerationRequest
    call: _Call
    index: int
    submitted_at: float
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    admitted_at: float = 0.0
    admit_step: int = -1
    prefills: int = 0
    uniforms: list[float] = field(default_factory=list)
    """Drawn from `generator` but not used yet, the next one last."""

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    def next_uniform(self) -> float:
        """The next uniform of this request's own stream (one CPU call per block, not per token)."""
        assert self.generator is not None
        if not self.uniforms:
            self.uniforms = torch.rand(_UNIFORM_BLOCK, generator=self.generator).tolist()[::-1]
        return self.uniforms.pop()

    @property
    def length(self) -> int:
        return len(self.request.prompt_ids) + len(self.token_ids)

    @property
    def alive(self) -> bool:
        return self.finish_reason is None and not self.call.cancelled and self.call.error is None


@dataclass(eq=False)
class _WeightLoad:
    version: int
    state: Mapping[str, torch.Tensor]
    done: anyio.Event
    error: BaseException | None = None
    pause_s: float = 0.0
    adopt: bool = False
    """`state` holds tensors made for this load alone, which may become the parameters' storage."""
    adapter: lora.Adapter | None = None
    """The LoRA adapter of this version (merged into `state`, or served unmerged)."""
    hooks: list[tuple[str, torch.Tensor, torch.Tensor]] | None = None
    """Serve `adapter` through these hooks until its merge lands (`lora_serving.py`); `state` is empty."""


class DecodeLoop:
    """The decode-thread methods of `LocalEngine`, which sets up the state below in its `__init__`."""

    engine_id: str
    model: PreTrainedModel
    device: torch.device
    vocab_size: int
    max_batch_size: int
    max_prefill_tokens: int
    prefill_min_rows: int
    kv_after_load: Literal["recompute", "keep", "finish"]
    _version: int
    _generator: torch.Generator
    _params: dict[str, torch.Tensor]
    _lora: AdapterServing
    _cond: threading.Condition
    _incoming: deque[_Sequence]
    _loads: deque[_WeightLoad]
    _closing: bool
    _waiting: deque[_Sequence]
    _rows: list[_Sequence]
    _joiners: list[_Sequence]
    _kv: _BatchKV | _SlotKV
    _token: anyio.lowlevel.EventLoopToken | None
    _last_error: str
    _log: structlog.typing.FilteringBoundLogger
    steps: int
    prefill_forwards: int
    prefill_tokens: int
    reprefill_tokens: int
    prefill_s: float
    decode_s: float
    loads: int
    tokens_generated: int

    # ---------------------------------------------------------- decode thread

    def _apply_weights(self, state: Mapping[str, torch.Tensor], adopt: bool = False) -> None:
        """Copy `state` into the model in place (on the decode thread, or before it starts). With
        `adopt` on the CPU, tensors of the parameter's dtype and shape replace its storage instead
        (no copy; nothing has captured CPU parameters' addresses)."""
        adopt = adopt and self.device.type == "cpu"
        with torch.no_grad():
            for name, tensor in state.items():
                param = self._params[name]
                fits = tensor.dtype == param.dtype and tensor.shape == param.shape and tensor.is_contiguous()
                if adopt and fits:
                    param.data = tensor
                else:
                    param.copy_(tensor, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _install(self, load: _WeightLoad) -> None:
        """Put `load`'s weights (or its unmerged adapter) in place; what the LoRA state becomes."""
        if load.hooks is not None:
            self._lora.serve_unmerged(load.hooks)
            return
        self._apply_weights(load.state, load.adopt)
        self._lora.reset()
        self._lora.merged = load.adapter

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (
                        self._closing or self._loads or self._incoming or self._waiting or self._rows
                        or self._lora.merge_done()
                    ):  # fmt: skip
                        self._cond.wait()
                    if self._closing:
                        break
                if self._lora.merge_done():  # same version, same function: no re-prefill, no pause
                    self._lora.land(lambda merged: self._apply_weights(merged, adopt=True))
                    continue
                with self._cond:
                    self._waiting.extend(self._incoming)
                    self._incoming.clear()
                    # "finish": a load waits until the running requests are done on the old weights,
                    # and no request is admitted meanwhile (no completion spans two versions).
                    draining = (
                        bool(self._loads)
                        and self.kv_after_load == "finish"
                        and any(s.alive for s in self._rows)
                    )
                    load = self._loads.popleft() if self._loads and not draining else None
                if load is not None:
                    self._load_at_boundary(load)
                    continue
                try:
                    finished = self._step(admit_new=not draining)
                except Exception as exc:  # a failed step fails its requests, not the engine
                    self._log.exception("decode step failed")
                    self._last_error = repr(exc)
                    finished = self._fail_running(exc)
                self._notify_finished(finished)
        finally:
            self._shutdown()

    def _load_at_boundary(self, load: _WeightLoad) -> None:
        started = time.perf_counter()
        try:
            self._install(load)
        except Exception as exc:
            load.error = exc
            self._last_error = repr(exc)
        else:
            self._version = load.version  # before any token is sampled with the new weights
            self.loads += 1
            if self.kv_after_load == "recompute":
                # Running requests re-prefill from prompt + tokens so far with the new weights, first.
                self._kv.clear()
                self._waiting.extendleft(reversed([s for s in self._rows if s.alive]))
                self._rows = []
        load.pause_s = time.perf_counter() - started
        self._signal([load.done])

    def _step(self, admit_new: bool = True) -> list[_Sequence]:
        """One scheduling step: retire, admit (prefill) unless `admit_new` is off, decode. Returns
        sequences that finished."""
        # Rows that finished last step were reported then; they leave the KV when it compacts.
        finished: list[_Sequence] = []
        keep = [i for i, s in enumerate(self._rows) if s.alive]
        joiners = self._joiners
        free = self.max_batch_size - len(keep)
        admit = admit_new and (not keep or free >= min(self.prefill_min_rows, len(self._waiting)))
        while admit and self._waiting and len(keep) + len(joiners) < self.max_batch_size:
            sequence = self._waiting.popleft()
            if sequence.alive:
                joiners.append(sequence)
        with torch.inference_mode():
            if joiners or self._kv.compacts(len(keep)):
                self._rows = [self._rows[i] for i in self._kv.retain(keep)]
            if joiners:
                started = time.perf_counter()
                self._rows += self._prefill(joiners)
                finished += [s for s in joiners if s.finish_reason is not None]
                joiners.clear()
                self.prefill_s += time.perf_counter() - started
            if any(s.alive for s in self._rows):
                started = time.perf_counter()
                finished += self._decode()
                self.decode_s += time.perf_counter() - started
        return finished

    def _prefill(self, joiners: list[_Sequence]) -> list[_Sequence]:
        """Prefill joiners (prompt + tokens so far), add their KV rows after the current rows and sample
        each one's next token. Returns the sequences that now hold those rows, in row order."""
        now = time.perf_counter()
        for s in joiners:
            if s.prefills == 0:
                s.admitted_at, s.admit_step = now, self.steps
            s.prefills += 1
        self.reprefill_tokens += sum(s.length for s in joiners if s.token_ids)
        if isinstance(self._kv, _SlotKV):
            return self._prefill_slots(self._kv, joiners)
        order = sorted(range(len(joiners)), key=lambda i: joiners[i].length)
        chunks: list[list[int]] = [[]]
        for i in order:
            chunk = chunks[-1]
            if chunk and (len(chunk) + 1) * joiners[i].length > self.max_prefill_tokens:
                chunks.append(chunk := [])
            chunk.append(i)
        merged = _BatchKV()
        for chunk in chunks:
            kv = self._prefill_chunk([joiners[i] for i in chunk])
            merged.merge(list(range(merged.rows)), kv)
        rows = [joiners[i] for chunk in chunks for i in chunk]
        merged.select([i for i, s in enumerate(rows) if s.alive])
        if merged.rows:
            self._kv.admit(merged)
        return [s for s in rows if s.alive]

    def _prefill_slots(self, kv: _SlotKV, joiners: list[_Sequence]) -> list[_Sequence]:
        """Slots: each distinct token row (prompt + tokens so far) is computed once, straight into the
        slot of its first joiner, in chunks of <= max_prefill_tokens padded tokens; joiners that repeat
        it (a group's samples) get a copy of that slot. Every joiner keeps a row, finished ones too."""
        kv.reserve(max(len(s.request.prompt_ids) + s.sampling.max_new_tokens for s in joiners))
        start = kv.rows
        tokens = [(*s.request.prompt_ids, *s.token_ids) for s in joiners]
        first: dict[tuple[int, ...], int] = {}
        source = [first.setdefault(t, i) for i, t in enumerate(tokens)]
        chunks: list[list[int]] = [[]]
        for i in sorted(first.values(), key=lambda i: len(tokens[i])):
            chunk = chunks[-1]
            if chunk and (len(chunk) + 1) * len(tokens[i]) > self.max_prefill_tokens:
                chunks.append(chunk := [])
            chunk.append(i)
        logits = []
        for chunk in chunks:
            logits.append(kv.prefill(self.model, [tokens[i] for i in chunk], [start + i for i in chunk]))
            self.prefill_forwards += 1
            self.prefill_tokens += sum(len(tokens[i]) for i in chunk)
        where = {i: k for k, i in enumerate(i for chunk in chunks for i in chunk)}
        copies = [i for i, j in enumerate(source) if j != i]
        if copies:
            kv.copy_rows(
                torch.tensor([start + i for i in copies], device=self.device),
                torch.tensor([start + source[i] for i in copies], device=self.device),
            )
        kv.rows = start + len(joiners)
        index = torch.tensor([where[j] for j in source], device=self.device)
        self._sample(joiners, torch.cat(logits).index_select(0, index))
        return list(joiners)

    def _prefill_chunk(self, sequences: list[_Sequence]) -> _BatchKV:
        """Dynamic layout: prefill `sequences` (prompt + tokens so far) and sample each one's next token.

        Each distinct prompt is computed once (a group's samples share theirs): a forward over the
        distinct prompts (left-padded), their KV copied to every row that shares the prompt, then,
        for rows that already hold tokens (re-prefill after a weight load), a second forward over
        those tokens (left-padded) on top. The row mask then has padding before the prompt and
        between prompt and tokens; attention and position ids skip it.
        """
        prompts: dict[tuple[int, ...], int] = {}
        group = [prompts.setdefault(tuple(s.request.prompt_ids), len(prompts)) for s in sequences]
        ids, mask = _left_padded([list(p) for p in prompts])
        cache = DynamicCache(config=self.model.config)
        logits = self._forward_prefill(ids, mask, cache)
        index = torch.tensor(group, device=self.device)
        if len(prompts) < len(sequences):
            for layer in cache.layers:
                layer.keys = layer.keys.index_select(0, index)
                layer.values = layer.values.index_select(0, index)
        logits, mask = logits.index_select(0, index), mask.to(self.device).index_select(0, index)
        resumed = [row for row, s in enumerate(sequences) if s.token_ids]
        if resumed:
            tail_ids, tail_mask = _left_padded([s.token_ids for s in sequences])
            mask = torch.cat([mask, tail_mask.to(self.device)], dim=1)
            tail_logits = self._forward_prefill(tail_ids, mask, cache)
            rows = torch.tensor(resumed, device=self.device)
            logits = logits.index_copy(0, rows, tail_logits.index_select(0, rows))
        self._sample(sequences, logits)
        return _BatchKV(cache, mask)

    def _forward_prefill(self, ids: torch.Tensor, mask: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Forward `ids` [B, T] on top of `cache` (extended in place); `mask` covers cache + ids.

        Returns the logits of each row's last column [B, V]."""
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)[:, -ids.shape[1] :]
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **cache_kwarg(self.model, cache),
            logits_to_keep=1,
        )
        self.prefill_forwards += 1
        self.prefill_tokens += int(mask[:, -ids.shape[1] :].sum())
        return out.logits[:, -1]

    def _decode(self) -> list[_Sequence]:
        """One decode step of every row; samples the live ones. Returns those that finished."""
        live = [s for s in self._rows if s.alive]
        uniforms = self._uniforms(live)
        next_uniform = iter(uniforms)
        values = [
            (
                s.token_ids[-1],
                s.length - 1,
                s.sampling.temperature or 1.0,
                next(next_uniform),
                s.sampling.temperature == 0,
            )
            if s.alive
            else _STAND_IN  # a finished row keeps its slot until the KV compacts
            for s in self._rows
        ]
        rows = _DecodeRows(*(list(column) for column in zip(*values, strict=True)))
        logits_BV, draws_2B = self._kv.decode(self.model, rows, max(s.length for s in live))
        self.steps += 1
        if len(live) < len(self._rows):
            index = torch.tensor([i for i, s in enumerate(self._rows) if s.alive], device=self.device)
            logits_BV = logits_BV.index_select(0, index)
            draws_2B = None if draws_2B is None else draws_2B.index_select(1, index)
        if draws_2B is None or any(is_filtered(s.sampling, self.vocab_size) for s in live):
            return self._sample(live, logits_BV, uniforms)
        tokens, logprobs = draws_2B.cpu().tolist()
        return self._record(live, [int(t) for t in tokens], logprobs)

    def _uniforms(self, sequences: list[_Sequence]) -> list[float]:
        """One uniform per sampled (non-greedy) sequence: from its own generator when it has a seed,
        else from the engine generator (one draw for all of them); 0.0 for greedy ones."""
        uniforms = [0.0] * len(sequences)
        shared = [i for i, s in enumerate(sequences) if s.generator is None and s.sampling.temperature != 0]
        for i, u in zip(shared, torch.rand(len(shared), generator=self._generator).tolist(), strict=True):
            uniforms[i] = u
        for i, s in enumerate(sequences):
            if s.generator is not None and s.sampling.temperature != 0:
                uniforms[i] = s.next_uniform()
        return uniforms

    def _sample(
        self, sequences: list[_Sequence], logits_BV: torch.Tensor, uniforms: list[float] | None = None
    ) -> list[_Sequence]:
        """Sample each sequence's next token from its logits row; returns those that finished."""
        if uniforms is None:
            uniforms = self._uniforms(sequences)
        tokens_B, logprobs_B = sample_tokens(logits_BV, [s.sampling for s in sequences], uniforms)
        return self._record(sequences, tokens_B.tolist(), logprobs_B.tolist())

    def _record(
        self, sequences: list[_Sequence], tokens: list[int], logprobs: list[float]
    ) -> list[_Sequence]:
        """Append one sampled token per sequence; returns those that finished with it."""
        version = self._version
        finished = []
        for s, token, logprob in zip(sequences, tokens, logprobs, strict=True):
            s.token_ids.append(token)
            s.logprobs.append(logprob)
            s.versions.append(version)
            if token in s.sampling.stop_token_ids:
                s.finish_reason = "stop"
            elif len(s.token_ids) >= s.sampling.max_new_tokens:
                s.finish_reason = "length"
            if s.finish_reason is not None:
                finished.append(s)
        self.tokens_generated += len(sequences)
        return finished

    # ------------------------------------------------------------ completion

    def _notify_finished(self, finished: list[_Sequence]) -> None:
        now = time.perf_counter()
        events = []
        for s in finished:
            if s.call.cancelled or s.call.error is not None:
                continue
            s.call.results[s.index] = GenerationResult(
                request_id=s.request.request_id,
                prompt_ids=s.request.prompt_ids,
                token_ids=s.token_ids,
                logprobs=s.logprobs,
                versions=s.versions,
                finish_reason=s.finish_reason,  # type: ignore[arg-type]
                stats={
                    "queued_s": s.admitted_at - s.submitted_at,
                    "seconds": now - s.submitted_at,
                    "admit_step": float(s.admit_step),
                    "finish_step": float(self.steps),
                    "prefills": float(s.prefills),
                },
            )
            s.call.remaining -= 1
            if s.call.remaining == 0:
                events.append(s.call.done)
        self._signal(events)

    def _fail_running(self, exc: BaseException) -> list[_Sequence]:
        error = RuntimeError(f"engine {self.engine_id} failed while decoding: {exc!r}")
        error.__cause__ = exc
        self._fail(self._rows + self._joiners, error)
        self._rows, self._joiners = [], []
        self._kv.clear()
        return []

    def _fail(self, sequences: list[_Sequence] | deque[_Sequence], error: BaseException) -> None:
        events = []
        for s in sequences:
            # a finished row can still hold a slot; its call may already have all its results
            if s.call.error is None and not s.call.cancelled and s.call.remaining > 0:
                s.call.error = error
                events.append(s.call.done)
        self._signal(events)

    def _shutdown(self) -> None:
        self._lora.abandon()
        with self._cond:
            self._closing = True
            pending = self._rows + self._joiners + list(self._waiting) + list(self._incoming)
            loads = list(self._loads)
            self._incoming.clear()
            self._loads.clear()
        self._rows, self._joiners, self._waiting = [], [], deque()
        self._kv.clear()
        closed = EngineClosedError(f"engine {self.engine_id} closed before the request finished")
        self._fail(pending, closed)
        for load in loads:
            load.error = closed
        self._signal([load.done for load in loads])

    def _signal(self, events: list[anyio.Event]) -> None:
        """Set anyio Events from the decode thread, in the event loop that started the engine."""
        if not events:
            return

        def set_all() -> None:
            for event in events:
                event.set()

        try:
            anyio.from_thread.run_sync(set_all, token=self._token)
        except RuntimeError:  # the event loop is gone; nobody is waiting any more
            self._log.warning("event loop gone; dropping notifications", count=len(events))
