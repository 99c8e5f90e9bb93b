"""Events on the wire: MessagePack encoding and decoding of the schemas of ``bus.schemas``.

Contract (docs/design.md section 4; the schemas and their evolution rules are in ``bus.schemas``,
whose names, and the packing helpers of ``bus.packed``, are importable from here too):

* ``encode`` writes an event as a msgpack map; ``decode`` reads one, of any event type or of the
  one expected, and raises exactly one error type, ``DecodeError``, for anything that is not a
  valid event of the expected type: the consumer dead-letters it and goes on.
* ``SUBJECT_TYPES``/``expected_type``: the one event type each subject carries.
* Headers (``headers_for``) repeat the event name, run and policy version so the NATS CLI
  can filter without decoding bodies.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import msgspec

from bus import subjects as subj
from bus.packed import pack_f32, pack_i32, pack_u8, unpack_f32, unpack_i32, unpack_u8
from bus.schemas import (
    EVENT_TYPES,
    Completion,
    DeadLetter,
    Event,
    GenerateCall,
    GenerateReply,
    Heartbeat,
    MetricsReport,
    PromptTask,
    RolloutFailed,
    RolloutGroup,
    RunEnded,
    RunHealed,
    RunStalled,
    ScoredGroup,
    TensorEntry,
    TrainerStep,
    TransferOffer,
    WeightsLoad,
    WeightsLoaded,
    WeightsPublished,
    WeightsServed,
)

__all__ = [
    "Completion",
    "DeadLetter",
    "decode",
    "DecodeError",
    "encode",
    "Event",
    "event_name",
    "EVENT_TYPES",
    "expected_type",
    "GenerateCall",
    "GenerateReply",
    "headers_for",
    "Heartbeat",
    "MetricsReport",
    "pack_f32",
    "pack_i32",
    "pack_u8",
    "PromptTask",
    "RolloutFailed",
    "RolloutGroup",
    "RunEnded",
    "RunHealed",
    "RunStalled",
    "ScoredGroup",
    "SUBJECT_TYPES",
    "TensorEntry",
    "TrainerStep",
    "TransferOffer",
    "unpack_f32",
    "unpack_i32",
    "unpack_u8",
    "WeightsLoad",
    "WeightsLoaded",
    "WeightsPublished",
    "WeightsServed",
]

HEADER_EVENT = "Areal-Event"
HEADER_RUN = "Areal-Run"
HEADER_POLICY_VERSION = "Areal-Policy-Version"
HEADER_MSG_ID = "Nats-Msg-Id"


class DecodeError(Exception):
    """A payload is not a valid event (of the expected type); ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


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
