"""Infinity's bitwise tokenizer: a Flux-style conv autoencoder with multi-scale binary spherical
quantisation (BSQ), reproduced so the official ``infinity_vae_d32reg.pth`` / ``infinity_vae_d32_reg.pth``
(and the 8B model's ``infinity_vae_d56_f8_14_patchify``) load key for key (research/infinity.md §2).

- Encoder / decoder: GroupNorm(32 groups, eps 1e-6; 24 groups when channels % 32 != 0) + swish,
  ResNet blocks (1×1 ``nin_shortcut`` when the width changes), no attention, downsampling by a
  stride-2 3×3 conv after zero-padding right and bottom, upsampling by nearest ×2 + 3×3 conv.
  Every conv is stored as ``<name>.conv.*`` and every GroupNorm as ``<name>.norm.*`` (the official
  wrappers), so the module names are the checkpoint keys.
- Quantiser: per scale, the residual is area-downsampled, l2-normalised over the d channels,
  and each channel becomes a bit (value > 0); its code is ±1/√d. Codes are trilinearly upsampled
  (bilinear in 2-D) and subtracted from the residual; their sum is the decoder input.
- No quant / post-quant conv, no scale or shift factor.

The transformer side (bits → codes → next-scale input) lives in :func:`codes_from_bits` and
:func:`next_scale_input` so the Infinity adapter and the tests share one definition.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from ._blocks import norm_silu, resnet_block, rgb_output


def code_value(d: int) -> float:
    """The magnitude of every code entry: 1/√d as the reference computes it (float32 ±1/√d, then
    l2-normalised over the d channels — a no-op in exact arithmetic, kept for the last bit)."""
    s = torch.full((d,), 1.0 / math.sqrt(d), dtype=torch.float32)
    return float(F.normalize(s, dim=0)[0])


def codes_from_bits(bits: torch.Tensor, d: int) -> torch.Tensor:
    """Bits (any shape, last axis or not; values 0/1) → float32 codes ±1/√d of the same shape."""
    c = code_value(d)
    return torch.where(bits.bool(), c, -c).float()


def upsample_codes(codes_BdHW: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The reference's ``trilinear`` resize of (B, d, 1, h, w) codes (align_corners False; with a
    depth of 1 this is bilinear without antialias). Takes and returns 4-D (B, d, h, w)."""
    x_Bd1hw = codes_BdHW.unsqueeze(2)                                              # (B, d, h, w) → (B, d, 1, h, w)
    return F.interpolate(x_Bd1hw, size=(1, *size), mode="trilinear", align_corners=False).squeeze(2)


def next_scale_input(summed_BdHW: torch.Tensor, hw: tuple[int, int], patchify: bool = False) -> torch.Tensor:
    """The transformer input of the scale of token size ``hw`` from the codes summed so far at the
    VAE latent size: trilinear resize (to 2h × 2w and a 2×2 pixel-unshuffle when the model uses
    spatial patchify), flattened row-major. Returns (B, h·w, D) float32."""
    h, w = hw
    size = (2 * h, 2 * w) if patchify else (h, w)
    x_BdHW = upsample_codes(summed_BdHW, size)
    if patchify:
        x_BdHW = F.pixel_unshuffle(x_BdHW, 2)                                      # (B, d, 2h, 2w) → (B, 4d, h, w)
    B, D = x_BdHW.shape[:2]
    return x_BdHW.reshape(B, D, h * w).transpose(1, 2)                              # (B, D, h, w) → (B, hw, D)


# ---- building blocks (module names = official key names) ------------------------------------------
class _Conv(nn.Module):
    """``<name>.conv`` — the official ``Conv`` wrapper around a 2-D convolution."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, padding: int = 0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class _Norm(nn.Module):
    """``<name>.norm`` — GroupNorm with 32 groups (24 when the width is not a multiple of 32)."""

    def __init__(self, channels: int):
        super().__init__()
        if channels % 32 == 0:
            groups = 32
        elif channels % 24 == 0:
            groups = 24
        else:
            raise ValueError(f"BSQ-VAE width {channels} is a multiple of neither 32 nor 24; use base_ch and "
                             f"ch_mult giving widths divisible by 32 (official: base_ch 128)")
        self.norm = nn.GroupNorm(groups, channels, eps=1e-6, affine=True)

    def forward(self, x: torch.Tensor, silu: bool = False) -> torch.Tensor:
        """GroupNorm, then SiLU when ``silu`` (``norm_silu``: the fused kernel on the GPU, which keeps
        the channels-last memory of the fast decode, see ``BSQVAE.decode``)."""
        return norm_silu(self.norm, x, silu)


class _ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1, self.conv1 = _Norm(cin), _Conv(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = _Norm(cout), _Conv(cout, cout, 3, padding=1)
        if cin != cout:
            self.nin_shortcut = _Conv(cin, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return resnet_block(x, self.norm1.norm, self.conv1.conv, self.norm2.norm, self.conv2.conv,
                            self.nin_shortcut.conv if hasattr(self, "nin_shortcut") else None)


class _Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = _Conv(channels, channels, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))                                    # zero-pad right and bottom


class _Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = _Conv(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _Level(nn.Module):
    """One resolution level: ``block`` (ResNet blocks) and optionally ``downsample``/``upsample``."""

    def __init__(self, blocks: Sequence[nn.Module]):
        super().__init__()
        self.block = nn.ModuleList(blocks)


class _Mid(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.block_1 = _ResnetBlock(channels, channels)
        self.block_2 = _ResnetBlock(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.block_1(x))


class _Encoder(nn.Module):
    def __init__(self, ch: int, ch_mult: Sequence[int], num_res_blocks: int, z_channels: int, patch_size: int):
        super().__init__()
        n_down = int(math.log2(patch_size))
        self.conv_in = _Conv(3, ch, 3, padding=1)
        in_mult = (1,) + tuple(ch_mult)
        self.down = nn.ModuleList()
        block_in = ch
        for i, mult in enumerate(ch_mult):
            block_in, block_out = ch * in_mult[i], ch * mult
            blocks = []
            for _ in range(num_res_blocks):
                blocks.append(_ResnetBlock(block_in, block_out))
                block_in = block_out
            level = _Level(blocks)
            if i < n_down:
                level.downsample = _Downsample(block_in)
            self.down.append(level)
        self.mid = _Mid(block_in)
        self.norm_out = _Norm(block_in)
        self.conv_out = _Conv(block_in, z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.down:
            for blk in level.block:
                h = blk(h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        h = self.mid(h)
        return self.conv_out(self.norm_out(h, silu=True))


class _Decoder(nn.Module):
    def __init__(self, ch: int, ch_mult: Sequence[int], num_res_blocks: int, z_channels: int, patch_size: int):
        super().__init__()
        n_up = int(math.log2(patch_size))
        block_in = ch * ch_mult[-1]
        self.conv_in = _Conv(z_channels, block_in, 3, padding=1)
        self.mid = _Mid(block_in)
        levels = []
        for i in reversed(range(len(ch_mult))):
            block_out = ch * ch_mult[i]
            blocks = []
            for _ in range(num_res_blocks + 1):
                blocks.append(_ResnetBlock(block_in, block_out))
                block_in = block_out
            level = _Level(blocks)
            if 1 <= i <= n_up:
                level.upsample = _Upsample(block_in)
            levels.insert(0, level)                                                 # up[i] is level i
        self.up = nn.ModuleList(levels)
        self.norm_out = _Norm(block_in)
        self.conv_out = _Conv(block_in, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(z))
        for level in reversed(self.up):
            for blk in level.block:
                h = blk(h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return rgb_output(self.norm_out.norm, self.conv_out.conv, h)


class BSQVAE(ModelMixin, ConfigMixin):
    """Infinity's BSQ-VAE (official key layout; the ``quantizer.lfq.mask`` buffers are not kept).

    Args:
        codebook_dim: bits per latent position d (32 for the 2B model's d32 VAE, 14 for the 8B's).
        base_ch, ch_mult, num_res_blocks: conv widths (official: 128, [1, 2, 4, 4, 4], 2; the 8B's
            patchify VAE: [1, 2, 4, 4]).
        patch_size: pixel stride of one latent position (16; 8 for the patchify VAE, whose 2×2
            latent patches form one transformer token).
    """

    @register_to_config
    def __init__(self, codebook_dim: int = 32, base_ch: int = 128, ch_mult: Sequence[int] = (1, 2, 4, 4, 4),
                 num_res_blocks: int = 2, patch_size: int = 16):
        super().__init__()
        if patch_size < 1 or patch_size & (patch_size - 1):
            raise ValueError(f"patch_size={patch_size} must be a power of two (official: 16, or 8 with patchify)")
        if int(math.log2(patch_size)) > len(ch_mult):
            raise ValueError(f"patch_size={patch_size} needs {int(math.log2(patch_size))} resolution levels, "
                             f"ch_mult={list(ch_mult)} has {len(ch_mult)}")
        self.encoder = _Encoder(base_ch, ch_mult, num_res_blocks, codebook_dim, patch_size)
        self.decoder = _Decoder(base_ch, ch_mult, num_res_blocks, codebook_dim, patch_size)

    @property
    def codebook_dim(self) -> int:
        return self.config.codebook_dim

    def init_random_weights(self, std: float = 0.02) -> "BSQVAE":
        """Random weights for a model built by size (benchmarks, smoke tests); draws noise."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.trunc_normal_(m.weight, std=std)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.GroupNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        return self

    # ---- encode (reconstruction, tests) ----------------------------------------------------------
    @torch.no_grad()
    def encode_features(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        """Raw encoder output h (B, d, H/patch, W/patch) float32 for images in [-1, 1]."""
        wdtype = self.encoder.conv_in.conv.weight.dtype
        return self.encoder(img_B3HW.to(wdtype)).float()

    @torch.no_grad()
    def quantize(self, h_BdHW: torch.Tensor, schedule_hw: Sequence[tuple[int, int]]):
        """Multi-scale BSQ of encoder features over a schedule of latent sizes (smallest first).

        Returns (bits, z): ``bits`` a list of (B, h·w, d) uint8 per scale (row-major), ``z`` the
        sum of the upsampled quantised scales (B, d, H, W) float32 — the decoder input.
        """
        B, d, H, W = h_BdHW.shape
        residual = h_BdHW.float().unsqueeze(2)                                      # (B, d, 1, H, W)
        q_scale = 1.0 / (d ** 0.5)
        summed = torch.zeros_like(residual)
        bits = []
        for h, w in schedule_hw:
            full = (h, w) == (H, W)
            r = residual if full else F.interpolate(residual, size=(1, h, w), mode="area")
            r_Bnd = r.permute(0, 2, 3, 4, 1).reshape(B, h * w, d)                   # (B, d, 1, h, w) → (B, hw, d)
            x = F.normalize(r_Bnd, dim=-1)
            zhat = torch.where(x > 0, 1.0, -1.0) * q_scale
            q_Bnd = x + (zhat - x)                                                 # the reference's straight-through value
            bits.append((q_Bnd > 0).to(torch.uint8))
            q = q_Bnd.transpose(1, 2).reshape(B, d, 1, h, w)                       # (B, hw, d) → (B, d, 1, h, w)
            if not full:
                q = F.interpolate(q, size=(1, H, W), mode="trilinear", align_corners=False)
            residual = residual - q
            summed = summed + q
        return bits, summed.squeeze(2)

    @torch.no_grad()
    def encode(self, img_B3HW: torch.Tensor, schedule_hw: Sequence[tuple[int, int]]):
        """Images in [-1, 1] → (h, bits per scale, z); see :meth:`quantize`."""
        h = self.encode_features(img_B3HW)
        bits, z = self.quantize(h, schedule_hw)
        return h, bits, z

    def summed_codes(self, bits: Sequence[torch.Tensor], schedule_hw: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The decoder input for per-scale bits (B, h·w, d): Σ trilinear-upsampled ±1/√d codes."""
        d = self.codebook_dim
        H, W = schedule_hw[-1]
        total = 0
        for b_Bnd, (h, w) in zip(bits, schedule_hw):
            B = b_Bnd.shape[0]
            codes_BdHW = codes_from_bits(b_Bnd, d).transpose(1, 2).reshape(B, d, h, w)  # (B, hw, d) → (B, d, h, w)
            total = total + upsample_codes(codes_BdHW, (H, W))
        return total

    # ---- decode ------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, z_BdHW: torch.Tensor) -> torch.Tensor:
        """Summed codes → images (B, 3, H·patch, W·patch) float32 clamped to [-1, 1].

        In the weights' dtype. A bf16 / fp16 decoder on CUDA runs channels-last (the memory layout
        cuDNN's half-precision convolutions work in) with the fused GroupNorm + SiLU kernel; float32
        runs channels-first with PyTorch's GroupNorm."""
        wdtype = self.decoder.conv_in.conv.weight.dtype
        z = z_BdHW.to(wdtype)
        if z.is_cuda and wdtype in (torch.bfloat16, torch.float16):
            z = z.contiguous(memory_format=torch.channels_last)
        return self.decoder(z).float().clamp(-1.0, 1.0).contiguous()

    # ---- checkpoints -------------------------------------------------------------------------------
    @staticmethod
    def config_from_state_dict(sd, source: str = "checkpoint") -> dict:
        """Constructor arguments inferred from official keys and shapes."""
        try:
            d = sd["encoder.conv_out.conv.weight"].shape[0]
            base_ch = sd["encoder.conv_in.conv.weight"].shape[0]
            levels = sorted({int(k.split(".")[2]) for k in sd if k.startswith("encoder.down.")})
            ch_mult = [sd[f"encoder.down.{i}.block.0.conv1.conv.weight"].shape[0] // base_ch for i in levels]
            blocks = {int(k.split(".")[4]) for k in sd if k.startswith("encoder.down.0.block.")}
            n_down = sum(1 for i in levels if f"encoder.down.{i}.downsample.conv.conv.weight" in sd
                         or f"encoder.down.{i}.downsample.conv.weight" in sd)
        except KeyError as e:
            raise ValueError(f"{source}: missing key {e.args[0]!r} needed to infer the BSQ-VAE configuration; "
                             f"is this an official infinity_vae_*.pth file?") from None
        return dict(codebook_dim=d, base_ch=base_ch, ch_mult=ch_mult, num_res_blocks=len(blocks),
                    patch_size=2 ** n_down)


__all__ = ["BSQVAE", "codes_from_bits", "code_value", "next_scale_input", "upsample_codes"]
