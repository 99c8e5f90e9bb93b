"""A whole run with simulated engines and a simulated trainer: every real path but the math."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.helpers.jobs import committed_steps, read_steps, run_job, worker_log

PROFILE = {
    # A completion of 12 tokens (the tail reaches the cap of 32) takes 0.7 s, a step of 4 groups x 8 x
    # 12 tokens 0.77 s: engines are decoding whenever a version loads.
    "engine": {"decode_step_s": 0.06, "completion_tokens_mean": 12, "completion_tokens_sigma": 0.5},
    "trainer": {"seconds_per_token": 0.002, "save_s": 0.01},
    "weights": {"bytes": 50_000_000, "bandwidth_gb_s": 1.0},
}


def simulated_config(tmp: Path, name: str, *, max_staleness: int, steps: int) -> Path:
    (tmp / "profile.yaml").write_text(yaml.safe_dump(PROFILE))
    cfg = {
        "name": name,
        "dir": str(tmp / name),
        "model": {"path": "simulated", "use_chat_template": False},
        "dataset": {"kind": "arithmetic", "eval_size": 4, "epochs": 100, "options": {"lo": 10, "hi": 99}},
        "rollout": {
            "engine": "simulated",
            "group_size": 8,
            "max_staleness": max_staleness,
            "max_batch_size": 16,
            "sampling": {"max_new_tokens": 32},
        },
        "reward": {"fn": "arithmetic", "num_workers": 1, "timeout_s": 5},
        "trainer": {"backend": "simulated", "batch_size": 4, "total_steps": steps, "eval_every": 0},
        "simulation": {"profile": str(tmp / "profile.yaml"), "engines_per_worker": 3},
        "checkpoint": {"every_steps": 4},
        "logging": {"format": "json"},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.timeout(240)
def test_simulated_run_keeps_the_staleness_bound_and_trains_every_task_once(tmp_path: Path) -> None:
    """Three simulated engines (one process, three bus clients) and a simulated trainer run 10 steps at
    max_staleness 1 through the real controller, reward, weight-sync and bus: every committed step
    trains B groups inside the guard's window, no task twice, the engines' versions advance with the
    trainer's, some completion spans two versions (a load interrupted its decoding), and the run ends
    with a checkpoint of the last step."""
    steps, eta = 10, 1
    cfg = simulated_config(tmp_path, "sim", max_staleness=eta, steps=steps)
    job = run_job(cfg, timeout=200)
    assert job.returncode == 0, job.output[-3000:]
    final = committed_steps(read_steps(job.run_dir, "sim"))
    assert sorted(final) == list(range(1, steps + 1))
    ids = [task for ev in final.values() for task in ev.task_ids]
    assert len(ids) == len(set(ids)) == 4 * steps
    for ev in final.values():
        t = ev.policy_version - 1
        assert all(t - eta <= h <= t for h in ev.head_versions), (ev.step, ev.head_versions)
    assert max(h for ev in final.values() for h in ev.head_versions) >= steps - 1 - eta
    groups = worker_log(job.run_dir, "generation", "group generated")
    engines = {g["worker_id"] for g in groups}
    assert len(engines) == 3, engines
    assert any(g["tail_version"] > g["head_version"] for g in groups), "no load interrupted a completion"
    loaded = worker_log(job.run_dir, "generation", "weights loaded")
    assert {g["policy_version"] for g in loaded} >= set(range(1, steps))
    assert (job.run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps}"
