"""In-memory weight transfer (``weight_sync.transport`` ``gloo``, ``nccl`` or ``cuda_ipc``), both sides.

Built on the primitives of ``areal_async/weight_buckets.py``; the ``bus`` transport is ``workers/weight_bus.py``.

The trainer's ``WeightSender``: ``prepare`` turns a version's snapshot into what travels: its tensors packed into buckets on the
transfer device (``cuda_ipc``: one buffer, exported as a handle), a digest per bucket, and the
``TransferOffer`` that ``weights.published`` carries. It returns views of the tensors inside the
buckets, so the disk copy is written from the same bytes without a second copy of the model.
The newest ``KEEP`` prepared versions stay in memory.

``serve`` (group transports) answers every ``weights.load`` that names a group: it opens the
group as rank 0 on its own store (the same group again for the next version while the members
do not change) and broadcasts the version's buckets in a worker thread, one transfer at a time.
A transfer that fails or times out is logged and the group dropped; the engines load the disk
copy. For ``cuda_ipc`` there is nothing to serve: engines map the exported buffer.

A generation worker's ``WeightReceiver`` receives an offered version (see its docstring).

``ServerRelay`` is the same hop one level down, for ``weight_sync.transport: bus`` with a remote
engine (vLLM): the generation worker, which rebuilt the version from the weights bucket, is the
sender (a ``WeightSender`` over gloo on a store of its own) and its engine's servers the members,
receiving through ``WeightReceiver.receive_remote`` exactly as from a trainer.
"""

from __future__ import annotations

import json
import socket
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import anyio
import structlog
import torch

from areal_async.config import RunConfig
from areal_async.weight_buckets import (
    TransferError,
    cut_buckets,
    decode_manifest,
    digest,
    encode_manifest,
    export_cuda,
    import_cuda,
    manifest_of,
    open_group,
    pack,
    plan_buckets,
    receive_buckets,
    send_buckets,
    serve_store,
    unpack,
)
from bus import Bus
from bus.events import TransferOffer, WeightsLoad

log = structlog.get_logger()

KEEP = 2
"""Prepared versions held in memory: the newest, and the one engines may still be copying."""

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
"""Host names of server URLs that put the server on the generation worker's own host."""


@dataclass
class Prepared:
    offer: TransferOffer
    buffers: list[torch.Tensor]


def host_address() -> str:
    """This host's name resolved, else 127.0.0.1."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def transfer_host(cfg: RunConfig) -> str:
    """The address engines reach the trainer's store at (``weight_sync.host``)."""
    return cfg.weight_sync.host or host_address()


def relay_host(server_urls: Sequence[str]) -> str:
    """The address a generation worker's servers reach its relay store at: loopback when every
    server listens on this host's loopback, else this host's address."""
    hosts = {urlsplit(url).hostname for url in server_urls}
    return "127.0.0.1" if hosts and hosts <= LOOPBACK else host_address()


class WeightSender:
    def __init__(
        self,
        cfg: RunConfig,
        device: str | torch.device,
        *,
        transport: str | None = None,
        host: str | None = None,
        keep: int = KEEP,
    ) -> None:
        """``transport`` and ``host``: other than the run's (``ServerRelay``); ``keep``: versions held."""
        self.cfg = cfg
        self.transport = transport or cfg.weight_sync.transport
        if self.transport == "disk":
            raise ValueError("WeightSender serves in-memory transports only")
        # gloo moves CPU buffers; nccl and cuda_ipc stay on the trainer's GPU.
        self.device = torch.device("cpu") if self.transport == "gloo" else torch.device(device)
        self.bucket_bytes = cfg.weight_sync.bucket_mb * 2**20
        self.timeout_s = cfg.weight_sync.transfer_timeout_s
        self.prepared: OrderedDict[int, Prepared] = OrderedDict()
        self.store: Any = None
        self.address = ""
        self.keep = keep
        if self.transport in ("gloo", "nccl"):
            host = host or transfer_host(cfg)
            self.store = serve_store(host, 0, self.timeout_s)
            self.address = f"{host}:{self.store.port}"
        self.group: tuple[str, Any] | None = None
        self.lock = anyio.Lock()
        self.newest: int | None = None
        self.failed: set[str] = set()
        self.sent = 0

    def prepare(self, version: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pack ``tensors`` (worker thread), remember the version, and return views of them inside
        the packed buffers (for the disk copy). ``offer(version)`` then describes it."""
        manifest = manifest_of(tensors)
        whole = self.transport == "cuda_ipc"
        plan = plan_buckets(manifest, None if whole else self.bucket_bytes)
        buffers = [pack(bucket, tensors, self.device) for bucket in plan]
        tensors.clear()  # the snapshot's own copies are freed; the buckets hold the bytes now
        views: dict[str, torch.Tensor] = {}
        for bucket, buffer in zip(plan, buffers, strict=True):
            views.update(unpack(bucket, buffer))
        self.hold(version, encode_manifest(manifest), buffers)
        return views

    def hold(self, version: int, manifest: list[list[Any]], buffers: list[torch.Tensor]) -> Prepared:
        """Keep ``version``, already packed into ``buffers`` (the buckets of ``plan_buckets`` of the
        encoded ``manifest`` at ``bucket_mb``; one whole buffer for ``cuda_ipc``), with its offer."""
        offer = TransferOffer(
            transport=self.transport,
            manifest=manifest,
            digests=[digest(b) for b in buffers],
            bucket_bytes=self.bucket_bytes,
            address=self.address,
            handle=export_cuda(buffers[0]) if self.transport == "cuda_ipc" and buffers else b"",
        )
        held = self.prepared[version] = Prepared(offer, buffers)
        self.prepared.move_to_end(version)
        while len(self.prepared) > self.keep:
            self.prepared.popitem(last=False)
        return held

    def offer(self, version: int) -> TransferOffer | None:
        held = self.prepared.get(version)
        return held.offer if held else None

    async def serve(self, bus: Bus) -> None:
        """Join every group transfer ``weight-sync`` announces (group transports only), one at a
        time. A transfer still waiting when a newer one is announced is skipped (its engines time
        out and read the disk copy, and have the newer one coming): a group with a dead member
        costs at most one ``transfer_timeout_s``, not one per queued version."""
        if self.store is None:
            return
        async with anyio.create_task_group() as tg:
            async for ev in bus.subscribe(bus.subjects.weights_load):
                if not isinstance(ev, WeightsLoad) or ev.transfer is None or not ev.group or not ev.members:
                    continue
                if ev.transfer.address != self.address:
                    continue  # announced by an earlier trainer process
                if self.newest is None or ev.policy_version >= self.newest:
                    self.newest = ev.policy_version
                tg.start_soon(self._serve_one, ev)

    async def _serve_one(self, ev: WeightsLoad) -> None:
        async with self.lock:
            if self.newest is not None and ev.policy_version < self.newest:
                log.warning(
                    "weight transfer skipped: a newer version is announced", policy_version=ev.policy_version
                )
                return
            held = self.prepared.get(ev.policy_version)
            if held is None:
                log.warning(
                    "weights.load asks for a version no longer held in memory; engines load the disk copy",
                    policy_version=ev.policy_version,
                )
                return
            if ev.group in self.failed:  # its store keys are stale: it cannot form again
                log.warning("weight transfer refused: its group failed before", group=ev.group)
                return
            await self.send(ev, held)

    async def send(self, ev: WeightsLoad, held: Prepared) -> None:
        """Broadcast ``held`` to the group ``ev`` names (opened on the first send under that name);
        a failure is logged, not raised: the members see it themselves."""
        started = time.monotonic()
        try:
            world_size, _ = group_layout(ev)
            await anyio.to_thread.run_sync(self._broadcast, ev.group, world_size, held.buffers)
        except Exception as exc:  # the engines time out and load the disk copy
            self.group = None
            self.failed.add(ev.group)
            log.error(
                "weight transfer failed; engines fall back to the disk copy",
                policy_version=ev.policy_version,
                group=ev.group,
                error=f"{type(exc).__name__}: {exc}",
            )
            return
        self.sent += 1
        log.info(
            "weights sent",
            policy_version=ev.policy_version,
            transport=self.transport,
            engines=len(ev.members),
            seconds=round(time.monotonic() - started, 4),
        )

    def _broadcast(self, name: str, world_size: int, buffers: list[torch.Tensor]) -> None:
        if self.group is None or self.group[0] != name:
            self.group = None
            group = open_group(
                self.transport,
                self.address,
                name,
                rank=0,
                world_size=world_size,
                timeout_s=self.timeout_s,
                store=self.store,
            )
            self.group = (name, group)
        send_buckets(self.group[1], buffers)


def group_layout(ev: WeightsLoad) -> tuple[int, dict[str, int]]:
    """The group's size and each member's first rank (the trainer is rank 0)."""
    ranks = list(ev.ranks) or [1] * len(ev.members)
    if len(ranks) != len(ev.members) or min(ranks, default=1) < 1:
        raise TransferError(f"weights.load names {len(ev.members)} members but ranks {ev.ranks}")
    first, offset = {}, 1
    for member, n in zip(ev.members, ranks, strict=True):
        first[member] = offset
        offset += n
    return offset, first


class WeightReceiver:
    """A generation worker's side: receive one offered version into the engine's device.

    ``receive`` (worker thread) returns the version's tensors by name, or raises: a group that does
    not form within ``transfer_timeout_s``, a broken broadcast, a handle that cannot be mapped or
    a digest that differs from the offer are all errors, and the caller loads the disk copy.
    ``receive_remote`` does the same for a remote engine's servers. A group that failed either way
    is refused at once when a later version names it again (the sender refuses it too, so waiting
    would only cost another ``transfer_timeout_s``)."""

    def __init__(self, cfg: RunConfig, device: str | torch.device, worker_id: str) -> None:
        self.device = torch.device(device)
        self.worker_id = worker_id
        self.timeout_s = cfg.weight_sync.transfer_timeout_s
        self.group: tuple[str, Any] | None = None
        self.failed: set[str] = set()

    def receive(self, ev: WeightsLoad) -> dict[str, torch.Tensor]:
        offer = ev.transfer
        assert offer is not None
        manifest = decode_manifest(offer.manifest)
        if offer.transport == "cuda_ipc":
            (bucket,) = plan_buckets(manifest, None)
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            buffer = import_cuda(offer.handle, device=index)
            if len(offer.digests) != 1 or digest(buffer) != offer.digests[0]:
                raise TransferError("the mapped CUDA IPC buffer differs from the announced digest")
            return unpack(bucket, buffer)
        name = ev.group
        self._refuse_failed(name)
        try:
            if self.group is None or self.group[0] != name:
                self.group = None
                world_size, first = group_layout(ev)
                group = open_group(
                    offer.transport,
                    offer.address,
                    name,
                    rank=first[self.worker_id],
                    world_size=world_size,
                    timeout_s=self.timeout_s,
                )
                self.group = (name, group)
            device = torch.device("cpu") if offer.transport == "gloo" else self.device
            return receive_buckets(
                self.group[1], plan_buckets(manifest, offer.bucket_bytes), offer.digests, device
            )
        except Exception:
            self.group = None  # a failed collective leaves the group unusable
            self.failed.add(name)
            raise

    async def receive_remote(self, engine: Any, version: int, location: str, ev: WeightsLoad) -> None:
        """Have a remote engine's servers receive ``ev``'s version (``server_call``) and load it;
        a group that fails here is refused at once next time, as in ``receive``."""
        call = self.server_call(ev)
        try:
            await engine.load_weights(version, location, group=call)
        except Exception:
            self.failed.add(ev.group)
            raise

    def _refuse_failed(self, group: str) -> None:
        if group in self.failed:
            raise TransferError(f"weight transfer group {group} failed before; loading the disk copy")

    def server_call(self, ev: WeightsLoad) -> dict[str, str]:
        """The ``receive_weights`` arguments for a remote engine's servers (``vllm_worker``): they
        join the group themselves, from this worker's first rank on."""
        offer = ev.transfer
        if offer is None or offer.transport not in ("gloo", "nccl"):
            raise TransferError("remote servers receive group transfers only (gloo, nccl)")
        self._refuse_failed(ev.group)
        world_size, first = group_layout(ev)
        return {
            "backend": offer.transport,
            "address": offer.address,
            "group": ev.group,
            "rank_offset": str(first[self.worker_id]),
            "world_size": str(world_size),
            "manifest": json.dumps(offer.manifest),
            "digests": json.dumps(offer.digests),
            "bucket_bytes": str(offer.bucket_bytes),
            "timeout_s": str(self.timeout_s),
        }


class ServerRelay:
    """A generation worker's hop into its remote engine's servers (``weight_sync.transport: bus``
    with vLLM): ``load`` sends a version the worker holds packed whole (the bus reader's buffer) to
    every server of its engine and has them install it.

    The worker is rank 0 of a gloo group on a store of its own (at ``relay_host``), the servers the
    members from rank 1 on, as in a trainer's transfer: the buckets are ``weight_sync.bucket_mb``
    views of the buffer (no copy), each with its digest, which the servers check before any
    parameter changes. Consecutive versions reuse the group; after a failure the next version
    opens a new one. A failure raises ``TransferError`` with the reason (after at most
    ``weight_sync.transfer_timeout_s``); the servers keep their previous weights then."""

    def __init__(self, cfg: RunConfig, worker_id: str, host: str) -> None:
        self.worker_id = worker_id
        self.sender = WeightSender(cfg, "cpu", transport="gloo", host=host, keep=1)
        self.receiver = WeightReceiver(cfg, "cpu", worker_id)
        self.epoch = 0

    async def load(
        self, engine: Any, version: int, location: str, flat: torch.Tensor, manifest: list[list[Any]]
    ) -> None:
        """Install ``version`` (``flat``: its tensors packed in name order, ``manifest`` encoded) on
        ``engine``'s servers; ``location`` is its disk copy, which a revived server reloads."""
        problem = engine.group_problem()
        if problem is not None:  # refused before the sender waits for members that cannot come
            raise TransferError(f"the hop into the engine's servers cannot start: {problem}")
        plan = plan_buckets(decode_manifest(manifest), self.sender.bucket_bytes)
        held = await anyio.to_thread.run_sync(self.sender.hold, version, manifest, cut_buckets(flat, plan))
        ev = WeightsLoad(
            policy_version=version,
            path=location,
            transfer=held.offer,
            group=f"relay-{self.worker_id}-{self.epoch}",
            members=[self.worker_id],
            ranks=[engine.group_ranks],
        )
        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.sender.send, ev, held)
            try:
                await self.receiver.receive_remote(engine, version, location, ev)
            except Exception as exc:  # raised once the sender is done too, outside the task group
                error = exc
        if error is not None:
            self.epoch += 1
            raise TransferError(
                f"the hop into the engine's servers failed: {type(error).__name__}: {error}"
            ) from error
