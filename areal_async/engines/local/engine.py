"""LocalEngine: an in-process transformers inference engine with continuous batching and interruption.

Guarantees (beyond the `InferenceEngine` contract in engines/base.py):

- Continuous batching: up to `max_batch_size` sequences decode together. When slots free up they go to
  the next waiting requests; the batch never waits for its longest member. A prefill runs once
  `prefill_min_rows` slots are free (default max_batch_size // 16, at least 1), or every waiting request
  fits, or nothing is decoding: a separate prefill forward per freed slot costs more than the slot.
  Concurrent `generate()` calls feed the same queue (FIFO).
- Prefill: joining requests are prefilled together (left-padded, in chunks of at most
  `max_prefill_tokens` padded tokens) in their own forward, then their KV rows join the batch.
  A prompt shared by several requests (the samples of one group) is computed once and its KV
  copied to each of them (`prefill_tokens` counts the tokens computed). A request resuming after a
  weight load adds its own tokens so far: on top of the shared prompt in a second forward
  ("dynamic"), or as one token row of its own ("slots").
- KV layouts (`kv_cache`), same guarantees, pick by speed:
  - "slots" (default): preallocated per-slot buffers; a prefill writes a joining row's tokens
    straight into its slot, a decode step one column per row, in place; finished rows are replaced
    by moving rows from the end; no per-step cache copies. Capacity grows to the longest admitted
    prompt + max_new_tokens. On CUDA, `cuda_graphs=True` captures the decode step (forward and the
    draws of rows without top-k / top-p) per (batch bucket, length bucket) and replays it; finished
    rows then keep their slots until rows join or the batch fits a smaller graph. `compile=True`
    (needs `cuda_graphs=True`, else ValueError) also `torch.compile`s the decode forward and the
    prefill once each, dynamic in batch, length and capacity (minutes for a 0.5B model, paid by the
    first requests), and the graphs capture the compiled forward. A grouped-query (GQA) sdpa
    model decodes with its query heads grouped under their K/V head (`packed_gqa_sdpa`), so the K/V
    heads are never repeated per query head.
  - "dynamic": one left-padded transformers DynamicCache; rows are dropped / merged by copying, and
    leading all-padding columns are trimmed.
  Attention masks and explicit position ids keep every row numerically identical (up to float noise)
  to an unpadded forward of the same tokens.
- Log-probs: temperature, then top-k, then top-p shape the distribution a token is sampled from; the
  reported log-prob is under exactly that distribution. Temperature 0 is greedy and reports the log-prob
  under the raw (temperature 1, unfiltered) softmax.
- Seeds: a request with `seed` samples from its own torch.Generator (one uniform per token, drawn 64 at
  a time), so its completion depends only on seed, prompt and weights (not on what else is in the
  batch, up to float noise of batched matmuls). Requests without a seed draw from the engine generator
  seeded with `seed`.
- Interruption: `load_weights` reads the checkpoint off the decode thread, then the decode thread pauses
  at its next step boundary, copies the tensors into the model in place and sets the new version.
  `kv_after_load="recompute"` (default) then drops the KV cache and re-prefills every running request
  from prompt + tokens so far before sampling again, so every token after the load is computed wholly
  by the new weights. `kv_after_load="keep"` keeps the running requests' KV (computed by the weights
  that were current when each token was read) and goes on decoding with the new weights: no
  re-prefill. Either way each token carries the version that sampled it and its exact log-prob under
  the distribution it was drawn from, which is what the decoupled loss's behaviour policy needs.
  `kv_after_load="finish"` does not interrupt: once a load is queued no request is admitted, the
  running ones decode to their end on the old weights, then the load is applied and admission
  resumes, so every completion has one version (`load_weights` returns after that drain).
- LoRA: `load_weights` of an adapter directory (areal_async/lora.py) merges `W + scale * B @ A`
  into each targeted weight (one `addmm` each, in the weight's dtype) from a copy of the weight
  taken before the first adapter (adapters are relative to the base model; loading full weights
  makes those the new base), off the decode thread. On a GPU the merged weights are installed at
  the pause and the version is served from them. On the CPU, where the merge is the slow part of
  the hand-off, the version is served at once through low-rank forward hooks while a worker thread
  merges, and the merged tensors become the parameters' storage (no copy) at the first step
  boundary after (`lora_serving.py`). Decoding runs the plain model once the merge has landed,
  so its speed does not change; `health()["lora_unmerged"]` says whether hooks serve the version.
- Threading: all model work runs on one dedicated decode thread; the event loop only queues requests
  and waits on anyio Events, so it never blocks. Use the engine from the event loop it was started in.
- Each result's `stats` holds `queued_s`, `seconds`, `admit_step`, `finish_step` (engine decode-step
  counter), `prefills` (1 + re-prefills after weight loads).
- Engine counters (`health()` and the "engine closed" log line): `steps`, `tokens_generated`,
  `prefill_forwards`, `prefill_tokens`, `reprefill_tokens` (prompt + tokens so far of each request
  re-prefilled after a weight load),
  `prefill_s` / `decode_s` (decode-thread seconds in each phase), `loads`.

Not supported: sliding-window / hybrid-cache models (rejected at construction).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.lowlevel
import structlog
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from areal_async import lora
from areal_async.engines.base import (
    EngineClosedError,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
)
from areal_async.engines.local.decode_loop import DecodeLoop, _Call, _Sequence, _WeightLoad
from areal_async.engines.local.gqa_decode import PACKED_GQA_SDPA
from areal_async.engines.local.kv import _BatchKV
from areal_async.engines.local.lora_serving import AdapterServing
from areal_async.engines.local.slots import _SlotKV
from areal_async.models import load_causal_lm, torch_dtype
from areal_async.weights_file import read_safetensors_dir

log = structlog.get_logger(__name__)


class LocalEngine(DecodeLoop, InferenceEngine):
    """Transformers causal LM served in-process (CPU or CUDA); see the module docstring.

    The methods here run on the event loop; those of `DecodeLoop` on the decode thread."""

    def __init__(
        self,
        model_path_or_model: str | os.PathLike[str] | PreTrainedModel,
        *,
        device: str | torch.device = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 32,
        engine_id: str | None = None,
        seed: int = 0,
        version: int = 0,
        max_prefill_tokens: int = 8192,
        kv_cache: Literal["dynamic", "slots"] = "slots",
        cuda_graphs: bool = False,
        compile: bool = False,
        prefill_min_rows: int | None = None,
        kv_after_load: Literal["recompute", "keep", "finish"] = "recompute",
    ) -> None:
        if kv_after_load not in ("recompute", "keep", "finish"):
            raise ValueError(f"kv_after_load must be 'recompute', 'keep' or 'finish', got {kv_after_load!r}")
        if kv_cache not in ("dynamic", "slots"):
            raise ValueError(f"kv_cache must be 'dynamic' or 'slots', got {kv_cache!r}")
        if cuda_graphs and (kv_cache != "slots" or torch.device(device).type != "cuda"):
            raise ValueError("cuda_graphs=True needs kv_cache='slots' and a CUDA device")
        if compile and not cuda_graphs:
            raise ValueError(
                "compile=True needs cuda_graphs=True (so kv_cache='slots' and a CUDA device): the "
                "compiled decode step is replayed from CUDA graphs"
            )
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if prefill_min_rows is not None and not 1 <= prefill_min_rows <= max_batch_size:
            raise ValueError(
                f"prefill_min_rows must be in [1, max_batch_size={max_batch_size}], got {prefill_min_rows}"
            )
        self.device = torch.device(device)
        if isinstance(model_path_or_model, PreTrainedModel):
            self.model = model_path_or_model.to(self.device).eval()
        else:
            self.model = load_causal_lm(model_path_or_model, dtype=torch_dtype(dtype), device=self.device)
            self.model.requires_grad_(False)
        self._check_cache_layout()
        config = self.model.config
        if kv_cache == "slots" and getattr(config, "_attn_implementation", None) == "sdpa":
            heads = getattr(config.get_text_config(), "num_attention_heads", 1)
            kv_heads = getattr(config.get_text_config(), "num_key_value_heads", None) or heads
            if kv_heads < heads:
                self.model.set_attn_implementation(PACKED_GQA_SDPA)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.engine_id = engine_id or f"local-{uuid.uuid4().hex[:8]}"
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_min_rows = prefill_min_rows or max(1, max_batch_size // 16)
        """A prefill waits until this many slots are free (or every waiting request fits, or no row is
        decoding): one prefill forward per freed slot would cost more than the slots it refills."""
        self.kv_after_load = kv_after_load
        """What running requests do at a weight load: re-prefill ("recompute"), keep their KV
        ("keep"), or finish on the old weights before the load ("finish")."""
        self._version = version
        self._generator = torch.Generator().manual_seed(seed)
        self._params = self._parameter_names()
        self._lora_base: dict[str, torch.Tensor] = {}
        """Unadapted copies of the weights adapters have changed (LoRA in the module docstring)."""
        self._lora = AdapterServing(self.model, self._params)

        self._cond = threading.Condition()
        self._incoming: deque[_Sequence] = deque()  # guarded by _cond
        self._loads: deque[_WeightLoad] = deque()  # guarded by _cond
        self._closing = False  # guarded by _cond
        self._waiting: deque[_Sequence] = deque()  # decode thread only
        self._rows: list[_Sequence] = []  # decode thread only, in KV row order
        self._joiners: list[_Sequence] = []  # decode thread only, being admitted this step
        self._kv: _BatchKV | _SlotKV = (
            _SlotKV(self.model, max_batch_size, graphs=cuda_graphs, compile=compile)
            if kv_cache == "slots"
            else _BatchKV()
        )  # decode thread only
        self._thread: threading.Thread | None = None
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._load_lock = anyio.Lock()
        self._status = "created"
        self._last_error = ""
        self.steps = 0
        self.prefill_forwards = 0
        self.prefill_tokens = 0
        """Tokens computed by prefill forwards (padding excluded; a shared prompt counts once)."""
        self.reprefill_tokens = 0
        """Prompt + tokens so far of each request resuming after a weight load (work redone)."""
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.loads = 0
        self.tokens_generated = 0
        self._log = log.bind(engine_id=self.engine_id)

    # ----------------------------------------------------------------- public API

    @property
    def version(self) -> int:
        return self._version

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._token = anyio.lowlevel.current_token()
        self._thread = threading.Thread(target=self._run, name=f"decode-{self.engine_id}", daemon=True)
        self._status = "running"
        self._thread.start()
        self._log.info(
            "engine started",
            device=str(self.device),
            dtype=str(next(self.model.parameters()).dtype),
            max_batch_size=self.max_batch_size,
            version=self._version,
        )

    async def aclose(self) -> None:
        thread = self._thread
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if thread is not None and thread.is_alive():
            # Shielded: a cancelled caller (a worker stopping on SIGTERM) must still wait for the
            # decode thread to leave its step; a torch op running during interpreter teardown aborts
            # the process (SIGABRT). The thread stops at its next step boundary.
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(thread.join)
        if self._status != "closed":
            self._status = "closed"
            self._log.info("engine closed", **self.counters())

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        if not requests:
            return []
        for request in requests:
            self._validate(request)
        self._ensure_running()
        call = _Call(results=[None] * len(requests), remaining=len(requests), done=anyio.Event())
        now = time.perf_counter()
        sequences = []
        for index, request in enumerate(requests):
            seed = request.sampling.seed
            generator = None if seed is None else torch.Generator().manual_seed(seed)
            sequences.append(_Sequence(request, call, index, now, generator))
        with self._cond:
            if self._closing:
                raise EngineClosedError(f"engine {self.engine_id} is closed")
            self._incoming.extend(sequences)
            self._cond.notify_all()
        try:
            await call.done.wait()
        except BaseException:
            with self._cond:
                call.cancelled = True
                self._cond.notify_all()
            raise
        if call.error is not None:
            raise call.error
        assert all(result is not None for result in call.results)
        return list(call.results)  # type: ignore[arg-type]

    async def load_weights(
        self, version: int, location: str | os.PathLike[str] | Mapping[str, torch.Tensor]
    ) -> float:
        started = time.perf_counter()
        adapter = None
        if isinstance(location, Mapping):
            state: Mapping[str, torch.Tensor] = location
        elif lora.is_adapter_dir(location):
            adapter = await anyio.to_thread.run_sync(lora.read_adapter_dir, location)
            state = {}
        else:
            state = await anyio.to_thread.run_sync(read_safetensors_dir, Path(location))
        if adapter is None:
            self._check_state(state)
        else:
            self._lora.check(adapter)
        async with self._load_lock:
            await anyio.to_thread.run_sync(self._lora.wait_landed)  # the last version's merge is in
            unmerged = adapter is not None and self.device.type == "cpu" and self._thread is not None
            hooks = None
            if unmerged:
                hooks = await anyio.to_thread.run_sync(self._lora.unmerged_hooks, adapter)
            elif adapter is not None:
                state = await anyio.to_thread.run_sync(self._merge_adapter, adapter)
            elif adapter is None:
                self._lora_base.clear()  # full weights: the next adapter applies to them
            if self._status == "closed" or self._closing:
                raise EngineClosedError(f"engine {self.engine_id} is closed")
            load = _WeightLoad(
                version=version, state=state, done=anyio.Event(), adopt=adapter is not None,
                adapter=adapter, hooks=hooks,
            )  # fmt: skip
            if self._thread is None:  # not started: nothing is decoding, load directly
                await anyio.to_thread.run_sync(self._install, load)
                self._version = version
                pause_s = 0.0
            else:
                with self._cond:
                    if self._closing:
                        raise EngineClosedError(f"engine {self.engine_id} is closed")
                    self._loads.append(load)
                    self._cond.notify_all()
                await load.done.wait()
                if load.error is not None:
                    raise load.error
                pause_s = load.pause_s
                if unmerged:
                    assert adapter is not None
                    self._lora.start_merge(self._merge_adapter, adapter, self._wake)
        seconds = time.perf_counter() - started
        self._log.info(
            "weights loaded", policy_version=version, seconds=round(seconds, 4), pause_s=round(pause_s, 4)
        )
        return seconds

    def counters(self) -> dict[str, Any]:
        """Work done so far (see the module docstring); read from any thread, values may lag a step."""
        return {
            "steps": self.steps,
            "tokens_generated": self.tokens_generated,
            "prefill_forwards": self.prefill_forwards,
            "prefill_tokens": self.prefill_tokens,
            "reprefill_tokens": self.reprefill_tokens,
            "prefill_s": round(self.prefill_s, 3),
            "decode_s": round(self.decode_s, 3),
            "loads": self.loads,
        }

    async def health(self) -> dict[str, Any]:
        with self._cond:
            incoming = len(self._incoming)
        return {
            "engine_id": self.engine_id,
            "version": self._version,
            "status": self._status,
            "device": str(self.device),
            "max_batch_size": self.max_batch_size,
            "running": sum(1 for s in list(self._rows) if s.alive),
            "waiting": len(self._waiting) + incoming,
            **self.counters(),
            "lora_unmerged": self._lora.unmerged,
            "last_error": self._last_error,
        }

    # ------------------------------------------------------------ validation

    def _ensure_running(self) -> None:
        if self._thread is None:
            raise EngineClosedError(
                f"engine {self.engine_id} is not started; call `await engine.start()` first"
            )
        if self._status == "closed" or self._closing:
            raise EngineClosedError(f"engine {self.engine_id} is closed")

    def _validate(self, request: GenerationRequest) -> None:
        rid = request.request_id
        bad = [t for t in request.prompt_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"request {rid}: prompt token id {bad[0]} >= vocab size {self.vocab_size}; "
                "tokenize with this model's tokenizer"
            )
        total = len(request.prompt_ids) + request.sampling.max_new_tokens
        if self.max_positions is not None and total > self.max_positions:
            raise ValueError(
                f"request {rid}: prompt ({len(request.prompt_ids)} tokens) + max_new_tokens "
                f"({request.sampling.max_new_tokens}) = {total} exceeds the model's max positions "
                f"{self.max_positions}; shorten the prompt or lower max_new_tokens"
            )

    def _check_cache_layout(self) -> None:
        layers = DynamicCache(config=self.model.config).layers
        if any(type(layer) is not DynamicLayer for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers})
            raise NotImplementedError(
                f"LocalEngine supports full-attention models only; this model's cache layers are {kinds}"
            )

    def _wake(self) -> None:
        """Wake the decode thread (a merge has finished)."""
        with self._cond:
            self._cond.notify_all()

    def _merge_adapter(self, adapter: lora.Adapter) -> dict[str, torch.Tensor]:
        """The targeted weights with `adapter` merged, from the base copies (taken on first use)."""
        with torch.no_grad():
            for name in lora.targeted_weights(adapter):
                if name not in self._lora_base:
                    self._lora_base[name] = self._params[name].detach().clone()
            return lora.merge(self._lora_base, adapter.tensors, adapter.scale)

    def _parameter_names(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters(remove_duplicate=False))

    def _check_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Reject a state dict that would leave the model half-loaded, before anything is paused."""
        unexpected = sorted(set(state) - set(self._params))
        if unexpected:
            raise ValueError(
                f"weights have {len(unexpected)} unknown tensors (first: {unexpected[0]!r}); "
                "save them with the model's Hugging Face parameter names"
            )
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(self._params[name].shape):
                raise ValueError(
                    f"weights tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(self._params[name].shape)}"
                )
        covered = {id(self._params[name]) for name in state}
        missing = [name for name, p in self._params.items() if id(p) not in covered]
        if missing:
            raise ValueError(
                f"weights miss {len(missing)} tensors (first: {missing[0]!r}); pass a full checkpoint"
            )
