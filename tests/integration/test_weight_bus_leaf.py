"""The weights bucket across the shipped 3-node cluster and a leaf node (scripts/nats/leaf.conf).

The cluster members run the shipped configs with ``leafnodes.conf`` included; the leaf runs
``leaf.conf`` (no JetStream of its own; ``$JS.API`` mapped to the cluster's domain). The trainer
writes versions through a member, a generation worker that reaches only the leaf provisions the
run, reads every version bit for bit, takes and acks a prompt task, and is refused a write into
the bucket; both sides go on when the node leading the bucket's stream is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest
import pytest_asyncio
import torch

from bus import Bus, BusPermissionError, ConnectOptions, EmbeddedServer, connect
from bus import events as ev
from bus.embedded import find_nats_server
from bus.subjects import Streams
from tests.helpers.ops_helpers import (
    cluster_configs,
    free_port,
    monitor,
    password_env,
    role_passwords,
    start_together,
)
from tests.integration.test_ops_cluster import eventually
from tests.integration.test_weight_bus import run_config, versions
from workers.weight_bus import BusWeightReader, BusWeightWriter

RUN = "leafrun"


async def _wait_for_port(port: int, seconds: float = 10) -> None:
    with anyio.fail_after(seconds):
        while True:
            try:
                await (await anyio.connect_tcp("127.0.0.1", port)).aclose()
                return
            except OSError:
                await anyio.sleep(0.05)


@pytest.fixture
def leaf_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    passwords = role_passwords()
    env = {**password_env(passwords), "AREAL_NATS_PASS_LEAF": "leaf-secret"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield passwords


@pytest_asyncio.fixture
async def cluster_and_leaf(
    tmp_path: Path, leaf_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[list[EmbeddedServer], str]]:
    """Three members accepting leaf connections, and a leaf connected to all three; the leaf's URL."""
    mains = cluster_configs(tmp_path / "etc", [free_port() for _ in range(3)])
    leaf_ports = [free_port() for _ in mains]
    for main, port in zip(mains, leaf_ports, strict=True):
        main.write_text(main.read_text().replace("# include ./leafnodes.conf", "include ./leafnodes.conf"))
        leafnodes = main.parent / "leafnodes.conf"
        leafnodes.write_text(leafnodes.read_text().replace("0.0.0.0:7422", f"127.0.0.1:{port}"))
    for k, port in enumerate(leaf_ports, start=1):
        monkeypatch.setenv(f"AREAL_LEAF_HUB_{k}", f"nats-leaf://leaf:leaf-secret@127.0.0.1:{port}")
    servers = [
        EmbeddedServer(tmp_path / f"store-{k}", config_file=main, http_port=-1)
        for k, main in enumerate(mains, start=1)
    ]
    leaf_port = free_port()
    leaf = None
    try:
        await start_together(servers)
        leaf = await anyio.open_process(
            [find_nats_server(), "-c", str(mains[0].parent / "leaf.conf"), "-p", str(leaf_port), "-m", "0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        await _wait_for_port(leaf_port)
        yield servers, f"nats://127.0.0.1:{leaf_port}"
    finally:
        if leaf is not None:
            leaf.terminate()
            await leaf.wait()
        for server in servers:
            await server.astop()


async def login(url: str | list[str], user: str, passwords: dict[str, str]) -> Bus:
    options = ConnectOptions(
        url=url, name=f"{user}-1", user=user, password=passwords[user], request_timeout_s=2.0
    )
    bus = await connect(options, RUN)
    await eventually(lambda: bus.provision(replicas=3, weights_bucket=True), 60)
    return bus


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_an_engine_behind_a_leaf_node_reads_the_weights_bucket_and_may_not_write_it(
    cluster_and_leaf: tuple[list[EmbeddedServer], str], leaf_env: dict[str, str]
) -> None:
    """Through the leaf only, the generation role provisions the run, reads each version the
    trainer wrote through a member (same digest, same tensors), consumes and acks a prompt task
    the controller published on another member, and its write into the bucket is refused."""
    servers, leaf_url = cluster_and_leaf
    trainer = await login(str(servers[0].url), "trainer", leaf_env)
    controller = await login(str(servers[1].url), "controller", leaf_env)
    generation = await login(leaf_url, "generation", leaf_env)
    try:
        cfg = run_config(RUN)
        writer, reader = BusWeightWriter(cfg, trainer), BusWeightReader(cfg, generation)
        for v, tensors in enumerate(versions(4)):
            written = await writer.write(v, dict(tensors))
            got, digest = await reader.fetch(v)
            assert digest == written["digest"]
            assert all(torch.equal(got[k], t) for k, t in tensors.items())
        with pytest.raises(BusPermissionError):
            await BusWeightWriter(cfg, generation).write(9, dict(versions(1)[0]))

        task = ev.PromptTask(task_id="train:0:1", kind="train", index=1, epoch=0, row={}, issued_at=0.0)
        await controller.publish(controller.subjects.prompt, task, msg_id="train:0:1:0")
        with anyio.fail_after(30):
            async for delivery in generation.consume(Streams.PROMPT, batch=1):
                assert delivery.event.task_id == "train:0:1"
                await delivery.ack_sync()
                break
        # The ack's reply comes from the consumer; the work queue drops the message through its
        # own raft group a moment later, so the stream is asked until it is empty (or 10 s pass).
        prompts = trainer.subjects.stream(Streams.PROMPT).name
        deadline = anyio.current_time() + 10
        info = await eventually(lambda: trainer.js.stream_info(prompts))
        while info.state.messages and anyio.current_time() < deadline:
            await anyio.sleep(0.1)
            info = await eventually(lambda: trainer.js.stream_info(prompts))
        assert info.state.messages == 0, "the ack through the leaf did not reach the work queue"

        # SIGKILL of the node leading the bucket's stream: the trainer's put and the engine's
        # read wait out the election and go on through the other members.
        leader = (await trainer.js.stream_info(trainer.subjects.weights_stream)).cluster.leader
        victim = next(s for s in servers if monitor(s, "/varz")["server_name"] == leader)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        after = versions(5)[4]
        written = await writer.write(4, dict(after))
        got, digest = await reader.fetch(4)
        assert digest == written["digest"] and all(torch.equal(got[k], t) for k, t in after.items())
    finally:
        for bus in (trainer, controller, generation):
            await bus.close()
