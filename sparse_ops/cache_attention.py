"""Triton: VAR's attention step over the KV cache in one launch. Twin of ``ref.qk_norm_attend``.

Unfused, a VAR layer's attention is three kernels: the q/k cosine norm with the cache write
(``dense_fused.qk_norm_store``), SDPA over the cache, and (for the first scales) the copy of SDPA's
(R, H, l, d) output into the (R, l, C) rows of the output projection. At batch 1 each of them is far
below a microsecond of work, and inside a CUDA graph each costs its launch and ramp-up.

Here one program owns (a block of ≤ 64 queries, one head, one row):
1. it normalises its queries (× the head's temperature) and its own tokens' keys, and writes those
   keys and the raw values into their cache slots;
2. it runs an online-softmax attention (the flash-attention recurrence, float32 statistics, bf16
   operands as in SDPA's kernels) first over the earlier scales' keys, read from the cache, then
   over this scale's keys, which it normalises again from the qkv rows: other programs are writing
   those slots concurrently, so they are not read back. Normalising twice gives the same bits, so
   the cache and the attention see identical keys;
3. it writes its output straight into the (R, l, H, d) layout the projection reads as (R, l, C).

Only the unmasked case (every row attends to every cached key) runs here; a key-padding mask goes
through ``sparse_ops.attention``. ``tl.dot`` on bf16 is wrong in Triton's CPU interpreter
(triton#11584), so there the operands are cast to float32 first (``UPCAST``).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _gdc
from ._backend import dependent_launch, fit_stages, interpreting, shared_memory
from .dense_fused import _norm_rows
from .gemm_rows import empty_rows

_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _online_block(q, k, v, key_ok, m_i, l_i, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One block of keys in the online-softmax recurrence: returns the new (m_i, l_i, acc)."""
    if UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    s = tl.where(key_ok[None, :], s * _LOG2E, float("-inf"))                # log2 domain: exp2 below
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if UPCAST:
        acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc * alpha[:, None], input_precision=PRECISION)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _qk_norm_attend_kernel(qkv_ptr, mult_ptr, k_ptr, v_ptr, o_ptr, l, start, H,
                           s_ar, s_al, s_kr, s_kh, s_kl, s_vr, s_vh, s_vl, s_or, s_ol,
                           D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                           UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    _gdc.release_then_wait(PDL)
    qb = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    r = tl.program_id(2).to(tl.int64)
    d = tl.arange(0, D)
    t = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)                     # this program's tokens of the scale
    t_ok = t < l
    row = qkv_ptr + r * s_ar + h * D + d[None, :]                # head h inside a (3, H, d) token row
    mq = tl.load(mult_ptr + h)
    mk = tl.load(mult_ptr + H + h)
    dt = k_ptr.dtype.element_ty
    # 1. own queries, own keys and values → cache slots start + t
    q = _norm_rows(tl.load(row + t[:, None] * s_al, mask=t_ok[:, None], other=0.0).to(tl.float32), mq).to(dt)
    k_own = _norm_rows(tl.load(row + t[:, None] * s_al + H * D, mask=t_ok[:, None], other=0.0).to(tl.float32), mk)
    v_own = tl.load(row + t[:, None] * s_al + 2 * H * D, mask=t_ok[:, None], other=0.0)
    slot = (start + t)[:, None].to(tl.int64)
    tl.store(k_ptr + r * s_kr + h * s_kh + slot * s_kl + d[None, :], k_own.to(dt), mask=t_ok[:, None])
    tl.store(v_ptr + r * s_vr + h * s_vh + slot * s_vl + d[None, :], v_own.to(dt), mask=t_ok[:, None])
    # 2. online softmax over the earlier scales' keys (cache), then this scale's (qkv rows)
    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, D], tl.float32)
    j0 = tl.arange(0, BLOCK_K)
    for kb in range(0, start, BLOCK_K):
        j = kb + j0
        j_ok = j < start
        jj = j[:, None].to(tl.int64)
        k = tl.load(k_ptr + r * s_kr + h * s_kh + jj * s_kl + d[None, :], mask=j_ok[:, None], other=0.0)
        v = tl.load(v_ptr + r * s_vr + h * s_vh + jj * s_vl + d[None, :], mask=j_ok[:, None], other=0.0)
        m_i, l_i, acc = _online_block(q, k, v, j_ok, m_i, l_i, acc, UPCAST, PRECISION)
    for kb in range(0, l, BLOCK_K):
        j = kb + j0
        j_ok = j < l
        src = row + j[:, None] * s_al
        k = _norm_rows(tl.load(src + H * D, mask=j_ok[:, None], other=0.0).to(tl.float32), mk).to(dt)
        v = tl.load(src + 2 * H * D, mask=j_ok[:, None], other=0.0)
        m_i, l_i, acc = _online_block(q, k, v, j_ok, m_i, l_i, acc, UPCAST, PRECISION)
    out = acc / l_i[:, None]
    tl.store(o_ptr + r * s_or + t[:, None].to(tl.int64) * s_ol + h * D + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=t_ok[:, None])


def launch_shape(rows: int, heads: int, l: int, L: int, head_dim: int = 64, elem: int = 2,
                 limit: Optional[int] = None) -> tuple[int, int, int, int]:
    """(query block, key block, warps, pipeline stages) for ``rows`` × ``heads`` × ``l`` queries
    over ``L`` keys, the fastest of a sweep over VAR-d30's shapes: with few (row, head) pairs, small
    query blocks put more programs on the SMs; with many, 64-query blocks read each key block fewer
    times, and 32-key blocks are faster up to 128 queries. Within ``limit`` bytes of shared memory
    (``_backend.shared_memory``, for ``head_dim`` and ``elem``-byte operands): fewer stages, then
    narrower key blocks, where they do not fit."""
    if interpreting():
        return 16, 16, 4, 1
    if rows * heads < 256:
        block_q = 16 if l <= 48 else 32 if l <= 64 else 64
        block_k = 32 if l <= 32 else 64
    else:
        block_q = 16 if l <= 16 else 32 if l <= 32 else 64
        block_k = 32 if l <= 128 else 64
    stages = 2 if l <= 48 else 3
    while True:
        fit = fit_stages(stages, elem * block_q * head_dim, elem * 2 * block_k * head_dim, limit)  # q; k, v a stage
        if fit is not None or block_k == 16:
            return block_q, block_k, 4, fit or 1
        block_k //= 2


def qk_norm_attend(qkv_Rl3Hd: torch.Tensor, mult_2H1: torch.Tensor, k_RHLd: torch.Tensor,
                   v_RHLd: torch.Tensor, pdl: bool | None = None) -> torch.Tensor:
    """Triton twin of ``ref.qk_norm_attend``: writes this scale's normalised keys and raw values
    into the last ``l`` slots of ``k_RHLd`` / ``v_RHLd`` and returns the attention output as a
    contiguous (R, l, H, d). ``pdl`` overrides where programmatic dependent launch is used
    (``_backend.dependent_launch``; tests)."""
    R, l, three, H, D = qkv_Rl3Hd.shape
    L = k_RHLd.shape[2]
    assert three == 3 and k_RHLd.shape == (R, H, L, D) and v_RHLd.shape == (R, H, L, D) and L >= l
    assert D == triton.next_power_of_2(D) and D >= 16, f"head dim {D}: the kernel needs a power of two ≥ 16"
    if qkv_Rl3Hd.stride(-1) != 1 or qkv_Rl3Hd.stride(-2) != D or qkv_Rl3Hd.stride(2) != H * D:
        qkv_Rl3Hd = qkv_Rl3Hd.contiguous()
    assert k_RHLd.stride(-1) == 1 and v_RHLd.stride(-1) == 1, "cache views need a contiguous head dim"
    assert k_RHLd.dtype == v_RHLd.dtype == qkv_Rl3Hd.dtype, "qkv and the cache share one dtype"
    mult = mult_2H1.reshape(2 * H).to(torch.float32).contiguous()
    out_RlHd = empty_rows((R, l, H, D), dtype=qkv_Rl3Hd.dtype, device=qkv_Rl3Hd.device, row_dims=2)  # proj may pad
    if R == 0 or l == 0:
        return out_RlHd
    block_q, block_k, warps, stages = launch_shape(R, H, l, L, D, qkv_Rl3Hd.element_size(),
                                                  shared_memory(qkv_Rl3Hd.device))
    upcast = interpreting() and qkv_Rl3Hd.dtype not in (torch.float32, torch.float64)
    precision = "ieee" if qkv_Rl3Hd.dtype == torch.float32 else None      # float32: no TF32
    pdl = dependent_launch(qkv_Rl3Hd.device, R * l, pdl)
    _qk_norm_attend_kernel[(triton.cdiv(l, block_q), H, R)](
        qkv_Rl3Hd, mult, k_RHLd, v_RHLd, out_RlHd, l, L - l, H,
        qkv_Rl3Hd.stride(0), qkv_Rl3Hd.stride(1), k_RHLd.stride(0), k_RHLd.stride(1), k_RHLd.stride(2),
        v_RHLd.stride(0), v_RHLd.stride(1), v_RHLd.stride(2), out_RlHd.stride(0), out_RlHd.stride(1),
        D=D, BLOCK_Q=block_q, BLOCK_K=block_k, UPCAST=upcast, PRECISION=precision, num_warps=warps,
        num_stages=stages, PDL=pdl, launch_pdl=pdl)
    return out_RlHd
