"""Comparing training runs that do the same arithmetic in another order (ranks against one process,
one parallel layout against another, a resumed run against the one that wrote the checkpoint).

Float32 sums taken in another order (other ranks, another SIMD width: AVX2, AVX-512, AMX) differ by
a few ulps, so losses, gradient norms and logprobs agree to a relative ~1e-6 and compare with
rtol 1e-5. Weights after AdamW steps do not: Adam's step ``lr * m / (sqrt(v) + eps)`` with the usual
eps = 1e-8 maps a gradient element at the rounding scale (|g| ~ 1e-9, pure noise) to a step of up to
``lr`` whose sign is the noise's, so two correct runs can differ by ~lr in such an element, and which
elements those are depends on the CPU.

Tests that compare weights therefore train with ``LINEAR_ADAM``: eps = 1 lies above every gradient
element (``grad_clip = 1`` bounds the whole gradient's norm by 1), so the step
``lr * g / (|g| + 1)`` is Lipschitz in g with slope <= lr. Two runs' weight updates then differ by
at most the gradients' relative rounding times the update itself, plus the rounding of the weights;
`assert_same_updates` checks exactly that, so a wrong gradient (a shard summed twice, a rank's
tokens dropped) still shows as an O(1) relative difference of the update.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

LINEAR_ADAM = {"lr": 0.1, "eps": 1.0, "grad_clip": 1.0}
"""Optimizer options for runs whose weights are compared (see the module docstring)."""

UPDATE_RTOL = 1e-4
"""Relative agreement of two runs' updates: gradients agree to ~1e-6 (a few float32 ulps, summed
over micro-batches and ranks); 100x margin for the momentum and the clip coefficient."""


def assert_same_updates(
    got: Mapping[str, torch.Tensor],
    want: Mapping[str, torch.Tensor],
    before: Mapping[str, torch.Tensor],
    *,
    steps: int,
) -> None:
    """Weights `got` and `want`, both reached from `before` in `steps` optimizer steps, hold the same
    update: per tensor, |got - want| <= UPDATE_RTOL * max|want - before| plus 2 ulps of the weights
    per step (each step rounds the new weight once in each run)."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for name, target in want.items():
        start, result = before[name].to(target.dtype), got[name]
        update = (target - start).abs().max()
        ulp = torch.finfo(target.dtype).eps * target.abs().max()
        bound = UPDATE_RTOL * update + 2 * steps * ulp
        diff = (result - target).abs().max()
        assert diff <= bound, f"{name}: updates differ by {diff:.3g} > {bound:.3g} (update {update:.3g})"
