"""Named loss recipes: ``trainer.loss.preset`` -> values of the ``LossConfig`` fields.

``LOSS_FIELDS`` lists every field of ``config.LossConfig`` with its default (the ``ppo_decoupled``
recipe), read from the dataclass: the defaults live only there. Every entry of ``PRESETS`` is complete:
it sets every field of ``LOSS_FIELDS`` except ``preset`` itself. The run-file loader
(``areal_async/run_file.py``) applies the preset first and the run file's own keys over it; a
``LossConfig`` built in code is taken as written (pass ``preset_overrides(name)`` for a recipe).

The behaviour weight pi_prox / pi_behave (with its cap) is applied whenever ``decoupled`` is on. Recipes
named after a synchronous paper keep that paper's advantage and aggregation choices; all but ``grpo``
keep the decoupled objective, since the paper's version of it (ratio against pi_behave) degrades with
staleness (AReaL Table 2).

Torch-free. ``run_file.py`` imports this module inside the function that applies a preset, so
reading ``LossConfig`` here makes no import cycle.
"""

from __future__ import annotations

import dataclasses
import difflib

from areal_async.config import LossConfig

LOSS_FIELDS: dict[str, object] = {f.name: f.default for f in dataclasses.fields(LossConfig)}
"""Every LossConfig field name with its default value."""

_BASE: dict[str, object] = {k: v for k, v in LOSS_FIELDS.items() if k != "preset"}

PRESETS: dict[str, dict[str, object]] = {
    # AReaL (arXiv 2505.24298) eq. 5: decoupled PPO, behaviour weight capped at 5 by masking, group
    # mean/std normalisation plus batch advantage normalisation, token mean over the global batch.
    "ppo_decoupled": dict(_BASE),
    # GRPO (DeepSeekMath, arXiv 2402.03300): group mean/std, mean over sequences of the token mean,
    # ratio against the behaviour policy. For the paper's KL term set kl_coef (0.04 there); k3 in loss.
    "grpo": {
        **_BASE,
        "decoupled": False,
        "loss_agg": "seq_mean_token_mean",
        "batch_adv_norm": False,
        "kl_estimator": "k3",
    },
    # Dr.GRPO (Understanding R1-Zero-Like Training, arXiv 2503.20783): no std division anywhere,
    # token sum normalised by a constant (max_new_tokens), mean over sequences.
    "dr_grpo": {
        **_BASE,
        "loss_agg": "seq_mean_token_sum_norm",
        "group_std": False,
        "batch_adv_norm": False,
    },
    # RLOO (Ahmadian et al., arXiv 2402.14740): leave-one-out mean baseline, no std normalisation.
    "rloo": {
        **_BASE,
        "group_baseline": "loo",
        "group_std": False,
        "batch_adv_norm": False,
    },
    # DAPO (arXiv 2503.14476): clip-higher 0.2/0.28, token-level mean, dynamic sampling, soft overlong
    # penalty. The paper's buffer is 20% of the budget (4096 of 20480): 4 fits the default 16-token
    # budget; raise it with max_new_tokens.
    "dapo": {
        **_BASE,
        "eps_clip_high": 0.28,
        "batch_adv_norm": False,
        "dynamic_sampling": True,
        "overlong_buffer": 4,
        "overlong_penalty": 1.0,
    },
    # GSPO (Group Sequence Policy Optimization, arXiv 2507.18071): length-normalised sequence ratio,
    # clip 3e-4 / 4e-4, group mean/std advantages, mean over sequences.
    "gspo": {
        **_BASE,
        "ratio_level": "sequence",
        "eps_clip_low": 3e-4,
        "eps_clip_high": 4e-4,
        "loss_agg": "seq_mean_token_mean",
        "batch_adv_norm": False,
    },
}
"""Preset name -> value of every LossConfig field except ``preset``."""


def preset_overrides(name: str) -> dict[str, object]:
    """A copy of the field values of preset ``name``; ValueError with a hint for an unknown name."""
    if name not in PRESETS:
        match = difflib.get_close_matches(name, list(PRESETS), n=1, cutoff=0.6)
        hint = f" (did you mean {match[0]!r}?)" if match else ""
        raise ValueError(f"unknown loss preset {name!r}{hint}; choose one of {sorted(PRESETS)}")
    return dict(PRESETS[name])
