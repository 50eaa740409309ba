"""Triton: SparVAR's gathered column-sparse attention, twin of ``ref.group_sparse_attention``.

Each program takes one (row·head, query group, block of the group's queries) and keeps an online
softmax (FA2-style, base 2) over three runs of keys: the prefix every group reads (contiguous
tiles), the group's band (one contiguous range), then its key list (``ref.key_lists``), whose K
and V rows are gathered from the cache into dense tiles, skipping keys the first two runs read.
Every run multiplies on the tensor cores; no mask over the full cache is read, and the work grows
with the keys a group reads, not with the cache. Loop bounds (band, list count) are read on the
device. A group may read another group's list (a map of groups) and count the listed keys it read.
With a map to add (CS4A's O_cache), the epilogue adds its bilinear resize to the query scale (the
four taps of ``F.interpolate``'s align_corners=False rule) to the float32 result, so the resized
map is never written.

``tl.dot`` on bf16 is wrong in Triton's CPU interpreter (triton#11584), so there the operands are
cast to float32 first (``UPCAST``); on a GPU bf16/fp16 operands go to the tensor cores with float32
accumulation, and float32 operands use IEEE precision (no TF32).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._backend import fit_stages, interpreting, shared_memory
from .ref import _check_add, _check_group_lists

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(q, k_ptrs, v_ptrs, kv_mask, valid, m_i, l_i, acc, scale_log2,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys into the online softmax; ``valid`` ([1, BLOCK_N] per key, or [BLOCK_M, BLOCK_N]
    per score) may be all False (then nothing changes)."""
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)                # no key yet: keep exp2 finite
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _start_queries(q_ptr, pos, rows, r, hh, sq_r, sq_h, sq_l, d, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """The queries at positions ``pos`` (``rows`` valid) of one (row, head), and an empty online
    softmax for them: (q, dd, dmask, m_i, l_i, acc)."""
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < d
    q = tl.load(q_ptr + r * sq_r + hh * sq_h + pos[:, None].to(tl.int64) * sq_l + dd[None, :],
                mask=rows[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    return q, dd, dmask, m_i, l_i, acc


@triton.jit
def _attend_range(q, k_base, v_base, lo, hi, sk_l, sv_l, dd, dmask, m_i, l_i, acc, scale_log2,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """The contiguous keys lo … hi (inclusive; none where hi < lo) into the online softmax, in
    tiles of ``BLOCK_N``."""
    for n0 in range(lo, hi + 1, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n <= hi
        key = n.to(tl.int64)
        kv_mask = valid[:, None] & dmask[None, :]
        m_i, l_i, acc = _attend_tile(q, k_base + key[:, None] * sk_l + dd[None, :],
                                     v_base + key[:, None] * sv_l + dd[None, :], kv_mask, valid[None, :], m_i, l_i,
                                     acc, scale_log2, UPCAST, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _group_attention_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, count_ptr, band_ptr, o_ptr, add_ptr, src_ptr, reads_ptr,
                            H, l, d, group, G, G_src, K, prefix, scale_log2, sq_r, sq_h, sq_l,
                            sk_r, sk_h, sk_l, sv_r, sv_h, sv_l, so_r, so_h, so_l, sa_r, sa_h, sa_l, w, h_add, w_add,
                            ratio_h, ratio_w,
                            HAS_BAND: tl.constexpr, HAS_ADD: tl.constexpr,
                            MAP_GROUPS: tl.constexpr, COUNT_READS: tl.constexpr, UPCAST: tl.constexpr,
                            PRECISION: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rh = tl.program_id(2)
    g = tl.program_id(1)
    r = (rh // H).to(tl.int64)
    hh = (rh % H).to(tl.int64)
    q_lo = g * group
    q_hi = tl.minimum(q_lo + group, l)
    m = q_lo + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = m < q_hi
    q, dd, dmask, m_i, l_i, acc = _start_queries(q_ptr, m, rows, r, hh, sq_r, sq_h, sq_l, d, UPCAST, BLOCK_M, BLOCK_D)
    k_base = k_ptr + r * sk_r + hh * sk_h
    v_base = v_ptr + r * sv_r + hh * sv_h
    # 1. the prefix every group reads: contiguous tiles
    m_i, l_i, acc = _attend_range(q, k_base, v_base, 0, prefix - 1, sk_l, sv_l, dd, dmask, m_i, l_i, acc, scale_log2,
                                  UPCAST, PRECISION, BLOCK_N)
    # 2. the group's band: one contiguous range (keys inside the prefix were read above)
    lo = prefix
    hi = prefix - 1
    if HAS_BAND:
        lo = tl.maximum(tl.load(band_ptr + 2 * g), prefix)
        hi = tl.load(band_ptr + 2 * g + 1)
        m_i, l_i, acc = _attend_range(q, k_base, v_base, lo, hi, sk_l, sv_l, dd, dmask, m_i, l_i, acc, scale_log2,
                                      UPCAST, PRECISION, BLOCK_N)
    # 3. the listed keys (group g's list, or list src_ptr[g] with a map of groups), gathered; those
    # already read (prefix, band) are skipped
    src = g
    if MAP_GROUPS:
        src = tl.load(src_ptr + g)
    list_at = rh.to(tl.int64) * G_src + src
    count = tl.load(count_ptr + list_at)
    reads = tl.zeros([BLOCK_N], dtype=tl.int32)
    for n0 in range(0, count, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        listed = n < count
        key = tl.load(idx_ptr + list_at * K + n, mask=listed, other=0)
        valid = listed & (key >= prefix) & ((key < lo) | (key > hi))
        if COUNT_READS:
            reads += valid.to(tl.int32)
        key = key.to(tl.int64)
        kv_mask = valid[:, None] & dmask[None, :]
        m_i, l_i, acc = _attend_tile(q, k_base + key[:, None] * sk_l + dd[None, :],
                                     v_base + key[:, None] * sv_l + dd[None, :], kv_mask, valid[None, :], m_i, l_i, acc,
                                     scale_log2, UPCAST, PRECISION)
    if COUNT_READS:      # one program of the group writes its count
        if tl.program_id(0) == 0:
            tl.store(reads_ptr + rh.to(tl.int64) * G + g, tl.sum(reads, axis=0))
    out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)     # no key: zeros
    if HAS_ADD:      # + the (h_add, w_add) map resized to the queries' (l / w, w) map, bilinear
        y = m // w
        x = m - y * w
        sy = tl.maximum((y.to(tl.float32) + 0.5) * ratio_h - 0.5, 0.0)
        sx = tl.maximum((x.to(tl.float32) + 0.5) * ratio_w - 0.5, 0.0)
        y0 = sy.to(tl.int32)
        x0 = sx.to(tl.int32)
        y1 = tl.minimum(y0 + 1, h_add - 1)
        x1 = tl.minimum(x0 + 1, w_add - 1)
        ly = (sy - y0.to(tl.float32))[:, None]
        lx = (sx - x0.to(tl.float32))[:, None]
        a_base = add_ptr + r * sa_r + hh * sa_h + dd[None, :]
        amask = rows[:, None] & dmask[None, :]
        a00 = tl.load(a_base + (y0 * w_add + x0)[:, None].to(tl.int64) * sa_l, mask=amask, other=0.0).to(tl.float32)
        a01 = tl.load(a_base + (y0 * w_add + x1)[:, None].to(tl.int64) * sa_l, mask=amask, other=0.0).to(tl.float32)
        a10 = tl.load(a_base + (y1 * w_add + x0)[:, None].to(tl.int64) * sa_l, mask=amask, other=0.0).to(tl.float32)
        a11 = tl.load(a_base + (y1 * w_add + x1)[:, None].to(tl.int64) * sa_l, mask=amask, other=0.0).to(tl.float32)
        out += (1.0 - ly) * ((1.0 - lx) * a00 + lx * a01) + ly * ((1.0 - lx) * a10 + lx * a11)
    tl.store(o_ptr + r * so_r + hh * so_h + m[:, None].to(tl.int64) * so_l + dd[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rows[:, None] & dmask[None, :])


def _launch(d: int, elem: int = 2, limit: Optional[int] = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for head dim ``d`` and ``elem``-byte operands within
    ``limit`` bytes of shared memory (``_backend.shared_memory``): 64 queries by 64 keys, four
    warps, three stages (the best of a sweep at d=128, benchmarks/results/README.md, Session 35);
    fewer stages, then narrower key tiles, where they do not fit."""
    if interpreting():
        return 16, 16, 4, 1
    bd = max(16, triton.next_power_of_2(d))
    for block_n in (64, 32, 16):
        stages = fit_stages(3, elem * 64 * bd, elem * 2 * block_n * bd, limit)   # q; k and v tiles a stage
        if stages is not None:
            return 64, block_n, 4, stages
    return 32, 16, 4, 1


def _operands(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, v_RHLd: torch.Tensor):
    """q, k, v with a unit-stride head dim, k and v in q's dtype (what the gathered kernels load)."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_RHld, k_RHLd, v_RHLd))
    return q, k.to(q.dtype), v.to(q.dtype)


def group_sparse_attention(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, v_RHLd: torch.Tensor, idx_RHGK: torch.Tensor,
                           count_RHG: torch.Tensor, group: int, scale: float, prefix: int = 0,
                           band_G2: Optional[torch.Tensor] = None, add_RHpd: Optional[torch.Tensor] = None,
                           hw: Optional[tuple[int, int]] = None, add_hw: Optional[tuple[int, int]] = None,
                           list_of_G: Optional[torch.Tensor] = None, reads_RHG: Optional[torch.Tensor] = None
                           ) -> torch.Tensor:
    """Triton twin of ``ref.group_sparse_attention``: (R, H, l, d) in q's dtype."""
    R, H, l, d = q_RHld.shape
    G, K = -(-l // group), idx_RHGK.shape[-1]
    _check_group_lists(idx_RHGK, count_RHG, band_G2, R, H, G, l, group, list_of_G, reads_RHG)
    _check_add(add_RHpd, hw, add_hw, R, H, l, d)
    q, k, v = _operands(q_RHld, k_RHLd, v_RHLd)
    idx = idx_RHGK if idx_RHGK.dtype == torch.int32 and idx_RHGK.is_contiguous() else \
        idx_RHGK.to(torch.int32).contiguous()
    count = count_RHG if count_RHG.dtype == torch.int32 and count_RHG.is_contiguous() else \
        count_RHG.to(torch.int32).contiguous()
    band = None if band_G2 is None else band_G2.to(device=q.device, dtype=torch.int32).contiguous()
    src = None if list_of_G is None else list_of_G.to(device=q.device, dtype=torch.int32).contiguous()
    add = None if add_RHpd is None else (add_RHpd if add_RHpd.stride(-1) == 1 else add_RHpd.contiguous())
    w, (h_add, w_add) = (hw[1], add_hw) if add is not None else (1, (1, 1))
    out = torch.empty(R, H, l, d, device=q.device, dtype=q_RHld.dtype)
    if R * H * l * d == 0:
        return out
    upcast = interpreting() and q.dtype not in (torch.float32, torch.float64)
    precision = "ieee" if q.dtype == torch.float32 else None
    block_m, block_n, num_warps, num_stages = _launch(d, q.element_size(), shared_memory(q.device))
    grid = (triton.cdiv(min(group, l), block_m), G, R * H)
    _group_attention_kernel[grid](
        q, k, v, idx, count, band if band is not None else count, out, add if add is not None else out,
        src if src is not None else count,
        reads_RHG if reads_RHG is not None else count, H, l, d, group, G, idx.shape[2], K, int(prefix),
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        *((add.stride(0), add.stride(1), add.stride(2)) if add is not None else (0, 0, 0)),
        w, h_add, w_add, h_add / (l // w), w_add / w,
        HAS_BAND=band is not None, HAS_ADD=add is not None, MAP_GROUPS=src is not None, COUNT_READS=reads_RHG is not None, UPCAST=upcast, PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)), num_warps=num_warps,
        num_stages=num_stages)
    return out
