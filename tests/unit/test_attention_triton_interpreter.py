"""The Triton packed-attention kernels, run on this CPU by Triton's interpreter, agree with causal
SDPA per sequence in float64; and the trainer's kernel choice on CPU.

CI has no GPU, so `tests/gpu/test_attention_triton_gpu.py` cannot run there; Triton's interpreter
(`TRITON_INTERPRET=1`) executes the same kernel source on CPU tensors with numpy, which checks the
kernels' logic: the online softmax, the causal mask on the diagonal blocks only, sequence bounds
inside blocks, grouped K/V heads whose gradients are summed over their query heads, the row
sums of the backward. The interpreter runs float32 (its bfloat16 matrix product is wrong in
Triton 3.9), with small blocks so that sequences span several of them. Triton is installed
outside `.venv` by `scripts/test.sh` (`.cache/triton`) and imported only in the subprocess
(`tests/helpers/triton_interpreter.py`).
"""

from __future__ import annotations

import pytest
import torch

from areal_async.ops.varlen import pick_attention_kernel
from tests.helpers.triton_interpreter import needs_triton, run_interpreted

CHECK = r"""
import json, torch
import torch.nn.functional as F
from areal_async.ops import attention_triton as at

at.CONFIG[16] = at.CONFIG[32] = {
    "forward": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
    "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
    "dq": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
}

def reference(q, k, v, lengths, scale):
    groups = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(outs)

out = []
# Lengths: one token, inside one block, on and across block edges (16, 32), several blocks.
lengths = [1, 5, 37, 64, 100, 33, 16]
for heads, kv_heads, dim, scale, longest in [(4, 2, 16, 0.3, 100), (2, 2, 32, None, 100), (6, 2, 16, None, 160)]:
    torch.manual_seed(heads * dim)
    n = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(n, heads, dim, requires_grad=True)
    # K/V with the token axis second in memory: the kernels take strides, not layouts.
    k = torch.randn(kv_heads, n, dim).transpose(0, 1).requires_grad_(True)
    v = torch.randn(n, kv_heads, dim, requires_grad=True)
    grad = torch.randn(n, heads, dim)
    got = at.varlen_attention(q, k, v, cu, longest, scale)
    got_grads = torch.autograd.grad((got * grad).sum(), [q, k, v])
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    want = reference(*leaves, lengths, scale if scale is not None else dim ** -0.5)
    want_grads = torch.autograd.grad((want * grad.double()).sum(), leaves)
    errors = [float((a.double() - b).norm() / b.norm()) for a, b in zip([got, *got_grads], [want, *want_grads])]
    out.append({"case": [heads, kv_heads, dim, scale, longest], "errors": errors,
                "finite": all(bool(torch.isfinite(t).all()) for t in [got, *got_grads])})
print(json.dumps(out))
"""


@needs_triton
def test_kernels_match_causal_sdpa_per_sequence_under_the_interpreter() -> None:
    """Output and the q, k, v gradients agree with float64 SDPA to float32 rounding for grouped
    (4/2, 6/2) and plain (2/2) heads, two head sizes, the default and a given scale, and a
    max_length above the longest sequence (programs with no rows)."""
    cases = run_interpreted(CHECK)
    assert len(cases) == 3
    for case in cases:
        assert case["finite"], case
        assert max(case["errors"]) < 1e-5, case


def test_cpu_trainer_keeps_flash_and_refuses_the_triton_kernels() -> None:
    """On CPU `auto` names the FlashAttention implementation (whose CPU path is SDPA per sequence);
    asking for Triton there, or a head size the kernels lack, or an unknown name, is an error
    that names the setting to change."""
    cpu = torch.device("cpu")
    assert pick_attention_kernel(cpu, "auto", 64) == "flash"
    assert pick_attention_kernel(cpu, "flash", 64) == "flash"
    with pytest.raises(ValueError, match="trainer.attention_kernel=auto"):
        pick_attention_kernel(cpu, "triton", 64)
    with pytest.raises(ValueError, match="attention_kernel must be 'auto', 'flash' or 'triton', got 'fa3'"):
        pick_attention_kernel(cpu, "fa3", 64)


def test_auto_takes_triton_only_for_tuned_head_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernels run, `auto` takes them for the tuned head sizes and FlashAttention for the
    rest; `triton` with a head size the kernels cannot hold is refused."""
    from areal_async.ops import triton_support

    monkeypatch.setattr(triton_support, "triton_available", lambda device: True)
    gpu = torch.device("cuda")
    assert pick_attention_kernel(gpu, "auto", 64) == "triton"
    assert pick_attention_kernel(gpu, "auto", 128) == "triton"
    assert pick_attention_kernel(gpu, "auto", 32) == "flash"
    assert pick_attention_kernel(gpu, "triton", 32) == "triton"
    with pytest.raises(ValueError, match=r"supports head_dim \[16, 32, 64, 128\], the model has 96"):
        pick_attention_kernel(gpu, "triton", 96)
