"""Tiny random-init causal LMs with locally trained tokenizers, for tests and benchmarks.

- `build_tiny_model(out_dir, ...)` writes a random-init Llama/Qwen2 model plus a locally trained
  tokenizer (char-level WordLevel or byte-level BPE) with a ChatML-style chat template. The directory
  loads with `load_causal_lm`/`load_tokenizer` and `AutoModelForCausalLM.from_pretrained`, so the
  inference engine and the trainer can share it. Same arguments give the same weights.
- `build_tokenizer(kind, ...)` is that tokenizer alone; `char_vocabulary()` its char-level vocabulary.

Special tokens: `<pad>`=0, `<|im_start|>`=1 (bos), `<|im_end|>`=2 (eos), `<unk>`=3.
"""

from __future__ import annotations

import os
import string
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import structlog

from areal_async.models import torch_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = structlog.get_logger(__name__)

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
