"""Episodes: the token record of one multi-turn conversation, ready for training.

An ``Episode`` is a sequence of ``Turn``s. The first turn is the ``prompt`` (the rendered
opening messages); after it come ``model`` turns (what the policy generated) and context turns
(``user``, ``tool``, ``environment``: text the conversation added between model turns). The
episode's token sequence is the concatenation of its turns' token ids, exactly as produced:
model turns hold the ids the engine sampled, never a decode/re-encode of their text.

Per token the episode holds

- ``token_ids``;
- ``logprobs``: the behaviour log-prob of a generated token (0.0 for context tokens);
- ``versions``: the policy version that produced a generated token (-1 for context tokens);
- ``loss_mask``: 1 for tokens the model generated, 0 for prompt, user, tool and environment tokens.

Rewards live on model turns (a context turn's reward must be 0). With ``gamma`` in (0, 1] the
episode reward is ``sum_k gamma**k * r_k`` over the model turns k = 0, 1, ... in order:
``gamma = 1`` sums the per-turn rewards, ``gamma < 1`` discounts later turns.

``head_version`` is the oldest version among the trained (mask 1) tokens and ``tail_version`` the
newest; both are -1 when the episode holds no model tokens. Versions may grow between turns (the
engine loaded new weights mid-episode) or within one (a load mid-decode).

Invalid input raises ValueError naming the turn, the field and the value. ``to_dict`` /
``from_dict`` give a msgpack-able dict (lists, str, int, float only) and back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from areal_async.engines.base import GenerationResult

TurnRole = Literal["prompt", "model", "user", "tool", "environment"]
TURN_ROLES: tuple[str, ...] = get_args(TurnRole)
CONTEXT_VERSION = -1
"""Policy version recorded for tokens the model did not generate."""


@dataclass(frozen=True, kw_only=True)
class Turn:
    """One contiguous span of the episode's tokens, all from the model or all from the context.

    Model turns carry one log-prob and one policy version per token. Context turns leave
    ``logprobs`` and ``versions`` empty: they are filled with 0.0 and -1.
    """

    role: TurnRole
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] = ()
    versions: tuple[int, ...] = ()
    text: str = ""
    """Readable text of the turn (for a model turn: its content without the stop token)."""
    reward: float = 0.0
    """Reward of a model turn; context turns carry 0."""
    finish_reason: str = ""
    """Why a model turn ended ("stop" or "length"); empty for context turns."""

    def __post_init__(self) -> None:
        where = f"{self.role!r} turn"
        if self.role not in TURN_ROLES:
            raise ValueError(f"turn role must be one of {TURN_ROLES}, got {self.role!r}")
        ids = _as_tuple(self.token_ids, where, "token_ids")
        if not ids:
            raise ValueError(f"{where}: token_ids is empty; every turn holds at least one token")
        if not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"{where}: token_ids must be ints >= 0, got {list(ids)[:8]}...")
        logprobs = _as_tuple(self.logprobs, where, "logprobs")
        versions = _as_tuple(self.versions, where, "versions")
        n = len(ids)
        if self.trained:
            if len(logprobs) != n or len(versions) != n:
                raise ValueError(
                    f"{where}: token_ids, logprobs and versions must have equal lengths, got "
                    f"{n}, {len(logprobs)}, {len(versions)}; take all three from one GenerationResult"
                )
            if not all(_is_int(v) and v >= 0 for v in versions):
                raise ValueError(f"{where}: versions of generated tokens must be ints >= 0, got {versions}")
        else:
            if len(logprobs) not in (0, n) or any(x != 0 for x in logprobs):
                raise ValueError(f"{where}: context tokens have logprob 0.0; leave logprobs empty")
            if len(versions) not in (0, n) or any(v != CONTEXT_VERSION for v in versions):
                raise ValueError(
                    f"{where}: context tokens have version {CONTEXT_VERSION}; leave versions empty"
                )
            logprobs, versions = (0.0,) * n, (CONTEXT_VERSION,) * n
        if not all(isinstance(x, int | float) and math.isfinite(x) for x in logprobs):
            raise ValueError(f"{where}: logprobs must be finite numbers")
        if not isinstance(self.reward, int | float) or not math.isfinite(self.reward):
            raise ValueError(f"{where}: reward must be a finite number, got {self.reward!r}")
        if not self.trained and self.reward != 0:
            raise ValueError(f"{where}: only model turns carry a reward, got {self.reward}")
        object.__setattr__(self, "token_ids", tuple(int(t) for t in ids))
        object.__setattr__(self, "logprobs", tuple(float(x) for x in logprobs))
        object.__setattr__(self, "versions", tuple(int(v) for v in versions))
        object.__setattr__(self, "reward", float(self.reward))

    @classmethod
    def from_result(cls, result: GenerationResult, *, text: str = "") -> Turn:
        """A model turn holding exactly the ids, log-probs and versions of ``result``."""
        return cls(
            role="model",
            token_ids=tuple(result.token_ids),
            logprobs=tuple(result.logprobs),
            versions=tuple(result.versions),
            text=text,
            finish_reason=result.finish_reason,
        )

    @property
    def trained(self) -> bool:
        """Whether the loss covers this turn's tokens (model turns only)."""
        return self.role == "model"

    @property
    def loss_mask(self) -> tuple[int, ...]:
        return (1 if self.trained else 0,) * len(self.token_ids)

    def with_reward(self, reward: float) -> Turn:
        return replace(self, reward=reward)


@dataclass(frozen=True, kw_only=True)
class Episode:
    """A finished conversation: its turns, how its reward is discounted, and where it came from."""

    turns: tuple[Turn, ...]
    gamma: float = 1.0
    """Per-turn discount of the episode reward, in (0, 1]; 1 sums the per-turn rewards."""
    group_index: int = 0
    """Index of this episode within its group (the n-th sample for the same row)."""
    stop_reason: str = ""
    """Why the conversation ended, as the workflow names it ("answer", "max_turns", ...)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Msgpack-able facts from the workflow (tool calls made, reward errors, ...)."""

    def __post_init__(self) -> None:
        turns = _as_tuple(self.turns, "episode", "turns")
        if not turns or not all(isinstance(t, Turn) for t in turns):
            raise ValueError("episode: turns must be a non-empty sequence of Turn, starting with the prompt")
        if turns[0].role != "prompt":
            raise ValueError(f"episode: the first turn must be the 'prompt', got {turns[0].role!r}")
        extra = [i for i, t in enumerate(turns) if t.role == "prompt" and i > 0]
        if extra:
            raise ValueError(f"episode: only the first turn may be a 'prompt'; turn {extra[0]} is one too")
        if not isinstance(self.gamma, int | float) or not 0 < self.gamma <= 1:
            raise ValueError(f"episode: gamma must be in (0, 1] (1 = plain sum), got {self.gamma!r}")
        if not _is_int(self.group_index) or self.group_index < 0:
            raise ValueError(f"episode: group_index must be an int >= 0, got {self.group_index!r}")
        object.__setattr__(self, "turns", turns)

    # ---- per token --------------------------------------------------------------------------

    @property
    def token_ids(self) -> list[int]:
        return [t for turn in self.turns for t in turn.token_ids]

    @property
    def logprobs(self) -> list[float]:
        return [x for turn in self.turns for x in turn.logprobs]

    @property
    def versions(self) -> list[int]:
        return [v for turn in self.turns for v in turn.versions]

    @property
    def loss_mask(self) -> list[int]:
        return [m for turn in self.turns for m in turn.loss_mask]

    @property
    def prompt_ids(self) -> list[int]:
        """The opening context: tokens before the first model turn's."""
        return list(self.turns[0].token_ids)

    def __len__(self) -> int:
        return sum(len(turn.token_ids) for turn in self.turns)

    # ---- per turn ---------------------------------------------------------------------------

    @property
    def model_turns(self) -> list[Turn]:
        return [turn for turn in self.turns if turn.trained]

    @property
    def turn_rewards(self) -> list[float]:
        """The reward of each model turn, in order."""
        return [turn.reward for turn in self.model_turns]

    @property
    def reward(self) -> float:
        """``sum_k gamma**k * r_k`` over the model turns (see the module docstring)."""
        return discounted_sum(self.turn_rewards, self.gamma)

    @property
    def head_version(self) -> int:
        """Oldest policy version among trained tokens; -1 without model tokens."""
        trained = [v for turn in self.model_turns for v in turn.versions]
        return min(trained) if trained else CONTEXT_VERSION

    @property
    def tail_version(self) -> int:
        """Newest policy version among trained tokens; -1 without model tokens."""
        trained = [v for turn in self.model_turns for v in turn.versions]
        return max(trained) if trained else CONTEXT_VERSION

    # ---- wire form --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A msgpack-able dict; ``Episode.from_dict`` reverses it (and validates again)."""
        return {
            "turns": [
                {
                    "role": t.role,
                    "token_ids": list(t.token_ids),
                    "logprobs": list(t.logprobs) if t.trained else [],
                    "versions": list(t.versions) if t.trained else [],
                    "text": t.text,
                    "reward": t.reward,
                    "finish_reason": t.finish_reason,
                }
                for t in self.turns
            ],
            "gamma": self.gamma,
            "group_index": self.group_index,
            "stop_reason": self.stop_reason,
            "info": dict(self.info),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Episode:
        turns = tuple(Turn(**turn) for turn in data["turns"])
        fields = {k: data[k] for k in ("gamma", "group_index", "stop_reason", "info") if k in data}
        return cls(turns=turns, **fields)


def discounted_sum(rewards: Sequence[float], gamma: float) -> float:
    """``sum_k gamma**k * rewards[k]``."""
    return float(sum(r * gamma**k for k, r in enumerate(rewards)))


def _as_tuple(value: Any, where: str, name: str) -> tuple[Any, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValueError(f"{where}: {name} must be a sequence, got {type(value).__name__}")
    return tuple(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
