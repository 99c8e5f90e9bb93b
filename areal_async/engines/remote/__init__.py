"""Client side shared by the HTTP inference engines (vLLM, SGLang): routing, interruption, retries.

The servers run elsewhere (their own processes, venvs, machines); we only talk HTTP to them. Contract,
on top of the `InferenceEngine` contract in engines/base.py:

- Ownership. One engine owns its servers: nothing else may pause them or reload their weights, or the
  version stamps below stop being true. Several servers behind one engine are fine.
- Routing. Each request goes to the live, in-sync server with the fewest requests in flight (ties:
  round robin) and is streamed, so the engine always knows which tokens have arrived.
- Exact versions by abort-and-continue. `load_weights` closes the gate (new attempts wait), cancels
  every open stream (tokens received so far are kept, stamped with the version that produced them),
  waits until no stream is open, then on every live server: pause (aborting what is left), reload the
  safetensors directory, drop the prefix cache, resume. It sets the new version, opens the gate, and
  every unfinished request is resubmitted as prompt + tokens so far with the remaining budget. A token
  is accepted only from a stream opened under the version it is stamped with, and no stream is open
  while any server's weights change, so no token can carry the wrong version (a request that reached a
  server only after the pause, and would run on new weights after resume, belongs to a stream that is
  already closed: nothing it produces is read). `version` is updated before any new-weights stream
  opens. Servers' own pause semantics (abort / wait / keep) do not matter for correctness.
- LoRA adapters. `load_weights` of a LoRA adapter directory (areal_async/lora.py; this client must
  read its `adapter_config.json`) loads it on every live server as a runtime adapter named
  `areal-v<version>`, on top of the full weights they serve (the start-up checkpoint, or the last full
  directory loaded), through the same drain -> pause -> install -> reset cache -> resume. Every attempt
  opened afterwards, continuations included, names that adapter; the adapter a server served before is
  then unloaded (no stream is open, so no request uses it). A full directory makes the servers serve
  their model itself again. A revived server gets its base reloaded if it restarted, then the adapter.
  A server that cannot load adapters (e.g. started without LoRA) is refused with the fix in the error.
- Dead servers. A connection error, a 5xx, a malformed reply or a read timeout on a stream marks the
  server dead; its requests continue on another server from the tokens received so far. While a server
  is dead or out of sync, requests probe it at most every `health_interval_s`; once it answers, it is
  brought to the current weights (reload, even if it never restarted) before it serves again.
- Failures. A 4xx is the request's fault: ValueError naming the request, the status and the server's
  message, not retried. A request that gets no usable server for `server_wait_s`, or fails
  `max_retries` attempts in a row without a new token, raises RuntimeError naming each server and
  its last error.
- Continuations of a seeded request use a seed derived from (seed, tokens so far), so a seeded
  completion is reproducible only if it was never interrupted.
- Each result's `stats`: `seconds`, `first_token_s`, `attempts` (streams opened), `interruptions`
  (streams cut by a weight load, or because their server failed), `prefills` (= attempts; each attempt
  re-prefills prompt + tokens).

Concurrency: all state lives on the event loop the engine was started in; use it from that loop only.

Modules: engine.py (RemoteEngine: public API, the attempt loop, the hooks a server API implements),
pool.py (the servers, routing, health and weight sync), gate.py (the load gate and the open streams),
continuation.py (one request across attempts), wire.py (errors, streamed pieces, SSE and HTTP replies).
This package exports what the engine of one server API (vllm.py, sglang.py) builds on.
"""

from areal_async.engines.remote.continuation import Attempt
from areal_async.engines.remote.engine import RemoteEngine
from areal_async.engines.remote.pool import Server
from areal_async.engines.remote.wire import Piece, RemoteRequestError, ServerUnavailable, finite_logprob

__all__ = [
    "Attempt",
    "Piece",
    "RemoteEngine",
    "RemoteRequestError",
    "Server",
    "ServerUnavailable",
    "finite_logprob",
]
