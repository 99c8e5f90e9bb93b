"""LocalEngine: an in-process transformers inference engine; its guarantees are in `engine.py`.

Modules: `engine` (the public API, used from the event loop), `decode_loop` (the decode thread),
`kv` (the KV-store interface and the "dynamic" layout), `slots` (the "slots" layout), `sampling`
(token draws and their log-probs).
"""

from areal_async.engines.local.engine import LocalEngine
from areal_async.engines.local.kv import cache_kwarg
from areal_async.engines.local.sampling import decode_draws, sample_tokens
from areal_async.engines.local.slots import slot_decode_forward, slot_prefill_step

__all__ = [
    "LocalEngine",
    "cache_kwarg",
    "decode_draws",
    "sample_tokens",
    "slot_decode_forward",
    "slot_prefill_step",
]
