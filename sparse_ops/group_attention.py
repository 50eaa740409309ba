"""Triton: SparVAR's gathered column-sparse attention, twin of ``ref.group_sparse_attention``.

Each program takes one (row·head, query group, block of the group's queries). It walks the
group's key index list (``ref.key_lists``) in tiles of ``BLOCK_N``: gathers those K and V rows
from the cache into dense tiles, multiplies on the tensor cores, and keeps an online softmax
(FA2-style, base 2), so no mask over the full cache is read and the work grows with the keys a
group keeps, not with the cache. The loop bound is the group's count, read on the device.

``tl.dot`` on bf16 is wrong in Triton's CPU interpreter (triton#11584), so there the operands are
cast to float32 first (``UPCAST``); on a GPU bf16/fp16 operands go to the tensor cores with float32
accumulation, and float32 operands use IEEE precision (no TF32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import interpreting

_LOG2E = 1.4426950408889634


@triton.jit
def _group_attention_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, count_ptr, o_ptr, H, l, d, group, G, K, scale_log2,
                            sq_r, sq_h, sq_l, sk_r, sk_h, sk_l, sv_r, sv_h, sv_l, so_r, so_h, so_l,
                            UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rh = tl.program_id(2)
    g = tl.program_id(1)
    r = (rh // H).to(tl.int64)
    hh = (rh % H).to(tl.int64)
    q_lo = g * group
    q_hi = tl.minimum(q_lo + group, l)
    m = q_lo + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = m < q_hi
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < d
    q = tl.load(q_ptr + r * sq_r + hh * sq_h + m[:, None].to(tl.int64) * sq_l + dd[None, :],
                mask=rows[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    list_at = rh.to(tl.int64) * G + g
    count = tl.load(count_ptr + list_at)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, count, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        keep = n < count
        key = tl.load(idx_ptr + list_at * K + n, mask=keep, other=0).to(tl.int64)
        kv_mask = keep[:, None] & dmask[None, :]
        k = tl.load(k_ptr + r * sk_r + hh * sk_h + key[:, None] * sk_l + dd[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + r * sv_r + hh * sv_h + key[:, None] * sv_l + dd[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(keep[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))                       # finite: the tile holds a kept key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)     # no key: zeros
    tl.store(o_ptr + r * so_r + hh * so_h + m[:, None].to(tl.int64) * so_l + dd[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rows[:, None] & dmask[None, :])


def _launch(d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    if interpreting():
        return 16, 16, 4, 1
    return 64, 64, 4, 2


def group_sparse_attention(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, v_RHLd: torch.Tensor, idx_RHGK: torch.Tensor,
                           count_RHG: torch.Tensor, group: int, scale: float) -> torch.Tensor:
    """Triton twin of ``ref.group_sparse_attention``: (R, H, l, d) in q's dtype."""
    R, H, l, d = q_RHld.shape
    G, K = -(-l // group), idx_RHGK.shape[-1]
    if idx_RHGK.shape[:3] != (R, H, G) or count_RHG.shape != (R, H, G):
        raise ValueError(f"group_sparse_attention: idx_RHGK {tuple(idx_RHGK.shape)} / count_RHG "
                         f"{tuple(count_RHG.shape)} need (R, H, G) = {(R, H, G)} for {l} queries in groups of {group}")
    q = q_RHld if q_RHld.stride(-1) == 1 else q_RHld.contiguous()
    k = k_RHLd if k_RHLd.stride(-1) == 1 else k_RHLd.contiguous()
    v = v_RHLd if v_RHLd.stride(-1) == 1 else v_RHLd.contiguous()
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    if v.dtype != q.dtype:
        v = v.to(q.dtype)
    idx = idx_RHGK.to(torch.int32).contiguous()
    count = count_RHG.to(torch.int32).contiguous()
    out = torch.empty(R, H, l, d, device=q.device, dtype=q_RHld.dtype)
    if R * H * l * d == 0:
        return out
    upcast = interpreting() and q.dtype not in (torch.float32, torch.float64)
    precision = "ieee" if q.dtype == torch.float32 else None
    block_m, block_n, num_warps, num_stages = _launch(d)
    grid = (triton.cdiv(min(group, l), block_m), G, R * H)
    _group_attention_kernel[grid](
        q, k, v, idx, count, out, H, l, d, group, G, K, float(scale) * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        UPCAST=upcast, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(d)), num_warps=num_warps, num_stages=num_stages)
    return out
