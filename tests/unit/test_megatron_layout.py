"""HF <-> megatron-core weight layout: bit-exact round trips, the fused QKV / gate-up row order,
tensor-parallel slices, and the errors for models or splits the backend cannot build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from areal_async.config import MegatronConfig, TrainerConfig
from areal_async.training.megatron import layout
from areal_async.training.megatron.layout import MegatronShape

SHAPE = dict(
    vocab_size=48,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def hf_model(family: str, tie: bool) -> Any:
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=tie))
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=tie))
    return Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=tie))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_round_trip_is_bit_exact(family: str, tie: bool) -> None:
    model = hf_model(family, tie)
    shape = MegatronShape.from_hf_config(model.config)
    hf = {k: v.clone() for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    mega = layout.to_megatron(hf, shape)
    assert ("output_layer.weight" in mega) is not tie
    assert ("decoder.layers.1.self_attention.linear_qkv.bias" in mega) is (family == "qwen2")
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in mega) is (family == "qwen3")
    back = layout.to_hf(mega, shape)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_fused_rows_follow_megatron_order() -> None:
    """linear_qkv: per K/V group, its query heads then K then V; linear_fc1: gate then up."""
    model = hf_model("qwen2", tie=False)
    shape = MegatronShape.from_hf_config(model.config)
    sd = model.state_dict()
    mega = layout.to_megatron(dict(sd), shape)
    qkv = mega["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, per_group = shape.head_dim, shape.num_heads // shape.num_kv_heads
    attn = "model.layers.0.self_attn."
    rows = (per_group + 2) * d
    for g in range(shape.num_kv_heads):
        block = qkv[g * rows : (g + 1) * rows]
        assert torch.equal(
            block[: per_group * d], sd[attn + "q_proj.weight"][g * per_group * d : (g + 1) * per_group * d]
        )
        assert torch.equal(
            block[per_group * d : per_group * d + d], sd[attn + "k_proj.weight"][g * d : (g + 1) * d]
        )
        assert torch.equal(block[per_group * d + d :], sd[attn + "v_proj.weight"][g * d : (g + 1) * d])
    fc1 = mega["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(
        fc1, torch.cat([sd["model.layers.0.mlp.gate_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"]])
    )


def test_tensor_parallel_slices_merge_back_and_split_gate_and_up_apart() -> None:
    model = hf_model("qwen2", tie=False)
    shape = MegatronShape.from_hf_config(model.config)
    mega = layout.to_megatron(dict(model.state_dict()), shape)
    for size in (2, 4):
        for name, full in mega.items():
            parts = [layout.tp_shard(name, full, r, size) for r in range(size)]
            assert torch.equal(layout.tp_merge(name, parts), full), (name, size)
            if layout.tp_split(name):
                assert sum(p.numel() for p in parts) == full.numel(), name
            else:
                assert all(p is full for p in parts), name
    fc1 = mega["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    assert torch.equal(
        layout.tp_shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, 2),
        torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]),
    )
    proj = mega["decoder.layers.0.self_attention.linear_proj.weight"]
    assert torch.equal(
        layout.tp_shard("decoder.layers.0.self_attention.linear_proj.weight", proj, 0, 2),
        proj[:, : proj.shape[1] // 2],
    )


def test_models_the_backend_cannot_build_are_refused_by_name() -> None:
    config = LlamaConfig(**SHAPE)
    config.architectures = ["MistralForCausalLM"]
    with pytest.raises(ValueError, match=r"architectures=\['MistralForCausalLM'\].*trainer.backend=fsdp2"):
        MegatronShape.from_hf_config(config)
    config = Qwen2Config(**SHAPE, use_sliding_window=True)
    config.architectures = ["Qwen2ForCausalLM"]
    with pytest.raises(ValueError, match="use_sliding_window=True"):
        MegatronShape.from_hf_config(config)
    config = LlamaConfig(**SHAPE, attention_bias=True)
    config.architectures = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="attention_bias=True"):
        MegatronShape.from_hf_config(config)


def test_splits_the_model_cannot_take_name_the_key() -> None:
    config = LlamaConfig(**SHAPE)
    config.architectures = ["LlamaForCausalLM"]
    shape = MegatronShape.from_hf_config(config)
    shape.check_parallel(tensor_parallel=2, pipeline_parallel=2)
    with pytest.raises(
        ValueError, match=r"tensor_parallel=4 does not divide the model's num_key_value_heads=2"
    ):
        shape.check_parallel(tensor_parallel=4, pipeline_parallel=1)
    with pytest.raises(
        ValueError, match=r"pipeline_parallel=3 does not divide the model's num_hidden_layers=2"
    ):
        shape.check_parallel(tensor_parallel=1, pipeline_parallel=3)
    with pytest.raises(ValueError, match=r"pipeline_parallel=2 x virtual_pipeline=2 does not divide.*=2"):
        shape.check_parallel(tensor_parallel=1, pipeline_parallel=2, virtual_pipeline=2)


def test_megatron_config_errors_name_the_key_and_the_fix() -> None:
    with pytest.raises(ValueError, match="tensor_parallel must be"):
        MegatronConfig(tensor_parallel=0)
    with pytest.raises(ValueError, match="context_parallel must be"):
        TrainerConfig(backend="megatron", context_parallel=0)
    MegatronConfig(tensor_parallel=2, pipeline_parallel=2, virtual_pipeline=2)
    with pytest.raises(ValueError, match="virtual_pipeline=2 needs pipeline_parallel > 1"):
        MegatronConfig(virtual_pipeline=2)
    with pytest.raises(
        ValueError,
        match=r"sequence_parallel=true needs tensor_parallel > 1 .* set tensor_parallel: 2 or more",
    ):
        MegatronConfig(sequence_parallel=True)
    MegatronConfig(tensor_parallel=2, sequence_parallel=True)
    TrainerConfig(  # with every other split
        backend="megatron",
        num_ranks=8,
        context_parallel=2,
        megatron=MegatronConfig(
            tensor_parallel=2, pipeline_parallel=2, virtual_pipeline=2, sequence_parallel=True
        ),
    )
    with pytest.raises(ValueError, match=r"tensor_parallel=2 does not divide trainer.num_ranks=3"):
        TrainerConfig(backend="megatron", num_ranks=3, megatron=MegatronConfig(tensor_parallel=2))
    TrainerConfig(
        backend="fsdp2", num_ranks=3, megatron=MegatronConfig(tensor_parallel=2)
    )  # ignored by fsdp2


def test_a_checkpoint_the_megatron_backend_cannot_read_is_refused_by_name(tmp_path: Path) -> None:
    from areal_async.training.megatron import checkpoint as megatron_checkpoint

    with pytest.raises(ValueError, match="written by trainer.backend=fsdp2, this run uses megatron"):
        megatron_checkpoint.load(None, tmp_path / "engine", {"model": {}})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a sharded Megatron checkpoint.*earlier areal-async"):
        megatron_checkpoint.load(None, tmp_path / "engine", {"backend": "megatron", "model": {}})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("stages", "chunks", "count"), [(2, 1, 5), (3, 1, 2), (2, 2, 4), (2, 2, 2), (4, 2, 8), (3, 3, 6)]
)
def test_pipeline_schedules_run_every_pass_once_and_never_wait_on_each_other(
    stages: int, chunks: int, count: int
) -> None:
    """Every stage's schedule holds each micro-batch's forward and backward of each chunk once, the
    backward after the forward; played together (sends never block, a pass waits only for its
    input), the stages finish: no stage waits on a pass another stage has not scheduled yet. With
    one chunk, stage s holds at most P - s micro-batches' activations (1F1B)."""
    from areal_async.training.megatron.pipeline import Stages, schedule

    plans = [schedule(Stages(stages, s, tuple(range(stages)), None, chunks), count) for s in range(stages)]
    for s, plan in enumerate(plans):
        passes = [(k, m, c) for k, m, c in plan]
        want = {(k, m, c) for k in "FB" for m in range(count) for c in range(chunks)}
        assert sorted(passes) == sorted(want) and len(passes) == len(want)
        assert all(
            plan.index(("F", m, c)) < plan.index(("B", m, c)) for m in range(count) for c in range(chunks)
        )
        if chunks == 1:
            live = peak = 0
            for kind, _, _ in plan:
                live += 1 if kind == "F" else -1
                peak = max(peak, live)
            assert peak <= stages - s

    def needs(s: int, kind: str, m: int, c: int) -> tuple[int, str, int, int] | None:
        """The pass on another stage whose output this one receives (None: its input is local)."""
        if kind == "F":
            if s > 0:
                return (s - 1, "F", m, c)
            return (stages - 1, "F", m, c - 1) if c > 0 else None
        if s < stages - 1:
            return (s + 1, "B", m, c)
        return (0, "B", m, c + 1) if c < chunks - 1 else None

    done: set[tuple[int, str, int, int]] = set()
    at = [0] * stages
    while any(at[s] < len(plans[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while at[s] < len(plans[s]):
                kind, m, c = plans[s][at[s]]
                need = needs(s, kind, m, c)
                if need is not None and need not in done:
                    break
                done.add((s, kind, m, c))
                at[s] += 1
                moved = True
        assert moved, f"the stages wait on each other at {at}"

    # Messages between two stages are matched in order (one stream per direction and tag): what
    # a stage sends is what its neighbour receives, in the same order.
    for s in range(stages):
        nxt = (s + 1) % stages
        sent = [
            (m, c) for kind, m, c in plans[s] if kind == "F" and not (s == stages - 1 and c == chunks - 1)
        ]
        got = [needs(nxt, "F", m, c) for kind, m, c in plans[nxt] if kind == "F"]
        assert sent == [(m, c) for src, _, m, c in filter(None, got) if src == s], s
        back = [(m, c) for kind, m, c in plans[nxt] if kind == "B" and not (nxt == 0 and c == 0)]
        got_back = [needs(s, "B", m, c) for kind, m, c in plans[s] if kind == "B"]
        assert back == [(m, c) for src, _, m, c in filter(None, got_back) if src == nxt], s
