"""Training engines as tests build them: flat keyword arguments in, the engine a run would build out.

Both engines take the run file's trainer section (`TrainerConfig`) plus a few arguments that are not
run-file keys (`seed`, `temperature`, `logprob_chunk_tokens`, FSDP2's `packed`). `trainer_config`
sorts flat keywords into that section: `trainer.optimizer` keys (`lr`, `eps`, `grad_clip`, ...) into
its optimizer, the others into the section itself. What a test leaves out is a run file's default,
the same value a run gets.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from areal_async.config import OptimizerConfig, TrainerConfig
from areal_async.training.fsdp.engine import FSDPTrainEngine

_TRAINER_KEYS = {f.name for f in fields(TrainerConfig)} - {"optimizer"}
_OPTIMIZER_KEYS = {f.name for f in fields(OptimizerConfig)}


def trainer_config(**keys: Any) -> TrainerConfig:
    """The trainer section with `keys` set; optimizer keys go into `trainer.optimizer`."""
    unknown = set(keys) - _TRAINER_KEYS - _OPTIMIZER_KEYS
    assert not unknown, f"not keys of trainer or trainer.optimizer: {sorted(unknown)}"
    optimizer = OptimizerConfig(**{k: v for k, v in keys.items() if k in _OPTIMIZER_KEYS})
    return TrainerConfig(optimizer=optimizer, **{k: v for k, v in keys.items() if k in _TRAINER_KEYS})


def _split(keys: dict[str, Any]) -> tuple[TrainerConfig, dict[str, Any]]:
    section = {k: v for k, v in keys.items() if k in _TRAINER_KEYS | _OPTIMIZER_KEYS}
    return trainer_config(**section), {k: v for k, v in keys.items() if k not in section}


def fsdp_engine(model_dir: str | Path, **keys: Any) -> FSDPTrainEngine:
    """`FSDPTrainEngine` from flat keywords: trainer-section keys and the engine's own arguments."""
    trainer, own = _split(keys)
    return FSDPTrainEngine(model_dir, trainer, **own)


def megatron_engine(model_dir: str | Path, **keys: Any) -> Any:
    """`MegatronTrainEngine` from flat keywords, with `backend: megatron` as a run file says it."""
    from areal_async.training.megatron.engine import MegatronTrainEngine

    trainer, own = _split({"backend": "megatron", **keys})
    return MegatronTrainEngine(model_dir, trainer, **own)
