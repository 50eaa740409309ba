"""Triton: FastVAR's pivotal-token selection, twin of ``ref.pivotal_tokens``.

FastVAR chooses its tokens afresh before every pruned sub-layer: per batch row, the ``keep`` tokens
whose residual-stream rows lie farthest (squared L2) from the row's spatial mean. In torch that is a
mean, a subtraction, a square, a sum, a top-k and a sort — about ten launches, two of them sorts —
per sub-layer, 60 times per scale at VAR-d30 and 75 at Infinity-2B: more GPU time than the pruning
saves. Here it is three launches, each reading what it needs once:

1. column sums of every row over chunks of tokens (float32 partial sums, one slice per chunk);
2. each token's score: the partial sums added in a fixed order into the mean, then
   ``Σ_c (x − mean)²`` over its row;
3. one program per batch row over all its scores: the ``keep`` largest by the radix select of
   ``select`` (ties: the earlier position first, as the reference's stable sort), then a
   prefix-sum compaction that writes the positions in ascending order — no host read.

Deterministic: no atomics, fixed summation orders. Scores are float32 either way, but summed in
another order than torch's, so a near-tie between the last kept and the first dropped token may
resolve the other way than in the torch path (the tests allow that only for tokens within 1e-5 of
the cut, and require the reference's choice on exactly equal scores).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import ref
from ._backend import interpreting
from .select import MAX_TOKENS, _top_keys, map_warps, pos_bits


@triton.jit
def _column_sums_kernel(x_ptr, ws_ptr, L, C, chunk, s_xr, s_xl, SPLIT: tl.constexpr,
                        BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr):
    cb = tl.program_id(0)
    s = tl.program_id(1)
    r = tl.program_id(2).to(tl.int64)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    lo = s * chunk
    hi = tl.minimum(lo + chunk, L)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for l0 in range(lo, hi, BLOCK_L):
        j = l0 + tl.arange(0, BLOCK_L)
        m2 = (j < hi)[:, None] & cm[None, :]
        x = tl.load(x_ptr + r * s_xr + j[:, None].to(tl.int64) * s_xl + c[None, :], mask=m2, other=0.0)
        acc += tl.sum(x.to(tl.float32), axis=0)
    tl.store(ws_ptr + (r * SPLIT + s) * C + c, acc, mask=cm)


@triton.jit
def _score_kernel(x_ptr, ws_ptr, score_ptr, L, C, s_xr, s_xl, SPLIT: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(1).to(tl.int64)
    j = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    jm = j < L
    acc = tl.zeros([ROWS], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        cm = c < C
        total = tl.load(ws_ptr + r * SPLIT * C + c, mask=cm, other=0.0)
        for s in tl.static_range(1, SPLIT):                              # fixed order: deterministic
            total += tl.load(ws_ptr + (r * SPLIT + s) * C + c, mask=cm, other=0.0)
        mean = total / L
        m2 = jm[:, None] & cm[None, :]
        x = tl.load(x_ptr + r * s_xr + j[:, None].to(tl.int64) * s_xl + c[None, :], mask=m2, other=0.0)
        d = tl.where(m2, x.to(tl.float32) - mean[None, :], 0.0)
        acc += tl.sum(d * d, axis=1)
    tl.store(score_ptr + r * L + j, acc, mask=jm)


@triton.jit
def _pick_kernel(score_ptr, idx_ptr, slot_ptr, L, keep, POS_BITS: tl.constexpr, BLOCK_L: tl.constexpr,
                 SLOTS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_L)
    im = i < L
    score = tl.load(score_ptr + r * L + i, mask=im, other=0.0)
    sel = im & _top_keys(score, i, im, keep, POS_BITS)
    slot = tl.cumsum(sel.to(tl.int32), axis=0) - 1                      # ascending positions
    tl.store(idx_ptr + r * keep + slot, i.to(tl.int64), mask=sel)
    if SLOTS:                                                            # the inverse map, for the restore
        tl.store(slot_ptr + r * L + i, tl.where(sel, slot, -1), mask=im)


def launch_shape(R: int, L: int, C: int) -> tuple[int, int, int, int, int]:
    """(token chunks of the column sums, their BLOCK_C, score rows per program, score BLOCK_C,
    selection warps), for R rows of L tokens × C channels, the fastest measured at VAR-d30's and
    Infinity-2B's pruned scales: chunks of ~128 tokens, 64-wide column blocks while they do not fill
    the SMs once and 256-wide beyond, 8 tokens per score program, four warps for the selection up to
    2048 tokens."""
    if interpreting():
        return 2 if L > 64 else 1, min(triton.next_power_of_2(C), 128), 64, min(triton.next_power_of_2(C), 128), 4
    split = max(1, min(16, triton.cdiv(L, 128)))
    block_c = 64 if R * triton.cdiv(C, 256) * split < 132 else 256
    return split, block_c, 8, 512, map_warps(triton.next_power_of_2(L))


def pivotal_tokens(x_RLC: torch.Tensor, keep: int, slots: bool = False, shape: Optional[tuple] = None):
    """Triton twin of ``ref.pivotal_tokens``: (R, keep) int64 positions, ascending; with ``slots``
    also their inverse map (R, L) int32 (``ref.slot_map``), written by the selection's last launch.
    ``shape`` overrides :func:`launch_shape` (benchmarks)."""
    R, L, C = x_RLC.shape
    keep = int(keep)
    if not 0 <= keep <= L:
        raise ValueError(f"keep={keep}: choose between 0 and the {L} tokens of the map")
    dev = x_RLC.device
    if keep == L:
        idx_RL = torch.arange(L, device=dev).expand(R, L).contiguous()
        return (idx_RL, idx_RL.to(torch.int32)) if slots else idx_RL
    if L > MAX_TOKENS or R == 0 or keep == 0 or C == 0:
        return ref.pivotal_tokens(x_RLC, keep, slots)
    if x_RLC.stride(-1) != 1:
        x_RLC = x_RLC.contiguous()
    split, block_c, rows, block_c2, warps = shape or launch_shape(R, L, C)
    chunk = triton.cdiv(L, split)
    ws = torch.empty(R, split, C, device=dev, dtype=torch.float32)
    _column_sums_kernel[(triton.cdiv(C, block_c), split, R)](
        x_RLC, ws, L, C, chunk, x_RLC.stride(0), x_RLC.stride(1), SPLIT=split, BLOCK_L=32, BLOCK_C=block_c,
        num_warps=4)
    score_RL = torch.empty(R, L, device=dev, dtype=torch.float32)
    _score_kernel[(triton.cdiv(L, rows), R)](x_RLC, ws, score_RL, L, C, x_RLC.stride(0), x_RLC.stride(1),
                                             SPLIT=split, ROWS=rows, BLOCK_C=block_c2, num_warps=4)
    idx_Rk = torch.empty(R, keep, device=dev, dtype=torch.long)
    slot_RL = torch.empty(R, L, device=dev, dtype=torch.int32) if slots else idx_Rk      # never written without
    block_l = triton.next_power_of_2(L)
    _pick_kernel[(R,)](score_RL, idx_Rk, slot_RL, L, keep, POS_BITS=pos_bits(block_l), BLOCK_L=block_l,
                       SLOTS=slots, num_warps=warps)
    return (idx_Rk, slot_RL) if slots else idx_Rk
