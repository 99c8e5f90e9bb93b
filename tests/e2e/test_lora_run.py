"""A whole LoRA run: adapter-only versions, served by the engine at every version, through a trainer
restart, and exported as a merged model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_async import lora
from tests.e2e.test_e2e import kill_mid_run
from tests.helpers.jobs import steps_clear_of_lost_versions

TOLERANCE = 2e-3  # |pi_prox / pi_behave - 1| of a version's own tokens, float32 on both sides


@pytest.mark.timeout(900)
def test_lora_run_serves_every_version_s_adapter_through_a_trainer_restart(
    tmp_path: Path, tiny_sft_model: Path
) -> None:
    """At max_staleness 0 every trained token was sampled by the version the trainer holds, so
    pi_prox (the trainer's adapter) equals pi_behave (what the engine served) for every token of
    every step, unless some version was served without its adapter. The trainer is killed after
    step 5 and resumes from its step-4 checkpoint (adapters and optimizer state)."""
    res, steps = kill_mid_run(
        tmp_path,
        tiny_sft_model,
        "lora",
        "trainer",
        total=16,
        batch=4,
        after=5,
        rollout__max_staleness=0,
        model__dtype="float32",
        trainer__dtype="float32",
        trainer__optimizer={"lr": 2e-2},
        trainer__lora={"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]},
    )
    run_dir = res.run_dir
    # Groups sampled by a version the killed trainer published after its checkpoint (a lost
    # future) are off-policy by design and the behaviour weight corrects them: not this check's.
    clear, lost = steps_clear_of_lost_versions(steps)
    checked = 0
    for ev in clear:
        m = ev.metrics
        assert abs(m["behave_weight_mean"] - 1.0) < TOLERANCE, (ev.step, m)
        assert m["behave_weight_max"] < 1.0 + 5 * TOLERANCE, (ev.step, m)
        checked += 1
    assert lost and checked >= 5, (lost, checked)

    versions = sorted(p for p in (run_dir / "weights").iterdir() if p.name.startswith("v") and p.is_dir())
    assert versions and all(lora.is_adapter_dir(p) for p in versions), versions
    final = run_dir / "weights" / "v16"
    assert (final / lora.ADAPTER_FILE).stat().st_size < 200_000  # adapters only, no base weights

    # The check above could fail: the final adapter moves the policy far more than the tolerance.
    base = AutoModelForCausalLM.from_pretrained(tiny_sft_model, dtype=torch.float32)
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        plain = torch.log_softmax(base(input_ids=ids).logits, -1)
    adapter = lora.read_adapter_dir(final)
    merged = lora.merge(dict(base.state_dict()), adapter.tensors, adapter.scale)
    base.load_state_dict(merged, strict=False)
    with torch.no_grad():
        adapted = torch.log_softmax(base(input_ids=ids).logits, -1)
    assert (adapted - plain).abs().max() > 20 * TOLERANCE

    # `areal-async export --merge-lora`: a plain HF model whose logits are the adapted ones.
    out = tmp_path / "merged"
    cmd = [
        str(Path(sys.executable).parent / "areal-async"),
        "export",
        str(tmp_path / "lora.yaml"),
        "--out",
        str(out),
    ]
    done = subprocess.run([*cmd, "--merge-lora"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["kind"] == "hf model"
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(torch.log_softmax(exported(input_ids=ids).logits, -1), adapted)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "exists" in again.stderr
    adapter_out = tmp_path / "adapter"
    cmd[-1] = str(adapter_out)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and lora.is_adapter_dir(adapter_out), done.stderr[-2000:]
