"""Write a random-init model of a real shape with a real tokenizer, for whole-run benchmarks.

The body (hidden size, layers, heads, MLP) is the named shape's (``bench_trainer.SHAPES``); the
vocabulary is the tokenizer's, so every generated id decodes. Random weights rarely sample EOS,
so completions run to ``max_new_tokens``: throughput numbers, never accuracy.

    python -m benchmarks.random_model qwen2-0.5b /tmp/q05 --tokenizer ~/.cache/areal-async/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from benchmarks.bench_trainer import SHAPES

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def build(shape: str, out: Path, tokenizer: Path, dtype: str = "bfloat16") -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    spec = dict(SHAPES[shape])
    spec["vocab_size"] = len(tok)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tok, key)
        if value is not None:
            spec[key] = value
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy2(tokenizer / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {shape} body, vocab {len(tok)}, {params / 1e6:.0f}M parameters")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out", type=Path)
    p.add_argument("--tokenizer", type=Path, required=True, help="a directory with tokenizer.json")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args()
    build(args.shape, args.out, args.tokenizer, args.dtype)


if __name__ == "__main__":
    main()
