"""The "slots" KV layout of the local engine: preallocated per-slot buffers, written in place.

`_SlotKV` implements the KV-store interface of `kv.py` (layout, compaction and CUDA graphs in its
docstring); `_SlotLayer` is how one forward reads and writes the slots. `slot_decode_forward` and
`slot_prefill_step` are the forwards it runs, `torch.compile`d once each with `compile=True`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog
import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from areal_async.engines.local.gqa_decode import PACKED_GQA_SDPA
from areal_async.engines.local.kv import _cache_name, _DecodeRows
from areal_async.engines.local.sampling import decode_draws

log = structlog.get_logger(__name__)


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
