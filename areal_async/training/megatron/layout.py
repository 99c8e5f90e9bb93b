"""Hugging Face <-> megatron-core weight layout for the Llama, Qwen2 and Qwen3 families, and its
tensor-parallel shards. Plain torch: no megatron import, so it is tested on any machine.

`MegatronShape.from_hf_config(config)` reads what the layout depends on from an HF config and
refuses what the Megatron backend does not build (other architectures, biases other than Qwen2's
q/k/v, sliding windows, activations other than SiLU), naming the field.

Names and layouts (full tensors, megatron-core's GPT model with the local layer spec):

| HF (`model.` prefix)                     | megatron-core                                       |
|------------------------------------------|-----------------------------------------------------|
| embed_tokens.weight                      | embedding.word_embeddings.weight                    |
| layers.i.input_layernorm.weight          | decoder.layers.i.input_layernorm.weight             |
| layers.i.self_attn.{q,k,v}_proj.{weight,bias} | decoder.layers.i.self_attention.linear_qkv.{weight,bias} |
| layers.i.self_attn.o_proj.weight         | decoder.layers.i.self_attention.linear_proj.weight  |
| layers.i.self_attn.{q,k}_norm.weight     | decoder.layers.i.self_attention.{q,k}_layernorm.weight |
| layers.i.post_attention_layernorm.weight | decoder.layers.i.pre_mlp_layernorm.weight           |
| layers.i.mlp.{gate,up}_proj.weight       | decoder.layers.i.mlp.linear_fc1.weight              |
| layers.i.mlp.down_proj.weight            | decoder.layers.i.mlp.linear_fc2.weight              |
| norm.weight                              | decoder.final_layernorm.weight                      |
| lm_head.weight (untied models only)      | output_layer.weight                                 |

`linear_qkv` holds, for each K/V head g in turn, the query heads of g, then K of g, then V of g
(rows of `head_dim`); `linear_fc1` is gate then up. Both conversions only move rows, so a round
trip is bit-exact. `to_megatron` / `to_hf` convert whole state dicts; they work on any tensors
keyed by parameter name, so optimizer moments convert the same way as the weights.

Tensor parallelism (`tp_shard` / `tp_merge`): column-parallel weights (QKV, fc1, embedding,
output layer) split their rows, fc1 splitting gate and up separately; row-parallel weights (the
attention output and fc2) split their columns; norms are replicated. Whole K/V groups land on
each rank because groups are contiguous rows of `linear_qkv`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class MegatronShape:
    """What the weight layout and megatron-core's `TransformerConfig` need from an HF config."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    tied: bool

    @classmethod
    def from_hf_config(cls, config: Any) -> MegatronShape:
        archs = list(getattr(config, "architectures", None) or [])
        by_type = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        if not archs:  # a config built in memory, not read from config.json
            archs = [by_type.get(getattr(config, "model_type", ""), "")]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"trainer.backend=megatron builds {', '.join(SUPPORTED_ARCHITECTURES)}; the model's config.json "
                f"has architectures={archs}. Use trainer.backend=fsdp2 for this model"
            )
        problems = {
            "hidden_act": getattr(config, "hidden_act", "silu") != "silu",
            "attention_bias": arch != "Qwen2ForCausalLM" and bool(getattr(config, "attention_bias", False)),
            "mlp_bias": bool(getattr(config, "mlp_bias", False)),
            "use_sliding_window": bool(getattr(config, "use_sliding_window", False)),
        }
        bad = [f"{key}={getattr(config, key)!r}" for key, used in problems.items() if used]
        if bad:
            raise ValueError(
                f"trainer.backend=megatron does not build this {arch}: {', '.join(bad)} in config.json; "
                "use trainer.backend=fsdp2 for it"
            )
        heads = int(config.num_attention_heads)
        return cls(
            architecture=arch,
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            ffn_hidden_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            norm_eps=float(config.rms_norm_eps),
            qkv_bias=arch == "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            tied=bool(getattr(config, "tie_word_embeddings", False)),
        )

    def check_parallel(
        self, *, tensor_parallel: int, pipeline_parallel: int, virtual_pipeline: int = 1
    ) -> None:
        """Raise ValueError naming the `trainer.megatron` key when the model cannot be split so."""
        tp, pp = tensor_parallel, pipeline_parallel
        divides = {
            f"num_attention_heads={self.num_heads}": (self.num_heads, tp),
            f"num_key_value_heads={self.num_kv_heads}": (self.num_kv_heads, tp),
            f"intermediate_size={self.ffn_hidden_size}": (self.ffn_hidden_size, tp),
            f"vocab_size={self.vocab_size}": (self.vocab_size, tp),
        }
        for what, (n, parts) in divides.items():
            if n % parts:
                raise ValueError(
                    f"trainer.megatron.tensor_parallel={tp} does not divide the model's {what}; "
                    "choose a tensor_parallel that divides it"
                )
        if self.num_layers % pp:
            raise ValueError(
                f"trainer.megatron.pipeline_parallel={pp} does not divide the model's "
                f"num_hidden_layers={self.num_layers}; choose a pipeline_parallel that divides it"
            )
        if self.num_layers % (pp * virtual_pipeline):
            raise ValueError(
                f"trainer.megatron.pipeline_parallel={pp} x virtual_pipeline={virtual_pipeline} does not "
                f"divide the model's num_hidden_layers={self.num_layers}; choose a virtual_pipeline with "
                "pipeline_parallel x virtual_pipeline dividing it"
            )


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
_QKV = ("q_proj", "k_proj", "v_proj")


def _pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: MegatronShape) -> torch.Tensor:
    groups, d = shape.num_kv_heads, shape.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(groups, -1, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _unpack_qkv(qkv: torch.Tensor, shape: MegatronShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = shape.num_kv_heads, shape.head_dim
    per_group = shape.num_heads // groups * d
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, per_group + 2 * d, *rest).split([per_group, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def to_megatron(hf: dict[str, torch.Tensor], shape: MegatronShape) -> dict[str, torch.Tensor]:
    """Megatron-named full tensors from HF-named ones (a tied model's `lm_head.weight` is dropped)."""
    out: dict[str, torch.Tensor] = {}
    pending: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in hf.items():
        if name in _GLOBAL_NAMES:
            if not (shape.tied and name == "lm_head.weight"):
                out[_GLOBAL_NAMES[name]] = tensor
            continue
        match = _LAYER.match(name)
        if match is None:
            raise KeyError(f"no megatron-core name for the HF tensor {name!r}")
        i, rest = int(match.group(1)), match.group(2)
        prefix = f"decoder.layers.{i}."
        if rest in _LAYER_NAMES:
            out[prefix + _LAYER_NAMES[rest]] = tensor
            continue
        module, _, kind = rest.rpartition(".")  # self_attn.q_proj / weight
        part = module.rpartition(".")[2]
        if part in _QKV or part in ("gate_proj", "up_proj"):
            group = pending.setdefault((i, f"{'qkv' if part in _QKV else 'fc1'}.{kind}"), {})
            group[part] = tensor
            continue
        raise KeyError(f"no megatron-core name for the HF tensor {name!r}")
    for (i, key), parts in pending.items():
        fused, kind = key.split(".")
        prefix = f"decoder.layers.{i}."
        if fused == "qkv":
            q, k, v = (parts[p] for p in _QKV)
            out[f"{prefix}self_attention.linear_qkv.{kind}"] = _pack_qkv(q, k, v, shape)
        else:
            out[f"{prefix}mlp.linear_fc1.{kind}"] = torch.cat([parts["gate_proj"], parts["up_proj"]])
    return out


def to_hf(megatron: dict[str, torch.Tensor], shape: MegatronShape) -> dict[str, torch.Tensor]:
    """HF-named full tensors from megatron-named ones (no `lm_head.weight` for a tied model)."""
    globals_back = {v: k for k, v in _GLOBAL_NAMES.items()}
    layer_back = {v: k for k, v in _LAYER_NAMES.items()}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in megatron.items():
        if name in globals_back:
            out[globals_back[name]] = tensor
            continue
        match = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
        if match is None:
            raise KeyError(f"no HF name for the megatron-core tensor {name!r}")
        prefix, rest = f"model.layers.{match.group(1)}.", match.group(2)
        if rest in layer_back:
            out[prefix + layer_back[rest]] = tensor
        elif rest.startswith("self_attention.linear_qkv."):
            kind = rest.rpartition(".")[2]
            for part, t in zip(_QKV, _unpack_qkv(tensor, shape), strict=True):
                out[f"{prefix}self_attn.{part}.{kind}"] = t
        elif rest == "mlp.linear_fc1.weight":
            gate, up = tensor.chunk(2)
            out[prefix + "mlp.gate_proj.weight"] = gate
            out[prefix + "mlp.up_proj.weight"] = up
        else:
            raise KeyError(f"no HF name for the megatron-core tensor {name!r}")
    return out


_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")
_GATED = ("linear_fc1.weight",)


def tp_split(name: str) -> bool:
    """True when the megatron-named tensor is split across tensor-parallel ranks (False: replicated)."""
    return tp_dim(name) is not None


def tp_dim(name: str) -> int | None:
    """The dimension the megatron-named tensor is split along across tensor-parallel ranks (None:
    replicated). A gated weight (`tp_gated`) splits each of its two halves along it."""
    if name.endswith(_GATED + _COLUMN):
        return 0
    return 1 if name.endswith(_ROW) else None


def tp_gated(name: str) -> bool:
    """True for the fused gate/up weight, whose slices hold a part of each half (see `tp_shard`)."""
    return name.endswith(_GATED)


def tp_shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s part of the megatron-named full tensor `name` under `size`-way tensor parallelism."""
    if size == 1:
        return full
    if name.endswith(_GATED):
        return torch.cat([half.chunk(size)[rank] for half in full.chunk(2)])
    if name.endswith(_COLUMN):
        return full.chunk(size)[rank]
    if name.endswith(_ROW):
        return full.chunk(size, dim=1)[rank]
    return full


def tp_merge(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every rank's `tp_shard` part, in rank order."""
    if len(parts) == 1:
        return parts[0]
    if name.endswith(_GATED):
        halves = [p.chunk(2) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if name.endswith(_COLUMN):
        return torch.cat(parts)
    if name.endswith(_ROW):
        return torch.cat(parts, dim=1)
    return parts[0]
