"""Unit tests of areal_async.algo.staleness, and a simulated run that checks the staleness invariant.

The simulation is a discrete-event model of the pipeline of docs/design.md sections 5, 7 and 8, with timings
drawn by hypothesis: a controller issuing prompt tasks under ``admission_allows``; generation engines
stamping ``head_version`` with the version they serve when they start a task; reward latency; a
weight-sync worker that declares a version served once every live engine has loaded it; a trainer that
takes the oldest scored groups, applies ``guard`` and re-issues what it rejects, steps, checkpoints and
publishes weights. Crashes: an engine dies (its in-flight tasks are redelivered) and comes back on the
served weights; the trainer dies mid-step and is restored from its last checkpoint (an older version),
republishes those weights, and the controller re-issues the groups trained after that checkpoint.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_async.algo.staleness import StalenessStats, admission_allows, admission_capacity, guard


def test_admission_is_bounded_by_the_staleness_window() -> None:
    """max_staleness 1, v 2, B 4: at most (1 + 2 + 1) * 4 = 16 tasks issued; the 16th is allowed, the 17th is not."""
    common = dict(trained=14, served_version=2, max_staleness=1, batch_size=4, max_inflight=100)
    assert admission_allows(issued=15, **common)
    assert not admission_allows(issued=16, **common)


def test_admission_is_bounded_by_max_inflight() -> None:
    """issued - trained < max_inflight: 3 in flight with a limit of 4 is allowed, 4 is not."""
    common = dict(served_version=10, max_staleness=2, batch_size=4, max_inflight=4)
    assert admission_allows(issued=11, trained=8, **common)
    assert not admission_allows(issued=12, trained=8, **common)


def test_synchronous_rl_issues_one_batch_per_served_version() -> None:
    """max_staleness 0: before any step (v 0) exactly B tasks; after v 1 is served, B more."""
    kwargs = dict(max_staleness=0, batch_size=3, max_inflight=100)
    assert admission_capacity(issued=0, trained=0, served_version=0, **kwargs) == 3
    assert admission_capacity(issued=3, trained=3, served_version=0, **kwargs) == 0
    assert admission_capacity(issued=3, trained=3, served_version=1, **kwargs) == 3


@given(
    issued=st.integers(0, 60),
    trained=st.integers(0, 60),
    served_version=st.integers(0, 10),
    max_staleness=st.integers(0, 4),
    batch_size=st.integers(1, 6),
    max_inflight=st.integers(1, 30),
)
def test_admission_capacity_counts_exactly_the_tasks_admission_allows(**kwargs: int) -> None:
    """Issuing one task at a time while admission_allows holds issues admission_capacity tasks."""
    capacity = admission_capacity(**kwargs)
    assert (capacity > 0) == admission_allows(**kwargs)
    issued = kwargs.pop("issued")
    count = 0
    while admission_allows(issued=issued + count, **kwargs):
        count += 1
    assert count == capacity


def test_guard_accepts_exactly_the_window_t_minus_eta_to_t() -> None:
    """t 5, max_staleness 2: head 3, 4, 5 are ok; 2 is stale; 6 is from the future."""
    verdicts = {h: guard(head_version=h, trainer_version=5, max_staleness=2) for h in range(1, 8)}
    assert verdicts == {1: "stale", 2: "stale", 3: "ok", 4: "ok", 5: "ok", 6: "future", 7: "future"}


def test_guard_with_eta_zero_accepts_only_the_current_version() -> None:
    """Synchronous RL: only head == t trains."""
    assert guard(head_version=3, trainer_version=3, max_staleness=0) == "ok"
    assert guard(head_version=2, trainer_version=3, max_staleness=0) == "stale"
    assert guard(head_version=4, trainer_version=3, max_staleness=0) == "future"


def test_staleness_stats_summarise_t_minus_head() -> None:
    """t 7, heads [7, 5, 6]: lags [0, 2, 1] -> mean 1, max 2, min 0; an empty batch is all zeros."""
    stats = StalenessStats.of(trainer_version=7, head_versions=[7, 5, 6])
    assert (stats.count, stats.mean, stats.max, stats.min) == (3, 1.0, 2, 0)
    assert stats.as_metrics() == {"staleness_mean": 1.0, "staleness_max": 2.0, "staleness_min": 0.0}
    assert StalenessStats.of(trainer_version=3, head_versions=[]) == StalenessStats(0, 0.0, 0, 0)


# --- simulated run ------------------------------------------------------------------------------


@dataclass
class _Task:
    task_id: int
    prompt: int
    state: str = "queued"  # queued | generating | scoring | buffered | training | trained | failed
    head_version: int = -1
    engine: int = -1
    delivery: int = 0  # bumped on redelivery, so events of an earlier delivery are ignored


@dataclass
class _Engine:
    alive: bool = True
    version: int = 0
    applied_seq: int = 0  # index into _Run.published of the weights it serves


class _Run:
    """One simulated run; every check is an assert inside the event handlers or ``check_final``."""

    def __init__(
        self,
        *,
        max_staleness: int,
        batch_size: int,
        max_inflight: int,
        num_engines: int,
        ckpt_every: int,
        rng: random.Random,
    ) -> None:
        self.max_staleness, self.batch_size, self.max_inflight, self.ckpt_every, self.rng = (
            max_staleness,
            batch_size,
            max_inflight,
            ckpt_every,
            rng,
        )
        self.now = 0.0
        self.events: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self.event_count = 0
        self.tasks: dict[int, _Task] = {}
        # controller (its counters are what it would keep in KV)
        self.issued = 0
        self.trained = 0
        self.served_version = 0
        self.requeue: deque[int] = deque()
        self.next_prompt = 0
        self.issue_checks = 0
        # weight sync
        self.published = [0]  # publish sequence -> policy version; 0 = the initial weights
        self.served_seq = 0
        self.engines = [_Engine() for _ in range(num_engines)]
        # trainer
        self.trainer_version = 0
        self.trainer_alive = True
        self.step_token = 0
        self.in_step: list[int] = []
        self.buffer: list[int] = []
        self.trained_ids: list[int] = []
        self.checkpoint: tuple[int, list[int]] = (0, [])
        # record
        self.recycled: Counter[str] = Counter()
        self.trained_heads: list[tuple[int, int]] = []
        self.steps = 0

    # plumbing
    def schedule(self, delay: float, kind: str, *args: Any) -> None:
        self.event_count += 1
        heapq.heappush(self.events, (self.now + delay, self.event_count, kind, args))

    def run(
        self, *, target_version: int, crashes: list[tuple[float, str, int]], max_events: int = 60_000
    ) -> None:
        for at, kind, who in crashes:
            heapq.heappush(self.events, (at, -1, f"{kind}_crash", (who,)))
        crashes_left = len(crashes)
        self.pump()
        handled = 0
        while not (crashes_left == 0 and self.trainer_alive and self.trainer_version >= target_version):
            assert self.events, f"deadlock: nothing left to happen at t={self.now:.1f}: {self.describe()}"
            handled += 1
            assert handled <= max_events, f"no progress after {max_events} events: {self.describe()}"
            self.now, _, kind, args = heapq.heappop(self.events)
            crashes_left -= kind.endswith("_crash")
            getattr(self, f"on_{kind}")(*args)

    def describe(self) -> str:
        states = Counter(t.state for t in self.tasks.values())
        return (
            f"trainer v{self.trainer_version} alive={self.trainer_alive} served v{self.served_version} "
            f"issued={self.issued} trained={self.trained} tasks={dict(states)} recycled={dict(self.recycled)}"
        )

    # controller
    def pump(self) -> None:
        while admission_allows(
            issued=self.issued,
            trained=self.trained,
            served_version=self.served_version,
            max_staleness=self.max_staleness,
            batch_size=self.batch_size,
            max_inflight=self.max_inflight,
        ):
            self.issue()

    def issue(self) -> None:
        # The admission formula, checked against ground truth rather than the controller's counters.
        issued_truth = sum(t.state != "failed" for t in self.tasks.values())
        assert self.issued == issued_truth
        assert self.trained == len(self.trained_ids)
        assert issued_truth < (self.max_staleness + self.served_version + 1) * self.batch_size
        assert issued_truth - len(self.trained_ids) < self.max_inflight
        self.issue_checks += 1
        prompt = self.requeue.popleft() if self.requeue else self._new_prompt()
        task = _Task(task_id=len(self.tasks), prompt=prompt)
        self.tasks[task.task_id] = task
        self.issued += 1
        self.schedule(self.rng.uniform(0.0, 0.3), "start", task.task_id, task.delivery)

    def _new_prompt(self) -> int:
        self.next_prompt += 1
        return self.next_prompt - 1

    def recycle(self, task: _Task, reason: str) -> None:
        """rollout.failed: the task no longer counts as issued and its prompt is issued again."""
        task.state = "failed"
        self.issued -= 1
        self.requeue.append(task.prompt)
        self.recycled[reason] += 1

    # generation and reward
    def on_start(self, task_id: int, delivery: int) -> None:
        task = self.tasks[task_id]
        if task.delivery != delivery or task.state != "queued":
            return
        live = [i for i, e in enumerate(self.engines) if e.alive]
        if not live:
            self.schedule(1.0, "start", task_id, delivery)
            return
        task.engine = self.rng.choice(live)
        task.head_version = self.engines[task.engine].version
        task.state = "generating"
        self.schedule(self.rng.uniform(0.5, 4.0), "generated", task_id, delivery)

    def on_generated(self, task_id: int, delivery: int) -> None:
        task = self.tasks[task_id]
        if task.delivery != delivery or task.state != "generating":
            return
        task.state = "scoring"
        slow = self.rng.random() < 0.1
        self.schedule(self.rng.uniform(5.0, 12.0) if slow else self.rng.uniform(0.0, 1.0), "scored", task_id)

    def on_scored(self, task_id: int) -> None:
        task = self.tasks[task_id]
        task.state = "buffered"
        self.buffer.append(task_id)
        self.try_train()

    # weight sync
    def publish(self, version: int) -> None:
        self.published.append(version)
        seq = len(self.published) - 1
        for i in range(len(self.engines)):
            self.schedule(self.rng.uniform(0.1, 1.5), "load", i, seq)

    def on_load(self, engine_id: int, seq: int) -> None:
        engine = self.engines[engine_id]
        if not engine.alive or seq <= engine.applied_seq:
            return
        engine.applied_seq = seq
        engine.version = self.published[seq]
        self.check_served()

    def check_served(self) -> None:
        live = [e.applied_seq for e in self.engines if e.alive]
        if live and min(live) > self.served_seq:
            self.served_seq = min(live)
            self.served_version = self.published[self.served_seq]
            self.pump()

    def on_engine_crash(self, engine_id: int) -> None:
        engine = self.engines[engine_id % len(self.engines)]
        if not engine.alive:
            return
        engine.alive = False
        for task in self.tasks.values():
            if task.state == "generating" and task.engine == engine_id % len(self.engines):
                task.delivery += 1  # unacked prompt task: redelivered after the ack wait
                task.state = "queued"
                task.head_version = -1
                self.schedule(self.rng.uniform(0.5, 2.0), "start", task.task_id, task.delivery)
        self.schedule(self.rng.uniform(0.5, 5.0), "engine_restart", engine_id % len(self.engines))
        self.check_served()

    def on_engine_restart(self, engine_id: int) -> None:
        engine = self.engines[engine_id]
        engine.alive = True
        engine.applied_seq = self.served_seq
        engine.version = self.published[self.served_seq]
        if len(self.published) - 1 > self.served_seq:
            self.schedule(self.rng.uniform(0.1, 1.5), "load", engine_id, len(self.published) - 1)
        self.check_served()

    # trainer
    def try_train(self) -> None:
        if not self.trainer_alive or self.in_step:
            return
        selected: list[int] = []
        for task_id in sorted(self.buffer):  # task ids grow with issue order: oldest first
            task = self.tasks[task_id]
            verdict = guard(
                head_version=task.head_version,
                trainer_version=self.trainer_version,
                max_staleness=self.max_staleness,
            )
            if verdict != "ok":
                self.recycle(task, verdict)
            elif len(selected) < self.batch_size:
                selected.append(task_id)
        self.buffer = [i for i in self.buffer if self.tasks[i].state == "buffered" and i not in selected]
        if len(selected) < self.batch_size:
            self.buffer.extend(selected)
            self.pump()
            return
        for task_id in selected:
            self.tasks[task_id].state = "training"
        self.in_step = selected
        self.step_token += 1
        self.schedule(self.rng.uniform(0.5, 2.0), "step_done", self.step_token)

    def on_step_done(self, token: int) -> None:
        if token != self.step_token or not self.trainer_alive:
            return
        t = self.trainer_version
        heads = [self.tasks[i].head_version for i in self.in_step]
        for head in heads:
            assert t - self.max_staleness <= head <= t, (
                f"trained head_version {head} at trainer version {t}, max_staleness {self.max_staleness}"
            )
            self.trained_heads.append((t, head))
        stats = StalenessStats.of(trainer_version=t, head_versions=heads)
        assert 0 <= stats.min <= stats.max <= self.max_staleness
        for task_id in self.in_step:
            self.tasks[task_id].state = "trained"
            self.trained_ids.append(task_id)
        self.trained += len(self.in_step)  # trainer.step reaches the controller
        self.in_step = []
        self.trainer_version += 1
        self.steps += 1
        if self.trainer_version % self.ckpt_every == 0:
            self.checkpoint = (self.trainer_version, list(self.trained_ids))
        self.publish(self.trainer_version)
        self.pump()
        self.try_train()

    def on_trainer_crash(self, _who: int) -> None:
        if not self.trainer_alive:
            return
        self.trainer_alive = False
        self.step_token += 1
        for task_id in self.in_step:  # consumed but unacked: redelivered to the restarted trainer
            self.tasks[task_id].state = "buffered"
            self.buffer.append(task_id)
        self.in_step = []
        self.schedule(self.rng.uniform(0.5, 5.0), "trainer_restore")

    def on_trainer_restore(self) -> None:
        version, ids = self.checkpoint
        assert self.trained_ids[: len(ids)] == ids
        for task_id in self.trained_ids[len(ids) :]:  # trained in the lost future: re-issued
            self.recycle(self.tasks[task_id], "lost")
        self.trained_ids = list(ids)
        self.trained = len(ids)
        self.trainer_version = version
        self.trainer_alive = True
        self.publish(version)  # engines must come back to the restored weights, or nothing is ever ok
        self.pump()
        self.try_train()

    def check_final(self) -> None:
        live_prompts = [t.prompt for t in self.tasks.values() if t.state != "failed"]
        assert len(live_prompts) == len(set(live_prompts)), "a prompt is live twice"
        trained_prompts = [self.tasks[i].prompt for i in self.trained_ids]
        assert len(trained_prompts) == len(set(trained_prompts)), "a prompt was trained twice"
        assert set(live_prompts) | set(self.requeue) == set(range(self.next_prompt)), "a prompt was lost"
        assert not set(live_prompts) & set(self.requeue)


_timing = dict(
    max_staleness=st.integers(0, 3),
    batch_size=st.integers(1, 4),
    extra_inflight=st.integers(0, 8),
    num_engines=st.integers(1, 3),
    ckpt_every=st.integers(1, 3),
    rng=st.randoms(use_true_random=False),
)


def _make_run(
    max_staleness: int,
    batch_size: int,
    extra_inflight: int,
    num_engines: int,
    ckpt_every: int,
    rng: random.Random,
) -> _Run:
    # max_inflight >= B: with fewer the trainer can never gather a batch.
    return _Run(
        max_staleness=max_staleness,
        batch_size=batch_size,
        max_inflight=batch_size + extra_inflight,
        num_engines=num_engines,
        ckpt_every=ckpt_every,
        rng=rng,
    )


@settings(max_examples=150, deadline=None)
@given(**_timing)
def test_without_crashes_the_run_progresses_and_every_trained_group_is_in_the_window(
    max_staleness: int,
    batch_size: int,
    extra_inflight: int,
    num_engines: int,
    ckpt_every: int,
    rng: random.Random,
) -> None:
    """Random timings, no crashes: 8 steps complete (no deadlock), admission always holds at issue time,
    every trained group satisfies t - max_staleness <= head_version <= t, and no group is ever from the future."""
    run = _make_run(max_staleness, batch_size, extra_inflight, num_engines, ckpt_every, rng)
    run.run(target_version=8, crashes=[])
    run.check_final()
    assert run.steps == 8
    assert len(run.trained_heads) == 8 * batch_size
    assert run.recycled["future"] == 0
    assert run.issue_checks >= 8 * batch_size


_crash = st.tuples(st.floats(0.0, 60.0), st.sampled_from(["engine", "trainer"]), st.integers(0, 2))


@settings(max_examples=150, deadline=None)
@given(**_timing, crashes=st.lists(_crash, min_size=1, max_size=4))
def test_with_crashes_and_restores_the_window_holds_and_the_run_recovers(
    max_staleness: int,
    batch_size: int,
    extra_inflight: int,
    num_engines: int,
    ckpt_every: int,
    rng: random.Random,
    crashes: list[tuple[float, str, int]],
) -> None:
    """Engine crashes (redelivery) and trainer crashes (restore to an older checkpoint): admission holds
    at every issue, every trained group is inside the window, groups from the lost future are recycled,
    nothing is lost or trained twice, and after the last crash the run still reaches version 8."""
    run = _make_run(max_staleness, batch_size, extra_inflight, num_engines, ckpt_every, rng)
    run.run(target_version=8, crashes=crashes)
    run.check_final()
    if not any(kind == "trainer" for _, kind, _ in crashes):
        assert run.recycled["future"] == 0


def test_a_restore_to_an_older_checkpoint_recycles_future_groups() -> None:
    """Deterministic scenario: the trainer reaches v2, crashes and is restored at v0 (no checkpoint since);
    groups generated at v1/v2 come back as ``future`` and are re-issued, and the run still reaches v3."""
    run = _Run(
        max_staleness=2, batch_size=2, max_inflight=6, num_engines=2, ckpt_every=100, rng=random.Random(7)
    )
    run.run(target_version=2, crashes=[])
    run.run(target_version=3, crashes=[(run.now, "trainer", 0)])
    run.check_final()
    assert run.recycled["lost"] >= 4
    assert run.checkpoint == (0, [])
    assert run.trainer_version >= 3


@pytest.mark.parametrize("max_staleness", [0, 1, 4])
def test_with_strict_timings_the_guard_never_fires(max_staleness: int) -> None:
    """Generation, reward and sync all take the same time: admission alone keeps every group fresh."""

    class _Fixed(random.Random):
        def uniform(self, a: float, b: float) -> float:
            return a

        def random(self) -> float:
            return 0.5

    run = _Run(
        max_staleness=max_staleness,
        batch_size=3,
        max_inflight=(max_staleness + 1) * 3,
        num_engines=2,
        ckpt_every=1,
        rng=_Fixed(0),
    )
    run.run(target_version=10, crashes=[])
    run.check_final()
    assert sum(run.recycled.values()) == 0
