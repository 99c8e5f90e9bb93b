"""Encoding one policy version for the bus: anchors, deltas and their digests.

A version travels as one flat byte buffer: its tensors packed in name order
(``weight_buckets.plan_buckets(manifest, None)`` + ``pack``). ``word_bytes`` is the width the
codec reads that buffer in: the common element size of its tensors (2 for bf16/fp16, 4 for
float32, 1 for mixed widths).

- anchor: ``zstd(planes(buffer))``, the whole version.
- delta against a base version: ``zstd(planes(zigzag(buffer - base)))``: ``-`` subtracts the bit
  patterns as ``word_bytes``-wide integers (wrapping), ``zigzag`` maps the signed difference to
  an unsigned one (0, -1, 1, -2 -> 0, 1, 2, 3) and ``planes`` lays the words out byte plane by
  byte plane (every word's low byte, then every second byte, ...).

Why this delta (``bench_weights --transports bus``, training steps of the 135M shape;
docs/benchmarks-log.md): a small optimizer step leaves most words unchanged and moves the others
by a unit or two in the last place. The zigzagged difference is then 0 or a small number, so
every plane but the lowest is almost all zeros, which zstd stores in a few bytes: a bf16 step at
lr 1e-5 took 9.4 % of the version, against 10.3 % for XOR (a carry such as 0x7F -> 0x80 sets many
bits), 14.2 % for the plain difference (a decrement sets every high bit) and 29 % for changed
indices + values (6 bytes per changed word, with 13 % of the words changed).

Contract: ``decode_anchor(encode_anchor(b, w), w) == b`` and ``apply_delta(base,
encode_delta(b, base, w), w) == b`` bit for bit. Digests are sha256: ``digest(version buffer)``
names a version, ``digest(chunk)`` each stored chunk; a caller checks the rebuilt version's
digest before it serves anything, so a wrong base or a damaged payload is refused, not served.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import zstandard

ZSTD_LEVEL = 1
"""zstd level: 1 compresses a delta within a few percent of level 3 at about twice the speed."""

_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


class CodecError(ValueError):
    """A payload that does not decode, or decodes to the wrong size: the version is refused."""


def digest(data: bytes | bytearray | memoryview | np.ndarray) -> str:
    """sha256 of ``data``, hex."""
    return hashlib.sha256(memoryview(data).cast("B") if not isinstance(data, bytes) else data).hexdigest()


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


# Every step below writes into a buffer it is given where it can: a fresh array of a few hundred
# MB costs a page fault per 4 KiB on first touch, which measured more than the arithmetic.


def _planes(words: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``words`` byte plane by byte plane, into ``out`` (uint8, as many bytes) if given. One
    strided copy per plane: several times faster than copying the transposed view at once."""
    width = words.dtype.itemsize
    columns = words.view(np.uint8).reshape(-1, width)
    planes = (np.empty(words.nbytes, dtype=np.uint8) if out is None else out).reshape(width, -1)
    for k in range(width):
        planes[k] = columns[:, k]
    return planes


def _unplanes(planes: np.ndarray, word_bytes: int) -> np.ndarray:
    """The words whose byte planes ``planes`` (uint8) holds, in a new array."""
    rows = planes.reshape(word_bytes, -1)
    out = np.empty((rows.shape[1], word_bytes), dtype=np.uint8)
    for k in range(word_bytes):
        out[:, k] = rows[k]
    return out.reshape(-1).view(_DTYPES[word_bytes])


def _compress(data: np.ndarray) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(data)


def _decompress(payload: bytes, size: int, word_bytes: int) -> np.ndarray:
    """The ``size`` bytes ``payload`` decodes to (uint8), or CodecError."""
    if size % word_bytes:
        raise CodecError(f"a version of {size} bytes is not a whole number of {word_bytes}-byte words")
    out = np.empty(size, dtype=np.uint8)
    filled = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(payload) as reader:
            view = memoryview(out)
            while filled < size and (n := reader.readinto(view[filled:])):
                filled += n
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CodecError(f"the payload does not decode: {exc}") from None
    if filled != size or extra:
        raise CodecError(
            f"the payload decodes to {'more than ' if extra else ''}{filled} bytes, the version has {size}"
        )
    return out


def encode_anchor(buffer: bytes | np.ndarray, word_bytes: int) -> bytes:
    """The whole version, compressed."""
    return _compress(_planes(_words(buffer, word_bytes)))


def decode_anchor(payload: bytes, size: int, word_bytes: int) -> np.ndarray:
    """The version's bytes (``uint8``, ``size`` long) from an anchor payload."""
    return _unplanes(_decompress(payload, size, word_bytes), word_bytes).view(np.uint8)


def encode_delta(buffer: bytes | np.ndarray, base: bytes | np.ndarray, word_bytes: int) -> bytes:
    """``buffer`` as a difference from ``base`` (the same size), compressed."""
    words, base_words = _words(buffer, word_bytes), _words(base, word_bytes)
    if words.size != base_words.size:
        raise CodecError(
            f"a delta needs a base of the same size: {words.nbytes} vs {base_words.nbytes} bytes"
        )
    zigzag = np.subtract(words, base_words)
    signed = zigzag.view(_SIGNED[word_bytes])
    sign = np.right_shift(signed, 8 * word_bytes - 1)
    np.left_shift(signed, 1, out=signed)
    np.bitwise_xor(signed, sign, out=signed)
    return _compress(_planes(zigzag, out=sign.view(np.uint8)))


def apply_delta(base: bytes | np.ndarray, payload: bytes, word_bytes: int) -> np.ndarray:
    """The version's bytes (a new ``uint8`` array) from ``base`` and a delta payload."""
    base_words = _words(base, word_bytes)
    planes = _decompress(payload, base_words.nbytes, word_bytes)
    zigzag = _unplanes(planes, word_bytes)
    half = np.right_shift(zigzag, 1, out=planes.view(zigzag.dtype))
    np.bitwise_and(zigzag, 1, out=zigzag)
    np.negative(zigzag, out=zigzag)
    np.bitwise_xor(zigzag, half, out=zigzag)
    np.add(zigzag, base_words, out=zigzag)
    return zigzag.view(np.uint8)
