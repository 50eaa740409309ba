"""HART (research/hart.md): the text-to-image transformer with llama-style blocks and its residual
diffusion head. Only what differs from the other families lives here; the tokenizer is VAR's
multi-scale VQVAE with its last scale outside φ (``MultiScaleVQVAE(phi_on_last=False)``, hart.md §4).

- Inputs: the text hidden states (T = ``context_token`` slots, pads included) through
  ``context_embed`` are the first step's tokens; image tokens are ``word_embed`` of the next-scale
  input. Every position adds a level embedding: a table row or, with ``use_timestep_embed``, a
  timestep embedder applied to the scale index (text = level 0).
- Blocks: pre-norm, one RMSNorm (``ln_wo_grad``) shared by both sub-layers; attention with bias
  [q_bias, 0, v_bias], RoPE (1-D on text positions, 2-D on image positions r·P/pn + o, c·P/pn + o
  with P the last patch number and o the last text position id), softmax scale 0.25/√d (or cosine
  attention with a learned temperature under ``attn_l2_norm``); SwiGLU. With AdaLN
  (``disable_aln=False``) a pooled text condition modulates both sub-layers.
- Head: AdaLN before the head from the max over the text embeddings, float32 logits.
- Diffusion head (``diffloss.net``): MAR's MLP with AdaLN predicting ε and the variance
  interpolation of the last scale's continuous residual, sampled by an 8-step respaced IDDPM.
- Engine adapter (``HARTAdapter``): the text runs as the engine's scale 0; the last scale's hidden
  states condition the diffusion head, so every policy hands over the full map there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from ..engine.adapter import ModelAdapter
from ._blocks import decode_graph_key, trunc_normal_init_, weight_ptrs, weights_key
from ..engine.contract import SubLayer, SubLayerContext
from ..engine.graphs import persistent_copy
from ..engine.kv_cache import KVCache
from ..engine.layers import LayerCall
from ..engine.sampling import sample_codes_per_image, takes_drawn_noise
from ..sparse_ops.ref import filter_top_k_top_p
from ..engine.schedule import ScaleSchedule
from ..engine.state import RunState
from ..engine.workspace import Workspace
from ..sparse_ops.attention import dense_attention
from ..sparse_ops.kernels import rms_norm, rope_rotate_half

HART_SCHEDULE_1024 = (1, 2, 3, 4, 5, 7, 9, 12, 16, 21, 27, 36, 48, 64)
# Sizes for models built with random weights (HARTPipeline.from_random): the release's best estimate
# (hart.md §1.3: depth 24, width 1536, 24 heads, 300 text slots of Qwen2-1.5B's 1536 channels) and a
# tiny one of the fixture's shape.
HART_PRESETS = {
    "hart-0.7b": dict(transformer=dict(), vqvae=dict(patch_nums=HART_SCHEDULE_1024)),
    "hart-tiny": dict(transformer=dict(vocab_size=1024, z_channels=8, context_token=12, context_dim=32, depth=2,
                                       embed_dim=64, num_heads=4, diff_width=32, diff_depth=2,
                                       patch_nums=(1, 2, 3, 4, 6, 8)),
                      vqvae=dict(vocab_size=1024, z_channels=8, ch=32, ch_mult=(1, 1, 2), patch_nums=(1, 2, 3, 4, 6, 8))),
}
ROPE_BASE = 10000.0
VAE_SCALE = 0.6                      # the diffusion head samples residual / 0.6


class RMSNorm(nn.Module):
    """RMSNorm with a weight (official key ``weight``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def sinusoid(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """(N, dim) [cos, sin] embedding of (N,) (possibly fractional) steps, frequencies
    exp(−ln(max_period)·i/(dim/2)) (DiT / MAR)."""
    half = dim // 2                      # made on t's device: no copy from the host (a captured graph runs this)
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    """sinusoid(256) → Linear → SiLU → Linear (keys ``mlp.0``, ``mlp.2``)."""

    def __init__(self, dim: int, freq_dim: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.freq_dim = freq_dim

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(sinusoid(t, self.freq_dim).to(self.mlp[0].weight.dtype))


# ---- RoPE -------------------------------------------------------------------------------------------
def rope_1d(pos_BT: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) (B, T, head_dim) float32 of 1-D positions: frequencies base^(−2i/d), [θ, θ]."""
    inv = 1.0 / (ROPE_BASE ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    ang = pos_BT.float()[..., None] * inv.to(pos_BT.device)                      # (B, T, d/2)
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos(), ang.sin()


def image_positions(patch_nums: Sequence[int], scales: Sequence[int], device) -> torch.Tensor:
    """(n, 2) float32 (row, col) positions of the tokens of ``scales`` (row-major), each scaled to the
    last patch number: (i / pn) · P (hart.md §2)."""
    P = patch_nums[-1]
    out = []
    for si in scales:
        pn = patch_nums[si]
        ar = torch.arange(pn, device=device)
        grid = torch.stack(torch.meshgrid(ar, ar, indexing="ij"), dim=-1)           # (pn, pn, 2) (row, col)
        out.append((grid / pn * P).reshape(-1, 2))
    return torch.cat(out)


def rope_2d(pos_Bn2: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) (B, n, head_dim) float32 of 2-D positions: frequencies base^(−4i/d), angles
    [r·f, r·f, c·f, c·f] (each d/4 long); applied with rotate-half over the whole head (hart.md §2:
    element j pairs with j + d/2, which holds the column angle — the release's layout)."""
    inv = 1.0 / (ROPE_BASE ** (torch.arange(0, head_dim, 4, dtype=torch.int64).float() / head_dim))
    ang = pos_Bn2.float()[..., None] * inv.to(pos_Bn2.device)                  # (B, n, 2, d/4)
    ang = torch.cat((ang, ang), dim=-1).flatten(-2)                              # (B, n, 2·d/2) rows then cols
    return ang.cos(), ang.sin()


# ---- blocks -------------------------------------------------------------------------------------------
class HARTAttention(nn.Module):
    """Keys ``qkv_proj.weight`` (3C, C, no bias), ``q_bias``, ``v_bias``, ``proj``; with l2-norm
    attention ``scale_mul_1H11``. The official ``zero_k_bias`` buffer is not kept."""

    def __init__(self, dim: int, num_heads: int, l2_norm: bool):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv_proj = nn.Linear(dim, 3 * dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.proj = nn.Linear(dim, dim)
        self.l2_norm = l2_norm
        if l2_norm:
            self.scale_mul_1H11 = nn.Parameter(torch.full((1, num_heads, 1, 1), math.log(4.0)))
        self.scale = 1.0 if l2_norm else 0.25 / math.sqrt(self.head_dim)

    def qkv(self, h_BLC: torch.Tensor, cos_BLd: torch.Tensor, sin_BLd: torch.Tensor):
        """q, k (RoPE applied; cosine-normalised under l2-norm attention, q times its temperature)
        and v, each (B, H, L, d)."""
        B, L, C = h_BLC.shape
        qkv = F.linear(h_BLC, self.qkv_proj.weight, self.qkv_bias()).view(B, L, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)                  # (B, L, 3, H, d) → 3 × (B, H, L, d)
        if self.l2_norm:
            q, k = self.cosine(q, k)
        return rope_rotate_half(q, cos_BLd, sin_BLd), rope_rotate_half(k, cos_BLd, sin_BLd), v

    def qkv_bias(self) -> torch.Tensor:
        """(3C,) the projection's bias: [q_bias, 0, v_bias]."""
        return torch.cat((self.q_bias, torch.zeros_like(self.q_bias), self.v_bias))

    def cosine(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """L2-normalised q (times its temperature, at most 100) and k (l2-norm attention)."""
        mult = self.scale_mul_1H11.clamp_max(math.log(100.0)).exp()
        return F.normalize(q, dim=-1) * mult, F.normalize(k, dim=-1)


class SwiGLU(nn.Module):
    """down(SiLU(gate(x)) · up(x)); keys ``gate_proj``, ``up_proj``, ``down_proj`` (no biases)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HARTBlock(nn.Module):
    """x += attn(norm(x)); x += ffn(norm(x)) with one RMSNorm; with AdaLN, (γ1, γ2, s1, s2, b1, b2)
    from ``ada_lin`` of the pooled condition modulate both."""

    def __init__(self, dim: int, num_heads: int, hidden: int, eps: float, adaln: bool, l2_norm: bool):
        super().__init__()
        self.attn = HARTAttention(dim, num_heads, l2_norm)
        self.ffn = SwiGLU(dim, hidden)
        self.ln_wo_grad = RMSNorm(dim, eps)
        if adaln:
            self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def modulation(self, cond_B1C: Optional[torch.Tensor]):
        """(γ1, γ2, s1, s2, b1, b2) each (B, 1, C), or None without AdaLN."""
        if not hasattr(self, "ada_lin"):
            return None
        C = self.ln_wo_grad.weight.shape[0]
        return self.ada_lin(cond_B1C).view(-1, 1, 6, C).unbind(2)

    def forward(self, x_BLC, cos, sin, mod=None, attn_mask=None):
        h = self.ln_wo_grad(x_BLC)
        if mod is not None:
            h = h * (mod[2] + 1) + mod[4]
        q, k, v = self.attn.qkv(h, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.attn.scale)
        a = self.attn.proj(o.transpose(1, 2).reshape(x_BLC.shape))          # (B, H, L, d) → (B, L, C)
        x_BLC = x_BLC + (a * mod[0] if mod is not None else a)
        h = self.ln_wo_grad(x_BLC)
        if mod is not None:
            h = h * (mod[3] + 1) + mod[5]
        f = self.ffn(h)
        return x_BLC + (f * mod[1] if mod is not None else f)


class AdaLNBeforeHead(nn.Module):
    """RMSNorm(x)·(1 + scale) + shift, (scale, shift) = ada_lin(condition); keys ``ln_wo_grad``,
    ``ada_lin.1``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.ln_wo_grad = RMSNorm(dim, eps)
        self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def modulation(self, cond_B1C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, shift), each (B, 1, C), of the condition."""
        return self.ada_lin(cond_B1C).view(-1, 1, 2, cond_B1C.shape[-1]).unbind(2)

    def forward(self, x_BLC: torch.Tensor, mod: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        scale, shift = mod
        return self.ln_wo_grad(x_BLC) * (scale + 1) + shift


# ---- the diffusion head ----------------------------------------------------------------------------
class _ResBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.in_ln = nn.LayerNorm(width, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 3 * width))

    def forward(self, x, silu_y):
        """x + gate · mlp(LN(x)·(1 + scale) + shift), (shift, scale, gate) from SiLU(y) (computed once
        for every block)."""
        shift, scale, gate = self.adaLN_modulation[1](silu_y).chunk(3, dim=-1)
        return x + gate * self.mlp(self.in_ln(x) * (1 + scale) + shift)


class _FinalLayer(nn.Module):
    eps = 1e-6                                   # its LayerNorm's (no affine)

    def __init__(self, width: int, out: int):
        super().__init__()
        self.linear = nn.Linear(width, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))

    def forward(self, x, silu_y):
        shift, scale = self.adaLN_modulation[1](silu_y).chunk(2, dim=-1)
        return self.linear(F.layer_norm(x, (x.shape[-1],), eps=self.eps) * (1 + scale) + shift)


class DiffusionMLP(nn.Module):
    """MAR's SimpleMLPAdaLN (keys ``time_embed``, ``cond_embed``, ``input_proj``, ``res_blocks.k``,
    ``final_layer``): (x (N, Cvae), original timestep t (N,), condition z (N, C)) → (N, 2·Cvae) =
    [ε, variance interpolation v]."""

    def __init__(self, z_channels: int, cond_dim: int, width: int, depth: int):
        super().__init__()
        self.time_embed = TimestepEmbedder(width)
        self.cond_embed = nn.Linear(cond_dim, width)
        self.input_proj = nn.Linear(z_channels, width)
        self.res_blocks = nn.ModuleList(_ResBlock(width) for _ in range(depth))
        self.final_layer = _FinalLayer(width, 2 * z_channels)

    def forward(self, x_NC: torch.Tensor, t_N: torch.Tensor, z_NC: torch.Tensor, fused=None) -> torch.Tensor:
        """``fused``: a ``token_residual_norm_modulate`` (sparse_ops.kernels) that runs each block's
        gated residual with the next block's LayerNorm and AdaLN in one step; None: the modules'
        own steps (the reference's order of operations)."""
        x = self.input_proj(x_NC)
        silu_y = F.silu(self.time_embed(t_N) + self.cond_embed(z_NC))      # every block's AdaLN input
        if fused is None:
            for block in self.res_blocks:
                x = block(x, silu_y)
            return self.final_layer(x, silu_y)
        h = gate = None
        for block in self.res_blocks:
            shift, scale, next_gate = block.adaLN_modulation[1](silu_y).chunk(3, dim=-1)
            x, y = fused(x, h, gate, scale, shift, block.in_ln.weight, block.in_ln.bias, block.in_ln.eps, x.dtype)
            h, gate = block.mlp(y), next_gate
        shift, scale = self.final_layer.adaLN_modulation[1](silu_y).chunk(2, dim=-1)
        _, y = fused(x, h, gate, scale, shift, None, None, self.final_layer.eps, x.dtype)
        return self.final_layer.linear(y)


class _DiffLoss(nn.Module):
    """The official container of the diffusion MLP (key prefix ``diffloss.net``)."""

    def __init__(self, net: DiffusionMLP):
        super().__init__()
        self.net = net


class RespacedIDDPM:
    """The 1000-step cosine IDDPM schedule respaced to ``steps`` evenly spread original steps
    (improved-diffusion's section rule, one section), as float64 tables (hart.md §5)."""

    def __init__(self, steps: int, num_timesteps: int = 1000):
        if steps < 1 or steps > num_timesteps:
            raise ValueError(f"num_sampling_steps={steps}: use 1 … {num_timesteps}")

        def alpha_bar(t):
            return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

        betas = np.array([min(1 - alpha_bar((i + 1) / num_timesteps) / alpha_bar(i / num_timesteps), 0.999)
                          for i in range(num_timesteps)], dtype=np.float64)
        stride = (num_timesteps - 1) / (steps - 1) if steps > 1 else 1
        self.timesteps = sorted({round(i * stride) for i in range(steps)})
        acp = np.cumprod(1.0 - betas)
        new_betas, last = [], 1.0
        for i in self.timesteps:
            new_betas.append(1 - acp[i] / last)
            last = acp[i]
        b = np.array(new_betas, dtype=np.float64)
        a = np.cumprod(1.0 - b)
        a_prev = np.append(1.0, a[:-1])
        post_var = b * (1.0 - a_prev) / (1.0 - a)
        self.betas = b
        self.sqrt_recip = np.sqrt(1.0 / a)
        self.sqrt_recipm1 = np.sqrt(1.0 / a - 1)
        self.log_var_min = np.log(np.append(post_var[1], post_var[1:])) if len(b) > 1 else np.log(post_var)
        self.log_var_max = np.log(b)
        self.coef1 = b * np.sqrt(a_prev) / (1.0 - a)
        self.coef2 = (1.0 - a_prev) * np.sqrt(1.0 - b) / (1.0 - a)

    @staticmethod
    def at(table: np.ndarray, i: int) -> float:
        """Entry ``i`` of a float64 table as the reference reads it (float64 → float32), a Python
        number: it multiplies float32 tensors as the reference's float32 scalar tensor does, and it
        needs no copy to the device (a captured graph runs the sampler)."""
        return float(np.float32(table[i]))


def sample_residual(net: DiffusionMLP, schedule: RespacedIDDPM, z_cond_NC: torch.Tensor,
                    z_uncond_NC: Optional[torch.Tensor], guidance: float, noise_init_NC: torch.Tensor,
                    noise_steps: Sequence[torch.Tensor], temperature: float = 1.0, fused=None) -> torch.Tensor:
    """The continuous residual of N last-scale tokens (N, Cvae), already × 0.6 (hart.md §5).

    With ``z_uncond_NC`` (guidance), each step runs the net on [x; x] with [z_cond; z_uncond],
    guides ε = (1 + t)·ε_cond − t·ε_uncond and keeps the conditional half's variance value; without,
    the net runs on x with z_cond alone. ``noise_steps``: one (N, Cvae) draw per reverse step, in
    loop order (the last is unused). ``fused``: see :meth:`DiffusionMLP.forward`."""
    x = noise_init_NC.float()
    C = x.shape[1]
    dev = x.device
    dt = net.input_proj.weight.dtype                   # the net in its weights' dtype; the sampler in float32
    z_NC = (torch.cat((z_cond_NC, z_uncond_NC)) if z_uncond_NC is not None else z_cond_NC).to(dt)
    for i in reversed(range(len(schedule.timesteps))):
        t_N = torch.full((x.shape[0],), schedule.timesteps[i], device=dev, dtype=torch.int64)
        if z_uncond_NC is not None:
            out = net(torch.cat((x, x)).to(dt), t_N.repeat(2), z_NC, fused).float()
            eps_c, eps_u = out[:, :C].chunk(2)
            eps, v = eps_c * (1 + guidance) - guidance * eps_u, out[:x.shape[0], C:]
        else:
            out = net(x.to(dt), t_N, z_NC, fused).float()
            eps, v = out[:, :C], out[:, C:]
        x0 = (schedule.at(schedule.sqrt_recip, i) * x - schedule.at(schedule.sqrt_recipm1, i) * eps).clamp(-1, 1)
        mean = schedule.at(schedule.coef1, i) * x0 + schedule.at(schedule.coef2, i) * x
        frac = (v + 1) / 2
        log_var = frac * schedule.at(schedule.log_var_max, i) + (1 - frac) * schedule.at(schedule.log_var_min, i)
        x = mean + (float(i != 0) * torch.exp(0.5 * log_var) * noise_steps[len(schedule.timesteps) - 1 - i].float()
                    * temperature)
    return x * VAE_SCALE


# ---- the transformer ---------------------------------------------------------------------------------
class HARTTransformer(ModelMixin, ConfigMixin):
    """HART's transformer with its diffusion head (official key layout; the derived buffers
    ``lvl_1L``, ``attn_bias_for_masking`` and ``blocks.N.attn.zero_k_bias`` are not kept).

    Args:
        vocab_size, z_channels: the tokenizer's codebook size V and code dimension Cvae.
        context_token, context_dim: text slots T (300 in the release) and the text encoder width.
        depth, embed_dim, num_heads, mlp_ratio, norm_eps: transformer size (release, best estimate:
            24, 1536, 24, 4, 1e-6; hart.md §1.3).
        use_timestep_embed: level embedding by a timestep embedder (else a table).
        disable_aln: plain pre-norm blocks (the release); False adds AdaLN from the pooled text.
        sep_aln_pooling_mode: "max" or "avg" (mask-weighted) pooling of the text for AdaLN blocks.
        attn_l2_norm: cosine attention with a learned temperature per head.
        diff_width, diff_depth, num_sampling_steps: the diffusion MLP and its sampler's steps.
        patch_nums: the square schedule (the release: ``HART_SCHEDULE_1024``).
    """

    @register_to_config
    def __init__(self, vocab_size: int = 4096, z_channels: int = 32, context_token: int = 300,
                 context_dim: int = 1536, depth: int = 24, embed_dim: int = 1536, num_heads: int = 24,
                 mlp_ratio: float = 4.0, norm_eps: float = 1e-6, use_timestep_embed: bool = True,
                 disable_aln: bool = True, sep_aln_pooling_mode: str = "max", attn_l2_norm: bool = False,
                 diff_width: int = 1024, diff_depth: int = 6, num_sampling_steps: int = 8,
                 patch_nums: Sequence[int] = HART_SCHEDULE_1024):
        super().__init__()
        if embed_dim % num_heads or (embed_dim // num_heads) % 4:
            raise ValueError(f"embed_dim={embed_dim} with num_heads={num_heads}: the head dim must be a multiple "
                             f"of 4 (2-D RoPE)")
        if sep_aln_pooling_mode not in ("max", "avg"):
            raise ValueError(f"sep_aln_pooling_mode={sep_aln_pooling_mode!r}: use 'max' or 'avg'")
        C = embed_dim
        self.schedule = ScaleSchedule.square(patch_nums)
        hidden = int((C * mlp_ratio * 2) / 3 + 255) // 256 * 256
        self.word_embed = nn.Linear(z_channels, C)
        self.context_embed = nn.Linear(context_dim, C)
        self.lvl_embed = TimestepEmbedder(C) if use_timestep_embed else nn.Embedding(len(patch_nums), C)
        self.blocks = nn.ModuleList(HARTBlock(C, num_heads, hidden, norm_eps, not disable_aln, attn_l2_norm)
                                    for _ in range(depth))
        self.head_nm = AdaLNBeforeHead(C, norm_eps)
        self.head = nn.Linear(C, vocab_size)
        self.decoder_norm = RMSNorm(C, norm_eps)
        self.diffloss = _DiffLoss(DiffusionMLP(z_channels, C, diff_width, diff_depth))
        self.head_dim = C // num_heads
        self.sampler = RespacedIDDPM(int(num_sampling_steps))

    def init_random_weights(self, std: float = 0.02) -> "HARTTransformer":
        """Random weights for a model built by size (benchmarks, smoke tests): trunc-normal linears and
        embeddings, zero biases, unit norms. Not the official training init; draws noise."""
        trunc_normal_init_(self, std)
        for m in self.modules():
            if isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
            elif isinstance(m, nn.LayerNorm) and m.elementwise_affine:
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, HARTAttention):
                nn.init.zeros_(m.q_bias)
                nn.init.zeros_(m.v_bias)
                if m.l2_norm:                                  # (built on meta: not set otherwise)
                    nn.init.constant_(m.scale_mul_1H11, math.log(4.0))
        return self

    def set_block_dtype(self, dtype: torch.dtype) -> "HARTTransformer":
        """The blocks and the diffusion head's net in ``dtype`` (bf16 on GPUs; the reference runs
        everything under fp16 autocast); with a half-precision ``dtype`` the head's product in float16
        (as under the reference's autocast), its AdaLN norm in float32; the embeddings,
        ``decoder_norm`` and the diffusion sampler's arithmetic stay float32."""
        torch.nn.Module.to(self, torch.float32)
        torch.nn.Module.to(self.blocks, dtype)
        torch.nn.Module.to(self.diffloss, dtype)
        if dtype in (torch.float16, torch.bfloat16):
            torch.nn.Module.to(self.head, torch.float16)
        return self

    weights_key = weights_key                    # (models/_blocks.py)

    @staticmethod
    def official_extra_keys(depth: int) -> set:
        """Official buffers this module rebuilds instead of loading."""
        return {"lvl_1L", "attn_bias_for_masking"} | {f"blocks.{i}.attn.zero_k_bias" for i in range(depth)}

    # ---- pieces the generation loop uses ------------------------------------------------------------
    def level_embedding(self, levels: torch.Tensor) -> torch.Tensor:
        """(n, C) level embedding of the (n,) integer levels (text = 0, scale k = k): a table row or
        the timestep embedder of the level."""
        return self.lvl_embed(levels)

    def text_condition(self, context_BTD: torch.Tensor) -> torch.Tensor:
        """(B, T, C) ``context_embed`` of the text hidden states (the first step's tokens and the
        head's condition)."""
        return self.context_embed(context_BTD)

    def block_condition(self, cond_BTC: torch.Tensor, mask_BT: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """(B, 1, C) pooled text for AdaLN blocks (None without AdaLN)."""
        if self.config.disable_aln:
            return None
        if self.config.sep_aln_pooling_mode == "max":
            return cond_BTC.max(1, keepdim=True).values
        m = mask_BT.to(cond_BTC.dtype)[..., None]
        return ((cond_BTC * m).sum(1) / m.sum(1).clamp(min=1))[:, None]

    def head_modulation(self, cond_BTC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's AdaLN (scale, shift) from the max over the text embeddings (once per generation)."""
        return self.head_nm.modulation(cond_BTC.float().max(1, keepdim=True).values)

    def logits(self, x_BLC: torch.Tensor, head_mod: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Float32 logits (B, L, V) with the head's AdaLN ``head_mod`` (:meth:`head_modulation`), the
        product in the head's dtype."""
        return self.head(self.head_nm(x_BLC.float(), head_mod).to(self.head.weight.dtype)).float()

    def image_rope(self, scales: Sequence[int], offset_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) (B, n, d) of the image tokens of ``scales``, positions offset by each row's last
        text position id."""
        pos_n2 = image_positions([h for h, _ in self.schedule.hw], scales, offset_B.device)
        return rope_2d(pos_n2[None] + offset_B[:, None, None], self.head_dim)

    # ---- teacher forcing (parity tests) --------------------------------------------------------------
    def forward(self, context_BTD: torch.Tensor, x_BLCv: torch.Tensor, context_position_ids_BT: torch.Tensor,
                context_mask_BT: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Teacher-forced logits (B, L, V) over the whole sequence (text, then scales 1…) with the
        block-causal mask by level; row 0 is read at the last text slot (it predicts scale 0)."""
        B, T, _ = context_BTD.shape
        S = self.schedule.num_scales
        cond_BTC = self.text_condition(context_BTD)
        levels = torch.cat([torch.zeros(T, dtype=torch.long)] +
                           [torch.full((self.schedule.tokens(si),), si) for si in range(1, S)]).to(
            context_BTD.device)
        x = torch.cat((cond_BTC, self.word_embed(x_BLCv.float())), dim=1) + self.level_embedding(levels)[None]
        cos_t, sin_t = rope_1d(context_position_ids_BT, self.head_dim)
        cos_i, sin_i = self.image_rope(range(1, S), context_position_ids_BT[:, -1].float())
        cos, sin = torch.cat((cos_t, cos_i), 1), torch.cat((sin_t, sin_i), 1)
        mask = levels[:, None] >= levels[None, :]                          # block-causal by level
        cond = self.block_condition(cond_BTC, context_mask_BT)
        for block in self.blocks:
            x = block(x, cos, sin, block.modulation(cond), attn_mask=mask)
        return self.logits(x[:, T - 1:], self.head_modulation(cond_BTC))


# ---- the engine adapter -----------------------------------------------------------------------------
REFERENCE_TOP_K = ((7, 600), (None, 300))    # top-k 600 below scale index 7, then 300 (the reference's rule)


@dataclass(frozen=True)
class HARTConditioning:
    """What one generation is conditioned on: the text encoder's last hidden states of the B prompts
    (B, T, D) with their validity mask and HART's position ids (cumsum(mask) − 1, pads repeating the
    last), and optionally the diffusion head's noise ((B·P², Cvae) start, one (B·P², Cvae) draw per
    reverse step) instead of drawing it from the generator (parity tests).

    smooth: the reference's ``more_smooth`` (its demo default): the latent takes a Gumbel-softmax
    mixture of the codebook from the top-k/top-p filtered logits (temperature
    max(0.27·(1 − 0.95·ratio), 0.005)), drawn after each scale's codes from the same generator;
    the diffusion head is still conditioned on the drawn code."""

    context_BTD: torch.Tensor
    position_ids_BT: torch.Tensor
    mask_BT: torch.Tensor
    diffusion_noise: Optional[tuple] = None
    smooth: bool = False


class _HARTCall(LayerCall):
    """Where a HART block runs: the layer's norm modulation (gate₁, mul₁, shift₁, gate₂, mul₂, shift₂),
    float32 (R or 1, 1, C), the RMSNorm weight folded into each mul; and the RoPE of the scale's
    tokens."""

    __slots__ = ("mod", "rope")

    def __init__(self, kv, si, layer, run, ops, pos, valid_Rl, record, mod, rope):
        super().__init__(kv, si, layer, run, ops, pos, valid_Rl, record)
        self.mod, self.rope = mod, rope


class _HARTWorkspace(Workspace):
    """The buffers of one batch size: KV cache (text slots, then every image scale), the latent,
    the next scale's input, the text embeddings, every row's RoPE tables and the last scale's hidden
    states (the diffusion head's condition)."""

    def __init__(self, model: HARTTransformer, batch: int, schedule: ScaleSchedule, device, dtype, kv_slots=None,
                 kv_tail: bool = False):
        super().__init__(device, schedule.total_tokens)
        cfg = model.config
        R, L = 2 * batch, schedule.total_tokens
        self.kv = KVCache.for_schedule(cfg.depth, R, cfg.num_heads, model.head_dim,
                                       [schedule.tokens(si) for si in range(schedule.num_scales)], dtype, device,
                                       kv_slots, kv_tail)
        P = cfg.patch_nums[-1]
        self.f_hat = torch.zeros(batch, cfg.z_channels, P, P, device=device, dtype=torch.float32)
        self.next_BLC = torch.zeros(batch, L, cfg.z_channels, device=device, dtype=torch.float32)
        self.cond_RTC: Optional[torch.Tensor] = None
        self.cos_RLd: Optional[torch.Tensor] = None
        self.sin_RLd: Optional[torch.Tensor] = None
        self.norm_mods: list = []      # per layer, _HARTCall.mod's six tensors (held)
        self.head_mod: Optional[tuple] = None
        self.levels_SC: Optional[torch.Tensor] = None
        self.qkv_bias: list = []       # per layer, [q_bias, 0, v_bias] (held)
        self.weights = None            # the weights_key qkv_bias and levels_SC were computed from
        self.held: dict = {}           # (name, shape) → the buffer the fields above point into (graphs read them)
        self.last_hidden: dict = {}    # rows → the last scale's hidden states (the diffusion head's condition)

    def hold(self, name, t: torch.Tensor) -> torch.Tensor:
        """``t`` copied into this workspace's buffer for (``name``, its shape): the same address in
        every generation, as a captured scale's compute reads it."""
        return persistent_copy(self.held, (name, tuple(t.shape), t.dtype), t)


class HARTAdapter(ModelAdapter):
    """The engine's view of a HART transformer + its hybrid tokenizer (engine/adapter.py).

    The engine's schedule holds the text as scale 0 (1 × T tokens: the step-0 input, whose last
    slot predicts the 1×1 code), then the image scales. Rows are [cond (B); uncond (B)]; the
    unconditional text is zeros (its embedding the bias) at position 0. Guidance ramps with the
    scale: t = cfg·si/(S−1), the last scale reusing (S−2)/(S−1); guided = (1 + t)·cond − t·uncond.
    ``top_k`` 0 samples with the reference's rule (600 below scale 7, then 300)."""

    family = "hart"
    supports_scale_graphs = True

    def __init__(self, transformer: HARTTransformer, vqvae):
        cfg = transformer.config
        if vqvae.phi_on_last:
            raise ValueError("HART's tokenizer keeps its last scale out of φ: build the VQVAE with phi_on_last=False")
        if tuple(vqvae.patch_nums) != tuple(cfg.patch_nums):
            raise ValueError(f"the tokenizer's schedule {tuple(vqvae.patch_nums)} is not the transformer's "
                             f"{tuple(cfg.patch_nums)}")
        hw = ((1, cfg.context_token),) + tuple((p, p) for p in cfg.patch_nums[1:])
        super().__init__(transformer, ScaleSchedule(hw), transformer.blocks)
        self.vqvae = vqvae
        self.image_schedule = transformer.schedule
        # the last scale's K/V in one buffer shared by the layers (ModelAdapter.kv_tail_used) where that
        # makes the cache smaller: the tail holds one layer's whole cache, the layers lose the last scale.
        # The release size at 1024²: 4096 of 9751 slots, 1.8 GB of cache instead of 2.9 (bf16, CFG), for
        # one copy of each layer's earlier keys at the last scale
        last = self.schedule.tokens(self.schedule.num_scales - 1)
        self.kv_tail = self.schedule.total_tokens < cfg.depth * last

    @property
    def device(self) -> torch.device:
        return self.transformer.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.blocks[0].attn.qkv_proj.weight.dtype

    # ---- adapter interface ----------------------------------------------------------------------
    @torch.no_grad()
    def begin(self, run: RunState, cond: HARTConditioning) -> None:
        m, B, dev = self.transformer, run.batch_size, self.device
        if not isinstance(cond, HARTConditioning):
            raise TypeError(f"HART conditioning must be a HARTConditioning, got {type(cond).__name__}")
        T = m.config.context_token
        if tuple(cond.context_BTD.shape[:2]) != (B, T):
            raise ValueError(f"context of shape {tuple(cond.context_BTD.shape)}: need ({B}, {T}, D) for {B} images")
        # captured graphs hold the weights' addresses: a model moved away and back has new storage (the
        # scales' graphs read the tokenizer's codebook and φ too)
        tail = self.kv_tail_used(self.schedule, 2 * B, run.kv_slots)
        key = (B, dev, self.dtype, weight_ptrs(m), weight_ptrs(self.vqvae), run.kv_slots, tail)
        ws = self.workspace(key, lambda: _HARTWorkspace(m, B, self.schedule, dev, self.dtype, run.kv_slots, tail))
        run.cfg_active = float(run.settings.guidance_scale) != 0.0
        ctx = cond.context_BTD.to(dev, torch.float32)
        pos_BT = cond.position_ids_BT.to(dev)
        mask_BT = cond.mask_BT.to(dev)
        if run.cfg_active:
            unc_mask = torch.zeros_like(mask_BT)
            unc_mask[:, 0] = True
            ctx, pos_BT = torch.cat((ctx, torch.zeros_like(ctx))), torch.cat((pos_BT, torch.zeros_like(pos_BT)))
            mask_BT = torch.cat((mask_BT, unc_mask))
        # everything a scale's compute reads goes into the workspace's held buffers (fixed addresses)
        ws.cond_RTC = ws.hold("cond", m.text_condition(ctx.to(m.context_embed.weight.dtype)).float())
        cos_t, sin_t = rope_1d(pos_BT, m.head_dim)
        cos_i, sin_i = m.image_rope(range(1, self.image_schedule.num_scales), pos_BT[:, -1].float())
        ws.cos_RLd = ws.hold("cos", torch.cat((cos_t, cos_i), 1))
        ws.sin_RLd = ws.hold("sin", torch.cat((sin_t, sin_i), 1))
        pooled = m.block_condition(ws.cond_RTC, mask_BT)
        ws.head_mod = tuple(ws.hold(("head", j), t) for j, t in enumerate(m.head_modulation(ws.cond_RTC)))
        # what depends on the weights alone is computed again only when they changed (a new in-place
        # version; parameters made under inference mode keep no version: every call)
        weights, versioned = m.weights_key()
        refresh = not versioned or ws.weights != weights
        if refresh:
            ws.qkv_bias = [ws.hold(("qkv_bias", i), blk.attn.qkv_bias()) for i, blk in enumerate(m.blocks)]
            ws.levels_SC = ws.hold("levels", m.level_embedding(torch.arange(self.schedule.num_scales,
                                                                            device=dev)).float())
            ws.weights = weights if versioned else None
        if refresh or pooled is not None:                  # with AdaLN they depend on the condition too
            ws.norm_mods = [tuple(ws.hold(("norm_mod", i, j), t) for j, t in enumerate(self._norm_mod(blk, pooled)))
                            for i, blk in enumerate(self.streamed_blocks())]
        ws.f_hat.zero_()
        ws.kv.reset()
        if not run.cfg_active:
            ws.kv.keep_rows(B)
        run.model_state.update(diffusion_noise=cond.diffusion_noise, smooth=bool(cond.smooth), hard_BlC=None)
        run.workspace = ws

    def stage_input(self, si: int, run: RunState) -> torch.Tensor:
        """(R, l, C) float32: the text embeddings at scale 0, else the word embedding of the next-scale
        input; plus the level embedding."""
        ws, R, B, m = run.workspace, run.rows, run.batch_size, self.transformer
        lvl = ws.levels_SC[si]                                                          # (C,)
        if si == 0:
            return ws.cond_RTC[:R] + lvl
        start, end = run.schedule.offsets[si], run.schedule.offsets[si + 1]
        x_BlC = m.word_embed(ws.next_BLC[:, start:end].to(m.word_embed.weight.dtype)).float() + lvl
        return x_BlC.repeat(R // B, 1, 1)

    def chains_layers(self) -> bool:
        return self.ops.kind != "torch"

    def chains_into_head(self) -> bool:
        return False

    def _norm_mod(self, blk: HARTBlock, pooled: Optional[torch.Tensor]) -> tuple:
        """(gate₁, mul₁, shift₁, gate₂, mul₂, shift₂) float32 of a block: mul = w·(1 + s) with w the
        RMSNorm weight, so that every norm runs as ``RMSNorm(x)·mul + shift`` (shape (R, 1, C) with
        AdaLN, else (1, 1, C): gates 1, shifts 0)."""
        w = blk.ln_wo_grad.weight.float().view(1, 1, -1)
        mod = None if pooled is None else blk.modulation(pooled.to(self.dtype))
        if mod is None:
            ones, zeros = torch.ones_like(w), torch.zeros_like(w)
            return ones, w, zeros, ones, w, zeros
        g1, g2, s1, s2, b1, b2 = (t.float() for t in mod)
        return g1, w * (s1 + 1), b1, g2, w * (s2 + 1), b2

    def scale_constants(self, si: int, run: RunState, pos: torch.Tensor):
        """The RoPE (cos, sin) (R, l, d) of the scale's tokens, which every layer shares."""
        return self._rope(run, pos)

    def _rope(self, run: RunState, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) (R, l, d) of positions (l,) shared by the rows or (R, n) per row."""
        ws, R = run.workspace, run.rows
        if pos.dim() == 1:
            return ws.cos_RLd[:R, pos], ws.sin_RLd[:R, pos]
        idx = pos[..., None].expand(-1, -1, ws.cos_RLd.shape[-1])
        return ws.cos_RLd[:R].gather(1, idx), ws.sin_RLd[:R].gather(1, idx)

    def layer_call(self, si: int, i: int, run: RunState, pos, valid_Rn, record: bool, shared) -> _HARTCall:
        ws = run.workspace
        return _HARTCall(ws.kv, si, i, run, self.ops, pos, valid_Rn, record, self._mods(i, run), shared)

    @staticmethod
    def _mods(i: int, run: RunState) -> tuple:
        return tuple(t[:run.rows] for t in run.workspace.norm_mods[i])

    def _attend(self, i: int, y_RnC: torch.Tensor, call: _HARTCall, idx_Rn=None) -> torch.Tensor:
        """Self-attention of block ``i`` up to its output projection: q/k/v of the modulated tokens
        ``y_RnC`` (the layer's or the subset ``idx_Rn`` of them), RoPE, the KV-cache write and the
        attention over the cache (a policy's, else dense): (R, n, C) in the blocks' dtype."""
        attn, run = self.blocks[i].attn, call.run
        R, n, C = y_RnC.shape
        pos, valid = call.positions(idx_Rn)
        cos, sin = call.rope if idx_Rn is None else self._rope(run, pos)      # a subset: its own rows
        qkv = self.ops.linear(y_RnC, attn.qkv_proj.weight, run.workspace.qkv_bias[i])
        qkv = qkv.view(R, n, 3, attn.num_heads, attn.head_dim)                      # (R, n, 3C) → (R, n, 3, H, d)
        if attn.l2_norm:                  # cosine attention: q (× its temperature) and k normalised before RoPE
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)                          # → 3 × (R, H, n, d)
            q, k = attn.cosine(q, k)
            qkv = torch.stack((q, k.to(q.dtype), v), dim=2).transpose(1, 3)        # (R, H, 3, n, d) → (R, n, 3, H, d)
        k_dst, v_dst = call.reserve(n, idx_Rn, pos, valid)
        # the temperature folded into q: attention at scale 1
        q = self.ops.rope_half_store(qkv, cos, sin, attn.scale, k_dst, v_dst)
        K, V = call.kv.view(call.layer)
        out = None
        if run.hooks.attends(call.layer):
            out = run.policies.attention(SubLayerContext(call.si, call.layer, "self_attn"), q, K, V, run)
        if out is None:
            out = dense_attention(q, K, V, scale=1.0, attn_mask=call.kv.key_mask(call.layer))
        return out.transpose(1, 2).reshape(R, n, C).to(self.dtype)                 # (R, H, n, d) → (R, n, C)

    def _ffn_hidden(self, i: int, y_RnC: torch.Tensor) -> torch.Tensor:
        """SiLU(gate(y)) · up(y): SwiGLU up to its down projection."""
        f, ops = self.blocks[i].ffn, self.ops
        return ops.silu_mul(ops.linear(y_RnC, f.gate_proj.weight), ops.linear(y_RnC, f.up_proj.weight))

    def layer(self, i: int, x_RlC: torch.Tensor, call: _HARTCall) -> torch.Tensor:
        blk, ops = self.blocks[i], self.ops
        g1, m1, b1, g2, m2, b2 = call.mod
        eps, wdtype = blk.ln_wo_grad.eps, self.dtype

        def modulate(x, mul, shift):
            return ops.modulate(x, mul, shift, eps, wdtype, rms=True)

        def attn_branch(y_RnC, idx_Rn=None):
            return ops.linear(self._attend(i, y_RnC, call, idx_Rn), blk.attn.proj.weight, blk.attn.proj.bias)

        def ffn_branch(y_RnC, idx_Rn=None):
            return ops.linear(self._ffn_hidden(i, y_RnC), blk.ffn.down_proj.weight)

        add, run = ops.gated_residual, call.run
        if run.hooks.wraps(i):
            stack = run.policies
            x_RlC = stack.wrap_sublayer(SubLayer(SubLayerContext(call.si, i, "self_attn"), m1, b1, g1, attn_branch,
                                                 modulate, add), x_RlC, run)
            return stack.wrap_sublayer(SubLayer(SubLayerContext(call.si, i, "ffn"), m2, b2, g2, ffn_branch, modulate,
                                                add), x_RlC, run)
        x_RlC = add(x_RlC, attn_branch(modulate(x_RlC, m1, b1)), g1)
        return add(x_RlC, ffn_branch(modulate(x_RlC, m2, b2)), g2)

    def chain_input(self, i: int, x_RlC: torch.Tensor, run: RunState) -> torch.Tensor:
        _, m1, b1, *_ = self._mods(i, run)
        return self.ops.modulate(x_RlC, m1, b1, self.blocks[i].ln_wo_grad.eps, self.dtype, rms=True)

    def chained_layer(self, i: int, x_RlC: torch.Tensor, y_RlC: torch.Tensor, chain_next: bool, call: _HARTCall):
        """The dense path of block ``i`` without sub-layer wrappers: ``y_RlC`` is its modulated
        attention input; each output projection runs with its residual add and the next norm
        (the FFN's, then the next block's when ``chain_next``). Returns (x, the next block's
        attention input or None)."""
        blk, ops = self.blocks[i], self.ops
        g1, _, _, g2, m2, b2 = call.mod
        eps, wdtype = blk.ln_wo_grad.eps, self.dtype
        attn, down = blk.attn, blk.ffn.down_proj.weight
        x_RlC, y_RlC = ops.linear_residual_modulate(self._attend(i, y_RlC, call), attn.proj.weight, attn.proj.bias,
                                                    x_RlC, g1, m2, b2, eps, wdtype, rms=True)
        h_RlH = self._ffn_hidden(i, y_RlC)
        if not chain_next:
            return ops.gated_residual(x_RlC, ops.linear(h_RlH, down), g2), None
        _, m1_next, b1_next, *_ = self._mods(i + 1, call.run)
        return ops.linear_residual_modulate(h_RlH, down, None, x_RlC, g2, m1_next, b1_next, eps, wdtype, rms=True)

    def head(self, x_RLC: torch.Tensor, run: RunState, modulated: bool = False) -> torch.Tensor:
        """Float32 logits: at scale 0 of the last text slot only (it predicts the 1×1 code); the last
        scale's hidden states are kept for the diffusion head."""
        si, ws = run.si, run.workspace
        if si == 0:
            x_RLC = x_RLC[:, -1:]
        elif si == run.schedule.num_scales - 1:           # copied, so that a replayed graph refreshes it
            persistent_copy(ws.last_hidden, run.rows, x_RLC)
        R = run.rows
        return self.transformer.logits(x_RLC, (ws.head_mod[0][:R], ws.head_mod[1][:R]))

    @staticmethod
    def ratio(si: int, run: RunState) -> float:
        """si/(S−1), the last scale reusing the ratio of the one before (the reference's loop)."""
        S = run.schedule.num_scales
        return min(si, S - 2) / (S - 1)

    def guidance(self, si: int, run: RunState) -> float:
        """t at scale ``si``: cfg·ratio."""
        return float(run.settings.guidance_scale) * self.ratio(si, run)

    def guide(self, si: int, logits_RlV: torch.Tensor, run: RunState) -> torch.Tensor:
        B = run.batch_size
        if not run.cfg_active:
            return logits_RlV[:B]
        t = self.guidance(si, run)
        return (1 + t) * logits_RlV[:B] - t * logits_RlV[B:]

    def scale_noise(self, si: int, run: RunState) -> Optional[tuple]:
        """The codes' Exp(1) noise (B·l, V); with ``smooth``, the Gumbel mixture's (B·l, V) after it; at
        the last scale, the diffusion head's start and one draw per step (B·l, Cvae) — when one
        generator on the model's device draws them all and no diffusion noise was given."""
        last = si == run.schedule.num_scales - 1
        if not takes_drawn_noise(run.generator, self.device) or (last and run.model_state["diffusion_noise"] is not None):
            return None
        p, m = self.image_schedule.hw[si][0], self.transformer
        N, V = run.batch_size * p * p, m.config.vocab_size
        draws = (("exponential", (N, V)),) * (2 if run.model_state["smooth"] else 1)
        if last:
            draws += (("normal", (N, m.config.z_channels)),) * (1 + len(m.sampler.timesteps))
        return draws

    def scale_graph_constants(self, run: RunState) -> tuple:
        return (run.model_state["smooth"],)

    def sample(self, si: int, guided_BlV: torch.Tensor, run: RunState) -> torch.Tensor:
        s = run.settings
        k = s.top_k or next(k for below, k in REFERENCE_TOP_K if below is None or si < below)
        noise_NV = run.drawn(0)
        if not run.model_state["smooth"]:
            return sample_codes_per_image(guided_BlV, k, s.top_p, run.generator, noise_NV=noise_NV)
        # smooth: one filtering serves the codes and the mixture (the codes' draw from the filtered
        # logits filters nothing more: the same codes); its Gumbel draws follow the codes', as in the
        # reference
        B, l, V = guided_BlV.shape
        masked_BlV = filter_top_k_top_p(guided_BlV.reshape(B * l, V), k, s.top_p).view(B, l, V)
        codes_Bl = sample_codes_per_image(masked_BlV, 0, 0.0, run.generator, noise_NV=noise_NV)
        gens = run.generator if isinstance(run.generator, (list, tuple)) else [run.generator]
        rows = [masked_BlV] if len(gens) == 1 else list(masked_BlV.split(1))
        exp_BlV = run.drawn(1).view(B, l, V) if run.drawn_noise else \
            torch.cat([torch.empty_like(r).exponential_(generator=g) for r, g in zip(rows, gens)])
        tau = max(0.27 * (1 - 0.95 * self.ratio(si, run)), 0.005)
        weights_BlV = ((masked_BlV * (1 + self.ratio(si, run)) - exp_BlV.log()) / tau).softmax(-1)
        run.model_state["mixture_BlC"] = weights_BlV @ self.vqvae.quantize.embedding.weight.float()
        return codes_Bl

    def residual(self, si: int, codes_Bl: torch.Tensor, run: RunState) -> torch.Tensor:
        """Codebook vectors (B, l, Cvae) float32 (with ``smooth``, the Gumbel mixture; the drawn
        codes' vectors are kept for the diffusion head's condition)."""
        hard_BlC = F.embedding(codes_Bl, self.vqvae.quantize.embedding.weight.float())
        if not run.model_state["smooth"]:
            return hard_BlC
        run.model_state["hard_BlC"] = hard_BlC
        return run.model_state.pop("mixture_BlC")

    def _diffusion_noise(self, run: RunState, n: int, C: int):
        given = run.model_state.get("diffusion_noise")
        if given is not None:
            init, steps = given
            return init.to(self.device), [s[:n].to(self.device) for s in steps]
        if run.drawn_noise:                             # drawn beforehand, after the codes' (scale_noise)
            init, *steps = run.drawn_noise[-1 - len(self.transformer.sampler.timesteps):]
            return init, steps
        gens = run.generator if isinstance(run.generator, (list, tuple)) else [run.generator]
        per = n // len(gens)

        def draw():
            return torch.cat([torch.randn(per, C, generator=g, device=g.device if g is not None else self.device)
                              .to(self.device) for g in gens])
        return draw(), [draw() for _ in self.transformer.sampler.timesteps]

    @torch.no_grad()
    def accumulate(self, si: int, residual_BlC: torch.Tensor, run: RunState) -> None:
        ws, m, S = run.workspace, self.transformer, run.schedule.num_scales
        B, l, Cv = residual_BlC.shape
        p = self.image_schedule.hw[si][0]
        h_BChw = residual_BlC.transpose(1, 2).reshape(B, Cv, p, p)                   # (B, l, Cv) → (B, Cv, p, p)
        if si < S - 1:
            _, nxt_BChw = self.vqvae.next_stage_input(si, None, ws.f_hat, h_BChw)
            start, end = run.schedule.offsets[si + 1], run.schedule.offsets[si + 2]
            ws.next_BLC[:, start:end].copy_(nxt_BChw.flatten(2).transpose(1, 2))    # (B, Cv, h, w) → (B, h·w, Cv)
            return
        # the last scale: the diffusion head samples the continuous residual of every token
        R = run.rows
        hard_BlC = run.model_state["hard_BlC"] if run.model_state["smooth"] else residual_BlC
        z_RlC = m.decoder_norm(ws.last_hidden[R].float() + m.word_embed(hard_BlC.float()).repeat(R // B, 1, 1))
        init, steps = self._diffusion_noise(run, B * l, Cv)
        z_uncond = z_RlC[B:].flatten(0, 1) if run.cfg_active else None
        r_NC = sample_residual(m.diffloss.net, m.sampler, z_RlC[:B].flatten(0, 1), z_uncond, self.guidance(si, run),
                               init, steps, fused=self.ops.token_residual_norm_modulate)
        tokens_BlC = residual_BlC + r_NC.view(B, l, Cv)
        ws.f_hat.add_(tokens_BlC.transpose(1, 2).reshape(B, Cv, p, p))

    def latent(self, run: RunState) -> torch.Tensor:
        return run.workspace.f_hat

    @torch.no_grad()
    def replace_latent(self, si: int, latent: torch.Tensor, run: RunState) -> None:
        ws, sch = run.workspace, run.schedule
        ws.f_hat.copy_(latent)
        if si < sch.num_scales - 1:
            nxt_BChw = F.interpolate(ws.f_hat, size=self.image_schedule.hw[si + 1], mode="area")
            start, end = sch.offsets[si + 1], sch.offsets[si + 2]
            ws.next_BLC[:, start:end].copy_(nxt_BChw.flatten(2).transpose(1, 2))      # (B, Cv, h, w) → (B, h·w, Cv)

    @torch.no_grad()
    def decode(self, run: RunState) -> torch.Tensor:
        return (self.vqvae.fhat_to_img(run.workspace.f_hat).float() + 1) * 0.5

    def decode_key(self, run: RunState) -> Optional[tuple]:
        """A graph up to one 1024² picture (the workspace key holds the VQVAE's weights)."""
        return decode_graph_key(run.workspace.f_hat, self.vqvae.downsample_factor)


def hart_loop_flops(cfg, batch: int = 1, cfg_rows: int = 2, tokens_per_scale: Optional[Sequence[float]] = None,
                    rows_per_scale: Optional[Sequence[int]] = None,
                    kv_per_scale: Optional[Sequence[float]] = None) -> float:
    """FLOPs of HART's generation loop (multiply-add = 2) for ``batch`` images with ``cfg_rows`` rows
    each (``rows_per_scale[k]`` overrides it), over the engine's scales (scale 0 = the T text tokens,
    whose last slot alone reaches the head), when scale k runs ``tokens_per_scale[k]`` tokens
    (default all; 0 = skipped) and attends to ``kv_per_scale[k]`` cached tokens (default the running
    sum); the diffusion head's sampling steps at the last scale included (its net runs on both CFG
    halves)."""
    C, depth, V, W = cfg.embed_dim, cfg.depth, cfg.vocab_size, cfg.diff_width
    hidden = int((C * cfg.mlp_ratio * 2) / 3 + 255) // 256 * 256
    sizes = [cfg.context_token] + [p * p for p in cfg.patch_nums[1:]]
    total, prefix = 0.0, 0.0
    for k, full in enumerate(sizes):
        n = full if tokens_per_scale is None else tokens_per_scale[k]
        if n == 0:
            continue
        prefix += n
        kv = prefix if kv_per_scale is None else kv_per_scale[k]
        rows = batch * (cfg_rows if rows_per_scale is None else rows_per_scale[k])
        per_layer = 2 * n * (4 * C * C + 3 * C * hidden) + 4 * n * kv * C
        head = 2 * (1 if k == 0 else full) * C * V
        total += rows * (depth * per_layer + head)
        if k == len(sizes) - 1:                                        # the diffusion head, on every last-scale token
            net = 2 * (cfg.z_channels * W + C * W + cfg.diff_depth * (2 * W * W + 3 * W * W) + 2 * W * W
                       + 2 * W * cfg.z_channels) + 2 * (256 * W + W * W)
            total += rows * full * cfg.num_sampling_steps * net
    return total
