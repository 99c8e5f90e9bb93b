"""`areal-async export`: a run's trained policy as a directory other tools load.

``export_weights(cfg, out, version=None, merge_lora=False)`` copies the newest (or the given)
weights version of the run (``weight_sync.dir``'s ``v<N>``) to ``out``:

- a full fine-tuning run's version is a Hugging Face model directory already; it is copied;
- a LoRA run's version is an adapter directory (``areal_async/lora.py``): without ``merge_lora``
  it is copied as is (``peft.PeftModel.from_pretrained(base, out)`` loads it); with ``merge_lora``
  the adapter is merged into the base model it was trained on (``base_model_name_or_path`` of its
  config, else ``model.path``) and ``out`` is a plain HF model directory: config, tokenizer files
  and ``model.safetensors`` in the base model's dtypes.

``out`` is written atomically (``out.tmp`` then renamed) and must not exist yet.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from areal_async import lora
from areal_async.config import RunConfig
from areal_async.errors import ConfigError
from areal_async.files import fsync_tree, replace_dir

_VERSION = re.compile(r"v(\d+)")


def versions(cfg: RunConfig) -> dict[int, Path]:
    """Complete weights versions of the run on disk (a directory with its manifest), by number."""
    root = cfg.weights_root
    found = {}
    if root.is_dir():
        for path in root.iterdir():
            match = _VERSION.fullmatch(path.name)
            if match and (path / "manifest.json").is_file():
                found[int(match.group(1))] = path
    return found


def export_weights(
    cfg: RunConfig, out: str | Path, *, version: int | None = None, merge_lora: bool = False
) -> Path:
    out = Path(out)
    if out.exists():
        raise ConfigError(f"--out {out} exists; export writes a new directory, choose another path")
    found = versions(cfg)
    if not found:
        raise ConfigError(
            f"no weights versions under {cfg.weights_root} (weight_sync.dir); has the run trained?"
        )
    if version is None:
        version = max(found)
    if version not in found:
        raise ConfigError(f"--version {version}: not on disk; versions kept there: {sorted(found)}")
    source = found[version]
    if not lora.is_adapter_dir(source):
        if merge_lora:
            raise ConfigError(
                f"--merge-lora: {source} is a full model (the run has no trainer.lora); drop the flag"
            )
        _copy(source, out)
        return out
    if not merge_lora:
        _copy(source, out)
        return out
    adapter = lora.read_adapter_dir(source)
    base_dir = _base_dir(adapter.base_model, cfg)
    _write_merged(base_dir, adapter, out)
    return out


def _base_dir(recorded: str | None, cfg: RunConfig) -> Path:
    from workers.common import resolve_model_path

    for candidate in (recorded, cfg.model.path):
        if candidate and (path := Path(resolve_model_path(candidate))).is_dir():
            return path
    raise ConfigError(
        f"--merge-lora needs the base model the adapter was trained on ({recorded or cfg.model.path}); "
        "it is not on this machine: download it or set model.path with --set"
    )


def _write_merged(base_dir: Path, adapter: lora.Adapter, out: Path) -> None:
    from areal_async.training.hf_writer import TOKENIZER_FILES
    from areal_async.weights_file import read_safetensors_dir, write_weights_dir

    base = read_safetensors_dir(base_dir)
    base.update(lora.merge(base, adapter.tensors, adapter.scale))

    def add_files(tmp: Path) -> None:
        for name in ("config.json", *TOKENIZER_FILES):
            if (base_dir / name).is_file():
                shutil.copy2(base_dir / name, tmp / name)

    write_weights_dir(out, base, add_files)


def _copy(source: Path, out: Path) -> None:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    fsync_tree(tmp)
    replace_dir(tmp, out)


def describe(path: Path) -> dict[str, Any]:
    """What was exported, for the command's output line."""
    kind = "lora adapter" if lora.is_adapter_dir(path) else "hf model"
    return {"path": str(path), "kind": kind, "files": sorted(p.name for p in path.iterdir())}
