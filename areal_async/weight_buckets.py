"""Moving one policy version in memory: bucketed broadcast over a process group, or one CUDA IPC buffer.

The primitives both ends share; the trainer's and the engine's sides are ``workers/weight_memory.py``.

Both ends hold the same manifest, a list of ``(name, shape, dtype)``. ``plan_buckets`` sorts it by
name and cuts it into buckets of at most ``bucket_bytes`` (a tensor larger than that is a bucket of
its own). ``pack`` copies a bucket's tensors into one flat ``uint8`` buffer on the sender's
device; ``unpack`` gives the receiver views of the tensors inside a buffer. A version already
packed whole (the bus reader's buffer, ``workers/weight_bus.py``) is sent as ``cut_buckets``
views of it, without a copy.

Group transports (``gloo`` on CPU, ``nccl`` between GPUs): the sender (rank 0) serves a
``TCPStore``; every transfer names a group, and the members open a process group of their own on
that store under the group's name (``open_group``), outside ``torch.distributed``'s default group,
so a trainer that already runs under torchrun can still send. ``send_buckets`` broadcasts every
bucket in plan order; ``receive_buckets`` receives them and checks each.

``cuda_ipc`` (one GPU or one host): the sender packs the whole version into one buffer and
exports it (``export_cuda``): the handle is plain bytes and integers, encoded with msgpack, never
pickled. A receiver maps it (``import_cuda``), checks it, copies what it needs, and drops the map.

Integrity: ``digest`` is a position-weighted sum over a buffer's 32-bit words (wrapping int64
arithmetic, so any summation order gives the same value), computed where the bytes are, in chunks
(a few elementwise kernels on a GPU, no host copy). The sender announces each bucket's digest with
the version; a receiver checks every bucket before it hands back any tensor and raises
``TransferError`` on a mismatch. It catches corrupted, truncated and reordered bytes; it is not a
cryptographic hash: the group is a private channel of one run, and the disk copy keeps its sha256.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 512 * 2**20
"""Bucket size: large enough to amortise a collective's latency, small enough to stage twice."""

_DIGEST_MODULUS = 65521
"""Position weights cycle through 1..65521 (a prime), so swapped words change the sum."""

_DIGEST_CHUNK_WORDS = 2**24
"""Words per digest chunk: bounds the int64 temporaries to 128 MiB."""

BACKENDS = ("gloo", "nccl")


class TransferError(RuntimeError):
    """A transfer failed or arrived different from what the sender announced: the version is refused."""


@dataclass(frozen=True)
class Slot:
    """One tensor of the manifest: where its bytes sit in its bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


Manifest = Sequence[tuple[str, Sequence[int], torch.dtype]]


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


def manifest_of(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, list[int], torch.dtype]]:
    return [(name, list(t.shape), t.dtype) for name, t in tensors.items()]


def encode_manifest(manifest: Manifest) -> list[list[Any]]:
    """The manifest as msgpack-able lists: ``[name, shape, dtype name]``."""
    return [
        [name, [int(d) for d in shape], str(dtype).removeprefix("torch.")] for name, shape, dtype in manifest
    ]


def decode_manifest(rows: Sequence[Sequence[Any]]) -> list[tuple[str, list[int], torch.dtype]]:
    out = []
    for row in rows:
        name, shape, dtype_name = row
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise TransferError(f"manifest entry {name!r} names an unknown dtype {dtype_name!r}")
        out.append((str(name), [int(d) for d in shape], dtype))
    return out


def plan_buckets(manifest: Manifest, bucket_bytes: int | None = DEFAULT_BUCKET_BYTES) -> list[list[Slot]]:
    """The manifest in name order, cut into buckets of at most ``bucket_bytes`` (one tensor larger
    than that is a bucket of its own; None: one bucket). Every rank computes the same plan from
    the same manifest."""
    if bucket_bytes is None:
        bucket_bytes = sum(nbytes(shape, dtype) for _, shape, dtype in manifest) or 1
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    names = [name for name, _, _ in manifest]
    if len(set(names)) != len(names):
        raise ValueError("the manifest names a tensor twice")
    buckets: list[list[Slot]] = []
    current: list[Slot] = []
    used = 0
    for name, shape, dtype in sorted(manifest, key=lambda entry: entry[0]):
        size = nbytes(shape, dtype)
        if current and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(Slot(name, tuple(int(d) for d in shape), dtype, used, size))
        used += size
    if current:
        buckets.append(current)
    return buckets


def digest(buffer: torch.Tensor) -> int:
    """A position-weighted sum of ``buffer``'s 32-bit words (uint8, 1-D), computed on its device."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"expected a 1-D uint8 buffer, got {buffer.dtype} of shape {tuple(buffer.shape)}")
    n = buffer.numel()
    whole = n - n % 4
    total = torch.zeros((), dtype=torch.int64, device=buffer.device)
    words = buffer[:whole].view(torch.int32) if whole else buffer[:0]
    for start in range(0, words.numel(), _DIGEST_CHUNK_WORDS):
        chunk = words[start : start + _DIGEST_CHUNK_WORDS].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=buffer.device, dtype=torch.int64)
        total += (chunk * (weights % _DIGEST_MODULUS + 1)).sum()
    tail = buffer[whole:].to(torch.int64)
    total += (tail * torch.arange(1, tail.numel() + 1, device=buffer.device, dtype=torch.int64)).sum()
    return int(total.item()) ^ n


def pack(
    bucket: Sequence[Slot], tensors: Mapping[str, torch.Tensor], device: torch.device | str
) -> torch.Tensor:
    """One flat ``uint8`` buffer on ``device`` holding the bucket's tensors at their offsets."""
    buffer = torch.empty(sum(s.nbytes for s in bucket), dtype=torch.uint8, device=torch.device(device))
    for slot in bucket:
        t = tensors[slot.name]
        if tuple(t.shape) != slot.shape or t.dtype != slot.dtype:
            raise ValueError(
                f"tensor {slot.name!r} is {t.dtype} {tuple(t.shape)}, the manifest says {slot.dtype} {slot.shape}"
            )
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[slot.offset : slot.offset + slot.nbytes].copy_(flat)
    return buffer


def unpack(bucket: Sequence[Slot], buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of the bucket's tensors inside ``buffer`` (no copy)."""
    need = sum(s.nbytes for s in bucket)
    if buffer.numel() != need:
        raise TransferError(f"a bucket of {buffer.numel()} bytes arrived where the plan needs {need}")
    return {s.name: buffer[s.offset : s.offset + s.nbytes].view(s.dtype).reshape(s.shape) for s in bucket}


def cut_buckets(buffer: torch.Tensor, buckets: Sequence[Sequence[Slot]]) -> list[torch.Tensor]:
    """A whole version packed as one bucket (``plan_buckets(manifest, None)``), as views cut along
    ``buckets`` (a plan of the same manifest): both plans lay the tensors out in name order, so
    each bucket is a contiguous slice of the whole, and nothing is copied."""
    out, start = [], 0
    for bucket in buckets:
        size = sum(s.nbytes for s in bucket)
        out.append(buffer[start : start + size])
        start += size
    if start != buffer.numel():
        raise TransferError(f"a version of {buffer.numel()} bytes cut into buckets of {start} bytes")
    return out


# ---- group transports -------------------------------------------------------------------------


def serve_store(host: str, port: int = 0, timeout_s: float = 60.0) -> dist.TCPStore:
    """The sender's rendezvous store (``port`` 0: a free one; read it back from ``store.port``)."""
    return dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def open_group(
    backend: str,
    address: str,
    name: str,
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """Join the process group ``name`` of ``world_size`` members on the store at ``address``
    (``host:port``; the sender passes its own ``store``). Blocks until every member has joined
    or ``timeout_s`` passes."""
    if backend not in BACKENDS:
        raise ValueError(f"weight transfer backend must be one of {BACKENDS}, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        host, _, port = address.rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    scoped = dist.PrefixStore(f"weights/{name}/", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(scoped, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(scoped, rank, world_size, options)


def _broadcast(group: dist.ProcessGroup, buffer: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()


def send_buckets(group: dist.ProcessGroup, buffers: Sequence[torch.Tensor]) -> None:
    """Broadcast the packed buckets from rank 0, in plan order."""
    for buffer in buffers:
        _broadcast(group, buffer)
    if buffers and buffers[0].is_cuda:
        torch.cuda.current_stream(buffers[0].device).synchronize()


def receive_buckets(
    group: dist.ProcessGroup,
    buckets: Sequence[Sequence[Slot]],
    digests: Sequence[int],
    device: torch.device | str,
) -> dict[str, torch.Tensor]:
    """Receive every bucket from rank 0 and return the tensors by name; ``TransferError`` when a
    bucket's digest differs from the announced one (every bucket is still received, so the
    group's collectives stay in step)."""
    if len(digests) != len(buckets):
        raise TransferError(f"{len(digests)} digests announced for {len(buckets)} buckets")
    out: dict[str, torch.Tensor] = {}
    bad: list[str] = []
    for bucket, want in zip(buckets, digests, strict=True):
        buffer = torch.empty(sum(s.nbytes for s in bucket), dtype=torch.uint8, device=torch.device(device))
        _broadcast(group, buffer)
        if digest(buffer) != want:
            bad.append(bucket[0].name)
            continue
        out.update(unpack(bucket, buffer))
    if bad:
        raise TransferError(
            f"{len(bad)} of {len(buckets)} weight buckets arrived corrupted (first tensors: {bad[:3]}); "
            "the version is refused"
        )
    return out


# ---- CUDA IPC ---------------------------------------------------------------------------------


def export_cuda(buffer: torch.Tensor) -> bytes:
    """A handle another process on this host can map ``buffer`` with (msgpack bytes). The sender
    keeps ``buffer`` alive until every receiver has copied from it."""
    import msgpack  # here: vLLM's workers import this module without msgpack installed

    if not buffer.is_cuda or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError("export_cuda needs a 1-D uint8 CUDA buffer")
    storage = buffer.untyped_storage()
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
    return msgpack.packb(
        {
            "device": int(device),
            "handle": bytes(handle),
            "storage_size": int(size),
            "storage_offset": int(offset),
            "ref_handle": bytes(ref_handle),
            "ref_offset": int(ref_offset),
            "event_handle": bytes(event_handle) if event_handle else b"",
            "event_sync": bool(event_sync),
            "element_offset": int(buffer.storage_offset()),
            "numel": int(buffer.numel()),
        }
    )


def import_cuda(handle: bytes, device: int | None = None) -> torch.Tensor:
    """Map a buffer exported by ``export_cuda`` in another process (a 1-D uint8 CUDA tensor)."""
    import msgpack

    try:
        h = msgpack.unpackb(handle)
        target = h["device"] if device is None else device
        with torch.cuda.device(target):
            storage = torch.UntypedStorage._new_shared_cuda(
                target,
                h["handle"],
                h["storage_size"],
                h["storage_offset"],
                h["ref_handle"],
                h["ref_offset"],
                h["event_handle"] or None,
                h["event_sync"],
            )
            whole = torch.empty(0, dtype=torch.uint8, device=f"cuda:{target}")
            whole.set_(storage, 0, (h["storage_size"],), (1,))
        return whole[h["element_offset"] : h["element_offset"] + h["numel"]]
    except (KeyError, TypeError, ValueError, RuntimeError, msgpack.UnpackException) as exc:
        raise TransferError(f"cannot map the CUDA IPC handle: {type(exc).__name__}: {exc}") from exc
