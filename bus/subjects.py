"""Every subject, stream, durable consumer and KV bucket name of a run.

Contract: all subjects of run ``<run>`` live under ``areal.<run>.``, so runs share one
NATS cluster and ``areal.<run>.>`` taps one run. Streams are named ``AREAL_<run>_<KEY>``,
KV buckets ``areal_<run>_state`` and ``areal_<run>_workers``, the object store bucket
``areal_<run>_weights`` (stream ``OBJ_areal_<run>_weights``, ``weight_sync.transport: bus``).
Nothing outside this module
spells a subject, stream, consumer or bucket name.

Planes:

| subject             | plane                              | durable consumer       |
|---------------------|------------------------------------|------------------------|
| prompt              | JetStream PROMPT (work queue)      | generation             |
| rollout.generated   | JetStream GENERATED (work queue)   | reward                 |
| rollout.scored      | JetStream SCORED (work queue)      | trainer                |
| eval.scored         | JetStream EVAL (work queue)        | controller-eval        |
| rollout.failed      | JetStream FAILED (work queue)      | controller-failed      |
| trainer.step        | JetStream STEPS (limits, audit)    | controller-steps       |
| deadletter          | JetStream DEADLETTER (limits)      | (none; inspect reads)  |
| weights.*, heartbeat.<role>.<id>, metrics, run.*    | core NATS | -            |
| generate (request/reply, queue group ``generation``)  | core NATS | -            |

A work-queue stream allows only non-overlapping consumers, so each has exactly one durable
that all replicas of a role share. Limits streams (STEPS, DEADLETTER) accept any number of
extra consumers (``areal-async inspect``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")

# Subject suffixes, relative to ``areal.<run>.``.
PROMPT = "prompt"
ROLLOUT_GENERATED = "rollout.generated"
ROLLOUT_SCORED = "rollout.scored"
ROLLOUT_FAILED = "rollout.failed"
EVAL_SCORED = "eval.scored"
TRAINER_STEP = "trainer.step"
WEIGHTS_PUBLISHED = "weights.published"
WEIGHTS_LOAD = "weights.load"
WEIGHTS_LOADED = "weights.loaded"
WEIGHTS_SERVED = "weights.served"
HEARTBEAT = "heartbeat"
DEADLETTER = "deadletter"
METRICS = "metrics"
RUN_ENDED = "run.ended"
RUN_STALLED = "run.stalled"
RUN_HEALED = "run.healed"
GENERATE = "generate"

Retention = Literal["work_queue", "limits"]


class Streams:
    """Stream keys, as ``Bus.consume`` and ``Subjects.stream`` take them."""

    PROMPT = "PROMPT"
    GENERATED = "GENERATED"
    SCORED = "SCORED"
    EVAL = "EVAL"
    FAILED = "FAILED"
    STEPS = "STEPS"
    DEADLETTER = "DEADLETTER"


class Buckets:
    """KV bucket references, as the ``Bus.kv_*`` calls take them."""

    STATE = "state"
    """Run state: latest-value facts (``bus.state``)."""

    WORKERS = "workers"
    """One heartbeat entry per live worker, expiring after ``bus.heartbeat_ttl_s``."""


def _validate_token(value: str, field: str, fix: str) -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise ValueError(
            f"{field} must match ^[A-Za-z0-9_-]+$ (letters, digits, '_' and '-'; no dots, spaces "
            f"or wildcards), got {value!r}; {fix}"
        )
    return value


def validate_run_name(run: str) -> str:
    """Return ``run`` if it can be a subject token and part of stream/bucket names; else ValueError."""
    return _validate_token(run, "run name", "rename the run, e.g. 'gsm8k-qwen-0p5b_r1'")


@dataclass(frozen=True, kw_only=True)
class StreamSpec:
    """One JetStream stream of a run and the durable pull consumer its readers share."""

    key: str
    """Short name: PROMPT, GENERATED, SCORED, EVAL, FAILED, STEPS or DEADLETTER."""

    name: str
    """Stream name on the server, ``AREAL_<run>_<key>``."""

    subject: str
    """The one subject the stream stores."""

    retention: Retention
    """work_queue: a message is deleted once acked. limits: kept (audit, dead letters)."""

    consumer: str | None
    """Durable pull consumer shared by every reader of the stream; None for DEADLETTER."""


# key, subject suffix, retention, durable consumer
_STREAMS: tuple[tuple[str, str, Retention, str | None], ...] = (
    (Streams.PROMPT, PROMPT, "work_queue", "generation"),
    (Streams.GENERATED, ROLLOUT_GENERATED, "work_queue", "reward"),
    (Streams.SCORED, ROLLOUT_SCORED, "work_queue", "trainer"),
    (Streams.EVAL, EVAL_SCORED, "work_queue", "controller-eval"),
    (Streams.FAILED, ROLLOUT_FAILED, "work_queue", "controller-failed"),
    (Streams.STEPS, TRAINER_STEP, "limits", "controller-steps"),
    (Streams.DEADLETTER, DEADLETTER, "limits", None),
)


class Subjects:
    """All names of one run. ``Subjects("r1").prompt == "areal.r1.prompt"``."""

    def __init__(self, run: str) -> None:
        self.run = validate_run_name(run)
        self.prefix = f"areal.{run}."
        self.all = f"areal.{run}.>"
        self.prompt = self.prefix + PROMPT
        self.rollout_generated = self.prefix + ROLLOUT_GENERATED
        self.rollout_scored = self.prefix + ROLLOUT_SCORED
        self.rollout_failed = self.prefix + ROLLOUT_FAILED
        self.eval_scored = self.prefix + EVAL_SCORED
        self.trainer_step = self.prefix + TRAINER_STEP
        self.weights_published = self.prefix + WEIGHTS_PUBLISHED
        self.weights_load = self.prefix + WEIGHTS_LOAD
        self.weights_loaded = self.prefix + WEIGHTS_LOADED
        self.weights_served = self.prefix + WEIGHTS_SERVED
        self.heartbeat_all = self.prefix + HEARTBEAT + ".>"
        self.deadletter = self.prefix + DEADLETTER
        self.metrics = self.prefix + METRICS
        self.run_ended = self.prefix + RUN_ENDED
        self.run_stalled = self.prefix + RUN_STALLED
        self.run_healed = self.prefix + RUN_HEALED
        self.generate = self.prefix + GENERATE
        self.state_bucket = f"areal_{run}_state"
        self.workers_bucket = f"areal_{run}_workers"
        self.weights_bucket = f"areal_{run}_weights"
        """Object store of the policy versions (``workers/weight_bus.py``)."""
        self.weights_stream = f"OBJ_{self.weights_bucket}"
        self.streams: tuple[StreamSpec, ...] = tuple(
            StreamSpec(
                key=key,
                name=f"AREAL_{run}_{key}",
                subject=self.prefix + suffix,
                retention=retention,
                consumer=consumer,
            )
            for key, suffix, retention, consumer in _STREAMS
        )
        self._by_subject = {s.subject: s for s in self.streams}

    def __repr__(self) -> str:
        return f"Subjects({self.run!r})"

    def heartbeat(self, role: str, worker_id: str) -> str:
        """``areal.<run>.heartbeat.<role>.<worker_id>``; both must be single subject tokens."""
        _validate_token(role, "heartbeat role", "use the role name, e.g. 'generation'")
        _validate_token(worker_id, "worker_id", "use e.g. '<host>-<pid>' without dots")
        return f"{self.prefix}{HEARTBEAT}.{role}.{worker_id}"

    def stream(self, ref: str) -> StreamSpec:
        """Find a stream by key ('PROMPT'), stream name ('AREAL_r1_PROMPT') or durable ('generation')."""
        for spec in self.streams:
            if ref in (spec.key, spec.name, spec.consumer):
                return spec
        known = ", ".join(f"{s.key}/{s.consumer}" for s in self.streams)
        raise ValueError(f"unknown stream or consumer {ref!r} for run {self.run!r}; known: {known}")

    def stream_for_subject(self, subject: str) -> StreamSpec | None:
        """The stream that stores ``subject``, or None for a core NATS subject."""
        return self._by_subject.get(subject)

    def bucket(self, ref: str) -> str:
        """Full bucket name for 'state' / 'workers' (or a full name of this run, returned as is)."""
        if ref == Buckets.STATE:
            return self.state_bucket
        if ref == Buckets.WORKERS:
            return self.workers_bucket
        if ref in (self.state_bucket, self.workers_bucket):
            return ref
        raise ValueError(
            f"unknown KV bucket {ref!r} for run {self.run!r}; use 'state' ({self.state_bucket}) "
            f"or 'workers' ({self.workers_bucket})"
        )

    def suffix(self, subject: str) -> str | None:
        """``subject`` relative to this run's prefix, or None if it belongs to another run."""
        return subject[len(self.prefix) :] if subject.startswith(self.prefix) else None


def subject_suffix(subject: str) -> str | None:
    """The part of ``areal.<run>.<suffix>`` after the run token, for any run; None if not ours."""
    parts = subject.split(".", 2)
    if len(parts) < 3 or parts[0] != "areal":
        return None
    return parts[2]
