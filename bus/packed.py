"""Packed arrays of the wire format: little-endian int32 / float32 and uint8 bytes.

Token ids, versions and log-probs travel as raw little-endian bytes (``pack_i32``, ``pack_f32``),
a loss mask as one byte per token (``pack_u8``); ``unpack_*`` return read-only numpy views.
Lengths are checked with errors naming the field (docs/design.md section 4.1).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_U8 = np.dtype("u1")


def check_packed(data: bytes, field: str, width: int = 4) -> None:
    if len(data) % width:
        raise ValueError(f"{field}: {len(data)} bytes is not a multiple of {width} (packed int32/float32)")


def pack_i32(values: Sequence[int] | np.ndarray) -> bytes:
    """Little-endian int32 bytes of ``values`` (a list or an integer array); refuses overflow."""
    arr = np.asarray(values)
    if arr.size == 0:
        return b""
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"pack_i32 needs integers, got dtype {arr.dtype}")
    if arr.dtype != _I32 and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise ValueError(f"pack_i32: values out of int32 range [{arr.min()}, {arr.max()}]")
    return np.ascontiguousarray(arr.reshape(-1), dtype=_I32).tobytes()


def pack_f32(values: Sequence[float] | np.ndarray) -> bytes:
    """Little-endian float32 bytes of ``values`` (a list or a numeric array)."""
    arr = np.asarray(values)
    if arr.size == 0:
        return b""
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"pack_f32 needs numbers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr.reshape(-1), dtype=_F32).tobytes()


def pack_u8(values: Sequence[int] | np.ndarray) -> bytes:
    """One byte per value (a list or an integer/bool array of 0..255); refuses overflow."""
    arr = np.asarray(values)
    if arr.size == 0:
        return b""
    if not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
        raise ValueError(f"pack_u8 needs integers, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() > 255:
        raise ValueError(f"pack_u8: values out of uint8 range [{arr.min()}, {arr.max()}]")
    return np.ascontiguousarray(arr.reshape(-1), dtype=_U8).tobytes()


def unpack_u8(data: bytes) -> np.ndarray:
    """A read-only uint8 array over ``data``."""
    return np.frombuffer(data, dtype=_U8)


def unpack_i32(data: bytes, field: str = "data") -> np.ndarray:
    """A read-only int32 array over ``data``; ValueError naming ``field`` if the length is wrong."""
    check_packed(data, field)
    return np.frombuffer(data, dtype=_I32)


def unpack_f32(data: bytes, field: str = "data") -> np.ndarray:
    """A read-only float32 array over ``data``; ValueError naming ``field`` if the length is wrong."""
    check_packed(data, field)
    return np.frombuffer(data, dtype=_F32)
