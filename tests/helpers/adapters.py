"""LoRA adapters for engine tests: written the way the trainer writes them, read back by peft.

- `write_random_adapter(model_dir, out, cfg, seed=, relative=)` injects `cfg`'s adapters into a float32
  copy of the model (areal_async.lora.inject, as the trainer does), gives A and B random values (a
  trained adapter, unlike peft's B = 0), scales each B so that `scale * B @ A` has `relative` times the
  standard deviation of the weight it updates, and writes the adapter directory (lora.adapter_tensors
  of the model's state dict, lora.write_adapter_dir).
- `peft_reference(base_dir, adapter_dir)`: peft's `PeftModel.from_pretrained` of the base model with
  that directory, in float32: the oracle engines are checked against (independent of lora.merge).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from areal_async import lora


def write_random_adapter(
    model_dir: Path, out: Path, cfg: lora.LoraConfig, *, seed: int, relative: float
) -> Path:
    """An adapter directory for `model_dir` whose updates are `relative` of each weight's std."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora.inject(model, cfg, base_dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if not hasattr(module, "lora_A") or not hasattr(module, "base_layer"):
                continue
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            a.copy_(torch.randn(a.shape, generator=generator) / a.shape[1] ** 0.5)
            b.copy_(torch.randn(b.shape, generator=generator))
            update = cfg.scale * b @ a
            b.mul_(relative * module.base_layer.weight.std() / update.std())
    tensors = lora.adapter_tensors(model.state_dict())
    assert tensors, f"no adapter tensors for {cfg.target_modules} in {model_dir}"
    lora.write_adapter_dir(out, tensors, cfg, base_model=str(model_dir))
    return out


def peft_reference(base_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    """peft's model of `base_dir` with the adapter at `adapter_dir` (float32, eval mode)."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with warnings.catch_warnings():  # transformers' deprecation of a name peft still calls
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        return PeftModel.from_pretrained(base, str(adapter_dir)).eval()
