"""Encoding one policy version for the bus: anchors, deltas and their digests.

A version travels as one flat byte buffer: its tensors packed in name order
(``weight_transport.plan_buckets(manifest, None)`` + ``pack``). ``word_bytes`` is the width the
codec reads that buffer in: the common element size of its tensors (2 for bf16/fp16, 4 for
float32, 1 for mixed widths).

- anchor: ``zstd(planes(buffer))``, the whole version.
- delta against a base version: ``zstd(planes(zigzag(buffer - base)))``: ``-`` subtracts the bit
  patterns as ``word_bytes``-wide integers (wrapping), ``zigzag`` maps the signed difference to
  an unsigned one (0, -1, 1, -2 -> 0, 1, 2, 3) and ``planes`` lays the words out byte plane by
  byte plane (every word's low byte, then every second byte, ...).

Why this delta (measured on training steps of the 135M shape, docs/benchmarks-log.md): a small
optimizer step leaves most words unchanged and moves the others by a unit or two in the last
place. The zigzagged difference is then 0 or a small number, so every plane but the lowest is
almost all zeros, which zstd stores in a few bytes: a bf16 step at lr 1e-5 took 10.2 % of the
version, against 11.2 % for XOR (a carry such as 0x7F -> 0x80 sets many bits), 15.5 % for the
plain difference (a decrement sets every high bit) and 33 % for changed indices + values (6 bytes
per changed word, with 15 % of the words changed).

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


def _planes(words: np.ndarray) -> np.ndarray:
    # One strided copy per plane: several times faster than copying the transposed view at once.
    width = words.dtype.itemsize
    columns = words.view(np.uint8).reshape(-1, width)
    out = np.empty((width, columns.shape[0]), dtype=np.uint8)
    for k in range(width):
        out[k] = columns[:, k]
    return out


def _unplanes(data: bytes, word_bytes: int) -> np.ndarray:
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.size % word_bytes:
        raise CodecError(f"{raw.size} decoded bytes are not a whole number of {word_bytes}-byte words")
    planes = raw.reshape(word_bytes, -1)
    out = np.empty((planes.shape[1], word_bytes), dtype=np.uint8)
    for k in range(word_bytes):
        out[:, k] = planes[k]
    return out.reshape(-1).view(_DTYPES[word_bytes])


def _compress(data: np.ndarray) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(data)


def _decompress(payload: bytes, size: int) -> bytes:
    try:
        data = zstandard.ZstdDecompressor().decompress(payload, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CodecError(f"the payload does not decode: {exc}") from None
    if len(data) != size:
        raise CodecError(f"the payload decodes to {len(data)} bytes, the version has {size}")
    return data


def encode_anchor(buffer: bytes | np.ndarray, word_bytes: int) -> bytes:
    """The whole version, compressed."""
    return _compress(_planes(_words(buffer, word_bytes)))


def decode_anchor(payload: bytes, size: int, word_bytes: int) -> np.ndarray:
    """The version's bytes (``uint8``, ``size`` long) from an anchor payload."""
    return _unplanes(_decompress(payload, size), word_bytes).view(np.uint8)


def encode_delta(buffer: bytes | np.ndarray, base: bytes | np.ndarray, word_bytes: int) -> bytes:
    """``buffer`` as a difference from ``base`` (the same size), compressed."""
    words, base_words = _words(buffer, word_bytes), _words(base, word_bytes)
    if words.size != base_words.size:
        raise CodecError(
            f"a delta needs a base of the same size: {words.nbytes} vs {base_words.nbytes} bytes"
        )
    signed = (words - base_words).view(_SIGNED[word_bytes])
    zigzag = ((signed << 1) ^ (signed >> (8 * word_bytes - 1))).view(words.dtype)
    return _compress(_planes(zigzag))


def apply_delta(base: bytes | np.ndarray, payload: bytes, word_bytes: int) -> np.ndarray:
    """The version's bytes (a new ``uint8`` array) from ``base`` and a delta payload."""
    base_words = _words(base, word_bytes)
    zigzag = _unplanes(_decompress(payload, base_words.nbytes), word_bytes)
    difference = (zigzag >> 1) ^ np.negative(zigzag & 1)
    return (base_words + difference).view(np.uint8)
