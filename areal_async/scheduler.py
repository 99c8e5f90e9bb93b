"""Prompt scheduling: the controller's state machine, free of I/O.

The controller feeds the dataset to generation workers under the staleness admission
rule of docs/design.md section 5::

    issued < (max_staleness + v + 1) * B      and      issued - trained < max_inflight

``issued`` counts training tasks issued and not failed; ``trained`` counts groups the
trainer has committed; ``v`` is the version every engine serves. A failed task
(``stale``/``future``/``error``) leaves ``issued`` and waits in the re-issue queue with
its attempt number bumped; a ``filtered`` task (DAPO dynamic sampling) leaves ``issued``
and is not re-issued, the feed moves on to new prompts.

When the trainer restarts from an older checkpoint, its next ``trainer.step`` repeats a
step number that was already counted: the steps from there on are rolled back
(``trained`` drops by their groups). Those groups were never acknowledged by the trainer,
so JetStream redelivers them and the trainer's guard trains or recycles them. A recycled one
(``rollout.failed`` from a trainer behind the step that trained it) leaves that step and is
re-issued like any failure.

``inflight`` maps every issued training task that is neither trained nor failed to its
``[epoch, index, attempt]``: the controller acts on a ``rollout.failed`` or ``trainer.step``
only when the tasks it names are in flight with those fields (``check_failed``, ``check_trained``),
so a forged or corrupt event cannot make it re-issue a row it never issued. Tasks rolled back
from a repeated step are in flight again with attempt -1 (any attempt of theirs may fail).

The whole state is plain data (``to_dict``/``from_dict``) kept in the run's KV bucket,
so a restarted controller continues without double-issuing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from areal_async.algo.staleness import admission_allows

RETRY_REASONS = frozenset({"stale", "future", "error"})
ANY_ATTEMPT = -1


def task_position(task_id: str) -> tuple[int, int] | None:
    """``(epoch, index)`` of a training task id ``e<epoch>-i<index>``; None for any other id."""
    head, sep, tail = task_id.partition("-i")
    if not sep or not head.startswith("e") or not head[1:].isdigit() or not tail.isdigit():
        return None
    return int(head[1:]), int(tail)


@dataclass(frozen=True)
class Issue:
    """One training task to publish: ``task_id`` is stable across attempts."""

    task_id: str
    epoch: int
    index: int
    attempt: int


@dataclass
class SchedulerState:
    max_staleness: int
    batch_size: int
    max_inflight: int
    issued: int = 0
    trained: int = 0
    served_version: int = 0
    trainer_step: int = 0
    step_seq: int = 0
    """Stream sequence of the newest ``trainer.step`` event recorded (0: none)."""
    total_issued: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    retry: deque[list[Any]] = field(default_factory=deque)
    attempts: dict[str, int] = field(default_factory=dict)
    step_tasks: dict[int, list[str]] = field(default_factory=dict)
    inflight: dict[str, list[int]] | None = field(default_factory=dict)
    """task_id -> [epoch, index, attempt]; None for a state saved before it was kept (not checked)."""

    # ---- admission -------------------------------------------------------------------

    def can_issue(self) -> bool:
        return admission_allows(
            issued=self.issued,
            trained=self.trained,
            served_version=self.served_version,
            max_staleness=self.max_staleness,
            batch_size=self.batch_size,
            max_inflight=self.max_inflight,
        )

    def take_retry(self) -> Issue | None:
        """Pop the oldest task waiting to be re-issued, counting it as issued."""
        if not self.retry:
            return None
        task_id, epoch, index = self.retry.popleft()
        attempt = self.attempts.get(task_id, 0)
        self.issued += 1
        self.total_issued += 1
        if self.inflight is not None:
            self.inflight[task_id] = [epoch, index, attempt]
        return Issue(task_id, epoch, index, attempt)

    def take_new(self, epoch: int, index: int) -> Issue:
        """Count a fresh dataset row as issued (the dataset cursor keeps the position)."""
        self.issued += 1
        self.total_issued += 1
        task_id = f"e{epoch}-i{index}"
        if self.inflight is not None:
            self.inflight[task_id] = [epoch, index, 0]
        return Issue(task_id, epoch, index, 0)

    # ---- events ----------------------------------------------------------------------

    def check_failed(
        self, task_id: str, epoch: int, index: int, attempt: int, trainer_version: int = -1
    ) -> str:
        """'' when a failure names a task in flight with its epoch, index and attempt, or a task of a step
        the failing trainer (at ``trainer_version``) no longer has; else why not."""
        if self.inflight is None:
            return ""
        entry = self.inflight.get(task_id)
        if entry is None:
            lost = self.lost_step(task_id, trainer_version) is not None
            if lost and task_position(task_id) == (epoch, index):
                return ""
            return f"task {task_id!r} is not in flight (never issued, already trained or failed)"
        if [epoch, index] != entry[:2]:
            return f"task {task_id!r} was issued for epoch {entry[0]} index {entry[1]}, not {epoch}/{index}"
        if entry[2] not in (ANY_ATTEMPT, attempt):
            return f"task {task_id!r} is in flight as attempt {entry[2]}, not {attempt}"
        return ""

    def lost_step(self, task_id: str, trainer_version: int) -> int | None:
        """The step that trained ``task_id`` if a trainer at ``trainer_version`` is behind it (restored
        from an older checkpoint: the step is lost and its groups come back); else None."""
        if trainer_version < 0:
            return None
        return next((s for s, ids in self.step_tasks.items() if s > trainer_version and task_id in ids), None)

    def check_trained(self, step: int, task_ids: list[str]) -> str:
        """'' when every task of a step is in flight (or rolled back by this step); else why not."""
        if len(set(task_ids)) != len(task_ids):
            return "a task id appears twice in one step"
        if self.inflight is None:
            return ""
        rolled_back = {t for s, ids in self.step_tasks.items() if s >= step for t in ids}
        unknown = [t for t in task_ids if t not in self.inflight and t not in rolled_back]
        if unknown:
            return f"{len(unknown)} task(s) not in flight, e.g. {unknown[0]!r}"
        return ""

    def on_failed(
        self, task_id: str, epoch: int, index: int, attempt: int, reason: str, trainer_version: int = -1
    ) -> bool:
        """A task produced nothing trainable. Returns True if it will be re-issued.

        A restored trainer fails groups of the steps it lost (``stale``/``future`` at its older
        version): such a task leaves the lost step and ``trained`` before it is failed as usual.
        """
        lost = self.lost_step(task_id, trainer_version)
        if lost is not None and (self.inflight is None or task_id not in self.inflight):
            self.step_tasks[lost].remove(task_id)
            self.trained = max(0, self.trained - 1)
        elif attempt < self.attempts.get(task_id, 0):
            return False  # an older attempt's failure, already handled
        if self.inflight is not None:
            self.inflight.pop(task_id, None)
        self.failures[reason] = self.failures.get(reason, 0) + 1
        self.issued = max(0, self.issued - 1)
        if reason not in RETRY_REASONS:
            return False
        self.attempts[task_id] = attempt + 1
        self.retry.append([task_id, epoch, index])
        return True

    def on_trained(self, step: int, task_ids: list[str]) -> int:
        """The trainer committed ``step``; returns how many groups were rolled back first."""
        rolled_back = 0
        for s in sorted(k for k in self.step_tasks if k >= step):
            ids = self.step_tasks.pop(s)
            rolled_back += len(ids)
            for task_id in ids:  # redelivered to the trainer: in flight again, any attempt
                position = task_position(task_id)
                if self.inflight is not None and position is not None:
                    self.inflight[task_id] = [*position, ANY_ATTEMPT]
        self.trained = max(0, self.trained - rolled_back) + len(task_ids)
        self.step_tasks[step] = list(task_ids)
        self.trainer_step = step
        for task_id in task_ids:
            self.attempts.pop(task_id, None)
            if self.inflight is not None:
                self.inflight.pop(task_id, None)
        # Only the recent steps can ever be rolled back (to the last checkpoint); keep a window.
        for s in [k for k in self.step_tasks if k < step - 1000]:
            del self.step_tasks[s]
        return rolled_back

    def on_served(self, version: int) -> None:
        self.served_version = version

    # ---- persistence -----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_staleness": self.max_staleness,
            "batch_size": self.batch_size,
            "max_inflight": self.max_inflight,
            "issued": self.issued,
            "trained": self.trained,
            "served_version": self.served_version,
            "trainer_step": self.trainer_step,
            "step_seq": self.step_seq,
            "total_issued": self.total_issued,
            "failures": dict(self.failures),
            "retry": [list(r) for r in self.retry],
            "attempts": dict(self.attempts),
            "step_tasks": {str(k): v for k, v in self.step_tasks.items()},
            "inflight": None if self.inflight is None else {k: list(v) for k, v in self.inflight.items()},
        }

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], *, max_staleness: int, batch_size: int, max_inflight: int
    ) -> SchedulerState:
        """Restore saved state; admission parameters come from the current config."""
        state = cls(max_staleness=max_staleness, batch_size=batch_size, max_inflight=max_inflight)
        for key in ("issued", "trained", "served_version", "trainer_step", "step_seq"):
            setattr(state, key, int(data.get(key, 0)))
        state.total_issued = int(data.get("total_issued", 0))
        state.failures = dict(data.get("failures", {}))
        state.retry = deque(list(r) for r in data.get("retry", []))
        state.attempts = dict(data.get("attempts", {}))
        state.step_tasks = {int(k): list(v) for k, v in data.get("step_tasks", {}).items()}
        inflight = data.get("inflight")
        state.inflight = (
            None if inflight is None else {str(k): [int(x) for x in v] for k, v in inflight.items()}
        )
        return state
