"""The CUDA logprob kernels, run on this CPU by Triton's interpreter, agree with the eager form.

CI has no GPU, so `tests/gpu/test_logprob_triton_gpu.py` cannot run there; Triton's interpreter
(`TRITON_INTERPRET=1`) executes the same kernel source on CPU tensors with numpy, which checks the
kernels' logic (online softmax, masking of the last block, the entropy sum, the in-place gradient).
Triton is installed outside `.venv` by `scripts/test.sh` (`.cache/triton`) and imported only in the
subprocess, so the suite's torch never sees it.
"""

from __future__ import annotations

from tests.helpers.triton_interpreter import needs_triton, run_interpreted

CHECK = r"""
import json, torch
from areal_async.ops import logprob_triton
from areal_async.ops.logprobs import token_logprobs

out = []
for vocab in (50, logprob_triton.FORWARD_BLOCK * 2 + 13):
    for temperature in (0.7, 1.0):
        for overwrite in (False, True):
            torch.manual_seed(vocab)
            head = torch.nn.Linear(16, vocab, bias=False)
            hidden = torch.randn(6, 16)
            hidden[3] = head.weight[11].detach() * 200.0  # row 3: target 11 near-certain
            hidden.requires_grad_(True)
            targets = torch.randint(0, vocab, (6,))
            targets[3] = 11
            upstream = torch.randn(6)
            lp, ent = token_logprobs(hidden, targets, head, temperature, True)
            want = torch.autograd.grad((lp * upstream).sum(), [hidden, head.weight])
            lp2, ent2 = logprob_triton.target_logprob(
                head(hidden), targets, temperature, True, overwrite_logits=overwrite
            )
            got = torch.autograd.grad((lp2 * upstream).sum(), [hidden, head.weight])
            _, no_entropy = logprob_triton.target_logprob(head(hidden), targets, temperature, False)
            out.append({
                "case": [vocab, temperature, overwrite],
                "logprob": (lp2 - lp).abs().max().item(),
                "entropy": (ent2 - ent).abs().max().item(),
                # relative to the largest entry: row 3's hidden state is 200x a weight row
                "grad_hidden": ((got[0] - want[0]).abs().max() / want[0].abs().max()).item(),
                "grad_head": ((got[1] - want[1]).abs().max() / want[1].abs().max()).item(),
                "entropy_off_max": no_entropy.abs().max().item(),
                "near_certain": lp2[3].item(),
            })
print(json.dumps(out))
"""


@needs_triton
def test_kernels_match_the_eager_form_under_the_interpreter() -> None:
    """Logprob, entropy and both gradients (relative to their largest entry) agree to float32 rounding for a vocabulary smaller than one
    block and one that ends in a partial block, two temperatures, with and without the in-place
    gradient; with the entropy off it is exactly zero."""
    cases = run_interpreted(CHECK)
    assert len(cases) == 8
    for case in cases:
        assert case["logprob"] < 1e-5 and case["entropy"] < 2e-5, case
        assert case["grad_hidden"] < 1e-5 and case["grad_head"] < 1e-5, case
        assert case["entropy_off_max"] == 0.0 and case["near_certain"] > -1e-2, case
