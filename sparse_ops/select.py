"""Triton: SparseVAR's change map and kept-token selection, twins of ``ref.change_map`` and
``ref.select_kept``.

``change_map`` reads the observed block's input and output once (the eager form makes about four
passes) and writes the per-token change, averaged over the CFG halves, straight into the image's
full map. ``select_kept`` is one program per image over the whole map: threshold (tau · max) or
budget (the ``budget`` largest scores, found by a radix select over packed (score, position) keys —
scores are non-negative, so their float bits order like integers), then a prefix-sum compaction that writes
the kept positions, the padding and the count on the device: no host read, no ``nonzero``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import ref
from ._backend import interpreting

# one program holds a whole map; beyond this the torch path runs (a 128×128 map)
MAX_TOKENS = 16384


def pos_bits(block_l: int) -> int:
    """Bits of a position in the sort keys of a program holding ``block_l`` (a power of two) tokens:
    each is one step of the radix select."""
    return max(1, (block_l - 1).bit_length())


def map_warps(block_l: int) -> int:
    """Warps of a program holding a whole map of ``block_l`` tokens (the selections here and in
    ``pivotal``)."""
    return 4 if block_l <= 2048 else 8 if block_l <= 8192 else 16


def _change_launch(C: int) -> tuple[int, int, int]:
    """(BLOCK_C, ROWS, num_warps) of the change-map kernel: ROWS tokens per program, C in chunks.
    One token per program in 1024-wide chunks measured best."""
    if interpreting():
        return min(triton.next_power_of_2(C), 1024), 64, 4
    return min(triton.next_power_of_2(C), 1024), 1, 8


@triton.jit
def _change_map_kernel(xin_ptr, xout_ptr, idx_ptr, out_ptr, B, G, n, C,
                       stride_ir, stride_il, stride_or_, stride_ol, stride_xb, stride_ob,
                       HAS_IDX: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(1)
    j = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    jm = j < n
    total = tl.zeros([ROWS], dtype=tl.float32)
    for g in range(0, G):
        r = (g * B + b).to(tl.int64)
        acc = tl.zeros([ROWS], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            m2 = jm[:, None] & (c < C)[None, :]
            a = tl.load(xin_ptr + r * stride_ir + j[:, None].to(tl.int64) * stride_il + c[None, :],
                        mask=m2, other=0.0).to(tl.float32)
            o = tl.load(xout_ptr + r * stride_or_ + j[:, None].to(tl.int64) * stride_ol + c[None, :],
                        mask=m2, other=0.0).to(tl.float32)
            d = o - a
            acc += tl.sum(d * d, axis=1)
        total += acc / C
    val = total / G
    if HAS_IDX:
        dst = tl.load(idx_ptr + b.to(tl.int64) * stride_xb + j, mask=jm, other=0).to(tl.int64)
    else:
        dst = j.to(tl.int64)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + dst, val, mask=jm)


def change_map(x_in_RnC: torch.Tensor, x_out_RnC: torch.Tensor, batch: int, idx_Bn: Optional[torch.Tensor],
               L: int) -> torch.Tensor:
    """Triton twin of ``ref.change_map``: (B, L) float32 per-token change, CFG halves averaged."""
    R, n, C = x_out_RnC.shape
    x_in_RnC = x_in_RnC if x_in_RnC.stride(-1) == 1 else x_in_RnC.contiguous()
    x_out_RnC = x_out_RnC if x_out_RnC.stride(-1) == 1 else x_out_RnC.contiguous()
    dev = x_out_RnC.device
    if idx_Bn is None:
        out_BL = torch.empty(batch, n, device=dev, dtype=torch.float32)
    else:
        out_BL = torch.zeros(batch, L, device=dev, dtype=torch.float32)
        idx_Bn = idx_Bn if idx_Bn.stride(-1) == 1 else idx_Bn.contiguous()
    if n == 0 or batch == 0:
        return out_BL
    block_c, rows, num_warps = _change_launch(C)
    _change_map_kernel[(triton.cdiv(n, rows), batch)](
        x_in_RnC, x_out_RnC, idx_Bn if idx_Bn is not None else out_BL, out_BL, batch, R // batch, n, C,
        x_in_RnC.stride(0), x_in_RnC.stride(1), x_out_RnC.stride(0), x_out_RnC.stride(1),
        idx_Bn.stride(0) if idx_Bn is not None else 0, out_BL.stride(0),
        HAS_IDX=idx_Bn is not None, ROWS=rows, BLOCK_C=block_c, num_warps=num_warps)
    return out_BL


@triton.jit
def _top_keys(score, i, im, budget, POS_BITS: tl.constexpr):
    """Mask of the ``budget`` largest of the non-negative float32 ``score`` (positions ``i`` <
    2**POS_BITS, valid where ``im``); ties: the earlier position first. Shared with ``pivotal``."""
    bits = score.to(tl.int32, bitcast=True).to(tl.int64)                # >= 0 for non-negative floats
    key = (bits << POS_BITS) | ((1 << POS_BITS) - 1 - i).to(tl.int64)  # ties: earlier position first
    key = tl.where(im, key, -1)
    # the budget-th largest key, bit by bit from the top (radix select; keys are unique and
    # < 2**(31 + POS_BITS)): 31 + POS_BITS masked counts instead of a sort of the whole map
    kth = tl.full((), 0, dtype=tl.int64)
    for step in range(0, 31 + POS_BITS):
        bit = tl.full((), 30 + POS_BITS, dtype=tl.int64) - step
        cand = kth | (tl.full((), 1, dtype=tl.int64) << bit)
        kth = tl.where(tl.sum((key >= cand).to(tl.int32), axis=0) >= budget, cand, kth)
    return key >= kth


@triton.jit
def _select_kernel(change_ptr, src_ptr, anchor_ptr, idx_ptr, count_ptr, keep_ptr,
                   L, tau, budget, stride_cb,
                   USE_BUDGET: tl.constexpr, POS_BITS: tl.constexpr, BLOCK_L: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_L)
    im = i < L
    src = tl.load(src_ptr + i, mask=im, other=0).to(tl.int64)
    score = tl.load(change_ptr + b * stride_cb + src, mask=im, other=0.0).to(tl.float32)
    anchor = tl.load(anchor_ptr + i, mask=im, other=0) != 0
    if USE_BUDGET:
        keep = im & _top_keys(tl.where(anchor, float("inf"), score), i, im, budget, POS_BITS)
    else:
        top = tl.max(tl.where(im, score, float("-inf")), axis=0)
        keep = im & ((score > tau * top) | anchor)
    keep_i = keep.to(tl.int32)
    count = tl.sum(keep_i, axis=0)
    slot = tl.cumsum(keep_i, axis=0) - 1
    first = tl.min(tl.where(keep, i, BLOCK_L), axis=0)
    tl.store(idx_ptr + b * L + slot, i.to(tl.int64), mask=keep)
    tl.store(idx_ptr + b * L + i, first.to(tl.int64) + tl.zeros_like(i).to(tl.int64), mask=im & (i >= count))
    tl.store(count_ptr + b, count.to(tl.int64))
    tl.store(keep_ptr + b * L + i, keep_i.to(tl.int8), mask=im)


def select_kept(change_BM: torch.Tensor, src_L: torch.Tensor, anchors_L: torch.Tensor, tau: float,
                budget: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of ``ref.select_kept``: (idx_BL, count_B, keep_BL), compacted on the device."""
    B = change_BM.shape[0]
    L = src_L.shape[0]
    if L > MAX_TOKENS or L == 0:
        return ref.select_kept(change_BM, src_L, anchors_L, tau, budget)
    change_BM = change_BM.float()
    change_BM = change_BM if change_BM.stride(-1) == 1 else change_BM.contiguous()
    dev = change_BM.device
    idx_BL = torch.empty(B, L, device=dev, dtype=torch.long)
    count_B = torch.empty(B, device=dev, dtype=torch.long)
    keep_BL = torch.empty(B, L, device=dev, dtype=torch.int8)
    block_l = triton.next_power_of_2(L)
    _select_kernel[(B,)](
        change_BM, src_L.contiguous(), anchors_L.contiguous().view(torch.uint8) if anchors_L.dtype == torch.bool
        else anchors_L.contiguous(), idx_BL, count_B, keep_BL,
        L, float(tau), int(budget) if budget is not None else 0, change_BM.stride(0),
        USE_BUDGET=budget is not None, POS_BITS=pos_bits(block_l), BLOCK_L=block_l,
        num_warps=map_warps(block_l))
    return idx_BL, count_B, keep_BL.view(torch.bool)
