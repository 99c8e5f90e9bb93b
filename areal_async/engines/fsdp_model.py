"""The FSDP root module of the training engine: decoder -> hidden states -> logprobs and entropy
of the selected tokens only (the `[tokens, vocab]` logits never exist for a whole micro-batch)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from areal_async.engines import logprobs


class TokenLogprobModel(nn.Module):
    """FSDP root: decoder -> hidden states -> logprobs/entropy of the selected tokens only."""

    def __init__(
        self, hf: nn.Module, *, temperature: float, chunk_tokens: int, logprob_fn: logprobs.LogprobFn
    ) -> None:
        super().__init__()
        self.hf = hf
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens
        self.logprob_fn = logprob_fn
        """One of the forms in `engines/logprobs.py`."""

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        hidden_index: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_length: int = 0,
        with_entropy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs and entropy `[n]` of the tokens at `hidden_index + 1` (`batching.ModelInputs`).

        With `cu_seqlens` the row is packed and the decoder must run one of `varlen.ATTN_IMPLEMENTATIONS`.
        """
        packed: dict[str, Any] = {}
        if cu_seqlens is not None:  # read by varlen.packed_attention_forward in every layer
            packed = {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens}
            packed |= {"max_length_q": max_length, "max_length_k": max_length}
        hidden = self.hf.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **packed
        )
        hidden_BTH = hidden.last_hidden_state
        head = self.hf.get_output_embeddings()
        n, chunk = hidden_index.shape[0], self.chunk_tokens
        if n == 0:
            # Keep every parameter in the graph: all ranks must run the same gradient reductions.
            anchor = head(hidden_BTH[:1, :1]).float().sum() * 0.0
            zeros = torch.zeros(0, dtype=torch.float32, device=input_ids.device) + anchor
            return zeros, zeros.detach()
        # Indices come from the host: no device-to-host sync, unlike a boolean-mask select.
        hidden_NH = hidden_BTH.flatten(0, 1).index_select(0, hidden_index)
        targets_N = input_ids.flatten().index_select(0, hidden_index + 1)
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        for start in range(0, n, chunk):
            args = (
                hidden_NH[start : start + chunk],
                targets_N[start : start + chunk],
                head,
                self.temperature,
                with_entropy,
            )
            if torch.is_grad_enabled() and n > chunk:
                parts.append(checkpoint(self.logprob_fn, *args, use_reentrant=False))
            else:
                parts.append(self.logprob_fn(*args))
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
