"""Triton: column sums of attention probabilities per query group (SparVAR's decision scale),
twin of ``ref.attention_colsum``.

Two passes, no atomics (research/kernels.md §4.2): pass 1 computes every query's log-sum-exp over
all keys (online, FA2-style), unless the caller has it from its dense pass; pass 2 gives each
program one (row·head, key block) and a run of query groups, recomputes q·kᵀ for each group's
queries tile by tile, turns it into probabilities with the LSE and sums them over the group's
queries, so each output element is written by exactly one program.

``tl.dot`` on bf16 is wrong in Triton's CPU interpreter (triton#11584), so there the operands are
cast to float32 first (``UPCAST``); on a GPU bf16/fp16 operands go to the tensor cores with float32
accumulation, and float32 operands use IEEE precision (no TF32).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._backend import fit_stages, interpreting, shared_memory, sm_count

_LOG2E = 1.4426950408889634


@triton.jit
def _load_operand(ptrs, mask, UPCAST: tl.constexpr):
    x = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _lse_kernel(q_ptr, k_ptr, lse_ptr, H, l, Lk, d, scale_log2,
                sq_r, sq_h, sq_l, sk_r, sk_h, sk_l,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rh = tl.program_id(1)
    r = (rh // H).to(tl.int64)
    hh = (rh % H).to(tl.int64)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    q_ptrs = q_ptr + r * sq_r + hh * sq_h + m[:, None].to(tl.int64) * sq_l + dd[None, :]
    qm = (m < l)[:, None] & (dd < d)[None, :]
    q = _load_operand(q_ptrs, qm, UPCAST)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(0, Lk, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        k_ptrs = k_ptr + r * sk_r + hh * sk_h + n[:, None].to(tl.int64) * sk_l + dd[None, :]
        km = (n < Lk)[:, None] & (dd < d)[None, :]
        k = _load_operand(k_ptrs, km, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where((n < Lk)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m_i = m_new
    tl.store(lse_ptr + rh.to(tl.int64) * l + m, m_i + tl.log2(l_i), mask=m < l)


@triton.jit
def _colsum_kernel(q_ptr, k_ptr, lse_ptr, out_ptr, H, l, Lk, d, group, G, groups, tiles, scale_log2,
                   sq_r, sq_h, sq_l, sk_r, sk_h, sk_l,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rh = tl.program_id(2)
    g0 = tl.program_id(1) * groups
    r = (rh // H).to(tl.int64)
    hh = (rh % H).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dd = tl.arange(0, BLOCK_D)
    k_ptrs = k_ptr + r * sk_r + hh * sk_h + n[:, None].to(tl.int64) * sk_l + dd[None, :]
    km = (n < Lk)[:, None] & (dd < d)[None, :]
    k = _load_operand(k_ptrs, km, UPCAST)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # one flat loop over this program's groups' query tiles (``tiles`` a group), so the key tile is
    # loaded once and the query loads pipeline across groups; a group's sums are stored after its
    # last tile and the accumulator cleared
    for t in range(0, (tl.minimum(g0 + groups, G) - g0) * tiles):
        g = g0 + t // tiles
        j = t % tiles
        i = j * BLOCK_M + tl.arange(0, BLOCK_M)
        m = g * group + i
        rows = (i < group) & (m < l)
        q_ptrs = q_ptr + r * sq_r + hh * sq_h + m[:, None].to(tl.int64) * sq_l + dd[None, :]
        qm = rows[:, None] & (dd < d)[None, :]
        q = _load_operand(q_ptrs, qm, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        lse = tl.load(lse_ptr + rh.to(tl.int64) * l + m, mask=rows, other=0.0)
        p = tl.exp2(s - lse[:, None])
        acc += tl.sum(tl.where(rows[:, None], p, 0.0), axis=0)
        last = j == tiles - 1
        tl.store(out_ptr + (rh.to(tl.int64) * G + g) * Lk + n, acc, mask=(n < Lk) & last)
        acc = tl.where(last, 0.0, acc)


def _colsum_launch(d: int, elem: int = 2, limit: Optional[int] = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of both passes for head dim ``d`` and ``elem``-byte
    operands within ``limit`` bytes of shared memory (``_backend.shared_memory``): 64×128 tiles, 4
    warps, three stages (the best of a sweep at d=128); fewer stages, then narrower key tiles, where
    they do not fit. The log-sum-exp pass, which keeps its 64 queries and streams key tiles, needs
    the most; the column-sum pass keeps a key tile and streams query tiles and their sums."""
    if interpreting():
        return 16, 32, 4, 1
    bd = max(16, triton.next_power_of_2(d))
    for block_n in (128, 64, 32):
        lse = fit_stages(3, elem * 64 * bd, elem * block_n * bd, limit)
        sums = fit_stages(3, elem * block_n * bd, elem * 64 * bd + 4 * 64, limit)
        if lse is not None and sums is not None:
            return 64, block_n, 4, min(lse, sums)
    return 32, 32, 4, 1


def _groups_per_program(G: int, programs_a_group: int, sms: int) -> int:
    """Query groups one column-sum program sums (each reading its key tile once): as many as leave
    at least two waves of programs on ``sms`` SMs."""
    return max(1, min(G, (G * programs_a_group) // (2 * sms)))


def attention_colsum(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, scale: float, group: int,
                     lse_RHl: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton twin of ``ref.attention_colsum``: (R, H, G, Lk) float32 summed probabilities."""
    R, H, l, d = q_RHld.shape
    Lk = k_RHLd.shape[2]
    G = -(-l // group)
    q = q_RHld if q_RHld.stride(-1) == 1 else q_RHld.contiguous()
    k = k_RHLd if k_RHLd.stride(-1) == 1 else k_RHLd.contiguous()
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    dev = q.device
    out = torch.empty(R, H, G, Lk, device=dev, dtype=torch.float32)
    if R * H * l * Lk == 0:
        return out.zero_()
    interp = interpreting()
    upcast = interp and q.dtype not in (torch.float32, torch.float64)
    precision = "ieee" if q.dtype == torch.float32 else None
    block_d = max(16, triton.next_power_of_2(d))
    block_m, block_n, num_warps, num_stages = _colsum_launch(d, q.element_size(), shared_memory(q.device))
    scale_log2 = float(scale) * _LOG2E
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    if lse_RHl is not None:                      # natural log → the kernels' base 2
        lse = (lse_RHl.float() * _LOG2E).reshape(R * H, l).contiguous()
    else:
        lse = torch.empty(R * H, l, device=dev, dtype=torch.float32)
        _lse_kernel[(triton.cdiv(l, block_m), R * H)](
            q, k, lse, H, l, Lk, d, scale_log2, *strides,
            UPCAST=upcast, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
            num_warps=num_warps, num_stages=num_stages)
    tiles = triton.cdiv(min(group, l), block_m)                 # query tiles a group
    groups = _groups_per_program(G, triton.cdiv(Lk, block_n) * R * H, sm_count(dev))
    _colsum_kernel[(triton.cdiv(Lk, block_n), triton.cdiv(G, groups), R * H)](
        q, k, lse, out, H, l, Lk, d, group, G, groups, tiles, scale_log2, *strides,
        UPCAST=upcast, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=num_warps, num_stages=num_stages)
    return out
