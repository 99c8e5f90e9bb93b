"""The dashboard's model of a run (``workers.dashboard.view``) and its small rules, without a bus."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from areal_async.errors import ConfigError
from bus import events as ev
from workers.cli import main
from workers.dashboard import choose_token, dashboard_main, is_loopback
from workers.dashboard.view import RunView


def _view(**kw: object) -> RunView:
    return RunView("r1", max_staleness=2, heartbeat_interval_s=1.0, heartbeat_ttl_s=5.0, **kw)  # type: ignore[arg-type]


def _beat(worker_id: str, role: str = "reward", **kw: object) -> ev.Heartbeat:
    return ev.Heartbeat(role=role, worker_id=worker_id, host="h", pid=7, status="ready", sent_at=0.0, **kw)  # type: ignore[arg-type]


def _step(step: int, reward: float) -> ev.TrainerStep:
    return ev.TrainerStep(
        step=step, policy_version=step, task_ids=[], head_versions=[], metrics={"reward_mean": reward}
    )


def test_a_worker_is_live_then_late_then_dead_and_stalled_while_the_watchdog_says_so() -> None:
    """States follow the silence since the last beat (2 intervals + 1 s: late; past the TTL: dead),
    a reported stall wins until the role heals, and after the run ends a silent worker has exited."""
    view = _view()
    view.heartbeat(_beat("w1", peak_rss=5, restarts=2), heard_at=100.0)
    state = lambda now: view.fleet(now)[0]["state"]  # noqa: E731
    assert [state(102.0), state(104.0), state(106.0)] == ["live", "late", "dead"]
    assert view.fleet(100.0)[0]["peak_rss"] == 5 and view.fleet(100.0)[0]["restarts"] == 2
    view.stall(
        {"event": "RunStalled", "role": "reward", "worker_id": "w1", "state": "wedged", "evidence": "x"}
    )
    assert state(100.0) == "stalled" and view.letters.total == 1
    view.stall({"event": "RunHealed", "role": "reward", "worker_id": "w1", "state": "wedged"})
    assert state(100.0) == "live"
    view.run_ended("total_steps reached", 3)
    assert state(106.0) == "exited"


def test_a_page_gets_only_the_step_rows_it_lacks_and_all_of_them_after_a_step_repeats() -> None:
    """``since(cursor)`` sends new rows from the page's count on; a step repeated after a trainer
    restore rewrites its row and makes the next update carry every row (``steps_from`` 0)."""
    view = _view()
    for s in (1, 2, 3):
        view.step(_step(s, 0.1 * s), at=float(s))
    cursor = view.cursor()
    view.step(_step(4, 0.4), at=4.0)
    update = view.since(cursor)
    assert update["steps_from"] == 3 and update["steps"]["step"] == [4]
    cursor = update["cursor"]
    view.step(_step(2, 0.9), at=5.0)  # repeated after a restore
    update = view.since(cursor)
    assert update["steps_from"] == 0 and update["steps"]["step"] == [1, 2, 3, 4]
    assert update["steps"]["reward_mean"][1] == 0.9
    assert view.since(update["cursor"])["steps"]["step"] == []


def test_a_rollout_shows_each_completions_version_span_and_an_episodes_turns() -> None:
    """Head..tail per completion from its per-token versions (an interrupted generation spans
    two); an agent episode's loss mask becomes its model and context turns, each with its tokens
    decoded when the run's tokenizer is at hand (None otherwise)."""
    completion = ev.Completion(
        token_ids=ev.pack_i32([1, 2, 3, 4, 5]),
        logprobs=ev.pack_f32([-1.0, 0.0, 0.0, -1.0, -1.0]),
        versions=ev.pack_i32([3, 3, 3, 4, 4]),
        finish_reason="stop",
        text="<tool_call>x</tool_call>",
        loss_mask=ev.pack_u8([1, 0, 0, 1, 1]),
    )
    group = ev.RolloutGroup(
        task_id="e0-i1", kind="train", index=1, epoch=0, attempt=0, row={"prompt": "2+2="},
        engine_id="g", prompt_ids=ev.pack_i32([9]), completions=[completion, completion],
        head_version=3, tail_version=4,
    )  # fmt: skip
    scored = ev.ScoredGroup(group=group, rewards=[1.0, 0.0], reward_errors=["", ""], reward_seconds=0.0)
    view = _view(decode=lambda ids: "".join(chr(96 + i) for i in ids))  # 1 -> "a", 2 -> "b", ...
    view.scored(scored, 1.0)
    entry = view.snapshot()["rollouts"][0]
    first = entry["completions"][0]
    assert entry["prompt"] == "2+2=" and first["reward"] == 1.0 and first["tokens"] == 5
    assert (first["head"], first["tail"]) == (3, 4)
    assert first["turns"] == [["model", 1, "a"], ["context", 2, "bc"], ["model", 2, "de"]]
    without_tokenizer = _view()
    without_tokenizer.scored(scored, 1.0)
    assert without_tokenizer.snapshot()["rollouts"][0]["completions"][0]["turns"][1] == ["context", 2, None]


def test_only_a_loopback_bind_goes_without_a_token() -> None:
    """127.0.0.1, ::1 and localhost need none; any other address gets a fresh one unless given."""
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert choose_token("127.0.0.1", None) is None
    made = choose_token("0.0.0.0", None)
    assert made and len(made) >= 24 and made != choose_token("0.0.0.0", None)
    assert choose_token("10.0.0.5", "given") == "given"


def test_without_the_dashboard_extra_the_error_names_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With uvicorn not importable, ``areal-async dashboard`` and ``areal-async run --dashboard``
    fail before anything starts, with one line that names the extra to install."""
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    with pytest.raises(
        ConfigError, match=r"'dashboard' extra \(uvicorn is missing\).*areal-async\[dashboard\]"
    ):
        dashboard_main(SimpleNamespace())
    assert main(["run", "no-such-run.yaml", "--dashboard"]) == 2
    assert "error: ConfigError: the dashboard needs the 'dashboard' extra" in capsys.readouterr().err


def test_the_dashboard_imports_no_torch() -> None:
    """The dashboard starts fast: its modules (and inspect's, which it reuses) pull in neither torch
    nor transformers."""
    code = (
        "import sys, workers.dashboard, workers.dashboard.app, workers.dashboard.reader; "
        "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
