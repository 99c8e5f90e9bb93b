"""The dashboard reads a run as its ``viewer`` user, whom the server keeps read-only.

A real nats-server with the embedded run's users (``run_credentials``, pinned to the run) and the
synthetic store of ``tests/helpers/dashboard_run.py``: as ``viewer`` every read of
``workers.dashboard.reader`` works, live and from the finished run's store, without one refusal;
every write is refused by the server.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from areal_async.run_file import load_config
from bus import Bus, BusError, BusPermissionError, ConnectOptions, EmbeddedServer, connect
from bus import events as ev
from bus.embedded import CREDENTIALS_FILE, run_credentials
from tests.helpers.dashboard_run import fill, synthetic_config
from workers.dashboard.reader import follow, load_stored
from workers.dashboard.view import RunView
from workers.inspect import Target, embedded_login, open_run

RUN = "viewed"
STEPS = 20


@pytest.fixture
def viewed_run(
    tmp_path: Path, server_factory: Callable[..., EmbeddedServer]
) -> tuple[Target, EmbeddedServer]:
    """The embedded server of a run, with the run's users, holding a synthetic run of STEPS steps."""
    config = synthetic_config(tmp_path, RUN)
    store = tmp_path / RUN / "nats"
    passwords = run_credentials(store)
    server = server_factory(store, users=passwords, run=RUN)
    assert server.url is not None
    anyio.run(functools.partial(fill, server.url, RUN, STEPS, password=passwords["ops"]), backend="asyncio")
    return Target(run=RUN, url=server.url, cfg=load_config(config, []), store=store), server


def _view(from_store: bool) -> RunView:
    return RunView(
        RUN,
        max_staleness=2,
        heartbeat_interval_s=2.0,
        heartbeat_ttl_s=60.0,
        source="store" if from_store else "live",
    )


def _as(server: EmbeddedServer, user: str) -> ConnectOptions:
    password = run_credentials(server.store_dir)[user]
    return ConnectOptions(
        url=str(server.url), name=f"test-{user}", user=user, password=password, connect_timeout_s=5
    )


def _denied(logs: Sequence[Mapping[str, Any]]) -> list[str]:
    return [repr(e) for e in logs if e.get("event") == "nats permission denied"]


async def _wait_for_denial(logs: Sequence[Mapping[str, Any]], subject: str) -> None:
    """The server's -ERR comes after the publish: poll the captured logs for it (nats-py lowers
    the case of the error text)."""
    with anyio.move_on_after(5):
        while not any(subject.lower() in d.lower() for d in _denied(logs)):  # noqa: ASYNC110
            await anyio.sleep(0.01)
    assert any(subject.lower() in d.lower() for d in _denied(logs)), (subject, _denied(logs))


def test_a_run_started_before_the_viewer_user_is_read_as_ops_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Credentials without ``viewer`` (a run of an older version) log the dashboard in as ``ops`` and
    say so on stderr; with ``viewer`` there is no warning."""
    store = tmp_path / "nats"
    passwords = run_credentials(store)
    target = Target(run=RUN, url=None, cfg=None, store=store)
    assert embedded_login(target, "viewer") == ("viewer", passwords["viewer"])
    assert capsys.readouterr().err == ""
    older = {user: pw for user, pw in passwords.items() if user != "viewer"}
    (store / CREDENTIALS_FILE).write_text(json.dumps(older))
    assert embedded_login(target, "viewer") == ("ops", passwords["ops"])
    assert "has no 'viewer' user" in capsys.readouterr().err


@pytest.mark.asyncio
async def test_as_viewer_the_dashboard_reads_a_live_run_and_its_store_without_a_refusal(
    viewed_run: tuple[Target, EmbeddedServer],
) -> None:
    """``open_run(user="viewer")`` logs in as viewer; load_stored and follow fill the view (steps,
    held-out accuracy, hand-offs, scored groups, refusals, dead letters, the fleet, the end of the
    run) and events published while it follows arrive; then, with the server stopped, the same from
    a temporary server on the store. The server refuses none of the viewer's requests."""
    target, server = viewed_run
    ops = await connect(_as(server, "ops"), RUN)
    with capture_logs() as logs:
        async with open_run(target, user="viewer", name="dashboard") as (bus, from_store):
            assert not from_store and bus.options.user == "viewer"
            view = _view(from_store)
            await load_stored(bus, view, None)
            assert len(view.steps["step"]) == 0 and view.evals == {0: 0.0} and STEPS in view.handoffs
            assert view.rollouts.total == 8 and view.letters.total == 1  # the groups, the refusal
            assert view.ended is not None and "trainer-synthetic" in view.workers
            async with anyio.create_task_group() as tg:
                await tg.start(follow, bus, view)
                step = ev.TrainerStep(step=STEPS + 1, policy_version=STEPS + 1, task_ids=["x"], head_versions=[STEPS],
                                      metrics={"reward_mean": 1.0})  # fmt: skip
                await ops.publish(ops.subjects.trainer_step, step, msg_id="step-live")
                beat = ev.Heartbeat(role="reward", worker_id="reward-live", host="h", pid=2, status="ok",
                                    sent_at=0.0)  # fmt: skip
                await ops.publish(ops.subjects.heartbeat("reward", "reward-live"), beat)
                with anyio.fail_after(5):
                    while len(view.steps["step"]) < STEPS + 1 or "reward-live" not in view.workers:  # noqa: ASYNC110
                        await anyio.sleep(0.02)
                assert view.letters.total == 2  # and the stored dead letter, through its ordered consumer
                tg.cancel_scope.cancel()
            assert bus.stats["permission_denied"] == 0
        await ops.close()
        await anyio.to_thread.run_sync(server.stop)
        stored = Target(run=RUN, url=None, cfg=target.cfg, store=target.store)
        async with open_run(stored, user="viewer", name="dashboard") as (bus, from_store):
            assert from_store and bus.options.user == "viewer"
            view = _view(from_store)
            await load_stored(bus, view, None)
            async with anyio.create_task_group() as tg:
                await tg.start(follow, bus, view)
                with anyio.fail_after(5):
                    while len(view.steps["step"]) < STEPS + 1:  # noqa: ASYNC110
                        await anyio.sleep(0.02)
                tg.cancel_scope.cancel()
            assert view.rollouts.total == 8 and bus.stats["permission_denied"] == 0
    assert _denied(logs) == []


@pytest.mark.asyncio
async def test_the_server_refuses_every_write_of_the_viewer(
    viewed_run: tuple[Target, EmbeddedServer],
) -> None:
    """As viewer: a publish to a run subject (a stream's and a core one), a KV put, a stream purge,
    a stream delete, a durable consumer's creation and an ack of the trainer's durable are each
    refused by the server (a permissions violation), and the one consumer creation it may ask for
    makes ephemerals only; nothing changes in the run."""
    _, server = viewed_run
    ops = await connect(_as(server, "ops"), RUN)
    viewer = await connect(_as(server, "viewer"), RUN)
    scored = ops.subjects.stream("SCORED").name
    steps = ops.subjects.stream("STEPS").name
    try:
        with capture_logs() as logs:
            step = ev.TrainerStep(step=99, policy_version=99, task_ids=["x"], head_versions=[98], metrics={})
            with pytest.raises(BusPermissionError):
                await viewer.publish(viewer.subjects.trainer_step, step, msg_id="forged")
            with pytest.raises(BusPermissionError):
                await viewer.kv_put("state", "run.ended", b"\x80")
            await viewer.publish(
                viewer.subjects.run_ended, ev.RunEnded(reason="forged", policy_version=0, steps=0)
            )
            await _wait_for_denial(logs, f"areal.{RUN}.run.ended")

            js = viewer.nc.jetstream(timeout=0.5)
            api_calls = [
                (f"$JS.API.STREAM.PURGE.{scored}", lambda: js.purge_stream(scored)),
                (f"$JS.API.STREAM.DELETE.{scored}", lambda: js.delete_stream(scored)),
                (f"$JS.API.CONSUMER.DURABLE.CREATE.{steps}.mine", lambda: js.add_consumer(steps, durable_name="mine")),
            ]  # fmt: skip
            for subject, call in api_calls:
                with pytest.raises((BusError, TimeoutError)):  # a raw API call: only the -ERR says why
                    await call()
                await _wait_for_denial(logs, subject)

            durable = {"stream_name": steps, "config": {"durable_name": "mine", "ack_policy": "explicit"}}
            answer = await viewer.nc.request(f"$JS.API.CONSUMER.CREATE.{steps}", json.dumps(durable).encode())
            assert "durable name" in json.loads(answer.data)["error"]["description"]  # ephemerals only

            trainer = await ops.js.pull_subscribe_bind("trainer", scored)
            [held] = await trainer.fetch(1, timeout=5)
            assert held.reply.startswith(f"$JS.ACK.{scored}.trainer.")
            await viewer.nc.publish(held.reply, b"+ACK")
            await _wait_for_denial(logs, held.reply)
            await trainer.unsubscribe()
        assert await _messages(ops, "SCORED") == 8 and await _messages(ops, "STEPS") == STEPS
        assert await ops.kv_get("state", "run.ended") is not None
        assert (await ops.js.consumer_info(scored, "trainer")).num_ack_pending == 1  # the ack never landed
        assert viewer.nc.is_connected
    finally:
        await viewer.close()
        await ops.close()


async def _messages(bus: Bus, key: str) -> int:
    return (await bus.js.stream_info(bus.subjects.stream(key).name)).state.messages
