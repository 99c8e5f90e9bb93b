"""What the dashboard knows about one run: a model built from events, and its JSON for the page.

Nothing here does I/O: ``workers.dashboard.reader`` feeds events in (``heartbeat``, ``step``,
``scored``, ...), the web app reads ``snapshot()`` and ``since(cursor)``. Step rows are
numbered (a step repeated after a trainer restore rewrites its row and counts a rewrite), the
rollouts and letters are append-only logs, so a page that holds a cursor gets exactly what it has
not seen; the fleet is small and goes whole. The newest ``ROLLOUTS_KEPT`` scored groups and
``LETTERS_KEPT`` dead letters, refusals and stalls are kept; steps are kept whole (a 1,000-step
run is 68 KB of JSON columns, 6 KB gzipped).

Fleet states, judged by the dashboard's clock at the time of the look:

| state | when |
|---|---|
| `live` | heard within two heartbeat intervals and a second |
| `late` | silent for longer, still within ``bus.heartbeat_ttl_s`` |
| `dead` | silent past the TTL while the run goes on (a replacement shows as a new row) |
| `stalled` | the stall watchdog reported it (``run.stalled``) and it has not healed since |
| `exited` | silent after the run ended, and every worker of a finished run read from its store |
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bus.events import (
    Completion,
    DeadLetter,
    Heartbeat,
    RolloutFailed,
    RunHealed,
    RunStalled,
    ScoredGroup,
    TrainerStep,
    unpack_i32,
    unpack_u8,
)

ROLLOUTS_KEPT = 200
LETTERS_KEPT = 500
TEXT_CHARS = 4000
"""A prompt or completion longer than this is cut (the page shows the cut)."""

STEP_COLUMNS = (
    "reward_mean",
    "staleness_mean",
    "staleness_max",
    "wait_s",
    "prox_seconds",
    "compute_s",
    "save_s",
    "step_s",
    "trained_tokens_per_s",
)
"""``TrainerStep.metrics`` keys the Steps page plots, one column each (null where a step lacks one)."""


def _clip(text: str) -> str:
    return (
        text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS] + f" [... {len(text) - TEXT_CHARS} more chars]"
    )


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


Decode = Callable[[list[int]], str]
"""Token ids -> text (the run's tokenizer), for the turns of agent episodes."""


def _segments(c: Completion, decode: Decode | None) -> list[list[Any]]:
    """An episode's turns from its loss mask: ``[["model"|"context", tokens, text], ...]``; the text
    of a turn is its tokens decoded (None without a tokenizer). The completion's own ``text`` holds
    the model turns only; the context turns (tool results, user or environment replies) exist on
    the wire as tokens."""
    tokens = c.num_tokens
    if not c.loss_mask:
        return [["model", tokens, None]]
    ids = unpack_i32(c.token_ids, "token_ids").tolist()
    out: list[list[Any]] = []
    start = 0
    mask = unpack_u8(c.loss_mask).tolist()
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            text = _clip(decode(ids[start:i])) if decode is not None else None
            out.append(["model" if mask[start] else "context", i - start, text])
            start = i
    return out


def rollout_entry(ev: ScoredGroup, received_at: float, decode: Decode | None = None) -> dict[str, Any]:
    """One scored group as the Rollouts page shows it."""
    group = ev.group
    row = group.row
    prompt = row.get("prompt")
    if prompt is None and isinstance(row.get("messages"), list):
        prompt = "\n".join(
            f"[{m.get('role')}] {m.get('content')}" for m in row["messages"] if isinstance(m, dict)
        )
    completions = []
    for c, reward, error in zip(group.completions, ev.rewards, ev.reward_errors, strict=True):
        versions = unpack_i32(c.versions, "versions") if c.versions else None
        tokens = c.num_tokens
        completions.append(
            {
                "text": _clip(c.text),
                "reward": _finite(reward),
                "error": error,
                "tokens": tokens,
                "head": int(versions.min()) if versions is not None and len(versions) else None,
                "tail": int(versions.max()) if versions is not None and len(versions) else None,
                "finish": c.finish_reason,
                "turns": _segments(c, decode),
            }
        )
    return {
        "task_id": group.task_id,
        "kind": group.kind,
        "attempt": group.attempt,
        "engine": group.engine_id,
        "prompt": _clip(str(prompt) if prompt is not None else ""),
        "answer": _clip(str(row.get("answer", ""))),
        "head": group.head_version,
        "tail": group.tail_version,
        "completions": completions,
        "at": received_at,
    }


@dataclass
class Worker:
    """The newest heartbeat of one worker and when the dashboard heard it."""

    beat: Heartbeat
    heard_at: float


@dataclass
class _Log:
    """An append-only list of which only the newest ``keep`` entries stay; ``total`` numbers them."""

    keep: int
    items: deque[dict[str, Any]] = field(default_factory=deque)
    total: int = 0

    def add(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        self.total += 1
        while len(self.items) > self.keep:
            self.items.popleft()

    def since(self, cursor: int) -> list[dict[str, Any]]:
        new = self.total - cursor
        return list(self.items)[-new:] if new > 0 else []


class RunView:
    """The run as seen so far; ``revision`` grows with every change (the page's push waits on it)."""

    def __init__(
        self,
        run: str,
        *,
        max_staleness: int | None,
        heartbeat_interval_s: float,
        heartbeat_ttl_s: float,
        total_steps: int | None = None,
        source: str = "live",
        decode: Decode | None = None,
    ) -> None:
        self.run = run
        self.max_staleness = max_staleness
        self.interval_s = heartbeat_interval_s
        self.ttl_s = heartbeat_ttl_s
        self.total_steps = total_steps
        self.source = source
        """``live`` (the run's server) or ``store`` (a finished run's JetStream store)."""
        self.decode = decode
        self.revision = 0
        self.workers: dict[str, Worker] = {}
        self.stalled: dict[str, dict[str, Any]] = {}
        self.steps: dict[str, list[Any]] = {"step": [], "time": [], **{c: [] for c in STEP_COLUMNS}}
        self.seen_steps: dict[int, int] = {}
        """step -> row; a step repeated after a restore replaces its row's values."""
        self.step_rewrites = 0
        """Times a stored row was overwritten (the page then reloads every row)."""
        self.evals: dict[int, float] = {}
        self.published_at: dict[int, float] = {}
        self.handoffs: dict[int, float] = {}
        self.rollouts = _Log(ROLLOUTS_KEPT)
        self.letters = _Log(LETTERS_KEPT)
        self.ended: dict[str, Any] | None = None
        self.served_version = -1
        self.published_version = -1

    def _changed(self) -> None:
        self.revision += 1

    # -- events in -------------------------------------------------------------------------------

    def heartbeat(self, beat: Heartbeat, heard_at: float | None = None) -> None:
        self.workers[beat.worker_id] = Worker(beat, heard_at if heard_at is not None else time.time())
        self._changed()

    def step(self, ev: TrainerStep, at: float) -> None:
        row = self.seen_steps.get(ev.step)
        if row is not None:
            self.step_rewrites += 1
        else:
            row = self.seen_steps[ev.step] = len(self.steps["step"])
            for column in self.steps.values():
                column.append(None)
        self.steps["step"][row] = ev.step
        self.steps["time"][row] = round(at, 3)
        for c in STEP_COLUMNS:
            value = _finite(ev.metrics.get(c))
            self.steps[c][row] = round(value, 5) if value is not None else None
        self._changed()

    def evaluation(self, version: int, accuracy: float) -> None:
        if self.evals.get(version) != accuracy:
            self.evals[version] = accuracy
            self._changed()

    def published(self, version: int, at: float) -> None:
        self.published_at.setdefault(version, at)
        self.published_version = max(self.published_version, version)
        self._changed()

    def served(self, version: int, at: float) -> None:
        """A version is served; its hand-off is the time since it was published (when seen)."""
        start = self.published_at.get(version)
        if start is not None and version not in self.handoffs:
            self.handoffs[version] = round(max(0.0, at - start), 3)
        self.served_version = max(self.served_version, version)
        self._changed()

    def scored(self, ev: ScoredGroup, at: float) -> None:
        self.rollouts.add(rollout_entry(ev, at, self.decode))
        self._changed()

    def dead_letter(self, ev: DeadLetter, seq: int | None = None) -> None:
        self.letters.add(
            {
                "kind": "dead letter",
                "at": ev.received_at,
                "subject": ev.subject,
                "reason": ev.reason,
                "worker": ev.worker_id,
                "detail": f"{len(ev.data)} bytes" + (f", #{seq}" if seq is not None else ""),
            }
        )
        self._changed()

    def refused(self, ev: RolloutFailed, at: float) -> None:
        """A ``rollout.failed``: a group the trainer's guard or an agent refused, and why."""
        versions = ev.head_version >= 0 or ev.trainer_version >= 0
        self.letters.add(
            {
                "kind": f"refused: {ev.reason}",
                "at": at,
                "subject": f"{ev.task_id}:{ev.attempt}",
                "reason": ev.detail,
                "worker": "",
                "detail": f"head v{ev.head_version}, trainer v{ev.trainer_version}" if versions else "",
            }
        )
        self._changed()

    def stall(self, ev: RunStalled | RunHealed | Mapping[str, Any]) -> None:
        """A stall (opened) or a heal (closes the role's open stalls); also rows of ``stalls.jsonl``."""
        record = ev if isinstance(ev, Mapping) else {"event": type(ev).__name__, **_fields(ev)}
        if record.get("event") == "RunStalled":
            self.stalled[str(record.get("worker_id"))] = dict(record)
            self.letters.add(
                {
                    "kind": f"stalled: {record.get('state')}",
                    "at": record.get("detected_at", 0.0),
                    "subject": f"{record.get('role')} {record.get('worker_id')}",
                    "reason": record.get("evidence", ""),
                    "worker": str(record.get("worker_id")),
                    "detail": f"action {record.get('action')}",
                }
            )
        elif record.get("event") == "RunHealed":
            for worker_id, open_ in list(self.stalled.items()):
                if open_.get("role") == record.get("role"):
                    del self.stalled[worker_id]
        self._changed()

    def run_ended(self, reason: str, policy_version: int) -> None:
        if self.ended is None:
            self.ended = {"reason": reason, "policy_version": policy_version}
            self._changed()

    # -- JSON out --------------------------------------------------------------------------------

    def fleet(self, now: float | None = None) -> list[dict[str, Any]]:
        now = time.time() if now is None else now
        rows = []
        for worker_id, w in self.workers.items():
            b = w.beat
            silent = max(0.0, now - w.heard_at)
            if worker_id in self.stalled:
                state = "stalled"
            elif self.source == "store":
                state = "exited"  # the run's server is down: no worker of it is heard
            elif silent <= 2 * self.interval_s + 1.0:
                state = "live"
            elif self.ended is not None:
                state = "exited"
            elif silent <= self.ttl_s:
                state = "late"
            else:
                state = "dead"
            rows.append(
                {
                    "role": b.role,
                    "worker_id": worker_id,
                    "host": b.host,
                    "pid": b.pid,
                    "status": b.status,
                    "detail": b.detail,
                    "phase": b.phase,
                    "policy_version": b.policy_version,
                    "last_beat_s": round(silent, 1),
                    "started_at": b.started_at,
                    "peak_rss": b.peak_rss,
                    "restarts": b.restarts,
                    "handled": b.handled,
                    "tokens": b.tokens,
                    "state": state,
                    "stall": self.stalled.get(worker_id, {}).get("evidence", ""),
                }
            )
        rows.sort(key=lambda r: (r["role"], r["state"] in ("dead", "exited"), r["started_at"]))
        return rows

    def header(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "source": self.source,
            "revision": self.revision,
            "max_staleness": self.max_staleness,
            "total_steps": self.total_steps,
            "published_version": self.published_version,
            "served_version": self.served_version,
            "ended": self.ended,
            "now": time.time(),
        }

    def cursor(self) -> dict[str, int]:
        return {
            "steps": len(self.steps["step"]),
            "step_rewrites": self.step_rewrites,
            "rollouts": self.rollouts.total,
            "letters": self.letters.total,
        }

    def snapshot(self) -> dict[str, Any]:
        """Everything the page draws, in one object (the first response of a page load)."""
        return {
            **self.header(),
            "fleet": self.fleet(),
            "steps_from": 0,
            "steps": self.steps,
            "evals": _pairs(self.evals),
            "handoffs": _pairs(self.handoffs),
            "rollouts": list(self.rollouts.items),
            "letters": list(self.letters.items),
            "cursor": self.cursor(),
        }

    def since(self, cursor: Mapping[str, int]) -> dict[str, Any]:
        """What changed for a page at ``cursor`` (as ``cursor()`` gave it): the fleet whole, the step
        rows it lacks (all of them after a step was repeated: ``steps_from`` 0), new rollouts and
        letters."""
        rewrite = cursor.get("step_rewrites", 0) != self.step_rewrites
        start = 0 if rewrite else min(cursor.get("steps", 0), len(self.steps["step"]))
        return {
            **self.header(),
            "fleet": self.fleet(),
            "steps_from": start,
            "steps": {k: v[start:] for k, v in self.steps.items()},
            "evals": _pairs(self.evals),
            "handoffs": _pairs(self.handoffs),
            "rollouts": self.rollouts.since(cursor.get("rollouts", 0)),
            "letters": self.letters.since(cursor.get("letters", 0)),
            "cursor": self.cursor(),
        }


def _pairs(values: Mapping[int, float]) -> list[list[float]]:
    return [[k, values[k]] for k in sorted(values)]


def _fields(ev: Any) -> dict[str, Any]:
    return {f: getattr(ev, f) for f in ev.__struct_fields__}
