"""Whole multi-turn runs: agent workers, generation workers answering their calls, the trainer.

The tiny model is warm-started on mode_select in the chat format (two answer modes, first-try
greedy accuracy near 50%). With ``multi_turn`` a wrong answer gets a feedback message and a second
try; the episode reward discounts the second turn. RL must make the first answer right more often.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.jobs import (
    committed_steps,
    finish_job,
    read_steps,
    read_stream,
    run_job,
    start_job,
    steps_done,
    tiny_config,
)

LEARN_STEPS = 32


def _agent_config(tmp: Path, model: Path, name: str, **extra: object) -> Path:
    sections: dict[str, object] = {
        "rollout__workflow": "multi_turn",
        "rollout__group_size": 8,
        "rollout__sampling__max_new_tokens": 4,
        "agent__max_turns": 2,
        "agent__call_timeout_s": 20.0,
        "trainer__batch_size": 16,
        "trainer__total_steps": LEARN_STEPS,
        "trainer__eval_every": 8,
        "dataset__eval_size": 30,
        "checkpoint__every_steps": 4,
    }
    sections.update(extra)
    return tiny_config(tmp, model, name, **sections)


def _rise(values: list[float]) -> float:
    """The least-squares line's rise from the first value's index to the last's."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / sum(
        (x - mean_x) ** 2 for x in range(n)
    )
    return slope * (n - 1)


def _check_exactly_once(steps, total_steps: int, batch_size: int) -> None:
    final = committed_steps(steps)
    assert sorted(final) == list(range(1, total_steps + 1))
    ids = [t for ev in final.values() for t in ev.task_ids]
    assert not [t for t, n in Counter(ids).items() if n > 1], "trained twice"
    assert all(len(ev.task_ids) == batch_size for ev in final.values())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_multi_turn_run_learns_to_answer_right_the_first_time(
    tmp_path: Path, tiny_chat_model: Path
) -> None:
    """The episode reward rises; every step is trained once, within the staleness bound.

    The rise is judged on the training episodes (128 a step). mode_select has only 20 held-out
    prompts, so a greedy evaluation moves in steps of 0.05: its first-try rate did not rise in every
    run (0.35 at v0, then 0.25-0.35, while the training reward rose 0.55 -> 0.69), too few prompts
    to assert on; the evaluations are printed."""
    cfg = _agent_config(tmp_path, tiny_chat_model, "agents")
    res = run_job(cfg, timeout=800)
    assert res.returncode == 0, res.output[-4000:]
    evals = res.evals()
    first, last = evals[0], evals[-1]
    print(
        "first try {:.3f} -> {:.3f}; within 2 turns {:.3f} -> {:.3f}; {:.0f} s".format(
            first["eval/episode/first_try"],
            last["eval/episode/first_try"],
            first["eval/accuracy"],
            last["eval/accuracy"],
            res.seconds,
        )
    )
    # 20 held-out prompts are a noisy measure; the training reward over 128 episodes a step less so,
    # but a step's mean still varies by ~0.05, so the test fits a line through every step's reward.
    # Over 24 steps its rise was 0.05-0.21 in 13 runs (one under 0.06); over 32 steps 0.11-0.15 in
    # four.
    rewards = [m["reward_mean"] for m in res.metrics()]
    assert len(rewards) == LEARN_STEPS, rewards
    assert _rise(rewards) >= 0.06, rewards
    steps = read_steps(res.run_dir, "agents")
    _check_exactly_once(steps, LEARN_STEPS, 16)
    for ev in steps:
        t = ev.policy_version - 1
        assert all(t - 2 <= h <= t for h in ev.head_versions), (ev.step, ev.head_versions)


VICTIMS = ("agent", "generation", "trainer")


@pytest.mark.timeout(900)
def test_killing_each_role_mid_episode_loses_nothing(tmp_path: Path, tiny_model: Path) -> None:
    """SIGKILL one role after another during one multi-turn run, each once the previous one is back
    and training has moved on: an agent's tasks are redelivered to the restarted worker (its partial
    episodes never trained), an agent retries the calls a dead generation worker held, a restored
    trainer re-trains from its checkpoint. The run completes and nothing is trained twice."""
    name = "agentkill"
    per_victim = 3
    total = per_victim * (len(VICTIMS) + 1)
    cfg = _agent_config(
        tmp_path, tiny_model, name, trainer__total_steps=total, trainer__batch_size=8,
        trainer__eval_every=0, dataset__eval_size=4, rollout__group_size=4, checkpoint__every_steps=2,
    )  # fmt: skip
    run_dir = tmp_path / name
    started = time.monotonic()
    proc = start_job(cfg)
    try:
        for i, victim in enumerate(VICTIMS, start=1):
            deadline = time.monotonic() + 300
            while (
                steps_done(run_dir) < i * per_victim and proc.poll() is None and time.monotonic() < deadline
            ):
                time.sleep(0.05)
            assert steps_done(run_dir) >= i * per_victim, f"no progress before killing the {victim}"
            logs = sorted((run_dir / "logs").glob(f"{victim}-*.jsonl"), key=lambda p: p.stat().st_mtime)
            assert logs, f"no {victim} worker log"
            os.kill(int(logs[-1].stem.rsplit("-", 1)[1]), signal.SIGKILL)
    finally:
        res = finish_job(proc, run_dir, started, timeout=500)
    assert res.returncode == 0, res.output[-4000:]
    for victim in VICTIMS:
        assert f"warning: {victim} exited with -9; restart 1/3" in res.output, res.output[-4000:]
    steps = read_steps(run_dir, name)
    _check_exactly_once(steps, total, 8)
    for ev in committed_steps(steps).values():
        t = ev.policy_version - 1
        assert all(t - 2 <= h <= t for h in ev.head_versions), (ev.step, ev.head_versions)

    letters = read_stream(run_dir, name, "DEADLETTER")
    assert not [d for d in letters if "workflow" in d.reason], [d.reason for d in letters]
