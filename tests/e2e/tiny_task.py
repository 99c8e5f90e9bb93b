"""A tiny model that RL can measurably improve within seconds on 2 CPU cores.

``warm_start_mode_select`` builds a random-init char-level Llama and fine-tunes it on the
``mode_select`` task (``3+4=``) where the target is ``a+b`` or ``a+b+1`` with equal
probability. The model learns both answer modes as a mixture, so its greedy accuracy
sits near 50%; RL with an exact-match reward must pick the right mode. A random reward
does not do that, which is what makes a rise a signal rather than noise.
"""

from __future__ import annotations

import math
import random
import shutil
from pathlib import Path

import torch

from areal_async.data import load_dataset
from areal_async.models import load_tokenizer
from tests.helpers.models import build_tiny_model


def warm_start_mode_select(
    out_dir: Path,
    *,
    seed: int = 0,
    steps: int = 600,
    batch_size: int = 128,
    lr: float = 3e-3,
    alt_p: float = 0.5,
    eval_fraction: float = 0.3,
    hi: int = 9,
    chat: bool = False,
    init: Path | None = None,
) -> Path:
    """Build and SFT the tiny model into ``out_dir`` (reused when already there).

    ``chat``: prompts rendered with the tokenizer's ChatML template as one user message, the answer
    closed by ``<|im_end|>``, as agent workflows (``ChatSession``) render a row's first turn.
    ``init``: start from this model directory (e.g. the raw-format warm start) instead of random init.
    """
    if (out_dir / "sft.done").is_file():
        return out_dir
    from transformers import AutoModelForCausalLM

    if init is None:
        build_tiny_model(out_dir, hidden=128, layers=4, heads=4, seed=seed)
    else:
        shutil.copytree(init, out_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("sft.done"))
    tok = load_tokenizer(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    rows = load_dataset("mode_select", split="train", seed=seed, eval_fraction=eval_fraction, hi=hi)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99))
    # Cosine decay to 5% of lr: the model fits both answer modes of the train prompts almost exactly
    # (loss ~0.28 nats/token, the entropy of the mode choice), whatever CPU kernels computed it.
    # With a constant lr the fit, and so the start and ceiling of the RL reward, varied by CPU.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: 0.05 + 0.475 * (1 + math.cos(math.pi * min(i, steps) / steps))
    )
    eos = tok.eos_token_id

    def encode(prompt: str) -> list[int]:
        if not chat:
            return tok(prompt)["input_ids"]
        messages = [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    prompts = {row["prompt"]: encode(row["prompt"]) for row in rows}  # rendered once, not per step
    model.train()
    for _ in range(steps):
        batch = [rng.choice(rows) for _ in range(batch_size)]
        seqs, masks = [], []
        for row in batch:
            answer = int(row["answer"]) + (1 if rng.random() < alt_p else 0)
            p = prompts[row["prompt"]]
            a = tok(str(answer))["input_ids"] + [eos]
            seqs.append(p + a)
            masks.append([0] * len(p) + [1] * len(a))
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros((len(seqs), width))
        for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            loss_mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
        logits = model(ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    model.save_pretrained(out_dir)
    (out_dir / "sft.done").write_text(f"{loss.detach().item():.4f}\n")
    return out_dir


def exact_mode_preference(model_dir: Path, *, split: str = "eval", eval_fraction: float = 0.3) -> float:
    """Mean over the distinct prompts of ``split`` of P(exact answer | exact or +1 answer), scored
    teacher-forced by ``model_dir`` (each answer closed by EOS).

    It measures the one thing RL changes on this task, the choice between the two answer modes, on
    every held-out prompt at once, so it does not hinge on the argmax of a few near-ties as greedy
    accuracy over 20 prompts does (the warm start puts both modes near 50%)."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = load_dataset("mode_select", split=split, seed=0, eval_fraction=eval_fraction)
    prompts = {row["prompt"]: int(row["answer"]) for row in rows}

    def logprob(prompt_ids: list[int], answer: int) -> torch.Tensor:
        target = tok(str(answer))["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([prompt_ids + target])
        with torch.no_grad():
            logp = model(ids).logits[0, :-1].log_softmax(-1)
        at = torch.arange(len(prompt_ids) - 1, ids.shape[1] - 1)
        return logp[at, ids[0, len(prompt_ids) :]].sum()

    total = 0.0
    for prompt, answer in prompts.items():
        p = tok(prompt)["input_ids"]
        total += torch.sigmoid(logprob(p, answer) - logprob(p, answer + 1)).item()
    return total / len(prompts)
