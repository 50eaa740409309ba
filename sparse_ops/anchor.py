"""Triton: SparseVAR's anchor matching, twin of ``ref.anchor_match``.

Each program takes ``BLOCK_T`` tokens of one image. For every excluded token it reads its own
previous-scale logit row (index-mapped through ``src_L``, so the upsampled logits are never
materialised) and the rows of its 4 candidate anchors (few and shared, so they come from L2),
accumulating one norm and four dot products per V chunk, then writes the winner, the copy / zero
decision and the token role. Kept tokens only write their role. Cosine = dot / (max(|a|, 1e-12) ·
max(|c|, 1e-12)), as ``F.normalize`` defines it. Works for any vocabulary: 4096 codebook logits
(VAR, HART) or 2 × 32 bit logits (Infinity).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import ref
from ._backend import interpreting


@triton.jit
def _row_dot(base, s, a, v, m2, stride_m):
    c = tl.load(base + s[:, None] * stride_m + v[None, :], mask=m2, other=0.0).to(tl.float32)
    return tl.sum(a * c, axis=1), tl.sum(c * c, axis=1)


@triton.jit
def _cosine(dot, nn_a, nn_c):
    return dot / (tl.maximum(tl.sqrt(nn_a), 1e-12) * tl.maximum(tl.sqrt(nn_c), 1e-12))


@triton.jit
def _anchor_match_kernel(lg_ptr, src_ptr, cand_ptr, keep_ptr, anchor_ptr,
                         copy_ptr, zero_ptr, role_ptr, sim_ptr,
                         L, V, beta, stride_lb, stride_lm, stride_kb,
                         EXCLUDED: tl.constexpr, COPIED: tl.constexpr, KEPT: tl.constexpr, ANCHOR: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < L
    keep = tl.load(keep_ptr + b * stride_kb + t, mask=tm, other=1) != 0
    anchor = tl.load(anchor_ptr + t, mask=tm, other=0) != 0
    work = tm & (keep == 0)
    t64 = t.to(tl.int64)
    c0 = tl.load(cand_ptr + t64 * 4 + 0, mask=work, other=0).to(tl.int64)
    c1 = tl.load(cand_ptr + t64 * 4 + 1, mask=work, other=0).to(tl.int64)
    c2 = tl.load(cand_ptr + t64 * 4 + 2, mask=work, other=0).to(tl.int64)
    c3 = tl.load(cand_ptr + t64 * 4 + 3, mask=work, other=0).to(tl.int64)
    s_t = tl.load(src_ptr + t64, mask=work, other=0).to(tl.int64)
    s0 = tl.load(src_ptr + c0, mask=work, other=0).to(tl.int64)
    s1 = tl.load(src_ptr + c1, mask=work, other=0).to(tl.int64)
    s2 = tl.load(src_ptr + c2, mask=work, other=0).to(tl.int64)
    s3 = tl.load(src_ptr + c3, mask=work, other=0).to(tl.int64)
    base = lg_ptr + b * stride_lb
    nn_t = tl.zeros([BLOCK_T], dtype=tl.float32)
    d0 = tl.zeros([BLOCK_T], dtype=tl.float32)
    d1 = tl.zeros([BLOCK_T], dtype=tl.float32)
    d2 = tl.zeros([BLOCK_T], dtype=tl.float32)
    d3 = tl.zeros([BLOCK_T], dtype=tl.float32)
    n0 = tl.zeros([BLOCK_T], dtype=tl.float32)
    n1 = tl.zeros([BLOCK_T], dtype=tl.float32)
    n2 = tl.zeros([BLOCK_T], dtype=tl.float32)
    n3 = tl.zeros([BLOCK_T], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        m2 = work[:, None] & (v < V)[None, :]
        a = tl.load(base + s_t[:, None] * stride_lm + v[None, :], mask=m2, other=0.0).to(tl.float32)
        nn_t += tl.sum(a * a, axis=1)
        p, q = _row_dot(base, s0, a, v, m2, stride_lm)
        d0 += p
        n0 += q
        p, q = _row_dot(base, s1, a, v, m2, stride_lm)
        d1 += p
        n1 += q
        p, q = _row_dot(base, s2, a, v, m2, stride_lm)
        d2 += p
        n2 += q
        p, q = _row_dot(base, s3, a, v, m2, stride_lm)
        d3 += p
        n3 += q
    best = _cosine(d0, nn_t, n0)
    best_c = c0
    sim = _cosine(d1, nn_t, n1)                      # strictly greater: the earlier candidate wins ties
    best_c = tl.where(sim > best, c1, best_c)
    best = tl.maximum(best, sim)
    sim = _cosine(d2, nn_t, n2)
    best_c = tl.where(sim > best, c2, best_c)
    best = tl.maximum(best, sim)
    sim = _cosine(d3, nn_t, n3)
    best_c = tl.where(sim > best, c3, best_c)
    best = tl.maximum(best, sim)
    copied = work & (best >= beta)
    role = tl.where(anchor, ANCHOR, tl.where(keep, KEPT, tl.where(copied, COPIED, EXCLUDED)))
    out = b * L + t64
    tl.store(copy_ptr + out, tl.where(copied, best_c, t64), mask=tm)
    tl.store(zero_ptr + out, (work & (copied == 0)).to(tl.int8), mask=tm)
    tl.store(role_ptr + out, role.to(tl.uint8), mask=tm)
    tl.store(sim_ptr + out, tl.where(work, best, 0.0), mask=tm)


def launch_shape(V: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_V, warps). Codebook logits (V ≥ 1024): 4 tokens per program over 1024-wide
    chunks with two warps, so each program's chain of dependent V chunks is short (the sweep is in
    benchmarks/results/README.md). Bit logits (V = 64): 32 tokens × 64, four warps (fastest
    there)."""
    if interpreting():
        block_v = min(triton.next_power_of_2(V), 1024)
        return max(1, min(64, 8192 // block_v)), block_v, 4
    if V >= 1024:
        return 4, 1024, 2
    block_v = min(triton.next_power_of_2(V), 256)
    return max(1, min(64, 2048 // block_v)), block_v, 4


def anchor_match(logits_BMV: torch.Tensor, src_L: torch.Tensor, cand_L4: torch.Tensor, keep_BL: torch.Tensor,
                 anchors_L: torch.Tensor, beta: float, shape: Optional[tuple] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of ``ref.anchor_match``: (copy_src_BL, zero_BL, roles_BL, best_sim_BL). ``shape``
    = (BLOCK_T, BLOCK_V, warps) overrides the launch shape (benchmarks)."""
    B, L = keep_BL.shape
    V = logits_BMV.shape[-1]
    if L == 0 or B == 0:
        return ref.anchor_match(logits_BMV, src_L, cand_L4, keep_BL, anchors_L, beta)
    lg = logits_BMV if logits_BMV.stride(-1) == 1 else logits_BMV.contiguous()
    dev = keep_BL.device
    keep = keep_BL.contiguous()
    keep = keep.view(torch.uint8) if keep.dtype == torch.bool else keep
    anchors = anchors_L.contiguous()
    anchors = anchors.view(torch.uint8) if anchors.dtype == torch.bool else anchors
    copy_src = torch.empty(B, L, device=dev, dtype=torch.long)
    zero = torch.empty(B, L, device=dev, dtype=torch.int8)
    roles = torch.empty(B, L, device=dev, dtype=torch.uint8)
    sim = torch.empty(B, L, device=dev, dtype=torch.float32)
    block_t, block_v, warps = shape or launch_shape(V)
    _anchor_match_kernel[(triton.cdiv(L, block_t), B)](
        lg, src_L.contiguous(), cand_L4.contiguous(), keep, anchors, copy_src, zero, roles, sim,
        L, V, float(beta), lg.stride(0), lg.stride(1), keep.stride(0),
        EXCLUDED=ref.TOKEN_EXCLUDED, COPIED=ref.TOKEN_COPIED, KEPT=ref.TOKEN_KEPT, ANCHOR=ref.TOKEN_ANCHOR,
        BLOCK_T=block_t, BLOCK_V=block_v, num_warps=warps)
    return copy_src, zero.view(torch.bool), roles, sim
