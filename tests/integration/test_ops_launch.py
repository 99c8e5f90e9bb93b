"""Launching workers under systemd and Slurm (scripts/systemd/, scripts/slurm/).

* The unit files pass ``systemd-analyze verify`` (install paths moved into a temp prefix)
  and state the restart, stop and logging contract.
* ``areal-worker-exec INSTANCE`` turns the instance name and the environment files into the
  ``areal-worker`` (or torchrun) command line; checked in dry-run mode against the shipped
  example env files, and once for real: a reward worker started by the wrapper logs in with
  its role's user, scores a group, and stops cleanly on SIGTERM.
* The Slurm scripts run here with Slurm's environment variables set by hand: the array maps
  task ids to roles, the trainer job builds a c10d torchrun command from the node list.
  ``scontrol`` and ``srun`` do not exist here; the trainer test puts two tiny stand-ins on
  PATH (print the node list / run the command), the only fakes in these tests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import pytest_asyncio
from anyio.abc import Process

from bus import ConnectOptions, EmbeddedServer, connect
from bus import events as ev
from tests.helpers.ops_helpers import (
    REPO,
    SLURM_DIR,
    SYSTEMD_DIR,
    WORKER_EXEC,
    copy_nats_configs,
    dry_run,
    password_env,
    read_env_file,
    role_passwords,
    run_script,
    script_env,
)

ENV_DIR = SYSTEMD_DIR / "env"
HOST = "node7"
"""Short host name the scripts see (script_env sets HOSTNAME=node7.cluster.example)."""

VENV_BIN = Path(sys.executable).parent


def unit_settings(path: Path) -> dict[str, list[str]]:
    """``Section.Key`` -> values of a unit file (keys may repeat, e.g. EnvironmentFile)."""
    settings: dict[str, list[str]] = defaultdict(list)
    section = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        settings[f"{section}.{key}"].append(value)
    return settings


def seconds(value: str) -> float:
    """A systemd time span like ``45s``, ``5min`` or ``2min 30s`` in seconds."""
    units = {"ms": 0.001, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    return sum(float(n) * units[u or "s"] for n, u in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value))


# ---------------------------------------------------------------------------------------------
# systemd units


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze not installed; CI installs it with `apt-get install -y systemd`",
)
def test_the_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """areal-worker@generation-0.service (with its backoff drop-in) and areal-nats.service
    verify cleanly once /opt/areal points at real files. On systemd < 254 the only remarks
    allowed are the drop-in's RestartSteps/RestartMaxDelaySec, which that systemd ignores."""
    prefix = tmp_path / "opt-areal"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "venv" / "bin").mkdir(parents=True)
    (prefix / "bin" / "areal-worker-exec").symlink_to(WORKER_EXEC)
    from bus.embedded import find_nats_server

    (prefix / "venv" / "bin" / "nats-server").symlink_to(find_nats_server())
    units = tmp_path / "units"
    (units / "areal-worker@.service.d").mkdir(parents=True)
    for name in ("areal-worker@.service", "areal-nats.service", "areal-worker@.service.d/backoff.conf"):
        (units / name).write_text((SYSTEMD_DIR / name).read_text().replace("/opt/areal", str(prefix)))

    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(units / "areal-worker@generation-0.service"),
         str(units / "areal-nats.service")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    version = int(
        re.search(r"systemd (\d+)", subprocess.check_output(["systemd-analyze", "--version"], text=True))[1]
    )
    remarks = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    if version >= 254:
        assert remarks == []
    else:
        allowed = re.compile(r"backoff\.conf:\d+: Unknown key '(RestartSteps|RestartMaxDelaySec)'")
        assert remarks and all(allowed.search(line) for line in remarks), remarks


def test_the_worker_unit_restarts_failures_stops_within_a_bound_and_logs_to_the_journal() -> None:
    """The worker unit's contract: instance env file, the wrapper as ExecStart, restart on
    failure with a delay but not after exit 2 (bad configuration), SIGTERM then SIGKILL
    within TimeoutStopSec, output to the journal; the drop-in adds exponential backoff."""
    unit = unit_settings(SYSTEMD_DIR / "areal-worker@.service")
    assert "-/etc/areal/%i.env" in unit["Service.EnvironmentFile"]
    assert unit["Service.ExecStart"] == ["/opt/areal/bin/areal-worker-exec %i"]
    assert unit["Service.Restart"] == ["on-failure"]
    assert seconds(unit["Service.RestartSec"][0]) > 0
    assert "2" in unit["Service.RestartPreventExitStatus"][0].split()
    assert unit["Service.KillSignal"] == ["SIGTERM"]
    assert 15 <= seconds(unit["Service.TimeoutStopSec"][0]) <= 120
    assert unit["Service.StandardOutput"] == ["journal"] and unit["Service.StandardError"] == ["journal"]
    backoff = unit_settings(SYSTEMD_DIR / "areal-worker@.service.d" / "backoff.conf")
    assert int(backoff["Service.RestartSteps"][0]) > 0
    assert seconds(backoff["Service.RestartMaxDelaySec"][0]) > seconds(unit["Service.RestartSec"][0])

    nats = unit_settings(SYSTEMD_DIR / "areal-nats.service")
    assert nats["Service.ExecStart"] == ["/opt/areal/venv/bin/nats-server -c /etc/nats/areal-nats.conf"]
    assert nats["Service.Restart"] == ["on-failure"]
    assert seconds(nats["Service.TimeoutStopSec"][0]) > 30 + 5  # > lame_duck_duration + grace (common.conf)


# ---------------------------------------------------------------------------------------------
# the exec wrapper


def instance_env(instance: str, **extra: str) -> dict[str, str]:
    """What systemd gives the wrapper: common.env, then INSTANCE.env if shipped, as the unit
    orders its EnvironmentFile lines (a later file overrides an earlier one)."""
    env = read_env_file(ENV_DIR / "common.env")
    if (ENV_DIR / f"{instance}.env").exists():
        env.update(read_env_file(ENV_DIR / f"{instance}.env"))
    return script_env(**env, **extra)


def sets(*overrides: str) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


WORKER = "/opt/areal/venv/bin/areal-worker"
CONFIG = ["--config", "/etc/areal/run.yaml"]
JSON = "logging.format=json"
URL = "bus.url=nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222"
CA = "bus.tls_ca=/etc/areal/tls/ca.pem"
SHARED = ("bus.replicas=3", "dir=/shared/runs/{name}")
"""AREAL_SET of common.env."""


@pytest.mark.parametrize(
    ("instance", "argv"),
    [
        pytest.param("generation-0", [
            WORKER, "--role", "generation", *CONFIG, "--worker-id", f"generation-0-{HOST}",
            *sets(JSON, URL, "bus.user=generation", CA, *SHARED, "rollout.max_batch_size=64"),
        ], id="generation-0"),
        pytest.param("reward-0", [
            WORKER, "--role", "reward", *CONFIG, "--worker-id", f"reward-0-{HOST}",
            *sets(JSON, URL, "bus.nkeys_seed=/etc/areal/reward.nk", CA, *SHARED, "reward.num_workers=16"),
        ], id="reward-0"),
        pytest.param("weight-sync", [
            WORKER, "--role", "weight-sync", *CONFIG, "--worker-id", f"weight-sync-{HOST}",
            *sets(JSON, URL, CA, *SHARED),
        ], id="weight-sync (no instance file)"),
        pytest.param("weight-sync-1", [
            WORKER, "--role", "weight-sync", *CONFIG, "--worker-id", f"weight-sync-1-{HOST}",
            *sets(JSON, URL, CA, *SHARED),
        ], id="weight-sync-1"),
        pytest.param("trainer", [
            "/opt/areal/venv/bin/torchrun", "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
            "--rdzv-endpoint=trainer-a:29500", "--rdzv-id=gsm8k-qwen", "--max-restarts=0", "-m", "workers.cli",
            "--role", "trainer", *CONFIG, "--worker-id", f"trainer-{HOST}",
            *sets(JSON, URL, "bus.creds=/etc/areal/trainer.creds", CA, *SHARED, "trainer.device=cuda"),
        ], id="trainer (2 nodes x 8 ranks)"),
    ],
)  # fmt: skip
def test_the_wrapper_maps_the_instance_and_its_env_files_to_the_worker_command(
    instance: str, argv: list[str]
) -> None:
    """``areal-worker-exec INSTANCE`` under the shipped example env files runs exactly this
    command: role and replica from the instance name, a stable worker id, bus settings and
    overrides as --set (shared ones first, the role's own last), JSON logs; secrets (the
    NATS password) stay in the environment and never reach the command line."""
    env = instance_env(instance)
    got = dry_run([WORKER_EXEC, instance], env)
    assert got == argv
    assert not any("change-me" in arg for arg in got)


@pytest.mark.parametrize(
    ("instance", "env", "message"),
    [
        ("genration-0", {}, "not ROLE or ROLE-INDEX"),
        ("generation-x", {}, "not ROLE or ROLE-INDEX"),
        ("generation-0", {"AREAL_CONFIG": ""}, "AREAL_CONFIG is not set"),
        ("reward-1", {"AREAL_SET": "reward.num_workers"}, "is not KEY=VALUE"),
        ("trainer", {"AREAL_TORCHRUN_NNODES": "2"}, "needs AREAL_TORCHRUN_RDZV_ENDPOINT"),
    ],
)
def test_the_wrapper_refuses_a_bad_instance_or_environment_with_exit_2(
    instance: str, env: dict[str, str], message: str
) -> None:
    """Mistakes a restart cannot fix exit with 2 (the unit's RestartPreventExitStatus) and a
    message saying what to set."""
    result = run_script([WORKER_EXEC, instance], script_env(**{"AREAL_CONFIG": "/etc/areal/run.yaml", **env}))
    assert result.returncode == 2
    assert message in result.stderr


# ---------------------------------------------------------------------------------------------
# a real worker through the wrapper


@pytest_asyncio.fixture
async def users_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[str, dict[str, str]]]:
    """scripts/nats/single.conf with per-role users; yields (url, passwords)."""
    passwords = role_passwords()
    for key, value in password_env(passwords).items():
        monkeypatch.setenv(key, value)
    conf_dir = copy_nats_configs(tmp_path / "etc-nats")
    async with EmbeddedServer(
        tmp_path / "nats", config_file=conf_dir / "single.conf", http_port=-1
    ) as server:
        assert server.url is not None
        yield server.url, passwords


def rollout_group(answer: int, texts: tuple[str, ...]) -> ev.RolloutGroup:
    """A generated group for the arithmetic reward: one completion per text."""
    completions = [
        ev.Completion(token_ids=ev.pack_i32([3]), logprobs=ev.pack_f32([-0.1]), versions=ev.pack_i32([0]),
                      finish_reason="stop", text=text)
        for text in texts
    ]  # fmt: skip
    return ev.RolloutGroup(
        task_id="train:0:1", kind="train", index=1, epoch=0, attempt=0, row={"answer": answer},
        engine_id="gen-0", prompt_ids=ev.pack_i32([1, 2]), completions=completions, head_version=0, tail_version=0,
    )  # fmt: skip


async def json_lines(process: Process, into: list[dict[str, object]], raw: list[str]) -> None:
    """Collect the worker's stderr: every line must be one JSON object."""
    assert process.stderr is not None
    buffer = b""
    async for chunk in process.stderr:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                raw.append(line.decode(errors="replace"))
                into.append(json.loads(line))


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("entry", ["systemd", "slurm"])
async def test_a_reward_worker_started_by_the_entry_scripts_scores_and_stops_on_sigterm(
    users_server: tuple[str, dict[str, str]], tmp_path: Path, entry: str
) -> None:
    """The real thing, through areal-worker-exec (systemd) or workers.sbatch -> array_entry.sh
    (Slurm, task 3 of controller=1,weight-sync=1,generation=1,reward=1, with every role's
    credentials in one environment): the worker logs in as the reward user (password from the
    environment only), heartbeats under its instance's
    worker id, scores a rollout group with no permissions violation, writes JSON lines only,
    and on SIGTERM returns exit 0 well within the unit's TimeoutStopSec."""
    if not (VENV_BIN / "areal-worker").exists():
        pytest.skip(f"areal-worker is not installed beside {sys.executable} (pip install -e .)")
    url, passwords = users_server
    env = script_env(
        AREAL_CONFIG=str(REPO / "configs" / "arith_cpu.yaml"),
        AREAL_NATS_URL=url,
        AREAL_SET=f"dir={tmp_path}/run reward.num_workers=1",
        AREAL_VENV=str(VENV_BIN.parent),
    )
    worker_id = f"reward-0-{HOST}"
    if entry == "systemd":  # /etc/areal/reward-0.env holds the reward user
        env |= {"AREAL_NATS_USER": "reward", "AREAL_NATS_PASSWORD": passwords["reward"]}
        command = [str(WORKER_EXEC), "reward-0"]
    else:  # one --export for the whole array: every role's credentials, each task picks its own
        env |= {f"AREAL_NATS_{k}_{role.upper().replace('-', '_')}": v for role in ("controller", "reward")
                for k, v in (("USER", role), ("PASSWORD", passwords[role]))}  # fmt: skip
        env |= {"SLURM_SUBMIT_DIR": str(REPO), "SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MAX": "3",
                "AREAL_NUM_GENERATION": "1", "AREAL_NUM_REWARD": "1"}  # fmt: skip
        command = ["bash", str(SLURM_DIR / "workers.sbatch")]
    ops = await connect(
        ConnectOptions(url=url, name="ops", user="ops", password=passwords["ops"]), "arith-cpu"
    )
    logs: list[dict[str, object]] = []
    raw: list[str] = []
    process = None
    try:
        async with ops.subscribe(ops.subjects.heartbeat("reward", worker_id)) as beats:
            process = await anyio.open_process(
                command, env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(json_lines, process, logs, raw)
                with anyio.fail_after(60):
                    beat = await anext(beats)
                assert isinstance(beat, ev.Heartbeat) and beat.role == "reward"
                assert await ops.kv_get("workers", f"reward.{worker_id}") is not None

                await ops.publish(
                    ops.subjects.rollout_generated, rollout_group(answer=42, texts=("42", "41"))
                )
                async with ops.consume("SCORED", batch=1, fetch_timeout=0.5) as scored:
                    with anyio.fail_after(30):
                        delivery = await anext(scored)
                    await delivery.ack()
                assert delivery.event.rewards == [1.0, 0.0]

                process.send_signal(signal.SIGTERM)
                with anyio.fail_after(30):
                    code = await process.wait()
        assert code == 0, "\n".join(raw[-20:])
    finally:
        if process is not None:
            if process.returncode is None:  # the test failed before SIGTERM: leave nothing behind
                process.kill()
            await process.aclose()
        await ops.close()
    events = [e["event"] for e in logs]
    assert "worker started" in events and events[-1] == "worker stopped"
    assert {e.get("worker_id") for e in logs} == {worker_id}
    assert not [line for line in raw if re.search("permission", line, re.IGNORECASE)]
    assert not any(passwords[user] in line for user in ("reward", "controller") for line in raw)


# ---------------------------------------------------------------------------------------------
# Slurm


def slurm_env(**variables: str) -> dict[str, str]:
    return script_env(SLURM_SUBMIT_DIR=str(REPO), AREAL_CONFIG="configs/gsm8k_cluster.yaml", **variables)


def instances(**counts: int) -> list[str]:
    return [f"{role.replace('_', '-')}-{i}" for role, n in counts.items() for i in range(n)]


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        pytest.param({"AREAL_NUM_GENERATION": "2", "AREAL_NUM_REWARD": "2"},
                     instances(controller=1, weight_sync=1, generation=2, reward=2), id="one array, default order"),
        pytest.param({"AREAL_LAYOUT": "generation=8"}, instances(generation=8), id="2-node GPU array"),
        pytest.param({"AREAL_LAYOUT": "controller=1,weight-sync=1,reward=2"},
                     instances(controller=1, weight_sync=1, reward=2), id="2-node CPU array"),
        pytest.param({"AREAL_LAYOUT": "generation=64"}, instances(generation=64), id="16-node GPU array"),
        pytest.param({"AREAL_LAYOUT": "controller=1,weight-sync=1,reward=16"},
                     instances(controller=1, weight_sync=1, reward=16), id="16-node CPU array"),
    ],
)  # fmt: skip
def test_array_tasks_map_to_roles_in_layout_order_with_each_roles_own_user(
    layout: dict[str, str], expected: list[str]
) -> None:
    """workers.sbatch, task by task, with the --array size docs/operations.md gives: task ids
    are handed out in layout order (by default controller, weight-sync, N generation, M
    reward); each task execs areal-worker for its role, with worker id ROLE-INDEX-<host> and
    the NATS user exported for its role."""
    users = {f"AREAL_NATS_USER_{r.upper().replace('-', '_')}": r for r in ("controller", "generation", "reward",
                                                                          "trainer", "weight-sync")}  # fmt: skip
    got = []
    for task in range(len(expected)):
        env = slurm_env(
            SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_TASK_MAX=str(len(expected) - 1), **layout, **users
        )
        argv = dry_run(["bash", SLURM_DIR / "workers.sbatch"], env)
        role = argv[argv.index("--role") + 1]
        assert argv[0] == str(REPO / ".venv" / "bin" / "areal-worker")
        assert argv[argv.index("--config") + 1] == "configs/gsm8k_cluster.yaml"
        assert f"bus.user={role}" in argv
        worker_id = argv[argv.index("--worker-id") + 1]
        assert worker_id.startswith(f"{role}-")
        got.append(worker_id.removesuffix(f"-{HOST}"))
    assert got == expected


def test_a_custom_layout_maps_tasks_and_a_wrong_array_size_is_refused() -> None:
    """AREAL_LAYOUT splits the roles over arrays of different shapes (a GPU array of
    generation workers); an --array that does not match the layout is refused with the right
    --array in the message, and so is a task beyond it."""
    argv = dry_run(
        [SLURM_DIR / "array_entry.sh"], slurm_env(SLURM_ARRAY_TASK_ID="5", AREAL_LAYOUT="generation=8")
    )
    assert argv[argv.index("--role") + 1] == "generation"
    assert argv[argv.index("--worker-id") + 1] == f"generation-5-{HOST}"

    wrong = run_script(
        [SLURM_DIR / "array_entry.sh"],
        slurm_env(
            SLURM_ARRAY_TASK_ID="0", SLURM_ARRAY_TASK_MAX="9", AREAL_NUM_GENERATION="2", AREAL_NUM_REWARD="2"
        ),
    )
    assert wrong.returncode == 2 and "--array=0-5" in wrong.stderr
    beyond = run_script(
        [SLURM_DIR / "array_entry.sh"], slurm_env(SLURM_ARRAY_TASK_ID="8", AREAL_LAYOUT="reward=4")
    )
    assert beyond.returncode == 2 and "outside the layout" in beyond.stderr


@pytest.mark.parametrize(
    ("nodelist", "hosts", "node_id"),
    [
        pytest.param("gpu[07-08]", ["gpu07", "gpu08"], "1", id="2-node trainer, second node"),
        pytest.param(
            "gpu[01-08]", [f"gpu0{i}" for i in range(1, 9)], "0", id="16-node layout: 8-node trainer"
        ),
    ],
)
def test_the_trainer_job_runs_torchrun_per_node_with_c10d_at_the_first_host(
    tmp_path: Path, nodelist: str, hosts: list[str], node_id: str
) -> None:
    """trainer.sbatch: srun starts trainer_entry.sh on each node, which asks scontrol for the
    host names and runs one torchrun agent: all nodes, the node's GPUs as ranks, c10d
    rendezvous at the first host, the job id as rendezvous id, a worker id per node."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text(  # `scontrol show hostnames LIST`: one host per line
        f'#!/bin/sh\n[ "$1 $2 $3" = "show hostnames {nodelist}" ] && printf "%s\\n" {" ".join(hosts)}\n'
    )
    (stubs / "srun").write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = slurm_env(
        SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=nodelist, SLURM_JOB_NUM_NODES=str(len(hosts)), SLURM_NODEID=node_id,
        SLURM_GPUS_ON_NODE="8", AREAL_NATS_URL="nats://nats-1:4222",
    )  # fmt: skip
    env["PATH"] = f"{stubs}{os.pathsep}{env['PATH']}"
    argv = dry_run(["bash", SLURM_DIR / "trainer.sbatch"], env)
    assert argv == [
        str(REPO / ".venv" / "bin" / "torchrun"), f"--nnodes={len(hosts)}", "--nproc-per-node=8",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts[0]}:29500", "--rdzv-id=4242", "--max-restarts=0",
        "-m", "workers.cli", "--role", "trainer", "--config", "configs/gsm8k_cluster.yaml",
        "--worker-id", f"trainer-4242-{node_id}", "--set", "logging.format=json", "--set", "bus.url=nats://nats-1:4222",
    ]  # fmt: skip


def test_the_two_gpu_job_runs_the_whole_job_with_each_role_on_its_gpu() -> None:
    """two_gpu.sbatch: one `areal-async run` of the two-GPU run file, generation on GPU 0 and the
    trainer on GPU 1 unless AREAL_CUDA_DEVICES says otherwise (the launcher maps them, see
    tests/unit/test_affinity.py)."""
    env = script_env(SLURM_SUBMIT_DIR=str(REPO))
    argv = dry_run(["bash", SLURM_DIR / "two_gpu.sbatch"], env)
    assert argv == [
        "AREAL_CUDA_DEVICES=generation=0;trainer=1", f"{REPO}/.venv/bin/areal-async", "run",
        "configs/gsm8k_2gpu.yaml", "--no-live",
    ]  # fmt: skip
    argv = dry_run(
        ["bash", SLURM_DIR / "two_gpu.sbatch"], {**env, "AREAL_CUDA_DEVICES": "generation=1;trainer=0"}
    )
    assert argv[0] == "AREAL_CUDA_DEVICES=generation=1;trainer=0"


def test_the_entry_scripts_are_valid_bash() -> None:
    """``bash -n`` accepts every shipped script (sbatch files are bash with #SBATCH comments)."""
    for script in [WORKER_EXEC, *SLURM_DIR.iterdir()]:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script.name}: {result.stderr}"
