"""One request across the attempts a remote engine makes for it (weight loads and dead servers cut them).

Each attempt asks for the prompt + every token received so far, with the remaining `max_new_tokens`
budget, so a cut stream loses nothing: what it delivered stays, stamped with the version of the weights
that produced it. A request is done at its first stop token, at its budget, or when a server reports
"stop" / "length" (e.g. its context length). `failures_in_row` counts consecutive attempts that neither
delivered a token nor were cut by the engine; the engine gives up past its `max_retries`.

Each attempt names the LoRA adapter the engine serves when it opens (`Attempt.adapter`), so a
continuation after a weight load runs on the new adapter. A continuation of a seeded request is
sampled with `continuation_seed(seed, tokens so far)`, so a seeded completion is reproducible only if
it was never interrupted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from areal_async.engines.base import FinishReason, GenerationRequest, GenerationResult
from areal_async.engines.remote.wire import Piece

_SEED_STRIDE = 1_000_003
_SEED_MOD = 2**31 - 1


def continuation_seed(seed: int | None, tokens_so_far: int) -> int | None:
    """The request's seed for its first attempt; a derived one for a continuation."""
    if seed is None or tokens_so_far == 0:
        return seed
    return (seed + _SEED_STRIDE * tokens_so_far) % _SEED_MOD


@dataclass(frozen=True)
class Attempt:
    """What one attempt asks a server for."""

    prompt_ids: list[int]
    """The request's prompt + the tokens received so far."""
    max_new_tokens: int
    """The budget left."""
    seed: int | None
    """The request's seed on a first attempt, `continuation_seed(...)` on a continuation."""
    adapter: str | None = None
    """The LoRA adapter to generate with, by its name on the server; None: the served model itself."""


class Continuation:
    """What one request has received so far, and what its next attempt asks for."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish: FinishReason | None = None
        self.attempts = 0
        self.interruptions = 0
        self.failures_in_row = 0
        self._stop = set(request.sampling.stop_token_ids)
        self._started = time.perf_counter()
        self._first_token_s = -1.0
        self._attempt_start = 0

    def next_attempt(self, adapter: str | None = None) -> Attempt:
        """Count one more attempt; what it asks for (on the LoRA adapter named `adapter`, if any)."""
        self.attempts += 1
        self._attempt_start = len(self.tokens)
        return Attempt(
            prompt_ids=list(self.request.prompt_ids) + self.tokens,
            max_new_tokens=self.request.sampling.max_new_tokens - len(self.tokens),
            seed=continuation_seed(self.request.sampling.seed, len(self.tokens)),
            adapter=adapter,
        )

    def add(self, piece: Piece, version: int) -> int:
        """Keep the piece's tokens, stamped `version`, up to a stop token or the budget; how many kept."""
        kept = 0
        for token, logprob in zip(piece.token_ids, piece.logprobs, strict=True):
            self.tokens.append(token)
            self.logprobs.append(logprob)
            self.versions.append(version)
            kept += 1
            if token in self._stop:
                self.finish = "stop"
            elif len(self.tokens) >= self.request.sampling.max_new_tokens:
                self.finish = "length"
            if self.finish is not None:
                return kept
        if piece.finish_reason in ("stop", "length"):
            self.finish = piece.finish_reason  # type: ignore[assignment]  # e.g. the server's context length
        return kept

    def end_attempt(self, *, interrupted: bool) -> None:
        """Account for the attempt that just ended; `interrupted`: the engine cut its stream."""
        if self._first_token_s < 0 and self.tokens:
            self._first_token_s = time.perf_counter() - self._started
        if interrupted:
            self.interruptions += 1
        if self.finish is not None:
            return
        if len(self.tokens) > self._attempt_start or interrupted:
            self.failures_in_row = 0
        else:
            self.failures_in_row += 1  # a failed or server-aborted attempt that produced nothing

    def result(self) -> GenerationResult:
        assert self.finish is not None, "result() of an unfinished request"
        return GenerationResult(
            request_id=self.request.request_id,
            prompt_ids=self.request.prompt_ids,
            token_ids=self.tokens,
            logprobs=self.logprobs,
            versions=self.versions,
            finish_reason=self.finish,
            stats={
                "seconds": time.perf_counter() - self._started,
                "first_token_s": self._first_token_s,
                "attempts": float(self.attempts),
                "interruptions": float(self.interruptions),
                "prefills": float(self.attempts),
            },
        )
