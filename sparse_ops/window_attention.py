"""Triton: SparVAR's CSLA as gathered windowed attention, twin of ``ref.window_attention``.

Each program takes one (row·head, tile) — a tile is a small 2-D patch of the query map, so the
keys its queries' windows reach in each key scale form a small patch there too. It keeps an online
softmax (base 2) over the prefix every query reads (contiguous tiles), then over the tile's key list,
whose K and V rows are gathered from the cache into dense tiles; each listed key carries the ranges
of query rows and columns whose window holds it (four table loads per key), so the window is exact
per score. The work grows with the tile's keys (the union of its queries' windows), not with the
cache; every run multiplies on the tensor cores (``group_attention._attend_tile``).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._backend import fit_stages, interpreting, shared_memory
from .group_attention import _LOG2E, _attend_range, _attend_tile, _operands, _start_queries
from .ref import _check_window_tiles


@triton.jit
def _window_attention_kernel(q_ptr, k_ptr, v_ptr, tq_ptr, tk_ptr, count_ptr, tab_ptr, o_ptr, H, d, M, K, L, prefix,
                             w, scale_log2, sq_r, sq_h, sq_l, sk_r, sk_h, sk_l, sv_r, sv_h, sv_l, so_r, so_h, so_l,
                             UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    rh = tl.program_id(1)
    r = (rh // H).to(tl.int64)
    hh = (rh % H).to(tl.int64)
    mm = tl.arange(0, BLOCK_M)
    qpos = tl.load(tq_ptr + t * M + mm, mask=mm < M, other=-1)
    rows = qpos >= 0
    qy = qpos // w
    qx = qpos - qy * w
    q, dd, dmask, m_i, l_i, acc = _start_queries(q_ptr, qpos, rows, r, hh, sq_r, sq_h, sq_l, d, UPCAST, BLOCK_M,
                                                 BLOCK_D)
    k_base = k_ptr + r * sk_r + hh * sk_h
    v_base = v_ptr + r * sv_r + hh * sv_h
    # 1. the prefix every query reads: contiguous tiles
    m_i, l_i, acc = _attend_range(q, k_base, v_base, 0, prefix - 1, sk_l, sv_l, dd, dmask, m_i, l_i, acc, scale_log2,
                                  UPCAST, PRECISION, BLOCK_N)
    # 2. the tile's listed keys, gathered; each read only by the queries inside its window
    count = tl.load(count_ptr + t)
    for n0 in range(0, count, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        listed = n < count
        key = tl.load(tk_ptr + t * K + n, mask=listed, other=0).to(tl.int64)
        y_lo = tl.load(tab_ptr + key, mask=listed, other=1)
        y_hi = tl.load(tab_ptr + L + key, mask=listed, other=0)
        x_lo = tl.load(tab_ptr + 2 * L + key, mask=listed, other=1)
        x_hi = tl.load(tab_ptr + 3 * L + key, mask=listed, other=0)
        seen = (y_lo[None, :] <= qy[:, None]) & (qy[:, None] <= y_hi[None, :]) \
            & (x_lo[None, :] <= qx[:, None]) & (qx[:, None] <= x_hi[None, :])
        kv_mask = listed[:, None] & dmask[None, :]
        m_i, l_i, acc = _attend_tile(q, k_base + key[:, None] * sk_l + dd[None, :],
                                     v_base + key[:, None] * sv_l + dd[None, :], kv_mask, seen, m_i, l_i, acc,
                                     scale_log2, UPCAST, PRECISION)
    out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)     # no key: zeros
    tl.store(o_ptr + r * so_r + hh * so_h + qpos[:, None].to(tl.int64) * so_l + dd[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rows[:, None] & dmask[None, :])


def _launch(M: int, d: int = 128, elem: int = 2, limit: Optional[int] = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for ``M``-query tiles, head dim ``d`` and
    ``elem``-byte operands within ``limit`` bytes of shared memory (``_backend.shared_memory``): the
    tile's queries (a power of two) by 32 keys, three stages; fewer stages, then 16-key tiles, where
    they do not fit."""
    block_m = max(16, triton.next_power_of_2(M))
    if interpreting():
        return block_m, 16, 4, 1
    bd = max(16, triton.next_power_of_2(d))
    for block_n in (32, 16):
        stages = fit_stages(3, elem * block_m * bd, elem * 2 * block_n * bd, limit)   # q; k and v tiles a stage
        if stages is not None:
            return block_m, block_n, 4, stages
    return block_m, 16, 4, 1


def window_attention(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, v_RHLd: torch.Tensor, tile_q_TM: torch.Tensor,
                     tile_keys_TK: torch.Tensor, count_T: torch.Tensor, prefix: int, tables_4L: torch.Tensor,
                     w: int, scale: float) -> torch.Tensor:
    """Triton twin of ``ref.window_attention``: (R, H, l, d) in q's dtype."""
    R, H, l, d = q_RHld.shape
    Lk = k_RHLd.shape[2]
    _check_window_tiles(tile_q_TM, tile_keys_TK, count_T, tables_4L, prefix, l, Lk)
    q, k, v = _operands(q_RHld, k_RHLd, v_RHLd)
    tq, tk, count, tab = (x if x.dtype == torch.int32 and x.is_contiguous() else x.to(torch.int32).contiguous()
                          for x in (tile_q_TM, tile_keys_TK, count_T, tables_4L))
    out = torch.zeros(R, H, l, d, device=q.device, dtype=q_RHld.dtype)
    T, M = tq.shape
    if R * H * l * d == 0 or T == 0:
        return out
    upcast = interpreting() and q.dtype not in (torch.float32, torch.float64)
    precision = "ieee" if q.dtype == torch.float32 else None
    block_m, block_n, num_warps, num_stages = _launch(M, d, q.element_size(), shared_memory(q.device))
    _window_attention_kernel[(T, R * H)](
        q, k, v, tq, tk, count, tab, out, H, d, M, tk.shape[1], Lk, int(prefix), int(w), float(scale) * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        UPCAST=upcast, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(d)), num_warps=num_warps, num_stages=num_stages)
    return out
