"""One matmul for q/k/v and one for gate/up in Llama and Qwen2 decoder layers (training forwards).

With hidden size 896 (Qwen2-0.5B) the k and v projections have 128 outputs each: as separate
matmuls they are thin, memory-bound products whose weight gradients run split-K, and each of
q/k/v and gate/up reads the layer input again. `fuse_projections(model)` makes every supported
attention and MLP module concatenate its weights at each call (~1M elements for q/k/v, ~9M for
gate/up: a copy far smaller than the activations) and run one matmul forward, one for the input
gradient and one for the weight gradient. Autograd slices the gradient back to the original
parameters, so parameter names, checkpoints and published weights do not change.

Supported: the attention and MLP classes of the Llama and Qwen2 families in transformers
(`SUPPORTED_ATTENTION`, `SUPPORTED_MLP`); other modules are left as they are. The fused
attention serves forwards without a KV cache (training, scoring), which is how the trainer runs.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_ATTENTION = ("LlamaAttention", "Qwen2Attention")
SUPPORTED_MLP = ("LlamaMLP", "Qwen2MLP")


def _fused_linear(x: torch.Tensor, projections: tuple[nn.Linear, ...]) -> torch.Tensor:
    weight = torch.cat([p.weight for p in projections])
    biases = [p.bias for p in projections]
    bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
    return F.linear(x, weight, bias)


class _FusedAttention:
    """Mixed in before a supported attention class: q/k/v in one matmul, then the class's own
    rotary embedding and attention function (transformers' `ALL_ATTENTION_FUNCTIONS`)."""

    def forward(
        self: Any,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        for key in ("cache", "past_key_values", "past_key_value"):
            if kwargs.pop(key, None) is not None:
                raise RuntimeError(
                    "fused q/k/v projections serve forwards without a KV cache (use_cache=False)"
                )
        modeling = self._modeling
        input_shape = hidden_states.shape[:-1]
        projections = (self.q_proj, self.k_proj, self.v_proj)
        qkv = _fused_linear(hidden_states, projections)
        query, key, value = (
            t.view(*input_shape, -1, self.head_dim).transpose(1, 2)
            for t in qkv.split([p.out_features for p in projections], dim=-1)
        )
        cos, sin = position_embeddings
        query, key = modeling.apply_rotary_pos_emb(query, key, cos, sin)
        implementation = self.config._attn_implementation
        attend = (
            modeling.eager_attention_forward
            if implementation == "eager"
            else modeling.ALL_ATTENTION_FUNCTIONS[implementation]
        )
        if getattr(self, "sliding_window", None) is not None:
            kwargs["sliding_window"] = self.sliding_window
        out, weights = attend(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


class _FusedMLP:
    """Mixed in before a supported MLP class: gate and up in one matmul whose output interleaves
    them (gate_0, up_0, gate_1, up_1, ...), so that the gradient of the product lands in one pass
    over `[..., I, 2]` pairs (with `[gate | up]` halves Inductor's kernel for that gradient took
    twice as long on an H200: 54 vs 27 ms per step for Qwen2-0.5B)."""

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        projections = (self.gate_proj, self.up_proj)
        weight = torch.stack([p.weight for p in projections], dim=1).flatten(0, 1)
        bias = None
        if self.gate_proj.bias is not None:
            bias = torch.stack([p.bias for p in projections], dim=1).flatten()
        gate, up = F.linear(x, weight, bias).unflatten(-1, (-1, 2)).unbind(-1)
        return self.down_proj(self.act_fn(gate) * up)


_CLASSES: dict[tuple[type, type], type] = {}


def _swap_class(module: nn.Module, mixin: type) -> None:
    base = type(module)
    if (mixin, base) not in _CLASSES:
        attrs = {"_modeling": sys.modules[base.__module__]}  # its rotary and attention functions
        _CLASSES[(mixin, base)] = type(f"Fused{base.__name__}", (mixin, base), attrs)
    module.__class__ = _CLASSES[(mixin, base)]


def fuse_projections(model: nn.Module) -> int:
    """Swap every supported attention and MLP module of `model` for its fused form (in place);
    returns how many modules were swapped (0: nothing supported, the model runs as it was)."""
    swapped = 0
    for module in model.modules():
        name = type(module).__name__
        if name in SUPPORTED_ATTENTION:
            _swap_class(module, _FusedAttention)
        elif name in SUPPORTED_MLP:
            _swap_class(module, _FusedMLP)
        else:
            continue
        swapped += 1
    return swapped
