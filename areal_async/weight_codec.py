"""Encoding one policy version for the bus: anchors, deltas and their digests.

A version travels as one flat byte buffer: its tensors packed in name order
(``weight_buckets.plan_buckets(manifest, None)`` + ``pack``). ``word_bytes`` is the width the
codec reads that buffer in: the common element size of its tensors (2 for bf16/fp16, 4 for
float32, 1 for mixed widths).

The buffer is cut into slices of ``SLICE_BYTES`` (the last one shorter), each coded on its own,
so the slices are coded in parallel (``threads()`` workers: numpy and zstd release the GIL) and
no temporary is larger than a slice. Per slice:

- anchor: ``zstd(planes(slice))``.
- delta against the same slice of a base version: ``zstd(planes(zigzag(slice - base)))``: ``-``
  subtracts the bit patterns as ``word_bytes``-wide integers (wrapping), ``zigzag`` maps the
  signed difference to an unsigned one (0, -1, 1, -2 -> 0, 1, 2, 3) and ``planes`` lays the words
  out byte plane by byte plane (every word's low byte, then every second byte, ...).

A payload is ``FRAMED``, the frame count (u32), each frame's length (u64 each, little-endian),
then the slices' zstd frames in order.

Why this delta (``bench_weights --transports bus``, training steps of the 135M shape;
docs/benchmarks-log.md): a small optimizer step leaves most words unchanged and moves the others
by a unit or two in the last place. The zigzagged difference is then 0 or a small number, so
every plane but the lowest is almost all zeros, which zstd stores in a few bytes: a bf16 step at
lr 1e-5 took 9.4 % of the version, against 10.3 % for XOR (a carry such as 0x7F -> 0x80 sets many
bits), 14.2 % for the plain difference (a decrement sets every high bit) and 29 % for changed
indices + values (6 bytes per changed word, with 13 % of the words changed).

Contract: ``decode_anchor(encode_anchor(b, w), len(b), w) == b`` and ``apply_delta(base,
encode_delta(b, base, w), w) == b`` bit for bit; a payload that is damaged, truncated or meant
for another size raises ``CodecError``. ``digest(chunk)`` is sha256; ``version_digest(buffer)``
names a version: sha256 over the sha256 of each slice (computed in parallel). A caller checks the
rebuilt version's digest before it serves anything, so a wrong base or a damaged payload is
refused, not served.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import zstandard

ZSTD_LEVEL = 1
"""zstd level: 1 compresses a delta within a few percent of level 3 at about twice the speed."""

SLICE_BYTES = 16 << 20
"""Bytes of the version coded as one frame (a multiple of every word width)."""

FRAMED = b"AWF1"
"""First bytes of a payload (then the frame table)."""

_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_T = TypeVar("_T")
_R = TypeVar("_R")
_pool: ThreadPoolExecutor | None = None


def threads() -> int:
    """Workers coding slices: the CPUs this process may run on, at most 8."""
    return max(
        1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    )


def _map(fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    global _pool
    if len(items) <= 1 or threads() == 1:
        return [fn(item) for item in items]
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=threads(), thread_name_prefix="weight-codec")
    return list(_pool.map(fn, items))


class CodecError(ValueError):
    """A payload that does not decode, or decodes to the wrong size: the version is refused."""


def digest(data: bytes | bytearray | memoryview | np.ndarray) -> str:
    """sha256 of ``data``, hex."""
    return hashlib.sha256(_bytes_view(data)).hexdigest()


def version_digest(buffer: bytes | bytearray | memoryview | np.ndarray) -> str:
    """A version's name: sha256 over the sha256 of each ``SLICE_BYTES`` slice, hex."""
    view = _bytes_view(buffer)
    parts = _map(lambda r: hashlib.sha256(view[r[0] : r[1]]).digest(), _slices(len(view)))
    return hashlib.sha256(b"".join(parts)).hexdigest()


def piece_digests(data: bytes | bytearray | memoryview | np.ndarray, piece_bytes: int) -> list[str]:
    """``digest`` of each ``piece_bytes`` piece of ``data`` (the last one shorter), in parallel."""
    view = _bytes_view(data)
    starts = range(0, max(len(view), 1), piece_bytes)
    return _map(lambda start: hashlib.sha256(view[start : start + piece_bytes]).hexdigest(), starts)


def _bytes_view(data: bytes | bytearray | memoryview | np.ndarray) -> memoryview:
    if isinstance(data, np.ndarray):
        return memoryview(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
    return memoryview(data).cast("B")


def _slices(nbytes: int) -> list[tuple[int, int]]:
    return [(start, min(start + SLICE_BYTES, nbytes)) for start in range(0, max(nbytes, 1), SLICE_BYTES)]


def word_bytes_of(element_sizes: Iterable[int]) -> int:
    """The width to read a version in: the common element size of its tensors, else 1."""
    sizes = set(element_sizes)
    if len(sizes) == 1 and (size := sizes.pop()) in _DTYPES:
        return size
    return 1


def _words(buffer: bytes | bytearray | memoryview | np.ndarray, word_bytes: int) -> np.ndarray:
    raw = (
        np.frombuffer(buffer, dtype=np.uint8) if not isinstance(buffer, np.ndarray) else buffer.view(np.uint8)
    )
    if raw.size % word_bytes:
        raise CodecError(f"a buffer of {raw.size} bytes is not a whole number of {word_bytes}-byte words")
    return raw.view(_DTYPES[word_bytes])


def _planes(words: np.ndarray) -> np.ndarray:
    """``words`` byte plane by byte plane (uint8, as many bytes). One strided copy per plane:
    several times faster than copying the transposed view at once."""
    width = words.dtype.itemsize
    columns = words.view(np.uint8).reshape(-1, width)
    planes = np.empty((width, words.size), dtype=np.uint8)
    for k in range(width):
        planes[k] = columns[:, k]
    return planes.reshape(-1)


def _unplanes(planes: np.ndarray, out: np.ndarray) -> None:
    """Write the words whose byte planes ``planes`` (uint8) holds into ``out`` (uint8, as many bytes)."""
    width = out.dtype.itemsize
    rows = planes.reshape(width, -1)
    columns = out.view(np.uint8).reshape(-1, width)
    for k in range(width):
        columns[:, k] = rows[k]


def _compress(data: np.ndarray) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(data)


def _decompress(frame: memoryview, size: int) -> np.ndarray:
    """The ``size`` bytes ``frame`` decodes to (uint8), or CodecError."""
    out = np.empty(size, dtype=np.uint8)
    filled = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(frame) as reader:
            view = memoryview(out)
            while filled < size and (n := reader.readinto(view[filled:])):
                filled += n
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CodecError(f"the payload does not decode: {exc}") from None
    if filled != size or extra:
        raise CodecError(
            f"a frame decodes to {'more than ' if extra else ''}{filled} bytes, its slice has {size}"
        )
    return out


def _frame(frames: list[bytes]) -> bytes:
    table = struct.pack(f"<I{len(frames)}Q", len(frames), *(len(f) for f in frames))
    return b"".join([FRAMED, table, *frames])


def _unframe(payload: bytes, size: int, word_bytes: int) -> tuple[list[tuple[int, int]], list[memoryview]]:
    """The slices of a ``size``-byte version and the frame of each, or CodecError."""
    if word_bytes not in _DTYPES or size % word_bytes:
        raise CodecError(f"a version of {size} bytes is not a whole number of {word_bytes}-byte words")
    slices = _slices(size)
    view = memoryview(payload)
    head = len(FRAMED) + 4
    if len(view) < head or bytes(view[: len(FRAMED)]) != FRAMED:
        raise CodecError("the payload is not a framed version payload")
    (count,) = struct.unpack_from("<I", view, len(FRAMED))
    if count != len(slices) or len(view) < head + 8 * count:
        raise CodecError(f"the payload holds {count} frames, a version of {size} bytes has {len(slices)}")
    lengths = struct.unpack_from(f"<{count}Q", view, head)
    start = head + 8 * count
    if start + sum(lengths) != len(view):
        raise CodecError(f"the payload is {len(view)} bytes, its frame table says {start + sum(lengths)}")
    frames = []
    for length in lengths:
        frames.append(view[start : start + length])
        start += length
    return slices, frames


def _words(buffer: bytes | bytearray | memoryview | np.ndarray, word_bytes: int) -> np.ndarray:
    raw = np.frombuffer(_bytes_view(buffer), dtype=np.uint8)
    if word_bytes not in _DTYPES or raw.size % word_bytes:
        raise CodecError(f"a buffer of {raw.size} bytes is not a whole number of {word_bytes}-byte words")
    return raw


def encode_anchor(buffer: bytes | np.ndarray, word_bytes: int) -> bytes:
    """The whole version, compressed."""
    raw = _words(buffer, word_bytes)
    dtype = _DTYPES[word_bytes]
    return _frame(_map(lambda r: _compress(_planes(raw[r[0] : r[1]].view(dtype))), _slices(raw.size)))


def decode_anchor(payload: bytes, size: int, word_bytes: int) -> np.ndarray:
    """The version's bytes (``uint8``, ``size`` long) from an anchor payload."""
    slices, frames = _unframe(payload, size, word_bytes)
    out = np.empty(size, dtype=np.uint8)
    dtype = _DTYPES[word_bytes]

    def one(i: int) -> None:
        start, end = slices[i]
        _unplanes(_decompress(frames[i], end - start), out[start:end].view(dtype))

    _map(one, range(len(slices)))
    return out


def encode_delta(buffer: bytes | np.ndarray, base: bytes | np.ndarray, word_bytes: int) -> bytes:
    """``buffer`` as a difference from ``base`` (the same size), compressed."""
    raw, base_raw = _words(buffer, word_bytes), _words(base, word_bytes)
    if raw.size != base_raw.size:
        raise CodecError(f"a delta needs a base of the same size: {raw.size} vs {base_raw.size} bytes")
    dtype, signed_dtype = _DTYPES[word_bytes], _SIGNED[word_bytes]

    def one(r: tuple[int, int]) -> bytes:
        zigzag = np.subtract(raw[r[0] : r[1]].view(dtype), base_raw[r[0] : r[1]].view(dtype))
        signed = zigzag.view(signed_dtype)
        sign = np.right_shift(signed, 8 * word_bytes - 1)
        np.left_shift(signed, 1, out=signed)
        np.bitwise_xor(signed, sign, out=signed)
        return _compress(_planes(zigzag))

    return _frame(_map(one, _slices(raw.size)))


def apply_delta(base: bytes | np.ndarray, payload: bytes, word_bytes: int) -> np.ndarray:
    """The version's bytes (a new ``uint8`` array) from ``base`` and a delta payload."""
    base_raw = _words(base, word_bytes)
    slices, frames = _unframe(payload, base_raw.size, word_bytes)
    out = np.empty(base_raw.size, dtype=np.uint8)
    dtype = _DTYPES[word_bytes]

    def one(i: int) -> None:
        start, end = slices[i]
        zigzag = out[start:end].view(dtype)
        _unplanes(_decompress(frames[i], end - start), zigzag)
        half = np.right_shift(zigzag, 1)
        np.bitwise_and(zigzag, 1, out=zigzag)
        np.negative(zigzag, out=zigzag)
        np.bitwise_xor(zigzag, half, out=zigzag)
        np.add(zigzag, base_raw[start:end].view(dtype), out=zigzag)

    _map(one, range(len(slices)))
    return out
