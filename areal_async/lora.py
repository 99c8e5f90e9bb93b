"""LoRA: the run file's ``trainer.lora`` section, adapters injected into the trainer's model, adapter
directories, and an adapter merged into base weights.

Training. ``inject(model, cfg, base_dtype=...)`` wraps every linear module whose name ends in one
of ``cfg.target_modules`` with a peft LoRA layer (A: ``[rank, in]``, random; B: ``[out, rank]``,
zero, so version 0 is the base model), freezes every other parameter and casts it to
``base_dtype`` (the training dtype: frozen weights need neither float32 masters nor optimizer
state). Only the adapters train.

Adapter directory (what a LoRA run publishes as each weights version, and what peft's
``PeftModel.from_pretrained``, vLLM's and SGLang's runtime LoRA loading read):
``adapter_config.json`` (peft's ``LoraConfig`` fields, ``base_model_name_or_path`` included),
``adapter_model.safetensors`` and ``manifest.json`` (``[{name, shape, dtype, sha256}]``). Tensors
are named ``base_model.model.<module>.lora_A.weight`` and ``...lora_B.weight``, ``<module>`` being
the Hugging Face module path (``model.layers.0.self_attn.q_proj``). Module ``W``'s weight becomes
``W + scale * B @ A`` with ``scale = alpha / rank``.

Torch and peft are imported where they are used, so the config section costs nothing to import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_TRAINER_ADAPTER = "default"  # peft's name for the one adapter the trainer holds

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """``trainer.lora``: train low-rank adapters instead of the full model (absent: full fine-tuning)."""

    rank: int = 16
    """r: rank of each adapter's update."""

    alpha: float = 32.0
    """The update is scaled by alpha / rank."""

    dropout: float = 0.0
    """Dropout on the adapters' input while training (engines never apply it)."""

    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Linear modules that get an adapter, by the last part of their name (Llama/Qwen names:
    q_proj k_proj v_proj o_proj gate_proj up_proj down_proj)."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"trainer.lora.rank must be an integer >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"trainer.lora.alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"trainer.lora.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            raise ValueError(
                f"trainer.lora.target_modules must name at least one linear module, got "
                f"{self.target_modules!r}; e.g. [q_proj, v_proj]"
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class Adapter:
    """One adapter directory read back: its scale and its tensors (peft names)."""

    scale: float
    rank: int
    tensors: dict[str, torch.Tensor]
    base_model: str | None = None


def _peft_config(cfg: LoraConfig, base_model: str | None = None) -> Any:
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


def inject(model: nn.Module, cfg: LoraConfig, *, base_dtype: torch.dtype) -> int:
    """Add adapters to ``model`` in place, freeze and cast the rest; returns the adapter parameter count."""
    from peft import inject_adapter_in_model
    from torch import nn

    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
    unknown = [t for t in cfg.target_modules if t not in linear]
    if unknown:
        raise ValueError(
            f"trainer.lora.target_modules names {unknown}, which this model has no linear module "
            f"called; its linear modules are {linear}"
        )
    inject_adapter_in_model(_peft_config(cfg), model, adapter_name=_TRAINER_ADAPTER)
    count = 0
    for name, param in model.named_parameters():
        if ".lora_" in name:
            param.requires_grad_(True)
            count += param.numel()
        else:
            param.requires_grad_(False)
            param.data = param.data.to(base_dtype)
    return count


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of the trainer's HF-named state dict (``model.layers.0...lora_A.default.weight``),
    renamed to the adapter directory's names; sorted by name."""
    out = {}
    for name in sorted(state):
        if is_adapter_name(name):
            short = name.replace(f".lora_A.{_TRAINER_ADAPTER}.", ".lora_A.").replace(
                f".lora_B.{_TRAINER_ADAPTER}.", ".lora_B."
            )
            out[PEFT_PREFIX + short] = state[name]
    return out


def module_weight(adapter_name: str) -> tuple[str, str]:
    """``base_model.model.<m>.lora_A.weight`` -> (``<m>.weight``, ``"A"``)."""
    name = adapter_name.removeprefix(PEFT_PREFIX)
    for part in ("A", "B"):
        marker = f".lora_{part}."
        if marker in name:
            module = name.split(marker, 1)[0]
            return f"{module}.weight", part
    raise ValueError(f"{adapter_name!r} is not a LoRA adapter tensor name (no .lora_A. or .lora_B.)")


def adapter_pairs(adapter: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF weight name -> ``(A, B)`` for every module an adapter's tensors (peft names) cover."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapter.items():
        weight, part = module_weight(name)
        halves.setdefault(weight, {})[part] = tensor
    pairs = {}
    for weight, ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(
                f"adapter for {weight!r} has only lora_{''.join(ab)}; it needs lora_A and lora_B"
            )
        pairs[weight] = (ab["A"], ab["B"])
    return pairs


def check_fits(weight: str, shape: Sequence[int] | None, a: torch.Tensor, b: torch.Tensor) -> None:
    """Raise unless ``B @ A`` has the shape of weight ``weight`` (``shape`` None: no such weight)."""
    if shape is None:
        raise ValueError(f"adapter targets {weight!r}, which the base model does not have")
    if b.shape[0] != shape[0] or a.shape[1] != shape[1] or a.shape[0] != b.shape[1]:
        raise ValueError(
            f"adapter for {weight!r} has A {tuple(a.shape)} and B {tuple(b.shape)}, which do not fit "
            f"the weight's shape {tuple(shape)}"
        )


def merge(
    base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """New tensors ``W + scale * B @ A`` for every module the adapter covers, in ``W``'s dtype and
    device (one ``addmm`` each); ``base`` maps HF weight names to the unadapted weights."""
    import torch

    merged = {}
    for weight, (a, b) in adapter_pairs(adapter).items():
        w = base.get(weight)
        check_fits(weight, None if w is None else w.shape, a, b)
        assert w is not None
        merged[weight] = torch.addmm(w, b.to(w.device, w.dtype), a.to(w.device, w.dtype), alpha=scale)
    return merged


def merged_state(state: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The trainer's HF-named state dict (adapted modules as ``<m>.base_layer.weight`` plus adapters)
    as a plain HF state dict with every adapter merged into its weight."""
    base = {n.replace(".base_layer.", "."): t for n, t in state.items() if not is_adapter_name(n)}
    base.update(merge(base, adapter_tensors(state), scale))
    return base


def write_adapter_dir(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    cfg: LoraConfig,
    *,
    base_model: str | None = None,
) -> list[dict[str, Any]]:
    """Write an adapter directory (module docstring) atomically; returns its manifest."""
    from areal_async.weights_file import write_weights_dir

    def add_config(tmp: Path) -> None:
        _peft_config(cfg, base_model).save_pretrained(tmp)

    return write_weights_dir(path, tensors, add_config, filename=ADAPTER_FILE)


def is_adapter_dir(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_adapter_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """An adapter directory's ``adapter_config.json``, checked: a rank ``r`` >= 1 and nothing this
    project cannot apply exactly (rsLoRA, DoRA, biases)."""
    config_path = Path(path) / ADAPTER_CONFIG
    try:
        config = json.loads(config_path.read_text())
        rank = config["r"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{config_path}: cannot read the adapter's config and its rank 'r' ({exc})") from exc
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{config_path}: r must be an integer >= 1, got {rank!r}")
    for key, allowed in (("use_rslora", False), ("use_dora", False), ("bias", "none")):
        if config.get(key, allowed) != allowed:
            raise ValueError(
                f"{path}: adapter_config {key}={config[key]!r} is not supported; train with {allowed!r}"
            )
    return config


def adapter_rank(path: str | os.PathLike[str]) -> int | None:
    """The rank of the adapter directory ``path``; None when ``path`` is not one."""
    return int(read_adapter_config(path)["r"]) if is_adapter_dir(path) else None


def read_adapter_dir(path: str | os.PathLike[str]) -> Adapter:
    """Read an adapter directory (its config checked by ``read_adapter_config``)."""
    from safetensors.torch import load_file

    path = Path(path)
    config = read_adapter_config(path)
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    tensors = load_file(path / ADAPTER_FILE)
    bad = [n for n in tensors if not is_adapter_name(n)]
    if bad:
        raise ValueError(f"{path}: {len(bad)} tensors are not LoRA adapters (first: {bad[0]!r})")
    return Adapter(
        scale=alpha / rank, rank=rank, tensors=tensors, base_model=config.get("base_model_name_or_path")
    )


def targeted_weights(adapter: Adapter | Sequence[str]) -> list[str]:
    """The HF weight names an adapter changes."""
    names = adapter.tensors if isinstance(adapter, Adapter) else adapter
    return sorted({module_weight(n)[0] for n in names})
