"""SGLangEngine: the InferenceEngine contract on one or more SGLang servers' native API (HTTP only).

Routing, interruption (abort-and-continue), dead-server retries: engines/remote/. What this
module adds is how to talk to SGLang (shapes from sgl-project/sglang's own source, cited in
docs/engines.md; tested here against tests/helpers/fake_sglang.py only, since SGLang has no CPU wheel):

- Generation: `POST /generate` with `input_ids`, `sampling_params` (max_new_tokens, temperature,
  top_p, top_k (-1 = off), min_p 0, our `stop_token_ids`, `ignore_eos: true`, `no_stop_trim: true`,
  `skip_special_tokens: false`, `sampling_seed` when the request has a seed), `return_logprob: true`,
  `logprob_start_len: -1` (output tokens only), `stream: true`, a unique `rid`. Each chunk's
  `meta_info.output_token_logprobs` holds `[logprob, token_id, text]` per output token and
  `meta_info.completion_tokens` the count so far; the client reads new tokens from those two, which
  works whether the server streams cumulative lists (its default) or increments
  (`--incremental-streaming-output`). `meta_info.finish_reason` is null or `{"type": "stop" |
  "length" | "abort", ...}`.
- Log-probs: SGLang reports log(softmax(logits / temperature)) before top-k / top-p filtering
  (python/sglang/srt/layers/sampler.py), and the raw log_softmax for greedy requests. That is the
  sampling distribution when top_k and top_p are off. With top_k > 0 the client asks for the
  `top_logprobs_num = top_k` best log-probs per position (`meta_info.output_top_logprobs`) and
  renormalises over them, which is exact. top_p < 1 is refused (ValueError): SGLang's backends apply
  it differently (before or after the top-k renormalisation), so the filtered log-prob cannot be
  rebuilt exactly.
- Weight update: `POST /pause_generation {"mode": "abort"}`, `POST /update_weights_from_disk
  {"model_path": DIR, "flush_cache": true, "weight_version": "<version>"}`, `POST /flush_cache`
  (a refusal there is only logged: the update already flushed), `POST /continue_generation`.
- LoRA adapters (engines/remote/__init__.py): `POST /load_lora_adapter {"lora_name", "lora_path"}`
  (when a revived server answers that the name is "already loaded", the client unloads and loads it
  again, as SGLang's own implicit reload does), `/generate` requests name it as `"lora_path": <name>`,
  and `POST /unload_lora_adapter {"lora_name"}` drops the previous one (SGLang waits for requests that
  use it). The server needs `--enable-lora --max-lora-rank R --lora-target-modules ...` (`LORA_FLAGS`);
  the "LoRA is not enabled" of a server without them is reported with those flags.
- Liveness: `GET /health`; configuration: `GET /get_model_info` (`model_path`, `weight_version`).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

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

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
LORA_FLAGS = (
    "--enable-lora --max-lora-rank R (R >= the adapter's rank) --lora-target-modules M... (the "
    "adapter's target modules)"
)


class SGLangEngine(RemoteEngine):
    """Client of SGLang servers; see the module docstring and engines/remote/."""

    kind = "sglang"

    def __init__(
        self, server_urls: Sequence[str], *, stream_interval: int | None = None, **kwargs: Any
    ) -> None:
        """`stream_interval`: tokens per streamed chunk (None: the server's default). Others: RemoteEngine."""
        if stream_interval is not None and stream_interval < 1:
            raise ValueError(f"stream_interval must be None or >= 1, got {stream_interval}")
        super().__init__(server_urls, **kwargs)
        self.stream_interval = stream_interval

    def _check_request(self, request: GenerationRequest) -> None:
        sampling = request.sampling
        if sampling.temperature > 0 and sampling.top_p < 1:
            raise ValueError(
                f"request {request.request_id}: top_p={sampling.top_p} is not supported by rollout.engine="
                "sglang: SGLang reports log-probs before top-p filtering and its backends filter "
                "differently, so the sampling log-prob cannot be rebuilt; use top_p=1 (top_k is fine) "
                "or rollout.engine=vllm"
            )

    async def _describe(self, server: Server) -> None:
        if not await self._is_healthy(server):
            raise ServerUnavailable(f"GET {server.url}/health did not answer 200")
        info = await self._get_json(server, "/get_model_info")
        if not isinstance(info, dict):
            raise ServerUnavailable(f"GET {server.url}/get_model_info is not a JSON object")
        server.initial_path = info.get("model_path")
        server.info = {"model_path": info.get("model_path"), "weight_version": info.get("weight_version")}

    async def _stream(
        self, server: Server, request: GenerationRequest, attempt: Attempt
    ) -> AsyncIterator[Piece]:
        sampling = request.sampling
        greedy = sampling.temperature == 0
        top_k = 0 if greedy else sampling.top_k
        params: dict[str, Any] = {
            "max_new_tokens": attempt.max_new_tokens,
            "temperature": float(sampling.temperature),
            "top_p": 1.0,
            "top_k": top_k if top_k > 0 else -1,
            "min_p": 0.0,
            "stop_token_ids": list(sampling.stop_token_ids),
            "ignore_eos": True,
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
        if attempt.seed is not None:
            params["sampling_seed"] = attempt.seed
        if self.stream_interval is not None:
            params["stream_interval"] = self.stream_interval
        payload: dict[str, Any] = {
            "rid": f"{self.engine_id}-{uuid.uuid4().hex}",
            "input_ids": attempt.prompt_ids,
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": True,
        }
        if top_k > 0:
            payload["top_logprobs_num"] = top_k
        if attempt.adapter is not None:
            payload["lora_path"] = attempt.adapter
        what = f"POST {server.url}/generate"
        received = 0
        async with self._post_events(server, "/generate", payload) as events:
            async for event in events:
                piece, received = _piece(event, received, top_k, what)
                yield piece

    async def _pause(self, server: Server) -> None:
        await self._post(server, "/pause_generation", body={"mode": "abort"})

    async def _reload(self, server: Server, path: str, version: int) -> None:
        body = {"model_path": path, "flush_cache": True, "weight_version": str(version)}
        response = await self._post(server, "/update_weights_from_disk", body=body)
        try:
            result = response.json()
        except ValueError as exc:
            raise ServerUnavailable(f"POST {server.url}/update_weights_from_disk: not JSON") from exc
        if not result.get("success", False):
            raise ServerUnavailable(f"update_weights_from_disk failed: {result.get('message', result)}")

    async def _load_adapter(self, server: Server, name: str, path: str) -> None:
        body = {"lora_name": name, "lora_path": path}
        try:
            await self._post(server, "/load_lora_adapter", body=body)
        except RemoteRequestError as exc:
            message = str(exc)
            if "already loaded" in message:  # the test SGLang's tokenizer_manager makes for this case
                await self._unload_adapter(server, name)
                await self._post(server, "/load_lora_adapter", body=body)
            elif "not enabled" in message:
                raise RemoteRequestError(f"{message}; restart the SGLang server with {LORA_FLAGS}") from None
            else:
                raise

    async def _unload_adapter(self, server: Server, name: str) -> None:
        await self._post(server, "/unload_lora_adapter", body={"lora_name": name})

    async def _reset_cache(self, server: Server) -> None:
        try:
            await self._post(server, "/flush_cache")
        except RemoteRequestError as exc:  # refused while requests exist; the update flushed already
            self._log.warning("flush_cache refused", url=server.url, error=str(exc))

    async def _resume(self, server: Server) -> None:
        await self._post(server, "/continue_generation", body={})


def _piece(event: dict[str, Any], received: int, top_k: int, what: str) -> tuple[Piece, int]:
    """The tokens of one /generate chunk that were not seen before, and the new count received."""
    if "error" in event:
        error = event["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise RemoteRequestError(f"{what}: {message}")
    meta = event.get("meta_info")
    if not isinstance(meta, dict):
        raise ServerUnavailable(f"{what}: chunk without meta_info: {str(event)[:200]}")
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise ServerUnavailable(
            f"{what}: no meta_info.output_token_logprobs; the server ignored return_logprob"
        )
    total = int(meta.get("completion_tokens", len(entries)))
    offset = total - len(entries)  # 0 for cumulative chunks, the tokens before this one for increments
    if received < offset or total < received:
        raise ServerUnavailable(
            f"{what}: chunk covers tokens {offset}..{total}, but {received} were received; lost a chunk"
        )
    new = entries[received - offset :]
    tops: list[Any] = []
    if top_k > 0 and new:
        all_tops = meta.get("output_top_logprobs") or []
        top_offset = total - len(all_tops)
        tops = all_tops[received - top_offset :]
        if top_offset > received or len(tops) != len(new):
            raise ServerUnavailable(f"{what}: output_top_logprobs do not line up with the output tokens")
    token_ids: list[int] = []
    logprobs: list[float] = []
    for index, entry in enumerate(new):
        logprob, token = finite_logprob(entry[0]), int(entry[1])
        if top_k > 0:
            logprob = _renormalize_top_k(logprob, token, tops[index], top_k, what)
        token_ids.append(token)
        logprobs.append(logprob)
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        kind = reason.get("type")
        if kind not in _FINISH:
            raise ServerUnavailable(f"{what}: request finished with {reason}")
        finish: str | None = _FINISH[kind]
    elif reason is None:
        finish = None
    else:
        raise ServerUnavailable(f"{what}: unreadable finish_reason {reason!r}")
    return Piece(token_ids=token_ids, logprobs=logprobs, finish_reason=finish), total


def _renormalize_top_k(logprob: float, token: int, top: Any, top_k: int, what: str) -> float:
    """log p(token) under softmax(logits / T) restricted to its top-k tokens (what was sampled from)."""
    if not isinstance(top, list) or len(top) < top_k:
        raise ServerUnavailable(f"{what}: expected {top_k} top log-probs per token, got {str(top)[:200]}")
    best = sorted((finite_logprob(e[0]), int(e[1])) for e in top)[-top_k:]
    if token not in {t for _, t in best}:
        raise ServerUnavailable(f"{what}: sampled token {token} is not among its top-{top_k} log-probs")
    peak = max(lp for lp, _ in best)
    mass = peak + math.log(sum(math.exp(lp - peak) for lp, _ in best))
    return logprob - mass
