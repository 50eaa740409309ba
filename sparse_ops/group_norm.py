"""Triton: GroupNorm with its affine and an optional SiLU, on channels-last or channels-first
(contiguous NCHW) activations, twin of ``ref.group_norm_silu``.

Why: in the VAE decoders every convolution is preceded by GroupNorm + SiLU. PyTorch's GroupNorm
wants channels-first memory (on channels-last input it makes a contiguous copy), so the
convolutions run channels-first too, where cuDNN's bf16 kernels transpose around each call; and
GroupNorm then SiLU are five passes over the activation. Here the activation stays channels-last
(B, H, W, C in memory) for the whole decoder and the norm takes three passes: per-block partial
statistics, their combination per (image, group), and one normalising pass that applies the
affine and SiLU and writes the result.

Statistics are float32 and combined with Chan's parallel formula (block means and centred sums of
squares), not as sums of squares, so a large mean does not cancel the variance. A program holds a
tile of pixels × groups × channels per group, the last two padded to powers of two and masked
(the BSQ-VAE's widths 128–512 in 32 groups need no padding; the VQVAE's 160–640 do); the launcher
falls back to the torch twin past 2048 padded channels or 64 groups.

Channels-first input (the VQVAE decoders of VAR, FlexVAR and HART, whose convolutions run NCHW)
takes its own three kernels, for any group count: a group of an image is one contiguous range of
(C/G)·H·W values, reduced by many programs at once (PyTorch's kernel gives each (image, group) one
block, which leaves most of the GPU idle on a 1024² map with 32 groups); the combination writes a
per-(image, channel) scale and shift, and the normalising pass is one multiply-add (and SiLU) per
value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _group_tile(x_ptr, b, p, HW, C, G: tl.constexpr, CPG: tl.constexpr, GP: tl.constexpr, CPGP: tl.constexpr):
    """Pixels ``p`` of image ``b`` as a (BLOCK_P, GP, CPGP) float32 tile: group g's channel j at
    [:, g, j], the padding (g ≥ G or j ≥ CPG, for counts that are not powers of two) and pixels past
    HW zero; with the tile's offsets and mask."""
    g = tl.arange(0, GP)
    j = tl.arange(0, CPGP)
    pm = p < HW
    m3 = pm[:, None, None] & (g < G)[None, :, None] & (j < CPG)[None, None, :]
    offs = b * HW * C + p.to(tl.int64)[:, None, None] * C + (g[:, None] * CPG + j[None, :])[None, :, :]
    return tl.load(x_ptr + offs, mask=m3, other=0.0).to(tl.float32), offs, m3


@triton.jit
def _gn_partial_kernel(x_ptr, mean_ptr, m2_ptr, cnt_ptr, HW, C, S, G: tl.constexpr, CPG: tl.constexpr,
                       GP: tl.constexpr, CPGP: tl.constexpr, BLOCK_P: tl.constexpr):
    s = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_acc = tl.zeros((GP,), dtype=tl.float32)
    mean_acc = tl.zeros((GP,), dtype=tl.float32)
    m2_acc = tl.zeros((GP,), dtype=tl.float32)
    n_tiles = tl.cdiv(HW, BLOCK_P)
    for tile in range(s, n_tiles, S):                    # tiles s, s + S, … of image b
        p = tile * BLOCK_P + tl.arange(0, BLOCK_P)
        x3, _, m3 = _group_tile(x_ptr, b, p, HW, C, G, CPG, GP, CPGP)
        n_t = tl.sum((p < HW).to(tl.float32), axis=0) * CPG
        mean_t = tl.sum(tl.sum(x3, axis=2), axis=0) / n_t                          # (GP,)
        d3 = tl.where(m3, x3 - mean_t[None, :, None], 0.0)
        m2_t = tl.sum(tl.sum(d3 * d3, axis=2), axis=0)
        # Chan: merge (n_acc, mean_acc, m2_acc) with this tile
        n_new = n_acc + n_t
        delta = mean_t - mean_acc
        mean_acc = mean_acc + delta * (n_t / n_new)
        m2_acc = m2_acc + m2_t + delta * delta * (n_acc * n_t / n_new)
        n_acc = n_new
    g = tl.arange(0, GP)
    out = (b * S + s) * GP + g
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
def _gn_apply_kernel(x_ptr, w_ptr, b_ptr, stat_ptr, out_ptr, HW, C, G: tl.constexpr, CPG: tl.constexpr,
                     GP: tl.constexpr, CPGP: tl.constexpr, BLOCK_P: tl.constexpr, SILU: tl.constexpr):
    pb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    x3, offs, m3 = _group_tile(x_ptr, b, p, HW, C, G, CPG, GP, CPGP)
    g = tl.arange(0, GP)
    mean = tl.load(stat_ptr + (b * 2) * GP + g)
    rstd = tl.load(stat_ptr + (b * 2 + 1) * GP + g)
    c2 = g[:, None] * CPG + tl.arange(0, CPGP)[None, :]                          # (GP, CPGP) channel index
    cm2 = (g < G)[:, None] & (tl.arange(0, CPGP) < CPG)[None, :]
    w2 = tl.load(w_ptr + c2, mask=cm2, other=0.0).to(tl.float32)
    b2 = tl.load(b_ptr + c2, mask=cm2, other=0.0).to(tl.float32)
    y = (x3 - mean[None, :, None]) * rstd[None, :, None] * w2[None, :, :] + b2[None, :, :]
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=m3)


@triton.jit
def _gn_partial_nchw_kernel(x_ptr, mean_ptr, m2_ptr, cnt_ptr, N, S, BLOCK: tl.constexpr):
    bg = tl.program_id(0).to(tl.int64)                   # (image, group): values [bg·N, bg·N + N)
    s = tl.program_id(1)
    n_acc = 0.0
    mean_acc = 0.0
    m2_acc = 0.0
    for tile in range(s, tl.cdiv(N, BLOCK), S):          # tiles s, s + S, … of the group
        i = tile * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        x = tl.load(x_ptr + bg * N + i, mask=m, other=0.0).to(tl.float32)
        n_t = tl.sum(m.to(tl.float32), axis=0)
        mean_t = tl.sum(x, axis=0) / n_t
        d = tl.where(m, x - mean_t, 0.0)
        m2_t = tl.sum(d * d, axis=0)
        n_new = n_acc + n_t                              # Chan's merge, as the channels-last kernel
        delta = mean_t - mean_acc
        mean_acc = mean_acc + delta * (n_t / n_new)
        m2_acc = m2_acc + m2_t + delta * delta * (n_acc * n_t / n_new)
        n_acc = n_new
    tl.store(mean_ptr + bg * S + s, mean_acc)
    tl.store(m2_ptr + bg * S + s, m2_acc)
    tl.store(cnt_ptr + bg * S + s, n_acc)


@triton.jit
def _gn_finalize_nchw_kernel(mean_ptr, m2_ptr, cnt_ptr, w_ptr, b_ptr, scale_ptr, shift_ptr, S, G, CPG, eps,
                             BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    bg = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    m = s < S
    n_i = tl.load(cnt_ptr + bg * S + s, mask=m, other=0.0)
    mean_i = tl.load(mean_ptr + bg * S + s, mask=m, other=0.0)
    m2_i = tl.load(m2_ptr + bg * S + s, mask=m, other=0.0)
    n = tl.sum(n_i, axis=0)
    mean = tl.sum(n_i * mean_i, axis=0) / n
    d = mean_i - mean
    m2 = tl.sum(m2_i, axis=0) + tl.sum(n_i * d * d, axis=0)
    rstd = 1.0 / tl.sqrt(m2 / n + eps)
    j = tl.arange(0, BLOCK_C)
    cm = j < CPG
    c = (bg % G) * CPG + j                               # the group's channels
    w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
    out = bg * CPG + j                                   # = image · C + channel
    tl.store(scale_ptr + out, rstd * w, mask=cm)
    tl.store(shift_ptr + out, b - mean * rstd * w, mask=cm)


@triton.jit
def _gn_apply_nchw_kernel(x_ptr, scale_ptr, shift_ptr, out_ptr, HW, BLOCK: tl.constexpr, SILU: tl.constexpr):
    bc = tl.program_id(0).to(tl.int64)                   # (image, channel): values [bc·HW, bc·HW + HW)
    pb = tl.program_id(1)
    i = pb * BLOCK + tl.arange(0, BLOCK)
    m = i < HW
    x = tl.load(x_ptr + bc * HW + i, mask=m, other=0.0).to(tl.float32)
    y = x * tl.load(scale_ptr + bc) + tl.load(shift_ptr + bc)
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    tl.store(out_ptr + bc * HW + i, y.to(out_ptr.dtype.element_ty), mask=m)


def _channels_last_ok(x_BCHW: torch.Tensor, groups: int) -> bool:
    B, C, H, W = x_BCHW.shape
    return (x_BCHW.is_contiguous(memory_format=torch.channels_last) and groups >= 1 and C % groups == 0
            and _padded(groups, C // groups) <= 2048 and groups <= 64)


def _padded(groups: int, cpg: int) -> int:
    """Channels a channels-last program holds: groups and channels per group each padded to a power
    of two."""
    return triton.next_power_of_2(groups) * triton.next_power_of_2(cpg)


def _channels_first_ok(x_BCHW: torch.Tensor, groups: int) -> bool:
    return x_BCHW.is_contiguous() and groups >= 1 and x_BCHW.shape[1] % groups == 0


def supported(x_BCHW: torch.Tensor, groups: int) -> bool:
    """Whether the kernels take this input: channels-last memory with at most 64 groups and at most
    2048 channels once groups and channels per group are padded to powers of two, or contiguous
    channels-first memory; groups that divide the channels."""
    return _channels_last_ok(x_BCHW, groups) or _channels_first_ok(x_BCHW, groups)


def _group_norm_silu_nchw(x_BCHW, weight_C, bias_C, groups: int, eps: float, silu: bool) -> torch.Tensor:
    B, C, H, W = x_BCHW.shape
    HW, CPG = H * W, C // groups
    out = torch.empty_like(x_BCHW)
    if not (B and HW):
        return out
    N = CPG * HW                                            # values per (image, group)
    BLOCK = 4096
    S = max(1, min(triton.cdiv(N, BLOCK), -(-2048 // (B * groups))))           # programs per group: ~2048 in all
    dev = x_BCHW.device
    part = torch.empty(3, B * groups, S, device=dev, dtype=torch.float32)          # mean, M2, count
    affine = torch.empty(2, B * C, device=dev, dtype=torch.float32)                # scale, shift
    _gn_partial_nchw_kernel[(B * groups, S)](x_BCHW, part[0], part[1], part[2], N, S, BLOCK=BLOCK, num_warps=8)
    _gn_finalize_nchw_kernel[(B * groups,)](part[0], part[1], part[2], weight_C, bias_C, affine[0], affine[1], S,
                                            groups, CPG, eps, BLOCK_S=triton.next_power_of_2(S),
                                            BLOCK_C=triton.next_power_of_2(CPG), num_warps=4)
    BLOCK_A = min(4096, triton.next_power_of_2(HW))
    _gn_apply_nchw_kernel[(B * C, triton.cdiv(HW, BLOCK_A))](x_BCHW, affine[0], affine[1], out, HW, BLOCK=BLOCK_A,
                                                             SILU=silu, num_warps=8 if BLOCK_A >= 2048 else 4)
    return out


def group_norm_silu(x_BCHW: torch.Tensor, weight_C: torch.Tensor, bias_C: torch.Tensor, groups: int, eps: float,
                    silu: bool = True) -> torch.Tensor:
    if not _channels_last_ok(x_BCHW, groups):
        if _channels_first_ok(x_BCHW, groups):
            return _group_norm_silu_nchw(x_BCHW, weight_C, bias_C, groups, eps, silu)
        from . import ref
        return ref.group_norm_silu(x_BCHW, weight_C, bias_C, groups, eps, silu)
    B, C, H, W = x_BCHW.shape
    HW, CPG = H * W, C // groups
    GP, CPGP = triton.next_power_of_2(groups), triton.next_power_of_2(CPG)      # padded (masked) in the tiles
    out = torch.empty_like(x_BCHW)                                                  # channels-last as x
    if not (B and HW):
        return out
    BLOCK_P = max(1, min(128, 8192 // (GP * CPGP)))
    n_tiles = triton.cdiv(HW, BLOCK_P)
    S = min(n_tiles, 256)                                   # partial-statistics programs per image
    dev = x_BCHW.device
    part = torch.empty(3, B, S, GP, device=dev, dtype=torch.float32)               # mean, M2, count
    stat = torch.empty(B, 2, GP, device=dev, dtype=torch.float32)                  # mean, rstd
    _gn_partial_kernel[(S, B)](x_BCHW, part[0], part[1], part[2], HW, C, S, G=groups, CPG=CPG, GP=GP, CPGP=CPGP,
                               BLOCK_P=BLOCK_P, num_warps=4)
    _gn_finalize_kernel[(B,)](part[0], part[1], part[2], stat, S, eps, G=GP,
                              BLOCK_S=triton.next_power_of_2(S), num_warps=4)
    _gn_apply_kernel[(n_tiles, B)](x_BCHW, weight_C, bias_C, stat, out, HW, C, G=groups, CPG=CPG, GP=GP, CPGP=CPGP,
                                   BLOCK_P=BLOCK_P, SILU=silu, num_warps=4)
    return out
