"""The inference-engine interface: what a generation worker needs from any backend.

Contract shared by every engine (local transformers, vLLM / SGLang clients):

- `generate(requests)` returns one `GenerationResult` per request, in request order. Concurrent
  callers share the engine's batch; a call returns when all its requests are finished.
- Every completion token comes with its id, the log-prob of that id under the distribution it was
  sampled from (after temperature, top-k, top-p; for temperature 0 the plain softmax of the raw
  logits), and the policy version of the weights that produced it.
- `load_weights(version, location)` may be called while requests are decoding. The engine pauses at the
  next decode-step boundary, loads the weights, drops every KV cache built with the old weights, sets
  `version` BEFORE decoding resumes, and continues each request from prompt + tokens so far. No request
  is lost or restarted, so a completion may mix versions. They usually rise along the sequence, but a
  trainer restored from a checkpoint republishes an older version, so they may also fall.
  (`LocalEngine(kv_after_load="keep")` opts out of dropping the KV: running requests decode on over
  the KV they have; stamps and log-probs stay those of the sampling distribution.
  `kv_after_load="finish"` does not interrupt: the load waits until the running requests are done,
  admitting none meanwhile.)
  `location` is a Hugging Face safetensors checkpoint directory or an in-memory state dict.
  Returns the seconds from the call to decoding resuming.
- A completion ends at the first token in `stop_token_ids` (included in the result, finish_reason
  "stop") or after `max_new_tokens` tokens (finish_reason "length"). The engine adds no stop ids of its
  own: pass the tokenizer's EOS id explicitly.
- Invalid input raises ValueError naming the field, the value and the fix.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self

if TYPE_CHECKING:
    import os

    import torch

FinishReason = Literal["stop", "length"]


class EngineClosedError(RuntimeError):
    """The engine was closed (or never started) while a request needed it."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one completion. Order of processing: temperature, then top-k, then top-p."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax), reported log-probs then use the raw softmax."""

    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches top_p; 1 = off."""

    top_k: int = 0
    """Keep only the k most likely tokens (ties at the k-th value kept); 0 = off."""

    max_new_tokens: int = 64
    """Completion length cap; hitting it gives finish_reason "length"."""

    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the completion (the stop token is part of the completion)."""

    seed: int | None = None
    """Per-request sampling seed: same seed + same prompt + same weights gives the same completion."""

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        stop = self.stop_token_ids
        if isinstance(stop, int) or not isinstance(stop, Sequence):
            raise ValueError(f"stop_token_ids must be a sequence of ints, e.g. (eos_id,), got {stop!r}")
        if not all(_is_int(t) and t >= 0 for t in stop):
            raise ValueError(f"stop_token_ids must hold token ids >= 0, got {stop!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be None or an int >= 0, got {self.seed!r}")


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One prompt to complete. `request_id` is echoed in the result; it need not be unique."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        prompt = self.prompt_ids
        if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence):
            raise ValueError(
                f"request {self.request_id}: prompt_ids must be a sequence of token ids "
                f"(tokenize the text first), got {type(prompt).__name__}"
            )
        if len(prompt) == 0:
            raise ValueError(
                f"request {self.request_id}: prompt_ids is empty; give at least one token (e.g. BOS)"
            )
        if not all(_is_int(t) and t >= 0 for t in prompt):
            raise ValueError(f"request {self.request_id}: prompt_ids must hold ints >= 0")
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in prompt))
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(
                f"request {self.request_id}: sampling must be SamplingParams, got {self.sampling!r}"
            )


@dataclass(frozen=True, kw_only=True)
class GenerationResult:
    """One finished completion. `token_ids`, `logprobs` and `versions` have equal length."""

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    """Policy version of the weights that produced each completion token (non-decreasing)."""
    finish_reason: FinishReason
    stats: dict[str, float] = field(default_factory=dict)
    """Engine-specific scheduling facts (queue time, admission and finish step, prefills, seconds)."""

    @property
    def head_version(self) -> int:
        """The oldest version among the tokens (what staleness is measured from)."""
        return min(self.versions)

    @property
    def tail_version(self) -> int:
        """The newest version among the tokens."""
        return max(self.versions)


class InferenceEngine(abc.ABC):
    """Async inference engine. Use `async with engine:` or call `start()` / `aclose()`."""

    engine_id: str

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Policy version of the weights currently served."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Make the engine ready to serve; returns once it is."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop serving; pending generate() calls raise EngineClosedError. Idempotent."""

    @abc.abstractmethod
    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Complete every request; results in request order."""

    @abc.abstractmethod
    async def load_weights(
        self, version: int, location: str | os.PathLike[str] | Mapping[str, torch.Tensor]
    ) -> float:
        """Swap in new weights mid-generation (see module docstring); returns seconds taken."""

    @abc.abstractmethod
    async def health(self) -> dict[str, Any]:
        """Liveness and load facts: at least engine_id, version, status."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
