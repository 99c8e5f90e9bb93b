"""Anchor/delta encoding of a version (``areal_async/weight_codec.py``) and chain planning
(``workers.weight_bus.plan_chain``)."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch

from areal_async import weight_codec as codec
from workers.weight_bus import BusWeightsUnavailable, Record, plan_chain


def trained_versions(dtype: torch.dtype, steps: int, lr: float = 1e-4) -> list[np.ndarray]:
    """Packed bytes of ``steps + 1`` versions of a float32 master moved by sign steps of ``lr``,
    snapshotted in ``dtype`` (what an Adam step does to a trainer's weights)."""
    g = torch.Generator().manual_seed(0)
    master = torch.randn(4096, generator=g) * 0.02
    out = []
    for _ in range(steps + 1):
        out.append(master.to(dtype).view(torch.uint8).numpy().copy())
        master += lr * torch.randn(4096, generator=g).sign()
    return out


@pytest.fixture(params=[None, 1024], ids=["one-slice", "many-slices"])
def slice_bytes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """The codec's slice size: its default (a whole test version in one frame) or 1 KiB."""
    if request.param is not None:
        monkeypatch.setattr(codec, "SLICE_BYTES", request.param)
    return codec.SLICE_BYTES


@pytest.mark.parametrize(
    ("dtype", "word_bytes"), [(torch.bfloat16, 2), (torch.float32, 4), (torch.bfloat16, 1)]
)
def test_anchor_and_delta_rebuild_every_version_bit_for_bit(
    dtype: torch.dtype, word_bytes: int, slice_bytes: int
) -> None:
    """Decoding an anchor, and applying each delta to its base, gives back the exact bytes, in one
    frame or in one frame per slice."""
    versions = trained_versions(dtype, 4)
    frames = -(-versions[0].size // slice_bytes)
    assert struct.unpack_from("<I", codec.encode_anchor(versions[0], word_bytes), 4) == (frames,)
    rebuilt = codec.decode_anchor(codec.encode_anchor(versions[0], word_bytes), versions[0].size, word_bytes)
    assert np.array_equal(rebuilt, versions[0])
    for base, new in zip(versions, versions[1:], strict=False):
        rebuilt = codec.apply_delta(rebuilt, codec.encode_delta(new, base, word_bytes), word_bytes)
        assert codec.digest(rebuilt) == codec.digest(new)


def test_a_small_bf16_step_encodes_to_a_small_fraction_of_the_version() -> None:
    """A step that moves few bf16 words compresses to well under the version's size."""
    base, new = trained_versions(torch.bfloat16, 1, lr=1e-5)
    assert len(codec.encode_delta(new, base, 2)) < 0.25 * new.size


def test_a_damaged_or_mismatched_payload_is_refused() -> None:
    """A truncated payload, or a delta applied to a base of another size, raises CodecError."""
    base, new = trained_versions(torch.bfloat16, 1)
    payload = codec.encode_delta(new, base, 2)
    with pytest.raises(codec.CodecError):
        codec.apply_delta(base, payload[: len(payload) // 2], 2)
    with pytest.raises(codec.CodecError):
        codec.apply_delta(base[:-2], payload, 2)
    with pytest.raises(codec.CodecError):
        codec.decode_anchor(codec.encode_anchor(new, 2), new.size + 2, 2)


def test_a_damaged_frame_table_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A payload without the frame marker, with a frame count or frame lengths that do not fit the
    version, raises CodecError before anything is decoded."""
    monkeypatch.setattr(codec, "SLICE_BYTES", 1024)
    base, new = trained_versions(torch.bfloat16, 1)
    payload = bytearray(codec.encode_delta(new, base, 2))
    assert codec.apply_delta(base, bytes(payload), 2).tobytes() == new.tobytes()
    for damaged in (
        b"XXXX" + payload[4:],  # not a framed payload
        payload[:4] + struct.pack("<I", 3) + payload[8:],  # 3 frames for 8 slices
        payload[:8] + struct.pack("<Q", 1 + struct.unpack_from("<Q", payload, 8)[0]) + payload[16:],
        payload[:-1],  # the last frame cut short
    ):
        with pytest.raises(codec.CodecError):
            codec.apply_delta(base, bytes(damaged), 2)


def test_the_version_digest_covers_every_slice_and_not_the_thread_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """sha256 over each slice's sha256; any changed byte changes it; one thread or many agree."""
    monkeypatch.setattr(codec, "SLICE_BYTES", 1024)
    data = np.random.default_rng(0).integers(0, 256, size=5000, dtype=np.uint8)
    by_hand = hashlib.sha256(
        b"".join(hashlib.sha256(data[i : i + 1024].tobytes()).digest() for i in range(0, 5000, 1024))
    ).hexdigest()
    assert codec.version_digest(data) == codec.version_digest(data.tobytes()) == by_hand
    monkeypatch.setattr(codec, "threads", lambda: 1)
    assert codec.version_digest(data) == by_hand
    for i in (0, 1023, 1024, 4999):
        changed = data.copy()
        changed[i] ^= 1
        assert codec.version_digest(changed) != by_hand
    assert codec.piece_digests(data, 2048) == [
        hashlib.sha256(data[i : i + 2048]).hexdigest() for i in (0, 2048, 4096)
    ]


def test_word_width_is_the_common_element_size() -> None:
    assert codec.word_bytes_of([2, 2]) == 2
    assert codec.word_bytes_of([4]) == 4
    assert codec.word_bytes_of([2, 4]) == 1


def rec(version: int, kind: str, digest: str, seq: int, base: tuple[int, str] = (-1, "")) -> Record:
    return Record(
        policy_version=version,
        kind=kind,
        digest=digest,
        size=4,
        word_bytes=2,
        manifest=[],
        chunks=[],
        payload_bytes=0,
        seq=seq,
        base_version=base[0],
        base_digest=base[1],
        slot=f"{kind}-{seq}",
    )


def test_the_chain_goes_from_the_held_version_else_from_the_newest_usable_anchor() -> None:
    """Deltas back to what the reader holds when they reach it; else an anchor and the deltas
    after it; with the newest anchor gone, the older one and the deltas from there."""
    records = [
        rec(0, "anchor", "d0", 0),
        rec(1, "delta", "d1", 1, (0, "d0")),
        rec(2, "delta", "d2", 2, (1, "d1")),
        rec(2, "anchor", "d2", 3),
        rec(3, "delta", "d3", 4, (2, "d2")),
    ]
    assert [r.seq for r in plan_chain(records, 3, held=(1, "d1"))] == [2, 4]
    assert [r.seq for r in plan_chain(records, 3)] == [3, 4]
    assert [r.seq for r in plan_chain(records, 3, held=(3, "d3"))] == []
    without_newest_anchor = [r for r in records if r.seq != 3]
    assert [r.seq for r in plan_chain(without_newest_anchor, 3)] == [0, 1, 2, 4]
    with pytest.raises(BusWeightsUnavailable, match="no whole chain"):
        plan_chain([r for r in without_newest_anchor if r.seq != 1], 3)


def test_a_restarted_trainers_versions_win_over_the_lost_ones() -> None:
    """A version written again by a restored trainer (higher seq, other digest) is the one
    rebuilt; the lost version's anchor is never used for it."""
    records = [
        rec(0, "anchor", "d0", 0),
        rec(1, "delta", "lost1", 1, (0, "d0")),
        rec(1, "anchor", "lost1", 2),
        rec(0, "anchor", "d0", 3),
        rec(1, "delta", "new1", 4, (0, "d0")),
    ]
    assert [r.seq for r in plan_chain(records, 1)] == [3, 4]
    assert [r.seq for r in plan_chain(records, 1, held=(1, "lost1"))] == [3, 4]
