"""The FSDP root module of the training engine: decoder -> hidden states -> logprobs and entropy
of the selected tokens only (the `[tokens, vocab]` logits never exist for a whole micro-batch)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

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
        return logprobs.of_selected(
            self.logprob_fn,
            hidden.last_hidden_state.flatten(0, 1),
            input_ids,
            hidden_index,
            self.hf.get_output_embeddings(),
            self.temperature,
            with_entropy,
            self.chunk_tokens,
        )
