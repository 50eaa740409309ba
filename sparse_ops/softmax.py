"""Triton: bias add, softmax per group and the cast for the next product in one pass, twin of
``ref.bias_softmax``.

Why: the absorbed cross-attention (``models._blocks.absorbed_cross_attention``) turns a layer's
attention to a short prompt into two products around a softmax over H groups of T logits. In torch
that softmax is three launches — the bias add, the float32 softmax, the cast to bf16 — each a full
pass over the (R, l, H·T) logits. Here one program reads a block of rows of T logits with their
bias, and writes the probabilities.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bias_softmax_kernel(x_ptr, b_ptr, out_ptr, M, T, rows_per_bias, G,
                         BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr):
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)              # rows of T logits
    t = tl.arange(0, BLOCK_T)
    mm = m < M
    tm = t < T
    mask = mm[:, None] & tm[None, :]
    x = tl.load(x_ptr + m[:, None] * T + t[None, :], mask=mask, other=0.0).to(tl.float32)
    # row m belongs to batch row m // rows_per_bias and group m % G; the bias row of that batch row
    # holds the G groups one after another
    b_off = (m // rows_per_bias) * (G * T) + (m % G) * T
    b = tl.load(b_ptr + b_off[:, None] + t[None, :], mask=mask, other=0.0).to(tl.float32)
    # the padding columns take no mass; padding rows (m >= M) stay finite and are not stored
    x = tl.where(tm[None, :], x + b, float("-inf"))
    x = x - tl.max(x, axis=1)[:, None]
    e = tl.exp(x)
    p = e / tl.sum(e, axis=1)[:, None]
    tl.store(out_ptr + m[:, None] * T + t[None, :], p.to(out_ptr.dtype.element_ty), mask=mask)


def bias_softmax(logits_RlN: torch.Tensor, bias_R1N: torch.Tensor, groups: int, out_dtype: torch.dtype) -> torch.Tensor:
    R, l, N = logits_RlN.shape
    if N % groups:
        raise ValueError(f"groups={groups} does not divide the last dim {N}")
    T = N // groups
    x = logits_RlN.contiguous()
    b = bias_R1N.reshape(R, N).contiguous()
    out = torch.empty(R, l, N, device=x.device, dtype=out_dtype)
    M = R * l * groups
    if M:
        BLOCK_T = max(16, triton.next_power_of_2(T))
        BLOCK_M = max(1, min(128, 4096 // BLOCK_T))
        _bias_softmax_kernel[(triton.cdiv(M, BLOCK_M),)](x, b, out, M, T, l * groups, groups,
                                                          BLOCK_M=BLOCK_M, BLOCK_T=BLOCK_T, num_warps=4)
    return out
