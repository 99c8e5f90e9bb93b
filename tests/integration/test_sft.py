"""``areal-async sft`` on a tiny model: the loss falls, only the model's tokens train, the written
model is the trained one, a killed run resumes on the same curve, and two ranks train as one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from areal_async.config import CheckpointConfig
from areal_async.data.sft import RenderOptions, SFTExample, load_examples, render_row
from areal_async.engines.base import GenerationRequest, SamplingParams
from areal_async.models import load_tokenizer
from areal_async.training.batching import TrainSequence
from areal_async.training.sft import SFTTrainer, to_sequence
from tests.helpers.engines import fsdp_engine
from tests.helpers.models import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
ROWS = [
    {"messages": [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": f"{a + b}"}]}
    for a in range(10)
    for b in range(4)
]
# Kills its own process (SIGKILL, no clean-up) as step 6 begins: steps 1-5 are in metrics.jsonl,
# the checkpoint of step 3 is the latest, steps 4-5 are lost.
KILL_AT_STEP_6 = """
import os, signal, sys
from areal_async.training import sft
from workers import sft as command
opened = []
open_trackers = command.open_trackers
command.open_trackers = lambda *args, **kwargs: opened.append(open_trackers(*args, **kwargs)) or opened[-1]
train_step = sft.SFTTrainer.step
def step(self, index):
    if index == 5:
        for trackers in opened:  # between steps: the trackers' thread is done with step 5
            trackers.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return train_step(self, index)
sft.SFTTrainer.step = step
from workers.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sft")
    model = build_tiny_model(root / "model", hidden=32, layers=2, heads=2)
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    run = root / "run.yaml"
    run.write_text(
        f"""
name: sft
dir: {root}/unset
model: {{path: {model}}}
trainer: {{dtype: float32, micro_batch_tokens: 256, num_threads: 1, optimizer: {{lr: 0.003}}}}
checkpoint: {{every_steps: 3, keep: 2}}
logging: {{format: json}}
metrics: {{loggers: []}}
sft: {{data: {data}, eval_fraction: 0.1, batch_size: 8, epochs: 2, eval_every: 2}}
"""
    )
    return {"root": root, "model": model, "data": data, "run": run}


def sft_command(setup: dict[str, Path], run_dir: Path, *prefix: str) -> list[str]:
    return [*prefix, "sft", str(setup["run"]), "--set", f"dir={run_dir}"]


def run(command: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "sft" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def baseline(setup: dict[str, Path]) -> Path:
    """One uninterrupted one-process run of the command."""
    run_dir = setup["root"] / "baseline"
    run(sft_command(setup, run_dir, sys.executable, "-m", "workers"))
    return run_dir


def examples(setup: dict[str, Path]) -> list[SFTExample]:
    return load_examples(setup["data"], load_tokenizer(setup["model"]))[0]


def test_sft_lowers_the_loss_and_writes_a_model_that_loads_as_trained(
    setup: dict[str, Path], tmp_path: Path
) -> None:
    """Training and eval loss fall; the written directory loads in transformers and in the local
    engine, and both give the trained engine's logprobs."""
    from transformers import AutoModelForCausalLM

    from areal_async.engines.local import LocalEngine

    rows = examples(setup)
    engine = fsdp_engine(setup["model"], dtype="float32", lr=3e-3, total_steps=15, micro_batch_tokens=256)
    trainer = SFTTrainer(engine, rows[4:], rows[:4], batch_size=8, epochs=3, seed=0)
    records: list[dict[str, Any]] = []
    trainer.run(tmp_path, CheckpointConfig(every_steps=100), start=0, eval_every=0, on_metrics=records.append)
    assert [r["step"] for r in records] == list(range(16))
    assert records[-1]["loss"] < 0.8 * records[1]["loss"]
    assert records[-1]["eval_loss"] < 0.8 * records[0]["eval_loss"]

    out = tmp_path / "model"
    engine.save_merged_hf(out)
    held_out = to_sequence(rows[0])
    [trained] = engine.compute_logprobs([held_out])
    ids = torch.tensor([*held_out.prompt_ids, *held_out.completion_ids])
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1].float()
    loaded = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0][len(held_out.prompt_ids) - 1 :]
    # float32 forwards of the same weights, one by the engine's kernels: rounding only.
    torch.testing.assert_close(loaded, trained, atol=1e-5, rtol=1e-5)

    async def generate() -> Any:
        async with LocalEngine(out, max_batch_size=1) as local:
            sampling = SamplingParams(temperature=0.0, max_new_tokens=4)
            request = GenerationRequest(
                request_id="g", prompt_ids=tuple(rows[0].prompt_ids), sampling=sampling
            )
            return (await local.generate([request]))[0]

    result = anyio.run(generate)
    seq = TrainSequence(
        prompt_ids=rows[0].prompt_ids,
        completion_ids=result.token_ids,
        behave_logprobs=[0.0] * len(result.token_ids),
        advantages=[0.0] * len(result.token_ids),
    )
    torch.testing.assert_close(
        torch.tensor(result.logprobs), engine.compute_logprobs([seq])[0], atol=1e-5, rtol=1e-5
    )


def test_only_the_assistant_tokens_train(setup: dict[str, Path], tmp_path: Path) -> None:
    """The step loss is the mean NLL of the assistant tokens alone, and training raises their
    logprob while the fixed user text's does not rise (it would, were it trained)."""
    tok = load_tokenizer(setup["model"])
    user, answer = "zzqq zqzq qqzz", "1212"
    row = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
    example = render_row(tok, row, RenderOptions())
    ids = example.prompt_ids + example.completion_ids
    whole = TrainSequence(prompt_ids=ids[:1], completion_ids=ids[1:], behave_logprobs=[0.0] * (len(ids) - 1),
                          advantages=[0.0] * (len(ids) - 1))  # fmt: skip
    user_ids = tok(user, add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(ids)) if ids[i : i + len(user_ids)] == user_ids)
    user_at = [i - 1 for i in range(start, start + len(user_ids))]  # logprob index of token i is i - 1
    answer_at = [len(example.prompt_ids) - 1 + i for i, m in enumerate(example.loss_mask) if m]

    engine = fsdp_engine(setup["model"], dtype="float32", lr=3e-3, total_steps=10, micro_batch_tokens=256)
    before = engine.compute_logprobs([whole])[0]
    trainer = SFTTrainer(engine, [example], batch_size=1, epochs=10, seed=0)
    first = trainer.step(0)
    assert first["loss"] == pytest.approx(-before[answer_at].mean().item(), rel=1e-6)
    assert first["tokens"] == len(answer_at) == len(answer) + 1
    for step in range(1, 10):
        trainer.step(step)
    after = engine.compute_logprobs([whole])[0]
    assert (after[answer_at] - before[answer_at]).mean() > 1.0
    assert (after[user_at] - before[user_at]).mean() < 0.1


def test_with_lora_the_written_model_is_the_base_with_the_adapters_merged(
    setup: dict[str, Path], tmp_path: Path
) -> None:
    """A LoRA warm start writes a plain HF model (no adapter files) whose logprobs are the trained
    adapters' on the base."""
    from transformers import AutoModelForCausalLM

    from areal_async.lora import LoraConfig

    spec = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    rows = examples(setup)
    engine = fsdp_engine(
        setup["model"], dtype="float32", lr=1e-2, total_steps=4, micro_batch_tokens=256, lora=spec
    )
    trainer = SFTTrainer(engine, rows, batch_size=10, epochs=1, seed=0)
    for step in range(trainer.total_steps):
        trainer.step(step)
    out = tmp_path / "merged"
    engine.save_merged_hf(out)
    assert not list(out.glob("adapter_*"))
    seq = to_sequence(rows[0])
    ids = torch.tensor([*seq.prompt_ids, *seq.completion_ids])
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32)
    with torch.no_grad():
        merged_logits, base_logits = (m(ids[None]).logits[0, :-1] for m in (model, base))
    merged = torch.log_softmax(merged_logits, -1).gather(1, ids[1:, None])[:, 0][len(seq.prompt_ids) - 1 :]
    base_lp = torch.log_softmax(base_logits, -1).gather(1, ids[1:, None])[:, 0][len(seq.prompt_ids) - 1 :]
    trained = engine.compute_logprobs([seq])[0]
    torch.testing.assert_close(merged, trained, atol=1e-5, rtol=1e-5)
    assert (merged - base_lp).abs().max() > 1e-3  # the adapters moved the model


def test_the_command_refuses_a_bad_row_naming_its_line(setup: dict[str, Path], tmp_path: Path) -> None:
    """A bad row stops ``areal-async sft`` before training: one line on stderr naming the file and
    line, exit code 2, nothing written."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "completion": "b"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    command = sft_command(setup, tmp_path / "run", sys.executable, "-m", "workers")
    done = run([*command, "--set", f"sft.data={rows}"], check=False)
    assert done.returncode == 2
    assert f"BadRow: {rows}:2: no assistant message: nothing to train" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "sft").exists()


def test_a_killed_run_resumes_from_its_checkpoint_on_the_same_curve(
    setup: dict[str, Path], baseline: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL after the step-3 checkpoint, then the same command again: steps 4-10 repeat the
    uninterrupted run's losses bit for bit (same batches, restored weights, optimizer and schedule,
    the same float operations in the same order on one thread), and metrics.jsonl holds each step
    once; so does the MLflow run, which the second process continues."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    trackers = ["--set", "metrics.loggers=[mlflow]", "--set", f"metrics.mlflow.tracking_uri={uri}"]
    run_dir = setup["root"] / "killed"
    killed = run([*sft_command(setup, run_dir, sys.executable, "-c", KILL_AT_STEP_6), *trackers], check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert (run_dir / "sft" / "checkpoints" / "latest").read_text().strip() == "step_3"
    assert [m["step"] for m in metrics(run_dir)] == [0, 1, 2, 3, 4, 5]

    run([*sft_command(setup, run_dir, sys.executable, "-m", "workers"), *trackers])
    want, got = metrics(baseline), metrics(run_dir)
    assert [m["step"] for m in got] == list(range(11))
    for key in ("loss", "eval_loss", "lr", "tokens", "grad_norm"):
        assert [m.get(key) for m in got] == [m.get(key) for m in want], key
    client = MlflowClient(tracking_uri=uri)
    (tracked,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert tracked.info.run_name == "sft-sft" and tracked.info.status == "FINISHED"
    history = client.get_metric_history(tracked.info.run_id, "sft/loss")
    assert sorted((m.step, m.value) for m in history) == [(m["step"], m["loss"]) for m in want if "loss" in m]
    manifest = json.loads((run_dir / "sft" / "model" / "manifest.json").read_text())
    assert manifest == json.loads((baseline / "sft" / "model" / "manifest.json").read_text())


def test_two_ranks_under_torchrun_train_as_one_process(setup: dict[str, Path], baseline: Path) -> None:
    """``torchrun --nproc-per-node 2 -m workers sft``: each rank trains half of every batch, and the
    losses match the one-process run's up to the order of float sums (relative 1e-5)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = setup["root"] / "two_ranks"
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(port),
    ]
    done = run(sft_command(setup, run_dir, *torchrun, "-m", "workers"))
    assert json.loads(done.stdout.strip().splitlines()[-1])["steps"] == 10  # one summary: rank 0's
    want, got = metrics(baseline), metrics(run_dir)
    assert [m["step"] for m in got] == list(range(11))
    for key in ("loss", "eval_loss", "tokens"):
        assert [key in m for m in got] == [key in m for m in want], key
        values = [m[key] for m in want if key in m]
        assert [m[key] for m in got if key in m] == pytest.approx(values, rel=1e-5), key
    assert (run_dir / "sft" / "model" / "model.safetensors").is_file()
