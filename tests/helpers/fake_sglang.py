"""A fake SGLang server: SGLang's native HTTP API shapes, real tokens and log-probs from a small model.

SGLang has no CPU wheel (docs/engines.md), so the SGLang client is tested against this. Request and
response shapes follow sgl-project/sglang:

- python/sglang/srt/entrypoints/http_server.py: the routes and their replies (`/generate` streams
  `data: {json}\\n\\n` chunks and ends with `data: [DONE]`; `/pause_generation` and
  `/continue_generation` answer `{"message": ..., "status": "ok"}`; `/update_weights_from_disk` answers
  `{"success", "message", "num_paused_requests"}`, 400 on failure; `/flush_cache` answers text, 400
  while requests run; `/health` 200 with an empty body; `/get_model_info`).
- python/sglang/srt/managers/io_struct.py: GenerateReqInput (input_ids, sampling_params,
  return_logprob, logprob_start_len, top_logprobs_num, stream, rid), PauseGenerationReqInput
  (mode: abort | retract | in_place, default abort), UpdateWeightFromDiskReqInput (model_path,
  weight_version, flush_cache, abort_all_requests).
- python/sglang/srt/managers/tokenizer_manager.py: `meta_info` = id, finish_reason (null or
  {"type": "stop", "matched": id} | {"type": "length", "length": n} | {"type": "abort", "message": ..}),
  prompt_tokens, completion_tokens, cached_tokens, weight_version, output_token_logprobs
  ([logprob, token_id, null] per output token), output_top_logprobs (top-n such triples per token).
  Streamed lists are cumulative by default, or increments with `incremental=True`
  (SGLang's --incremental-streaming-output); requests that arrive while paused wait for continue.
- python/sglang/srt/sampling/sampling_params.py and layers/sampler.py: temperature < 1e-6 is greedy
  (argmax, log-prob under the raw softmax); otherwise the token is drawn from softmax(logits / T)
  filtered by top-k / top-p, and the reported log-prob is log(softmax(logits / T)) BEFORE filtering.
  top_k must be -1 (off) or >= 1; top_k = 0 is a 400, as in SGLang.
- LoRA adapters (`enable_lora`, `max_lora_rank`): `/load_lora_adapter`, `/unload_lora_adapter` and
  `/generate` with `lora_path`, applied to the tokens for real; see tests/helpers/fake_sglang_lora.py.

Not modelled: batching across requests (each request decodes with its own KV cache, one token per
scheduler round), the radix cache, text (the `text` field is ""), n > 1, batched inputs.

Test hooks: `token_log` (rid, token, weight_version) for every token the model produced;
`attempts` (rid -> input_ids); `adapters` (rid -> the adapter it named, or None); `kill()` drops the
listening socket and every open connection at once, like a crashed server; `step_delay_s` slows
decoding so tests can interrupt it.

Modules: this one (the scheduler and the model), fake_sglang_http.py (routes and replies),
fake_sglang_lora.py (adapters).

Run alone: python -m tests.helpers.fake_sglang --model-path DIR --port 30000
"""

from __future__ import annotations

import argparse
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from tests.helpers.fake_sglang_http import DONE, BadRequest, handler_class
from tests.helpers.fake_sglang_lora import Loras

_SAMPLING_EPS = 1e-6
_TOP_K_ALL = 1 << 30


@dataclass(eq=False)
class _Request:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: set[int]
    stream: bool
    return_logprob: bool
    top_logprobs_num: int
    stream_interval: int
    generator: torch.Generator
    lora_name: str | None = None
    adapter: Any = None  # the lora.Adapter lora_name resolved to
    out: queue.Queue[Any] = field(default_factory=queue.Queue)
    cache: DynamicCache | None = None
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[list[Any]] = field(default_factory=list)
    top_logprobs: list[list[list[Any]]] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    sent: int = 0


class FakeSGLangServer:
    """Serve `model_path` on host:port (port 0 = any free port) until stop() or kill()."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        step_delay_s: float = 0.0,
        incremental: bool = False,
        seed: int = 0,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
    ) -> None:
        self.model_path = str(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.weight_version = "default"
        self.step_delay_s = step_delay_s
        self.incremental = incremental
        self.token_log: list[tuple[str, int, str]] = []
        self.attempts: dict[str, list[int]] = {}
        self.adapters: dict[str, str | None] = {}
        self.loras = Loras(self.model, enabled=enable_lora, max_rank=max_lora_rank)
        self.updates = 0
        self._seed = seed
        self._requests = 0
        self._cond = threading.Condition()
        self._model_lock = threading.Lock()
        self._active: dict[str, _Request] = {}
        self._paused = False
        self._stopping = False
        self._connections: set[socket.socket] = set()
        self._httpd = ThreadingHTTPServer((host, port), handler_class(self))
        self._httpd.daemon_threads = True
        self._threads: list[threading.Thread] = []

    # ----------------------------------------------------------------- lifecycle

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self._httpd.server_address[0]}:{self.port}"

    def start(self) -> FakeSGLangServer:
        for target, name in ((self._httpd.serve_forever, "http"), (self._schedule, "scheduler")):
            thread = threading.Thread(target=target, name=f"fake-sglang-{name}-{self.port}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Shut down: open streams end abruptly, new connections are refused."""
        self.kill()

    def kill(self) -> None:
        """Like a crash: stop the scheduler, close the listening socket and every open connection."""
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._cond.notify_all()
            active = list(self._active.values())
            self._active.clear()
            connections = list(self._connections)
        if self._threads:
            self._httpd.shutdown()
        self._httpd.server_close()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        for request in active:
            request.out.put(DONE)
        for thread in self._threads:
            thread.join(timeout=5)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def connected(self, connection: socket.socket, is_open: bool) -> None:
        """Track the open connections (kill() drops them all)."""
        with self._cond:
            if is_open:
                self._connections.add(connection)
            else:
                self._connections.discard(connection)

    def __enter__(self) -> FakeSGLangServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ scheduler

    def _schedule(self) -> None:
        torch.set_num_threads(1)
        while True:
            with self._cond:
                while not self._stopping and (self._paused or not self._active):
                    self._cond.wait()
                if self._stopping:
                    return
                batch = list(self._active.values())
            for request in batch:
                with self._model_lock:
                    with self._cond:
                        if self._paused or self._stopping or request.rid not in self._active:
                            break
                    self._step(request)
                if self.step_delay_s:
                    time.sleep(self.step_delay_s)

    def _step(self, request: _Request) -> None:
        """One token for one request (under the model lock)."""
        self.loras.apply(request.adapter)
        with torch.inference_mode():
            if request.cache is None:  # prefill (also after a retract dropped the cache)
                ids = torch.tensor([request.input_ids + request.output_ids])
                request.cache = DynamicCache(config=self.model.config)
            else:
                ids = torch.tensor([[request.output_ids[-1]]])
            logits = self.model(input_ids=ids, cache=request.cache, use_cache=True).logits[0, -1].float()
        token, logprob, top = _sample(logits, request)
        request.output_ids.append(token)
        request.token_logprobs.append([logprob, token, None])
        if request.top_logprobs_num:
            request.top_logprobs.append(top)
        self.token_log.append((request.rid, token, self.weight_version))
        if token in request.stop_token_ids:
            request.finish_reason = {"type": "stop", "matched": token}
        elif len(request.output_ids) >= request.max_new_tokens:
            request.finish_reason = {"type": "length", "length": request.max_new_tokens}
        count = len(request.output_ids)
        if request.finish_reason is not None:
            with self._cond:
                self._active.pop(request.rid, None)
            self._emit(request, final=True)
        elif request.stream and (count == 1 or count % request.stream_interval == 0):
            self._emit(request, final=False)

    def _emit(self, request: _Request, *, final: bool) -> None:
        meta: dict[str, Any] = {
            "id": request.rid,
            "finish_reason": request.finish_reason,
            "prompt_tokens": len(request.input_ids),
            "weight_version": self.weight_version,
            "completion_tokens": len(request.output_ids),
            "cached_tokens": 0,
        }
        start = request.sent if (request.stream and self.incremental) else 0
        if request.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [list(e) for e in request.token_logprobs[start:]]
            if request.top_logprobs_num:
                meta["input_top_logprobs"] = []
                meta["output_top_logprobs"] = [[list(e) for e in top] for top in request.top_logprobs[start:]]
        if final:
            meta["e2e_latency"] = 0.0
        out = {"text": "", "output_ids": list(request.output_ids[start:]), "meta_info": meta}
        request.sent = len(request.output_ids)
        if request.stream or final:
            request.out.put(out)
        if final:
            request.out.put(DONE)

    def _abort_all(self, message: str) -> int:
        """Finish every active request with finish_reason abort (caller holds the model lock)."""
        with self._cond:
            aborted = list(self._active.values())
            self._active.clear()
        for request in aborted:
            request.finish_reason = {"type": "abort", "message": message}
            self._emit(request, final=True)
        return len(aborted)

    # ------------------------------------------------------------------- routes

    def generate(self, body: dict[str, Any]) -> _Request:
        if body.get("text") is not None or body.get("input_ids") is None:
            raise BadRequest("this fake takes input_ids only")
        input_ids = body["input_ids"]
        if not isinstance(input_ids, list) or not input_ids or not all(isinstance(t, int) for t in input_ids):
            raise BadRequest("input_ids must be a non-empty list of token ids")
        if any(t < 0 or t >= self.vocab_size for t in input_ids):
            raise BadRequest(f"The input_ids contain ids outside the vocabulary (size {self.vocab_size}).")
        params = dict(body.get("sampling_params") or {})
        temperature = float(params.get("temperature", 1.0))
        top_p = float(params.get("top_p", 1.0))
        top_k = int(params.get("top_k", -1))
        max_new_tokens = int(params.get("max_new_tokens", 128))
        if temperature < 0:
            raise BadRequest(f"temperature must be a non-negative finite number, got {temperature}.")
        if not 0.0 < top_p <= 1.0:
            raise BadRequest(f"top_p must be in (0, 1], got {top_p}.")
        if top_k == 0 or top_k < -1:
            raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
        if max_new_tokens < 0:
            raise BadRequest(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
        if 0 <= temperature < _SAMPLING_EPS:
            temperature, top_k = 1.0, 1
        rid = str(body.get("rid") or uuid.uuid4().hex)
        with self._cond:
            self._requests += 1
            seed = params.get("sampling_seed")
            generator = torch.Generator().manual_seed(
                int(seed) if seed is not None else self._seed * 1_000_003 + self._requests
            )
        request = _Request(
            rid=rid,
            input_ids=list(input_ids),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=_TOP_K_ALL if top_k == -1 else top_k,
            stop_token_ids={int(t) for t in params.get("stop_token_ids") or []},
            stream=bool(body.get("stream", False)),
            return_logprob=bool(body.get("return_logprob", False)),
            top_logprobs_num=int(body.get("top_logprobs_num") or 0),
            stream_interval=max(1, int(params.get("stream_interval") or 1)),
            generator=generator,
        )
        with self._cond:
            while self._paused and not self._stopping:  # like TokenizerManager's is_pause wait
                self._cond.wait()
            if self._stopping:
                raise ConnectionAbortedError("server stopped")
            if body.get("lora_path"):
                request.lora_name = str(body["lora_path"])
                request.adapter = self.loras.resolve(request.lora_name)
            self.attempts[rid] = list(input_ids)
            self.adapters[rid] = request.lora_name
            self._active[rid] = request
            self._cond.notify_all()
        return request

    def cancel(self, request: _Request) -> None:
        """The client went away: drop the request (SGLang aborts on disconnect)."""
        with self._cond:
            self._active.pop(request.rid, None)

    def pause(self, mode: str) -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place'].")
        with self._cond:
            self._paused = True
        with self._model_lock:  # the step in progress ends first
            if mode == "abort":
                self._abort_all("Abort by pause_generation.")
            elif mode == "retract":
                with self._cond:
                    for request in self._active.values():
                        request.cache = None

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def update_weights(self, body: dict[str, Any]) -> tuple[bool, str]:
        path = Path(str(body.get("model_path", "")))
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            return False, f"Failed to get weights iterator: no *.safetensors in {path}."
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(file))
        params = dict(self.model.named_parameters(remove_duplicate=False))
        unknown = sorted(set(state) - set(params))
        if unknown:
            return False, f"Failed to update weights: unknown parameter {unknown[0]}."
        with self._cond:
            while self._active and not self._paused and not body.get("abort_all_requests"):
                self._cond.wait(timeout=0.05)  # SGLang's writer lock waits for running requests
        with self._model_lock:
            if body.get("abort_all_requests"):
                self._abort_all("Abort by update_weights_from_disk.")
            self.loras.apply(None)  # adapters apply to whatever base weights the server holds
            with torch.no_grad():
                for name, tensor in state.items():
                    params[name].copy_(tensor)
            for request in self._active.values():
                request.cache = None  # flush: running requests re-prefill with the new weights
            self.model_path = str(path)
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
            self.updates += 1
        return True, "Succeeded to update model weights."

    def unload_lora(self, name: Any) -> str | None:
        """Unregister the adapter, then wait until no running request uses it; the error, or None."""
        error = self.loras.unregister(name)
        with self._cond:
            while (
                error is None
                and not self._stopping
                and any(r.lora_name == name for r in self._active.values())
            ):
                self._cond.wait(timeout=0.05)
        return error

    def flush_cache(self) -> bool:
        with self._cond:
            return not self._active

    def abort(self, body: dict[str, Any]) -> None:
        with self._model_lock:
            if body.get("abort_all"):
                self._abort_all("Abort by abort_request.")
                return
            with self._cond:
                request = self._active.pop(str(body.get("rid", "")), None)
            if request is not None:
                request.finish_reason = {"type": "abort", "message": "Abort by abort_request."}
                self._emit(request, final=True)

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
        }


def _sample(logits: torch.Tensor, request: _Request) -> tuple[int, float, list[list[Any]]]:
    """SGLang's sampler on one row: token, reported log-prob, top-n [logprob, id, None] triples."""
    if request.top_k == 1:  # greedy: argmax, raw log_softmax
        logprobs = logits.log_softmax(-1)
        token = int(logits.argmax())
    else:
        scaled = logits / request.temperature
        logprobs = scaled.log_softmax(-1)  # reported before top-k / top-p filtering
        probs = scaled.softmax(-1)
        probs_sort, order = probs.sort(descending=True)
        mass = probs_sort.cumsum(-1)
        probs_sort[(mass - probs_sort) > request.top_p] = 0.0
        probs_sort[torch.arange(probs_sort.numel()) >= request.top_k] = 0.0
        index = torch.multinomial(probs_sort / probs_sort.sum(), 1, generator=request.generator)
        token = int(order[index])
    top: list[list[Any]] = []
    if request.top_logprobs_num:
        values, ids = logprobs.topk(request.top_logprobs_num)
        top = [[float(v), int(i), None] for v, i in zip(values, ids, strict=True)]
    return token, float(logprobs[token]), top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--step-delay-s", type=float, default=0.0)
    parser.add_argument("--incremental-streaming-output", action="store_true")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-lora-rank", type=int, default=16)
    args = parser.parse_args()
    server = FakeSGLangServer(
        args.model_path,
        host=args.host,
        port=args.port,
        step_delay_s=args.step_delay_s,
        incremental=args.incremental_streaming_output,
        enable_lora=args.enable_lora,
        max_lora_rank=args.max_lora_rank,
    ).start()
    print(f"fake sglang serving {args.model_path} on {server.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
