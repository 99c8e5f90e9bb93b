"""Small pieces several roles share: model resolution, weight-path checks, KV records.

Weight locations arrive in events; before anything is loaded they are checked to lie
inside ``<run_dir>/weights`` (or the configured model path for version 0), so a forged
event cannot make a worker read arbitrary files. Nothing on the wire is ever unpickled.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgpack

from areal_async.config import RunConfig
from areal_async.errors import ConfigError
from bus import StreamUnavailable

if TYPE_CHECKING:
    from bus import Bus

WEIGHTS_SERVED_KEY = "weights.served"
WEIGHTS_PUBLISHED_KEY = "weights.published"
RUN_ENDED_KEY = "run.ended"


def resolve_model_path(path: str) -> str:
    """``smollm2`` means the converted copy of the bundled GGUF; anything else is used as given."""
    if path == "smollm2":
        from areal_async.models import prepare_smollm2

        return str(prepare_smollm2(None))
    return path


def weights_root(cfg: RunConfig) -> Path:
    return cfg.weights_root.resolve()


def weights_dir(cfg: RunConfig, version: int) -> Path:
    return weights_root(cfg) / f"v{version}"


def checked_weights_path(cfg: RunConfig, path: str) -> Path:
    """``path`` resolved, if it lies inside the run's weights root; ConfigError otherwise."""
    resolved = Path(path).resolve()
    root = weights_root(cfg)
    if resolved != root and root not in resolved.parents:
        raise ConfigError(
            f"weights location {path!r} is outside the run's weights root {root}; refusing to load it "
            "(weights.* events must point into weight_sync.dir, default <run_dir>/weights)"
        )
    return resolved


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line (small and synchronous: a line per step or eval round)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def pack_record(**fields: Any) -> bytes:
    return msgpack.packb(fields)


def unpack_record(entry: Any) -> dict[str, Any] | None:
    """The dict stored in a KV entry (``bus.kv_get`` result), or None when absent."""
    raw = getattr(entry, "value", entry)
    if raw is None:
        return None
    data = msgpack.unpackb(raw)
    return data if isinstance(data, dict) else None


async def state_records(bus: Bus, key: str, every_s: float) -> AsyncIterator[dict[str, Any] | None]:
    """The record under ``key`` in the ``state`` bucket, read every ``every_s`` seconds.

    Core NATS events (``weights.served``, ``weights.published``, ``run.ended``) published while a
    worker is disconnected, or before its interest has reached the publisher's node after a
    reconnect, are lost; each is also written to a ``state`` key, and a worker that acts on one
    re-reads that key with this, so a lost event delays it by at most ``every_s``. A read during a
    JetStream election that outlasts the bus's leader wait is skipped, not raised.
    """
    while True:
        await anyio.sleep(every_s)
        try:
            yield unpack_record(await bus.kv_get("state", key))
        except StreamUnavailable:
            continue
