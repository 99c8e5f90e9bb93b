"""Simulated learner (`trainer.backend: simulated`): the learner's surface at a modelled speed.

The trainer worker (`workers/trainer.py`) drives it exactly as it drives `Learner`: it receives
scored groups, applies the guard, calls `step`, snapshots and writes each version, publishes
`weights.published` and `trainer.step`, checkpoints and acks. Only the math is modelled: `step`
takes `profile.trainer.step_seconds(tokens, trainer.num_ranks)` (times `simulation.time_scale`)
and returns the metrics a real step reports (token counts, reward mean) with loss 0; a version is a
directory holding `manifest.json` only, and `write_weights` takes the modelled transfer time of
`profile.weights.bytes`; engines model their own load of it. Checkpoints keep the real layout
(`checkpoints/step_<N>/` with `extra.json` and `meta.json`, committed by an atomic rename, then
`latest`), so resume, the acks that follow a checkpoint and the audit behave as in a real run.

Ranks are modelled, not started: `trainer.num_ranks` only divides the step time (one process).
With a shared device the step slows by `device.train_slowdown` while any engine's decoding flag is
present (`areal_async/engines/simulated.py`). No torch.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from areal_async.config import RunConfig
from areal_async.engines.simulated import DECODING_FLAG_PREFIX, SHARED_SLICE_S, TRAINING_FLAG
from areal_async.files import replace_dir, write_text_atomic
from areal_async.simulation.profile import Profile, load_profile
from areal_async.training.checkpoint import CHECKPOINT_DIR, LATEST_FILE, _step_dirs, find_latest


class SimulatedLearner:
    """`Learner`'s methods as the trainer worker calls them; see the module docstring."""

    world_size = 1

    def __init__(self, cfg: RunConfig, profile: Profile | None = None) -> None:
        self.cfg = cfg
        self.profile = profile or load_profile(cfg.simulation.profile)
        self.scale = cfg.simulation.time_scale
        self.ranks = cfg.trainer.num_ranks
        self.flags_dir = cfg.run_dir / "sim"
        self.flags_dir.mkdir(parents=True, exist_ok=True)
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def step(self, groups: Sequence[Any]) -> dict[str, float]:
        """One modelled optimizer step on `groups` (`GroupSample`s); version t -> t + 1."""
        tokens = 0
        rewards: list[float] = []
        lengths: list[int] = []
        for g in groups:
            for i, completion in enumerate(g.completions):
                trained = sum(g.loss_masks[i]) if g.loss_masks else len(completion)
                tokens += trained
                lengths.append(trained)
            rewards.extend(g.rewards)
        modelled_tokens = tokens * self.cfg.simulation.token_scale
        modelled = self.profile.trainer.step_seconds(modelled_tokens, self.ranks)
        self._work(modelled)
        self._version += 1
        return {
            "loss": 0.0,
            "loss_tokens": float(tokens),
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "completion_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
            "modelled_step_s": modelled,
            "modelled_tokens": float(modelled_tokens),
        }

    def _work(self, seconds: float) -> None:
        """Sleep `seconds` of modelled work (in the worker thread the trainer runs `step` in); on a
        shared device in slices, each slowed while an engine decodes."""
        d = self.profile.device
        if not d.shared:
            time.sleep(seconds * self.scale)
            return
        flag = self.flags_dir / TRAINING_FLAG
        flag.touch()
        try:
            left = seconds
            while left > 0:
                piece = min(left, SHARED_SLICE_S)
                slow = d.train_slowdown if self._engines_decoding() else 1.0
                time.sleep(piece * slow * self.scale)
                left -= piece
        finally:
            flag.unlink(missing_ok=True)

    def _engines_decoding(self) -> bool:
        return any(p.name.startswith(DECODING_FLAG_PREFIX) for p in self.flags_dir.iterdir())

    # ---- versions --------------------------------------------------------------------------

    def snapshot_weights(self, *, dtype: str = "", on_device: bool = False) -> dict[str, Any]:
        time.sleep(self.profile.trainer.save_s * self.scale)
        return {"policy_version": self._version}

    def write_weights(self, path: Path, tensors: dict[str, Any]) -> list[dict[str, Any]]:
        """A version's directory: `manifest.json` naming its modelled size; takes the modelled
        transfer time of that size."""
        time.sleep(self.profile.weights.transfer_s * self.scale)
        manifest = [
            {"name": "simulated", "shape": [self.profile.weights.bytes], "dtype": "uint8", "sha256": ""}
        ]
        path = Path(path)
        tmp = path.with_name(f"{path.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "manifest.json").write_text(json.dumps({"policy_version": tensors.get("policy_version", -1)}))
        replace_dir(tmp, path)
        tensors.clear()
        return manifest

    def save_weights(self, path: Path) -> list[dict[str, Any]]:
        return self.write_weights(path, {"policy_version": self._version})

    # ---- checkpoints ---------------------------------------------------------------------------

    def checkpoint(self, root: Path, extra: dict[str, Any], keep: int) -> Path:
        ckpt_dir = Path(root) / CHECKPOINT_DIR
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        name = f"step_{self._version}"
        tmp = ckpt_dir / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        (tmp / "extra.json").write_text(json.dumps(extra))
        meta = {
            "step": self._version,
            "policy_version": self._version,
            "world_size": 1,
            "saved_at": time.time(),
        }
        (tmp / "meta.json").write_text(json.dumps(meta))
        final = ckpt_dir / name
        replace_dir(tmp, final)
        write_text_atomic(ckpt_dir / LATEST_FILE, name)
        for old in _step_dirs(ckpt_dir)[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def restore(self, root: Path) -> dict[str, Any] | None:
        latest = find_latest(root)
        if latest is None:
            return None
        self._version = int(json.loads((latest / "meta.json").read_text())["policy_version"])
        return json.loads((latest / "extra.json").read_text())

    def stop(self) -> None:
        pass
