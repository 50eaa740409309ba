"""Triton: GroupNorm with its affine and an optional SiLU on channels-last activations, twin of
``ref.group_norm_silu``.

Why: in the VAE decoders every convolution is preceded by GroupNorm + SiLU. PyTorch's GroupNorm
wants channels-first memory (on channels-last input it makes a contiguous copy), so the
convolutions run channels-first too, where cuDNN's bf16 kernels transpose around each call; and
GroupNorm then SiLU are five passes over the activation. Here the activation stays channels-last
(B, H, W, C in memory) for the whole decoder and the norm takes three passes: per-block partial
statistics, their combination per (image, group), and one normalising pass that applies the
affine and SiLU and writes the result.

Statistics are float32 and combined with Chan's parallel formula (block means and centred sums of
squares), not as sums of squares, so a large mean does not cancel the variance. The Triton path
needs a power-of-two group count and channels per group (the decoders' widths 128–512 in 32
groups); the launcher falls back to the torch twin otherwise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gn_partial_kernel(x_ptr, mean_ptr, m2_ptr, cnt_ptr, HW, C, S,
                       G: tl.constexpr, CPG: tl.constexpr, BLOCK_P: tl.constexpr):
    s = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    c = tl.arange(0, G * CPG)
    n_acc = tl.zeros((G,), dtype=tl.float32)
    mean_acc = tl.zeros((G,), dtype=tl.float32)
    m2_acc = tl.zeros((G,), dtype=tl.float32)
    n_tiles = tl.cdiv(HW, BLOCK_P)
    for tile in range(s, n_tiles, S):                    # tiles s, s + S, … of image b
        p = tile * BLOCK_P + tl.arange(0, BLOCK_P)
        pm = p < HW
        x = tl.load(x_ptr + b * HW * C + p.to(tl.int64)[:, None] * C + c[None, :], mask=pm[:, None], other=0.0)
        x3 = tl.reshape(x.to(tl.float32), (BLOCK_P, G, CPG))
        n_t = tl.sum(pm.to(tl.float32), axis=0) * CPG
        mean_t = tl.sum(tl.sum(x3, axis=2), axis=0) / n_t                          # (G,)
        d3 = tl.where(tl.reshape(pm, (BLOCK_P, 1, 1)), x3 - mean_t[None, :, None], 0.0)
        m2_t = tl.sum(tl.sum(d3 * d3, axis=2), axis=0)
        # Chan: merge (n_acc, mean_acc, m2_acc) with this tile
        n_new = n_acc + n_t
        delta = mean_t - mean_acc
        mean_acc = mean_acc + delta * (n_t / n_new)
        m2_acc = m2_acc + m2_t + delta * delta * (n_acc * n_t / n_new)
        n_acc = n_new
    g = tl.arange(0, G)
    out = (b * S + s) * G + g
    tl.store(mean_ptr + out, mean_acc)
    tl.store(m2_ptr + out, m2_acc)
    tl.store(cnt_ptr + out, n_acc)


@triton.jit
def _gn_finalize_kernel(mean_ptr, m2_ptr, cnt_ptr, stat_ptr, S, eps, G: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    g = tl.arange(0, G)
    m = (s < S)[:, None]
    off = (b * S + s)[:, None] * G + g[None, :]
    n_i = tl.load(cnt_ptr + off, mask=m, other=0.0)
    mean_i = tl.load(mean_ptr + off, mask=m, other=0.0)
    m2_i = tl.load(m2_ptr + off, mask=m, other=0.0)
    n = tl.sum(n_i, axis=0)                                                         # (G,)
    mean = tl.sum(n_i * mean_i, axis=0) / n
    d = mean_i - mean[None, :]
    m2 = tl.sum(m2_i, axis=0) + tl.sum(n_i * d * d, axis=0)
    rstd = 1.0 / tl.sqrt(m2 / n + eps)
    tl.store(stat_ptr + (b * 2) * G + g, mean)
    tl.store(stat_ptr + (b * 2 + 1) * G + g, rstd)


@triton.jit
def _gn_apply_kernel(x_ptr, w_ptr, b_ptr, stat_ptr, out_ptr, HW, C,
                     G: tl.constexpr, CPG: tl.constexpr, BLOCK_P: tl.constexpr, SILU: tl.constexpr):
    pb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = p < HW
    c = tl.arange(0, G * CPG)
    offs = b * HW * C + p.to(tl.int64)[:, None] * C + c[None, :]
    x = tl.load(x_ptr + offs, mask=pm[:, None], other=0.0).to(tl.float32)
    g = tl.arange(0, G)
    mean = tl.load(stat_ptr + (b * 2) * G + g)
    rstd = tl.load(stat_ptr + (b * 2 + 1) * G + g)
    x3 = tl.reshape(x, (BLOCK_P, G, CPG))
    y = tl.reshape((x3 - mean[None, :, None]) * rstd[None, :, None], (BLOCK_P, G * CPG))
    y = y * tl.load(w_ptr + c).to(tl.float32)[None, :] + tl.load(b_ptr + c).to(tl.float32)[None, :]
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=pm[:, None])


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(x_BCHW: torch.Tensor, groups: int) -> bool:
    """Whether the kernels take this input: channels-last memory, power-of-two groups and channels
    per group, at most 1024 channels."""
    B, C, H, W = x_BCHW.shape
    return (x_BCHW.is_contiguous(memory_format=torch.channels_last) and C % groups == 0
            and _pow2(groups) and _pow2(C // groups) and C <= 1024 and groups <= 64)


def group_norm_silu(x_BCHW: torch.Tensor, weight_C: torch.Tensor, bias_C: torch.Tensor, groups: int, eps: float,
                    silu: bool = True) -> torch.Tensor:
    if not supported(x_BCHW, groups):
        from . import ref
        return ref.group_norm_silu(x_BCHW, weight_C, bias_C, groups, eps, silu)
    B, C, H, W = x_BCHW.shape
    HW, CPG = H * W, C // groups
    out = torch.empty_like(x_BCHW)                                                  # channels-last as x
    if not (B and HW):
        return out
    BLOCK_P = max(1, min(128, 8192 // C))
    n_tiles = triton.cdiv(HW, BLOCK_P)
    S = min(n_tiles, 256)                                   # partial-statistics programs per image
    dev = x_BCHW.device
    part = torch.empty(3, B, S, groups, device=dev, dtype=torch.float32)           # mean, M2, count
    stat = torch.empty(B, 2, groups, device=dev, dtype=torch.float32)              # mean, rstd
    _gn_partial_kernel[(S, B)](x_BCHW, part[0], part[1], part[2], HW, C, S, G=groups, CPG=CPG,
                               BLOCK_P=BLOCK_P, num_warps=4)
    _gn_finalize_kernel[(B,)](part[0], part[1], part[2], stat, S, eps, G=groups,
                              BLOCK_S=triton.next_power_of_2(S), num_warps=4)
    _gn_apply_kernel[(n_tiles, B)](x_BCHW, weight_C, bias_C, stat, out, HW, C, G=groups, CPG=CPG,
                                   BLOCK_P=BLOCK_P, SILU=silu, num_warps=4)
    return out
