"""Sizes on the wire: an event that would not fit is refused before it is sent.

The server cuts a connection that sends more than its max_payload (body plus headers), and a
stream refuses a message over its max_msg_size. ``Bus.publish`` therefore checks both first
and raises ``PayloadTooLarge`` naming the subject, both sizes, the setting to raise and what
to send less of. ``PAYLOAD_MARGIN`` stays free for protocol overhead.

A dead letter must always fit: ``fit_dead_letter`` truncates the copied data and says so.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from bus.errors import PayloadTooLarge
from bus.events import DeadLetter, encode, headers_for
from bus.subjects import subject_suffix

PAYLOAD_MARGIN = 1024
"""Bytes kept free under the server's max_payload for protocol overhead."""


def header_bytes(headers: Mapping[str, str] | None) -> int:
    """Bytes of the NATS/1.0 header block as the server counts it against max_payload."""
    if not headers:
        return 0
    return len("NATS/1.0\r\n") + sum(len(k) + len(v) + 4 for k, v in headers.items()) + 2


def fmt_bytes(n: int) -> str:
    for unit, size in (("MB", 2**20), ("KB", 2**10)):
        if n >= size:
            return f"{n / size:.1f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n} B"


def shrink_hint(subject: str) -> str:
    """What to send less of on ``subject``."""
    suffix = subject_suffix(subject) or ""
    if suffix in ("rollout.generated", "rollout.scored", "eval.scored"):
        return "lower max_new_tokens or group_size"
    if suffix == "prompt":
        return "shorten the dataset row"
    return "send less data in this event (bulk data belongs on disk, the bus carries its path)"


def check_payload(subject: str, size: int, max_payload: int) -> None:
    """PayloadTooLarge if ``size`` bytes (body + headers) do not fit under the server's max_payload."""
    if size > max_payload - PAYLOAD_MARGIN:
        margin = (
            f" (less {fmt_bytes(PAYLOAD_MARGIN)} kept for protocol overhead)" if size <= max_payload else ""
        )
        raise PayloadTooLarge(
            f"{subject}: {fmt_bytes(size)} exceeds max_payload {fmt_bytes(max_payload)}{margin}; "
            f"raise bus.max_payload or {shrink_hint(subject)}"
        )


def check_stream_limit(subject: str, size: int, stream: str, max_msg_size: int) -> None:
    """PayloadTooLarge if ``size`` bytes exceed ``stream``'s max_msg_size (<= 0: no limit)."""
    if 0 < max_msg_size < size:
        raise PayloadTooLarge(
            f"{subject}: {fmt_bytes(size)} exceeds max_msg_size {fmt_bytes(max_msg_size)} of stream "
            f"{stream}; raise bus.max_msg_bytes or {shrink_hint(subject)}"
        )


def fit_dead_letter(letter: DeadLetter, data: bytes, limit: int, run: str, msg_id: str | None) -> DeadLetter:
    """``letter`` carrying ``data``, truncated so that body and headers fit ``limit`` bytes;
    the reason then notes ``(data truncated from N to M bytes)``."""
    note = " (data truncated from 0000000000 to 0000000000 bytes)"  # the longest note
    worst = msgspec.structs.replace(letter, reason=letter.reason + note, data=b"")
    overhead = len(encode(worst)) + header_bytes(headers_for(worst, run, msg_id=msg_id)) + 16
    room = max(0, limit - overhead)
    if len(data) <= room:
        return msgspec.structs.replace(letter, data=bytes(data))
    reason = f"{letter.reason} (data truncated from {len(data)} to {room} bytes)"
    return msgspec.structs.replace(letter, reason=reason, data=bytes(data[:room]))
