"""Every event on the wire: typed msgspec Structs, MessagePack encoded.

Contract (docs/design.md section 4):

* An event is a msgpack map. It carries ``schema`` (the event name, e.g. "PromptTask") and
  ``schema_version`` (1). Plain ``msgpack.unpackb`` reads every event.
* Evolution: the only allowed change is a new field with a default. Readers ignore fields
  they do not know (an old reader reads a newer event) and fill defaults for fields a writer
  did not send (a new reader reads an old event). A breaking change bumps
  ``schema_version``; readers refuse versions they do not know.
* Token ids, logprobs and per-token versions travel as packed little-endian int32/float32
  bytes (``pack_i32`` / ``pack_f32`` / ``unpack_i32`` / ``unpack_f32``), never lists; loss
  masks as one uint8 per token (``pack_u8`` / ``unpack_u8``).
* ``decode`` raises exactly one error type, ``DecodeError``, for anything that is not a
  valid event of the expected type: the consumer dead-letters it and goes on.
* Headers (``headers_for``) repeat the event name, run and policy version so the NATS CLI
  can filter without decoding bodies.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Literal, TypeVar

import msgspec

from bus import subjects as subj
from bus.packed import check_packed, pack_f32, pack_i32, pack_u8, unpack_f32, unpack_i32, unpack_u8

__all__ = [
    "Completion",
    "DeadLetter",
    "DecodeError",
    "Event",
    "EVENT_TYPES",
    "GenerateCall",
    "GenerateReply",
    "Heartbeat",
    "MetricsReport",
    "PromptTask",
    "RolloutFailed",
    "RolloutGroup",
    "RunEnded",
    "ScoredGroup",
    "SUBJECT_TYPES",
    "TensorEntry",
    "TransferOffer",
    "TrainerStep",
    "WeightsLoad",
    "WeightsLoaded",
    "WeightsPublished",
    "WeightsServed",
    "decode",
    "encode",
    "event_name",
    "expected_type",
    "headers_for",
    "pack_f32",
    "pack_i32",
    "pack_u8",
    "unpack_f32",
    "unpack_i32",
    "unpack_u8",
]

HEADER_EVENT = "Areal-Event"
HEADER_RUN = "Areal-Run"
HEADER_POLICY_VERSION = "Areal-Policy-Version"
HEADER_MSG_ID = "Nats-Msg-Id"

TaskKind = Literal["train", "eval"]
FailReason = Literal["stale", "future", "error", "filtered", "duplicate"]


class DecodeError(Exception):
    """A payload is not a valid event (of the expected type); ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# ---------------------------------------------------------------------------------------------
# schemas


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


# ---------------------------------------------------------------------------------------------
# registry

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

SUBJECT_TYPES: dict[str, type[Event]] = {
    subj.PROMPT: PromptTask,
    subj.ROLLOUT_GENERATED: RolloutGroup,
    subj.ROLLOUT_SCORED: ScoredGroup,
    subj.EVAL_SCORED: ScoredGroup,
    subj.ROLLOUT_FAILED: RolloutFailed,
    subj.TRAINER_STEP: TrainerStep,
    subj.WEIGHTS_PUBLISHED: WeightsPublished,
    subj.WEIGHTS_LOAD: WeightsLoad,
    subj.WEIGHTS_LOADED: WeightsLoaded,
    subj.WEIGHTS_SERVED: WeightsServed,
    subj.HEARTBEAT: Heartbeat,  # heartbeat.<role>.<worker_id>
    subj.DEADLETTER: DeadLetter,
    subj.METRICS: MetricsReport,
    subj.RUN_ENDED: RunEnded,
    subj.RUN_STALLED: RunStalled,
    subj.RUN_HEALED: RunHealed,
    subj.GENERATE: GenerateCall,
}
"""Subject suffix (relative to ``areal.<run>.``) -> the one event type it carries."""

E = TypeVar("E", bound=Event)

_encoder = msgspec.msgpack.Encoder()
_any_decoder = msgspec.msgpack.Decoder(
    PromptTask
    | RolloutGroup
    | ScoredGroup
    | RolloutFailed
    | TrainerStep
    | WeightsPublished
    | WeightsLoad
    | WeightsLoaded
    | WeightsServed
    | Heartbeat
    | DeadLetter
    | MetricsReport
    | GenerateCall
    | GenerateReply
    | RunEnded
    | RunStalled
    | RunHealed
)


class _Peek(msgspec.Struct):
    """Just the envelope, read leniently to explain why a full decode failed."""

    schema: Any = None
    schema_version: Any = None


_peek_decoder = msgspec.msgpack.Decoder(_Peek)


@functools.cache
def _decoder_for(tp: type[Event]) -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(tp)


def expected_type(subject: str) -> type[Event] | None:
    """The event type ``subject`` (``areal.<run>.<suffix>``) carries, or None if it is not ours."""
    suffix = subj.subject_suffix(subject)
    if suffix is None:
        return None
    if suffix.startswith(subj.HEARTBEAT + "."):
        return Heartbeat
    return SUBJECT_TYPES.get(suffix)


def event_name(event: Event | type[Event]) -> str:
    """The schema name (tag) of an event or event type."""
    return str(event.__struct_config__.tag)


def encode(event: Event) -> bytes:
    """MessagePack bytes of ``event`` (a map with ``schema`` and ``schema_version``)."""
    if not isinstance(event, Event):
        raise TypeError(f"encode() needs a bus.events.Event, got {type(event).__name__}")
    return _encoder.encode(event)


def _explain(data: bytes, error: Exception) -> str:
    try:
        peek = _peek_decoder.decode(data)
    except msgspec.ValidationError:
        return "not an event: expected a msgpack map with a 'schema' field"
    except msgspec.DecodeError as e:
        return f"undecodable msgpack: {e}"
    if peek.schema is None:
        return "not an event: no 'schema' field"
    if not isinstance(peek.schema, str) or peek.schema not in EVENT_TYPES:
        return f"unknown schema {peek.schema!r}"
    tp = EVENT_TYPES[peek.schema]
    if isinstance(peek.schema_version, int) and not 1 <= peek.schema_version <= tp.SCHEMA_VERSION:
        return f"unsupported schema_version {peek.schema_version} of {peek.schema} (this reader knows 1..{tp.SCHEMA_VERSION})"
    return f"invalid {peek.schema}: {error}"


def decode(data: bytes | bytearray | memoryview, expected: type[E] | None = None) -> E:
    """Decode one event; ``expected`` narrows the type. Raises DecodeError, never anything else.

    ``expected`` may be a registered type or a Struct subclass of one (a reader's newer or
    older version of the schema, tagged with the same name).
    """
    if expected is not None and expected not in EVENT_TYPES.values():
        decoder = _decoder_for(expected)
    else:
        decoder = _any_decoder
    try:
        event = decoder.decode(data)
    except msgspec.ValidationError as e:
        reason = _explain(bytes(data), e)
        if expected is not None and reason.startswith("invalid "):
            # A valid event of another type fails on the tag when decoded as ``expected``.
            try:
                other = _any_decoder.decode(data)
            except msgspec.MsgspecError:
                pass
            else:
                reason = f"wrong schema: expected {event_name(expected)}, got {event_name(other)}"
        raise DecodeError(reason) from None
    except msgspec.DecodeError as e:
        raise DecodeError(f"undecodable msgpack: {e}") from None
    except Exception as e:  # __post_init__ bugs must not escape the one-error contract
        raise DecodeError(f"invalid payload: {type(e).__name__}: {e}") from None
    version = event.schema_version
    if not 1 <= version <= type(event).SCHEMA_VERSION:
        raise DecodeError(
            f"unsupported schema_version {version} of {event_name(event)} "
            f"(this reader knows 1..{type(event).SCHEMA_VERSION})"
        )
    if expected is not None and not isinstance(event, expected):
        raise DecodeError(f"wrong schema: expected {event_name(expected)}, got {event_name(event)}")
    return event  # type: ignore[return-value]


def headers_for(
    event: Event, run: str, policy_version: int | None = None, msg_id: str | None = None
) -> dict[str, str]:
    """NATS headers for ``event``: Areal-Event, Areal-Run, Areal-Policy-Version, Nats-Msg-Id.

    ``policy_version`` defaults to the event's own ``policy_version`` field when it has one;
    the header is left out when neither exists.
    """
    headers = {HEADER_EVENT: event_name(event), HEADER_RUN: run}
    if policy_version is None:
        policy_version = getattr(event, "policy_version", None)
    if policy_version is not None:
        headers[HEADER_POLICY_VERSION] = str(int(policy_version))
    if msg_id is not None:
        if not msg_id or any(c in msg_id for c in "\r\n"):
            raise ValueError(f"msg_id must be a non-empty single-line string, got {msg_id!r}")
        headers[HEADER_MSG_ID] = msg_id
    return headers
