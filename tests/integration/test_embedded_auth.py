"""The embedded server of ``areal-async run`` under per-run credentials (bus/embedded.py).

A real nats-server with the users and pinned permissions the launcher gives it: strangers are
refused, a role cannot do another role's job, the secrets are private files, and a server that
dies comes back on the same port with the same users and store.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from structlog.testing import capture_logs

from bus import (
    BusConnectError,
    BusPermissionError,
    ConnectOptions,
    EmbeddedServer,
    EmbeddedServerError,
    connect,
)
from bus import events as ev
from bus.embedded import CREDENTIALS_FILE, run_credentials
from workers.roles import ROLES

RUN = "authrun"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def login(
    server: EmbeddedServer, user: str | None, passwords: dict[str, str], **kwargs: object
) -> ConnectOptions:
    credentials = {"user": user, "password": passwords[user]} if user else {}
    return ConnectOptions(url=str(server.url), name=f"{user}-1", connect_timeout_s=5, **credentials, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def run_server(
    tmp_path: Path, server_factory: Callable[..., EmbeddedServer]
) -> tuple[EmbeddedServer, dict[str, str]]:
    """The server ``areal-async run`` starts: per-run users pinned to RUN, store under nats/."""
    store = tmp_path / "run" / "nats"
    passwords = run_credentials(store)
    return server_factory(store, users=passwords, run=RUN), passwords


def test_credentials_and_server_config_are_private_and_kept_for_a_resumed_run(tmp_path: Path) -> None:
    """credentials.json is created with mode 0600 even under umask 0 (never chmod-ed after),
    holds a password per role, for viewer and for ops, and a second call (a resumed run) returns the same
    passwords; the generated server config holding them is 0600 too."""
    store = tmp_path / "nats"
    old = os.umask(0)
    try:
        first = run_credentials(store)
    finally:
        os.umask(old)
    assert set(first) == {*ROLES, "viewer", "ops"}
    assert len(set(first.values())) == len(first) and all(len(p) >= 24 for p in first.values())
    assert mode(store / CREDENTIALS_FILE) == 0o600
    assert run_credentials(store) == first
    with EmbeddedServer(store, users=first, run=RUN):
        assert mode(store / "embedded.conf") == 0o600
        assert first["reward"] in (store / "embedded.conf").read_text()


@pytest.mark.asyncio
async def test_a_client_without_the_runs_credential_is_refused(
    run_server: tuple[EmbeddedServer, dict[str, str]],
) -> None:
    """No credentials, or a role's name with another role's password: BusConnectError at once,
    naming the authorization violation. The right password gets in."""
    server, passwords = run_server
    for options in (
        ConnectOptions(url=str(server.url), connect_timeout_s=5),
        ConnectOptions(
            url=str(server.url), user="reward", password=passwords["trainer"], connect_timeout_s=5
        ),
    ):
        with pytest.raises(BusConnectError, match="(?i)authorization violation"):
            await connect(options, RUN)
    bus = await connect(login(server, "reward", passwords), RUN)
    await bus.close()


@pytest.mark.asyncio
async def test_a_reward_worker_may_not_load_weights_write_issued_records_or_touch_another_run(
    run_server: tuple[EmbeddedServer, dict[str, str]], sample_events: dict[str, ev.Event]
) -> None:
    """Under its run's credential the reward user's weights.load is refused by the server (never
    delivered), writing an ``issued.<task_id>`` record raises BusPermissionError (the trainer's
    too), and its heartbeat under another run's name is refused (the users are pinned to their
    run); the controller may write the record, and the reward worker still scores."""
    server, passwords = run_server
    ops = await connect(login(server, "ops", passwords), RUN)
    reward = await connect(login(server, "reward", passwords, request_timeout_s=10.0), RUN)
    controller = await connect(login(server, "controller", passwords), RUN)
    trainer = await connect(login(server, "trainer", passwords), RUN)
    try:
        await ops.provision()
        load = next(e for e in sample_events.values() if isinstance(e, ev.WeightsLoad))
        async with ops.subscribe(ops.subjects.weights_load) as spy:
            await ops.flush()
            await reward.publish(reward.subjects.weights_load, load)
            with anyio.fail_after(5):
                while reward.stats["permission_denied"] < 1:  # noqa: ASYNC110 - the server's -ERR is async
                    await anyio.sleep(0.01)
            with anyio.move_on_after(0.3) as nothing:
                await anext(spy)
            assert nothing.cancelled_caught, "a refused weights.load was delivered"

        for bus in (reward, trainer):
            t0 = time.monotonic()
            with pytest.raises(BusPermissionError) as info:
                await bus.kv_put("state", "issued.e0-i1", b"\x80")
            assert time.monotonic() - t0 < 2
            assert info.value.subject == f"$KV.{bus.subjects.state_bucket}.issued.e0-i1"
        await controller.kv_put("state", "issued.e0-i1", b"\x80")
        assert (await ops.kv_get("state", "issued.e0-i1")) is not None

        beat = next(e for e in sample_events.values() if isinstance(e, ev.Heartbeat))
        denied = reward.stats["permission_denied"]
        await reward.publish(reward.subjects.heartbeat("reward", "w1"), beat)
        await reward.flush()
        assert reward.stats["permission_denied"] == denied  # its own run's heartbeat passes
        other = await connect(login(server, "reward", passwords), "otherrun")
        try:
            await other.publish(other.subjects.heartbeat("reward", "w1"), beat)
            with anyio.fail_after(5):
                while other.stats["permission_denied"] < 1:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
        finally:
            await other.close()
        scored = next(e for e in sample_events.values() if isinstance(e, ev.ScoredGroup))
        published = await reward.publish(reward.subjects.rollout_scored, scored, msg_id="s1")
        assert published is not None and reward.nc.is_connected
    finally:
        for bus in (trainer, controller, reward, ops):
            await bus.close()


@pytest.mark.asyncio
async def test_a_killed_server_restarts_on_its_port_with_its_users_and_store(
    run_server: tuple[EmbeddedServer, dict[str, str]], tmp_path: Path
) -> None:
    """SIGKILL, then restart(): the same URL, the stored stream survives, a connected client
    reconnects by itself, strangers are still refused; a second server on the same store is
    refused while the first holds it."""
    server, passwords = run_server
    url, pid = server.url, server.pid
    assert pid is not None
    bus = await connect(login(server, "ops", passwords, reconnect_wait_max_s=0.5), RUN)
    try:
        await bus.provision()
        await bus.publish(bus.subjects.trainer_step, ev.TrainerStep(step=1, policy_version=1, task_ids=["a"],
                                                                    head_versions=[0], metrics={}))  # fmt: skip
        with pytest.raises(EmbeddedServerError, match="in use"):
            EmbeddedServer(server.store_dir, start_timeout=5).start()
        os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(5):
            while server.running:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert server.returncode == -signal.SIGKILL
        await anyio.to_thread.run_sync(server.restart)
        assert server.url == url and server.pid != pid
        with anyio.fail_after(15):
            while not bus.nc.is_connected:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        info = await bus.js.stream_info(bus.subjects.stream("STEPS").name)
        assert info.state.messages == 1
        with pytest.raises(BusConnectError, match="(?i)authorization violation"):
            await connect(ConnectOptions(url=str(url), connect_timeout_s=5), RUN)
    finally:
        await bus.close()


@pytest.mark.asyncio
async def test_inspect_logs_in_to_a_running_embedded_run_as_its_ops_user(
    tmp_path: Path, server_factory: Callable[..., EmbeddedServer], capsys: pytest.CaptureFixture[str]
) -> None:
    """``inspect --config RUN.yaml`` on an embedded run reads nats.url and the ops password from
    credentials.json (a user or token in the run file does not matter) and reports the live run."""
    from workers.cli import main_parser
    from workers.inspect import _inspect

    run_dir = tmp_path / "run"
    passwords = run_credentials(run_dir / "nats")
    server = server_factory(run_dir / "nats", users=passwords, run=RUN)
    (run_dir / "nats.url").write_text(f"{server.url}\n")
    ops = await connect(login(server, "ops", passwords), RUN)
    try:
        await ops.provision()
    finally:
        await ops.close()
    config = tmp_path / "run.yaml"
    config.write_text(f"name: {RUN}\ndir: {run_dir}\nbus:\n  url: embedded\n  user: reward\n  token: nope\n")
    capsys.readouterr()
    with capture_logs():
        assert await _inspect(main_parser().parse_args(["inspect", "--config", str(config), "--json"])) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert report["run"] == RUN and report["streams"]["PROMPT"]["consumer"] == "generation"
    assert "reading its store" not in out.err


@pytest.mark.asyncio
async def test_an_agent_calls_a_generation_worker_which_may_only_answer_requests(
    run_server: tuple[EmbeddedServer, dict[str, str]],
) -> None:
    """The agent user's ``generate`` request reaches the generation user, whose reply to the
    requester's inbox passes (allow_responses); a publish of the generation user to an inbox
    that asked it nothing is refused."""
    server, passwords = run_server
    agent = await connect(login(server, "agent", passwords), RUN)
    generation = await connect(login(server, "generation", passwords), RUN)
    try:
        async with (
            anyio.create_task_group() as tg,
            generation.serve(generation.subjects.generate, queue="generation") as calls,
        ):

            async def answer() -> None:
                async for call in calls:
                    await call.respond(ev.GenerateReply(call_id=call.event.call_id, engine_id="gen-0"))
                    return

            tg.start_soon(answer)
            await generation.flush()
            call = ev.GenerateCall(
                call_id="c1", episode_id="e1", prompt_ids=ev.pack_i32([1]), max_new_tokens=2
            )
            reply = await agent.request(agent.subjects.generate, call, timeout_s=5)
        assert isinstance(reply, ev.GenerateReply) and reply.call_id == "c1"
        await generation.nc.publish("_INBOX.forged", b"x")
        with anyio.fail_after(5):
            while generation.stats["permission_denied"] < 1:  # noqa: ASYNC110
                await anyio.sleep(0.01)
    finally:
        await generation.close()
        await agent.close()
