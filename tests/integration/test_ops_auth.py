"""Authentication and per-role permissions of the shipped NATS configs (scripts/nats/).

Every test runs a real nats-server on the shipped files (only paths and addresses are
rewritten) and connects through ``bus.connect`` exactly as a worker does:

* the configs parse (``nats-server -t``), and a missing secret is named;
* user/password, nkey seed files, token, mutual TLS and ``.creds`` (a JWT chain minted here
  with ``nkeys``, as ``nsc`` would) admit the right client and refuse others with a
  ``BusConnectError`` naming the URL and the cause;
* each role can do its whole job under ``permissions.conf``, and a publish outside a role's
  permissions is refused by the server, logged and counted by the bus (``nats permission
  denied`` naming the subject), raises ``BusPermissionError`` at once for a JetStream
  publish or KV write, and leaves the connection working; a worker refused that way exits 2;
* ``areal-async inspect --config`` connects with the run's credentials.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from bus import Bus, BusConnectError, BusError, BusPermissionError, ConnectOptions, EmbeddedServer, connect
from bus import events as ev
from bus.events import expected_type
from tests.helpers.ops_helpers import (
    REPO,
    ROLES,
    check_config,
    copy_nats_configs,
    make_operator,
    make_tls,
    nkey_env,
    password_env,
    role_nkeys,
    role_passwords,
    write_main_config,
)

RUN = "ops1"
"""Run name for tests on their own server; tests on the shared ``users_server`` use ``run_name``."""

# What each role does on the bus, read from workers/*.py: the subjects it publishes (Subjects
# attribute names), the streams whose durable it consumes, and its keys in the state bucket.
# Every role also heartbeats (core + workers bucket), provisions, and may dead-letter.
ROLE_WORK: dict[str, dict[str, Sequence[str]]] = {
    "controller": {"publish": ("prompt", "metrics", "run_ended"), "consume": ("STEPS", "FAILED", "EVAL"),
                   "state": ("controller", "run.ended", "issued.e0-i1")},
    "generation": {"publish": ("rollout_generated", "weights_loaded"), "consume": ("PROMPT",), "state": ()},
    "reward": {"publish": ("rollout_scored", "eval_scored"), "consume": ("GENERATED",), "state": ()},
    "trainer": {"publish": ("trainer_step", "rollout_failed", "weights_published", "metrics"),
                "consume": ("SCORED",), "state": ("weights.published",)},
    "weight-sync": {"publish": ("weights_load", "weights_served"), "consume": (), "state": ("weights.served",)},
    "agent": {"publish": ("generate", "rollout_scored", "eval_scored", "rollout_failed"), "consume": ("PROMPT",),
              "state": ()},
}  # fmt: skip

# The REWARD permissions of permissions.conf in JWT form (`nsc add user --allow-pub ...`).
REWARD_JWT_PERMISSIONS: dict[str, object] = {
    "pub": {
        "allow": ["areal.*.rollout.scored", "areal.*.eval.scored", "areal.*.deadletter",
                  "areal.*.heartbeat.reward.>", "$JS.API.>", "$JS.FC.>", "$JS.ACK.*.reward.>", "$KV.*.reward.>"],
        "deny": ["areal.*.weights.>", "$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.PURGE.>"],
    },
    "sub": {"allow": ["_INBOX.>", "areal.>"]},
}  # fmt: skip


def names_server(error: BaseException, url: str) -> bool:
    """The error names the server's host:port (the scheme may read tls:// once TLS is on)."""
    return url.split("://", 1)[-1] in str(error)


def denials(logs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Log entries that report a permissions violation from the server (case-insensitive)."""
    return [repr(e) for e in logs if re.search(r"permission", repr(e), re.IGNORECASE)]


async def wait_for_denial(logs: Sequence[Mapping[str, Any]], subject: str) -> None:
    """The server's -ERR arrives asynchronously after a core publish: poll the captured logs."""
    with anyio.fail_after(5):
        while not any(subject.lower() in d.lower() for d in denials(logs)):  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def stream_messages(bus: Bus, key: str) -> int:
    return (await bus.js.stream_info(bus.subjects.stream(key).name)).state.messages


def sample(sample_events: Mapping[str, ev.Event], subject: str) -> ev.Event:
    """The sample event of the type ``subject`` carries."""
    wanted = expected_type(subject)
    assert wanted is not None, subject
    return next(e for e in sample_events.values() if isinstance(e, wanted))


async def round_trip(
    producer: Bus, reader: Bus, sample_events: Mapping[str, ev.Event], subject_attr: str, stream: str
) -> None:
    """``producer`` publishes one event on a stream subject; ``reader`` consumes and acks it
    from the stream's durable (as the role that owns that durable would)."""
    subject = getattr(producer.subjects, subject_attr)
    published = await producer.publish(
        subject, sample(sample_events, subject), msg_id=f"{subject}-{time.time_ns()}"
    )
    assert published is not None and not published.duplicate
    async with reader.consume(stream, batch=1, fetch_timeout=0.5) as consumer:
        with anyio.fail_after(10):
            delivery = await anext(consumer)
        await delivery.ack_sync()
    assert isinstance(delivery.event, expected_type(subject) or object)


# ---------------------------------------------------------------------------------------------
# fixtures


@dataclass
class UsersServer:
    server: EmbeddedServer
    passwords: dict[str, str]

    @property
    def url(self) -> str:
        assert self.server.url is not None
        return self.server.url

    def options(self, user: str, **kwargs: Any) -> ConnectOptions:
        return ConnectOptions(
            url=self.url, name=f"{user}-1", user=user, password=self.passwords[user], **kwargs
        )


@pytest.fixture(scope="module")
def users_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UsersServer]:
    """scripts/nats/single.conf (common.conf + auth-users.conf + permissions.conf), as shipped."""
    conf_dir = copy_nats_configs(tmp_path_factory.mktemp("users") / "etc-nats")
    passwords = role_passwords()
    server = EmbeddedServer(conf_dir.parent / "store", config_file=conf_dir / "single.conf", http_port=-1)
    with pytest.MonkeyPatch.context() as mp:  # the server reads its secrets at start only
        for key, value in password_env(passwords).items():
            mp.setenv(key, value)
        server.start()
    yield UsersServer(server, passwords)
    server.stop()


# ---------------------------------------------------------------------------------------------
# configs parse


def test_every_shipped_config_parses_with_its_environment(tmp_path: Path) -> None:
    """single.conf, the three cluster members and each auth/TLS/operator variant pass
    ``nats-server -t`` once the secrets they reference are in the environment."""
    conf_dir = copy_nats_configs(tmp_path / "etc-nats")
    tls = make_tls(tmp_path / "tls")
    (conf_dir / "tls.conf").write_text(
        (conf_dir / "tls.conf").read_text().replace("/etc/nats/tls", str(tls.ca.parent))
    )
    operator = make_operator(tmp_path / "op", {})
    (conf_dir / "operator.conf").write_text(
        (conf_dir / "operator.conf").read_text()
        .replace("/etc/nats/jwt/operator.jwt", str(operator.operator_jwt))
        .replace("/var/lib/nats/jwt", str(operator.resolver_dir))
    )  # fmt: skip
    env = {
        **password_env(role_passwords()),
        **nkey_env(role_nkeys(tmp_path / "nk")),
        "AREAL_NATS_TOKEN": "t0ken",
        "AREAL_NATS_SYSTEM_ACCOUNT": operator.system_account,
    }
    mains = [conf_dir / f"{name}.conf" for name in ("single", "nats-1", "nats-2", "nats-3")]
    mains += [
        write_main_config(conf_dir, "nkeys", "common.conf", "auth-nkeys.conf"),
        write_main_config(conf_dir, "token", "common.conf", "auth-token.conf"),
        write_main_config(conf_dir, "tls-users", "common.conf", "auth-users.conf", "tls.conf"),
        write_main_config(conf_dir, "operator", "common.conf", "operator.conf"),
    ]
    for main in mains:
        result = check_config(main, env)
        assert result.returncode == 0, f"{main.name}: {result.stdout}{result.stderr}"


def test_a_missing_secret_is_named_when_the_config_is_checked(tmp_path: Path) -> None:
    """Without AREAL_NATS_PASS_REWARD in its environment the server refuses the config and
    says which variable is missing (areal-nats.service runs this check before starting)."""
    conf_dir = copy_nats_configs(tmp_path / "etc-nats")
    env = password_env(role_passwords())
    del env["AREAL_NATS_PASS_REWARD"]
    result = check_config(conf_dir / "single.conf", env)
    assert result.returncode != 0
    assert "AREAL_NATS_PASS_REWARD" in result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------
# user / password


@pytest.mark.asyncio
async def test_a_role_user_connects_publishes_and_consumes(
    run_name: str, users_server: UsersServer, sample_events: dict[str, ev.Event]
) -> None:
    """The reward user logs in with its password, provisions the run, and scores: it consumes
    rollout.generated (acking its own durable) and publishes rollout.scored."""
    ops = await connect(users_server.options("ops"), run_name)
    reward = await connect(users_server.options("reward"), run_name)
    try:
        await reward.provision()
        await ops.publish(
            ops.subjects.rollout_generated, sample(sample_events, ops.subjects.rollout_generated)
        )
        async with reward.consume("GENERATED", batch=1, fetch_timeout=0.5) as consumer:
            with anyio.fail_after(10):
                delivery = await anext(consumer)
            await reward.publish(
                reward.subjects.rollout_scored, sample(sample_events, reward.subjects.rollout_scored)
            )
            await delivery.ack_sync()
        async with ops.consume("SCORED", batch=1, fetch_timeout=0.5) as scored:
            with anyio.fail_after(10):
                assert isinstance((await anext(scored)).event, ev.ScoredGroup)
    finally:
        await reward.close()
        await ops.close()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "credentials", [{"user": "reward", "password": "nope"}, {}], ids=["wrong password", "no credentials"]
)
async def test_a_client_without_valid_credentials_is_refused_at_once_naming_the_url(
    users_server: UsersServer, credentials: dict[str, str]
) -> None:
    """A bad password, or none, fails the first connect well before connect_timeout_s (no
    retries), with the URL and the server's "Authorization Violation" in the error."""
    t0 = time.monotonic()
    with pytest.raises(BusConnectError) as info:
        await connect(ConnectOptions(url=users_server.url, connect_timeout_s=5, **credentials), RUN)
    assert time.monotonic() - t0 < 3
    assert names_server(info.value, users_server.url)
    assert "authorization violation" in str(info.value).lower()


@pytest.mark.asyncio
@pytest.mark.parametrize("role", ROLES)
async def test_each_role_can_do_its_whole_job_under_its_permissions(
    run_name: str, users_server: UsersServer, sample_events: dict[str, ev.Event], role: str
) -> None:
    """Everything a role's worker does (provision, heartbeat on core NATS and in the workers
    bucket, its publishes, consuming and acking its durables, its state keys, a dead letter,
    deleting its heartbeat key on stop) passes without a single permissions violation."""
    work = ROLE_WORK[role]
    with capture_logs() as logs:
        ops = await connect(users_server.options("ops"), run_name)
        bus = await connect(users_server.options(role, request_timeout_s=2.0), run_name)
        try:
            await bus.provision()
            beat = sample(sample_events, bus.subjects.heartbeat(role, "w1"))
            await bus.publish(bus.subjects.heartbeat(role, "w1"), beat)
            await bus.kv_put("workers", f"{role}.w1", ev.encode(beat))
            for attr in work["publish"]:
                subject = getattr(bus.subjects, attr)
                await bus.publish(subject, sample(sample_events, subject))
            for stream in work["consume"]:
                spec = bus.subjects.stream(stream)
                await ops.publish(
                    spec.subject, sample(sample_events, spec.subject), msg_id=f"in-{time.time_ns()}"
                )
                async with bus.consume(stream, batch=1, fetch_timeout=0.5) as consumer:
                    with anyio.fail_after(10):
                        delivery = await anext(consumer)
                    await delivery.ack_sync()
            for key in work["state"]:
                await bus.kv_put("state", key, b"\x80")
                assert await bus.kv_get("state", key) is not None
            await bus.publish(bus.subjects.deadletter, sample(sample_events, bus.subjects.deadletter))
            await bus.kv_delete("workers", f"{role}.w1")
            await bus.flush()  # any -ERR for the publishes above arrives before this PONG
        finally:
            await bus.close()
            await ops.close()
    assert denials(logs) == []


@pytest.mark.asyncio
async def test_a_reward_worker_may_not_touch_weights_and_survives_trying(
    run_name: str, users_server: UsersServer, sample_events: dict[str, ev.Event]
) -> None:
    """A reward worker publishing weights.load (core NATS) is refused by the server: the
    message reaches no one, the bus logs the violation naming the subject, and the
    connection keeps working. A JetStream publish (prompt) and every KV write (weights.served)
    it may not make raise BusPermissionError naming the subject and the user at once, well
    before request_timeout, are logged and counted, and change nothing."""
    with capture_logs() as logs:
        ops = await connect(users_server.options("ops"), run_name)
        reward = await connect(users_server.options("reward", request_timeout_s=10.0), run_name)
        try:
            await reward.provision()
            async with ops.subscribe(ops.subjects.weights_load) as spy:
                load = sample(sample_events, reward.subjects.weights_load)
                await reward.publish(
                    reward.subjects.weights_load, load
                )  # returns: core NATS is fire-and-forget
                await wait_for_denial(logs, reward.subjects.weights_load)
                await ops.flush()
                with anyio.move_on_after(0.3) as nothing:
                    await anext(spy)
                assert nothing.cancelled_caught, "a denied publish was delivered"

            assert reward.nc.is_connected
            await round_trip(reward, ops, sample_events, "rollout_scored", "SCORED")  # still does its job

            prompt = reward.subjects.prompt
            kv_subject = f"$KV.{reward.subjects.state_bucket}.weights.served"
            refused = [  # (what, the subject the server refuses, the attempt)
                (
                    "publish",
                    prompt,
                    lambda: reward.publish(prompt, sample(sample_events, prompt), msg_id="x"),
                ),
                ("kv_put", kv_subject, lambda: reward.kv_put("state", "weights.served", b"forged")),
                ("kv_create", kv_subject, lambda: reward.kv_create("state", "weights.served", b"forged")),
                ("kv_update", kv_subject, lambda: reward.kv_update("state", "weights.served", b"x", last=1)),
                ("kv_delete", kv_subject, lambda: reward.kv_delete("state", "weights.served")),
            ]
            for what, subject, attempt in refused:
                t0 = time.monotonic()
                with pytest.raises(BusPermissionError) as info:
                    await attempt()
                assert time.monotonic() - t0 < 1, f"{what}: waited for a reply that never comes"
                assert (info.value.subject, info.value.user) == (subject, "reward"), what
                assert subject in str(info.value) and "'reward'" in str(info.value), what
                await wait_for_denial(logs, subject)
            assert reward.stats["permission_denied"] >= 1 + len(refused)
            assert any(e["event"] == "nats permission denied" for e in logs)
            assert await ops.kv_get("state", "weights.served") is None
            assert await stream_messages(ops, "PROMPT") == 0

            prompt_stream = reward.subjects.stream("PROMPT").name
            with pytest.raises((BusError, TimeoutError)):  # a raw JetStream API call: only the log says why
                await reward.nc.jetstream(timeout=1.0).delete_stream(prompt_stream)
            await wait_for_denial(logs, f"$JS.API.STREAM.DELETE.{prompt_stream}")
            assert (await ops.js.stream_info(prompt_stream)).config.name == prompt_stream

            assert reward.nc.is_connected
            await round_trip(reward, ops, sample_events, "rollout_scored", "SCORED")  # and still does
        finally:
            await reward.close()
            await ops.close()


FORGER = """
import sys, time
from areal_async.run_file import load_config
from bus import events as ev
from workers.runtime import run_role

async def serve(ctx):
    task = ev.PromptTask(task_id="forged:0", kind="train", index=0, epoch=0, row={}, issued_at=time.time())
    await ctx.bus.publish(ctx.bus.subjects.prompt, task, msg_id="forged:0")

sys.exit(run_role(load_config(sys.argv[1], []), role="reward", serve=serve, worker_id="reward-forger"))
"""


def test_a_worker_refused_for_permissions_exits_2_and_says_why(
    run_name: str, users_server: UsersServer, tmp_path: Path
) -> None:
    """A worker whose serve() makes a publish its user may not make exits with status 2 (which
    areal-worker@.service does not restart), and its log names the refused subject."""
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(
        f"name: {run_name}\ndir: {run_dir}\n"
        f"bus:\n  url: {users_server.url}\n  user: reward\n  connect_timeout_s: 5\n"
        "logging:\n  format: json\n"
    )
    env = {**os.environ, "AREAL_NATS_PASSWORD": users_server.passwords["reward"], "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", FORGER, str(config)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [json.loads(line) for line in (run_dir / "logs" / "reward-forger.jsonl").read_text().splitlines()]
    refused = [e for e in lines if e["event"] == "bus permission denied"]
    assert refused and refused[0]["subject"] == f"areal.{run_name}.prompt" and refused[0]["user"] == "reward"


@pytest.mark.asyncio
async def test_inspect_connects_with_the_run_files_credentials(
    run_name: str, users_server: UsersServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """``areal-async inspect --config RUN.yaml`` logs in as the run file's user (bus.user, the
    password from AREAL_NATS_PASSWORD) and reports the run; without credentials the same
    server refuses it."""
    from workers.cli import main_parser
    from workers.inspect import _inspect

    ops = await connect(users_server.options("ops"), run_name)
    try:
        await ops.provision()
    finally:
        await ops.close()
    config = tmp_path / "run.yaml"
    config.write_text(
        f"name: {run_name}\ndir: {tmp_path / 'run'}\nbus:\n  url: {users_server.url}\n  user: ops\n"
    )
    monkeypatch.setenv("AREAL_NATS_PASSWORD", users_server.passwords["ops"])
    capsys.readouterr()
    with capture_logs():  # structlog prints to stdout otherwise; keep stdout to the report
        assert await _inspect(main_parser().parse_args(["inspect", "--config", str(config), "--json"])) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["run"] == run_name and report["streams"]["PROMPT"]["consumer"] == "generation"

    monkeypatch.delenv("AREAL_NATS_PASSWORD")
    config.write_text(f"name: {run_name}\ndir: {tmp_path / 'run'}\nbus:\n  url: {users_server.url}\n")
    with pytest.raises(BusConnectError, match="(?i)authorization violation"):
        await _inspect(main_parser().parse_args(["inspect", "--config", str(config)]))


# ---------------------------------------------------------------------------------------------
# nkeys, token


@pytest.mark.asyncio
async def test_an_nkey_seed_file_authenticates_its_role_and_an_unknown_key_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sample_events: dict[str, ev.Event]
) -> None:
    """auth-nkeys.conf: a worker with bus.nkeys_seed = its role's seed file connects and works
    under that role's permissions; a seed the server does not know is refused, naming the URL."""
    conf_dir = copy_nats_configs(tmp_path / "etc-nats")
    keys = role_nkeys(tmp_path / "nk")
    for key, value in nkey_env(keys).items():
        monkeypatch.setenv(key, value)
    main = write_main_config(conf_dir, "nkeys", "common.conf", "auth-nkeys.conf")
    stranger = role_nkeys(tmp_path / "stranger")["reward"]
    async with EmbeddedServer(tmp_path / "store", config_file=main, http_port=-1) as server:
        assert server.url is not None
        bus = await connect(
            ConnectOptions(url=server.url, name="reward-1", nkeys_seed=str(keys["reward"].seed_file)), RUN
        )
        ops = await connect(
            ConnectOptions(url=server.url, name="ops", nkeys_seed=str(keys["ops"].seed_file)), RUN
        )
        try:
            await bus.provision()
            await round_trip(bus, ops, sample_events, "rollout_scored", "SCORED")
        finally:
            await bus.close()
            await ops.close()
        with pytest.raises(BusConnectError) as info:
            await connect(
                ConnectOptions(url=server.url, nkeys_seed=str(stranger.seed_file), connect_timeout_s=5), RUN
            )
        assert names_server(info.value, server.url) and "authorization violation" in str(info.value).lower()


@pytest.mark.asyncio
async def test_the_token_config_admits_the_token_and_refuses_another(
    run_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sample_events: dict[str, ev.Event]
) -> None:
    """auth-token.conf: the token from AREAL_NATS_TOKEN opens everything; another token is
    refused with the URL and the cause."""
    conf_dir = copy_nats_configs(tmp_path / "etc-nats")
    monkeypatch.setenv("AREAL_NATS_TOKEN", "s3cret-token")
    main = write_main_config(conf_dir, "token", "common.conf", "auth-token.conf")
    async with EmbeddedServer(tmp_path / "store", config_file=main, http_port=-1) as server:
        assert server.url is not None
        bus = await connect(ConnectOptions(url=server.url, token="s3cret-token"), run_name)
        try:
            await bus.provision()
            await round_trip(bus, bus, sample_events, "prompt", "PROMPT")
        finally:
            await bus.close()
        with pytest.raises(BusConnectError) as info:
            await connect(ConnectOptions(url=server.url, token="guess", connect_timeout_s=5), run_name)
        assert names_server(info.value, server.url) and "authorization violation" in str(info.value).lower()


# ---------------------------------------------------------------------------------------------
# TLS


@pytest.mark.asyncio
async def test_mutual_tls_admits_a_client_of_the_ca_and_refuses_a_wrong_ca_or_no_certificate(
    run_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sample_events: dict[str, ev.Event]
) -> None:
    """tls.conf + auth-users.conf: a worker with bus.tls_ca and a client certificate from the
    CA connects and works. Trusting another CA fails the server's certificate check; omitting
    the client certificate fails the server's check of the client. Both are BusConnectError
    naming the URL."""
    conf_dir = copy_nats_configs(tmp_path / "etc-nats")
    tls = make_tls(tmp_path / "tls")
    (conf_dir / "tls.conf").write_text(
        (conf_dir / "tls.conf").read_text().replace("/etc/nats/tls", str(tls.ca.parent))
    )
    passwords = role_passwords()
    for key, value in password_env(passwords).items():
        monkeypatch.setenv(key, value)
    main = write_main_config(conf_dir, "tls", "common.conf", "auth-users.conf", "tls.conf")
    async with EmbeddedServer(tmp_path / "store", config_file=main, http_port=-1) as server:
        assert server.url is not None
        user = {"user": "generation", "password": passwords["generation"]}
        good = ConnectOptions(
            url=server.url,
            tls_ca=str(tls.ca),
            tls_cert=str(tls.client_cert),
            tls_key=str(tls.client_key),
            **user,
        )
        bus = await connect(good, run_name)
        ops = await connect(
            dataclasses.replace(good, name="ops", user="ops", password=passwords["ops"]), run_name
        )
        try:
            await bus.provision()
            await round_trip(bus, ops, sample_events, "rollout_generated", "GENERATED")
        finally:
            await bus.close()
            await ops.close()

        wrong_ca = ConnectOptions(
            url=server.url, tls_ca=str(tls.other_ca), tls_cert=str(tls.client_cert), tls_key=str(tls.client_key),
            connect_timeout_s=1.5, **user,
        )  # fmt: skip
        with pytest.raises(BusConnectError) as info:
            await connect(wrong_ca, run_name)
        assert names_server(info.value, server.url) and "certificate verify failed" in str(info.value).lower()

        no_client_cert = ConnectOptions(url=server.url, tls_ca=str(tls.ca), connect_timeout_s=1.5, **user)
        with pytest.raises(BusConnectError) as info:
            await connect(no_client_cert, run_name)
        assert names_server(info.value, server.url)


# ---------------------------------------------------------------------------------------------
# .creds (operator / JWT)


@pytest.mark.asyncio
async def test_creds_signed_by_the_operator_chain_work_and_a_foreign_account_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sample_events: dict[str, ev.Event]
) -> None:
    """operator.conf with the full resolver: a reward user's .creds (JWT signed by the AREAL
    account, signed by the trusted operator) connects with bus.creds, scores, and is held to
    its JWT permissions (weights.load is refused and logged); a user of an account the server
    does not know is refused, naming the URL."""
    conf_dir = copy_nats_configs(tmp_path / "etc-nats")
    operator = make_operator(tmp_path / "op", {"reward": REWARD_JWT_PERMISSIONS, "ops": {}})
    (conf_dir / "operator.conf").write_text(
        (conf_dir / "operator.conf").read_text()
        .replace("/etc/nats/jwt/operator.jwt", str(operator.operator_jwt))
        .replace("/var/lib/nats/jwt", str(operator.resolver_dir))
    )  # fmt: skip
    monkeypatch.setenv("AREAL_NATS_SYSTEM_ACCOUNT", operator.system_account)
    main = write_main_config(conf_dir, "operator", "common.conf", "operator.conf")
    async with EmbeddedServer(tmp_path / "store", config_file=main, http_port=-1) as server:
        assert server.url is not None
        with capture_logs() as logs:
            bus = await connect(
                ConnectOptions(url=server.url, name="reward-1", creds=str(operator.creds["reward"])), RUN
            )
            ops = await connect(
                ConnectOptions(url=server.url, name="ops", creds=str(operator.creds["ops"])), RUN
            )
            try:
                await bus.provision()
                await round_trip(bus, ops, sample_events, "rollout_scored", "SCORED")
                await bus.publish(bus.subjects.weights_load, sample(sample_events, bus.subjects.weights_load))
                await wait_for_denial(logs, bus.subjects.weights_load)
                assert bus.nc.is_connected
            finally:
                await bus.close()
                await ops.close()
        with pytest.raises(BusConnectError) as info:
            await connect(
                ConnectOptions(url=server.url, creds=str(operator.rogue_creds), connect_timeout_s=5), RUN
            )
        assert names_server(info.value, server.url)
