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
squares), not as sums of squares, so a large mean does not cancel the variance. On channels-last
input a program holds a tile of pixels × a block of channels (the largest power of two up to 128
that divides C: 32 for the VQVAE's 160, 128 for the BSQ-VAE's 128–512), reads each pixel's block
as one contiguous run and keeps per-channel statistics; the combination merges a group's channels
into its statistics and writes a per-(image, channel) scale and shift, so that the normalising pass
is one multiply-add (and SiLU) per value, tiled like the first.

Channels-first input (the VQVAE decoders in float32, whose convolutions run NCHW) takes its own
three kernels, for any group count: a group of an image is one contiguous range of (C/G)·H·W values,
reduced by many programs at once (PyTorch's kernel gives each (image, group) one block, which leaves
most of the GPU idle on a 1024² map with 32 groups); the combination and the normalising pass as
above.

``x_bias_C`` (both layouts): the per-channel bias of the convolution that made x, which the norm
adds as it reads (its statistics are those of x + bias; the bias ends up in the shift). The decoders
run their convolutions before a norm without a bias, which saves a pass over the activation.
``channels_first_out``: channels-last input normalised into a contiguous channels-first result (the
decoders' last norm, whose convolution to 3 channels runs channels-first): PyTorch's copy between
the two layouts takes several times a pass over the activation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# the statistics pass's programs in all (each loops over its share of the tiles)
PARTIAL_PROGRAMS = 2048


@triton.jit
def _gn_partial_kernel(x_ptr, xb_ptr, mean_ptr, m2_ptr, cnt_ptr, HW, C, S,
                       HAS_XB: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """Per-channel statistics of pixel tiles s, s + S, … of image b, channels [cb·BLOCK_C, …):
    count, mean and centred sum of squares (Chan's merge across the tiles), of x (+ xb)."""
    s = tl.program_id(0)
    cb = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    if HAS_XB:
        xb = tl.load(xb_ptr + c, mask=cm, other=0.0).to(tl.float32)
    n_acc = 0.0
    mean_acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    m2_acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for tile in range(s, tl.cdiv(HW, BLOCK_P), S):
        p = tile * BLOCK_P + tl.arange(0, BLOCK_P)
        pm = p < HW
        m2d = pm[:, None] & cm[None, :]
        x = tl.load(x_ptr + b * HW * C + p.to(tl.int64)[:, None] * C + c[None, :], mask=m2d, other=0.0)
        x = x.to(tl.float32)
        if HAS_XB:
            x = tl.where(m2d, x + xb[None, :], 0.0)
        n_t = tl.sum(pm.to(tl.float32), axis=0)
        mean_t = tl.sum(x, axis=0) / n_t                                            # (BLOCK_C,)
        d = tl.where(m2d, x - mean_t[None, :], 0.0)
        m2_t = tl.sum(d * d, axis=0)
        n_new = n_acc + n_t                              # Chan: merge (n_acc, mean_acc, m2_acc) with this tile
        delta = mean_t - mean_acc
        mean_acc = mean_acc + delta * (n_t / n_new)
        m2_acc = m2_acc + m2_t + delta * delta * (n_acc * n_t / n_new)
        n_acc = n_new
    out = (b * S + s) * C + c
    tl.store(mean_ptr + out, mean_acc, mask=cm)
    tl.store(m2_ptr + out, m2_acc, mask=cm)
    tl.store(cnt_ptr + out, tl.zeros((BLOCK_C,), dtype=tl.float32) + n_acc, mask=cm)


@triton.jit
def _stat_rows(s0, b, S, C, c, cm, BLOCK_S: tl.constexpr):
    """Offsets and mask of partial-statistics rows s0 … s0 + BLOCK_S − 1 of image b, channels c."""
    s = s0 + tl.arange(0, BLOCK_S)
    return (b * S + s)[:, None] * C + c[None, :], (s < S)[:, None] & cm[None, :]


@triton.jit
def _gn_finalize_kernel(mean_ptr, m2_ptr, cnt_ptr, w_ptr, b_ptr, xb_ptr, scale_ptr, shift_ptr, S, C, G, CPG, eps,
                        HAS_XB: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """Group g of image b from its channels' per-tile statistics (two passes: the mean, then the
    centred sum of squares), written as each channel's scale and shift: y = x·scale + shift."""
    bg = tl.program_id(0).to(tl.int64)
    b = bg // G
    j = tl.arange(0, BLOCK_C)
    cm = j < CPG
    c = (bg % G) * CPG + j                               # the group's channels
    n = 0.0
    tot = 0.0
    for s0 in range(0, S, BLOCK_S):
        offs, m2d = _stat_rows(s0, b, S, C, c, cm, BLOCK_S)
        n_i = tl.load(cnt_ptr + offs, mask=m2d, other=0.0)
        n += tl.sum(tl.sum(n_i, axis=1), axis=0)
        tot += tl.sum(tl.sum(n_i * tl.load(mean_ptr + offs, mask=m2d, other=0.0), axis=1), axis=0)
    mean = tot / n
    m2 = 0.0
    for s0 in range(0, S, BLOCK_S):
        offs, m2d = _stat_rows(s0, b, S, C, c, cm, BLOCK_S)
        n_i = tl.load(cnt_ptr + offs, mask=m2d, other=0.0)
        d = tl.load(mean_ptr + offs, mask=m2d, other=0.0) - mean
        m2 += tl.sum(tl.sum(tl.load(m2_ptr + offs, mask=m2d, other=0.0) + n_i * d * d, axis=1), axis=0)
    rstd = 1.0 / tl.sqrt(m2 / n + eps)
    w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    bias = tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
    centre = -mean
    if HAS_XB:
        centre += tl.load(xb_ptr + c, mask=cm, other=0.0).to(tl.float32)
    tl.store(scale_ptr + b * C + c, rstd * w, mask=cm)
    tl.store(shift_ptr + b * C + c, bias + centre * rstd * w, mask=cm)


@triton.jit
def _gn_apply_kernel(x_ptr, scale_ptr, shift_ptr, out_ptr, HW, C,
                     BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, SILU: tl.constexpr, OUT_NCHW: tl.constexpr):
    pb = tl.program_id(0)
    cb = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    m2d = (p < HW)[:, None] & cm[None, :]
    offs = b * HW * C + p.to(tl.int64)[:, None] * C + c[None, :]
    x = tl.load(x_ptr + offs, mask=m2d, other=0.0).to(tl.float32)
    y = x * tl.load(scale_ptr + b * C + c, mask=cm, other=0.0)[None, :] \
        + tl.load(shift_ptr + b * C + c, mask=cm, other=0.0)[None, :]
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    if OUT_NCHW:                                         # channels-first output: each channel's pixels in a run
        offs = b * HW * C + c.to(tl.int64)[None, :] * HW + p[:, None]
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=m2d)


@triton.jit
def _gn_partial_nchw_kernel(x_ptr, xb_ptr, mean_ptr, m2_ptr, cnt_ptr, N, S, HW, G, CPG,
                            HAS_XB: tl.constexpr, BLOCK: tl.constexpr):
    bg = tl.program_id(0).to(tl.int64)                   # (image, group): values [bg·N, bg·N + N)
    s = tl.program_id(1)
    n_acc = 0.0
    mean_acc = 0.0
    m2_acc = 0.0
    for tile in range(s, tl.cdiv(N, BLOCK), S):          # tiles s, s + S, … of the group
        i = tile * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        x = tl.load(x_ptr + bg * N + i, mask=m, other=0.0).to(tl.float32)
        if HAS_XB:                                       # value i of the group is channel i // HW of it
            x = tl.where(m, x + tl.load(xb_ptr + (bg % G) * CPG + i // HW, mask=m, other=0.0).to(tl.float32), 0.0)
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
def _gn_finalize_nchw_kernel(mean_ptr, m2_ptr, cnt_ptr, w_ptr, b_ptr, xb_ptr, scale_ptr, shift_ptr, S, G, CPG, eps,
                             HAS_XB: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
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
    centre = -mean
    if HAS_XB:
        centre += tl.load(xb_ptr + c, mask=cm, other=0.0).to(tl.float32)
    out = bg * CPG + j                                   # = image · C + channel
    tl.store(scale_ptr + out, rstd * w, mask=cm)
    tl.store(shift_ptr + out, b + centre * rstd * w, mask=cm)


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
    return x_BCHW.is_contiguous(memory_format=torch.channels_last) and groups >= 1 and x_BCHW.shape[1] % groups == 0


def _channels_first_ok(x_BCHW: torch.Tensor, groups: int) -> bool:
    return x_BCHW.is_contiguous() and groups >= 1 and x_BCHW.shape[1] % groups == 0


def supported(x_BCHW: torch.Tensor, groups: int) -> bool:
    """Whether the kernels take this input: channels-last or contiguous channels-first memory, with
    groups that divide the channels."""
    return _channels_last_ok(x_BCHW, groups) or _channels_first_ok(x_BCHW, groups)


def _channel_block(C: int) -> int:
    """Channels a channels-last program holds: the largest power of two (≤ 128) that divides C, so
    that no lane is masked (160 → 32, 640 → 128); C's next power of two (masked) when that is < 16."""
    blk = min(128, C & -C)
    return blk if blk >= 16 else min(128, triton.next_power_of_2(C))


def _group_norm_silu_nchw(x_BCHW, weight_C, bias_C, groups: int, eps: float, silu: bool, x_bias_C) -> torch.Tensor:
    B, C, H, W = x_BCHW.shape
    HW, CPG = H * W, C // groups
    out = torch.empty_like(x_BCHW)
    if not (B and HW):
        return out
    N = CPG * HW                                            # values per (image, group)
    BLOCK = 4096
    S = max(1, min(triton.cdiv(N, BLOCK), -(-PARTIAL_PROGRAMS // (B * groups))))      # programs per group
    dev = x_BCHW.device
    part = torch.empty(3, B * groups, S, device=dev, dtype=torch.float32)          # mean, M2, count
    affine = torch.empty(2, B * C, device=dev, dtype=torch.float32)                # scale, shift
    xb = x_bias_C if x_bias_C is not None else weight_C                            # (not read without HAS_XB)
    _gn_partial_nchw_kernel[(B * groups, S)](x_BCHW, xb, part[0], part[1], part[2], N, S, HW, groups, CPG,
                                             HAS_XB=x_bias_C is not None, BLOCK=BLOCK, num_warps=8)
    _gn_finalize_nchw_kernel[(B * groups,)](part[0], part[1], part[2], weight_C, bias_C, xb, affine[0], affine[1], S,
                                            groups, CPG, eps, HAS_XB=x_bias_C is not None,
                                            BLOCK_S=triton.next_power_of_2(S),
                                            BLOCK_C=triton.next_power_of_2(CPG), num_warps=4)
    BLOCK_A = min(4096, triton.next_power_of_2(HW))
    _gn_apply_nchw_kernel[(B * C, triton.cdiv(HW, BLOCK_A))](x_BCHW, affine[0], affine[1], out, HW, BLOCK=BLOCK_A,
                                                             SILU=silu, num_warps=8 if BLOCK_A >= 2048 else 4)
    return out


def group_norm_silu(x_BCHW: torch.Tensor, weight_C: torch.Tensor, bias_C: torch.Tensor, groups: int, eps: float,
                    silu: bool = True, x_bias_C=None, channels_first_out: bool = False) -> torch.Tensor:
    if not _channels_last_ok(x_BCHW, groups):
        if _channels_first_ok(x_BCHW, groups):
            return _group_norm_silu_nchw(x_BCHW, weight_C, bias_C, groups, eps, silu, x_bias_C)
        from . import ref
        return ref.group_norm_silu(x_BCHW, weight_C, bias_C, groups, eps, silu, x_bias_C, channels_first_out)
    B, C, H, W = x_BCHW.shape
    HW, CPG = H * W, C // groups
    out = torch.empty(B, C, H, W, device=x_BCHW.device, dtype=x_BCHW.dtype) if channels_first_out \
        else torch.empty_like(x_BCHW)                                              # channels-last as x
    if not (B and HW):
        return out
    BLOCK_C = _channel_block(C)
    n_cb = triton.cdiv(C, BLOCK_C)
    BLOCK_P = max(16, 4096 // BLOCK_C)                      # a tile of ~4096 values
    n_tiles = triton.cdiv(HW, BLOCK_P)
    S = max(1, min(n_tiles, -(-PARTIAL_PROGRAMS // (B * n_cb))))   # partial-statistics programs per (image, block)
    dev = x_BCHW.device
    part = torch.empty(3, B, S, C, device=dev, dtype=torch.float32)                # per channel: mean, M2, count
    affine = torch.empty(2, B, C, device=dev, dtype=torch.float32)                 # scale, shift
    xb = x_bias_C if x_bias_C is not None else weight_C                            # (not read without HAS_XB)
    _gn_partial_kernel[(S, n_cb, B)](x_BCHW, xb, part[0], part[1], part[2], HW, C, S, HAS_XB=x_bias_C is not None,
                                     BLOCK_P=BLOCK_P, BLOCK_C=BLOCK_C, num_warps=4)
    _gn_finalize_kernel[(B * groups,)](part[0], part[1], part[2], weight_C, bias_C, xb, affine[0], affine[1], S, C,
                                       groups, CPG, eps, HAS_XB=x_bias_C is not None,
                                       BLOCK_S=max(1, min(64, triton.next_power_of_2(S), 4096 // triton.next_power_of_2(CPG))),
                                       BLOCK_C=triton.next_power_of_2(CPG), num_warps=4)
    _gn_apply_kernel[(n_tiles, n_cb, B)](x_BCHW, affine[0], affine[1], out, HW, C, BLOCK_P=BLOCK_P, BLOCK_C=BLOCK_C,
                                         SILU=silu, OUT_NCHW=channels_first_out, num_warps=4)
    return out
