"""Benchmark the bus on loopback: publish->consume latency and throughput.

Starts an embedded nats-server in a temp dir (or uses --url), opens one publisher and one
consumer connection in this process, and measures, for 1 KB and 256 KB RolloutGroup events:

* latency: one event in flight at a time; time from just before ``bus.publish`` to the
  consumer holding the decoded event (p50 / p99 over --samples);
* throughput: --count events published as fast as possible (JetStream: --concurrency
  publishers awaiting their acks), until the consumer has them all (msg/s, MB/s).

Transports: core NATS (``bus.subscribe``) and JetStream (work-queue stream, durable pull
consumer, ``bus.consume`` + ack). Numbers include msgpack encode/decode and validation.

    python -m benchmarks.bench_bus [--out bench.json] [--samples 500] [--count 5000]
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass

import anyio
import numpy as np
import structlog

from benchmarks import harness
from bus import Bus, ConnectOptions, EmbeddedServer, connect
from bus import events as ev

METRICS: dict[str, harness.Direction] = {"latency_p50_ms": "lower", "throughput_msgs_per_s": "higher"}
"""What report --check compares (rows: one per transport and event size); p99 is too noisy to."""


@dataclass
class Result:
    transport: str
    size_bytes: int
    latency_p50_ms: float
    latency_p99_ms: float
    latency_samples: int
    throughput_msgs_per_s: float
    throughput_mb_per_s: float
    throughput_sent: int
    throughput_received: int


def make_event(size: int, seq: int = 0) -> ev.RolloutGroup:
    """A RolloutGroup whose encoded size is about ``size`` bytes."""
    base = ev.RolloutGroup(
        task_id=f"bench:{seq}", kind="train", index=seq, epoch=0, attempt=0, row={}, engine_id="bench",
        prompt_ids=b"", completions=[], head_version=0, tail_version=0, timings={"sent": 0.0},
    )  # fmt: skip
    pad = max(0, size - len(ev.encode(base))) // 4
    return ev.RolloutGroup(
        task_id=base.task_id, kind="train", index=seq, epoch=0, attempt=0, row={}, engine_id="bench",
        prompt_ids=ev.pack_i32(np.arange(pad, dtype=np.int32)), completions=[], head_version=0,
        tail_version=0, timings={"sent": time.perf_counter()},
    )  # fmt: skip


class Stamped:
    """Re-stamps a prepared event with the send time without re-packing the arrays."""

    def __init__(self, size: int) -> None:
        self.template = make_event(size)

    def __call__(self, seq: int) -> ev.RolloutGroup:
        t = self.template
        return ev.RolloutGroup(
            task_id=f"bench:{seq}", kind="train", index=seq, epoch=0, attempt=0, row={}, engine_id="bench",
            prompt_ids=t.prompt_ids, completions=[], head_version=0, tail_version=0,
            timings={"sent": time.perf_counter()},
        )  # fmt: skip


async def bench_one(
    pub: Bus, sub: Bus, transport: str, size: int, samples: int, count: int, concurrency: int
) -> Result:
    stamped = Stamped(size)
    size_bytes = len(ev.encode(stamped(0)))
    js = transport == "jetstream"
    subject = pub.subjects.rollout_generated if js else pub.subjects.prefix + "bench"
    latencies: list[float] = []
    received = 0
    arrived = anyio.Event()
    done = anyio.Event()
    target = 0
    last_at = 0.0

    async def on_event(event: ev.RolloutGroup) -> None:
        nonlocal received, last_at
        now = time.perf_counter()
        received += 1
        last_at = now
        if target == 0:
            latencies.append(now - event.timings["sent"])
            arrived.set()
        elif received >= target:
            done.set()

    async def consume_loop() -> None:
        if js:
            async with sub.consume("GENERATED", batch=256, fetch_timeout=0.5) as deliveries:
                async for d in deliveries:
                    await d.ack()
                    await on_event(d.event)
        else:
            async with sub.subscribe(subject, pending_bytes_limit=512 * 2**20) as subscription:
                started.set()
                async for event in subscription:
                    await on_event(event)

    started = anyio.Event()
    if js:
        started.set()
    async with anyio.create_task_group() as tg:
        tg.start_soon(consume_loop)
        await started.wait()
        await sub.flush()
        # latency: one in flight; the first few warm the path and are dropped
        warmup = 20
        for i in range(samples + warmup):
            arrived = anyio.Event()
            await pub.publish(subject, stamped(i))
            with anyio.fail_after(10):
                await arrived.wait()
        del latencies[:warmup]

        # throughput
        received, target = 0, count
        t0 = time.perf_counter()
        if js:
            per_task = count // concurrency
            target = per_task * concurrency

            async def publisher(k: int) -> None:
                for i in range(per_task):
                    await pub.publish(subject, stamped(k * per_task + i))

            async with anyio.create_task_group() as pubs:
                for k in range(concurrency):
                    pubs.start_soon(publisher, k)
        else:
            for i in range(count):
                await pub.publish(subject, stamped(i))
            await pub.flush()
        with anyio.move_on_after(30):
            while not done.is_set():
                before = received
                with anyio.move_on_after(2.0):  # core NATS may drop under overload: stop when idle
                    await done.wait()
                if received == before:
                    break
        elapsed = max(last_at - t0, 1e-9)
        tg.cancel_scope.cancel()
    lat_ms = np.array(latencies) * 1e3
    return Result(
        transport=transport,
        size_bytes=size_bytes,
        latency_p50_ms=round(float(np.percentile(lat_ms, 50)), 3),
        latency_p99_ms=round(float(np.percentile(lat_ms, 99)), 3),
        latency_samples=len(latencies),
        throughput_msgs_per_s=round(received / elapsed, 1),
        throughput_mb_per_s=round(received * size_bytes / elapsed / 2**20, 1),
        throughput_sent=target,
        throughput_received=received,
    )


async def main(args: argparse.Namespace) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="bench-bus-") as tmp:
        server = None if args.url else EmbeddedServer(tmp).start()
        url = args.url or server.url  # type: ignore[union-attr]
        try:
            run = f"bench{os.getpid()}"
            pub = await connect(ConnectOptions(url=url, name="bench-pub"), run)
            sub = await connect(ConnectOptions(url=url, name="bench-sub"), run)
            await pub.provision(max_ack_pending=4096)
            results = []
            for transport in ("core", "jetstream"):
                for size in (1024, 256 * 1024):
                    count = args.count if size <= 1024 else max(100, args.count // 25)
                    results.append(
                        await bench_one(pub, sub, transport, size, args.samples, count, args.concurrency)
                    )
            for spec in pub.subjects.streams:
                await pub.js.delete_stream(spec.name)
            for bucket in (pub.subjects.state_bucket, pub.subjects.workers_bucket):
                await pub.js.delete_key_value(bucket)
            await pub.close()
            await sub.close()
        finally:
            if server is not None:
                server.stop()
    return results


def print_table(results: list[Result]) -> None:
    head = f"{'transport':<10} {'event':>9} {'p50 ms':>8} {'p99 ms':>8} {'msg/s':>10} {'MB/s':>8} {'recv/sent':>12}"
    print(head)
    print("-" * len(head))
    for r in results:
        size = f"{r.size_bytes / 1024:.0f} KB"
        print(
            f"{r.transport:<10} {size:>9} {r.latency_p50_ms:>8.3f} {r.latency_p99_ms:>8.3f} "
            f"{r.throughput_msgs_per_s:>10.0f} {r.throughput_mb_per_s:>8.1f} "
            f"{r.throughput_received:>5}/{r.throughput_sent:<6}"
        )


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="benchmark an existing server instead of an embedded one")
    parser.add_argument("--samples", type=int, default=500, help="latency samples per case")
    parser.add_argument(
        "--count", type=int, default=5000, help="events per 1 KB throughput case (256 KB: /25)"
    )
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent JetStream publishers")
    harness.add_output_args(parser)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    results = anyio.run(main, args, backend="asyncio")
    print_table(results)
    rows = [{"case": f"{r.transport} {round(r.size_bytes / 1024)} KB", **asdict(r)} for r in results]
    note = "Loopback, one process; on a shared machine p99 and throughput move by 2-4x between runs."
    harness.emit(harness.make_result("bus", args, rows, METRICS, note=note), args.out, args.save_baseline)


if __name__ == "__main__":
    cli()
