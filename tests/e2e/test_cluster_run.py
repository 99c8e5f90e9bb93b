"""A whole training run on the shipped 3-node NATS cluster, losing the JetStream leader mid-run.

Three nats-server processes run scripts/nats/nats-{1,2,3}.conf on loopback (routes moved to
free ports, per-role users and permissions as shipped). The five roles run as separate
``areal-worker`` processes, the way systemd units or a Slurm array start them: each logs in
as its own user and is given one node's URL only (controller and trainer on node 1,
generation and weight-sync on node 2, reward on node 3), so traffic crosses the routes. The
run's streams and buckets are R3. After two trained steps node 1 is made the JetStream meta
leader (a stepdown request from the system account) and SIGKILLed. The workers that were on it reconnect to the surviving nodes (they
learn them from the cluster); the run finishes every step, trains every task exactly once,
and keeps the staleness bound.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import anyio
import nats
import pytest

from bus import ConnectOptions, EmbeddedServer, connect
from bus.events import TrainerStep, decode
from tests.helpers.jobs import REPO, committed_steps, steps_done, tiny_config
from tests.helpers.ops_helpers import (
    cluster_configs,
    free_port,
    monitor,
    password_env,
    role_passwords,
    start_together,
)

ROLE_NODE = {"controller": 0, "trainer": 0, "generation": 1, "weight-sync": 1, "reward": 2}


def _meta_leader_name(servers: list[EmbeddedServer]) -> str | None:
    """The server name of the JetStream meta leader, as the first member that knows reports it."""
    for server in servers:
        meta = monitor(server, "/jsz").get("meta_cluster")
        if isinstance(meta, dict) and meta.get("leader"):
            return str(meta["leader"])
    return None


async def _move_meta_leader(servers: list[EmbeddedServer], target: str, sys_password: str) -> None:
    """Ask the meta leader to step down in favour of ``target`` (system account) until it leads."""
    nc = await nats.connect([str(s.url) for s in servers], user="sys", password=sys_password)
    try:
        with anyio.fail_after(60):
            while _meta_leader_name(servers) != target:
                request = json.dumps({"placement": {"preferred": target}}).encode()
                try:
                    await nc.request("$JS.API.META.LEADER.STEPDOWN", request, timeout=2)
                except Exception:  # mid-election; ask again
                    pass
                await anyio.sleep(0.5)
    finally:
        await nc.close()


async def _read_steps(urls: list[str], password: str, run: str) -> list[TrainerStep]:
    options = ConnectOptions(url=urls, name="test-ops", user="ops", password=password)
    bus = await connect(options, run)
    try:
        name = bus.subjects.stream("STEPS").name
        info = await bus.js.stream_info(name)
        assert info.config.num_replicas == 3
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            out.append(decode((await bus.js.get_msg(name, seq)).data, TrainerStep))
        return out
    finally:
        await bus.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_run_across_a_3_node_cluster_survives_losing_the_jetstream_leader(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    passwords = role_passwords()
    for key, value in password_env(passwords).items():
        monkeypatch.setenv(key, value)  # the servers read their users' passwords from the environment
    mains = cluster_configs(tmp_path / "etc", [free_port() for _ in range(3)])
    servers = [
        EmbeddedServer(tmp_path / f"store-{k}", config_file=main, http_port=-1)
        for k, main in enumerate(mains, start=1)
    ]
    total, batch, eta = 10, 4, 2
    cfg = tiny_config(
        tmp_path,
        tiny_model,
        "r3run",
        rollout__group_size=4,
        rollout__max_staleness=eta,
        trainer__total_steps=total,
        trainer__batch_size=batch,
        trainer__eval_every=0,
        dataset__eval_size=4,
        checkpoint__every_steps=2,
        bus__replicas=3,
        bus__reconnect_wait_max_s=0.5,
    )
    run_dir = tmp_path / "r3run"
    workers: dict[str, subprocess.Popen[bytes]] = {}
    anyio.run(start_together, servers)
    try:
        urls = [str(s.url) for s in servers]
        for role, node in ROLE_NODE.items():
            env = {**os.environ, "AREAL_NATS_PASSWORD": passwords[role]}
            workers[role] = subprocess.Popen(
                [sys.executable, "-m", "workers.cli", "--role", role, "--config", str(cfg)]
                + ["--set", f"bus.url={urls[node]}", "--set", f"bus.user={role}"]
                + ["--worker-id", f"{role}-1"],
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=(tmp_path / f"{role}.stderr").open("wb"),
            )
        deadline = time.monotonic() + 300
        while steps_done(run_dir) < 2:
            crashed = {r: p.returncode for r, p in workers.items() if p.poll() is not None}
            assert not crashed, f"workers exited before the kill: {crashed}\n" + "\n".join(
                (tmp_path / f"{role}.stderr").read_text()[-2000:] for role in crashed
            )
            assert time.monotonic() < deadline, "no two trained steps within 300 s"
            time.sleep(0.2)
        # the hardest node to lose: the one the controller and the trainer are connected to
        victim = servers[ROLE_NODE["trainer"]]
        target = str(monitor(victim, "/varz")["server_name"])
        anyio.run(_move_meta_leader, servers, target, passwords["sys"])
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        survivors = [s for s in servers if s is not victim]

        deadline = time.monotonic() + 600
        while any(proc.poll() is None for proc in workers.values()):
            failed = {r: p.returncode for r, p in workers.items() if p.returncode not in (None, 0)}
            assert not failed, f"workers failed after the kill: {failed}\n" + "\n".join(
                (tmp_path / f"{role}.stderr").read_text()[-3000:] for role in failed
            )
            assert time.monotonic() < deadline, "the run did not finish within 600 s of the kill"
            time.sleep(0.5)
        codes = {role: proc.returncode for role, proc in workers.items()}
        assert codes == dict.fromkeys(ROLE_NODE, 0), codes
        steps = anyio.run(_read_steps, [str(s.url) for s in survivors], passwords["ops"], "r3run")
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                proc.kill()
        for server in servers:
            server.stop()

    final = committed_steps(steps)
    assert sorted(final) == list(range(1, total + 1))
    trained = [task for ev in final.values() for task in ev.task_ids]
    assert not [t for t, n in Counter(trained).items() if n > 1], "a task was trained twice"
    assert all(len(ev.task_ids) == batch for ev in final.values())
    for ev in final.values():
        t = ev.policy_version - 1
        assert all(t - eta <= head <= t for head in ev.head_versions), (ev.step, ev.head_versions)
    assert steps_done(run_dir) >= total
    # the workers on the killed node carried on elsewhere: their logs show the reconnect
    moved = [r for r, node in ROLE_NODE.items() if servers[node] is victim]
    for role in moved:
        log = (run_dir / "logs" / f"{role}-1.jsonl").read_text()
        assert "nats reconnected" in log, f"{role} never reconnected"
