"""Multi-scale residual VQVAE of the class-conditional VAR ("vae_ch160v4096z32").

This is a from-scratch re-implementation of the tokenizer used by FoundationVision/VAR. The module
tree is laid out so that ``state_dict()`` has exactly the keys of the released checkpoint
``vae_ch160v4096z32.pth`` except the training-only buffer ``quantize.ema_vocab_hit_SV`` (see
:meth:`MultiScaleVQVAE.official_extra_keys`).

Conventions
-----------
* Images are float tensors ``B x 3 x H x W`` in ``[-1, 1]``; H and W must be multiples of the
  downsampling factor ``2 ** (len(ch_mult) - 1)`` (16 for the official model).
* Latent maps (``f_BChw``, ``f_hat_BChw``, ``h_BChw``) are ``B x Cvae x h x w``.
* Token indices of one scale are ``LongTensor (B, h*w)`` in row-major (y, x) order (``idx_Bl``).
* A *schedule* is a list of ``(h, w)`` per scale, coarse to fine; its last entry is the latent
  size. ``None`` means the square schedule from the config's ``patch_nums``.
* All quantiser math (distances, phi convolutions, f_hat accumulation) runs in float32 with
  autocast disabled, whatever the dtype of the encoder / decoder.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from ._blocks import norm_silu, resnet_block, rgb_output

__all__ = ["MultiScaleVQVAE", "phi_index_table"]

Schedule = Sequence[tuple[int, int]]

_GN_GROUPS = 32
_GN_EPS = 1e-6


NORMS = ("group", "channel")
PADDINGS = ("zeros", "replicate")


class ChannelNorm(nn.Module):
    """Normalises every pixel's channel vector on its own (zero mean, unit variance over the channels,
    eps 1e-6), then a per-channel affine: LayerNorm over C at each (y, x). Its parameters (``weight``,
    ``bias``, shape (C,)) have the keys and shapes of the GroupNorm it replaces.

    Why it exists: GroupNorm takes its statistics over the whole map. With 32 groups on 32 channels
    (a small VQVAE such as the demo's, ``ch=32``) each group is one channel, i.e. instance
    normalisation, and a decoder trained on scenes with large flat areas learns to set those
    statistics with a spike of huge activations in one corner (the top-left, which zero padding lets
    it find), visible as a noisy smudge there — the "droplet" artefact of StyleGAN (Karras et al.,
    "Analyzing and Improving the Image Quality of StyleGAN", 2020, §2). Statistics of one pixel leave
    no such lever."""

    def __init__(self, channels: int, eps: float = _GN_EPS):
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x_BChw: torch.Tensor) -> torch.Tensor:
        """``F.layer_norm`` over the channels of a channels-last view; the result keeps that memory
        layout (the next convolution takes it as it is, faster than normalising channels-first by
        hand)."""
        x_BhwC = x_BChw.permute(0, 2, 3, 1)  # (B, C, h, w) -> (B, h, w, C), a view
        y_BhwC = F.layer_norm(x_BhwC, (x_BhwC.shape[-1],), self.weight, self.bias, self.eps)
        return y_BhwC.permute(0, 3, 1, 2)  # (B, h, w, C) -> (B, C, h, w), channels-last memory


def _conv3x3(in_channels: int, out_channels: int, padding: str = "zeros") -> nn.Conv2d:
    """3x3 convolution, stride 1, one pixel of padding: "zeros" (the official VAE) or "replicate" (a
    flat map stays flat up to its borders and corners)."""
    return nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1, padding_mode=padding)


def _group_norm(channels: int, norm: str = "group") -> nn.Module:
    """The VAE's normalisation: GroupNorm(32 groups, eps 1e-6, affine) as in the official model, or
    :class:`ChannelNorm` (``norm="channel"``)."""
    if norm == "channel":
        return ChannelNorm(channels)
    return nn.GroupNorm(num_groups=_GN_GROUPS, num_channels=channels, eps=_GN_EPS, affine=True)


def _phi_index(si: int, num_scales: int, num_phi: int) -> int:
    """Reference tick rule; see :func:`phi_index_table`."""
    si, num_scales, K = int(si), int(num_scales), int(num_phi)
    if num_scales < 1:
        raise ValueError(f"num_scales must be >= 1, got {num_scales}")
    if not 0 <= si < num_scales:
        raise ValueError(f"si must be in [0, {num_scales - 1}] for num_scales={num_scales}, got {si}")
    if K < 1:
        raise ValueError(f"num_phi must be >= 1, got {K}")
    if num_scales == 1:
        return 0
    if K == 4:
        ticks = np.linspace(1 / 3 / K, 1 - 1 / 3 / K, K)
    else:
        ticks = np.linspace(1 / 2 / K, 1 - 1 / 2 / K, K)
    at = si / (num_scales - 1)  # Python float64, as in the reference
    return int(np.argmin(np.abs(ticks - at)).item())


def bicubic_operator(hw: tuple[int, int], size: tuple[int, int], device) -> torch.Tensor:
    """The linear map of ``F.interpolate(·, size, mode="bicubic", align_corners=False)`` from an
    (h, w) map to ``size`` = (H, W), as an (h·w, H·W) float32 matrix: row i is the upsampled i-th
    basis map, so ``x_N(hw) @ op`` upsamples N maps at once (borders clamped as PyTorch does).

    Why: PyTorch's CUDA bicubic kernel runs one thread per output pixel and loops over every (image,
    channel) plane, slow on VAR's many small planes; the product is one launch. The sums run in a
    different order: results agree to float32 rounding, not bit for bit."""
    h, w = hw
    basis = torch.eye(h * w, device=device, dtype=torch.float32).view(h * w, 1, h, w)
    return F.interpolate(basis, size=size, mode="bicubic", align_corners=False).view(h * w, size[0] * size[1])


def phi_index_table(num_scales: int, num_phi: int = 4) -> list[int]:
    """phi conv index of every scale of a ``num_scales``-scale schedule (reference rule).

    Scale ``si`` sits at ``a = si / (num_scales - 1)`` (0 when there is one scale); the phi whose
    tick is nearest is used, ticks = ``linspace(1/3/K, 1-1/3/K, K)`` for K == 4, else
    ``linspace(1/2/K, 1-1/2/K, K)``, argmin in numpy float64. Float64 rounding decides the exact
    ties at si=2 and si=7 of 10 scales: ``[0,0,1,1,1,2,2,3,3,3]`` (14 scales:
    ``[0,0,0,1,1,1,1,2,2,2,2,3,3,3]``); exact or float32 arithmetic would differ.
    """
    return [_phi_index(si, num_scales, num_phi) for si in range(int(num_scales))]


# ------------------------------------------------------------------------------------------------
# Building blocks (var.md 2.2)
# ------------------------------------------------------------------------------------------------
class ResnetBlock(nn.Module):
    """GN -> SiLU -> conv3x3 -> GN -> SiLU -> conv3x3, plus (1x1-projected) skip connection."""

    def __init__(self, in_channels: int, out_channels: int, norm: str = "group", padding: str = "zeros"):
        super().__init__()
        self.norm1 = _group_norm(in_channels, norm)
        self.conv1 = _conv3x3(in_channels, out_channels, padding)
        self.norm2 = _group_norm(out_channels, norm)
        self.conv2 = _conv3x3(out_channels, out_channels, padding)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=1, padding=0)
        else:
            self.nin_shortcut = nn.Identity()

    def forward(self, x_BChw: torch.Tensor) -> torch.Tensor:
        shortcut = None if isinstance(self.nin_shortcut, nn.Identity) else self.nin_shortcut
        return resnet_block(x_BChw, self.norm1, self.conv1, self.norm2, self.conv2, shortcut)


class AttnBlock(nn.Module):
    """Single-head spatial self-attention over all h*w positions (qkv 1x1 conv, proj_out 1x1 conv)."""

    def __init__(self, channels: int, norm: str = "group"):
        super().__init__()
        self.channels = channels
        self.norm = _group_norm(channels, norm)
        self.qkv = nn.Conv2d(channels, 3 * channels, kernel_size=1, stride=1, padding=0)
        self.proj_out = nn.Conv2d(channels, channels, kernel_size=1, stride=1, padding=0)
        self.scale = channels ** -0.5

    def forward(self, x_BChw: torch.Tensor) -> torch.Tensor:
        B, _, h, w = x_BChw.shape
        C = self.channels
        qkv_B3Chw = self.qkv(norm_silu(self.norm, x_BChw, silu=False)).reshape(B, 3, C, h, w)  # (B, 3C, h, w) -> (B, 3, C, h, w)
        q_BChw, k_BChw, v_BChw = qkv_B3Chw.unbind(1)
        q_BLC = q_BChw.reshape(B, C, h * w).permute(0, 2, 1)  # (B, C, h, w) -> (B, h*w, C)
        k_BCL = k_BChw.reshape(B, C, h * w)  # (B, C, h, w) -> (B, C, h*w)
        v_BCL = v_BChw.reshape(B, C, h * w)  # (B, C, h, w) -> (B, C, h*w)
        attn_BLL = torch.bmm(q_BLC, k_BCL).mul_(self.scale)  # [b, query, key]
        attn_BLL = F.softmax(attn_BLL, dim=2)
        out_BCL = torch.bmm(v_BCL, attn_BLL.permute(0, 2, 1))  # out[c, query] = sum_key v[c, key] * a[query, key]
        out_BChw = out_BCL.reshape(B, C, h, w)  # (B, C, h*w) -> (B, C, h, w)
        if x_BChw.is_contiguous(memory_format=torch.channels_last) and not x_BChw.is_contiguous():
            out_BChw = out_BChw.contiguous(memory_format=torch.channels_last)   # a channels-last decoder stays so
        return x_BChw + self.proj_out(out_BChw)


class Downsample2x(nn.Module):
    """Zero-pad right and bottom by one pixel, then a stride-2 3x3 conv without padding."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=2, padding=0)

    def forward(self, x_BChw: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x_BChw, (0, 1, 0, 1), mode="constant", value=0.0))


class Upsample2x(nn.Module):
    """Nearest-neighbour x2 upsampling followed by a 3x3 conv (padding 1)."""

    def __init__(self, channels: int, padding: str = "zeros"):
        super().__init__()
        self.conv = _conv3x3(channels, channels, padding)

    def forward(self, x_BChw: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x_BChw, scale_factor=2.0, mode="nearest"))


class _Level(nn.Module):
    """One resolution level: ``block`` (ResnetBlocks), ``attn`` (AttnBlocks, possibly empty) and an
    optional ``downsample`` / ``upsample`` (the attribute is only created when the level has one)."""

    def __init__(self):
        super().__init__()
        self.block = nn.ModuleList()
        self.attn = nn.ModuleList()

    def run_blocks(self, h_BChw: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.block):
            h_BChw = block(h_BChw)
            if len(self.attn) > 0:
                h_BChw = self.attn[i](h_BChw)
        return h_BChw


class _Mid(nn.Module):
    """ResnetBlock -> AttnBlock (or identity) -> ResnetBlock at the lowest resolution."""

    def __init__(self, channels: int, using_mid_sa: bool, norm: str = "group", padding: str = "zeros"):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, norm, padding)
        self.attn_1 = AttnBlock(channels, norm) if using_mid_sa else nn.Identity()
        self.block_2 = ResnetBlock(channels, channels, norm, padding)

    def forward(self, h_BChw: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(h_BChw)))


# ------------------------------------------------------------------------------------------------
# Encoder / decoder (var.md 2.3, 2.4)
# ------------------------------------------------------------------------------------------------
class Encoder(nn.Module):
    """Image (B, 3, H, W) -> latent (B, z_channels, H / 2^(n-1), W / 2^(n-1)), n = len(ch_mult)."""

    def __init__(self, ch: int, ch_mult: tuple[int, ...], num_res_blocks: int, z_channels: int,
                 using_sa: bool, using_mid_sa: bool, in_channels: int = 3):
        super().__init__()
        num_levels = len(ch_mult)
        self.conv_in = nn.Conv2d(in_channels, ch, kernel_size=3, stride=1, padding=1)
        in_mult = (1,) + tuple(ch_mult)
        self.down = nn.ModuleList()
        block_in = ch
        for i_level in range(num_levels):
            level = _Level()
            block_in = ch * in_mult[i_level]
            block_out = ch * ch_mult[i_level]
            for _ in range(num_res_blocks):
                level.block.append(ResnetBlock(block_in, block_out))
                block_in = block_out
                if i_level == num_levels - 1 and using_sa:
                    level.attn.append(AttnBlock(block_in))
            if i_level != num_levels - 1:
                level.downsample = Downsample2x(block_in)
            self.down.append(level)
        self.mid = _Mid(block_in, using_mid_sa)
        self.norm_out = _group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, z_channels, kernel_size=3, stride=1, padding=1)

    def forward(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        h_BChw = self.conv_in(img_B3HW)
        for i_level, level in enumerate(self.down):
            h_BChw = level.run_blocks(h_BChw)
            if i_level != len(self.down) - 1:
                h_BChw = level.downsample(h_BChw)
        h_BChw = self.mid(h_BChw)
        return self.conv_out(norm_silu(self.norm_out, h_BChw))


class Decoder(nn.Module):
    """Latent (B, z_channels, h, w) -> raw (unclamped) image (B, 3, h * 2^(n-1), w * 2^(n-1)).
    ``norm``: "group" (GroupNorm, the official decoder) or "channel" (:class:`ChannelNorm`);
    ``padding``: the 3x3 convolutions' padding, "zeros" (official) or "replicate"."""

    def __init__(self, ch: int, ch_mult: tuple[int, ...], num_res_blocks: int, z_channels: int,
                 using_sa: bool, using_mid_sa: bool, out_channels: int = 3, norm: str = "group",
                 padding: str = "zeros"):
        super().__init__()
        num_levels = len(ch_mult)
        block_in = ch * ch_mult[-1]
        self.conv_in = _conv3x3(z_channels, block_in, padding)
        self.mid = _Mid(block_in, using_mid_sa, norm, padding)
        levels: list[_Level] = []
        for i_level in reversed(range(num_levels)):
            level = _Level()
            block_out = ch * ch_mult[i_level]
            for _ in range(num_res_blocks + 1):
                level.block.append(ResnetBlock(block_in, block_out, norm, padding))
                block_in = block_out
                if i_level == num_levels - 1 and using_sa:
                    level.attn.append(AttnBlock(block_in, norm))
            if i_level != 0:
                level.upsample = Upsample2x(block_in, padding)
            levels.insert(0, level)  # ModuleList indexed by level: up.0 is the highest resolution
        self.up = nn.ModuleList(levels)
        self.norm_out = _group_norm(block_in, norm)
        self.conv_out = _conv3x3(block_in, out_channels, padding)

    def forward(self, z_BChw: torch.Tensor) -> torch.Tensor:
        h_BChw = self.mid(self.conv_in(z_BChw))
        for i_level in reversed(range(len(self.up))):
            level = self.up[i_level]
            h_BChw = level.run_blocks(h_BChw)
            if i_level != 0:
                h_BChw = level.upsample(h_BChw)
        return rgb_output(self.norm_out, self.conv_out, h_BChw)


# ------------------------------------------------------------------------------------------------
# Quantiser containers (var.md 2.6); the math lives in MultiScaleVQVAE
# ------------------------------------------------------------------------------------------------
class PhiPartiallyShared(nn.Module):
    """The K phi convolutions (``qresi_ls.{k}``), each conv3x3 Cvae -> Cvae with bias."""

    def __init__(self, channels: int, num_phi: int):
        super().__init__()
        self.qresi_ls = nn.ModuleList(
            nn.Conv2d(channels, channels, kernel_size=3, stride=1, padding=1) for _ in range(num_phi)
        )


class MultiScaleQuantizer(nn.Module):
    """Parameter container of the residual quantiser: ``quant_resi`` (phi convs) and ``embedding``."""

    def __init__(self, vocab_size: int, channels: int, num_phi: int):
        super().__init__()
        self.quant_resi = PhiPartiallyShared(channels, num_phi)
        self.embedding = nn.Embedding(vocab_size, channels)


# ------------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------------
class MultiScaleVQVAE(ModelMixin, ConfigMixin):
    """VAR's multi-scale residual VQVAE (encoder, decoder, residual quantiser with phi convs).

    The defaults reproduce the official ``vae_ch160v4096z32`` (V=4096, Cvae=32, ch=160, 4
    partially shared phi convs, the 256-px patch schedule). ``patch_nums`` only provides the
    default square schedule; every schedule-taking method accepts an explicit (possibly
    non-square) schedule.

    ``phi_on_last=False`` is HART's hybrid tokenizer (hart.md §4.2): the same network, but the last
    scale's codes enter the latent without φ (encode, ``idx_to_fhat``, ``next_stage_input``); the
    rest of the latent, ``f − f_hat``, is the continuous residual its diffusion head models.

    The decode side can differ from the official model (the encoder never does), with the same
    state-dict keys and shapes: ``decoder_norm`` is the decoder's normalisation, "group" (GroupNorm,
    official) or "channel" (:class:`ChannelNorm`, per pixel), and ``decoder_padding`` the padding of
    the 3x3 convolutions of ``post_quant_conv`` and the decoder, "zeros" (official) or "replicate".
    The demo model uses "channel" and "replicate": its GroupNorm decoder (32 channels, so one channel
    per group) grew a noisy smudge in the top-left corner of every picture, and zero padding left
    faint lines along the borders of its flat backgrounds.
    """

    @register_to_config
    def __init__(
        self,
        vocab_size: int = 4096,
        z_channels: int = 32,
        ch: int = 160,
        ch_mult: tuple = (1, 1, 2, 2, 4),
        num_res_blocks: int = 2,
        using_sa: bool = True,
        using_mid_sa: bool = True,
        num_phi: int = 4,
        quant_resi: float = 0.5,
        patch_nums: tuple = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16),
        decoder_norm: str = "group",
        decoder_padding: str = "zeros",
        phi_on_last: bool = True,
    ):
        super().__init__()
        ch_mult = tuple(int(m) for m in ch_mult)
        patch_nums = tuple(int(p) for p in patch_nums)
        if int(vocab_size) < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size!r}")
        if int(z_channels) < 1:
            raise ValueError(f"z_channels must be >= 1, got {z_channels!r}")
        if len(ch_mult) < 1 or any(m < 1 for m in ch_mult):
            raise ValueError(f"ch_mult must be a non-empty sequence of positive ints, got {ch_mult!r}")
        bad_widths = sorted({ch * m for m in (1,) + ch_mult if (ch * m) % _GN_GROUPS != 0})
        if int(ch) < 1 or bad_widths:
            raise ValueError(
                f"ch={ch!r} with ch_mult={ch_mult!r} gives channel widths {bad_widths} that are not "
                f"multiples of {_GN_GROUPS} (GroupNorm groups); use ch a multiple of {_GN_GROUPS}, e.g. 32 or 160"
            )
        if int(num_res_blocks) < 1:
            raise ValueError(f"num_res_blocks must be >= 1, got {num_res_blocks!r}")
        if int(num_phi) < 1:
            raise ValueError(
                f"num_phi must be >= 1 (only the partially-shared phi mode is implemented), got {num_phi!r}"
            )
        if not abs(float(quant_resi)) > 1e-6:
            raise ValueError(
                f"quant_resi={quant_resi!r}: |quant_resi| <= 1e-6 means 'no phi conv' in the reference, "
                f"which is not supported; use the official 0.5"
            )
        if len(patch_nums) < 1 or any(p < 1 for p in patch_nums):
            raise ValueError(f"patch_nums must be a non-empty sequence of positive ints, got {patch_nums!r}")
        if decoder_norm not in NORMS:
            raise ValueError(f"decoder_norm={decoder_norm!r}: choose one of {', '.join(map(repr, NORMS))} "
                             f"('group' for official checkpoints)")
        if decoder_padding not in PADDINGS:
            raise ValueError(f"decoder_padding={decoder_padding!r}: choose one of {', '.join(map(repr, PADDINGS))} "
                             f"('zeros' for official checkpoints)")

        self.vocab_size = int(vocab_size)
        self.z_channels = int(z_channels)
        self.patch_nums = patch_nums
        self.resi_ratio = abs(float(quant_resi))
        self.phi_on_last = bool(phi_on_last)
        self.downsample_factor = 2 ** (len(ch_mult) - 1)

        self.encoder = Encoder(int(ch), ch_mult, int(num_res_blocks), self.z_channels,
                               bool(using_sa), bool(using_mid_sa))
        self.decoder = Decoder(int(ch), ch_mult, int(num_res_blocks), self.z_channels,
                               bool(using_sa), bool(using_mid_sa), norm=decoder_norm, padding=decoder_padding)
        self.quantize = MultiScaleQuantizer(self.vocab_size, self.z_channels, int(num_phi))
        self.quant_conv = nn.Conv2d(self.z_channels, self.z_channels, kernel_size=3, stride=1, padding=1)
        self.post_quant_conv = _conv3x3(self.z_channels, self.z_channels, decoder_padding)

    # -------------------------------------------------------------------------------- checkpoints
    def init_random_weights(self) -> "MultiScaleVQVAE":
        """Random weights for a model built by size (benchmarks, smoke tests): PyTorch's default
        init for every layer, codebook ~ N(0, 0.5²). Decodes noise."""
        for m in self.modules():
            if hasattr(m, "reset_parameters") and m is not self:
                m.reset_parameters()
        with torch.no_grad():
            self.quantize.embedding.weight.normal_(0.0, 0.5)
        return self

    @staticmethod
    def official_extra_keys() -> set:
        """Keys of official checkpoints that this module does not have (a loader drops them)."""
        return {"quantize.ema_vocab_hit_SV"}

    @classmethod
    def config_from_state_dict(cls, sd, patch_nums: Sequence[int] | None = None) -> dict:
        """Constructor kwargs inferred from an official-layout VQVAE state dict.

        ``quant_resi`` and ``patch_nums`` are not stored in checkpoints: ``quant_resi`` is left at
        its default (0.5, the only released value) and ``patch_nums`` is included only when given.

        Raises:
            ValueError: ``sd`` is not a (plain, un-prefixed) VAR VQVAE state dict.
        """
        if not hasattr(sd, "keys"):
            raise ValueError(f"sd must be a state dict (mapping key -> tensor), got {type(sd).__name__}")
        keys = set(sd.keys())
        required = ("quantize.embedding.weight", "encoder.conv_in.weight", "encoder.down.0.block.0.conv1.weight",
                    "decoder.conv_in.weight", "quant_conv.weight", "post_quant_conv.weight")
        missing = [k for k in required if k not in keys]
        if missing:
            sample = sorted(str(k) for k in keys)[:5]
            hint = ""
            if "trainer" in keys:
                hint = " It looks like a VAR training checkpoint: pass ckpt['trainer']['vae_local']."
            elif any(str(k).endswith(missing[0]) for k in keys):
                hint = " The keys carry a prefix: strip it (e.g. 'module.' or 'vae.') first."
            raise ValueError(
                f"sd is not a VAR VQVAE state dict: missing key(s) {missing} (first keys: {sample}).{hint}"
            )

        emb = sd["quantize.embedding.weight"]
        if emb.ndim != 2:
            raise ValueError(f"quantize.embedding.weight must be 2-D (V, Cvae), got shape {tuple(emb.shape)}")
        vocab_size, z_channels = int(emb.shape[0]), int(emb.shape[1])
        ch = int(sd["encoder.conv_in.weight"].shape[0])

        ch_mult = []
        while f"encoder.down.{len(ch_mult)}.block.0.conv1.weight" in keys:
            width = int(sd[f"encoder.down.{len(ch_mult)}.block.0.conv1.weight"].shape[0])
            if width % ch != 0:
                raise ValueError(
                    f"encoder.down.{len(ch_mult)} width {width} is not a multiple of ch={ch}: not a VAR VQVAE"
                )
            ch_mult.append(width // ch)

        num_res_blocks = 0
        while f"encoder.down.0.block.{num_res_blocks}.conv1.weight" in keys:
            num_res_blocks += 1

        num_phi = 0
        while f"quantize.quant_resi.qresi_ls.{num_phi}.weight" in keys:
            num_phi += 1
        if num_phi == 0:
            raise ValueError(
                "sd has no 'quantize.quant_resi.qresi_ls.{k}' keys: only the partially-shared phi mode "
                "(official share_quant_resi=4) is supported"
            )

        last = len(ch_mult) - 1
        cfg = dict(
            vocab_size=vocab_size,
            z_channels=z_channels,
            ch=ch,
            ch_mult=ch_mult,
            num_res_blocks=num_res_blocks,
            using_sa=f"encoder.down.{last}.attn.0.qkv.weight" in keys,
            using_mid_sa="encoder.mid.attn_1.qkv.weight" in keys,
            num_phi=num_phi,
        )
        if patch_nums is not None:
            cfg["patch_nums"] = [int(p) for p in patch_nums]
        return cfg

    # -------------------------------------------------------------------------------- schedules
    def default_schedule(self) -> list[tuple[int, int]]:
        """The square schedule from the config's ``patch_nums``: ``[(pn, pn), ...]``."""
        return [(pn, pn) for pn in self.patch_nums]

    def _schedule(self, schedule: Schedule | None, name: str = "schedule") -> list[tuple[int, int]]:
        """Normalise a schedule to a list of (h, w) int tuples (ints are accepted as square)."""
        if schedule is None:
            return self.default_schedule()
        out: list[tuple[int, int]] = []
        for entry in schedule:
            if isinstance(entry, (int, np.integer)):
                hw = (int(entry), int(entry))
            else:
                try:
                    h, w = entry
                    hw = (int(h), int(w))
                except (TypeError, ValueError):
                    raise ValueError(
                        f"{name} entries must be (h, w) pairs of positive ints, got {entry!r} in {list(schedule)!r}"
                    ) from None
            if hw[0] < 1 or hw[1] < 1:
                raise ValueError(f"{name} entries must be positive, got {entry!r} in {list(schedule)!r}")
            out.append(hw)
        if not out:
            raise ValueError(f"{name} must contain at least one (h, w) entry, got {schedule!r}")
        H, W = out[-1]
        too_big = [hw for hw in out if hw[0] > H or hw[1] > W]
        if too_big:
            raise ValueError(
                f"{name} entries {too_big} exceed the last entry (latent size) {(H, W)}; "
                f"list scales coarse to fine, ending with the latent size"
            )
        return out

    # -------------------------------------------------------------------------------- phi
    def phi_index(self, si: int, num_scales: int) -> int:
        """Index of the phi conv used at scale ``si`` of a ``num_scales``-scale schedule.

        See :func:`phi_index_table` for the rule (reference tick rule, numpy float64).
        """
        return _phi_index(si, num_scales, len(self.quantize.quant_resi.qresi_ls))

    def phi_parameters(self, si: int, num_scales: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(conv weight (Cvae, Cvae, 3, 3), its bias, r = |quant_resi|) of the phi used at scale ``si``
        of a ``num_scales``-scale schedule: phi(h) = (1 - r) * h + r * conv(h)."""
        conv = self.quantize.quant_resi.qresi_ls[self.phi_index(si, num_scales)]
        return conv.weight, conv.bias, self.resi_ratio

    def phi_or_identity(self, h_BChw: torch.Tensor, si: int, num_scales: int) -> torch.Tensor:
        """``apply_phi``, except at the last scale of a tokenizer with ``phi_on_last=False`` (HART),
        where the codes enter the latent as they are."""
        if si == num_scales - 1 and not self.phi_on_last:
            return h_BChw.float()
        return self.apply_phi(h_BChw, si, num_scales)

    def apply_phi(self, h_BChw: torch.Tensor, si: int, num_scales: int) -> torch.Tensor:
        """phi(h) = (1 - r) * h + r * conv_k(h) with r = |quant_resi| and k = phi_index(si, num_scales).

        Computed in float32 (autocast off; ``sparse_ops.ref.phi``); returns a new float32 tensor. (The
        sampler's latent update adds it into the latent in one step: ``ref.phi_accumulate`` and its kernel.)
        """
        from ..sparse_ops.ref import phi
        return phi(h_BChw, *self.phi_parameters(si, num_scales))

    # -------------------------------------------------------------------------------- encode / quantise
    def encode(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        """Continuous latent ``f_BChw = quant_conv(encoder(img))`` for images in [-1, 1]."""
        if img_B3HW.ndim != 4 or img_B3HW.shape[1] != 3:
            raise ValueError(f"img_B3HW must be B x 3 x H x W, got shape {tuple(img_B3HW.shape)}")
        H, W = img_B3HW.shape[-2:]
        if H % self.downsample_factor or W % self.downsample_factor:
            raise ValueError(
                f"image size {(H, W)} must be divisible by {self.downsample_factor}; resize or crop the image"
            )
        return self.quant_conv(self.encoder(img_B3HW.to(self.quant_conv.weight.dtype)))

    def _codebook(self) -> torch.Tensor:
        return self.quantize.embedding.weight.float()  # (V, Cvae)

    @torch.no_grad()  # inference path (the reference's training forward adds a straight-through estimator)
    def quantize_multiscale(
        self, f_BChw: torch.Tensor, schedule: Schedule | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Residual multi-scale quantisation of an encoder latent (var.md 2.6).

        Returns ``(idx_list, fhat_list)``: per scale the codes ``idx_Bl`` (LongTensor (B, h*w),
        row-major) and the cumulative float32 ``f_hat_BChw`` after that scale.
        """
        sched = self._schedule(schedule)
        if f_BChw.ndim != 4 or f_BChw.shape[1] != self.z_channels:
            raise ValueError(f"f_BChw must be B x {self.z_channels} x h x w, got shape {tuple(f_BChw.shape)}")
        B, C, H, W = f_BChw.shape
        if sched[-1] != (H, W):
            raise ValueError(
                f"schedule ends with {sched[-1]} but the latent is {(H, W)}; pass a schedule whose last "
                f"entry is the latent size (image size / {self.downsample_factor})"
            )
        SN = len(sched)
        codebook_VC = self._codebook()
        idx_list: list[torch.Tensor] = []
        fhat_list: list[torch.Tensor] = []
        with torch.autocast(device_type=f_BChw.device.type, enabled=False):
            f_rest_BChw = f_BChw.detach().float().clone()
            f_hat_BChw = torch.zeros_like(f_rest_BChw)
            emb_sq_V = codebook_VC.square().sum(dim=1)
            for si, (ph, pw) in enumerate(sched):
                if si != SN - 1:
                    z_BChw = F.interpolate(f_rest_BChw, size=(ph, pw), mode="area")
                else:
                    z_BChw = f_rest_BChw
                z_NC = z_BChw.permute(0, 2, 3, 1).reshape(-1, C)  # (B, C, ph, pw) -> (B*ph*pw, C) row-major
                d_NV = z_NC.square().sum(dim=1, keepdim=True) + emb_sq_V  # ||z||^2 + ||e||^2
                d_NV.addmm_(z_NC, codebook_VC.T, beta=1, alpha=-2)  # - 2 z.e
                idx_N = d_NV.argmin(dim=1)
                h_BChw = F.embedding(idx_N.view(B, ph, pw), codebook_VC).permute(0, 3, 1, 2)  # (B,ph,pw,C) -> (B,C,ph,pw)
                if si != SN - 1:
                    h_BChw = F.interpolate(h_BChw, size=(H, W), mode="bicubic", align_corners=False).contiguous()
                else:
                    h_BChw = h_BChw.contiguous()
                h_BChw = self.phi_or_identity(h_BChw, si, SN)
                f_hat_BChw.add_(h_BChw)
                f_rest_BChw.sub_(h_BChw)
                idx_list.append(idx_N.reshape(B, ph * pw))  # (B*ph*pw,) -> (B, ph*pw)
                fhat_list.append(f_hat_BChw.clone())
        return idx_list, fhat_list

    def img_to_idx(self, img_B3HW: torch.Tensor, schedule: Schedule | None = None) -> list[torch.Tensor]:
        """Images in [-1, 1] -> list of per-scale codes ``idx_Bl`` (LongTensor (B, h*w))."""
        idx_list, _ = self.quantize_multiscale(self.encode(img_B3HW), schedule)
        return idx_list

    # -------------------------------------------------------------------------------- codes -> f_hat
    def embed(self, idx_Bl: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Codebook lookup ``(B, h*w) -> (B, Cvae, h, w)`` (float32, row-major).

        The result is a (channels-last strided) view of the looked-up (B, h*w, Cvae) tensor, as in
        the reference; call ``.contiguous()`` if a flat NCHW buffer is needed.
        """
        if idx_Bl.ndim != 2 or idx_Bl.shape[1] != h * w:
            raise ValueError(f"idx_Bl must be (B, h*w) = (B, {h * w}) for (h, w)=({h}, {w}), got {tuple(idx_Bl.shape)}")
        B = idx_Bl.shape[0]
        e_BlC = F.embedding(idx_Bl, self._codebook())
        return e_BlC.transpose(1, 2).view(B, self.z_channels, h, w)  # (B, h*w, C) -> (B, C, h*w) -> (B, C, h, w)

    def _check_idx_list(self, idx_list: Sequence[torch.Tensor], sched: list[tuple[int, int]], allow_short: bool):
        n = len(idx_list)
        ok = n == len(sched) or (allow_short and n == len(sched) - 1)
        if not ok:
            raise ValueError(
                f"idx_list has {n} scales but the schedule has {len(sched)} ({sched}); pass the schedule the "
                f"codes were made with"
            )
        for si, idx_Bl in enumerate(idx_list):
            ph, pw = sched[si]
            if idx_Bl.ndim != 2 or idx_Bl.shape[1] != ph * pw:
                raise ValueError(
                    f"idx_list[{si}] has shape {tuple(idx_Bl.shape)} but scale {si} of the schedule is "
                    f"{(ph, pw)} -> expected (B, {ph * pw}); pass the schedule the codes were made with"
                )

    def idx_to_fhat(self, idx_list: Sequence[torch.Tensor], schedule: Schedule | None = None) -> torch.Tensor:
        """Codes of all scales -> cumulative float32 ``f_hat_BChw`` at the latent size (last entry)."""
        sched = self._schedule(schedule)
        self._check_idx_list(idx_list, sched, allow_short=False)
        SN = len(sched)
        H, W = sched[-1]
        B = idx_list[0].shape[0]
        with torch.autocast(device_type=idx_list[0].device.type, enabled=False):
            f_hat_BChw = torch.zeros(B, self.z_channels, H, W, dtype=torch.float32, device=idx_list[0].device)
            for si, (ph, pw) in enumerate(sched):
                h_BChw = self.embed(idx_list[si], ph, pw)
                if si != SN - 1:
                    h_BChw = F.interpolate(h_BChw, size=(H, W), mode="bicubic", align_corners=False)
                f_hat_BChw.add_(self.phi_or_identity(h_BChw, si, SN))
        return f_hat_BChw

    def idx_to_var_input(self, idx_list: Sequence[torch.Tensor], schedule: Schedule | None = None) -> torch.Tensor:
        """Teacher-forcing input ``x_BLCv_wo_first_l`` (B, L - first_l, Cvae), float32.

        For every scale si < SN-1 the cumulative f_hat (codes of scales 0..si) is area-downsampled to
        scale si+1 and flattened row-major. ``idx_list`` may hold all SN scales or only the first SN-1.
        """
        sched = self._schedule(schedule)
        self._check_idx_list(idx_list, sched, allow_short=True)
        SN = len(sched)
        H, W = sched[-1]
        B = idx_list[0].shape[0]
        dev = idx_list[0].device
        if SN == 1:
            return torch.zeros(B, 0, self.z_channels, dtype=torch.float32, device=dev)
        next_scales: list[torch.Tensor] = []
        with torch.autocast(device_type=dev.type, enabled=False):
            f_hat_BChw = torch.zeros(B, self.z_channels, H, W, dtype=torch.float32, device=dev)
            for si in range(SN - 1):
                ph, pw = sched[si]
                h_BChw = F.interpolate(self.embed(idx_list[si], ph, pw), size=(H, W), mode="bicubic",
                                       align_corners=False)
                f_hat_BChw.add_(self.apply_phi(h_BChw, si, SN))
                nh, nw = sched[si + 1]
                nxt_BChw = F.interpolate(f_hat_BChw, size=(nh, nw), mode="area")
                next_scales.append(nxt_BChw.reshape(B, self.z_channels, nh * nw).transpose(1, 2))  # (B,C,nh,nw) -> (B,nh*nw,C)
        return torch.cat(next_scales, dim=1)

    def next_stage_input(
        self, si: int, schedule: Schedule | None, f_hat_BChw: torch.Tensor, h_BChw: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One autoregressive inference step (reference ``get_next_autoregressive_input``).

        ``h_BChw`` holds the embeddings of the codes just sampled at scale ``si`` (size schedule[si]).
        Not last scale: ``f_hat += phi(bicubic_up(h -> latent size))`` **in place** and returns
        ``(f_hat, area_down(f_hat -> schedule[si+1]))``. Last scale: ``f_hat += phi(h)`` in place and
        returns ``(f_hat, f_hat)``. ``f_hat_BChw`` must be a float32 (B, Cvae, H, W) tensor.
        """
        sched = self._schedule(schedule)
        SN = len(sched)
        H, W = sched[-1]
        if not 0 <= int(si) < SN:
            raise ValueError(f"si must be in [0, {SN - 1}] for a {SN}-scale schedule, got {si}")
        si = int(si)
        if f_hat_BChw.ndim != 4 or tuple(f_hat_BChw.shape[1:]) != (self.z_channels, H, W):
            raise ValueError(
                f"f_hat_BChw must be B x {self.z_channels} x {H} x {W} (latent size = last schedule entry), "
                f"got {tuple(f_hat_BChw.shape)}"
            )
        if f_hat_BChw.dtype != torch.float32:
            raise ValueError(f"f_hat_BChw must be float32 (it accumulates in place), got {f_hat_BChw.dtype}")
        if h_BChw.ndim != 4 or tuple(h_BChw.shape[-2:]) != sched[si]:
            raise ValueError(f"h_BChw must be B x C x {sched[si][0]} x {sched[si][1]} at scale {si}, got {tuple(h_BChw.shape)}")
        with torch.autocast(device_type=f_hat_BChw.device.type, enabled=False):
            if si != SN - 1:
                up_BChw = F.interpolate(h_BChw.float(), size=(H, W), mode="bicubic", align_corners=False)
                f_hat_BChw.add_(self.apply_phi(up_BChw, si, SN))
                return f_hat_BChw, F.interpolate(f_hat_BChw, size=sched[si + 1], mode="area")
            f_hat_BChw.add_(self.phi_or_identity(h_BChw, si, SN))
            return f_hat_BChw, f_hat_BChw

    # -------------------------------------------------------------------------------- decode
    def fhat_to_img(self, f_hat_BChw: torch.Tensor) -> torch.Tensor:
        """``decoder(post_quant_conv(f_hat))`` clamped to [-1, 1] (new tensor; input untouched), in the
        weights' dtype. A bf16 / fp16 decoder on CUDA runs channels-last (the memory layout cuDNN's
        half-precision convolutions work in; channels-first they transpose around every call) with the
        fused GroupNorm + SiLU kernels and the convolutions' biases folded into them; the result is
        channels-first."""
        if f_hat_BChw.ndim != 4 or f_hat_BChw.shape[1] != self.z_channels:
            raise ValueError(f"f_hat_BChw must be B x {self.z_channels} x h x w, got {tuple(f_hat_BChw.shape)}")
        wdtype = self.post_quant_conv.weight.dtype
        z_BChw = self.post_quant_conv(f_hat_BChw.to(wdtype))
        if z_BChw.is_cuda and wdtype in (torch.bfloat16, torch.float16):
            z_BChw = z_BChw.contiguous(memory_format=torch.channels_last)
        return self.decoder(z_BChw).clamp(-1.0, 1.0).contiguous()

    def idx_to_img(self, idx_list: Sequence[torch.Tensor], schedule: Schedule | None = None) -> torch.Tensor:
        """Codes of all scales -> image in [-1, 1] (B, 3, 16h, 16w for the official model)."""
        return self.fhat_to_img(self.idx_to_fhat(idx_list, schedule))

    def forward(self, img_B3HW: torch.Tensor, schedule: Schedule | None = None) -> torch.Tensor:
        """Reconstruction through the tokenizer: encode, quantise all scales, decode; in [-1, 1]."""
        _, fhat_list = self.quantize_multiscale(self.encode(img_B3HW), schedule)
        return self.fhat_to_img(fhat_list[-1])
