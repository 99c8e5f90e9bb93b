"""A whole run with ``weight_sync.transport: bus`` on CPU: every version reaches the engines
through the run's weights bucket, bit-identical to the trainer's."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from safetensors.torch import load_file

from areal_async import weight_codec as codec
from areal_async.run_file import load_config
from bus import ConnectOptions, EmbeddedServer, connect
from tests.e2e.test_e2e import _check_exactly_once, _pid_of, _wait_for
from tests.helpers.jobs import (
    finish_job,
    read_steps,
    start_extra_generation,
    start_job,
    steps_done,
    tiny_config,
    worker_log,
)
from workers.weight_bus import BusStore, Record, flatten, slot_names


async def _bucket_contents(url: str, run: str, slots: tuple[str, ...]) -> tuple[list[Record], int]:
    """The records in the run's weights bucket and the number of messages its stream holds."""
    bus = await connect(ConnectOptions(url=url, name="ops"), run)
    try:
        records = await BusStore(bus, slots).records()
        info = await bus.js.stream_info(bus.subjects.weights_stream)
        return records, info.state.messages
    finally:
        await bus.close()


def _bus_loads(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in worker_log(run_dir, "generation", "weights loaded") if r.get("via") == "bus"]


@pytest.mark.timeout(600)
def test_bus_transport_serves_every_version_bit_identical_to_a_restarted_and_a_late_engine(
    tmp_path: Path, tiny_sft_model: Path
) -> None:
    """Every version an engine loads comes from the weights bucket, with the digest the trainer
    wrote (a sha256 of the packed tensors, checked by the engine before it serves them); the
    engine killed mid-run and restarted by the supervisor, and a second engine that joins the
    running run, both rebuild the served version from an anchor and the deltas after it. Nothing
    falls back to disk, the run completes with every task trained once, and the last version's
    disk copy, written from the same snapshot, has the same digest. The bucket holds no more
    than its ring of objects and no chunk of an overwritten one (the run wraps the ring)."""
    total, batch = 12, 4
    cfg = tiny_config(
        tmp_path,
        tiny_sft_model,
        "busw",
        rollout__group_size=4,
        trainer__total_steps=total,
        trainer__batch_size=batch,
        trainer__eval_every=0,
        dataset__eval_size=4,
        checkpoint__every_steps=4,
        weight_sync__transport="bus",
        weight_sync__anchor_every=2,
        weight_sync__chunk_kb=16,
    )
    run_dir = tmp_path / "busw"
    started = time.monotonic()
    proc = start_job(cfg)
    extra = None
    try:
        _wait_for(lambda: steps_done(run_dir) >= 2 and len(_bus_loads(run_dir)) >= 2, 240, "two loads")
        os.kill(_pid_of(run_dir, "generation"), signal.SIGKILL)
        extra = start_extra_generation(cfg, run_dir, "generation-late")
        late = lambda: [r for r in _bus_loads(run_dir) if r["file"] == "generation-late.jsonl"]  # noqa: E731
        _wait_for(lambda: len(late()) >= 2, 240, "the late engine to load two versions")
        extra.send_signal(signal.SIGTERM)
        assert extra.wait(60) == 0
    finally:
        if extra is not None and extra.poll() is None:
            extra.kill()
        res = finish_job(proc, run_dir, started, timeout=300)
    assert res.returncode == 0, res.output[-4000:]
    assert "warning: generation exited with -9; restart 1/3" in res.output
    _check_exactly_once(read_steps(run_dir, "busw"), total, batch)

    written = {r["policy_version"]: r for r in worker_log(run_dir, "trainer", "weights written to the bus")}
    assert sorted(written) == list(range(1, total + 1))
    assert len({w["digest"] for w in written.values()}) == total, "every step moves the weights"
    assert any(w["delta_bytes"] and not w["anchor_bytes"] for w in written.values())
    loads = [r for r in worker_log(run_dir, "generation", "weights loaded") if "via" in r]
    assert loads and all(r["via"] == "bus" for r in loads), [(r["file"], r["via"]) for r in loads]
    assert all(r["digest"] == written[r["policy_version"]]["digest"] for r in loads)
    assert not worker_log(run_dir, "generation", "weights from the bus failed; loading the disk copy")
    engines = {r["file"] for r in loads}
    assert len(engines) == 3, f"the first engine, its restart and the late one each load: {engines}"
    last = load_file(run_dir / "weights" / f"v{total}" / "model.safetensors")
    assert codec.version_digest(flatten(last)[0]) == written[total]["digest"]

    slots = slot_names(load_config(cfg))
    assert total > len(slots), "the run must wrap the ring"
    with EmbeddedServer(run_dir / "nats") as server:  # the run's store; its users live in the global account
        records, messages = anyio.run(_bucket_contents, str(server.url), "busw", slots)
    assert len(records) <= len(slots) and max(r.policy_version for r in records) == total
    assert messages == sum(len(r.chunks) for r in records) + len(records), (
        "chunks of overwritten objects remain"
    )
