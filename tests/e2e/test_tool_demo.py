"""The tool demo's chain on a tiny model: calculator transcripts, ``areal-async sft`` on them, then a
``tool_use`` RL run that starts from the model the warm start wrote (configs/agent_tool_words_cpu.yaml)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_async.agents import Calculator
from areal_async.agents.toolcall import render_tool_prompt
from areal_async.data.tool_transcripts import DEMO_KIND, DEMO_OPTIONS, tool_transcripts, write_jsonl
from tests.helpers.jobs import REPO, run_job, tiny_config
from tests.helpers.models import build_tiny_model

SYSTEM = "Use the calculator tool for arithmetic, then give the final number."


@pytest.mark.timeout(800)
def test_a_warm_start_on_transcripts_feeds_a_tool_use_run(tmp_path: Path) -> None:
    """sft trains on generated transcripts and writes a model; a two-step tool_use run from that
    model trains both steps, evaluates, and reports the share of episodes with a call that ran."""
    rows = tool_transcripts(16, seed=1)
    data = write_jsonl(rows, tmp_path / "rows.jsonl")
    texts = [SYSTEM, render_tool_prompt([Calculator()]), *(json.dumps(r) for r in rows)]
    base = build_tiny_model(tmp_path / "base", vocab="bpe", texts=texts, hidden=32, layers=2, heads=2)
    cfg = tiny_config(
        tmp_path, base, "tooldemo",
        model__use_chat_template=True, model__system_prompt=SYSTEM,
        dataset__kind=DEMO_KIND, dataset__options=DEMO_OPTIONS, dataset__eval_size=2,
        rollout__workflow="tool_use", rollout__group_size=2, rollout__sampling__max_new_tokens=8,
        agent__max_turns=2, agent__tools=["calculator"], agent__call_timeout_s=60.0,
        reward__fn="arithmetic", trainer__batch_size=2, trainer__total_steps=2, trainer__eval_every=2,
        checkpoint__every_steps=2, sft={"data": str(data), "batch_size": 8, "epochs": 1},
    )  # fmt: skip
    run_dir = tmp_path / "tooldemo"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "workers", "sft", str(cfg)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["rows"] == 16 and summary["steps"] == 2 and not summary["skipped"]
    model = run_dir / "sft" / "model"
    assert Path(summary["out"]) == model and (model / "model.safetensors").is_file()

    res = run_job(cfg, f"model.path={model}", timeout=400)
    assert res.returncode == 0, res.output[-4000:]
    assert [m["step"] for m in res.metrics()] == [1, 2]
    evals = res.evals()
    assert evals, res.output[-4000:]
    assert all(0.0 <= e["eval/episode/tool_ok_rate"] <= e["eval/episode/tool_use_rate"] for e in evals)
