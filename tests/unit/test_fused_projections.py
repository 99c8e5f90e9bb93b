"""Fused q/k/v and gate/up projections compute what the separate ones do, with the same parameters."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from areal_async.engines.fused_projections import fuse_projections

SHAPE = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize(
    "config",
    [LlamaConfig(**SHAPE), LlamaConfig(**SHAPE, attention_bias=True, mlp_bias=True), Qwen2Config(**SHAPE)],
    ids=["llama", "llama-biases", "qwen2"],
)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_fused_model_matches_the_separate_projections(config: LlamaConfig, attn: str) -> None:
    """Logits and every parameter's gradient agree, parameter names are unchanged, and the fused
    model reports how many modules it swapped (2 per layer)."""
    torch.manual_seed(0)
    config._attn_implementation = attn
    plain = AutoModelForCausalLM.from_config(config).train()
    for p in plain.parameters():  # biases start at zero: make them matter
        torch.nn.init.normal_(p, std=0.05)
    fused = copy.deepcopy(plain)
    assert fuse_projections(fused) == 2 * config.num_hidden_layers
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in plain.named_parameters()]
    ids = torch.randint(0, config.vocab_size, (3, 11))
    outputs = []
    for model in (plain, fused):
        logits = model(input_ids=ids, use_cache=False).logits
        (logits.square().mean()).backward()
        outputs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(outputs[1][0], outputs[0][0], rtol=1e-5, atol=1e-5)
    for name, grad in outputs[0][1].items():
        torch.testing.assert_close(outputs[1][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert type(fused.model.layers[0].self_attn).__name__.startswith("Fused")


def test_a_kv_cache_is_refused_and_unsupported_models_are_left_alone() -> None:
    """Generation with a cache is not what the fused attention serves: it says so. A model with
    no supported module is returned unchanged (0 swapped)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE))
    fuse_projections(model)
    with pytest.raises(RuntimeError, match="without a KV cache"):
        model(input_ids=torch.randint(0, 97, (1, 4)), use_cache=True)
    other = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert fuse_projections(other) == 0
    assert type(other[0]) is torch.nn.Linear


def test_the_trainer_config_reaches_the_engine(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """trainer.fused_projections and trainer.logprob_kernel are what the learner's engine runs with."""
    from areal_async.config import load_config
    from areal_async.engines.logprobs import token_logprobs
    from areal_async.learner import Learner
    from tests.fsdp_helpers import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny", vocab=64)
    for fused in (False, True):
        cfg = load_config(
            None, [f"trainer.fused_projections={str(fused).lower()}", "trainer.logprob_kernel=torch"]
        )
        engine = Learner(cfg, str(model)).engine
        layer = engine.model.hf.get_decoder().layers[0]
        assert type(layer.self_attn).__name__.startswith("Fused") is fused
        assert type(layer.mlp).__name__.startswith("Fused") is fused
        assert engine.model.logprob_fn is token_logprobs
