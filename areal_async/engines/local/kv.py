"""KV stores of the local engine: the interface both layouts share, and the "dynamic" layout.

A KV store holds one row per running sequence, in the engine's row order, and is used by the
decode thread only: `retain(keep)` keeps rows `keep` and returns the old row indices in the new
order, `compacts(live)` says whether finished rows leave now, `decode(model, rows, span)` runs one
decode forward of every row and returns the logits [B, V] (and the draws where the layout fuses
them), `clear()` drops every row. `_BatchKV` ("dynamic") is a left-padded transformers
DynamicCache plus a [B, L] attention mask; the "slots" layout is `slots._SlotKV`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer


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
