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
  copied to each of them; a request resuming after a weight load then adds its own tokens so far
  in a second forward on top (`prefill_tokens` counts the tokens computed).
- KV layouts (`kv_cache`), same guarantees, pick by speed:
  - "slots" (default): preallocated per-slot buffers, one column written in place per decode step,
    finished rows replaced by moving rows from the end; no per-step cache copies. Capacity grows to
    the longest admitted prompt + max_new_tokens. On CUDA, `cuda_graphs=True` captures the decode
    forward per (batch bucket, length bucket) and replays it. A grouped-query (GQA) sdpa model
    decodes with its query heads grouped under their K/V head (`packed_gqa_sdpa`), so the K/V
    heads are never repeated per query head.
  - "dynamic": one left-padded transformers DynamicCache; rows are dropped / merged by copying, and
    leading all-padding columns are trimmed.
  Attention masks and explicit position ids keep every row numerically identical (up to float noise)
  to an unpadded forward of the same tokens.
- Log-probs: temperature, then top-k, then top-p shape the distribution a token is sampled from; the
  reported log-prob is under exactly that distribution. Temperature 0 is greedy and reports the log-prob
  under the raw (temperature 1, unfiltered) softmax.
- Seeds: a request with `seed` samples from its own torch.Generator, so its completion depends only on
  seed, prompt and weights (not on what else is in the batch, up to float noise of batched matmuls).
  Requests without a seed draw from the engine generator seeded with `seed`.
- Interruption: `load_weights` reads the checkpoint off the decode thread, then the decode thread pauses
  at its next step boundary, copies the tensors into the model in place, drops the KV cache, sets the
  new version, and re-prefills every running request from prompt + tokens so far before sampling again.
- Threading: all model work runs on one dedicated decode thread; the event loop only queues requests
  and waits on anyio Events, so it never blocks. Use the engine from the event loop it was started in.
- Each result's `stats` holds `queued_s`, `seconds`, `admit_step`, `finish_step` (engine decode-step
  counter), `prefills` (1 + re-prefills after weight loads).

Not supported: sliding-window / hybrid-cache models (rejected at construction).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.from_thread
import anyio.lowlevel
import structlog
import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from areal_async.engines.base import (
    EngineClosedError,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    SamplingParams,
)
from areal_async.models import load_causal_lm, torch_dtype


def cache_kwarg(model: PreTrainedModel, cache: Cache) -> dict[str, Cache]:
    """The KV-cache keyword of ``model.forward``: ``cache`` (transformers >= 5.2x) or ``past_key_values``.

    An unknown keyword would be swallowed by ``**kwargs`` and the cache silently left empty.
    """
    name = _CACHE_KWARG.get(type(model))
    if name is None:
        import inspect

        params = inspect.signature(type(model).forward).parameters
        name = "cache" if "cache" in params else "past_key_values"
        _CACHE_KWARG[type(model)] = name
    return {name: cache}


_CACHE_KWARG: dict[type, str] = {}

log = structlog.get_logger(__name__)

_NO_TOP_P = 2.0  # a top_p the cumulative mass never reaches, so float rounding never filters a token


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

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

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


class _BatchKV:
    """Left-padded KV cache of the running batch: a DynamicCache plus a [B, L] attention mask."""

    def __init__(self, cache: DynamicCache | None = None, mask: torch.Tensor | None = None) -> None:
        self.cache = cache
        self.mask = mask

    @property
    def rows(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    def clear(self) -> None:
        self.cache, self.mask = None, None

    def _layers(self) -> list[DynamicLayer]:
        assert self.cache is not None
        return list(self.cache.layers)

    def select(self, keep: list[int]) -> None:
        """Keep only rows `keep` (in that order) and trim leading columns that are padding in every row."""
        if keep == list(range(self.rows)):
            return
        if not keep:
            self.clear()
            return
        assert self.mask is not None
        index = torch.tensor(keep, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        start = int(mask.any(0).nonzero()[0])
        self.mask = mask[:, start:]
        for layer in self._layers():
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]

    # -- the KV-store interface shared with _SlotKV (decode thread only)

    def retain(self, keep: list[int]) -> list[int]:
        """Keep rows `keep`; return the old row indices in the new row order."""
        self.select(keep)
        return keep

    def reserve(self, tokens: int) -> None:
        """Make room for rows of up to `tokens` tokens (a DynamicCache grows by itself)."""

    def admit(self, new: _BatchKV) -> None:
        """Append the rows of a prefilled (left-padded) batch after the current rows."""
        self.merge(list(range(self.rows)), new)

    def decode(
        self, model: PreTrainedModel, ids_B1: torch.Tensor, positions_B1: torch.Tensor, span: int
    ) -> torch.Tensor:
        """One decode forward for all rows (`span` = longest row incl. the new token); logits [B, V]."""
        assert self.mask is not None and self.rows == ids_B1.shape[0]
        mask = torch.cat([self.mask, self.mask.new_ones(self.rows, 1)], dim=1)
        out = model(
            input_ids=ids_B1,
            attention_mask=mask,
            position_ids=positions_B1,
            use_cache=True,
            **cache_kwarg(model, self.cache),
        )
        self.mask = mask
        return out.logits[:, -1]

    def merge(self, keep: list[int], new: _BatchKV) -> None:
        """Rows `keep` of this batch followed by all rows of `new`, left-padded to a common length."""
        if not keep:
            self.cache, self.mask = new.cache, new.mask
            return
        self.select(keep)
        assert self.mask is not None and new.mask is not None
        length = max(self.mask.shape[1], new.mask.shape[1])
        self.mask = torch.cat([_left_pad(self.mask, length), _left_pad(new.mask, length)])
        for old_layer, new_layer in zip(self._layers(), new._layers(), strict=True):
            old_layer.keys = torch.cat([_left_pad(old_layer.keys, length), _left_pad(new_layer.keys, length)])
            old_layer.values = torch.cat(
                [_left_pad(old_layer.values, length), _left_pad(new_layer.values, length)]
            )


def _left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows left-padded to the longest: ids [B, T] (pad 0) and mask [B, T] (1 on tokens)."""
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, length - len(r) :] = torch.tensor(r)
            mask[i, length - len(r) :] = 1
    return ids, mask


def _left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad dim -1 (masks) or dim -2 (KV [B, H, L, D]) on the left up to `length`."""
    dim = -1 if tensor.dim() == 2 else -2
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad = (missing, 0) if dim == -1 else (0, 0, missing, 0)
    return torch.nn.functional.pad(tensor, pad)


PACKED_GQA_SDPA = "areal_packed_gqa_sdpa"
"""Attention implementation name a slots engine gives a GQA model that uses sdpa."""


def packed_gqa_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """sdpa attention; a one-token query of a GQA layer runs on the K/V heads without repeating them.

    Query head h attends with K/V head h // groups (transformers' `repeat_kv` order), so the query
    [B, heads, 1, D] is viewed as [B, kv_heads, groups, D]: each K/V head answers its `groups` query
    heads as a `groups`-long query, and the mask [B, 1, 1, span] broadcasts over them. Anything else
    (prefill, no GQA, extra options) goes to transformers' sdpa unchanged.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_length, dim = query.shape
    if q_length != 1 or groups == 1 or dropout or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    grouped = query.reshape(batch, heads // groups, groups, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(batch, 1, heads, dim), None


AttentionInterface.register(PACKED_GQA_SDPA, packed_gqa_sdpa)
AttentionMaskInterface.register(PACKED_GQA_SDPA, sdpa_mask)


class _SlotLayer(CacheLayerMixin):
    """One layer's view of `_SlotKV` for one decode forward (query length 1).

    `update` writes each row's new K/V at that row's position in place, then returns the first `span`
    columns; all shapes and addresses are fixed, so the forward can be captured in a CUDA graph.
    """

    is_sliding = False
    is_compileable = True

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, span: int
    ) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.rows, self.positions, self.span = rows, positions, span
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("slot layers are initialised by _SlotKV")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        self.keys[self.rows, :, self.positions] = key_states[:, :, 0]
        self.values[self.rows, :, self.positions] = value_states[:, :, 0]
        return self.keys[:, :, : self.span], self.values[:, :, : self.span]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.span, 0

    def get_seq_length(self) -> int:
        return self.span - 1

    def get_max_length(self) -> int:
        assert self.keys is not None
        return self.keys.shape[2]


class _SlotKV:
    """Preallocated KV slots [max_rows, kv_heads, capacity, head_dim] per layer, rows kept compact.

    Row i holds its tokens at columns 0..length-1 (no padding); a decode step writes one column per row
    in place and attends over the first `span` columns with a [B, 1, 1, span] mask (col <= position).
    Finished rows are replaced by moving rows from the end (only moved rows are copied). With
    `graphs` (CUDA only) each decode forward is captured once per (batch bucket, span bucket) in a CUDA
    graph and replayed; weights are loaded in place, so graphs stay valid across weight updates.
    """

    def __init__(self, model: PreTrainedModel, max_rows: int, *, graphs: bool) -> None:
        config = model.config.get_text_config()
        self.layers = int(config.num_hidden_layers)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.max_rows = max_rows
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        attention = getattr(model.config, "_attn_implementation", "sdpa")
        if attention not in ("sdpa", "eager", PACKED_GQA_SDPA):
            raise NotImplementedError(f"kv_cache='slots' supports sdpa or eager attention, not {attention!r}")
        self.additive_mask = attention == "eager"  # eager adds the mask to the scores; sdpa takes bools
        self.graphs = graphs
        self.granularity = 256 if graphs else 64
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0
        self.rows = 0
        self._captured: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None
        self._static_ids = torch.zeros(max_rows, 1, dtype=torch.long, device=self.device)
        self._static_positions = torch.zeros(max_rows, 1, dtype=torch.long, device=self.device)
        buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if b < max_rows]
        self._batch_buckets = [*buckets, max_rows]

    def clear(self) -> None:
        self.rows = 0

    def reserve(self, tokens: int) -> None:
        if tokens <= self.capacity:
            return
        capacity = -(-tokens // self.granularity) * self.granularity
        if self.max_positions is not None:
            capacity = max(tokens, min(capacity, self.max_positions))
        shape = (self.max_rows, self.kv_heads, capacity, self.head_dim)
        old = self.capacity
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        for new_k, new_v, old_k, old_v in zip(keys, values, self.keys, self.values, strict=False):
            new_k[:, :, :old] = old_k
            new_v[:, :, :old] = old_v
        self.keys, self.values, self.capacity = keys, values, capacity
        self._captured.clear()  # graphs point at the old buffers
        self._pool = None
        log.debug("kv slots resized", rows=self.max_rows, capacity=capacity)

    def retain(self, keep: list[int]) -> list[int]:
        kept, kept_set = len(keep), set(keep)
        holes = [i for i in range(kept) if i not in kept_set]
        movers = [i for i in keep if i >= kept]
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            for tensors in (self.keys, self.values):
                for t in tensors:
                    t.index_copy_(0, dst, t.index_select(0, src))
        order = list(range(kept))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        self.rows = kept
        return order

    def admit(self, new: _BatchKV) -> None:
        assert new.cache is not None and new.mask is not None
        count, width = new.mask.shape
        assert self.rows + count <= self.max_rows and width <= self.capacity
        # a row's tokens sit at its mask's 1-columns (padding before them, and between prompt and
        # tokens after a re-prefill); move them to columns 0.. in order (what follows is never read)
        index = torch.argsort((new.mask == 0).to(torch.int8), dim=1, stable=True)
        index = index[:, None, :, None].expand(count, self.kv_heads, width, self.head_dim)
        start, stop = self.rows, self.rows + count
        for layer, keys, values in zip(new.cache.layers, self.keys, self.values, strict=True):
            keys[start:stop, :, :width] = layer.keys.gather(2, index)
            values[start:stop, :, :width] = layer.values.gather(2, index)
        self.rows = stop

    def decode(
        self, model: PreTrainedModel, ids_B1: torch.Tensor, positions_B1: torch.Tensor, span: int
    ) -> torch.Tensor:
        rows = self.rows
        if not self.graphs:
            return self._forward(model, rows, span, ids_B1, positions_B1)
        batch = next(b for b in self._batch_buckets if b >= rows)
        span = min(-(-span // self.granularity) * self.granularity, self.capacity)
        self._static_ids[:rows] = ids_B1
        self._static_positions[:rows] = positions_B1
        self._static_ids[rows:batch] = 0
        self._static_positions[rows:batch] = 0
        key = (batch, span)
        if key not in self._captured:
            self._captured[key] = self._capture(model, batch, span)
        graph, logits = self._captured[key]
        graph.replay()
        return logits[:rows]

    def _forward(
        self, model: PreTrainedModel, rows: int, span: int, ids_B1: torch.Tensor, positions_B1: torch.Tensor
    ) -> torch.Tensor:
        positions_B = positions_B1[:, 0]
        row_index = torch.arange(rows, device=self.device)
        mask = (torch.arange(span, device=self.device)[None, :] <= positions_B[:, None])[:, None, None, :]
        if self.additive_mask:
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill(
                ~mask, torch.finfo(self.dtype).min
            )
        layers = [
            _SlotLayer(k[:rows], v[:rows], row_index, positions_B, span)
            for k, v in zip(self.keys, self.values, strict=True)
        ]
        out = model(
            input_ids=ids_B1,
            attention_mask=mask,
            position_ids=positions_B1,
            use_cache=True,
            **cache_kwarg(model, Cache(layers=layers)),
        )
        return out.logits[:, -1]

    def _capture(
        self, model: PreTrainedModel, batch: int, span: int
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, positions = self._static_ids[:batch], self._static_positions[:batch]
        # Warm-up (and capture) rewrite the current step's K/V with identical values: harmless.
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(model, batch, span, ids, positions)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(model, batch, span, ids, positions)
        self._pool = graph.pool()
        log.debug("decode graph captured", batch=batch, span=span)
        return graph, logits


def sample_tokens(
    logits_BV: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    fallback: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (token ids [B], log-probs [B] under the sampled distribution).

    Per row: temperature, then top-k, then top-p, then inverse-CDF sampling from the processed
    distribution with one uniform drawn from the row's generator (or `fallback`); generators are CPU
    generators whatever the logits' device. Temperature 0 rows take the argmax and report the log-prob
    under the raw softmax.
    """
    logits_BV = logits_BV.float()
    batch, vocab = logits_BV.shape
    device = logits_BV.device
    greedy = [p.temperature == 0 for p in params]
    temps = torch.tensor(
        [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)], device=device
    )
    scores_BV = logits_BV / temps[:, None]
    top_k = [p.top_k if p.top_k and not g else vocab for g, p in zip(greedy, params, strict=True)]
    top_p = [p.top_p if p.top_p < 1 and not g else _NO_TOP_P for g, p in zip(greedy, params, strict=True)]
    if any(k < vocab for k in top_k) or any(p < 1 for p in top_p):
        sorted_BV, order_BV = scores_BV.sort(dim=-1, descending=True)
        kth_B1 = sorted_BV.gather(1, torch.tensor(top_k, device=device)[:, None].clamp(max=vocab) - 1)
        sorted_BV = sorted_BV.masked_fill(sorted_BV < kth_B1, float("-inf"))
        probs_BV = sorted_BV.softmax(dim=-1)
        mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV
        drop_sorted_BV = mass_before_BV >= torch.tensor(top_p, device=device)[:, None]
        drop_sorted_BV |= sorted_BV == float("-inf")
        drop_sorted_BV[:, 0] = False
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(1, order_BV, drop_sorted_BV)
        scores_BV = scores_BV.masked_fill(drop_BV, float("-inf"))
    logprobs_BV = scores_BV.log_softmax(dim=-1)
    # Inverse-CDF sampling: one uniform per row (cheap on CPU, unlike a vocab-sized noise draw). A
    # zero-probability token never raises the CDF, so `right=True` never lands on it.
    uniforms = [0.0] * batch
    shared = [i for i, g in enumerate(generators) if g is None and not greedy[i]]
    for i, u in zip(shared, torch.rand(len(shared), generator=fallback).tolist(), strict=True):
        uniforms[i] = u
    for i, generator in enumerate(generators):
        if generator is not None and not greedy[i]:
            uniforms[i] = float(torch.rand(1, generator=generator))
    cdf_BV = logprobs_BV.exp().cumsum(dim=-1)
    # keep u * total strictly below the total despite float32 rounding
    u_B1 = torch.tensor(uniforms, device=device).clamp(max=1 - 1e-6)[:, None] * cdf_BV[:, -1:]
    tokens_B = torch.searchsorted(cdf_BV, u_B1, right=True)[:, 0].clamp(max=vocab - 1)
    if any(greedy):
        greedy_B = torch.tensor(greedy, device=device)
        tokens_B = torch.where(greedy_B, logprobs_BV.argmax(dim=-1), tokens_B)
    return tokens_B, logprobs_BV.gather(1, tokens_B[:, None])[:, 0]


class LocalEngine(InferenceEngine):
    """Transformers causal LM served in-process (CPU or CUDA); see the module docstring."""

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
        prefill_min_rows: int | None = None,
    ) -> None:
        if kv_cache not in ("dynamic", "slots"):
            raise ValueError(f"kv_cache must be 'dynamic' or 'slots', got {kv_cache!r}")
        if cuda_graphs and (kv_cache != "slots" or torch.device(device).type != "cuda"):
            raise ValueError("cuda_graphs=True needs kv_cache='slots' and a CUDA device")
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
        self._version = version
        self._generator = torch.Generator().manual_seed(seed)
        self._params = self._parameter_names()

        self._cond = threading.Condition()
        self._incoming: deque[_Sequence] = deque()  # guarded by _cond
        self._loads: deque[_WeightLoad] = deque()  # guarded by _cond
        self._closing = False  # guarded by _cond
        self._waiting: deque[_Sequence] = deque()  # decode thread only
        self._rows: list[_Sequence] = []  # decode thread only, in KV row order
        self._joiners: list[_Sequence] = []  # decode thread only, being admitted this step
        self._kv: _BatchKV | _SlotKV = (
            _SlotKV(self.model, max_batch_size, graphs=cuda_graphs) if kv_cache == "slots" else _BatchKV()
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
            self._log.info("engine closed", steps=self.steps, tokens_generated=self.tokens_generated)

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
        if isinstance(location, Mapping):
            state: Mapping[str, torch.Tensor] = location
        else:
            state = await anyio.to_thread.run_sync(read_safetensors_dir, Path(location))
        self._check_state(state)
        async with self._load_lock:
            if self._status == "closed" or self._closing:
                raise EngineClosedError(f"engine {self.engine_id} is closed")
            if self._thread is None:  # not started: nothing is decoding, load directly
                await anyio.to_thread.run_sync(self._apply_weights, state)
                self._version = version
                pause_s = 0.0
            else:
                load = _WeightLoad(version=version, state=state, done=anyio.Event())
                with self._cond:
                    if self._closing:
                        raise EngineClosedError(f"engine {self.engine_id} is closed")
                    self._loads.append(load)
                    self._cond.notify_all()
                await load.done.wait()
                if load.error is not None:
                    raise load.error
                pause_s = load.pause_s
        seconds = time.perf_counter() - started
        self._log.info(
            "weights loaded", policy_version=version, seconds=round(seconds, 4), pause_s=round(pause_s, 4)
        )
        return seconds

    async def health(self) -> dict[str, Any]:
        with self._cond:
            incoming = len(self._incoming)
        return {
            "engine_id": self.engine_id,
            "version": self._version,
            "status": self._status,
            "device": str(self.device),
            "max_batch_size": self.max_batch_size,
            "running": len(self._rows),
            "waiting": len(self._waiting) + incoming,
            "steps": self.steps,
            "prefill_forwards": self.prefill_forwards,
            "tokens_generated": self.tokens_generated,
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

    def _apply_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in state.items():
                self._params[name].copy_(tensor, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---------------------------------------------------------- decode thread

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._closing or self._loads or self._incoming or self._waiting or self._rows):
                        self._cond.wait()
                    if self._closing:
                        break
                    self._waiting.extend(self._incoming)
                    self._incoming.clear()
                    load = self._loads.popleft() if self._loads else None
                if load is not None:
                    self._load_at_boundary(load)
                    continue
                try:
                    finished = self._step()
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
            self._apply_weights(load.state)
        except Exception as exc:
            load.error = exc
            self._last_error = repr(exc)
        else:
            self._version = load.version  # before any token is sampled with the new weights
            # Old-weight KV is invalid: running requests re-prefill from prompt + tokens so far, first.
            self._kv.clear()
            self._waiting.extendleft(reversed([s for s in self._rows if s.alive]))
            self._rows = []
        load.pause_s = time.perf_counter() - started
        self._signal([load.done])

    def _step(self) -> list[_Sequence]:
        """One scheduling step: retire, admit (prefill), decode. Returns sequences that finished."""
        # Rows that finished last step were reported then; they leave the KV here.
        finished: list[_Sequence] = []
        keep = [i for i, s in enumerate(self._rows) if s.alive]
        joiners = self._joiners
        free = self.max_batch_size - len(keep)
        admit = not keep or free >= min(self.prefill_min_rows, len(self._waiting))
        while admit and self._waiting and len(keep) + len(joiners) < self.max_batch_size:
            sequence = self._waiting.popleft()
            if sequence.alive:
                joiners.append(sequence)
        with torch.inference_mode():
            rows = [self._rows[i] for i in self._kv.retain(keep)]
            if joiners:
                new_kv, joiners[:] = self._prefill(joiners)
                finished += [s for s in joiners if s.finish_reason is not None]
                live = [s for s in joiners if s.alive]
                new_kv.select([i for i, s in enumerate(joiners) if s.alive])
                if live:
                    self._kv.reserve(max(len(s.request.prompt_ids) + s.sampling.max_new_tokens for s in live))
                    self._kv.admit(new_kv)
                rows += live
                joiners.clear()
            self._rows = rows
            if self._rows:
                self._decode()
                finished += [s for s in self._rows if s.finish_reason is not None]
        return finished

    def _prefill(self, joiners: list[_Sequence]) -> tuple[_BatchKV, list[_Sequence]]:
        """Prefill joiners (prompt + tokens so far) in chunks of <= max_prefill_tokens padded tokens.

        Returns the joiners' KV and the joiners in its row order (sorted by length, less padding).
        """
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
        return merged, [joiners[i] for chunk in chunks for i in chunk]

    def _prefill_chunk(self, sequences: list[_Sequence]) -> _BatchKV:
        """Prefill `sequences` (prompt + tokens so far) and sample each one's next token.

        Each distinct prompt is computed once (a group's samples share theirs): a forward over the
        distinct prompts (left-padded), their KV copied to every row that shares the prompt, then,
        for rows that already hold tokens (re-prefill after a weight load), a second forward over
        those tokens (left-padded) on top. The row mask then has padding before the prompt and
        between prompt and tokens; attention and position ids skip it.
        """
        now = time.perf_counter()
        for s in sequences:
            if s.prefills == 0:
                s.admitted_at, s.admit_step = now, self.steps
            s.prefills += 1
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

    def _decode(self) -> None:
        rows = self._rows
        ids = torch.tensor([[s.token_ids[-1]] for s in rows], device=self.device)
        positions = torch.tensor([[s.length - 1] for s in rows], device=self.device)
        logits = self._kv.decode(self.model, ids, positions, max(s.length for s in rows))
        self.steps += 1
        self._sample(rows, logits)

    def _sample(self, sequences: list[_Sequence], logits_BV: torch.Tensor) -> None:
        tokens_B, logprobs_B = sample_tokens(
            logits_BV, [s.sampling for s in sequences], [s.generator for s in sequences], self._generator
        )
        version = self._version
        for s, token, logprob in zip(sequences, tokens_B.tolist(), logprobs_B.tolist(), strict=True):
            s.token_ids.append(token)
            s.logprobs.append(logprob)
            s.versions.append(version)
            if token in s.sampling.stop_token_ids:
                s.finish_reason = "stop"
            elif len(s.token_ids) >= s.sampling.max_new_tokens:
                s.finish_reason = "length"
        self.tokens_generated += len(sequences)

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
            if s.call.error is None and not s.call.cancelled:
                s.call.error = error
                events.append(s.call.done)
        self._signal(events)

    def _shutdown(self) -> None:
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


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF safetensors checkpoint directory (single file or sharded), on CPU."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        return load_file(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {path}; expected a Hugging Face checkpoint directory"
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state
