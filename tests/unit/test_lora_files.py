"""Adapter directories (areal_async/lora.py): peft reads what the trainer writes, bit for bit, and
what cannot be applied exactly is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from areal_async import lora
from tests.helpers.fsdp_helpers import write_tiny_llama

SPEC = lora.LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def adapted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor]:
    """A tiny base model, an adapter directory with non-zero B, and the adapted model's logits."""
    root = tmp_path_factory.mktemp("lora-files")
    base = write_tiny_llama(root / "base", vocab=64, tie=True)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora.inject(model, SPEC, base_dtype=torch.float32)
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if ".lora_B." in name:
            param.data.normal_(0, 0.1)
    with torch.no_grad():
        logits = model(input_ids=torch.arange(1, 20)[None]).logits
    lora.write_adapter_dir(root / "v1", lora.adapter_tensors(model.state_dict()), SPEC, base_model=str(base))
    return base, root / "v1", logits


def test_peft_loads_the_adapter_directory_exactly(adapted: tuple[Path, Path, torch.Tensor]) -> None:
    base, adapter_dir, logits = adapted
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)
    with torch.no_grad():
        torch.testing.assert_close(
            peft_model(input_ids=torch.arange(1, 20)[None]).logits, logits, atol=0, rtol=0
        )
    manifest = json.loads((adapter_dir / "manifest.json").read_text())
    assert len(manifest) == 2 * 3 * 2 and all(m["sha256"] for m in manifest)


def test_merging_gives_the_adapted_model(adapted: tuple[Path, Path, torch.Tensor]) -> None:
    base, adapter_dir, logits = adapted
    adapter = lora.read_adapter_dir(adapter_dir)
    assert (adapter.rank, adapter.scale, adapter.base_model) == (4, 2.0, str(base))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = lora.merge(dict(model.state_dict()), adapter.tensors, adapter.scale)
    assert sorted(merged) == lora.targeted_weights(adapter) and len(merged) == 3 * 2
    model.load_state_dict(merged, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=torch.arange(1, 20)[None]).logits, logits, atol=1e-5, rtol=0
        )


def test_what_cannot_be_applied_exactly_is_refused(
    adapted: tuple[Path, Path, torch.Tensor], tmp_path: Path
) -> None:
    base, adapter_dir, _ = adapted
    config = json.loads((adapter_dir / lora.ADAPTER_CONFIG).read_text())
    bad = tmp_path / "rslora"
    bad.mkdir()
    (bad / lora.ADAPTER_CONFIG).write_text(json.dumps({**config, "use_rslora": True}))
    with pytest.raises(ValueError, match=r"use_rslora=True is not supported"):
        lora.read_adapter_dir(bad)
    adapter = lora.read_adapter_dir(adapter_dir)
    weights = dict(AutoModelForCausalLM.from_pretrained(base).state_dict())
    only_a = {n: t for n, t in adapter.tensors.items() if ".lora_A." in n}
    with pytest.raises(ValueError, match=r"has only lora_A; it needs lora_A and lora_B"):
        lora.merge(weights, only_a, 1.0)
    wrong = {n: (t[:, :-1] if ".lora_A." in n else t) for n, t in adapter.tensors.items()}
    with pytest.raises(ValueError, match=r"do not fit the weight's shape"):
        lora.merge(weights, wrong, 1.0)
    other = {n.replace("q_proj", "qkv_proj"): t for n, t in adapter.tensors.items()}
    with pytest.raises(
        ValueError, match=r"targets 'model.layers.0.self_attn.qkv_proj.weight'.*does not have"
    ):
        lora.merge(weights, other, 1.0)
