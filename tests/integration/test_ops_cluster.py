"""The shipped 3-node NATS cluster (scripts/nats/nats-{1,2,3}.conf) on loopback: R3 failover.

Three nats-server processes from the wheel run the shipped member configs (routes and
listen addresses moved to loopback ports, per-role users as shipped). The run is
provisioned with ``replicas=3``; then the node that leads both the JetStream meta group and
the prompt stream is SIGKILLed while work flows through the stream. Publishing and
consuming go on through the other two nodes without any retrying in the caller (the bus
waits out the election), and every task arrives, none stored twice.
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import anyio
import pytest
import pytest_asyncio

from bus import Bus, ConnectOptions, EmbeddedServer, connect
from bus import events as ev
from tests.helpers.ops_helpers import (
    cluster_configs,
    free_port,
    monitor,
    password_env,
    role_passwords,
    start_together,
)

T = TypeVar("T")

NUM_TASKS = 300
KILL_AFTER = NUM_TASKS // 3


def task(index: int) -> ev.PromptTask:
    return ev.PromptTask(
        task_id=f"train:0:{index}", kind="train", index=index, epoch=0, row={}, issued_at=0.0
    )


class Cluster:
    """Three members started from the shipped configs, plus the ops user's credentials."""

    def __init__(self, servers: list[EmbeddedServer], passwords: dict[str, str]) -> None:
        self.servers = servers
        self.passwords = passwords

    @property
    def urls(self) -> list[str]:
        return [str(s.url) for s in self.servers]

    def options(self, user: str, urls: list[str], **kwargs: object) -> ConnectOptions:
        return ConnectOptions(
            url=urls, name=f"{user}-1", user=user, password=self.passwords[user],
            reconnect_wait_max_s=0.5, request_timeout_s=2.0, **kwargs,
        )  # fmt: skip

    def by_name(self, server_name: str) -> EmbeddedServer:
        return next(s for s in self.servers if monitor(s, "/varz")["server_name"] == server_name)


@pytest_asyncio.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    passwords = role_passwords()
    for key, value in password_env(passwords).items():
        monkeypatch.setenv(key, value)
    mains = cluster_configs(tmp_path / "etc", [free_port() for _ in range(3)])
    servers = [
        EmbeddedServer(tmp_path / f"store-{k}", config_file=main, http_port=-1)
        for k, main in enumerate(mains, start=1)
    ]
    try:
        await start_together(servers)
        yield Cluster(servers, passwords)
    finally:
        for server in servers:
            await server.astop()


async def eventually(call: Callable[[], Awaitable[T]], seconds: float = 30) -> T:
    """Retry a JetStream request that fails while its raft group has no leader (no meta leader
    yet at start; a stream or bucket electing a new one after the kill)."""
    with anyio.fail_after(seconds):
        while True:
            try:
                return await call()
            except Exception:  # 503 no responders / timeout: no leader yet
                await anyio.sleep(0.1)


async def lead_stream_from_meta_leader(bus: Bus, cluster: Cluster, stream: str) -> str:
    """Move ``stream``'s leader onto the meta leader (so one kill takes out both); its name."""
    meta = monitor(cluster.servers[0], "/jsz")["meta_cluster"]
    assert isinstance(meta, dict)
    leader = str(meta["leader"])
    with anyio.fail_after(20):
        while (await eventually(lambda: bus.js.stream_info(stream))).cluster.leader != leader:
            request = json.dumps({"placement": {"preferred": leader}}).encode()
            try:
                await bus.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", request, timeout=2)
            except Exception:  # mid-election; ask again
                pass
            await anyio.sleep(0.2)
    return leader


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_killing_the_leader_node_loses_no_work_and_stores_nothing_twice(cluster: Cluster) -> None:
    """R3 streams and KV on the shipped cluster survive a SIGKILL of the node leading both the
    meta group and the prompt stream, mid-stream: the controller (publishing with msg ids)
    and a generation worker (consuming, acking) were both connected to that node only; they
    reconnect to the others (learned from the cluster) and ride out the election inside the
    bus: no publish raises and the consumer never stops iterating. Every task is consumed
    (duplicates only as redeliveries, dropped by task id), the stream stored each task once,
    and the KV state written before the kill is still there."""
    ops = await connect(cluster.options("ops", cluster.urls), "r3")
    try:
        await eventually(ops.js.account_info)  # auth hides JetStream from the start check
        await ops.provision(replicas=3, ack_wait=5.0)
        prompt = ops.subjects.stream("PROMPT").name
        for name in (prompt, f"KV_{ops.subjects.state_bucket}", f"KV_{ops.subjects.workers_bucket}"):
            info = await ops.js.stream_info(name)
            assert info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2, name
        await ops.kv_put("state", "weights.served", b"v7")

        leader = await lead_stream_from_meta_leader(ops, cluster, prompt)
        victim = cluster.by_name(leader)
        assert victim.pid is not None and victim.url is not None
        controller = await connect(cluster.options("controller", [victim.url]), "r3")
        generation = await connect(cluster.options("generation", [victim.url]), "r3")

        received: Counter[str] = Counter()
        published = 0
        all_published, all_received = anyio.Event(), anyio.Event()

        async def publish_all() -> None:
            nonlocal published
            for i in range(NUM_TASKS):
                await controller.publish(controller.subjects.prompt, task(i), msg_id=f"train:0:{i}")
                published += 1
                if i == KILL_AFTER:
                    os.kill(victim.pid, signal.SIGKILL)
            all_published.set()

        async def consume_all() -> None:
            async with generation.consume("PROMPT", batch=8, fetch_timeout=0.5) as deliveries:
                async for d in deliveries:  # until drained() cancels it
                    received[d.event.task_id] += 1
                    await d.ack()
                    if len(received) == NUM_TASKS:
                        all_received.set()
            raise AssertionError("the consumer stopped iterating")

        async def drained(scope: anyio.CancelScope) -> None:
            """Done when every task was published and received and the work queue is empty.

            An ack lost in the failover leaves its task in the stream; it is redelivered after
            ack_wait (a duplicate, dropped by task id) and acked again, so the queue empties."""
            await all_published.wait()
            await all_received.wait()
            while (await eventually(lambda: ops.js.stream_info(prompt))).state.messages:  # noqa: ASYNC110
                await anyio.sleep(0.1)
            scope.cancel()

        with anyio.move_on_after(60) as deadline:
            async with anyio.create_task_group() as tg:
                tg.start_soon(publish_all)
                tg.start_soon(consume_all)
                tg.start_soon(drained, tg.cancel_scope)
        assert not deadline.cancelled_caught, (
            f"stuck: published {published}/{NUM_TASKS}, received {len(received)}"
        )
        assert controller.stats["publish_retries"] > 0, "the kill never reached a publish"

        assert set(received) == {f"train:0:{i}" for i in range(NUM_TASKS)}
        assert generation.nc.connected_url is not None and generation.nc.connected_url.port != int(
            victim.url.rsplit(":", 1)[1]
        )
        state = (await eventually(lambda: ops.js.stream_info(prompt))).state
        assert state.last_seq == NUM_TASKS, f"stored {state.last_seq} for {NUM_TASKS} tasks"
        served = await eventually(lambda: ops.kv_get("state", "weights.served"))
        assert served is not None and served.value == b"v7"
        assert await eventually(lambda: ops.kv_put("state", "weights.served", b"v8")) > served.revision
        await controller.close()
        await generation.close()
    finally:
        await ops.close()
