"""Causal attention over packed rows in Triton (CUDA): forward and backward, grouped K/V heads.

The packed training row holds several sequences back to back (`ops/varlen.py`); every token
attends causally to the tokens of its own sequence only. This module computes that attention
from `q [N, H, D]`, `k, v [N, Hk, D]` (H a multiple of Hk: grouped-query attention) and the
int32 sequence bounds `cu_seqlens [S + 1]`, in one program per (block of rows, sequence, head):

- forward (`_attn_forward_kernel`): online softmax over the key blocks of the row's sequence, in
  base 2 (exp2, scores pre-multiplied by scale * log2 e); only the blocks on the diagonal are
  masked. Saves the output and the log-sum-exp per row `[H, N]` float32.
- backward: `_attn_delta_kernel` computes rowsum(dO * O) per row and head; `_attn_dkdv_kernel` runs one
  program per (key block, sequence, K/V head) that loops over the query heads of its group, so
  the gradients of the shared K/V heads are summed in registers and written once (no per-query-head
  buffers to add up afterwards); `_attn_dq_kernel` runs one program per (query block, sequence, head)
  and recomputes the probabilities. No atomics: every output element has one writer.

Launch shapes (`CONFIG`) were chosen on an H200 for head sizes 64 and 128 by sweeping
(`python -m benchmarks.bench_attention --sweep`). There, against FlashAttention-2 varlen on one packed row of
51,200 tokens in sequences of 1,152-2,048: 14 q / 2 kv heads of 64, 0.63 / 2.04 ms forward /
backward vs 1.02 / 2.18; 28 q / 4 kv heads of 128, 1.87 / 6.28 ms vs 2.43 / 7.26.
`varlen_attention(q, k, v, cu_seqlens, max_length, scale)` is the entry point: a torch custom
op with a registered backward, so torch.compile treats it as one opaque call. Triton's
interpreter (`TRITON_INTERPRET=1`) runs the same kernels on CPU tensors
(tests/unit/test_attention_triton_interpreter.py).

Legend: N tokens of the packed row, S sequences, H query heads, Hk K/V heads, D head dim,
M / Nb row / key block sizes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from areal_async.ops.triton_support import tl, triton

LOG2E = 1.4426950408889634

CONFIG: dict[int, dict[str, dict[str, int]]] = {
    64: {
        "forward": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
        "dkdv": {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
        "dq": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    },
    128: {
        "forward": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
        "dkdv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
        "dq": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
    },
}
"""Block sizes and launch settings per head size and kernel (head sizes below 64 use 64's).
Forward and dq need BLOCK_M % BLOCK_N == 0 and dkdv BLOCK_N % BLOCK_M == 0: the diagonal then
falls on whole blocks. At head size 128 the dk/dv accumulators of a 128-key block spill, so
its key blocks are halved."""

HEAD_DIMS = frozenset({16, 32, 64, 128})
"""Head sizes the kernels accept (one tile holds a whole head)."""

TUNED_HEAD_DIMS = frozenset({64, 128})
"""Head sizes `CONFIG` was measured on and beats FlashAttention-2 varlen for (`auto` picks these)."""

DELTA_BLOCK = 64
"""Rows per program of the rowsum(dO * O) kernel."""


if triton is not None:

    @triton.jit
    def _sequence_bounds(cu_ptr, seq):
        """First token (int64) and length of sequence `seq` in the packed row."""
        start = tl.load(cu_ptr + seq).to(tl.int64)
        return start, (tl.load(cu_ptr + seq + 1) - start).to(tl.int32)

    @triton.jit
    def _load_tile(base, rows, stride, length, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr):
        """`[len(rows), HEAD_DIM]` from `base + row * stride`; with MASKED, rows >= length read 0."""
        ptrs = base + rows[:, None] * stride + tl.arange(0, HEAD_DIM)[None, :]
        if MASKED:
            return tl.load(ptrs, mask=(rows < length)[:, None], other=0.0)
        return tl.load(ptrs)

    @triton.jit
    def _store_tile(base, rows, stride, length, value, HEAD_DIM: tl.constexpr):
        """Store `value` at rows < length of `base + row * stride`, in the pointer's dtype."""
        ptrs = base + rows[:, None] * stride + tl.arange(0, HEAD_DIM)[None, :]
        tl.store(ptrs, value.to(base.dtype.element_ty), mask=(rows < length)[:, None])

    @triton.jit
    def _attn_forward_step(
        acc, m_i, l_i, q, rows, k_base, v_base, n_lo, length, stride_kn, stride_vn, scale_log2,
        MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """Fold key block [n_lo, n_lo + Nb) into the running max, sum and output of `rows`."""
        cols = n_lo + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base, cols, stride_kn, length, HEAD_DIM, MASKED)
        v = _load_tile(v_base, cols, stride_vn, length, HEAD_DIM, MASKED)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        if MASKED:  # causal, which also hides keys past the sequence from its rows
            s = tl.where(cols[None, :] <= rows[:, None], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return acc, m_new, l_i * alpha + tl.sum(p, 1)

    @triton.jit
    def _attn_forward_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_ptr, scale_log2,
        stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, total_tokens,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        q_lo = tl.program_id(0) * BLOCK_M
        seq = tl.program_id(1)
        head = tl.program_id(2)
        start, length = _sequence_bounds(cu_ptr, seq)
        if q_lo >= length:
            return
        kv_head = head // GROUP
        rows = q_lo + tl.arange(0, BLOCK_M)
        q = _load_tile(q_ptr + start * stride_qn + head * stride_qh, rows, stride_qn, length, HEAD_DIM, True)
        k_base = k_ptr + start * stride_kn + kv_head * stride_kh
        v_base = v_ptr + start * stride_vn + kv_head * stride_vh
        m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        # Keys [0, q_lo) are visible to every row of the block: no mask.
        for n_lo in range(0, q_lo, BLOCK_N):
            acc, m_i, l_i = _attn_forward_step(
                acc, m_i, l_i, q, rows, k_base, v_base, n_lo, length, stride_kn, stride_vn, scale_log2,
                MASKED=False, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N,
            )  # fmt: skip
        # The diagonal: keys [q_lo, end of the block's rows), masked.
        for n_lo in range(q_lo, tl.minimum(q_lo + BLOCK_M, length), BLOCK_N):
            acc, m_i, l_i = _attn_forward_step(
                acc, m_i, l_i, q, rows, k_base, v_base, n_lo, length, stride_kn, stride_vn, scale_log2,
                MASKED=True, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N,
            )  # fmt: skip
        o_base = o_ptr + start * stride_on + head * stride_oh
        _store_tile(o_base, rows, stride_on, length, acc / l_i[:, None], HEAD_DIM)
        tl.store(lse_ptr + head * total_tokens + start + rows, m_i + tl.log2(l_i), mask=rows < length)

    @triton.jit
    def _attn_delta_kernel(
        o_ptr, do_ptr, delta_ptr, stride_on, stride_oh, stride_don, stride_doh, total_tokens,
        HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """delta = rowsum(dO * O) per token and head, float32 `[H, N]`."""
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        head = tl.program_id(1)
        o = _load_tile(o_ptr + head * stride_oh, rows.to(tl.int64), stride_on, total_tokens, HEAD_DIM, True)
        do = _load_tile(
            do_ptr + head * stride_doh, rows.to(tl.int64), stride_don, total_tokens, HEAD_DIM, True
        )
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(delta_ptr + head * total_tokens + rows, delta, mask=rows < total_tokens)

    @triton.jit
    def _attn_dkdv_step(
        dk, dv, k, v, cols, q_base, do_base, lse_base, delta_base, m_lo, length, stride_qn, stride_don,
        scale_log2, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """Add query rows [m_lo, m_lo + M) of one head to the key block's dk and dv."""
        rows = m_lo + tl.arange(0, BLOCK_M)
        rows_ok = rows < length
        q = _load_tile(q_base, rows, stride_qn, length, HEAD_DIM, True)
        do = _load_tile(do_base, rows, stride_don, length, HEAD_DIM, True)
        # Rows past the sequence: lse = +inf makes their probabilities 0.
        lse = tl.load(lse_base + rows, mask=rows_ok, other=float("inf"))
        delta = tl.load(delta_base + rows, mask=rows_ok, other=0.0)
        p_t = tl.exp2(tl.dot(k, tl.trans(q)) * scale_log2 - lse[None, :])  # [Nb, M]
        if MASKED:
            p_t = tl.where(rows[None, :] >= cols[:, None], p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
        return dk, dv

    @triton.jit
    def _attn_dkdv_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_ptr, scale, scale_log2,
        stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_don, stride_doh,
        stride_dkn, stride_dkh, stride_dvn, stride_dvh, total_tokens,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        n_lo = tl.program_id(0) * BLOCK_N
        seq = tl.program_id(1)
        kv_head = tl.program_id(2)
        start, length = _sequence_bounds(cu_ptr, seq)
        if n_lo >= length:
            return
        cols = n_lo + tl.arange(0, BLOCK_N)
        k = _load_tile(
            k_ptr + start * stride_kn + kv_head * stride_kh, cols, stride_kn, length, HEAD_DIM, True
        )
        v = _load_tile(
            v_ptr + start * stride_vn + kv_head * stride_vh, cols, stride_vn, length, HEAD_DIM, True
        )
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        diagonal_end = tl.minimum(n_lo + BLOCK_N, length)
        for g in range(GROUP):
            head = kv_head * GROUP + g
            q_base = q_ptr + start * stride_qn + head * stride_qh
            do_base = do_ptr + start * stride_don + head * stride_doh
            lse_base = lse_ptr + head * total_tokens + start
            delta_base = delta_ptr + head * total_tokens + start
            # Rows [n_lo, n_lo + Nb) see part of the key block; later rows see all of it.
            for m_lo in range(n_lo, diagonal_end, BLOCK_M):
                dk, dv = _attn_dkdv_step(
                    dk, dv, k, v, cols, q_base, do_base, lse_base, delta_base, m_lo, length, stride_qn,
                    stride_don, scale_log2, MASKED=True, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M,
                )  # fmt: skip
            for m_lo in range(n_lo + BLOCK_N, length, BLOCK_M):
                dk, dv = _attn_dkdv_step(
                    dk, dv, k, v, cols, q_base, do_base, lse_base, delta_base, m_lo, length, stride_qn,
                    stride_don, scale_log2, MASKED=False, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M,
                )  # fmt: skip
        _store_tile(
            dk_ptr + start * stride_dkn + kv_head * stride_dkh, cols, stride_dkn, length, dk * scale, HEAD_DIM
        )
        _store_tile(
            dv_ptr + start * stride_dvn + kv_head * stride_dvh, cols, stride_dvn, length, dv, HEAD_DIM
        )

    @triton.jit
    def _attn_dq_step(
        dq, q, do, lse, delta, rows, k_base, v_base, n_lo, length, stride_kn, stride_vn, scale_log2,
        MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """Add key block [n_lo, n_lo + Nb) to the query rows' dq."""
        cols = n_lo + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base, cols, stride_kn, length, HEAD_DIM, MASKED)
        v = _load_tile(v_base, cols, stride_vn, length, HEAD_DIM, MASKED)
        p = tl.exp2(tl.dot(q, tl.trans(k)) * scale_log2 - lse[:, None])  # [M, Nb]
        if MASKED:
            p = tl.where(cols[None, :] <= rows[:, None], p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        return dq + tl.dot(ds.to(k.dtype), k)

    @triton.jit
    def _attn_dq_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_ptr, scale, scale_log2,
        stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_don, stride_doh,
        stride_dqn, stride_dqh, total_tokens,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        q_lo = tl.program_id(0) * BLOCK_M
        seq = tl.program_id(1)
        head = tl.program_id(2)
        start, length = _sequence_bounds(cu_ptr, seq)
        if q_lo >= length:
            return
        kv_head = head // GROUP
        rows = q_lo + tl.arange(0, BLOCK_M)
        rows_ok = rows < length
        q = _load_tile(q_ptr + start * stride_qn + head * stride_qh, rows, stride_qn, length, HEAD_DIM, True)
        do = _load_tile(
            do_ptr + start * stride_don + head * stride_doh, rows, stride_don, length, HEAD_DIM, True
        )
        lse = tl.load(lse_ptr + head * total_tokens + start + rows, mask=rows_ok, other=float("inf"))
        delta = tl.load(delta_ptr + head * total_tokens + start + rows, mask=rows_ok, other=0.0)
        k_base = k_ptr + start * stride_kn + kv_head * stride_kh
        v_base = v_ptr + start * stride_vn + kv_head * stride_vh
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for n_lo in range(0, q_lo, BLOCK_N):
            dq = _attn_dq_step(
                dq, q, do, lse, delta, rows, k_base, v_base, n_lo, length, stride_kn, stride_vn,
                scale_log2, MASKED=False, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N,
            )  # fmt: skip
        for n_lo in range(q_lo, tl.minimum(q_lo + BLOCK_M, length), BLOCK_N):
            dq = _attn_dq_step(
                dq, q, do, lse, delta, rows, k_base, v_base, n_lo, length, stride_kn, stride_vn,
                scale_log2, MASKED=True, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N,
            )  # fmt: skip
        _store_tile(
            dq_ptr + start * stride_dqn + head * stride_dqh, rows, stride_dqn, length, dq * scale, HEAD_DIM
        )


def _settings(name: str, head_dim: int) -> dict[str, int]:
    return dict(CONFIG[head_dim if head_dim in CONFIG else 64][name])


def _launch(
    kernel: Any, settings: dict[str, int], block_key: str, max_length: int, grid: tuple[int, int]
) -> Any:
    """`kernel` indexed by its grid: blocks of the longest sequence (of `settings[block_key]`
    tokens) x `grid` (sequences, heads)."""
    return kernel[(triton.cdiv(max_length, settings[block_key]), *grid)]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError(
            "varlen_attention needs Triton; check triton_support.triton_available(device) first"
        )
    if (
        q.dim() != 3
        or k.dim() != 3
        or k.shape != v.shape
        or k.shape[0] != q.shape[0]
        or k.shape[2] != q.shape[2]
    ):
        raise ValueError(
            f"q must be [N, H, D] and k, v [N, Hk, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of K/V heads ({kv_heads})")
    if dim not in (16, 32, 64, 128):
        raise ValueError(
            f"head_dim {dim} is not supported by the Triton attention kernels (16, 32, 64 or 128)"
        )
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(
            f"cu_seqlens must be 1-D int32, got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
        )


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("areal_async::varlen_attention_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_length: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    tokens, heads, dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((heads, tokens), dtype=torch.float32, device=q.device)
    sequences = cu_seqlens.numel() - 1
    if tokens and sequences:
        settings = _settings("forward", dim)
        _launch(_attn_forward_kernel, settings, "BLOCK_M", max_length, (sequences, heads))(
            q, k, v, out, lse, cu_seqlens, scale * LOG2E,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), tokens,
            GROUP=heads // k.shape[1], HEAD_DIM=dim, **settings,
        )  # fmt: skip
    return out, lse


@_forward_op.register_fake
def _(q, k, v, cu_seqlens, max_length, scale):  # type: ignore[no-untyped-def]
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("areal_async::varlen_attention_backward", mutates_args=())
def _backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_length: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_out, q, k, v = (_last_dim_contiguous(t) for t in (grad_out, q, k, v))
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    sequences = cu_seqlens.numel() - 1
    if not (tokens and sequences):
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty((heads, tokens), dtype=torch.float32, device=q.device)
    _attn_delta_kernel[(triton.cdiv(tokens, DELTA_BLOCK), heads)](
        out, grad_out, delta, out.stride(0), out.stride(1), grad_out.stride(0), grad_out.stride(1), tokens,
        HEAD_DIM=dim, BLOCK=DELTA_BLOCK,
    )  # fmt: skip
    group = heads // kv_heads
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    strides += (grad_out.stride(0), grad_out.stride(1))
    settings = _settings("dkdv", dim)
    _launch(_attn_dkdv_kernel, settings, "BLOCK_N", max_length, (sequences, kv_heads))(
        q, k, v, grad_out, lse, delta, dk, dv, cu_seqlens, scale, scale * LOG2E, *strides,
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), tokens,
        GROUP=group, HEAD_DIM=dim, **settings,
    )  # fmt: skip
    settings = _settings("dq", dim)
    _launch(_attn_dq_kernel, settings, "BLOCK_M", max_length, (sequences, heads))(
        q, k, v, grad_out, lse, delta, dq, cu_seqlens, scale, scale * LOG2E, *strides,
        dq.stride(0), dq.stride(1), tokens,
        GROUP=group, HEAD_DIM=dim, **settings,
    )  # fmt: skip
    return dq, dk, dv


@_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens, max_length, scale):  # type: ignore[no-untyped-def]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, cu_seqlens, max_length, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.max_length, ctx.scale = max_length, scale


def _backward(ctx: Any, grad_out: torch.Tensor, _grad_lse: torch.Tensor) -> tuple[Any, ...]:
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _backward_op(grad_out, q, k, v, out, lse, cu_seqlens, ctx.max_length, ctx.scale)
    return dq, dk, dv, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def varlen_attention(
    q_NHD: torch.Tensor,
    k_NHD: torch.Tensor,
    v_NHD: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_length: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention within each sequence of a packed row: `[N, H, D]` out, q's dtype.

    `q [N, H, D]`, `k, v [N, Hk, D]` (H a multiple of Hk; last dim contiguous or it is copied),
    `cu_seqlens` int32 `[S + 1]` (0, then the end of each sequence), `max_length` at least the
    longest sequence, `scale` defaults to 1/sqrt(D). Differentiable in q, k and v."""
    _check(q_NHD, k_NHD, v_NHD, cu_seqlens)
    scale = 1.0 / math.sqrt(q_NHD.shape[-1]) if scale is None else float(scale)
    out, _ = _forward_op(q_NHD, k_NHD, v_NHD, cu_seqlens, int(max_length), scale)
    return out
