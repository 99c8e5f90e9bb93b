"""LoRA versions on the local engine: the adapter merged into the weights, and on the CPU a new
adapter served before its merge lands.

Merging adds `scale * B @ A` to every targeted weight, one `addmm` over the whole weight (see
`areal_async/lora.py`). On a GPU that takes milliseconds and happens before the version is served.
On one CPU core it is the longest part of a version's hand-off (about 50 ms for a 135M model's
linear layers), so there the engine serves a new adapter at once, unmerged: forward hooks on the
targeted linear modules add `x A^T (scale B)^T - x A_m^T (scale_m B_m)^T` in low rank, where
`A_m, B_m` is the adapter merged into the weights now (none at first: the weights are the base).
A worker thread merges the new adapter meanwhile; at the first step boundary after it finishes, the
decode thread installs the merged weights and removes the hooks. Both compute the same function up
to rounding, so every token of a version is sampled from that version's weights; decoding pays
two small matmuls per targeted module only until the merge lands.

Threads: `serve_unmerged`, `land` and `reset` run on the decode thread (or before it starts);
`start_merge` and `wait_landed` on the engine's side. One merge is in flight at a time: the
engine waits for the last one to land before it starts a load.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from areal_async import lora

Merged = dict[str, torch.Tensor]


class AdapterServing:
    """Which adapter the weights hold, the hooks of one served unmerged, and its merge in flight."""

    def __init__(self, model: nn.Module, params: Mapping[str, torch.Tensor]) -> None:
        self._model = model
        self._params = params
        self.merged: lora.Adapter | None = None
        """The adapter merged into the weights (None: the weights are a base, no adapter)."""
        self._hooks: list[Any] = []
        self._merge: Future[Merged] | None = None
        self._merging: lora.Adapter | None = None
        self._landed = threading.Event()
        self._landed.set()
        self._executor: ThreadPoolExecutor | None = None
        self._log = structlog.get_logger("areal_async.lora")

    @property
    def unmerged(self) -> bool:
        """An adapter is served through hooks now."""
        return bool(self._hooks)

    def check(self, adapter: lora.Adapter) -> None:
        """Raise before anything is paused if `adapter` does not fit the model's weights."""
        for weight, (a, b) in lora.adapter_pairs(adapter.tensors).items():
            param = self._params.get(weight)
            lora.check_fits(weight, None if param is None else param.shape, a, b)

    # ------------------------------------------------------------------ decode thread

    def serve_unmerged(self, hooks: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """Install `hooks` (from `unmerged_hooks`): the weights now compute the new version."""
        self._remove_hooks()
        for module, down, up in hooks:
            hook = _low_rank_hook(down, up)
            self._hooks.append(self._model.get_submodule(module).register_forward_hook(hook))

    def merge_done(self) -> bool:
        return self._merge is not None and self._merge.done()

    def land(self, install: Callable[[Merged], None]) -> None:
        """Install the finished merge (`install` copies or adopts the tensors) and drop the hooks;
        a failed merge is logged and the hooks stay, so the version is still served exactly."""
        assert self._merge is not None and self._merging is not None
        future, adapter = self._merge, self._merging
        self._merge = self._merging = None
        try:
            install(future.result())
        except Exception:
            self._log.exception("adapter merge failed; serving it unmerged")
        else:
            self._remove_hooks()
            self.merged = adapter
        finally:
            self._landed.set()

    def reset(self) -> None:
        """Full weights were installed: they hold no adapter."""
        self._remove_hooks()
        self.merged = None

    # ------------------------------------------------------------------ engine side

    def unmerged_hooks(self, adapter: lora.Adapter) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """`(module, down, up)` per targeted module: `x down^T up^T` turns the weights, which hold
        `merged`, into `adapter`'s version (made off the decode thread, while no load can change
        `merged`)."""
        terms = [(lora.adapter_pairs(adapter.tensors), adapter.scale)]  # add the new adapter's term
        if self.merged is not None:  # and take the merged one's out
            terms.append((lora.adapter_pairs(self.merged.tensors), -self.merged.scale))
        out = []
        for weight in sorted({w for pairs, _ in terms for w in pairs}):
            param = self._params[weight]
            downs, ups = [], []
            for pairs, scale in terms:
                if weight in pairs:
                    a, b = pairs[weight]
                    downs.append(a.to(param.device, param.dtype))
                    ups.append((b * scale).to(param.device, param.dtype))
            out.append((weight.removesuffix(".weight"), torch.cat(downs), torch.cat(ups, dim=1)))
        return out

    def start_merge(
        self, merge: Callable[[lora.Adapter], Merged], adapter: lora.Adapter, wake: Callable[[], None]
    ) -> None:
        """Run `merge(adapter)` on the worker thread; `wake` tells the decode thread it finished."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="lora-merge")
        self._landed.clear()
        self._merging = adapter
        self._merge = self._executor.submit(merge, adapter)
        self._merge.add_done_callback(lambda _: wake())

    def wait_landed(self) -> None:
        """Block until no merge is in flight (run it in a worker thread)."""
        self._landed.wait()

    def abandon(self) -> None:
        """The engine closed: no merge will land."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._landed.set()

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _low_rank_hook(down: torch.Tensor, up: torch.Tensor) -> Callable[..., torch.Tensor]:
    """A forward hook adding `x down^T up^T` to a linear module's output (`down [k, in]`, `up [out, k]`)."""

    def add(_module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        return out + F.linear(F.linear(args[0], down), up)

    return add
