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
    return {_cache_name(model): cache}


def _cache_name(model: PreTrainedModel) -> str:
    name = _CACHE_KWARG.get(type(model))
    if name is None:
        import inspect

        params = inspect.signature(type(model).forward).parameters
        name = "cache" if "cache" in params else "past_key_values"
        _CACHE_KWARG[type(model)] = name
    return name


_CACHE_KWARG: dict[type, str] = {}

log = structlog.get_logger(__name__)

_NO_TOP_P = 2.0  # a top_p the cumulative mass never reaches, so float rounding never filters a token
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


_STAND_IN = (0, 0, 1.0, 0.0, False)
"""Decode inputs of a finished row that still holds its slot: token 0 at position 0, temperature 1."""


@dataclass(eq=False)
class _DecodeRows:
    """Host inputs of one decode step, one entry per KV row (`_STAND_IN` for a finished row)."""

    ids: list[int]
    positions: list[int]
    temperatures: list[float]
    uniforms: list[float]
    greedy: list[bool]


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

    def compacts(self, live: int) -> bool:
        """Whether finished rows leave now; here always, as each row costs every cache copy."""
        return True

    def admit(self, new: _BatchKV) -> None:
        """Append the rows of a prefilled (left-padded) batch after the current rows."""
        self.merge(list(range(self.rows)), new)

    def decode(
        self, model: PreTrainedModel, rows: _DecodeRows, span: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode forward for all rows (`span` = longest row incl. the new token).

        Returns the logits [B, V] and no fused draws (the caller samples)."""
        assert self.mask is not None and self.rows == len(rows.ids)
        device = self.mask.device
        ids_B1 = torch.tensor(rows.ids, device=device)[:, None]
        positions_B1 = torch.tensor(rows.positions, device=device)[:, None]
        mask = torch.cat([self.mask, self.mask.new_ones(self.rows, 1)], dim=1)
        out = model(
            input_ids=ids_B1,
            attention_mask=mask,
            position_ids=positions_B1,
            use_cache=True,
            **cache_kwarg(model, self.cache),
        )
        self.mask = mask
        return out.logits[:, -1], None

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
    """One layer's view of `_SlotKV` for one forward.

    `update` writes token t of input row b at slot `rows[b]`, column `positions[b, t]`, in place. A decode
    (`span` set) then attends over the first `span` columns of slots 0..B-1, whose rows it is; a prefill
    (`span` None) attends over its own new tokens only (its rows start empty). Shapes and addresses depend
    only on (B, T, span), so a decode forward can be captured in a CUDA graph.
    """

    is_sliding = False
    is_compileable = True

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        rows_B: torch.Tensor,
        positions_BT: torch.Tensor,
        span: int | None,
    ) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.rows_B1, self.positions_BT, self.span = rows_B[:, None], positions_BT, span
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("slot layers are initialised by _SlotKV")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        self.keys[self.rows_B1, :, self.positions_BT] = key_states.transpose(1, 2)
        self.values[self.rows_B1, :, self.positions_BT] = value_states.transpose(1, 2)
        if self.span is None:
            return key_states, value_states
        batch = key_states.shape[0]
        return self.keys[:batch, :, : self.span], self.values[:batch, :, : self.span]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (query_length if self.span is None else self.span), 0

    def get_seq_length(self) -> int:
        return 0 if self.span is None else self.span - 1

    def get_max_length(self) -> int:
        assert self.keys is not None
        return self.keys.shape[2]


def _slot_forward(
    model: PreTrainedModel,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    ids_BT: torch.Tensor,
    positions_BT: torch.Tensor,
    rows_B: torch.Tensor,
    mask: torch.Tensor,
    span: int | None,
    cache_name: str,
) -> torch.Tensor:
    """Forward `ids` through the model, K/V written into the slots (see `_SlotLayer`); logits of each
    row's last input column [B, V]. `mask` [B, 1, T, keys] is boolean (sdpa) or additive (eager)."""
    layers = [_SlotLayer(k, v, rows_B, positions_BT, span) for k, v in zip(keys, values, strict=True)]
    out = model(
        input_ids=ids_BT,
        attention_mask=mask,
        position_ids=positions_BT,
        use_cache=True,
        logits_to_keep=1,
        **{cache_name: Cache(layers=layers)},
    )
    return out.logits[:, -1]


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as eager attention takes it: 0 where attended, the dtype's minimum elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def slot_decode_forward(
    model: PreTrainedModel,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    inputs_B5: torch.Tensor,
    columns_S: torch.Tensor,
    additive: bool,
    cache_name: str,
) -> torch.Tensor:
    """One decode forward of slots 0..B-1 over their first `S = len(columns_S)` columns; logits [B, V].

    `inputs_B5` columns: token id, position, temperature, uniform, greedy (1.0) per slot, as float32
    (exact for ids and positions below 2**24), so that one host-to-device copy feeds the step.
    """
    ids_B1 = inputs_B5[:, 0:1].long()
    positions_B1 = inputs_B5[:, 1:2].long()
    rows_B = torch.arange(ids_B1.shape[0], device=ids_B1.device)
    mask = (columns_S[None, :] <= positions_B1)[:, None, None, :]
    if additive:
        mask = _additive(mask, keys[0].dtype)
    return _slot_forward(
        model, keys, values, ids_B1, positions_B1, rows_B, mask, columns_S.shape[0], cache_name
    )


def decode_draws(logits_BV: torch.Tensor, inputs_B5: torch.Tensor) -> torch.Tensor:
    """One draw per row of `slot_decode_forward`'s logits from its tempered, unfiltered distribution
    (`draw_tokens`); returns token ids and their log-probs [2, B] as float64 (one copy to the host).
    Rows with top-k / top-p are sampled from the logits instead."""
    tokens_B, logprobs_B = draw_tokens(
        logits_BV.float() / inputs_B5[:, 2:3], inputs_B5[:, 3], inputs_B5[:, 4] > 0
    )
    return torch.stack([tokens_B.double(), logprobs_B.double()])


def slot_prefill_step(
    model: PreTrainedModel,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    ids_BT: torch.Tensor,
    positions_BT: torch.Tensor,
    rows_B: torch.Tensor,
    additive: bool,
    cache_name: str,
) -> torch.Tensor:
    """Prefill input row b (left-padded) into the empty slot `rows_B[b]`; logits of its last token.

    Causal by position: a token attends to the tokens of its row at positions <= its own. Padding
    tokens take the positions after the row's last token, so no real token sees them (their K/V land
    in columns the row's decode steps overwrite before reading)."""
    mask = (positions_BT[:, None, :] <= positions_BT[:, :, None])[:, None]
    if additive:
        mask = _additive(mask, keys[0].dtype)
    return _slot_forward(model, keys, values, ids_BT, positions_BT, rows_B, mask, None, cache_name)


class _SlotKV:
    """Preallocated KV slots [max_rows + 1, kv_heads, capacity, head_dim] per layer, rows kept compact.

    Row i holds its tokens at columns 0..length-1 (no padding); a prefill writes a joining row's tokens
    straight into its slot, a decode step writes one column per row in place and attends over the first
    `span` columns with a [B, 1, 1, span] mask (col <= position). The last slot is scratch (padding rows
    of a compiled prefill write there). Finished rows leave by moving rows from the end into their slots
    (only moved rows are copied); with CUDA graphs that waits until rows join or the batch fits a smaller
    graph, and a finished row decodes a stand-in token meanwhile.

    With `graphs` (CUDA only) each decode step (forward + draws) is captured once per (batch bucket,
    span bucket) in a CUDA graph and replayed; weights are loaded in place, so graphs stay valid across
    weight updates. With `compile` the decode forward and the prefill are `torch.compile`d once each,
    dynamic in batch, length and capacity; the graphs capture the compiled forward and the draws.
    """

    def __init__(self, model: PreTrainedModel, max_rows: int, *, graphs: bool, compile: bool) -> None:
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
        self.cache_name = _cache_name(model)
        self.graphs, self.compile = graphs, compile
        self.granularity = 256 if graphs else 64
        self.slots = max_rows + 1
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0
        self.rows = 0
        self._columns = torch.zeros(0, dtype=torch.long, device=self.device)
        self._captured: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool: Any = None
        cuda = self.device.type == "cuda"
        self._host = torch.zeros(self.slots, 5, dtype=torch.float32, pin_memory=cuda)
        self._inputs = (
            torch.zeros(self.slots, 5, dtype=torch.float32, device=self.device) if cuda else self._host
        )
        # a size-1 dimension would be specialised by torch.compile (one more compile): start at 2
        smallest = 2 if compile else 1
        buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if smallest <= b < max_rows]
        self._batch_buckets = [*buckets, max(max_rows, smallest)]
        self._decode_forward: Any = slot_decode_forward
        self._prefill_step: Any = slot_prefill_step
        if compile:
            # The draws stay uncompiled (captured as they are): on torch 2.11 Inductor fails to
            # generate their vocabulary-wide reductions (argmax, then the cumsum's split scan) over
            # 152k columns with a dynamic batch.
            self._decode_forward = torch.compile(slot_decode_forward)
            self._prefill_step = torch.compile(slot_prefill_step)

    def clear(self) -> None:
        self.rows = 0

    def compacts(self, live: int) -> bool:
        """Whether finished rows leave now. Eagerly a dead row costs its share of every step; in a
        graph it costs next to nothing until the batch would fit a smaller graph."""
        if not self.graphs or live == 0:
            return live < self.rows
        return self._bucket(live) < self._bucket(self.rows)

    def _bucket(self, rows: int) -> int:
        return next(b for b in self._batch_buckets if b >= rows)

    def reserve(self, tokens: int) -> None:
        if tokens <= self.capacity:
            return
        capacity = -(-tokens // self.granularity) * self.granularity
        if self.max_positions is not None:
            capacity = max(tokens, min(capacity, self.max_positions))
        shape = (self.slots, self.kv_heads, capacity, self.head_dim)
        old = self.capacity
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        for new_k, new_v, old_k, old_v in zip(keys, values, self.keys, self.values, strict=False):
            new_k[:, :, :old] = old_k
            new_v[:, :, :old] = old_v
        if self.compile:  # one compiled graph for every engine size and capacity
            for tensor in (*keys, *values):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
                torch._dynamo.maybe_mark_dynamic(tensor, 2)
        self.keys, self.values, self.capacity = keys, values, capacity
        self._columns = torch.arange(capacity, device=self.device)
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
            self.copy_rows(dst, src)
        order = list(range(kept))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        self.rows = kept
        return order

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the K/V of slots `src` into slots `dst` (every layer, every column)."""
        for tensors in (self.keys, self.values):
            for t in tensors:
                t.index_copy_(0, dst, t.index_select(0, src))

    def prefill(
        self, model: PreTrainedModel, sequences: list[Sequence[int]], slots: list[int]
    ) -> torch.Tensor:
        """Write the K/V of token rows `sequences` into the empty `slots` (one forward, left-padded);
        return the logits of each row's last token [len(sequences), V]."""
        count, length = len(sequences), max(len(t) for t in sequences)
        rows = list(slots)
        if self.compile:  # pad to >= 2 rows of >= 2 tokens: torch.compile specialises size-1 dims
            length = max(length, 2)
            rows += [self.max_rows] * max(0, 2 - count)
            sequences = [*sequences, *[[0]] * (len(rows) - count)]
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        lengths = torch.tensor([len(t) for t in sequences])
        for i, tokens in enumerate(sequences):
            ids[i, length - len(tokens) :] = torch.tensor(tokens)
        # tokens get positions 0..L-1 in their columns; the padding before them L..length-1
        positions = (torch.arange(length)[None, :] - (length - lengths)[:, None]) % length
        ids, positions = ids.to(self.device), positions.to(self.device)
        rows_B = torch.tensor(rows, device=self.device)
        if self.compile:
            for tensor in (ids, positions):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
                torch._dynamo.maybe_mark_dynamic(tensor, 1)
            torch._dynamo.maybe_mark_dynamic(rows_B, 0)
        with _static_shape_names():
            logits = self._prefill_step(
                model, self.keys, self.values, ids, positions, rows_B, self.additive_mask, self.cache_name
            )
        return logits[:count]

    def decode(
        self, model: PreTrainedModel, rows: _DecodeRows, span: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step of all rows; returns the logits [B, V] and the draws [2, B] of
        `decode_draws` (valid for rows without top-k / top-p)."""
        count = self.rows
        assert len(rows.ids) == count
        batch = self._bucket(count) if self.graphs else count
        host = self._host.numpy()
        for column, values in enumerate(
            (rows.ids, rows.positions, rows.temperatures, rows.uniforms, rows.greedy)
        ):
            host[:count, column] = values
        host[count:batch] = (0.0, 0.0, 1.0, 0.0, 0.0)  # padding rows: token 0 at column 0
        inputs = self._inputs[:batch]
        if inputs.data_ptr() != self._host.data_ptr():
            inputs.copy_(self._host[:batch], non_blocking=True)
        if not self.graphs:
            return self._call_decode_step(model, inputs, self._columns[:span])
        span = min(-(-span // self.granularity) * self.granularity, self.capacity)
        key = (batch, span)
        if key not in self._captured:
            self._captured[key] = self._capture(model, batch, span)
        graph, logits, draws = self._captured[key]
        graph.replay()
        return logits[:count], draws[:, :count]

    def _capture(
        self, model: PreTrainedModel, batch: int, span: int
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        inputs, columns = self._inputs[:batch], self._columns[:span]
        # Warm-up (and capture) rewrite the current step's K/V with identical values: harmless.
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # the first call of a compiled step compiles it
                self._call_decode_step(model, inputs, columns)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, draws = self._call_decode_step(model, inputs, columns)
        self._pool = graph.pool()
        log.debug("decode graph captured", batch=batch, span=span, compiled=self.compile)
        return graph, logits, draws

    def _call_decode_step(
        self, model: PreTrainedModel, inputs: torch.Tensor, columns: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.compile:
            torch._dynamo.maybe_mark_dynamic(inputs, 0)
            torch._dynamo.maybe_mark_dynamic(columns, 0)
        with _static_shape_names():
            logits = self._decode_forward(
                model, self.keys, self.values, inputs, columns, self.additive_mask, self.cache_name
            )
        return logits, decode_draws(logits, inputs)


def _static_shape_names() -> Any:
    """Keep torch.compile from equating dimensions that happen to be equal at the first call (a batch
    of 256 in slots of capacity 256), which would cost a recompile when they differ later."""
    from torch.fx.experimental import _config

    return _config.patch(use_duck_shape=False)


def draw_tokens(
    scores_BV: torch.Tensor, uniforms_B: torch.Tensor, greedy_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of softmax(scores) by inverse CDF with `uniforms_B`, the argmax where `greedy_B`;
    returns (token ids [B], their log-probs under softmax(scores) [B]).

    A greedy row walks the CDF of its maximal scores with u = 0, which lands on the first of them (as
    `argmax` does) without an arg-reduction over the vocabulary. A zero-probability token never raises
    the CDF, so `right=True` never lands on it."""
    logprobs_BV = scores_BV.log_softmax(dim=-1)
    top_B1 = scores_BV.amax(dim=-1, keepdim=True)
    weights_BV = torch.where(greedy_B[:, None], (scores_BV == top_B1).float(), logprobs_BV.exp())
    cdf_BV = weights_BV.cumsum(dim=-1)
    # keep u * total strictly below the total despite float32 rounding
    u_B = torch.where(greedy_B, 0.0, uniforms_B.clamp(max=1 - 1e-6))
    tokens_B = torch.searchsorted(cdf_BV, u_B[:, None] * cdf_BV[:, -1:], right=True)[:, 0]
    tokens_B = tokens_B.clamp(max=scores_BV.shape[-1] - 1)
    return tokens_B, logprobs_BV.gather(1, tokens_B[:, None])[:, 0]


def is_filtered(params: SamplingParams, vocab: int) -> bool:
    """Whether top-k or top-p cut this request's distribution (never for greedy rows)."""
    if params.temperature == 0:
        return False
    return bool(params.top_k and params.top_k < vocab) or params.top_p < 1


def sample_tokens(
    logits_BV: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (token ids [B], log-probs [B] under the sampled distribution).

    Per row: temperature, then top-k, then top-p, then inverse-CDF sampling from the processed
    distribution with that row's uniform in [0, 1). Temperature 0 rows take the argmax and report the
    log-prob under the raw softmax.
    """
    logits_BV = logits_BV.float()
    vocab = logits_BV.shape[1]
    device = logits_BV.device
    greedy = [p.temperature == 0 for p in params]
    temps = torch.tensor(
        [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)], device=device
    )
    scores_BV = logits_BV / temps[:, None]
    if any(is_filtered(p, vocab) for p in params):
        top_k = [p.top_k if p.top_k and not g else vocab for g, p in zip(greedy, params, strict=True)]
        top_p = [p.top_p if p.top_p < 1 and not g else _NO_TOP_P for g, p in zip(greedy, params, strict=True)]
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
    return draw_tokens(
        scores_BV,
        torch.tensor(list(uniforms), dtype=torch.float32, device=device),
        torch.tensor(greedy, device=device),
    )


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
        compile: bool = False,
        prefill_min_rows: int | None = None,
        kv_after_load: Literal["recompute", "keep"] = "recompute",
    ) -> None:
        if kv_after_load not in ("recompute", "keep"):
            raise ValueError(f"kv_after_load must be 'recompute' or 'keep', got {kv_after_load!r}")
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
        """What running requests do at a weight load: re-prefill ("recompute") or keep their KV."""
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
            self.loads += 1
            if self.kv_after_load == "recompute":
                # Running requests re-prefill from prompt + tokens so far with the new weights, first.
                self._kv.clear()
                self._waiting.extendleft(reversed([s for s in self._rows if s.alive]))
                self._rows = []
        load.pause_s = time.perf_counter() - started
        self._signal([load.done])

    def _step(self) -> list[_Sequence]:
        """One scheduling step: retire, admit (prefill), decode. Returns sequences that finished."""
        # Rows that finished last step were reported then; they leave the KV when it compacts.
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
