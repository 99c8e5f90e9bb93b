"""LoRA adapters for tests/helpers/fake_sglang.py: SGLang's runtime adapter API, applied for real.

Shapes and messages follow sgl-project/sglang:

- python/sglang/srt/entrypoints/http_server.py: `POST /load_lora_adapter {"lora_name", "lora_path",
  "pinned"}` and `POST /unload_lora_adapter {"lora_name"}` answer a LoRAUpdateOutput
  `{"success", "error_message", "loaded_adapters"}`, 200 on success and 400 otherwise.
- python/sglang/srt/managers/tokenizer_control_mixin.py: without `--enable-lora` both answer "LoRA is
  not enabled. Please set `--enable-lora` to enable LoRA."; unloading first unregisters the name (no
  new request can use it), then waits until no running request uses it.
- python/sglang/srt/lora/lora_manager.py: a name that is loaded already, or a rank above
  `--max-lora-rank`, is refused (the messages below).
- python/sglang/srt/managers/tokenizer_manager.py (`_validate_and_resolve_lora`): a `/generate` request
  whose `lora_path` names an adapter fails with a ValueError when LoRA is not enabled or the adapter
  was never loaded (a streamed request gets it as a `data: {"error": {"message": ...}}` event); one
  naming an adapter that was loaded and then unloaded loads it again implicitly.

SGLang computes `W x + scale * B (A x)` for the requests that name an adapter. The fake merges
`W + scale * B @ A` into the weights (areal_async.lora.merge) while such a request steps and restores
them for the next request without it: the same function up to float rounding, applied to whatever
weights the server holds at that moment (also after /update_weights_from_disk).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from areal_async import lora

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class LoraRequestError(Exception):
    """What SGLang raises as a ValueError while admitting a /generate request (reported, not a 400)."""


class Loras:
    """The adapters of one fake server: its registry, and which one the model computes with now."""

    def __init__(self, model: nn.Module, *, enabled: bool, max_rank: int) -> None:
        self.model = model
        self.enabled = enabled
        self.max_rank = max_rank
        self.loaded: dict[str, lora.Adapter] = {}
        self.paths: dict[str, str] = {}
        """Every name ever loaded -> its path (SGLang's lora_ref_cache, for implicit reloads)."""
        self._lock = threading.Lock()
        self._applied: lora.Adapter | None = None
        self._base: dict[str, torch.Tensor] = {}

    def reply(self, error: str | None) -> tuple[int, dict[str, Any]]:
        """HTTP status and LoRAUpdateOutput body of a load or unload."""
        with self._lock:
            loaded = {name: self.paths[name] for name in self.loaded}
        body = {"success": error is None, "error_message": error, "loaded_adapters": loaded}
        return (200 if error is None else 400), body

    def load(self, name: Any, path: Any) -> str | None:
        """Load the adapter directory `path` as `name`; the error message, or None."""
        if not self.enabled:
            return NOT_ENABLED
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return "LoRARef must have both lora_name and lora_path set for loading."
        with self._lock:
            if name in self.loaded:
                return f"Failed to load LoRA adapter {name} because it is already loaded"
        try:
            adapter = lora.read_adapter_dir(path)
        except Exception as exc:  # noqa: BLE001 (SGLang reports whatever loading raised)
            return str(exc)
        if adapter.rank > self.max_rank:
            return (
                f"LoRA adapter {name} with rank {adapter.rank} is incompatible with the current LoRA memory "
                "pool configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
            )
        params = dict(self.model.named_parameters())
        missing = [w for w in lora.targeted_weights(adapter) if w not in params]
        if missing:
            return f"LoRA adapter {name} targets {missing[0]}, which the model does not have."
        with self._lock:
            self.loaded[name] = adapter
            self.paths[name] = path
        return None

    def unregister(self, name: Any) -> str | None:
        """Stop new requests from using `name`; the error message, or None (the caller then waits
        until no running request uses it)."""
        if not self.enabled:
            return NOT_ENABLED
        with self._lock:
            if name not in self.loaded:
                return f"LoRA with name {name} does not exist. Loaded LoRAs: {self.loaded.keys()}"
            del self.loaded[name]
        return None

    def resolve(self, name: str) -> lora.Adapter:
        """The adapter a /generate request names (loaded again if it was unloaded); LoraRequestError."""
        if not self.enabled:
            raise LoraRequestError(
                f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server "
                "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter "
                "endpoint."
            )
        with self._lock:
            adapter, path = self.loaded.get(name), self.paths.get(name)
            known = self.paths.keys()
        if adapter is not None:
            return adapter
        if path is None:
            raise LoraRequestError(
                f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: {known}."
            )
        error = self.load(name, path)
        if error is not None and "already loaded" not in error:
            raise LoraRequestError(f"Failed to implicitly load LoRA adapter {name}: {error}")
        with self._lock:
            return self.loaded[name]

    def apply(self, adapter: lora.Adapter | None) -> None:
        """Make the model compute with `adapter` (None: the weights it holds); caller holds the model lock."""
        if adapter is self._applied:
            return
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for weight, base in self._base.items():
                params[weight].copy_(base)
            self._base = {}
            if adapter is not None:
                self._base = {w: params[w].detach().clone() for w in lora.targeted_weights(adapter)}
                for weight, merged in lora.merge(self._base, adapter.tensors, adapter.scale).items():
                    params[weight].copy_(merged)
        self._applied = adapter
