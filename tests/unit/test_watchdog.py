"""The stall watchdog's verdicts from heartbeats and queue depths (no bus, no processes), and the
deadline of user workflow code."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from areal_async.config import WatchdogConfig
from bus.events import Heartbeat
from workers.agent import EpisodeTimeout, run_episode
from workers.watchdog import StallTracker, Verdict

CFG = WatchdogConfig(frozen_after_s=10, wedged_floor_s=60, first_progress_s=120, history_factor=5)


def beat(role: str, at: float, *, progress_at: float = 0.0, busy_at: float = 0.0, **kw: Any) -> Heartbeat:
    """A heartbeat sent at local time `at` (the tests use one clock for worker and watchdog); busy
    since `busy_at` (0: idle)."""
    fields: dict[str, Any] = dict(
        role=role,
        worker_id=f"{role}-1",
        host="h",
        pid=100,
        status="ready",
        sent_at=at,
        started_at=0.0,
        progress_at=progress_at,
        busy_at=busy_at,
        phase="working" if busy_at else "",
    )
    return Heartbeat(**(fields | kw))


def verdict(tracker: StallTracker, role: str, now: float) -> Verdict:
    return next(v for v in tracker.check(now) if v.role == role)


def test_a_worker_whose_beats_stop_is_frozen_after_the_limit() -> None:
    """No heartbeat for frozen_after_s: frozen, with the silence in the evidence; before it: healthy."""
    t = StallTracker(CFG)
    t.beat(beat("reward", 100.0, progress_at=99.0), now=100.0)
    assert verdict(t, "reward", 109.0).state == "healthy"
    frozen = verdict(t, "reward", 111.0)
    assert frozen.state == "frozen" and "no heartbeat for 11.0 s" in frozen.evidence
    assert frozen.stalled_since == 99.0  # its last unit of work


def test_silence_while_the_watchdog_itself_was_cut_off_is_no_evidence() -> None:
    """The watchdog's own connection was down from 105 s to 140 s (a broker restart): a worker last
    heard at 100 s is not frozen at 141 s; it is if it stays silent for the limit after the view
    came back."""
    t = StallTracker(CFG)
    t.beat(beat("reward", 100.0, progress_at=99.0), now=100.0)
    t.view_since = 140.0
    assert verdict(t, "reward", 141.0).state == "healthy"
    assert verdict(t, "reward", 149.0).state == "healthy"
    frozen = verdict(t, "reward", 151.0)
    assert frozen.state == "frozen" and "no heartbeat for 11.0 s" in frozen.evidence


def test_busy_without_progress_is_wedged_only_past_the_first_progress_allowance() -> None:
    """Beating and busy since 50 s (after an idle start) without a finished unit: healthy until
    first_progress_s of busy time (a first step with compilation), wedged after it."""
    t = StallTracker(CFG)
    t.beat(beat("trainer", 165.0, busy_at=50.0), now=165.0)
    assert verdict(t, "trainer", 165.0).state == "healthy"
    t.beat(beat("trainer", 175.0, busy_at=50.0), now=175.0)
    wedged = verdict(t, "trainer", 175.0)
    assert wedged.state == "wedged" and "no unit of work yet for 125.0 s" in wedged.evidence


def test_a_worker_that_was_idle_for_long_is_not_wedged_when_it_picks_up_work() -> None:
    """An hour without work, then busy for 30 s: the clock runs from the start of the busy period."""
    t = StallTracker(CFG)
    t.beat(beat("reward", 3600.0, progress_at=10.0, busy_at=3570.0), now=3600.0)
    assert verdict(t, "reward", 3600.0).state == "healthy"


def test_the_threshold_grows_with_the_role_s_own_history() -> None:
    """A role whose units take 100 s is not wedged 250 s after its last one (threshold 5 x 100 s);
    it is slow. Past 500 s it is wedged."""
    t = StallTracker(CFG)
    for i in range(1, 4):
        t.beat(beat("trainer", 100.0 * i, progress_at=100.0 * i, busy_at=100.0 * i), now=100.0 * i)
    assert t.threshold("trainer") == 500.0
    t.beat(beat("trainer", 550.0, progress_at=300.0, busy_at=300.0), now=550.0)
    assert verdict(t, "trainer", 550.0).state == "slow"
    t.beat(beat("trainer", 801.0, progress_at=300.0, busy_at=300.0), now=801.0)
    assert verdict(t, "trainer", 801.0).state == "wedged"


def test_an_idle_worker_is_never_wedged_but_waiting_messages_make_it_so() -> None:
    """Without work (not busy, empty queue) no progress is fine; undelivered messages in the role's
    durable consumer are work waiting for it."""
    t = StallTracker(CFG)
    t.beat(beat("reward", 1000.0, progress_at=10.0), now=1000.0)
    assert verdict(t, "reward", 1000.0).state == "healthy"
    t.consumers({"reward": 3, "trainer": 0})
    wedged = verdict(t, "reward", 1000.0)
    assert wedged.state == "wedged" and "3 messages wait in its queue" in wedged.evidence


def test_a_role_blocked_by_a_stuck_upstream_is_starved_and_names_it() -> None:
    """Reward would be wedged (messages wait), but generation, which it waits on, is frozen: reward
    is starved by generation and only generation is a stall to act on."""
    t = StallTracker(CFG)
    t.beat(beat("generation", 100.0, progress_at=100.0), now=100.0)
    t.beat(beat("reward", 200.0, progress_at=50.0, busy_at=60.0), now=200.0)
    verdicts = {v.role: v for v in t.check(200.0)}
    assert verdicts["generation"].state == "frozen"
    assert verdicts["reward"].state == "starved" and verdicts["reward"].upstream == "generation"
    assert [v.role for v in t.new_stalls(list(verdicts.values()), 200.0)] == ["generation"]


def test_a_stall_is_reported_once_and_healed_by_the_role_s_next_progress() -> None:
    """new_stalls reports a stall once; a replacement worker's first unit of work after the
    detection heals it, with the time from the last progress before the stall, also when the
    first beat that shows it is the replacement's last (the run ended within a check interval)."""
    t = StallTracker(CFG)
    t.beat(beat("reward", 100.0, progress_at=95.0), now=100.0)
    assert [v.state for v in t.new_stalls(t.check(120.0), 120.0)] == ["frozen"]
    assert t.new_stalls(t.check(125.0), 125.0) == []
    t.forget("reward", "reward-1")  # killed
    assert t.healed() == []
    t.beat(
        beat("reward", 140.0, progress_at=138.0, worker_id="reward-2", pid=101, status="stopped"), now=140.0
    )
    [(stalled, seconds)] = t.healed()
    assert stalled.worker_id == "reward-1" and seconds == 138.0 - 95.0
    assert t.healed() == []


def test_a_stopped_worker_is_forgotten() -> None:
    """A worker's last heartbeat (status stopped) removes it: it is never called frozen."""
    t = StallTracker(CFG)
    t.beat(beat("reward", 100.0), now=100.0)
    t.beat(beat("reward", 101.0, status="stopped"), now=101.0)
    assert t.check(500.0) == []


@pytest.mark.asyncio
async def test_an_episode_past_its_deadline_fails_instead_of_holding_the_worker() -> None:
    """User workflow code that never returns is cut at agent.episode_timeout_s with the reason; one
    that returns in time gives its episode."""

    async def stuck(client: object, row: dict[str, Any], ctx: Any) -> Any:
        await anyio.sleep_forever()

    async def quick(client: object, row: dict[str, Any], ctx: Any) -> Any:
        return row["episode"]

    ctx = SimpleNamespace(group_index=3)
    assert await run_episode(quick, None, {"episode": "done"}, ctx, timeout_s=5) == "done"
    started = time.monotonic()
    with pytest.raises(EpisodeTimeout, match=r"episode 3 passed agent.episode_timeout_s=0.2"):
        await run_episode(stuck, None, {}, ctx, timeout_s=0.2)
    assert time.monotonic() - started < 2
