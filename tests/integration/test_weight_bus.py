"""Policy versions through the run's object store bucket (``workers/weight_bus.py``), against a
real nats-server: versions read back bit for bit, damaged chunks refused, the bucket bounded,
and only the trainer may write it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from nats.js import api
from structlog.testing import capture_logs

from areal_async import weight_codec as codec
from areal_async.config import RolloutConfig, RunConfig, WeightSyncConfig
from bus import Bus, BusPermissionError, ConnectOptions, EmbeddedServer, connect
from bus.embedded import run_credentials
from tests.conftest import BusFactory
from workers.weight_bus import (
    BusWeightReader,
    BusWeightsUnavailable,
    BusWeightWriter,
    chunk_subject,
    delta_slots,
    flatten,
)

ANCHOR_EVERY = 3


def run_config(name: str) -> RunConfig:
    return RunConfig(
        name=name,
        rollout=RolloutConfig(max_staleness=1),
        weight_sync=WeightSyncConfig(transport="bus", anchor_every=ANCHOR_EVERY, chunk_kb=4),
    )


def versions(count: int) -> list[dict[str, torch.Tensor]]:
    """bf16 snapshots of a float32 master moved by sign steps (a trainer under Adam)."""
    g = torch.Generator().manual_seed(1)
    master = {
        "a.weight": torch.randn(64, 96, generator=g) * 0.02,
        "b.bias": torch.randn(96, generator=g) * 0.02,
    }
    out = []
    for _ in range(count):
        out.append({k: v.to(torch.bfloat16) for k, v in master.items()})
        for v in master.values():
            v += 1e-4 * torch.randn(v.shape, generator=g).sign()
    return out


async def weights_bus(bus_factory: BusFactory, name: str) -> Bus:
    bus = await bus_factory(name=name)
    await bus.provision(weights_bucket=True)
    return bus


async def corrupt_chunk(bus: Bus, slot: str, index: int) -> None:
    """Rewrite ``slot``'s chunks with one byte of chunk ``index`` flipped."""
    bucket = bus.subjects.weights_bucket
    sub = await bus.js.pull_subscribe(
        chunk_subject(bucket, slot),
        stream=bus.subjects.weights_stream,
        config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE),
    )
    chunks = []
    while True:
        try:
            chunks += [m.data for m in await sub.fetch(64, timeout=0.5)]
        except Exception:
            break
    await sub.unsubscribe()
    damaged = bytearray(chunks[index])
    damaged[len(damaged) // 2] ^= 0x01
    chunks[index] = bytes(damaged)
    for i, data in enumerate(chunks):
        await bus.js.publish(
            chunk_subject(bucket, slot), data, headers={"Nats-Rollup": "sub"} if i == 0 else None
        )


@pytest.mark.asyncio
async def test_every_version_is_read_back_bit_identical_by_a_follower_and_a_late_joiner(
    bus_factory: BusFactory, run_name: str
) -> None:
    """A reader that follows every version applies the deltas to what it holds; one that joins at
    the end rebuilds from the newest anchor. Both get the writer's bytes (digest and tensors)."""
    cfg = run_config(run_name)
    writer = BusWeightWriter(cfg, await weights_bus(bus_factory, "trainer"))
    follower = BusWeightReader(cfg, await weights_bus(bus_factory, "generation-1"))
    snapshots = versions(8)
    written = {}
    for v, tensors in enumerate(snapshots):
        written[v] = await writer.write(v, dict(tensors))
        got, digest = await follower.fetch(v)
        assert digest == written[v]["digest"] == codec.version_digest(flatten(tensors)[0])
        assert all(torch.equal(got[k], t) for k, t in tensors.items())
    kinds = [("anchor" if w["anchor_bytes"] else "delta") for w in written.values()]
    assert kinds == ["anchor", "delta", "delta", "anchor", "delta", "delta", "anchor", "delta"]
    assert all(w["delta_bytes"] < w["bytes"] / 2 for w in list(written.values())[1:])
    joiner = BusWeightReader(cfg, await weights_bus(bus_factory, "generation-2"))
    got, digest = await joiner.fetch(7)
    assert digest == written[7]["digest"]
    assert all(torch.equal(got[k], t) for k, t in snapshots[7].items())


@pytest.mark.asyncio
async def test_a_corrupted_chunk_is_refused_and_the_older_anchor_serves(
    bus_factory: BusFactory, run_name: str
) -> None:
    """A flipped byte in the newest anchor is caught by its chunk digest; the reader logs why and
    rebuilds the version from the older anchor and the deltas after it. A damaged delta that
    every chain needs leaves no verified chain: BusWeightsUnavailable, naming the chunk."""
    cfg = run_config(run_name)
    bus = await weights_bus(bus_factory, "trainer")
    writer = BusWeightWriter(cfg, bus)
    snapshots = versions(5)
    for v, tensors in enumerate(snapshots):
        written = await writer.write(v, dict(tensors))
    newest_anchor = "anchor-1"  # versions 0 and 3 are anchors, in anchor-0 and anchor-1
    await corrupt_chunk(bus, newest_anchor, 1)
    reader = BusWeightReader(cfg, await weights_bus(bus_factory, "generation"))
    with capture_logs() as logs:
        got, digest = await reader.fetch(4)
    assert digest == written["digest"]
    assert all(torch.equal(got[k], t) for k, t in snapshots[4].items())
    refused = [e for e in logs if e["event"] == "weights bucket object refused; planning around it"]
    assert refused and refused[0]["slot"] == newest_anchor and "chunk 1" in refused[0]["reason"]

    await corrupt_chunk(bus, f"delta-{4 % delta_slots(cfg)}", 0)
    fresh = BusWeightReader(cfg, await weights_bus(bus_factory, "generation-2"))
    with pytest.raises(BusWeightsUnavailable, match="chunk 0 of delta-4"):
        await fresh.fetch(4)


@pytest.mark.asyncio
async def test_a_delta_that_decodes_to_another_version_is_named_and_refused(
    bus_factory: BusFactory, run_name: str
) -> None:
    """A delta slot holding a well-formed delta of another step (its chunks match its record) rebuilds
    a version whose digest differs from the record's: the reader, which checks only the end of a
    chain first, applies the chain again step by step and refuses that object by name."""
    cfg = run_config(run_name)
    bus = await weights_bus(bus_factory, "trainer")
    writer = BusWeightWriter(cfg, bus)
    snapshots = versions(5)
    for v, tensors in enumerate(snapshots):
        await writer.write(v, dict(tensors))
    slot = f"delta-{4 % delta_slots(cfg)}"
    (record,) = [r for r in await writer.store.records() if r.slot == slot]
    flat = [flatten(dict(t))[0] for t in snapshots]
    other = codec.encode_delta(flat[2], flat[3], record.word_bytes)  # a step the chain never took
    chunk = cfg.weight_sync.chunk_kb * 1024
    forged = dataclasses.replace(record, chunks=codec.piece_digests(other, chunk), payload_bytes=len(other))
    await writer.store.put(slot, other, forged, chunk)
    reader = BusWeightReader(cfg, await weights_bus(bus_factory, "generation"))
    with pytest.raises(BusWeightsUnavailable, match=f"version 4 rebuilt through {slot} has digest"):
        await reader.fetch(4)
    got, _ = await reader.fetch(3)  # the versions before it still read back
    assert all(torch.equal(got[k], t) for k, t in snapshots[3].items())


@pytest.mark.asyncio
async def test_the_bucket_stays_bounded_over_a_long_run(bus_factory: BusFactory, run_name: str) -> None:
    """After many times the ring's length of versions the bucket holds exactly its slots' objects:
    no leftover chunks, at most 2 anchors + D deltas, and the newest version still reads back."""
    cfg = run_config(run_name)
    bus = await weights_bus(bus_factory, "trainer")
    writer = BusWeightWriter(cfg, bus)
    total = 4 * (delta_slots(cfg) + 2)
    snapshots = versions(total)
    sizes = []
    for v, tensors in enumerate(snapshots):
        written = await writer.write(v, dict(tensors))
        info = await bus.js.stream_info(bus.subjects.weights_stream)
        sizes.append(info.state.bytes)
    records = await writer.store.records()
    assert len(records) == 2 + delta_slots(cfg)
    info = await bus.js.stream_info(bus.subjects.weights_stream)
    assert info.state.messages == sum(len(r.chunks) for r in records) + len(records)
    half = len(sizes) // 2
    assert max(sizes[half:]) <= 1.2 * max(sizes[:half]), "the bucket kept growing"
    got, digest = await BusWeightReader(cfg, await weights_bus(bus_factory, "generation")).fetch(total - 1)
    assert digest == written["digest"]


@pytest.mark.asyncio
async def test_only_the_trainer_may_write_the_weights_bucket(
    tmp_path: Path, server_factory: Callable[..., EmbeddedServer]
) -> None:
    """Under the run's pinned permissions the trainer writes versions; a generation worker reads
    them but its write into the bucket is refused."""
    run = "wperm"
    passwords = run_credentials(tmp_path / "nats")
    server = server_factory(tmp_path / "nats", users=passwords, run=run)

    async def login(user: str) -> Bus:
        options = ConnectOptions(url=str(server.url), name=user, user=user, password=passwords[user])
        bus = await connect(options, run)
        await bus.provision(weights_bucket=True)
        return bus

    cfg = run_config(run)
    trainer, generation = await login("trainer"), await login("generation")
    try:
        snapshot = versions(1)[0]
        written = await BusWeightWriter(cfg, trainer).write(0, dict(snapshot))
        _, digest = await BusWeightReader(cfg, generation).fetch(0)
        assert digest == written["digest"]
        with pytest.raises(BusPermissionError):
            await BusWeightWriter(cfg, generation).write(1, dict(snapshot))
    finally:
        await trainer.close()
        await generation.close()


@pytest.mark.asyncio
async def test_a_restarted_trainers_versions_replace_the_lost_ones(
    bus_factory: BusFactory, run_name: str
) -> None:
    """A trainer restored from an older checkpoint writes an anchor of its version and trains on
    along another trajectory: a reader that holds a version of the lost future gets the new
    trainer's versions (its digests), never the lost ones, and the new writer's next anchor
    replaces the older of the two anchors."""
    cfg = run_config(run_name)
    first = BusWeightWriter(cfg, await weights_bus(bus_factory, "trainer-1"))
    reader = BusWeightReader(cfg, await weights_bus(bus_factory, "generation"))
    lost = versions(5)
    for v, tensors in enumerate(lost):
        await first.write(v, dict(tensors))
    await reader.fetch(4)
    restored = BusWeightWriter(cfg, await weights_bus(bus_factory, "trainer-2"))
    other = [{k: t + 1 for k, t in s.items()} for s in versions(3)]  # another trajectory from v2
    written = {v: await restored.write(v, dict(other[v - 2])) for v in (2, 3, 4)}
    records = await restored.store.records()
    anchors = {r.slot: r.policy_version for r in records if r.kind == "anchor"}
    assert sorted(anchors.values()) == [2, 3], anchors  # v3 (lost) stays, v0 was replaced
    for v in (3, 4):
        got, digest = await reader.fetch(v)
        assert digest == written[v]["digest"]
        assert all(torch.equal(got[k], t) for k, t in other[v - 2].items())


@pytest.mark.asyncio
async def test_an_engine_that_cannot_rebuild_a_version_loads_the_disk_copy_and_says_why(
    bus_factory: BusFactory, run_name: str, tmp_path: Path
) -> None:
    """A generation worker whose version's only anchor is damaged loads the version's disk copy
    and logs why; for a version without a disk copy it reports the load failed and keeps serving
    the version it has."""
    from areal_async.config import ModelConfig
    from areal_async.engines.local import LocalEngine
    from areal_async.models import load_tokenizer
    from areal_async.weights_file import write_weights_dir
    from tests.helpers.models import build_tiny_model
    from workers.generation import Generator
    from workers.runtime import WorkerContext

    model_dir = build_tiny_model(tmp_path / "model")
    cfg = RunConfig(
        name=run_name,
        dir=str(tmp_path / "{name}"),
        model=ModelConfig(path=str(model_dir), use_chat_template=False),
        rollout=RolloutConfig(max_staleness=1),
        weight_sync=WeightSyncConfig(transport="bus", anchor_every=ANCHOR_EVERY, chunk_kb=4),
    )
    trainer = await weights_bus(bus_factory, "trainer")
    writer = BusWeightWriter(cfg, trainer)
    engine = LocalEngine(str(model_dir), engine_id="g")
    await engine.start()
    try:
        base = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        v1 = {k: t + 0.01 for k, t in base.items()}
        await writer.write(1, dict(v1))
        write_weights_dir(cfg.weights_root / "v1", v1)
        await corrupt_chunk(trainer, "anchor-0", 0)
        ctx = WorkerContext(
            cfg=cfg, role="generation", worker_id="g", bus=await weights_bus(bus_factory, "gen")
        )
        generator = Generator(ctx, engine, load_tokenizer(model_dir))
        with capture_logs() as logs:
            await generator.load(1, str(cfg.weights_root / "v1"))
        failed = [e for e in logs if e["event"] == "weights from the bus failed; loading the disk copy"]
        assert failed and "chunk 0 of anchor-0" in failed[0]["error"]
        assert [e["via"] for e in logs if e["event"] == "weights loaded" and "via" in e] == ["disk"]
        assert engine.version == 1
        assert all(torch.equal(engine.model.state_dict()[k], t) for k, t in v1.items())

        await writer.write(2, {k: t + 0.01 for k, t in v1.items()})  # a delta on the damaged anchor
        with capture_logs() as logs:
            await generator.load(2, str(cfg.weights_root / "v2"))
        assert [e["event"] for e in logs if e["log_level"] == "error"] == ["weights load failed"]
        assert engine.version == 1
    finally:
        await engine.aclose()
