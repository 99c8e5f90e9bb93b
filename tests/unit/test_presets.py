"""Unit tests of areal_async.algo.presets: every recipe is complete, consistent and runnable."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from areal_async.algo.advantages import ADVANTAGE_FIELDS, compute_advantages
from areal_async.algo.loss import policy_loss
from areal_async.algo.presets import LOSS_FIELDS, PRESETS, preset_overrides
from areal_async.config import LossConfig

EXPECTED_PRESETS = {"ppo_decoupled", "grpo", "dr_grpo", "rloo", "dapo", "gspo"}
LOSS_KWARGS = (
    "eps_clip_low",
    "eps_clip_high",
    "dual_clip",
    "decoupled",
    "behave_cap",
    "behave_cap_mode",
    "ratio_level",
    "loss_agg",
    "kl_coef",
    "kl_estimator",
    "kl_in_reward",
)


def test_the_six_documented_presets_exist() -> None:
    """ppo_decoupled, grpo, dr_grpo, rloo, dapo and gspo are the recipe names the config accepts."""
    assert set(PRESETS) == EXPECTED_PRESETS


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_every_preset_sets_every_loss_field_with_the_default_type(name: str) -> None:
    """A preset is complete (all fields but ``preset``) and each value has its default's type (or None)."""
    preset = PRESETS[name]
    assert set(preset) == set(LOSS_FIELDS) - {"preset"}
    for key, value in preset.items():
        default = LOSS_FIELDS[key]
        if value is None or default is None:
            continue
        assert isinstance(value, type(default)), (key, value)


def test_ppo_decoupled_is_exactly_the_defaults() -> None:
    """The default recipe (AReaL): decoupled, cap 5 by masking, group mean/std plus batch norm, token mean."""
    assert PRESETS["ppo_decoupled"] == {k: v for k, v in LOSS_FIELDS.items() if k != "preset"}
    assert LOSS_FIELDS["preset"] == "ppo_decoupled"
    assert LOSS_FIELDS["decoupled"] is True
    assert LOSS_FIELDS["behave_cap"] == 5.0
    assert LOSS_FIELDS["behave_cap_mode"] == "mask"


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_every_preset_builds_a_valid_loss_config(name: str) -> None:
    """A LossConfig made of a preset's values passes the dataclass's own checks and keeps them."""
    config = LossConfig(preset=name, **PRESETS[name])
    assert {f.name: getattr(config, f.name) for f in dataclasses.fields(config)} == {
        **PRESETS[name],
        "preset": name,
    }


def test_each_named_recipe_sets_its_defining_switches() -> None:
    """The switches that define each published algorithm."""
    grpo, dr_grpo, rloo, dapo, gspo = (PRESETS[n] for n in ("grpo", "dr_grpo", "rloo", "dapo", "gspo"))
    assert (grpo["decoupled"], grpo["loss_agg"], grpo["group_std"]) == (False, "seq_mean_token_mean", True)
    assert (dr_grpo["loss_agg"], dr_grpo["group_std"], dr_grpo["batch_adv_norm"]) == (
        "seq_mean_token_sum_norm",
        False,
        False,
    )
    assert (rloo["group_baseline"], rloo["group_std"]) == ("loo", False)
    assert (dapo["eps_clip_low"], dapo["eps_clip_high"], dapo["loss_agg"]) == (0.2, 0.28, "token_mean")
    assert dapo["dynamic_sampling"] is True
    assert dapo["overlong_buffer"] > 0
    assert (gspo["ratio_level"], gspo["eps_clip_low"], gspo["eps_clip_high"]) == ("sequence", 3e-4, 4e-4)
    assert all(PRESETS[n]["decoupled"] for n in EXPECTED_PRESETS - {"grpo"})


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_every_preset_runs_through_advantages_and_loss(name: str) -> None:
    """Feeding a preset's fields to compute_advantages and policy_loss gives finite values and gradients."""
    preset = PRESETS[name]
    torch.manual_seed(0)
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    mask = torch.arange(16)[None, :] < torch.randint(1, 17, (8,))[:, None]
    behave = -torch.rand(8, 16) * 2
    adv = compute_advantages(rewards, mask, max_new_tokens=16, **{k: preset[k] for k in ADVANTAGE_FIELDS})
    logp = (behave + torch.randn(8, 16) * 0.1).requires_grad_(True)
    prox = behave + torch.randn(8, 16) * 0.1
    loss, _ = policy_loss(
        logp, prox, behave, adv, mask, max_new_tokens=16, **{k: preset[k] for k in LOSS_KWARGS}
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logp.grad).all()


def test_preset_overrides_returns_a_copy_and_hints_at_typos() -> None:
    """Editing the returned dict leaves PRESETS alone; an unknown name suggests the closest one."""
    overrides = preset_overrides("dapo")
    overrides["eps_clip_high"] = 9.0
    assert PRESETS["dapo"]["eps_clip_high"] == 0.28
    with pytest.raises(ValueError, match="did you mean 'dr_grpo'"):
        preset_overrides("dr-grpo")


def test_presets_and_staleness_import_without_torch() -> None:
    """config.py and the controller import these modules; they must not pull in torch."""
    code = (
        "import sys; import areal_async.algo.presets, areal_async.algo.staleness; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
