"""The bus against a real nats-server: delivery, dedup, dead letters, limits, connect, KV."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import anyio
import msgpack
import numpy as np
import pytest

from bus import (
    Bus,
    BusConnectError,
    ConnectOptions,
    Consumer,
    Delivery,
    EmbeddedServer,
    KvConflict,
    PayloadTooLarge,
    StreamFull,
    StreamNotFound,
    StreamUnavailable,
    connect,
)
from bus import events as ev
from bus.payload import PAYLOAD_MARGIN
from tests.conftest import BusFactory


async def next_delivery(consumer: Consumer) -> Delivery:
    with anyio.fail_after(10):
        return await anext(consumer)


async def wait_until(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll server-side state (there is no event to wait on) for up to 10 s."""
    with anyio.fail_after(10):
        while not await check():  # noqa: ASYNC110
            await anyio.sleep(0.02)


async def read_stream(bus: Bus, key: str, count: int) -> list[bytes]:
    """Raw payloads of the first ``count`` messages of a limits stream (ephemeral consumer)."""
    spec = bus.subjects.stream(key)
    psub = await bus.js.pull_subscribe(spec.subject, stream=spec.name)
    out: list[bytes] = []
    with anyio.fail_after(10):
        while len(out) < count:
            try:
                msgs = await psub.fetch(min(256, count - len(out)), timeout=1.0)
            except TimeoutError:
                continue
            out += [m.data for m in msgs]
    await psub.unsubscribe()
    return out


async def stream_messages(bus: Bus, key: str) -> int:
    return (await bus.js.stream_info(bus.subjects.stream(key).name)).state.messages


def prompt_task(index: int = 0) -> ev.PromptTask:
    return ev.PromptTask(
        task_id=f"train:0:{index}",
        kind="train",
        index=index,
        epoch=0,
        row={"q": index},
        issued_at=time.time(),
    )


def rollout_of_size(num_bytes: int) -> ev.RolloutGroup:
    """A RolloutGroup whose prompt_ids take ``num_bytes`` (rounded down to int32s)."""
    return ev.RolloutGroup(
        task_id="t", kind="train", index=0, epoch=0, attempt=0, row={}, engine_id="gen-0",
        prompt_ids=ev.pack_i32(np.zeros(num_bytes // 4, dtype=np.int32)), completions=[],
        head_version=0, tail_version=0,
    )  # fmt: skip


@pytest.mark.asyncio
async def test_every_event_type_round_trips_through_nats(
    bus: Bus, sample_events: dict[str, ev.Event]
) -> None:
    """Each event arrives equal on its subject, with headers, and plain msgpack reads the wire bytes."""
    s = bus.subjects
    cases = [
        (s.prompt, "PromptTask"),
        (s.rollout_generated, "RolloutGroup"),
        (s.rollout_scored, "ScoredGroup"),
        (s.eval_scored, "ScoredGroup"),
        (s.rollout_failed, "RolloutFailed"),
        (s.trainer_step, "TrainerStep"),
        (s.weights_published, "WeightsPublished"),
        (s.weights_load, "WeightsLoad"),
        (s.weights_loaded, "WeightsLoaded"),
        (s.weights_served, "WeightsServed"),
        (s.heartbeat("generation", "gen-0"), "Heartbeat"),
        (s.deadletter, "DeadLetter"),
        (s.metrics, "MetricsReport"),
        (s.run_ended, "RunEnded"),
        (s.run_stalled, "RunStalled"),
        (s.run_healed, "RunHealed"),
        (s.generate, "GenerateCall"),
    ]
    # GenerateReply has no subject: it goes to the caller's inbox (test_a_request_reaches_one_member...).
    assert {name for _, name in cases} == set(ev.EVENT_TYPES) - {"GenerateReply"}
    for subject, name in cases:
        event = sample_events[name]
        spec = s.stream_for_subject(subject)
        if spec is None:
            raw_sub = await bus.nc.subscribe(subject)
            async with bus.subscribe(subject) as sub:
                assert await bus.publish(subject, event) is None
                with anyio.fail_after(5):
                    got = await anext(sub)
            raw_msg = await raw_sub.next_msg(timeout=5)
            await raw_sub.unsubscribe()
            raw, headers = raw_msg.data, raw_msg.headers or {}
        elif spec.consumer is not None:
            published = await bus.publish(subject, event, msg_id=f"{name}:{subject}")
            assert published is not None and published.stream == spec.name
            async with bus.consume(spec.key, batch=1) as consumer:
                delivery = await next_delivery(consumer)
                await delivery.ack()
            got, raw, headers = delivery.event, delivery.data, delivery.headers
            assert delivery.num_delivered == 1 and delivery.stream_seq == published.seq
        else:
            published = await bus.publish(subject, event)
            assert published is not None
            stored = await bus.js.get_msg(spec.name, published.seq)
            raw, headers = stored.data or b"", stored.headers or {}
            got = ev.decode(raw, ev.DeadLetter)
        assert got == event, subject
        plain = msgpack.unpackb(raw)
        assert plain["schema"] == name and plain["schema_version"] == 1
        assert headers["Areal-Event"] == name and headers["Areal-Run"] == bus.run
    assert bus.stats["deadletter"] == 0


@pytest.mark.asyncio
async def test_unacked_message_is_redelivered_to_another_consumer(bus_factory: BusFactory) -> None:
    """A worker that dies holding a task loses nothing: after ack_wait another worker gets it."""
    worker_a = await bus_factory(name="worker-a")
    await worker_a.provision(ack_wait=1.0)
    worker_b = await bus_factory(name="worker-b")
    task = prompt_task(7)
    await worker_a.publish(worker_a.subjects.prompt, task, msg_id="train:0:7:0")

    first = await next_delivery(worker_a.consume("PROMPT", batch=1))
    assert first.event == task and first.num_delivered == 1
    await worker_a.nc.close()  # dies: no ack, no nak, no drain

    async with worker_b.consume("generation", batch=1, fetch_timeout=0.5) as consumer:
        again = await next_delivery(consumer)
        await again.ack_sync()
    assert again.event == task and again.num_delivered == 2
    assert await stream_messages(worker_b, "PROMPT") == 0


@pytest.mark.asyncio
async def test_a_reader_that_reclaims_gets_what_its_dead_predecessor_held_at_once(
    bus_factory: BusFactory,
) -> None:
    """reclaim() hands a restarted sole reader every unacked message now, not after ack_wait;
    acked ones stay gone, and a stream without a durable consumer of its own is refused."""
    first = await bus_factory(name="trainer-a")
    await first.provision(ack_wait=600.0)
    for i in range(5):
        await first.publish(first.subjects.prompt, prompt_task(i), msg_id=f"train:0:{i}:0")
    consumer = first.consume("PROMPT", batch=1)
    held = [await next_delivery(consumer) for _ in range(3)]
    await held[0].ack_sync()
    await first.nc.close()  # dies holding tasks 1 and 2

    second = await bus_factory(name="trainer-b")
    assert await second.reclaim("PROMPT")
    with anyio.fail_after(20):  # far below ack_wait: only the reset can deliver them
        async with second.consume("PROMPT", batch=4, fetch_timeout=0.5) as deliveries:
            got = [await next_delivery(deliveries) for _ in range(4)]
            for d in got:
                await d.ack_sync()
    assert sorted(d.event.index for d in got) == [1, 2, 3, 4]
    assert await stream_messages(second, "PROMPT") == 0
    with pytest.raises(ValueError, match="work-queue stream with a durable consumer"):
        await second.reclaim("STEPS")


@pytest.mark.asyncio
async def test_nak_redelivers_and_closing_a_consumer_returns_unhanded_messages(bus: Bus) -> None:
    """nak() puts a message back at once; close() naks what was fetched but not handed out."""
    for i in range(3):
        await bus.publish(bus.subjects.prompt, prompt_task(i))
    async with bus.consume("PROMPT", batch=3) as consumer:
        d = await next_delivery(consumer)
        await d.nak()
    async with bus.consume("PROMPT", batch=1) as consumer:
        got = [await next_delivery(consumer) for _ in range(3)]
        for d in got:
            await d.ack()
    assert sorted(d.event.index for d in got) == [0, 1, 2]
    assert sorted(d.num_delivered for d in got) == [2, 2, 2]


@pytest.mark.asyncio
async def test_duplicate_publish_with_same_msg_id_is_stored_once(bus: Bus) -> None:
    """Re-publishing with a msg id seen within the duplicate window stores nothing."""
    task = prompt_task(3)
    first = await bus.publish(bus.subjects.prompt, task, msg_id="train:0:3:0")
    again = await bus.publish(bus.subjects.prompt, task, msg_id="train:0:3:0")
    assert first is not None and again is not None
    assert not first.duplicate and again.duplicate and again.seq == first.seq
    assert await stream_messages(bus, "PROMPT") == 1
    other = await bus.publish(bus.subjects.prompt, task, msg_id="train:0:3:1")
    assert other is not None and not other.duplicate
    assert await stream_messages(bus, "PROMPT") == 2


@pytest.mark.asyncio
async def test_malformed_payloads_are_dead_lettered_and_the_consumer_goes_on(
    bus: Bus, sample_events: dict[str, ev.Event]
) -> None:
    """1,000 bad payloads: the consumer survives, the next valid task arrives, all 1,000 are in
    deadletter with their reason and raw bytes, and the work queue is left empty."""
    good = msgpack.unpackb(ev.encode(prompt_task(0)))
    kinds: dict[str, Callable[[int], bytes]] = {
        "random": lambda i: os.urandom(16 + i % 200),
        "truncated": lambda i: ev.encode(prompt_task(i))[: 10 + i % 40],
        "unknown schema": lambda i: msgpack.packb({**good, "schema": "Bogus"}),
        "wrong version": lambda i: msgpack.packb({**good, "schema_version": 99}),
        "wrong type": lambda i: ev.encode(sample_events["RolloutGroup"]),
    }
    payloads = [make(i) for i in range(200) for make in kinds.values()]
    assert len(payloads) == 1000
    for data in payloads:
        await bus.js.publish(bus.subjects.prompt, data)
    valid = prompt_task(1000)
    await bus.publish(bus.subjects.prompt, valid)

    async with bus.consume("PROMPT", batch=128, fetch_timeout=0.5) as consumer:
        delivery = await next_delivery(consumer)
        await delivery.ack()
    assert delivery.event == valid
    assert bus.stats["deadletter"] == 1000 and bus.stats["deadletter_lost"] == 0

    letters = [ev.decode(raw, ev.DeadLetter) for raw in await read_stream(bus, "DEADLETTER", 1000)]
    assert Counter(letter.data for letter in letters) == Counter(payloads)
    assert all(letter.subject == bus.subjects.prompt and letter.worker_id == "test-bus" for letter in letters)
    reasons = Counter(letter.reason for letter in letters)
    assert reasons["unknown schema 'Bogus'"] == 200
    assert reasons["unsupported schema_version 99 of PromptTask (this reader knows 1..1)"] == 200
    assert reasons["wrong schema: expected PromptTask, got RolloutGroup"] == 200
    assert sum(n for r, n in reasons.items() if r.startswith("undecodable msgpack")) >= 200
    assert all(letter.reason for letter in letters)
    await bus.flush()

    async def queue_empty() -> bool:
        return await stream_messages(bus, "PROMPT") == 0

    await wait_until(queue_empty)


@pytest.mark.asyncio
async def test_a_dead_letter_too_large_to_copy_is_truncated_with_a_note(bus: Bus) -> None:
    """Raw bytes near max_payload still leave a dead letter: truncated, saying so."""
    size = bus.nc.max_payload - PAYLOAD_MARGIN - 16
    await bus.js.publish(bus.subjects.rollout_generated, b"\x01" * size)
    await bus.publish(bus.subjects.rollout_generated, rollout_of_size(16))
    async with bus.consume("GENERATED") as consumer:
        delivery = await next_delivery(consumer)
        await delivery.ack()
    [raw] = await read_stream(bus, "DEADLETTER", 1)
    letter = ev.decode(raw, ev.DeadLetter)
    assert f"(data truncated from {size} to {len(letter.data)} bytes)" in letter.reason
    assert 0 < len(letter.data) < size and letter.data == b"\x01" * len(letter.data)


@pytest.mark.asyncio
async def test_core_subscription_dead_letters_bad_payloads_and_goes_on(
    bus: Bus, sample_events: dict[str, ev.Event]
) -> None:
    """A malformed heartbeat is dead-lettered; the subscriber still gets the next good one."""
    subject = bus.subjects.heartbeat("generation", "gen-0")
    async with bus.subscribe(bus.subjects.heartbeat_all) as sub:
        await bus.nc.publish(subject, b"\xc1 not msgpack")
        await bus.nc.publish(subject, ev.encode(sample_events["RunEnded"]))
        await bus.publish(subject, sample_events["Heartbeat"])
        with anyio.fail_after(5):
            got = await anext(sub)
    assert got == sample_events["Heartbeat"]
    assert bus.stats["deadletter"] == 2
    letters = [ev.decode(raw, ev.DeadLetter) for raw in await read_stream(bus, "DEADLETTER", 2)]
    assert {letter.subject for letter in letters} == {subject}
    assert any("expected Heartbeat, got RunEnded" in letter.reason for letter in letters)


@pytest.mark.asyncio
async def test_a_poison_delivery_is_dead_lettered_with_its_reason_and_never_redelivered(bus: Bus) -> None:
    """Delivery.dead_letter copies the raw message (subject, data, headers) to deadletter with the
    reason and acks it, so it leaves the work queue; Bus.dead_letter copies any bytes the same
    way and never raises, also when the deadletter stream is gone (the copy is counted lost)."""
    task = prompt_task(5)
    await bus.publish(bus.subjects.prompt, task, msg_id="train:0:5:0")
    async with bus.consume("PROMPT", batch=1) as consumer:
        delivery = await next_delivery(consumer)
        await delivery.dead_letter("ZeroDivisionError: division by zero")
    [raw] = await read_stream(bus, "DEADLETTER", 1)
    letter = ev.decode(raw, ev.DeadLetter)
    assert (letter.subject, letter.reason) == (bus.subjects.prompt, "ZeroDivisionError: division by zero")
    assert letter.data == ev.encode(task) and letter.worker_id == "test-bus"
    assert letter.headers["Nats-Msg-Id"] == "train:0:5:0" and letter.headers["Areal-Event"] == "PromptTask"

    prompt = bus.subjects.stream("PROMPT")

    async def settled() -> bool:
        info = await bus.js.consumer_info(prompt.name, "generation")
        drained = info.num_ack_pending == 0 and info.num_pending == 0
        return drained and await stream_messages(bus, "PROMPT") == 0

    await wait_until(settled)  # acked and removed: nothing left to redeliver

    await bus.dead_letter(bus.subjects.rollout_generated, "reward fn raised", b"\x00raw", {"k": "v"})
    letter = ev.decode((await read_stream(bus, "DEADLETTER", 2))[1], ev.DeadLetter)
    assert (letter.subject, letter.reason) == (bus.subjects.rollout_generated, "reward fn raised")
    assert letter.data == b"\x00raw" and letter.headers == {"k": "v"}

    await bus.js.delete_stream(bus.subjects.stream("DEADLETTER").name)
    await bus.dead_letter(bus.subjects.prompt, "lost", b"x")
    assert bus.stats["deadletter"] == 3 and bus.stats["deadletter_lost"] == 1


@pytest.mark.asyncio
async def test_oversized_payload_is_refused_before_sending(bus: Bus) -> None:
    """Too big for max_payload (headers included) or the stream's max_msg_size: PayloadTooLarge
    naming the subject, the sizes and the setting to change; nothing reaches the server."""
    subject = bus.subjects.rollout_generated
    with pytest.raises(PayloadTooLarge) as info:
        await bus.publish(subject, rollout_of_size(int(3.1 * 2**20)))
    message = str(info.value)
    assert message.startswith(f"{subject}: 3.1 MB exceeds max_payload 1 MB;")
    assert "raise bus.max_payload or lower max_new_tokens" in message

    # Fits alone under max_payload, but not with headers: nats-py would send it and the server
    # would cut the connection.
    event = rollout_of_size(bus.nc.max_payload - 200)
    assert len(ev.encode(event)) < bus.nc.max_payload
    with pytest.raises(PayloadTooLarge, match="exceeds max_payload"):
        await bus.publish(subject, event, msg_id="x" * 64)

    await bus.provision(max_msg_bytes=64 * 1024)
    with pytest.raises(PayloadTooLarge) as info:
        await bus.publish(subject, rollout_of_size(100 * 1024))
    assert f"exceeds max_msg_size 64 KB of stream AREAL_{bus.run}_GENERATED; raise bus.max_msg_bytes" in str(
        info.value
    )

    assert bus.nc.is_connected and bus.stats["published"] == 0
    assert await stream_messages(bus, "GENERATED") == 0
    assert await bus.publish(subject, rollout_of_size(1024)) is not None


@pytest.mark.asyncio
async def test_a_full_work_queue_refuses_new_work_instead_of_dropping_old(bus: Bus) -> None:
    """DiscardPolicy.NEW: at its limit a stream raises StreamFull (back off) and keeps what it has."""
    await bus.provision(max_stream_bytes=4096)
    stored = 0
    with pytest.raises(StreamFull, match="back off and retry"):
        for i in range(1000):
            await bus.publish(bus.subjects.prompt, prompt_task(i))
            stored += 1
    assert 0 < stored < 1000
    assert await stream_messages(bus, "PROMPT") == stored
    async with bus.consume("PROMPT", batch=1) as consumer:
        first = await next_delivery(consumer)
    assert first.event.index == 0


@pytest.mark.asyncio
async def test_publish_checks_the_subject_and_the_event_type(
    bus: Bus, sample_events: dict[str, ev.Event]
) -> None:
    """A subject carries one event type, and only subjects of the bus's run are accepted."""
    with pytest.raises(TypeError, match="carries PromptTask events, got RolloutGroup"):
        await bus.publish(bus.subjects.prompt, sample_events["RolloutGroup"])
    with pytest.raises(ValueError, match="not under areal"):
        await bus.publish("areal.other.prompt", sample_events["PromptTask"])


@pytest.mark.asyncio
async def test_connect_to_a_dead_port_fails_fast_with_a_clear_error(dead_url: str) -> None:
    """No server there: BusConnectError within connect_timeout_s (+1 s), naming the URL and the fix."""
    t0 = time.monotonic()
    with pytest.raises(BusConnectError) as info:
        await connect(ConnectOptions(url=dead_url, connect_timeout_s=1.0), "r1")
    assert time.monotonic() - t0 < 2.0
    assert dead_url in str(info.value) and "nats-server is running" in str(info.value)


@pytest.mark.asyncio
async def test_wrong_credentials_fail_at_once(server_factory: Callable[..., EmbeddedServer]) -> None:
    """Credentials do not improve with retries: refused at once, pointing at bus.token."""
    server = server_factory(token="s3cret")
    t0 = time.monotonic()
    with pytest.raises(BusConnectError, match=r"Authorization Violation.*check bus\.token"):
        await connect(ConnectOptions(url=server.url, token="wrong", connect_timeout_s=5.0), "r1")
    assert time.monotonic() - t0 < 2.0
    ok = await connect(ConnectOptions(url=server.url, token="s3cret"), "r1")
    await ok.close()


def make_tls_files(directory: Path) -> dict[str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl CLI)."""
    files = {
        name: str(directory / name) for name in ("ca.pem", "ca.key", "server.pem", "server.key", "server.csr")
    }
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for args in (
        ["req", "-x509", *ec, "-keyout", files["ca.key"], "-out", files["ca.pem"], "-days", "1", "-subj", "/CN=areal-test-ca"],
        ["req", *ec, "-keyout", files["server.key"], "-out", files["server.csr"], "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", files["server.csr"], "-CA", files["ca.pem"], "-CAkey", files["ca.key"],
         "-CAcreateserial", "-out", files["server.pem"], "-days", "1", "-extfile", str(directory / "san.ext")],
    ):  # fmt: skip
        subprocess.run(["openssl", *args], check=True, capture_output=True)
    return files


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make certificates")
@pytest.mark.asyncio
async def test_tls_connects_with_the_ca_and_fails_clearly_without(
    server_factory: Callable[..., EmbeddedServer], tmp_path: Path
) -> None:
    """A TLS server is reachable with ConnectOptions.tls_ca; without it the error names the URL."""
    files = make_tls_files(tmp_path)
    server = server_factory(
        extra_args=["--tls", "--tlscert", files["server.pem"], "--tlskey", files["server.key"]]
    )
    bus = await connect(ConnectOptions(url=server.url, tls_ca=files["ca.pem"]), "r1")
    await bus.provision()
    assert await bus.publish(bus.subjects.prompt, prompt_task()) is not None
    await bus.close()
    assert str(server.url).startswith("tls://")
    t0 = time.monotonic()
    with pytest.raises(BusConnectError, match=f"{server.url}.*CERTIFICATE_VERIFY_FAILED.*set bus.tls_ca"):
        # the system CAs do not trust it
        await connect(ConnectOptions(url=server.url, connect_timeout_s=5.0), "r1")
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(ValueError, match="tls_ca: no such file"):
        await connect(ConnectOptions(url=server.url, tls_ca=str(tmp_path / "missing.pem")), "r1")


@pytest.mark.asyncio
async def test_provision_is_idempotent_and_concurrent(bus_factory: BusFactory) -> None:
    """Every worker may provision at once; a second call changes nothing, a changed setting updates."""
    workers = [await bus_factory(name=f"w{i}") for i in range(3)]
    await asyncio.gather(*(w.provision() for w in workers * 2))
    bus = workers[0]
    await bus.provision()
    names = {info.config.name for info in await bus.js.streams_info()}
    expected = {spec.name for spec in bus.subjects.streams}
    assert expected <= names
    assert {f"KV_{bus.subjects.state_bucket}", f"KV_{bus.subjects.workers_bucket}"} <= names
    for spec in bus.subjects.streams:
        consumers = [c.name for c in await bus.js.consumers_info(spec.name)]
        assert consumers == ([spec.consumer] if spec.consumer else [])

    await bus.provision(ack_wait={"SCORED": 300.0}, max_ack_pending=4096, heartbeat_ttl=30.0)
    scored = await bus.js.consumer_info(bus.subjects.stream("SCORED").name, "trainer")
    prompt = await bus.js.consumer_info(bus.subjects.stream("PROMPT").name, "generation")
    assert (scored.config.ack_wait, scored.config.max_ack_pending) == (300.0, 4096)
    assert (prompt.config.ack_wait, prompt.config.max_ack_pending) == (60.0, 4096)
    workers_kv = await bus.js.stream_info(f"KV_{bus.subjects.workers_bucket}")
    assert workers_kv.config.max_age == 30.0


@pytest.mark.asyncio
async def test_an_unprovisioned_run_says_to_provision(bus_factory: BusFactory) -> None:
    """Publishing, consuming or reading KV before provision() names the missing piece and the fix."""
    bus = await bus_factory(name="early")
    with pytest.raises(StreamNotFound, match=r"call bus.provision\(\)"):
        await bus.publish(bus.subjects.prompt, prompt_task())
    with pytest.raises(StreamNotFound, match="consumer 'reward'"):
        await bus.consume("GENERATED").start()
    with pytest.raises(StreamNotFound, match="KV bucket"):
        await bus.kv_get("state", "policy_version")


@pytest.mark.asyncio
async def test_a_stream_deleted_under_a_publisher_is_reported_as_missing_not_waited_for(bus: Bus) -> None:
    """A publish (with a msg id, so it would retry a leaderless stream) to a stream that is gone
    asks JetStream, learns that it does not exist, and raises StreamNotFound at once instead of
    waiting leader_wait_s for an election that will never come."""
    await bus.publish(bus.subjects.prompt, prompt_task(1), msg_id="t1")
    await bus.js.delete_stream(bus.subjects.stream("PROMPT").name)
    with anyio.fail_after(bus.options.leader_wait_s / 2):
        with pytest.raises(StreamNotFound, match=r"call bus.provision\(\)"):
            await bus.publish(bus.subjects.prompt, prompt_task(2), msg_id="t2")


@pytest.mark.asyncio
async def test_publish_and_consumer_start_wait_for_the_stream_and_store_once(
    server_factory: Callable[..., EmbeddedServer],
) -> None:
    """While JetStream cannot answer (here: its only server is down) a publish with a msg id
    and a consumer's start are retried: past leader_wait_s the publish raises
    StreamUnavailable naming the stream; within it, both complete once the server is back,
    every message is stored at most once, and the consumer delivers."""
    server = server_factory()
    port = int(str(server.url).rsplit(":", 1)[1])
    options = ConnectOptions(url=server.url, name="patient", reconnect_wait_max_s=0.2, request_timeout_s=0.5)
    bus = await connect(options, "r1")
    try:
        await bus.provision()
        server.stop()

        async def disconnected() -> bool:
            return not bus.nc.is_connected

        await wait_until(disconnected)
        with pytest.raises(StreamUnavailable, match="AREAL_r1_PROMPT"):
            await bus.publish(bus.subjects.prompt, prompt_task(1), msg_id="t1", leader_wait_s=1.0)

        async def restart() -> None:
            await anyio.sleep(0.5)
            server_factory(store_dir=server.store_dir, port=port)

        waited: dict[str, object] = {}

        async def publish() -> None:
            waited["published"] = await bus.publish(bus.subjects.prompt, prompt_task(2), msg_id="t2")

        async def start_consumer() -> None:
            waited["consumer"] = await bus.consume("PROMPT", batch=1, fetch_timeout=0.5).start()

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for job in (publish, start_consumer, restart):
                    tg.start_soon(job)
        assert waited["published"] is not None and bus.stats["publish_retries"] > 0
        consumer = waited["consumer"]
        assert isinstance(consumer, Consumer)
        assert (await next_delivery(consumer)).event.index in (1, 2)
        name = bus.subjects.stream("PROMPT").name
        state = (await bus.js.stream_info(name)).state
        stored: Counter[int] = Counter()
        for seq in range(state.first_seq, state.last_seq + 1):
            stored[msgpack.unpackb((await bus.js.get_msg(name, seq)).data)["index"]] += 1
        # t1 may be stored too: nats-py sends what it buffered while disconnected on reconnect
        assert stored[2] == 1 and stored[1] <= 1 and set(stored) <= {1, 2}, stored
    finally:
        await bus.close()


@pytest.mark.asyncio
async def test_kv_get_put_create_update_and_watch(bus: Bus) -> None:
    """KV: absent keys read as None, create refuses an existing key, update is compare-and-set,
    a watcher sees the current value and then changes."""
    assert await bus.kv_get("state", "weights_served") is None
    rev = await bus.kv_create("state", "weights_served", b"0")
    with pytest.raises(KvConflict, match="already exists"):
        await bus.kv_create("state", "weights_served", b"1")
    async with bus.kv_watch("state", "weights_served") as watch:
        with anyio.fail_after(5):
            first = await anext(watch)
        assert (first.value, first.revision) == (b"0", rev)
        rev2 = await bus.kv_update("state", "weights_served", b"1", last=rev)
        with pytest.raises(KvConflict, match=f"changed since revision {rev}"):
            await bus.kv_update("state", "weights_served", b"2", last=rev)
        with anyio.fail_after(5):
            second = await anext(watch)
        assert (second.value, second.revision, second.operation) == (b"1", rev2, "PUT")
        await bus.kv_delete("state", "weights_served")
        with anyio.fail_after(5):
            gone = await anext(watch)
        assert gone.value is None and gone.operation == "DEL"
    assert await bus.kv_get("state", "weights_served") is None


@pytest.mark.asyncio
async def test_kv_keys_lists_live_keys_only(bus: Bus) -> None:
    """kv_keys shows what is set now: empty at first, without deleted keys later."""
    assert await bus.kv_keys("workers") == []
    for key in ("reward.w2", "generation.w1", "trainer.w0"):
        await bus.kv_put("workers", key, b"alive")
    await bus.kv_delete("workers", "trainer.w0")
    assert await bus.kv_keys("workers") == ["generation.w1", "reward.w2"]


@pytest.mark.asyncio
async def test_worker_keys_expire_after_the_heartbeat_ttl(bus: Bus) -> None:
    """A worker that stops refreshing its key disappears from the workers bucket."""
    await bus.provision(heartbeat_ttl=1.0)
    await bus.kv_put("workers", "generation.gen-0", b"alive")
    assert (await bus.kv_get("workers", "generation.gen-0")) is not None

    async def expired() -> bool:
        return await bus.kv_get("workers", "generation.gen-0") is None

    await wait_until(expired)


@pytest.mark.asyncio
async def test_a_restarted_server_pauses_then_resumes_the_bus(
    server_factory: Callable[..., EmbeddedServer], tmp_path: object
) -> None:
    """Losing NATS pauses a worker; when the server comes back the same Bus publishes and
    consumes again, and stored work survives the restart."""
    server = server_factory()
    port = int(str(server.url).rsplit(":", 1)[1])
    bus = await connect(ConnectOptions(url=server.url, name="resilient", reconnect_wait_max_s=0.5), "r1")
    try:
        await bus.provision()
        await bus.publish(bus.subjects.prompt, prompt_task(1))
        server.stop()

        async def disconnected() -> bool:
            return not bus.nc.is_connected

        async def connected() -> bool:
            return bus.nc.is_connected

        await wait_until(disconnected)
        server_factory(store_dir=server.store_dir, port=port)
        await wait_until(connected)
        await bus.publish(bus.subjects.prompt, prompt_task(2))
        async with bus.consume("PROMPT", batch=2, fetch_timeout=0.5) as consumer:
            got = [await next_delivery(consumer) for _ in range(2)]
            for d in got:
                await d.ack()
        assert sorted(d.event.index for d in got) == [1, 2]
    finally:
        await bus.close()


@pytest.mark.asyncio
async def test_close_is_bounded_and_ends_open_iterators(bus_factory: BusFactory) -> None:
    """close() ends consumers, subscriptions and KV watches, also ones another task is
    waiting on, and returns promptly."""
    bus = await bus_factory(name="closer", provision=True)
    consumer = await bus.consume("PROMPT", fetch_timeout=0.2).start()
    sub = await bus.subscribe(bus.subjects.metrics).start()
    watch = await bus.kv_watch("state").start()
    ended: list[str] = []

    async def drain(name: str, iterator: AsyncIterator[object]) -> None:
        async for _ in iterator:
            pass
        ended.append(name)

    async with anyio.create_task_group() as tg:
        for name, iterator in (("consumer", consumer), ("subscription", sub), ("watch", watch)):
            tg.start_soon(drain, name, iterator)
        await anyio.sleep(0.1)
        t0 = time.monotonic()
        with anyio.fail_after(bus.options.drain_timeout_s + 1):
            await bus.close()
        assert time.monotonic() - t0 < bus.options.drain_timeout_s
    assert sorted(ended) == ["consumer", "subscription", "watch"]
    assert bus.nc.is_closed


@pytest.mark.asyncio
async def test_a_request_reaches_one_member_of_the_queue_group_and_gets_its_reply(bus_factory) -> None:
    """Two servers in one queue group: each request is answered once; no server means NoResponders."""
    from bus import NoResponders
    from bus.events import GenerateCall, GenerateReply

    client = await bus_factory("client")
    call = GenerateCall(call_id="c1", episode_id="e1", prompt_ids=ev.pack_i32([1, 2]), max_new_tokens=2)
    with pytest.raises(NoResponders, match="nobody serves"):
        await client.request(client.subjects.generate, call, timeout_s=2.0)
    answered: list[str] = []

    async def serve(name: str) -> None:
        server = await bus_factory(name)
        async with server.serve(server.subjects.generate, queue="generation") as requests:
            async for req in requests:
                answered.append(name)
                await req.respond(GenerateReply(call_id=req.event.call_id, engine_id=name))

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve, "s1")
        tg.start_soon(serve, "s2")
        await anyio.sleep(0.5)
        replies = [
            await client.request(
                client.subjects.generate,
                GenerateCall(call_id=f"c{i}", episode_id="e", prompt_ids=ev.pack_i32([1]), max_new_tokens=1),
                timeout_s=5.0,
            )
            for i in range(6)
        ]
        tg.cancel_scope.cancel()
    assert [r.call_id for r in replies] == [f"c{i}" for i in range(6)]
    assert len(answered) == 6 and all(r.engine_id in ("s1", "s2") for r in replies)
