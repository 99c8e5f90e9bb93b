"""Scale without the hardware: simulated engines and trainer over the real bus (docs/benchmarks.md "scale_summary").

Three parts, one result each (benchmarks.harness layout), and ``render`` (``benchmarks.scale_report``):

- ``validate``: the simulator fed a measured whole run's profile (``benchmarks/baselines/async__*.json``,
  ``areal_async/simulation/profile.py``) runs that run's shape (batch, group, lengths, engine slots)
  at each of its staleness bounds, and its seconds per step and async/sync ratio are set beside the
  measured ones.
- ``sweep``: 1 -> 8 -> 64 -> 256 simulated engines (``simulation.engines_per_worker`` per process,
  each engine its own bus client) at one or more staleness bounds and trainer ranks, on one
  nats-server started here with monitoring on (``--cluster``: the shipped 3-node cluster). Per case:
  control-plane messages/s and bytes/s through the server(s), nats-server, controller and
  weight-sync CPU (share of one core, from /proc), admission latency (the controller's issue
  bursts), the bus share of the trainer's step, staleness and the share of groups turned away as
  stale, and the weight hand-off to every engine (``weights served`` total_s).
- ``areal``: AReaL's 1.5B setting (3/4 of the GPUs generating) at several GPU counts and staleness
  bounds, beside the paper's reported throughput.

    python -m benchmarks.bench_scale validate --time-scale 1 --out runs/bench-scale-validate
    python -m benchmarks.bench_scale sweep --engines 1,8,64,256 --time-scale 2 --out runs/bench-scale
    python -m benchmarks.bench_scale render

Every modelled duration is scaled by ``--time-scale``; reported times are divided back by it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks import harness
from workers.report import read_jsonl

REPO = harness.REPO
CONFIG = REPO / "configs" / "simulated.yaml"
BASELINES = {
    "cpu-amx-2c": {"max_staleness": (0, 2), "shape": ("4", "8", "16", "32")},
    "h100-80gb-hbm3": {"max_staleness": (0, 2), "shape": ("16", "8", "1024", "128")},
    "h200": {"max_staleness": (0, 2), "shape": ("16", "8", "1024", "128")},
}
"""Whole-run baselines validated: staleness bounds measured, and (batch, group, max_new_tokens,
engine slots) of the run files they were measured with."""

VALIDATE_METRICS: dict[str, harness.Direction] = {"seconds_per_step": "lower", "error": "lower"}
SWEEP_METRICS: dict[str, harness.Direction] = {
    "seconds_per_step": "lower",
    "controller_cpu": "lower",
    "nats_cpu": "lower",
    "bus_share": "lower",
}


def step_stats(run_dir: Path, warmup: int, scale: float, cooldown: int = 0) -> dict[str, Any]:
    """Seconds per step (first to last measured step, as bench_async), the phases and staleness;
    ``cooldown`` leaves the last steps out (the run's end: no task is issued after the last batch,
    so its stragglers gate the last step)."""
    steps = read_jsonl(run_dir / "metrics.jsonl")[warmup:]
    steps = steps[: len(steps) - cooldown] if cooldown else steps
    if len(steps) < 2:
        return {}
    span = steps[-1]["time"] - (steps[0]["time"] - steps[0]["step_s"])
    step_s = sum(s["step_s"] for s in steps)
    return {
        "steps": len(steps),
        "seconds_per_step": span / len(steps) / scale,
        "trained_tokens_per_s": sum(s.get("modelled_tokens", s["loss_tokens"]) for s in steps) / span * scale,
        "wait_s": sum(s["wait_s"] for s in steps) / len(steps) / scale,
        "compute_s": sum(s["compute_s"] for s in steps) / len(steps) / scale,
        "bus_share": sum(s.get("bus_s", 0.0) for s in steps) / step_s,
        "staleness_mean": sum(s["staleness_mean"] for s in steps) / len(steps),
        "staleness_max": max(s["staleness_max"] for s in steps),
    }


def run_cmd(config: Path, overrides: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    cmd = [sys.executable, "-m", "workers", "run", str(config), "--no-live"]
    for o in overrides:
        cmd += ["--set", o]
    with open(log, "wb") as out:
        return subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env).returncode


# ---- validate ------------------------------------------------------------------------------------


def validate(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for hardware, spec in BASELINES.items():
        path = harness.baseline_path("async", hardware)
        measured = {r["max_staleness"]: r for r in json.loads(path.read_text())["results"]}
        batch, group, max_new, slots = spec["shape"]
        case_rows = []
        for eta in spec["max_staleness"]:
            label = f"{hardware}-max_staleness{eta}"
            run_dir = args.out / label
            shutil.rmtree(run_dir, ignore_errors=True)
            overrides = [
                f"name=val-{label}",
                f"dir={run_dir}",
                f"simulation.profile={harness.repo_path(path)}",
                f"simulation.time_scale={args.time_scale}",
                f"rollout.max_staleness={eta}",
                f"trainer.batch_size={batch}",
                f"rollout.group_size={group}",
                f"rollout.sampling.max_new_tokens={max_new}",
                f"rollout.max_batch_size={slots}",
                f"trainer.total_steps={args.steps}",
                "checkpoint.every_steps=1000",
            ]
            rc = run_cmd(CONFIG, overrides, args.out / f"{label}.log")
            stats = step_stats(run_dir, args.warmup, args.time_scale)
            real = measured[eta]
            row = {"case": label, "hardware": hardware, "max_staleness": eta, "returncode": rc, **stats}
            if stats:
                row["measured_seconds_per_step"] = real["seconds_per_step"]
                row["error"] = stats["seconds_per_step"] / real["seconds_per_step"] - 1
            case_rows.append(row)
            print(json.dumps(row), flush=True)
        sync = next((r for r in case_rows if r["max_staleness"] == 0 and "steps" in r), None)
        for r in case_rows:
            if sync is not None and "steps" in r:
                r["speedup"] = sync["seconds_per_step"] / r["seconds_per_step"]
                r["measured_speedup"] = (
                    measured[0]["seconds_per_step"] / measured[r["max_staleness"]]["seconds_per_step"]
                )
                r["speedup_error"] = r["speedup"] / r["measured_speedup"] - 1
        rows += case_rows
    return rows


# ---- sweep ---------------------------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def find_pid(role: str, run_dir: Path) -> int | None:
    """The worker process of ``role`` whose command line names ``run_dir``."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--role" in cmd and role.encode() in cmd and any(str(run_dir).encode() in c for c in cmd):
            return int(proc.name)
    return None


def varz(monitor: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{monitor}/varz", timeout=5) as r:
        return json.loads(r.read())


def jsz(monitor: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{monitor}/jsz", timeout=5) as r:
        return json.loads(r.read())


def sweep_case(
    args: argparse.Namespace,
    engines: int,
    eta: int,
    ranks: int,
    *,
    batch_size: int | None = None,
    time_scale: float | None = None,
    label: str = "",
) -> dict[str, Any]:
    from bus.embedded import EmbeddedServer

    label = label or f"e{engines}-s{eta}-r{ranks}"
    batch_size = batch_size or max(4, args.groups_per_engine * engines)
    scale = time_scale or args.time_scale
    run_dir = args.out / label
    shutil.rmtree(run_dir, ignore_errors=True)
    per = min(engines, args.engines_per_process)
    processes = -(-engines // per)
    server = EmbeddedServer(run_dir / "nats-bench", http_port=-1).start()
    overrides = [
        f"name=scale-{label}",
        f"dir={run_dir}",
        f"bus.url={server.url}",
        f"simulation.profile={args.profile}",
        f"simulation.time_scale={scale}",
        f"simulation.engines_per_worker={per}",
        f"rollout.max_staleness={eta}",
        f"trainer.num_ranks={ranks}",
        f"trainer.batch_size={batch_size}",
        f"trainer.total_steps={args.steps}",
        f"rollout.sampling.max_new_tokens={args.max_new_tokens}",
        "rollout.max_batch_size=32",
        "checkpoint.every_steps=1000",
        *args.set,
    ]
    extra: list[subprocess.Popen[bytes]] = []
    job: subprocess.Popen[bytes] | None = None
    try:
        cmd = [sys.executable, "-m", "workers", "run", str(args.config), "--no-live"]
        for o in overrides:
            cmd += ["--set", o]
        log = open(args.out / f"{label}.log", "wb")  # noqa: SIM115 - closed below
        job = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        for k in range(1, processes):
            fleet = [
                sys.executable,
                "-m",
                "workers.cli",
                "--role",
                "generation",
                "--config",
                str(args.config),
            ]
            for o in overrides:
                fleet += ["--set", o]
            fleet += ["--worker-id", f"fleet{k}"]
            extra.append(
                subprocess.Popen(fleet, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        # Measure from the warm-up's last step to the end: counters and CPU of the server and controller.
        metrics = run_dir / "metrics.jsonl"
        while len(read_jsonl(metrics)) < args.warmup and job.poll() is None:
            time.sleep(0.5)
        pids = {role: find_pid(role, run_dir) for role in ("controller", "weight-sync")}
        assert server.pid is not None and server.monitor_url is not None
        before = varz(server.monitor_url), time.monotonic(), proc_cpu_s(server.pid)
        cpu_before = {role: proc_cpu_s(pid) for role, pid in pids.items() if pid}
        cpu_last = dict(cpu_before)
        store_before = jsz(server.monitor_url).get("storage", 0)
        while job.poll() is None and len(read_jsonl(metrics)) < args.steps:
            time.sleep(0.5)
            for role, pid in pids.items():
                try:
                    cpu_last[role] = proc_cpu_s(pid) if pid else 0.0
                except OSError:
                    pass
            after = varz(server.monitor_url), time.monotonic(), proc_cpu_s(server.pid)
            store_after = jsz(server.monitor_url).get("storage", 0)
        rc = job.wait(timeout=300)
        log.close()
    finally:
        if job is not None and job.poll() is None:  # interrupted: stop the run's workers too
            job.terminate()
            job.wait(timeout=60)
        for p in extra:
            p.terminate()
        for p in extra:
            p.wait(timeout=30)
        server.stop()
    elapsed = after[1] - before[1]
    row: dict[str, Any] = {
        "case": label,
        "engines": engines,
        "processes": processes,
        "max_staleness": eta,
        "trainer_ranks": ranks,
        "returncode": rc,
        **step_stats(run_dir, args.warmup, scale, args.cooldown),
        "msgs_per_s": (
            after[0]["in_msgs"] + after[0]["out_msgs"] - before[0]["in_msgs"] - before[0]["out_msgs"]
        )
        / elapsed,
        "bytes_per_s": (
            after[0]["in_bytes"] + after[0]["out_bytes"] - before[0]["in_bytes"] - before[0]["out_bytes"]
        )
        / elapsed,
        "nats_cpu": (after[2] - before[2]) / elapsed,
        "controller_cpu": (cpu_last["controller"] - cpu_before["controller"]) / elapsed
        if "controller" in cpu_before
        else None,
        "weight_sync_cpu": (cpu_last["weight-sync"] - cpu_before["weight-sync"]) / elapsed
        if "weight-sync" in cpu_before
        else None,
        "time_scale": scale,
        "batch_size": batch_size,
        "nodes": 1,
        "workflow": workflow_of(args),
        "jetstream_store_growth_bytes_per_s": (store_after - store_before) / elapsed,
        "jetstream_storage_bytes": store_after,
        "connections": after[0].get("connections"),
    }
    bursts = [
        line
        for path in (run_dir / "logs").glob("controller*.jsonl")
        for line in read_jsonl(path)
        if line.get("event") == "tasks issued" and "seconds" in line
    ]
    if bursts:  # admission: from the wake-up (a step, a served version, a failure) to its tasks stored
        row["admission_burst_s_mean"] = sum(b["seconds"] for b in bursts) / len(bursts)
        row["admission_burst_s_max"] = max(b["seconds"] for b in bursts)
        row["admission_ms_per_task"] = (
            1e3 * sum(b["seconds"] for b in bursts) / sum(b["count"] for b in bursts)
        )
    row["stale_share"] = stale_share(run_dir, batch_size)
    served = [
        line["total_s"]
        for path in (run_dir / "logs").glob("weight-sync*.jsonl")
        for line in read_jsonl(path)
        if line.get("event") == "weights served" and "total_s" in line
    ]
    if served:
        served.sort()
        row["fanout_s_median"] = served[len(served) // 2] / scale
        row["fanout_s_max"] = served[-1] / scale
    print(json.dumps(row), flush=True)
    return row


def cluster_case(args: argparse.Namespace, engines: int, eta: int, ranks: int) -> dict[str, Any]:
    """``sweep_case`` on the shipped 3-node cluster (scripts/nats/, routes on loopback, per-role users,
    R3 streams): every role runs as its own ``areal-worker`` logged in as its own user, as under
    systemd; server rates and CPU are summed over the three nodes."""
    import anyio

    from bus.embedded import EmbeddedServer
    from tests.helpers.ops_helpers import (
        cluster_configs,
        free_port,
        password_env,
        role_passwords,
        start_together,
    )

    label = f"cluster-e{engines}-s{eta}-r{ranks}"
    run_dir = args.out / label
    shutil.rmtree(run_dir, ignore_errors=True)
    per = min(engines, args.engines_per_process)
    processes = -(-engines // per)
    batch_size = max(4, args.groups_per_engine * engines)
    passwords = role_passwords()
    os.environ.update(password_env(passwords))  # the servers read their users' passwords from it
    mains = cluster_configs(run_dir / "etc", [free_port() for _ in range(3)])
    servers = [
        EmbeddedServer(run_dir / f"store-{k}", config_file=m, http_port=-1) for k, m in enumerate(mains)
    ]
    anyio.run(start_together, servers)
    urls = ",".join(str(s.url) for s in servers)
    overrides = [
        f"name=scale-{label}",
        f"dir={run_dir}",
        f"bus.url={urls}",
        "bus.replicas=3",
        f"simulation.profile={args.profile}",
        f"simulation.time_scale={args.time_scale}",
        f"simulation.engines_per_worker={per}",
        f"rollout.max_staleness={eta}",
        f"trainer.num_ranks={ranks}",
        f"trainer.batch_size={batch_size}",
        f"trainer.total_steps={args.steps}",
        f"rollout.sampling.max_new_tokens={args.max_new_tokens}",
        "rollout.max_batch_size=32",
        "checkpoint.every_steps=1000",
        *args.set,
    ]
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(role: str, worker_id: str) -> None:
        cmd = [sys.executable, "-m", "workers.cli", "--role", role, "--config", str(args.config)]
        for o in [*overrides, f"bus.user={role}"]:
            cmd += ["--set", o]
        env = {**os.environ, "AREAL_NATS_PASSWORD": passwords[role]}
        out = open(run_dir / f"{worker_id}.out", "wb")  # noqa: SIM115 - the child holds it
        procs[worker_id] = subprocess.Popen(
            [*cmd, "--worker-id", worker_id], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
        )

    try:
        scorer = "reward" if workflow_of(args) == "single_turn" else "agent"
        for role in ("controller", scorer, "trainer", "weight-sync"):
            start(role, f"{role}-1")
        for k in range(processes):
            start("generation", f"fleet{k}")
        metrics = run_dir / "metrics.jsonl"
        while len(read_jsonl(metrics)) < args.warmup and procs["trainer-1"].poll() is None:
            time.sleep(0.5)
        monitors = [str(s.monitor_url) for s in servers]
        pids = [s.pid for s in servers]
        ctl = procs["controller-1"].pid

        def sample() -> tuple[int, int, float, float, float]:
            v = [varz(m) for m in monitors]
            return (
                sum(x["in_msgs"] + x["out_msgs"] for x in v),
                sum(x["in_bytes"] + x["out_bytes"] for x in v),
                time.monotonic(),
                sum(proc_cpu_s(p) for p in pids if p),
                proc_cpu_s(ctl),
            )

        before = after = sample()
        while procs["trainer-1"].poll() is None and len(read_jsonl(metrics)) < args.steps:
            time.sleep(0.5)
            after = sample()
        rc = procs["controller-1"].wait(timeout=300)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            p.wait(timeout=60)
        for server in servers:
            server.stop()
    elapsed = after[2] - before[2]
    row: dict[str, Any] = {
        "case": label,
        "engines": engines,
        "processes": processes,
        "max_staleness": eta,
        "trainer_ranks": ranks,
        "returncode": rc,
        "nodes": 3,
        **step_stats(run_dir, args.warmup, args.time_scale, args.cooldown),
        "msgs_per_s": (after[0] - before[0]) / elapsed,
        "bytes_per_s": (after[1] - before[1]) / elapsed,
        "nats_cpu": (after[3] - before[3]) / elapsed,
        "controller_cpu": (after[4] - before[4]) / elapsed,
        "weight_sync_cpu": None,
        "time_scale": args.time_scale,
        "batch_size": batch_size,
        "workflow": workflow_of(args),
        "stale_share": stale_share(run_dir, batch_size),
    }
    print(json.dumps(row), flush=True)
    return row


def workflow_of(args: argparse.Namespace) -> str:
    """The run's ``rollout.workflow`` as ``--set`` gives it (single_turn by default)."""
    sets = [o.split("=", 1)[1] for o in args.set if o.startswith("rollout.workflow=")]
    return sets[-1] if sets else "single_turn"


def stale_share(run_dir: Path, batch_size: int) -> float | None:
    """Groups the trainer's guard turned away (generated, then wasted) per group trained."""
    failed = sum(
        1
        for path in (run_dir / "logs").glob("trainer*.jsonl")
        for line in read_jsonl(path)
        if line.get("event") == "group not trainable"
    )
    steps = len(read_jsonl(run_dir / "metrics.jsonl"))
    return failed / (steps * batch_size) if steps else None


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for eta in [int(x) for x in args.max_staleness.split(",")]:
        for ranks in [int(x) for x in args.ranks.split(",")]:
            for engines in [int(x) for x in args.engines.split(",")]:
                case = cluster_case if args.cluster else sweep_case
                rows.append(case(args, engines, eta, ranks))
    return rows


# ---- AReaL's setting ----------------------------------------------------------------------------

AREAL_PUBLISHED = {
    # Appendix C.3: 8 GPUs, 1.5B, 8k context, 64 prompts x 16 answers; effective training tokens/s.
    (8, 0): 27_100,
    (8, 1): 47_800,
    (8, 2): 47_800,
    (8, 4): 49_000,
    (8, 8): 51_500,
    # Fig. 4 (read from the plot), 1.5B, 16k context, eta as in its math runs (8).
    (32, 8): 29_000,
    (256, 8): 155_000,
}
"""AReaL's reported effective training throughput (tokens/s) by (GPUs, max staleness)."""


def areal(args: argparse.Namespace) -> list[dict[str, Any]]:
    """AReaL's 3/4 inference split at each GPU count and staleness bound; tokens/s beside the paper's."""
    rows = []
    for spec in args.cases.split(","):
        gpus_text, eta_text, scale_text = spec.split(":")
        gpus, eta, scale = int(gpus_text), int(eta_text), float(scale_text)
        engines, ranks = gpus * 3 // 4, gpus // 4
        batch = args.prompts_small if gpus == 8 else args.prompts
        row = sweep_case(
            args, engines, eta, ranks, batch_size=batch, time_scale=scale, label=f"g{gpus}-s{eta}"
        )
        row.update(gpus=gpus, published_tokens_per_s=AREAL_PUBLISHED.get((gpus, eta)))
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    v = sub.add_parser("validate", help="the simulator against the measured whole runs")
    v.add_argument("--steps", type=int, default=10)
    v.add_argument("--warmup", type=int, default=2)
    v.add_argument("--time-scale", type=float, default=0.5)
    s = sub.add_parser("sweep", help="fleet size x staleness x trainer ranks on one nats-server")
    s.add_argument("--config", type=Path, default=CONFIG)
    s.add_argument("--profile", default="configs/profiles/fleet.yaml")
    s.add_argument("--engines", default="1,8,64,256")
    s.add_argument("--engines-per-process", type=int, default=64)
    s.add_argument("--max-staleness", default="2")
    s.add_argument("--ranks", default="8")
    s.add_argument(
        "--groups-per-engine", type=int, default=2, help="trainer.batch_size = max(4, this x engines)"
    )
    s.add_argument("--max-new-tokens", type=int, default=1024)
    s.add_argument("--cluster", action="store_true", help="the shipped 3-node cluster instead of one server")
    s.add_argument("--steps", type=int, default=12)
    s.add_argument("--warmup", type=int, default=3)
    s.add_argument("--cooldown", type=int, default=1, help="leave the last N steps out (the run's drain)")
    s.add_argument("--time-scale", type=float, default=1.0)
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config overrides")
    a = sub.add_parser(
        "areal", help="AReaL's 1.5B setting (3/4 of GPUs generating) vs its reported throughput"
    )
    a.add_argument("--config", type=Path, default=CONFIG)
    a.add_argument("--profile", default="configs/profiles/areal_1p5b.yaml")
    a.add_argument(
        "--cases",
        default="8:0:0.07,8:1:0.07,8:4:0.07,32:0:0.04,32:8:0.04,128:8:0.2,256:0:0.4,256:8:0.4",
        help="GPUS:MAX_STALENESS:TIME_SCALE,... (time_scale chosen for ~10 s of wall time a step)",
    )
    a.add_argument("--prompts", type=int, default=512, help="prompts per step (16 answers each) above 8 GPUs")
    a.add_argument("--prompts-small", type=int, default=64, help="prompts per step at 8 GPUs (Appendix C.3)")
    a.add_argument("--engines-per-process", type=int, default=64)
    a.add_argument("--max-new-tokens", type=int, default=120, help="simulated tokens (x token_scale 64)")
    a.add_argument("--steps", type=int, default=6)
    a.add_argument("--warmup", type=int, default=2)
    a.add_argument("--cooldown", type=int, default=1, help="leave the last N steps out (the run's drain)")
    a.add_argument(
        "--set",
        action="append",
        default=["rollout.group_size=16", "simulation.token_scale=64", "rollout.max_batch_size=256"],
        metavar="KEY=VALUE",
    )
    sub.add_parser("render", help="docs/benchmarks.md's scale section and docs/scale.png from the baselines")
    for part in (v, s, a):
        part.add_argument("--out", type=Path, default=REPO / "runs" / "bench-scale")
        part.add_argument(
            "--save-baseline", action="store_true", help="also write the result as the baseline"
        )
    args = p.parse_args()
    if args.part == "render":
        from benchmarks.scale_report import render

        render()
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "validate":
        rows, name, metrics = validate(args), "scale_validate", VALIDATE_METRICS
    elif args.part == "areal":
        rows, name, metrics = areal(args), "scale_areal", {"trained_tokens_per_s": "higher"}
    else:
        rows, name, metrics = sweep(args), "scale", SWEEP_METRICS
    result = harness.make_result(name, args, rows, metrics, device="cpu")
    result["command"] = result["command"].replace(f"bench_{name}", "bench_scale")
    harness.emit(result, args.out / "result.json", args.save_baseline)


if __name__ == "__main__":
    main()
