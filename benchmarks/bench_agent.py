"""Benchmark the agent path: episodes through the bus to one generation worker, and the bus's share.

Starts an embedded nats-server and one generation worker process (``areal-worker --role
generation``, the run file's engine and model), then runs ``--episodes`` episodes of the run
file's workflow from this process, ``--concurrency`` at a time, each model call going over NATS
request/reply exactly as the agent worker sends it (``workers.agent.BusClient``). No trainer runs,
so the weights stay at version 0. Per case it reports episodes/s, generation calls/s, model
tokens/s, the mean turns per episode and the bus's share of call time: the sum over calls of
(round trip - the worker's own time on the call) over the sum of round trips.

    python -m benchmarks.bench_agent [--config configs/agent_cpu.yaml] [--episodes 64]
        [--concurrency 1,8,32] [--set key=value ...] [--out r.json] [--save-baseline]
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import structlog

from areal_async.agents import WorkflowContext, resolve_workflow
from areal_async.data import load_dataset
from areal_async.models import load_tokenizer
from areal_async.rewards.registry import call_reward, resolve_reward
from areal_async.run_file import load_config
from benchmarks import harness
from bus import ConnectOptions, EmbeddedServer, connect
from workers.agent import BusClient, make_tools
from workers.common import resolve_model_path, run_sampling

METRICS: dict[str, harness.Direction] = {
    "episodes_per_s": "higher",
    "calls_per_s": "higher",
    "bus_share": "lower",
}

READY_TIMEOUT_S = 300.0
"""How long the generation worker may take to load its model and answer a first call."""


class _TimedClient:
    """The agent's ``BusClient``, also summing each call's round trip (the bus share's denominator)."""

    def __init__(self, client: BusClient) -> None:
        self.client = client
        self.round_trip_s = 0.0
        self.tokens = 0

    async def generate(self, prompt_ids: list[int], sampling: Any, episode_id: str = "") -> Any:
        started = time.monotonic()
        result = await self.client.generate(prompt_ids, sampling, episode_id)
        self.round_trip_s += time.monotonic() - started
        self.tokens += len(result.token_ids)
        return result


async def _case(
    cfg: Any, bus: Any, tokenizer: Any, rows: list[dict[str, Any]], concurrency: int
) -> dict[str, Any]:
    client = _TimedClient(BusClient(bus, worker_id=f"bench-{concurrency}", timeout_s=600.0, attempts=1))
    workflow = resolve_workflow(cfg.rollout.workflow)
    reward_fn = resolve_reward(cfg.reward.fn)
    train_sampling, _ = run_sampling(cfg, tokenizer)
    tools = make_tools(cfg.agent.tools, cfg.agent.tool_timeout_s)
    limiter = anyio.CapacityLimiter(concurrency)
    turns: list[int] = []

    async def reward(text: str, row: dict[str, Any]) -> float:
        return call_reward(reward_fn, text, row)

    async def one(i: int) -> None:
        ctx = WorkflowContext(
            tokenizer=tokenizer, sampling=train_sampling, max_turns=cfg.agent.max_turns, tools=tools,
            reward_fn=reward, group_index=i, gamma=cfg.agent.gamma, system_prompt=cfg.model.system_prompt,
            tool_timeout_s=cfg.agent.tool_timeout_s,
        )  # fmt: skip
        async with limiter:
            episode = await workflow(client, dict(rows[i % len(rows)]), ctx)
        turns.append(sum(t.role == "model" for t in episode.turns))

    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        for i in range(len(rows)):
            tg.start_soon(one, i)
    seconds = time.monotonic() - started
    calls = client.client.calls
    return {
        "case": f"c{concurrency}",
        "concurrency": concurrency,
        "episodes": len(rows),
        "seconds": seconds,
        "episodes_per_s": len(rows) / seconds,
        "calls_per_s": calls / seconds,
        "model_tokens_per_s": client.tokens / seconds,
        "turns_mean": sum(turns) / len(turns),
        "bus_s": client.client.bus_s,
        "bus_share": client.client.bus_s / client.round_trip_s,
    }


async def _wait_ready(cfg: Any, bus: Any, tokenizer: Any) -> None:
    """Until the generation worker answers a call (it loads its model first)."""
    client = BusClient(bus, worker_id="bench-probe", timeout_s=READY_TIMEOUT_S, attempts=1)
    sampling, _ = run_sampling(cfg, tokenizer)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            await client.generate(tokenizer.encode("1+1="), sampling)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await anyio.sleep(1.0)


async def _measure(args: argparse.Namespace, cfg: Any, url: str) -> list[dict[str, Any]]:
    bus = await connect(ConnectOptions(url=url, name="bench-agent"), cfg.name)
    try:
        await bus.provision()
        tokenizer = load_tokenizer(resolve_model_path(cfg.model.path))
        d = cfg.dataset
        rows = load_dataset(d.kind, path=d.path, split="train", seed=d.seed, **d.options)[: args.episodes]
        await _wait_ready(cfg, bus, tokenizer)
        results = []
        for c in args.concurrency:
            results.append(await _case(cfg, bus, tokenizer, rows, c))
            harness.print_table(
                results[-1:], ["case", "episodes_per_s", "calls_per_s", "turns_mean", "bus_share"]
            )
        return results
    finally:
        await bus.close()


def _run(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Server and generation worker up, the cases measured, both stopped."""
    server = EmbeddedServer(tmp / "nats").start()
    try:
        overrides = [*args.set, f"bus.url={server.url}", f"dir={tmp / 'run'}", "name=bench-agent"]
        cfg = load_config(args.config, overrides)
        with (tmp / "generation.log").open("wb") as log_file:
            worker = subprocess.Popen(
                [sys.executable, "-m", "workers.cli", "--role", "generation", "--config", str(args.config),
                 *[a for o in overrides for a in ("--set", o)], "--worker-id", "bench-gen"],
                cwd=harness.REPO, stdout=subprocess.DEVNULL, stderr=log_file,
            )  # fmt: skip
            try:
                return anyio.run(_measure, args, cfg, str(server.url))
            finally:
                worker.terminate()
                worker.wait(30)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=harness.REPO / "configs" / "agent_cpu.yaml")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--set", action="append", default=[], help="run-file override key=value")
    harness.add_output_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        results = _run(args, Path(tmp))
    doc = harness.make_result(
        "agent", args, results, METRICS,
        note="Episodes through the bus to one generation worker (no trainer: weights stay at version 0). "
        "bus_share: round trip minus the worker's own time on each call, over the round trips.",
    )  # fmt: skip
    harness.emit(doc, args.out, args.save_baseline)


if __name__ == "__main__":
    main()
