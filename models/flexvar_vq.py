"""FlexVAR's tokenizer: LlamaGen's VQ-16 (research/flexvar.md §2), in its official key layout.

Only what differs from VAR's VQVAE (models/vqvae.py, whose ResNet blocks and resampling layers it
shares): the levels are ``conv_blocks.{i}`` with ``res`` / ``attn`` lists, the attention has
separate 1×1 ``q``, ``k``, ``v`` convolutions, ``quant_conv`` / ``post_quant_conv`` are 1×1 between
the 256-channel latent and the 32-channel codes, the decoder has three ResNet blocks per level, and
quantisation is cosine: latent vectors and the raw codebook rows are L2-normalised before the nearest
code is taken, and a code's vector is its normalised row. There is no residual across scales: each
scale is the area-downsampled latent quantised on its own, and the picture is decoded from the last
scale's codes alone (unclamped).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from ._blocks import norm_silu
from .vqvae import Downsample2x, ResnetBlock, Upsample2x, _group_norm


class SeparateQKVAttnBlock(nn.Module):
    """Single-head spatial self-attention with 1×1 ``q``, ``k``, ``v`` and ``proj_out`` (LlamaGen)."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = _group_norm(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x_BChw: torch.Tensor) -> torch.Tensor:
        B, C, h, w = x_BChw.shape
        y = norm_silu(self.norm, x_BChw, silu=False)
        q_BLC = self.q(y).reshape(B, C, h * w).transpose(1, 2)                      # (B, C, h, w) → (B, h·w, C)
        k_BCL = self.k(y).reshape(B, C, h * w)
        v_BCL = self.v(y).reshape(B, C, h * w)
        attn_BLL = torch.softmax(torch.bmm(q_BLC, k_BCL) * C ** -0.5, dim=2)       # [query, key]
        out_BCL = torch.bmm(v_BCL, attn_BLL.transpose(1, 2))
        return x_BChw + self.proj_out(out_BCL.reshape(B, C, h, w))


class _Block(nn.Module):
    """``conv_blocks.{i}``: ``res`` blocks, ``attn`` blocks (after each res block, lowest level only)
    and a ``downsample`` / ``upsample`` where the level has one."""

    def __init__(self, c_in: int, c_out: int, n_res: int, attn: bool, resample: str = ""):
        super().__init__()
        self.res = nn.ModuleList(ResnetBlock(c_in if j == 0 else c_out, c_out) for j in range(n_res))
        self.attn = nn.ModuleList(SeparateQKVAttnBlock(c_out) for _ in range(n_res if attn else 0))
        if resample == "down":
            self.downsample = Downsample2x(c_out)
        elif resample == "up":
            self.upsample = Upsample2x(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for j, res in enumerate(self.res):
            x = res(x)
            if len(self.attn):
                x = self.attn[j](x)
        if hasattr(self, "downsample"):
            x = self.downsample(x)
        if hasattr(self, "upsample"):
            x = self.upsample(x)
        return x


class _Mid(nn.ModuleList):
    """``mid.{0,1,2}``: res, attention, res."""

    def __init__(self, c: int):
        super().__init__([ResnetBlock(c, c), SeparateQKVAttnBlock(c), ResnetBlock(c, c)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self:
            x = m(x)
        return x


class _Encoder(nn.Module):
    def __init__(self, ch: int, ch_mult: Sequence[int], n_res: int, z_channels: int):
        super().__init__()
        self.conv_in = nn.Conv2d(3, ch, 3, padding=1)
        widths = [ch * m for m in ch_mult]
        blocks, c = [], ch
        for i, w in enumerate(widths):
            last = i == len(widths) - 1
            blocks.append(_Block(c, w, n_res, attn=last, resample="" if last else "down"))
            c = w
        self.conv_blocks = nn.ModuleList(blocks)
        self.mid = _Mid(c)
        self.norm_out = _group_norm(c)
        self.conv_out = nn.Conv2d(c, z_channels, 3, padding=1)

    def forward(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(img_B3HW)
        for block in self.conv_blocks:
            h = block(h)
        return self.conv_out(norm_silu(self.norm_out, self.mid(h)))


class _Decoder(nn.Module):
    def __init__(self, ch: int, ch_mult: Sequence[int], n_res: int, z_channels: int):
        super().__init__()
        widths = [ch * m for m in reversed(ch_mult)]                       # processing order: lowest level first
        c = widths[0]
        self.conv_in = nn.Conv2d(z_channels, c, 3, padding=1)
        self.mid = _Mid(c)
        blocks = []
        for i, w in enumerate(widths):
            last = i == len(widths) - 1
            blocks.append(_Block(c, w, n_res + 1, attn=i == 0, resample="" if last else "up"))
            c = w
        self.conv_blocks = nn.ModuleList(blocks)
        self.norm_out = _group_norm(c)
        self.conv_out = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, z_BChw: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(z_BChw))
        for block in self.conv_blocks:
            h = block(h)
        return self.conv_out(norm_silu(self.norm_out, h))


class _Quantize(nn.Module):
    def __init__(self, vocab_size: int, embed_dim: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)


class FlexVQ16(ModelMixin, ConfigMixin):
    """LlamaGen's VQ-16 as FlexVAR uses it (official keys; the training-only ``quantize.codebook_used``
    buffer is not kept). Released: 8912 codes of 32 channels, latent width 256, ``ch`` 128, ``ch_mult``
    (1, 1, 2, 2, 4) (16× downsampling), two ResNet blocks per encoder level."""

    @register_to_config
    def __init__(self, vocab_size: int = 8912, embed_dim: int = 32, z_channels: int = 256, ch: int = 128,
                 ch_mult: Sequence[int] = (1, 1, 2, 2, 4), num_res_blocks: int = 2):
        super().__init__()
        ch_mult = tuple(int(m) for m in ch_mult)
        self.encoder = _Encoder(ch, ch_mult, num_res_blocks, z_channels)
        self.decoder = _Decoder(ch, ch_mult, num_res_blocks, z_channels)
        self.quant_conv = nn.Conv2d(z_channels, embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(embed_dim, z_channels, 1)
        self.quantize = _Quantize(vocab_size, embed_dim)
        self.downsample_factor = 2 ** (len(ch_mult) - 1)

    @staticmethod
    def official_extra_keys() -> set:
        return {"quantize.codebook_used"}

    def init_random_weights(self) -> "FlexVQ16":
        """PyTorch's default init for every layer, codebook ~ N(0, 1) (benchmarks, smoke tests)."""
        for m in self.modules():
            if hasattr(m, "reset_parameters") and m is not self:
                m.reset_parameters()
        return self

    def codebook(self) -> torch.Tensor:
        """(V, C) float32 L2-normalised code vectors (what every use of the codebook reads)."""
        return F.normalize(self.quantize.embedding.weight.float(), p=2, dim=-1)

    def encode(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        """The continuous latent (B, C, H/16, W/16) of images in [−1, 1]."""
        return self.quant_conv(self.encoder(img_B3HW))

    def nearest(self, z_BChw: torch.Tensor) -> torch.Tensor:
        """(B, h·w) codes: nearest normalised code to each normalised latent vector (row-major)."""
        B, C, h, w = z_BChw.shape
        z_NC = F.normalize(z_BChw.float().permute(0, 2, 3, 1).reshape(-1, C), p=2, dim=-1)   # (B,C,h,w) → (N,C)
        e_VC = self.codebook()
        d_NV = z_NC.square().sum(1, keepdim=True) + e_VC.square().sum(1) - 2 * z_NC @ e_VC.T
        return d_NV.argmin(dim=1).view(B, h * w)

    def vectors(self, idx_Bl: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """(B, C, h, w) normalised code vectors of row-major codes."""
        return F.embedding(idx_Bl, self.codebook()).view(idx_Bl.shape[0], h, w, -1).permute(0, 3, 1, 2)

    def multiscale(self, img_B3HW: torch.Tensor, patch_nums: Sequence[int]):
        """(codes per scale [(B, pn²)], teacher-forcing input (B, L − 1, C)): every scale quantises
        the area-downsampled latent on its own; the input of scale k+1 is scale k's code vectors,
        bicubic-upsampled to it (row-major)."""
        f = self.encode(img_B3HW).float()
        idx, inputs = [], []
        for k, pn in enumerate(patch_nums):
            idx.append(self.nearest(F.interpolate(f, size=(pn, pn), mode="area")))
            if k + 1 < len(patch_nums):
                nxt = patch_nums[k + 1]
                q = F.interpolate(self.vectors(idx[-1], pn, pn), size=(nxt, nxt), mode="bicubic")
                inputs.append(q.flatten(2).transpose(1, 2))                              # (B, C, n, n) → (B, n², C)
        return idx, torch.cat(inputs, dim=1)

    def decode_codes(self, idx_Bl: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """The raw decoder output (≈[−1, 1], unclamped) of one scale's codes."""
        return self.decoder(self.post_quant_conv(self.vectors(idx_Bl, h, w)))


__all__ = ["FlexVQ16"]
