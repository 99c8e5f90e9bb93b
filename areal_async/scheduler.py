"""Prompt scheduling: the controller's state machine, free of I/O.

The controller feeds the dataset to generation workers under the staleness admission
rule of DESIGN section 4::

    issued < (eta + v + 1) * B      and      issued - trained < max_inflight

``issued`` counts training tasks issued and not failed; ``trained`` counts groups the
trainer has committed; ``v`` is the version every engine serves. A failed task
(``stale``/``future``/``error``) leaves ``issued`` and waits in the re-issue queue with
its attempt number bumped; a ``filtered`` task (DAPO dynamic sampling) leaves ``issued``
and is not re-issued, the feed moves on to new prompts.

When the trainer restarts from an older checkpoint, its next ``trainer.step`` repeats a
step number that was already counted: the steps from there on are rolled back
(``trained`` drops by their groups). Those groups were never acknowledged by the trainer,
so JetStream redelivers them and the trainer's guard trains or recycles them.

The whole state is plain data (``to_dict``/``from_dict``) kept in the run's KV bucket,
so a restarted controller continues without double-issuing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from areal_async.algo.staleness import admission_allows

RETRY_REASONS = frozenset({"stale", "future", "error"})


@dataclass(frozen=True)
class Issue:
    """One training task to publish: ``task_id`` is stable across attempts."""

    task_id: str
    epoch: int
    index: int
    attempt: int


@dataclass
class SchedulerState:
    eta: int
    batch_size: int
    max_inflight: int
    issued: int = 0
    trained: int = 0
    served_version: int = 0
    trainer_step: int = 0
    total_issued: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    retry: deque[list[Any]] = field(default_factory=deque)
    attempts: dict[str, int] = field(default_factory=dict)
    step_tasks: dict[int, list[str]] = field(default_factory=dict)

    # ---- admission -------------------------------------------------------------------

    def can_issue(self) -> bool:
        return admission_allows(
            issued=self.issued,
            trained=self.trained,
            served_version=self.served_version,
            eta=self.eta,
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
        return Issue(task_id, epoch, index, attempt)

    def take_new(self, epoch: int, index: int) -> Issue:
        """Count a fresh dataset row as issued (the dataset cursor keeps the position)."""
        self.issued += 1
        self.total_issued += 1
        return Issue(f"e{epoch}-i{index}", epoch, index, 0)

    # ---- events ----------------------------------------------------------------------

    def on_failed(self, task_id: str, epoch: int, index: int, attempt: int, reason: str) -> bool:
        """A task produced nothing trainable. Returns True if it will be re-issued."""
        if attempt < self.attempts.get(task_id, 0):
            return False  # an older attempt's failure, already handled
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
            rolled_back += len(self.step_tasks.pop(s))
        self.trained = max(0, self.trained - rolled_back) + len(task_ids)
        self.step_tasks[step] = list(task_ids)
        self.trainer_step = step
        for task_id in task_ids:
            self.attempts.pop(task_id, None)
        # Only the recent steps can ever be rolled back (to the last checkpoint); keep a window.
        for s in [k for k in self.step_tasks if k < step - 1000]:
            del self.step_tasks[s]
        return rolled_back

    def on_served(self, version: int) -> None:
        self.served_version = version

    # ---- persistence -----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "eta": self.eta,
            "batch_size": self.batch_size,
            "max_inflight": self.max_inflight,
            "issued": self.issued,
            "trained": self.trained,
            "served_version": self.served_version,
            "trainer_step": self.trainer_step,
            "total_issued": self.total_issued,
            "failures": dict(self.failures),
            "retry": [list(r) for r in self.retry],
            "attempts": dict(self.attempts),
            "step_tasks": {str(k): v for k, v in self.step_tasks.items()},
        }

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], *, eta: int, batch_size: int, max_inflight: int
    ) -> SchedulerState:
        """Restore saved state; admission parameters come from the current config."""
        state = cls(eta=eta, batch_size=batch_size, max_inflight=max_inflight)
        for key in ("issued", "trained", "served_version", "trainer_step"):
            setattr(state, key, int(data.get(key, 0)))
        state.total_issued = int(data.get("total_issued", 0))
        state.failures = dict(data.get("failures", {}))
        state.retry = deque(list(r) for r in data.get("retry", []))
        state.attempts = dict(data.get("attempts", {}))
        state.step_tasks = {int(k): list(v) for k, v in data.get("step_tasks", {}).items()}
        return state
