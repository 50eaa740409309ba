"""Triton: the dense path's per-layer elementwise steps, fused. Twins of ``ref.residual_norm_modulate``,
``ref.token_residual_norm_modulate`` (HART's diffusion head), ``ref.qk_norm_store`` (VAR),
``ref.qk_norm_rope_store`` (Infinity) and ``ref.rope_half_store`` (HART), same signatures.

At small batches each elementwise kernel costs more in launch and ramp-up inside a CUDA graph than
in work, so these kernels exist to remove launches: the gated residual, the next LayerNorm and the
AdaLN modulation (or RMSNorm, whose weight the caller folds into the modulation) in one pass; q/k
cosine normalisation or RoPE, the temperature and both KV-cache writes in another. Rows are held whole in registers; bf16 only at load / store, float32 arithmetic, so the
kernels also run in Triton's CPU interpreter (research/kernels.md §4.2).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _gdc
from ._backend import dependent_launch
from .gather_modulate import _launch_shape, _load_row, _norm_modulate_rows
from .gemm_rows import empty_rows


@triton.jit
def _norm_rows(x, mult):
    """Rows of ``x`` (n, D) float32 L2-normalised (norm clamped at 1e-12) and times ``mult`` (a scalar
    or one value per row). Shared with ``cache_attention``."""
    return x * (mult / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), 1e-12))[:, None]


@triton.jit
def _add_gated_store(x, branch, g, m2, xo_ptrs):
    """``x + branch · g`` (float32; ``g`` one float32 row), stored through ``xo_ptrs``; returns it.
    Shared with ``linear_residual``."""
    x = x + branch * g[None, :]
    tl.store(xo_ptrs, x.to(xo_ptrs.dtype.element_ty), mask=m2)
    return x


@triton.jit
def _residual_norm_mod_kernel(x_ptr, b_ptr, g_ptr, mul_ptr, shift_ptr, xo_ptr, y_ptr, n, C, eps,
                              s_xr, s_xl, s_br, s_bl, s_gr, s_mr, s_sr, s_or, s_ol, s_yr, s_yl,
                              HAS_RES: tl.constexpr, RMS: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
                              PDL: tl.constexpr):
    _gdc.release_then_wait(PDL)
    r = tl.program_id(1).to(tl.int64)
    j = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    cm = c < C
    m2 = (j < n)[:, None] & cm[None, :]
    mul = _load_row(mul_ptr + r * s_mr, c, cm)
    shift = _load_row(shift_ptr + r * s_sr, c, cm)
    x = tl.load(x_ptr + r * s_xr + j[:, None] * s_xl + c[None, :], mask=m2, other=0.0).to(tl.float32)
    if HAS_RES:
        g = _load_row(g_ptr + r * s_gr, c, cm)
        b = tl.load(b_ptr + r * s_br + j[:, None] * s_bl + c[None, :], mask=m2, other=0.0).to(tl.float32)
        x = _add_gated_store(x, b, g, m2, xo_ptr + r * s_or + j[:, None] * s_ol + c[None, :])
    y = _norm_modulate_rows(x, m2, C, eps, mul, shift, RMS)
    tl.store(y_ptr + r * s_yr + j[:, None] * s_yl + c[None, :], y.to(y_ptr.dtype.element_ty), mask=m2)


def residual_norm_modulate(x_RlC: torch.Tensor, branch_RlC: Optional[torch.Tensor], gate_R1C: Optional[torch.Tensor],
                           mul_R1C: torch.Tensor, shift_R1C: torch.Tensor, eps: float,
                           out_dtype: torch.dtype, rms: bool = False,
                           pdl: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``ref.residual_norm_modulate``: (x + gate·branch, LN(that)·mul + shift; RMSNorm
    with ``rms``).
    ``pdl`` overrides where programmatic dependent launch is used (``_backend.dependent_launch``)."""
    R, n, C = x_RlC.shape
    if x_RlC.stride(-1) != 1:
        x_RlC = x_RlC.contiguous()
    has_res = branch_RlC is not None
    y = empty_rows((R, n, C), dtype=out_dtype, device=x_RlC.device)       # spare rows: the next product may pad
    xo = torch.empty_like(x_RlC, memory_format=torch.contiguous_format) if has_res else x_RlC
    mul_R1C, shift_R1C = mul_R1C.expand(R, 1, C), shift_R1C.expand(R, 1, C)
    if has_res:
        if branch_RlC.stride(-1) != 1:
            branch_RlC = branch_RlC.contiguous()
        gate_R1C = gate_R1C.expand(R, 1, C)
    if R == 0 or n == 0:
        return xo, y
    for t in (mul_R1C, shift_R1C) + ((gate_R1C,) if has_res else ()):
        assert t.stride(-1) == 1, "modulation rows must be contiguous in C"
    block_c, rows, warps = _launch_shape(C, R * n)
    b, g = (branch_RlC, gate_R1C) if has_res else (x_RlC, mul_R1C)
    pdl = dependent_launch(x_RlC.device, R * n, pdl)
    _residual_norm_mod_kernel[(triton.cdiv(n, rows), R)](
        x_RlC, b, g, mul_R1C, shift_R1C, xo, y, n, C, float(eps),
        x_RlC.stride(0), x_RlC.stride(1), b.stride(0), b.stride(1), g.stride(0), mul_R1C.stride(0),
        shift_R1C.stride(0), xo.stride(0), xo.stride(1), y.stride(0), y.stride(1),
        HAS_RES=has_res, RMS=rms, ROWS=rows, BLOCK_C=block_c, num_warps=warps, PDL=pdl, launch_pdl=pdl)
    return xo, y


@triton.jit
def _token_residual_norm_mod_kernel(x_ptr, b_ptr, g_ptr, sc_ptr, sh_ptr, w_ptr, lb_ptr, xo_ptr, y_ptr, N, C, eps,
                                    s_x, s_b, s_g, s_sc, s_sh, s_xo, s_y,
                                    HAS_RES: tl.constexpr, AFFINE: tl.constexpr, ROWS: tl.constexpr,
                                    BLOCK_C: tl.constexpr):
    j = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    cm = c < C
    m2 = (j < N)[:, None] & cm[None, :]
    rows, cols = j[:, None], c[None, :]
    if AFFINE:
        w = _load_row(w_ptr, c, cm)
        lb = _load_row(lb_ptr, c, cm)
    else:
        w = tl.full((BLOCK_C,), 1.0, tl.float32)
        lb = tl.zeros((BLOCK_C,), tl.float32)
    scale = tl.load(sc_ptr + rows * s_sc + cols, mask=m2, other=0.0).to(tl.float32)
    shift = tl.load(sh_ptr + rows * s_sh + cols, mask=m2, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + rows * s_x + cols, mask=m2, other=0.0).to(tl.float32)
    if HAS_RES:
        g = tl.load(g_ptr + rows * s_g + cols, mask=m2, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + rows * s_b + cols, mask=m2, other=0.0).to(tl.float32)
        x = x + b * g
        tl.store(xo_ptr + rows * s_xo + cols, x.to(xo_ptr.dtype.element_ty), mask=m2)
    y = _norm_modulate_rows(x, m2, C, eps, w, lb, False) * (1.0 + scale) + shift
    tl.store(y_ptr + rows * s_y + cols, y.to(y_ptr.dtype.element_ty), mask=m2)


def token_residual_norm_modulate(x_NC: torch.Tensor, branch_NC: Optional[torch.Tensor], gate_NC: Optional[torch.Tensor],
                                 scale_NC: torch.Tensor, shift_NC: torch.Tensor, weight_C: Optional[torch.Tensor],
                                 bias_C: Optional[torch.Tensor], eps: float,
                                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``ref.token_residual_norm_modulate``: the gated residual and the next
    LayerNorm (affine optional) · (1 + scale) + shift with a modulation per token, in one pass; the
    modulation may be column blocks of one product (any row stride)."""
    N, C = x_NC.shape
    has_res, affine = branch_NC is not None, weight_C is not None
    tensors = (x_NC, scale_NC, shift_NC) + ((branch_NC, gate_NC) if has_res else ())
    assert all(t.shape == (N, C) and t.stride(-1) == 1 for t in tensors), "(N, C) operands, contiguous in C"
    y = torch.empty((N, C), dtype=out_dtype, device=x_NC.device)
    xo = torch.empty_like(x_NC, memory_format=torch.contiguous_format) if has_res else x_NC
    if N == 0:
        return xo, y
    block_c, rows, warps = _launch_shape(C)
    b, g = (branch_NC, gate_NC) if has_res else (x_NC, x_NC)
    w, lb = (weight_C.contiguous(), bias_C.contiguous()) if affine else (x_NC, x_NC)
    _token_residual_norm_mod_kernel[(triton.cdiv(N, rows),)](
        x_NC, b, g, scale_NC, shift_NC, w, lb, xo, y, N, C, float(eps),
        x_NC.stride(0), b.stride(0), g.stride(0), scale_NC.stride(0), shift_NC.stride(0), xo.stride(0), y.stride(0),
        HAS_RES=has_res, AFFINE=affine, ROWS=rows, BLOCK_C=block_c, num_warps=warps)
    return xo, y


@triton.jit
def _qk_norm_store_kernel(qkv_ptr, mult_ptr, q_ptr, k_ptr, v_ptr, H, D,
                          s_ar, s_al, s_qr, s_ql, s_kr, s_kh, s_kl, s_vr, s_vh, s_vl,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hm = h < H
    m2 = hm[:, None] & (d < D)[None, :]
    hd = h[:, None] * D + d[None, :]                         # (H, d) inside one (3, H, d) token row
    src = qkv_ptr + r * s_ar + t * s_al
    q = tl.load(src + hd, mask=m2, other=0.0).to(tl.float32)
    k = tl.load(src + H * D + hd, mask=m2, other=0.0).to(tl.float32)
    v = tl.load(src + 2 * H * D + hd, mask=m2, other=0.0)
    mq = tl.load(mult_ptr + h, mask=hm, other=0.0)
    mk = tl.load(mult_ptr + H + h, mask=hm, other=0.0)
    q = _norm_rows(q, mq)
    k = _norm_rows(k, mk)
    tl.store(q_ptr + r * s_qr + t * s_ql + hd, q.to(q_ptr.dtype.element_ty), mask=m2)
    hs = h[:, None].to(tl.int64)
    tl.store(k_ptr + r * s_kr + hs * s_kh + t * s_kl + d[None, :], k.to(k_ptr.dtype.element_ty), mask=m2)
    tl.store(v_ptr + r * s_vr + hs * s_vh + t * s_vl + d[None, :], v.to(v_ptr.dtype.element_ty), mask=m2)


def qk_norm_store(qkv_Rl3Hd: torch.Tensor, mult_2H1: torch.Tensor, k_dst_RHld: torch.Tensor,
                  v_dst_RHld: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``ref.qk_norm_store``: cosine q (×temperature) as (R, H, l, d); normalised k
    and raw v written into their cache slots."""
    R, l, three, H, D = qkv_Rl3Hd.shape
    assert three == 3 and k_dst_RHld.shape == (R, H, l, D) and v_dst_RHld.shape == (R, H, l, D)
    if qkv_Rl3Hd.stride(-1) != 1 or qkv_Rl3Hd.stride(-2) != D or qkv_Rl3Hd.stride(2) != H * D:
        qkv_Rl3Hd = qkv_Rl3Hd.contiguous()
    assert k_dst_RHld.stride(-1) == 1 and v_dst_RHld.stride(-1) == 1, "cache slots need a contiguous head dim"
    mult = mult_2H1.reshape(2 * H).to(torch.float32).contiguous()
    q_RlHd = torch.empty(R, l, H, D, device=qkv_Rl3Hd.device, dtype=qkv_Rl3Hd.dtype)
    if R and l:
        _qk_norm_store_kernel[(l, R)](
            qkv_Rl3Hd, mult, q_RlHd, k_dst_RHld, v_dst_RHld, H, D,
            qkv_Rl3Hd.stride(0), qkv_Rl3Hd.stride(1), q_RlHd.stride(0), q_RlHd.stride(1),
            k_dst_RHld.stride(0), k_dst_RHld.stride(1), k_dst_RHld.stride(2),
            v_dst_RHld.stride(0), v_dst_RHld.stride(1), v_dst_RHld.stride(2),
            BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D),
            num_warps=4 if H * D <= 2048 else 8)
    return q_RlHd.transpose(1, 2)                            # (R, l, H, d) → (R, H, l, d) view


@triton.jit
def _load_qkv_pairs(src, hd, partner, m2, HD):
    """q, k (float32) with each channel's RoPE partner (``partner``: its offsets in a head row), and
    raw v, of one (3, H, d) token row at ``src``. Whole rows are loaded contiguously; each partner
    comes from the same cache lines (L1). Shared by Infinity's and HART's kernels."""
    q = tl.load(src + hd, mask=m2, other=0.0).to(tl.float32)
    qp = tl.load(src + partner, mask=m2, other=0.0).to(tl.float32)
    k = tl.load(src + HD + hd, mask=m2, other=0.0).to(tl.float32)
    kp = tl.load(src + HD + partner, mask=m2, other=0.0).to(tl.float32)
    v = tl.load(src + 2 * HD + hd, mask=m2, other=0.0)
    return q, qp, k, kp, v


@triton.jit
def _store_q_and_cache(q, k, v, q_ptr, k_ptr, v_ptr, r, t, h, d, hd, m2,
                       s_qr, s_ql, s_kr, s_kh, s_kl, s_vr, s_vh, s_vl):
    """q into its (R, l, H, d) output, k and v into their (R, H, ·, d) cache slots at token ``t``."""
    tl.store(q_ptr + r * s_qr + t * s_ql + hd, q.to(q_ptr.dtype.element_ty), mask=m2)
    hs = h[:, None].to(tl.int64)
    tl.store(k_ptr + r * s_kr + hs * s_kh + t * s_kl + d[None, :], k.to(k_ptr.dtype.element_ty), mask=m2)
    tl.store(v_ptr + r * s_vr + hs * s_vh + t * s_vl + d[None, :], v.to(v_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _qk_norm_rope_store_kernel(qkv_ptr, mult_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, H, D,
                               s_ar, s_al, s_cr, s_cl, s_qr, s_ql, s_kr, s_kh, s_kl, s_vr, s_vh, s_vl,
                               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hm = h < H
    m2 = hm[:, None] & (d < D)[None, :]
    hd = h[:, None] * D + d[None, :]                         # (H, d) inside one (3, H, d) token row
    partner = h[:, None] * D + (d ^ 1)[None, :]              # the other channel of each RoPE pair
    q, qp, k, kp, v = _load_qkv_pairs(qkv_ptr + r * s_ar + t * s_al, hd, partner, m2, H * D)
    mq = tl.load(mult_ptr + h, mask=hm, other=0.0)
    q_scale = mq / tl.maximum(tl.sqrt(tl.sum(q * q, axis=1)), 1e-12)
    k_scale = 1.0 / tl.maximum(tl.sqrt(tl.sum(k * k, axis=1)), 1e-12)
    # pair (a, b) = channels (2p, 2p+1): a' = a·cos − b·sin, b' = b·cos + a·sin
    cs = tl.load(cos_ptr + r * s_cr + t * s_cl + d // 2, mask=d < D, other=0.0)[None, :]
    sn = tl.load(sin_ptr + r * s_cr + t * s_cl + d // 2, mask=d < D, other=0.0)[None, :]
    sn = tl.where((d % 2 == 0)[None, :], -sn, sn)
    q = (q * cs + qp * sn) * q_scale[:, None]
    k = (k * cs + kp * sn) * k_scale[:, None]
    _store_q_and_cache(q, k, v, q_ptr, k_ptr, v_ptr, r, t, h, d, hd, m2, s_qr, s_ql, s_kr, s_kh, s_kl, s_vr, s_vh, s_vl)


def qk_norm_rope_store(qkv_Rl3Hd: torch.Tensor, q_mult_H1: torch.Tensor, cos_Rl1P: torch.Tensor,
                       sin_Rl1P: torch.Tensor, k_dst_RHld: torch.Tensor, v_dst_RHld: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``ref.qk_norm_rope_store``: cosine q (×temperature) with RoPE as (R, H, l, d);
    normalised, rotated k and raw v written into their cache slots. One program per token and row;
    every load and store is a contiguous row (even and odd channels loaded separately are far
    slower)."""
    R, l, _, H, D = qkv_Rl3Hd.shape
    P = D // 2
    cos = cos_Rl1P.to(torch.float32).expand(R, l, 1, P)
    sin = sin_Rl1P.to(torch.float32).expand(R, l, 1, P)
    mult = q_mult_H1.reshape(H).to(torch.float32).contiguous()
    return _launch_rope_store(_qk_norm_rope_store_kernel, qkv_Rl3Hd, mult, cos, sin, k_dst_RHld, v_dst_RHld)


def _launch_rope_store(kernel, qkv_Rl3Hd: torch.Tensor, q_arg, cos: torch.Tensor, sin: torch.Tensor,
                       k_dst_RHld: torch.Tensor, v_dst_RHld: torch.Tensor) -> torch.Tensor:
    """Launch a RoPE + KV-cache-write kernel (Infinity's or HART's, which share their signature but
    for ``q_arg``: q's multipliers or its scale) with one program per token and row; ``cos``/``sin``
    (R, l, …) float32 rows. Returns q (R, H, l, d), a view of (R, l, H, d)."""
    R, l, three, H, D = qkv_Rl3Hd.shape
    assert three == 3 and D % 2 == 0 and k_dst_RHld.shape == (R, H, l, D) and v_dst_RHld.shape == (R, H, l, D)
    if qkv_Rl3Hd.stride(-1) != 1 or qkv_Rl3Hd.stride(-2) != D or qkv_Rl3Hd.stride(2) != H * D:
        qkv_Rl3Hd = qkv_Rl3Hd.contiguous()
    assert k_dst_RHld.stride(-1) == 1 and v_dst_RHld.stride(-1) == 1, "cache slots need a contiguous head dim"
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    q_RlHd = torch.empty(R, l, H, D, device=qkv_Rl3Hd.device, dtype=qkv_Rl3Hd.dtype)
    if R and l:
        kernel[(l, R)](
            qkv_Rl3Hd, q_arg, cos, sin, q_RlHd, k_dst_RHld, v_dst_RHld, H, D,
            qkv_Rl3Hd.stride(0), qkv_Rl3Hd.stride(1), cos.stride(0), cos.stride(1),
            q_RlHd.stride(0), q_RlHd.stride(1),
            k_dst_RHld.stride(0), k_dst_RHld.stride(1), k_dst_RHld.stride(2),
            v_dst_RHld.stride(0), v_dst_RHld.stride(1), v_dst_RHld.stride(2),
            BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D),
            num_warps=4 if H * D <= 2048 else 8)
    return q_RlHd.transpose(1, 2)                            # (R, l, H, d) → (R, H, l, d) view


@triton.jit
def _rope_half_store_kernel(qkv_ptr, q_scale, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, H, D,
                            s_ar, s_al, s_cr, s_cl, s_qr, s_ql, s_kr, s_kh, s_kl, s_vr, s_vh, s_vl,
                            BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    m2 = (h < H)[:, None] & dm[None, :]
    hd = h[:, None] * D + d[None, :]                         # (H, d) inside one (3, H, d) token row
    half = D // 2
    partner = h[:, None] * D + ((d + half) % D)[None, :]     # rotate-half: channel j pairs with j ± d/2
    q, qp, k, kp, v = _load_qkv_pairs(qkv_ptr + r * s_ar + t * s_al, hd, partner, m2, H * D)
    cs = tl.load(cos_ptr + r * s_cr + t * s_cl + d, mask=dm, other=0.0)[None, :]
    sn = tl.load(sin_ptr + r * s_cr + t * s_cl + d, mask=dm, other=0.0)[None, :]
    sn = tl.where((d < half)[None, :], -sn, sn)              # [−x₂, x₁]·sin
    q = (q * cs + qp * sn) * q_scale
    k = k * cs + kp * sn
    _store_q_and_cache(q, k, v, q_ptr, k_ptr, v_ptr, r, t, h, d, hd, m2, s_qr, s_ql, s_kr, s_kh, s_kl, s_vr, s_vh, s_vl)


def rope_half_store(qkv_Rl3Hd: torch.Tensor, cos_Rld: torch.Tensor, sin_Rld: torch.Tensor, q_scale: float,
                    k_dst_RHld: torch.Tensor, v_dst_RHld: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``ref.rope_half_store``: rotate-half RoPE of q (× ``q_scale``) as (R, H, l, d)
    and of k, written with raw v into their cache slots. One program per token and row; every load
    and store is a contiguous row, the pair partners come from the same cache lines."""
    R, l, _, _, D = qkv_Rl3Hd.shape
    cos, sin = cos_Rld.to(torch.float32).expand(R, l, D), sin_Rld.to(torch.float32).expand(R, l, D)
    return _launch_rope_store(_rope_half_store_kernel, qkv_Rl3Hd, float(q_scale), cos, sin, k_dst_RHld, v_dst_RHld)
