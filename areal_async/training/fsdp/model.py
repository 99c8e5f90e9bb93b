"""The FSDP root module of the training engine: decoder -> hidden states -> logprobs and entropy
of the selected tokens only (the `[tokens, vocab]` logits never exist for a whole micro-batch).
Under context parallelism (`training/context_parallel.py`) each rank runs the decoder on its part
of the packed row, the attention function gathers the group's keys and values, and the selected
rows' logprobs are gathered from the group."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from areal_async.ops import logprobs
from areal_async.training.context_parallel import ContextPart, gather_logprobs


class TokenLogprobModel(nn.Module):
    """FSDP root: decoder -> hidden states -> logprobs/entropy of the selected tokens only."""

    def __init__(
        self,
        hf: nn.Module,
        *,
        temperature: float,
        chunk_tokens: int,
        logprob_fn: logprobs.LogprobFn,
        context_group: Any = None,
        pad_token_id: int = 0,
    ) -> None:
        super().__init__()
        self.hf = hf
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens
        self.logprob_fn = logprob_fn
        """One of the forms in `ops/logprobs.py`."""
        self.context_group = context_group
        """The context-parallel group (None: every rank holds whole rows)."""
        self.pad_token_id = pad_token_id

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
        part, targets = None, input_ids
        if cu_seqlens is not None:  # read by varlen.packed_attention_forward in every layer
            packed = {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens}
            packed |= {"max_length_q": max_length, "max_length_k": max_length}
            if self.context_group is not None:
                part, input_ids, position_ids, hidden_index, targets = ContextPart.of(
                    self.context_group, input_ids, position_ids, hidden_index, cu_seqlens, self.pad_token_id
                )
                packed["context_part"] = part
        hidden = self.hf.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **packed
        )
        logprobs_N, entropy_N = logprobs.of_selected(
            self.logprob_fn,
            hidden.last_hidden_state.flatten(0, 1),
            targets,
            hidden_index,
            self.hf.get_output_embeddings(),
            self.temperature,
            with_entropy,
            self.chunk_tokens,
        )
        if part is None:
            return logprobs_N, entropy_N
        return gather_logprobs(part, logprobs_N, entropy_N)
