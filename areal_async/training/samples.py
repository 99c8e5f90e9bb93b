"""What the learner trains on: one scored group as plain lists (no bus types, no torch), so the
trainer worker builds it without importing a training backend."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupSample:
    """One scored group as the learner needs it (plain lists, no bus types)."""

    task_id: str
    prompt_ids: list[int]
    completions: list[list[int]]
    behave_logprobs: list[list[float]]
    rewards: list[float]
    finish_reasons: list[str]
    head_version: int
    loss_masks: list[list[int]] | None = None
    """Per completion, 1 on the tokens to train (the model's) and 0 on the others; None trains all."""

    def __post_init__(self) -> None:
        if self.loss_masks is None:
            return
        mask_lengths = [len(m) for m in self.loss_masks]
        if mask_lengths != [len(c) for c in self.completions]:
            raise ValueError(
                f"group {self.task_id}: loss mask lengths {mask_lengths[:8]} do not match completion "
                f"lengths {[len(c) for c in self.completions][:8]}; pass one mask entry per completion token"
            )
