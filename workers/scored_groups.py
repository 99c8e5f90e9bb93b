"""A scored group at the trainer's boundary: what makes it fit to train (``check_content``; an
unfit one is dead-lettered with the reason and its prompt re-issued, docs/design.md section 8) and
the training sample it becomes (``to_sample``). No torch here.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from bus.events import ScoredGroup, unpack_f32, unpack_i32, unpack_u8


def to_sample(scored: ScoredGroup) -> Any:
    from areal_async.training.samples import GroupSample

    g = scored.group
    masks = None
    if any(c.loss_mask for c in g.completions):
        masks = [
            unpack_u8(c.loss_mask).tolist() if c.loss_mask else [1] * c.num_tokens for c in g.completions
        ]
    return GroupSample(
        task_id=g.task_id,
        prompt_ids=unpack_i32(g.prompt_ids, "prompt_ids").tolist(),
        completions=[unpack_i32(c.token_ids, "token_ids").tolist() for c in g.completions],
        behave_logprobs=[unpack_f32(c.logprobs, "logprobs").tolist() for c in g.completions],
        rewards=list(scored.rewards),
        finish_reasons=[c.finish_reason for c in g.completions],
        head_version=g.head_version,
        loss_masks=masks,
    )


class Unfit(ValueError):
    """A scored group that must not be trained (dead-lettered with this reason)."""


def check_content(scored: ScoredGroup) -> None:
    """Unfit unless every number is finite, loss masks align, some token is trained and the group's
    head_version is the oldest version among its trained tokens (then re-issued).

    Versions may go down within an episode: its later turns can come from a generation worker that
    has not loaded the newest weights yet; the head version covers that.
    """
    g = scored.group
    if not g.completions:
        raise Unfit("the group has no completions")
    if not all(math.isfinite(r) for r in scored.rewards):
        raise Unfit(f"non-finite reward(s) {[r for r in scored.rewards if not math.isfinite(r)][:4]}")
    oldest: list[int] = []
    for i, c in enumerate(g.completions):
        if c.loss_mask and len(c.loss_mask) != c.num_tokens:
            raise Unfit(f"completion {i} has {len(c.loss_mask)} loss mask entries for {c.num_tokens} tokens")
        logprobs = unpack_f32(c.logprobs, "logprobs")
        versions = unpack_i32(c.versions, "versions")
        if not np.isfinite(logprobs).all():
            raise Unfit(f"completion {i} has non-finite logprobs")
        trained = versions[unpack_u8(c.loss_mask) == 1] if c.loss_mask else versions
        if len(trained) and trained.min() < 0:
            raise Unfit(f"completion {i} has negative token versions")
        if len(trained):
            oldest.append(int(trained.min()))
    if not oldest:
        raise Unfit("no completion has a token to train (all empty or masked out)")
    if g.head_version != min(oldest):
        raise Unfit(f"head_version {g.head_version} is not the oldest trained-token version {min(oldest)}")
