"""A whole run on the shipped 3-node cluster whose engines reach it only through a leaf node.

Every role runs as its own ``areal-worker`` process with its own user and password, as a
systemd unit or a Slurm task would start it: controller, reward, trainer and weight-sync against
the three members, the generation workers against the leaf (``scripts/nats/leaf.conf``). With
``weight_sync.transport: bus`` every version an engine serves comes out of the run's weights
bucket in the cluster's JetStream, through the leaf.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from bus import ConnectOptions, EmbeddedServer, connect
from bus.events import TrainerStep, decode
from bus.subjects import Streams
from tests.e2e.test_e2e import _check_exactly_once, _check_staleness
from tests.helpers.jobs import REPO, committed_steps, tiny_config, worker_log
from tests.integration.test_weight_bus_leaf import cluster_and_leaf, leaf_env  # noqa: F401

RUN = "leafwhole"
CORE_ROLES = ("controller", "reward", "trainer", "weight-sync")


def _worker(
    config: Path, role: str, url: str, password: str, worker_id: str, out: Path
) -> subprocess.Popen[bytes]:
    """``areal-worker --role ROLE`` as an operator starts it: the URL and user on the command line,
    the password in the environment."""
    with open(out, "ab") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "workers.cli", "--role", role, "--config", str(config)]
            + ["--set", f"bus.url={url}", "--set", f"bus.user={role}", "--worker-id", worker_id],
            cwd=REPO,
            env={**os.environ, "AREAL_NATS_PASSWORD": password},
            stdout=sink,
            stderr=subprocess.STDOUT,
        )


async def _until(
    check: Callable[[], bool], seconds: float, what: str, procs: dict[str, subprocess.Popen[bytes]]
) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        failed = {name: p.returncode for name, p in procs.items() if p.poll() not in (None, 0)}
        assert not failed, f"waiting for {what}: workers failed {failed}"
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        await anyio.sleep(0.2)


def _bus_loads(run_dir: Path, worker_id: str | None = None) -> list[dict]:
    loads = [r for r in worker_log(run_dir, "generation", "weights loaded") if "via" in r]
    return [r for r in loads if worker_id is None or r["file"] == f"{worker_id}.jsonl"]


@pytest.mark.asyncio
@pytest.mark.timeout(420)
async def test_a_run_on_the_cluster_serves_engines_behind_a_leaf_node_from_the_weights_bucket(
    tmp_path: Path,
    tiny_sft_model: Path,
    cluster_and_leaf: tuple[list[EmbeddedServer], str],  # noqa: F811
    leaf_env: dict[str, str],  # noqa: F811
) -> None:
    """The run completes with every task trained once and every step within the staleness bound.
    Every version an engine loads comes through the leaf from the bucket, with the digest the
    trainer wrote; nothing falls back to disk. The engine is killed mid-run and started again
    under the same id, and a second engine joins the running run through the leaf: both rebuild
    the version being served from an anchor and the deltas after it."""
    servers, leaf_url = cluster_and_leaf
    members = ",".join(str(s.url) for s in servers)
    total, batch = 8, 4
    cfg = tiny_config(
        tmp_path,
        tiny_sft_model,
        RUN,
        bus__url=members,
        bus__replicas=3,
        rollout__group_size=4,
        trainer__total_steps=total,
        trainer__batch_size=batch,
        trainer__eval_every=0,
        dataset__eval_size=4,
        checkpoint__every_steps=4,
        weight_sync__transport="bus",
        weight_sync__anchor_every=3,
        weight_sync__chunk_kb=64,
    )
    run_dir, logs = tmp_path / RUN, tmp_path / "out"
    logs.mkdir()

    def start(role: str, worker_id: str) -> subprocess.Popen[bytes]:
        url = leaf_url if role == "generation" else members
        return _worker(cfg, role, url, leaf_env[role], worker_id, logs / f"{worker_id}.out")

    procs = {role: start(role, f"{role}-1") for role in CORE_ROLES}
    procs["generation-1"] = start("generation", "generation-1")
    try:
        await _until(lambda: len(_bus_loads(run_dir, "generation-1")) >= 2, 240, "two loads", procs)
        procs.pop("generation-1").kill()  # SIGKILL
        before = len(_bus_loads(run_dir, "generation-1"))
        procs["generation-1b"] = start("generation", "generation-1")  # the same engine, restarted
        procs["generation-2"] = start("generation", "generation-2")  # a late joiner
        await _until(
            lambda: len(_bus_loads(run_dir, "generation-2")) >= 1, 240, "the late engine's load", procs
        )
        await anyio.to_thread.run_sync(procs["controller"].wait, 240)
        assert procs["controller"].returncode == 0, (logs / "controller-1.out").read_text()[-3000:]
        for p in procs.values():  # every other worker leaves on run.ended
            await anyio.to_thread.run_sync(p.wait, 60)
        assert all(p.returncode == 0 for p in procs.values()), {n: p.returncode for n, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    written = {r["policy_version"]: r for r in worker_log(run_dir, "trainer", "weights written to the bus")}
    assert sorted(written) == list(range(1, total + 1))
    assert len({w["digest"] for w in written.values()}) == total, "every step moves the weights"
    loads = _bus_loads(run_dir)
    assert all(r["via"] == "bus" for r in loads), [(r["file"], r["via"]) for r in loads]
    assert all(r["digest"] == written[r["policy_version"]]["digest"] for r in loads if r["policy_version"])
    assert not worker_log(run_dir, "generation", "weights from the bus failed; loading the disk copy")
    assert len(_bus_loads(run_dir, "generation-1")) > before, "the restarted engine loads again"
    assert _bus_loads(run_dir, "generation-2")

    options = ConnectOptions(url=members, name="reader", user="controller", password=leaf_env["controller"])
    reader = await connect(options, RUN)
    try:
        info = await reader.js.stream_info(reader.subjects.stream(Streams.STEPS).name)
        steps = [
            decode((await reader.js.get_msg(info.config.name, seq)).data, TrainerStep)
            for seq in range(info.state.first_seq, info.state.last_seq + 1)
        ]
    finally:
        await reader.close()
    _check_exactly_once(steps, total, batch)
    _check_staleness(list(committed_steps(steps).values()), eta=2)
