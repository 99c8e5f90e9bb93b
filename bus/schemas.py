"""The events of a run: typed msgspec Structs, one class per event (docs/design.md section 4).

Contract:

* An event is a msgpack map. It carries ``schema`` (the event name, e.g. "PromptTask") and
  ``schema_version`` (1). Plain ``msgpack.unpackb`` reads every event.
* Evolution: the only allowed change is a new field with a default. Readers ignore fields
  they do not know (an old reader reads a newer event) and fill defaults for fields a writer
  did not send (a new reader reads an old event). A breaking change bumps
  ``schema_version``; readers refuse versions they do not know.
* Token ids, logprobs and per-token versions travel as packed little-endian int32/float32
  bytes (``bus.packed``: ``pack_i32`` / ``pack_f32`` / ``unpack_i32`` / ``unpack_f32``), never
  lists; loss masks as one uint8 per token (``pack_u8`` / ``unpack_u8``).
* ``EVENT_TYPES`` names every top-level event; ``bus.events`` encodes and decodes them.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from bus.packed import check_packed, unpack_u8

TaskKind = Literal["train", "eval"]
FailReason = Literal["stale", "future", "error", "filtered", "duplicate"]


class Event(msgspec.Struct, tag_field="schema", tag=True, kw_only=True, frozen=True):
    """Base of every top-level event; the tag (``schema``) is the class name."""

    SCHEMA_VERSION: ClassVar[int] = 1
    """The version this code writes and the highest it reads."""

    schema_version: int = 1


class Completion(msgspec.Struct, kw_only=True, frozen=True):
    """One sampled completion; packed arrays are aligned token by token (prompt excluded).

    A multi-turn episode is one completion: the model's turns and the tool, user or environment
    tokens between them. ``loss_mask`` (uint8: one byte per token, a quarter of int32's size on
    episodes of many tokens) is 1 on the tokens the model generated, which are trained, and 0 on
    the others; empty means every token is trained. A token with mask 0 has logprob 0.0 and the
    version of the model token before it (of the first model token when none precedes it), so
    versions never decrease.
    """

    token_ids: bytes
    logprobs: bytes
    versions: bytes
    finish_reason: str
    text: str = ""
    loss_mask: bytes = b""

    def __post_init__(self) -> None:
        check_packed(self.token_ids, "token_ids")
        check_packed(self.logprobs, "logprobs")
        check_packed(self.versions, "versions")
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"token_ids, logprobs and versions must have one entry per token, got "
                f"{n // 4}, {len(self.logprobs) // 4}, {len(self.versions) // 4}"
            )
        if self.loss_mask:
            mask = unpack_u8(self.loss_mask)
            if len(mask) != n // 4:
                raise ValueError(
                    f"loss_mask has {len(mask)} entries for {n // 4} tokens; send one 0/1 byte per "
                    "token (pack_u8), or an empty loss_mask to train every token"
                )
            if mask.max() > 1 or not mask.any():
                raise ValueError(
                    f"loss_mask must hold only 0 and 1 with at least one 1, got values "
                    f"{sorted(set(mask.tolist()))[:4]}; an episode with no model token has nothing to train"
                )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) // 4


class TensorEntry(msgspec.Struct, kw_only=True, frozen=True):
    """One tensor of a weights manifest."""

    name: str
    shape: list[int]
    dtype: str
    sha256: str


class PromptTask(Event, kw_only=True):
    """controller -> generation: sample ``group_size`` completions for one dataset row."""

    task_id: str
    kind: TaskKind
    index: int
    epoch: int
    attempt: int = 0
    row: dict[str, Any]
    issued_at: float


class RolloutGroup(Event, kw_only=True):
    """generation -> reward: the completions of one task, with per-token versions."""

    task_id: str
    kind: TaskKind
    index: int
    epoch: int
    attempt: int
    row: dict[str, Any]
    engine_id: str
    prompt_ids: bytes
    completions: list[Completion]
    head_version: int
    tail_version: int
    timings: dict[str, float] = {}

    def __post_init__(self) -> None:
        check_packed(self.prompt_ids, "prompt_ids")


class ScoredGroup(Event, kw_only=True):
    """reward -> trainer (rollout.scored) or controller (eval.scored): one reward per completion."""

    group: RolloutGroup
    rewards: list[float]
    reward_errors: list[str]
    reward_seconds: float

    def __post_init__(self) -> None:
        n = len(self.group.completions)
        if len(self.rewards) != n or len(self.reward_errors) != n:
            raise ValueError(
                f"rewards and reward_errors need one entry per completion ({n}), got "
                f"{len(self.rewards)} and {len(self.reward_errors)}"
            )


class RolloutFailed(Event, kw_only=True):
    """Why a task produced nothing trainable; the controller re-issues or counts it."""

    task_id: str
    kind: TaskKind
    index: int
    epoch: int
    attempt: int
    reason: FailReason
    detail: str
    head_version: int = -1
    trainer_version: int = -1


class TrainerStep(Event, kw_only=True):
    """trainer -> controller: one optimizer step committed (kept in STEPS for audit)."""

    step: int
    policy_version: int
    task_ids: list[str]
    head_versions: list[int]
    metrics: dict[str, float] = {}


class TransferOffer(msgspec.Struct, kw_only=True, frozen=True):
    """How to receive one version in memory (``areal_async.weight_buckets``).

    ``transport`` is ``gloo``/``nccl`` (join the group named in ``weights.load`` on the store at
    ``address``, receive ``digests``-checked buckets of at most ``bucket_bytes``) or ``cuda_ipc``
    (map ``handle``: one buffer, ``digests`` has its one digest). ``manifest`` rows are
    ``[name, shape, dtype]``; every receiver plans the same buckets from it."""

    transport: str
    manifest: list[list[Any]]
    digests: list[int]
    bucket_bytes: int
    address: str = ""
    handle: bytes = b""


class WeightsPublished(Event, kw_only=True):
    """trainer -> weight-sync: a new version of the policy. Its disk copy is (or, with an in-memory
    ``transfer``, soon will be) at ``path``; with a ``transfer``, ``manifest`` sha256s are empty
    (the disk copy's ``manifest.json`` has them)."""

    policy_version: int
    path: str
    manifest: list[TensorEntry]
    total_bytes: int
    seconds: float
    transfer: TransferOffer | None = None


class WeightsLoad(Event, kw_only=True):
    """weight-sync -> generation: load ``path``; ``engine_ids`` empty means every engine.

    With a ``transfer``, the engines in ``members`` (in rank order, after the trainer's rank 0;
    ``ranks``: how many ranks each takes, empty = one each) receive the version in memory; a group
    transport opens the process group ``group``. Engines
    not in ``members`` load ``path``; so does a member whose transfer fails."""

    policy_version: int
    path: str
    engine_ids: list[str] = []
    transfer: TransferOffer | None = None
    group: str = ""
    members: list[str] = []
    ranks: list[int] = []


class WeightsLoaded(Event, kw_only=True):
    """generation -> weight-sync: one engine finished (or failed) loading a version; ``via`` is the
    transport it came by (``disk`` also after a failed in-memory transfer, whose reason is
    ``fallback``)."""

    policy_version: int
    engine_id: str
    ok: bool
    error: str = ""
    seconds: float
    via: str = "disk"
    fallback: str = ""


class WeightsServed(Event, kw_only=True):
    """weight-sync -> everyone: every live engine serves ``policy_version``."""

    policy_version: int
    engine_ids: list[str]
    seconds: dict[str, float] = {}


class Heartbeat(Event, kw_only=True):
    """Liveness of one worker (core NATS and the workers KV bucket)."""

    role: str
    worker_id: str
    host: str
    pid: int
    policy_version: int = -1
    status: str
    detail: str = ""
    load: dict[str, float] = {}
    sent_at: float
    transports: list[str] = []
    """In-memory weight transports this worker can receive (generation workers)."""
    transfer_ranks: int = 1
    """Ranks it takes in a weight-transfer group (a remote engine: one per server)."""
    handled: int = 0
    """Units of work finished since the worker started (groups generated or scored, steps trained,
    hand-offs served, prompts issued, episodes run)."""
    tokens: int = 0
    """Tokens generated or trained since the worker started."""
    progress_at: float = 0.0
    """Wall time of the last finished unit of work (0: none yet). Set by the work loop, never by
    the heartbeat task, so a beat from a worker whose work loop is stuck still shows the stall."""
    busy_at: float = 0.0
    """Wall time the work loop went from idle to holding work it has not finished; 0 while idle."""
    phase: str = ""
    """What the work loop is doing now (``generating``, ``training step 7``, ...) or waiting for."""
    held: int = 0
    """Deliveries this worker fetched and has not settled (acked, nak'd or dead-lettered)."""
    started_at: float = 0.0
    """Wall time the worker process started."""
    peak_rss: int = 0
    """Largest resident set of the worker process so far, bytes (0: not told)."""
    restarts: int = 0
    """How often its supervisor restarted this worker's slot before it (``areal-async run``; 0 elsewhere)."""


class DeadLetter(Event, kw_only=True):
    """A message no handler could use (it failed to decode, or its handling raised), with the
    reason and the raw bytes (``Bus.dead_letter``)."""

    subject: str
    reason: str
    data: bytes
    headers: dict[str, str] = {}
    worker_id: str
    received_at: float


class MetricsReport(Event, kw_only=True):
    """Per-step metrics for live dashboards (core NATS)."""

    step: int
    policy_version: int
    values: dict[str, float]


class RunEnded(Event, kw_only=True):
    """The controller ended the run; workers drain and exit."""

    reason: str
    policy_version: int
    steps: int


class RunStalled(Event, kw_only=True):
    """A watchdog found a worker that stopped making progress (core NATS, ``run.stalled``)."""

    role: str
    worker_id: str
    pid: int
    state: str
    """``frozen`` (no heartbeat), ``wedged`` (beats, but no progress while work waits) or
    ``starved`` (nothing to do because an upstream role is stuck)."""
    evidence: str
    action: str
    """What the watchdog did: ``killed`` (its process group; the launcher restarts it) or ``none``."""
    upstream: str = ""
    """For ``starved``: the stuck role it waits on."""
    detected_at: float


class RunHealed(Event, kw_only=True):
    """A role that stalled makes progress again (core NATS, ``run.healed``)."""

    role: str
    worker_id: str
    state: str
    """The state it stalled in."""
    stalled_s: float
    """From the last progress before the stall to the first progress after it."""
    healed_at: float


class GenerateCall(Event, kw_only=True):
    """agent -> generation (request/reply on ``generate``): one model call of an episode.

    Answered by any one generation worker (queue group) with a ``GenerateReply``. ``call_id`` is
    unique per attempt of a call; a retried call gets a new one.
    """

    call_id: str
    episode_id: str
    prompt_ids: bytes
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list[int] = []
    seed: int | None = None

    def __post_init__(self) -> None:
        check_packed(self.prompt_ids, "prompt_ids")


class GenerateReply(Event, kw_only=True):
    """generation -> agent: the completion of a ``GenerateCall`` (or why there is none)."""

    call_id: str
    engine_id: str
    token_ids: bytes = b""
    logprobs: bytes = b""
    versions: bytes = b""
    finish_reason: str = ""
    error: str = ""
    seconds: float = 0.0
    """Time the generation worker spent on the call, from its arrival to the reply (0: not told);
    the caller's round trip minus this is the bus's share."""


EVENT_TYPES: dict[str, type[Event]] = {
    t.__name__: t
    for t in (
        PromptTask,
        RolloutGroup,
        ScoredGroup,
        RolloutFailed,
        TrainerStep,
        WeightsPublished,
        WeightsLoad,
        WeightsLoaded,
        WeightsServed,
        Heartbeat,
        DeadLetter,
        MetricsReport,
        RunEnded,
        RunStalled,
        RunHealed,
        GenerateCall,
        GenerateReply,
    )
}
"""Schema name -> type."""
