"""Triton: VAR's input map of a scale in one launch, twin of ``ref.stage_embed``.

Why: in torch the next scale's input is seven launches — the area pooling of the latent, a cast to
the weights' dtype, the word embedding (cuBLAS, with a split-K reduction at some sizes), its cast to
float32, the level + position add and the copy for the second CFG half — each a few microseconds of
work and ramp at batch 1. Here one program owns (a block of tokens, a block of channels, one image):
it pools its tokens' K latent channels, multiplies them by the matching (K, channels) slice of the
embedding, adds the bias and the position rows and writes every copy.

Same pooling bits as torch's CUDA kernel: each window is summed in float32 row by row, left to
right, then divided by its height and then by its width (correctly rounded divisions). The embedding
sums its K = 32 products in float32 and rounds to the weight's dtype once, after the bias. Torch's
path (cuBLAS, split over K at some sizes) gives a value one step of that dtype away in part of the
elements; both stay within the tests' tolerance of a float64 oracle, so the kernel is no less exact,
but its maps are not torch's bit for bit.

Two workarounds for Triton's CPU interpreter: ``tl.dot`` on bf16 is wrong there (triton#11584), so
the operands are cast to float32 first (exact products, ``UPCAST``); and its float32 → bf16 cast
truncates where the GPU rounds to nearest even, so the two roundings are done on the bits first
(``RNE``).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._backend import interpreting


@triton.jit
def _round_to_bf16(x):
    """float32 rounded to the nearest bf16 (ties to even), still as float32 (finite inputs)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _stage_embed_kernel(f_ptr, w_ptr, b_ptr, pos_ptr, out_ptr, B, Hi, Wi, h, w, l, C, copies, win_h, win_w,
                        s_fb, s_fc, s_fh, s_pl, s_ob, s_ol,
                        K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
                        WIN_H: tl.constexpr, WIN_W: tl.constexpr,
                        UPCAST: tl.constexpr, PRECISION: tl.constexpr, RNE: tl.constexpr):
    tb = tl.program_id(0)
    cb = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)                      # this program's tokens of the scale
    t_ok = t < l
    oh = t // w
    ow = t % w
    h0 = (oh * Hi) // h                                           # window rows [h0, h1), columns [w0, w1)
    h1 = ((oh + 1) * Hi + h - 1) // h
    w0 = (ow * Wi) // w
    w1 = ((ow + 1) * Wi + w - 1) // w
    k = tl.arange(0, K)
    src = f_ptr + b * s_fb + k[None, :] * s_fc                    # (BLOCK_T, K): channel k of image b
    acc = tl.zeros([BLOCK_T, K], tl.float32)
    if WIN_H > 0:                 # small windows unrolled: every load issued before the sums wait on them
        for i in tl.static_range(WIN_H):                          # torch's order: row by row, left to right
            for j in tl.static_range(WIN_W):
                ok = t_ok & (h0 + i < h1) & (w0 + j < w1)
                acc += tl.load(src + ((h0 + i) * s_fh + w0 + j)[:, None], mask=ok[:, None], other=0.0)
    else:
        for i in range(0, win_h):
            ih = h0 + i
            for j in range(0, win_w):
                iw = w0 + j
                ok = t_ok & (ih < h1) & (iw < w1)
                acc += tl.load(src + (ih * s_fh + iw)[:, None], mask=ok[:, None], other=0.0)
    kh = tl.where(t_ok, h1 - h0, 1).to(tl.float32)[:, None]
    kw = tl.where(t_ok, w1 - w0, 1).to(tl.float32)[:, None]
    pooled = tl.math.div_rn(tl.math.div_rn(acc, kh), kw)          # sum / kH / kW, as torch rounds it
    dt = w_ptr.dtype.element_ty
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    wt = tl.load(w_ptr + c[None, :] * K + k[:, None], mask=c_ok[None, :], other=0.0)       # (K, BLOCK_C)
    if RNE:
        pooled = _round_to_bf16(pooled)
    a = pooled.to(dt)
    if UPCAST:
        e = tl.dot(a.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
    else:
        e = tl.dot(a, wt, input_precision=PRECISION)
    if HAS_BIAS:
        e += tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    ok = t_ok[:, None] & c_ok[None, :]
    if RNE:
        e = _round_to_bf16(e)
    x = e.to(dt).to(tl.float32) + tl.load(pos_ptr + t[:, None] * s_pl + c[None, :], mask=ok, other=0.0)
    dst = out_ptr + b * s_ob + t[:, None].to(tl.int64) * s_ol + c[None, :]
    for r in range(0, copies):                                    # the same map for every CFG half
        tl.store(dst + r * B * s_ob, x, mask=ok)


def _max_window(n_in: int, n_out: int) -> int:
    return max(((o + 1) * n_in + n_out - 1) // n_out - (o * n_in) // n_out for o in range(n_out))


def stage_embed(f_hat_BChw: torch.Tensor, h: int, w: int, weight_CK: torch.Tensor, bias_C: Optional[torch.Tensor],
                pos_lC: torch.Tensor, copies: int) -> torch.Tensor:
    """Triton twin of ``ref.stage_embed``: (copies·B, h·w, C) float32."""
    B, K, Hi, Wi = f_hat_BChw.shape
    C = weight_CK.shape[0]
    l = h * w
    assert weight_CK.shape == (C, K) and pos_lC.shape == (l, C), (weight_CK.shape, pos_lC.shape, l)
    assert K == triton.next_power_of_2(K) and K >= 16, f"{K} latent channels: the kernel needs a power of two ≥ 16"
    assert f_hat_BChw.dtype == pos_lC.dtype == torch.float32, "the latent and the position rows are float32"
    out = torch.empty(copies * B, l, C, device=f_hat_BChw.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    f = f_hat_BChw if f_hat_BChw.stride(3) == 1 else f_hat_BChw.contiguous()
    wgt = weight_CK.contiguous()
    pos = pos_lC if pos_lC.stride(1) == 1 else pos_lC.contiguous()
    if h == w == 1:
        # torch pools a 1 × 1 map as a mean (another summation order); one token: nothing to gain
        from .ref import stage_embed as reference
        return reference(f_hat_BChw, h, w, weight_CK, bias_C, pos_lC, copies)
    # 16-token blocks (the smallest tl.dot); 128 channels: a VAR-d30 map at batch 1 (C 1920) on
    # 15 programs per 16 tokens, so its last scale runs on 240
    block_t, block_c = 16, 128
    upcast = interpreting() and wgt.dtype != torch.float32
    precision = "ieee" if wgt.dtype == torch.float32 else None          # float32 weights: no TF32
    grid = (triton.cdiv(l, block_t), triton.cdiv(C, block_c), B)
    win_h, win_w = _max_window(Hi, h), _max_window(Wi, w)
    # windows of up to 64 pixels (VAR's 256-px schedule from its 2 × 2 scale on) unroll: one compile
    # per window size; larger ones (a 512-px model's first scales) loop
    unroll = win_h * win_w <= 64
    _stage_embed_kernel[grid](f, wgt, bias_C if bias_C is not None else wgt, pos, out, B, Hi, Wi, h, w, l, C, copies,
                              win_h, win_w, f.stride(0), f.stride(1), f.stride(2),
                              pos.stride(0), out.stride(0), out.stride(1), K=K, BLOCK_T=block_t,
                              BLOCK_C=block_c, HAS_BIAS=bias_C is not None, WIN_H=win_h if unroll else 0,
                              WIN_W=win_w if unroll else 0, UPCAST=upcast, PRECISION=precision,
                              RNE=interpreting() and wgt.dtype == torch.bfloat16, num_warps=4)
    return out
