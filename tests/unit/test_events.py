"""Event schemas (bus/schemas.py) and the wire format (bus/events.py); no network."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus import events as ev

DESIGN_DOC = Path(__file__).resolve().parents[2] / "docs" / "design.md"


def _contract_fields() -> dict[str, list[str]]:
    """Event name -> field names, parsed from the schema list in docs/design.md section 4.2."""
    text = DESIGN_DOC.read_text()
    section = text.split(" Event schemas\n", 1)[1].split("\n#", 1)[0]
    entries = re.findall(r"^- (.+?)(?=^- |\Z)", section, flags=re.M | re.S)
    out: dict[str, list[str]] = {}
    for entry in entries:
        head, _, body = " ".join(entry.split()).partition(":")
        name = head.split()[0]
        depth, token, parts = 0, "", []
        for ch in body:
            depth += ch in "([" and 1 or (ch in ")]" and -1 or 0)
            if ch == "," and depth == 0:
                parts.append(token)
                token = ""
            else:
                token += ch
        parts.append(token)
        out[name] = [re.match(r"\s*(\w+)", p).group(1) for p in parts if p.strip()]  # type: ignore[union-attr]
    return out


def test_schemas_have_exactly_the_fields_of_the_contract() -> None:
    """Every event in docs/design.md section 4.2 exists with exactly those fields (plus schema_version)."""
    contract = _contract_fields()
    types = dict(
        ev.EVENT_TYPES, Completion=ev.Completion, TensorEntry=ev.TensorEntry, TransferOffer=ev.TransferOffer
    )
    assert set(contract) - {"TensorEntry"} <= set(types)
    assert set(ev.EVENT_TYPES) <= set(contract)
    for name, fields in contract.items():
        struct_fields = set(types[name].__struct_fields__) - {"schema_version"}
        assert struct_fields == set(fields), name


def test_every_event_round_trips_and_plain_msgpack_reads_it(sample_events: dict[str, ev.Event]) -> None:
    """decode(encode(e)) == e, and msgpack.unpackb sees a map carrying schema and schema_version."""
    assert set(sample_events) == set(ev.EVENT_TYPES)
    for name, event in sample_events.items():
        data = ev.encode(event)
        assert ev.decode(data) == event
        assert ev.decode(data, type(event)) == event
        plain = msgpack.unpackb(data)
        assert isinstance(plain, dict)
        assert plain["schema"] == name and plain["schema_version"] == 1


def test_packed_arrays_travel_as_raw_little_endian_bytes(sample_events: dict[str, ev.Event]) -> None:
    """Token ids and logprobs are msgpack bin fields, readable with numpy on any machine."""
    plain = msgpack.unpackb(ev.encode(sample_events["RolloutGroup"]))
    completion = plain["completions"][0]
    assert isinstance(completion["token_ids"], bytes)
    assert np.frombuffer(completion["token_ids"], "<i4").tolist() == [11, 12, 13]
    assert np.frombuffer(completion["logprobs"], "<f4").tolist() == [-0.5, -1.25, -0.125]


class PromptTaskV2(ev.PromptTask, tag="PromptTask", kw_only=True):
    """A newer writer's PromptTask: one added field with a default."""

    priority: int = 7


def test_an_old_reader_reads_a_newer_event_with_an_extra_field() -> None:
    """Forward compatibility: unknown fields are ignored."""
    new = PromptTaskV2(task_id="t", kind="eval", index=1, epoch=2, row={}, issued_at=1.0, priority=3)
    old = ev.decode(ev.encode(new), ev.PromptTask)
    assert type(old) is ev.PromptTask
    assert (old.task_id, old.kind, old.index, old.epoch) == ("t", "eval", 1, 2)
    assert type(ev.decode(ev.encode(new))) is ev.PromptTask


def test_a_new_reader_reads_an_old_event_and_fills_the_default() -> None:
    """Backward compatibility: a field the writer did not know takes its default."""
    old = ev.PromptTask(task_id="t", kind="train", index=1, epoch=0, row={"a": 1}, issued_at=1.0)
    new = ev.decode(ev.encode(old), PromptTaskV2)
    assert isinstance(new, PromptTaskV2) and new.priority == 7 and new.row == {"a": 1}


def _episode(mask: list[int] | bytes) -> ev.Completion:
    """A multi-turn completion: model tokens 11, 12, tool output 90, 91, model token 13."""
    return ev.Completion(
        token_ids=ev.pack_i32([11, 12, 90, 91, 13]),
        logprobs=ev.pack_f32([-0.5, -1.0, 0.0, 0.0, -0.25]),
        versions=ev.pack_i32([3, 3, 3, 3, 4]),
        finish_reason="stop",
        loss_mask=mask if isinstance(mask, bytes) else ev.pack_u8(mask),
    )


def _group_of(completion: ev.Completion, sample: ev.Event) -> ev.RolloutGroup:
    assert isinstance(sample, ev.RolloutGroup)
    return msgspec.structs.replace(sample, completions=[completion, completion])


class CompletionV0(msgspec.Struct, kw_only=True, frozen=True):
    """Completion as written before loss masks existed."""

    token_ids: bytes
    logprobs: bytes
    versions: bytes
    finish_reason: str
    text: str = ""


class RolloutGroupV0(ev.RolloutGroup, tag="RolloutGroup", kw_only=True):
    """A reader (or writer) whose completions have no loss_mask."""

    completions: list[CompletionV0]  # type: ignore[assignment]


def test_a_loss_mask_round_trips_as_one_byte_per_token(sample_events: dict[str, ev.Event]) -> None:
    """The mask travels as a msgpack bin field of uint8 0/1 and decodes to the same completion."""
    group = _group_of(_episode([1, 1, 0, 0, 1]), sample_events["RolloutGroup"])
    data = ev.encode(group)
    assert ev.decode(data, ev.RolloutGroup) == group
    plain = msgpack.unpackb(data)["completions"][0]["loss_mask"]
    assert plain == bytes([1, 1, 0, 0, 1])
    assert ev.unpack_u8(plain).tolist() == [1, 1, 0, 0, 1]


def test_an_old_reader_reads_completions_with_a_loss_mask(sample_events: dict[str, ev.Event]) -> None:
    """Forward compatibility: a reader without the field ignores it."""
    group = _group_of(_episode([1, 1, 0, 0, 1]), sample_events["RolloutGroup"])
    old = ev.decode(ev.encode(group), RolloutGroupV0)
    assert isinstance(old.completions[0], CompletionV0)
    assert old.completions[0].token_ids == group.completions[0].token_ids


def test_a_new_reader_reads_completions_without_a_loss_mask(sample_events: dict[str, ev.Event]) -> None:
    """Backward compatibility: stored streams without the field decode with an empty mask."""
    sample: ev.RolloutGroup = sample_events["RolloutGroup"]  # type: ignore[assignment]
    v0 = CompletionV0(**{k: getattr(sample.completions[0], k) for k in CompletionV0.__struct_fields__})
    written = RolloutGroupV0(**{**msgspec.structs.asdict(sample), "completions": [v0, v0]})
    assert "loss_mask" not in msgpack.unpackb(ev.encode(written))["completions"][0]
    new = ev.decode(ev.encode(written), ev.RolloutGroup)
    assert type(new) is ev.RolloutGroup and new.completions == sample.completions
    assert new.completions[0].loss_mask == b""


@pytest.mark.parametrize(
    "mask,match",
    [
        (b"\x01\x01\x00\x01", "loss_mask has 4 entries for 5 tokens"),
        ([1, 2, 0, 0, 1], "only 0 and 1"),
        ([0, 0, 0, 0, 0], "at least one 1"),
    ],
)
def test_a_bad_loss_mask_is_refused_by_producer_and_decoder(
    mask: list[int] | bytes, match: str, sample_events: dict[str, ev.Event]
) -> None:
    """One 0/1 byte per token with at least one trained token, else ValueError / DecodeError."""
    with pytest.raises(ValueError, match=match):
        _episode(mask)
    group = msgpack.unpackb(ev.encode(_group_of(_episode([1] * 5), sample_events["RolloutGroup"])))
    group["completions"][0]["loss_mask"] = mask if isinstance(mask, bytes) else bytes(mask)
    with pytest.raises(ev.DecodeError, match=match):
        ev.decode(msgpack.packb(group), ev.RolloutGroup)


def _bad_payloads() -> dict[str, bytes]:
    good = ev.encode(ev.PromptTask(task_id="t", kind="train", index=0, epoch=0, row={}, issued_at=0.0))
    return {
        "undecodable msgpack": good[: len(good) // 2],
        "not an event": msgpack.packb([1, 2, 3]),
        "no 'schema' field": msgpack.packb({"task_id": "t"}),
        "unknown schema 'Bogus'": msgpack.packb({"schema": "Bogus", "schema_version": 1}),
        "unsupported schema_version 2 of PromptTask": msgpack.packb(
            {**msgpack.unpackb(good), "schema_version": 2}
        ),
        "invalid PromptTask: Expected `str`, got `int` - at `$.task_id`": msgpack.packb(
            {**msgpack.unpackb(good), "task_id": 5}
        ),
        "invalid PromptTask: Invalid enum value 'test'": msgpack.packb(
            {**msgpack.unpackb(good), "kind": "test"}
        ),
    }


@pytest.mark.parametrize("reason,data", list(_bad_payloads().items()))
def test_bad_payloads_raise_decode_error_with_a_reason(reason: str, data: bytes) -> None:
    """Every way a payload can be wrong surfaces as DecodeError whose reason says which."""
    with pytest.raises(ev.DecodeError) as info:
        ev.decode(data)
    assert reason in info.value.reason


def test_an_event_of_the_wrong_type_is_refused_when_a_type_is_expected(
    sample_events: dict[str, ev.Event],
) -> None:
    """A valid RolloutGroup where a PromptTask is expected is a DecodeError naming both."""
    data = ev.encode(sample_events["RolloutGroup"])
    with pytest.raises(ev.DecodeError, match="wrong schema: expected PromptTask, got RolloutGroup"):
        ev.decode(data, ev.PromptTask)


def test_misaligned_completion_arrays_are_invalid(sample_events: dict[str, ev.Event]) -> None:
    """One logprob and one version per token, else the producer and the decoder both refuse."""
    with pytest.raises(ValueError, match="one entry per token"):
        ev.Completion(
            token_ids=ev.pack_i32([1, 2]),
            logprobs=ev.pack_f32([0.0]),
            versions=ev.pack_i32([0, 0]),
            finish_reason="stop",
        )
    with pytest.raises(ValueError, match="not a multiple of 4"):
        ev.Completion(token_ids=b"\x00" * 3, logprobs=b"", versions=b"", finish_reason="stop")
    group = msgpack.unpackb(ev.encode(sample_events["RolloutGroup"]))
    group["completions"][0]["logprobs"] = b""  # a buggy writer
    scored = {
        "schema": "ScoredGroup",
        "group": group,
        "rewards": [0.0, 0.0],
        "reward_errors": ["", ""],
        "reward_seconds": 0.0,
    }
    with pytest.raises(ev.DecodeError, match="one entry per token"):
        ev.decode(msgpack.packb(scored))


def test_scored_group_needs_one_reward_per_completion(sample_events: dict[str, ev.Event]) -> None:
    """rewards and reward_errors align with completions."""
    group = sample_events["RolloutGroup"]
    with pytest.raises(ValueError, match=r"one entry per completion \(2\)"):
        ev.ScoredGroup(group=group, rewards=[1.0], reward_errors=[""], reward_seconds=0.0)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_raise_anything_but_decode_error(data: bytes) -> None:
    """decode() has one failure mode, so a consumer can dead-letter anything it receives."""
    try:
        ev.decode(data, ev.PromptTask)
    except ev.DecodeError as e:
        assert e.reason


def test_events_are_immutable(sample_events: dict[str, ev.Event]) -> None:
    """Frozen: a consumer cannot mutate an event another task also holds."""
    with pytest.raises(AttributeError):
        sample_events["PromptTask"].attempt = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "values", [[1, -2, 2**31 - 1, -(2**31)], np.arange(5, dtype=np.int64), np.array([], dtype=np.int32)]
)
def test_pack_i32_round_trips_lists_and_arrays(values: object) -> None:
    """pack_i32 accepts lists or integer arrays; unpack_i32 returns an int32 array."""
    out = ev.unpack_i32(ev.pack_i32(values))  # type: ignore[arg-type]
    assert out.dtype == np.dtype("<i4")
    assert out.tolist() == list(np.asarray(values).tolist())


def test_pack_f32_round_trips_to_float32() -> None:
    """pack_f32 stores float32; unpack_f32 returns a float32 array."""
    out = ev.unpack_f32(ev.pack_f32([0.5, -1.0, 3]))
    assert out.dtype == np.dtype("<f4") and out.tolist() == [0.5, -1.0, 3.0]
    assert ev.pack_f32(np.array([0.5], dtype=np.float64)) == np.array([0.5], "<f4").tobytes()


def test_pack_refuses_what_would_be_corrupted() -> None:
    """Overflowing ints, floats as token ids and odd byte lengths fail loudly, naming the field."""
    with pytest.raises((ValueError, OverflowError)):
        ev.pack_i32([2**31])
    with pytest.raises(ValueError, match="out of int32 range"):
        ev.pack_i32(np.array([2**40]))
    with pytest.raises(ValueError, match="needs integers"):
        ev.pack_i32([0.5])
    with pytest.raises(ValueError, match="token_ids: 6 bytes is not a multiple of 4"):
        ev.unpack_i32(b"\x00" * 6, "token_ids")
    with pytest.raises(ValueError, match="not a multiple of 4"):
        ev.unpack_f32(b"\x00" * 5)


def test_headers_name_the_event_run_version_and_msg_id(sample_events: dict[str, ev.Event]) -> None:
    """Headers let the NATS CLI filter without decoding bodies."""
    assert ev.headers_for(sample_events["PromptTask"], "r1", 4, msg_id="t:0") == {
        "Areal-Event": "PromptTask",
        "Areal-Run": "r1",
        "Areal-Policy-Version": "4",
        "Nats-Msg-Id": "t:0",
    }
    assert ev.headers_for(sample_events["WeightsServed"], "r1")["Areal-Policy-Version"] == "6"
    assert "Areal-Policy-Version" not in ev.headers_for(sample_events["PromptTask"], "r1")
    with pytest.raises(ValueError, match="msg_id"):
        ev.headers_for(sample_events["PromptTask"], "r1", msg_id="a\r\nb")


def test_each_subject_expects_one_event_type() -> None:
    """The registry maps every subject of a run (any run) to the type it carries."""
    assert ev.expected_type("areal.r1.prompt") is ev.PromptTask
    assert ev.expected_type("areal.x.rollout.scored") is ev.ScoredGroup
    assert ev.expected_type("areal.x.eval.scored") is ev.ScoredGroup
    assert ev.expected_type("areal.r1.heartbeat.generation.w1") is ev.Heartbeat
    assert ev.expected_type("areal.r1.unknown") is None
    assert ev.expected_type("elsewhere") is None
    assert ev.expected_type("areal.r1.generate") is ev.GenerateCall
    # Every event has its subject, except the reply of a request, which goes to the caller's inbox.
    assert set(ev.SUBJECT_TYPES.values()) == set(ev.EVENT_TYPES.values()) - {ev.GenerateReply}


def test_random_bytes_payloads_are_decode_errors() -> None:
    """A few kilobytes of noise are refused, not misread."""
    for _ in range(50):
        with pytest.raises(ev.DecodeError):
            ev.decode(os.urandom(256), ev.RolloutGroup)


def test_the_bus_package_imports_neither_torch_nor_the_library() -> None:
    """bus/ stays usable without a GPU stack: importing it pulls in no torch and no areal_async."""
    code = "import sys, bus; bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'areal_async')]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
