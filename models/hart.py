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
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from ..engine.schedule import ScaleSchedule

HART_SCHEDULE_1024 = (1, 2, 3, 4, 5, 7, 9, 12, 16, 21, 27, 36, 48, 64)
ROPE_BASE = 10000.0
VAE_SCALE = 0.6                      # the diffusion head samples residual / 0.6


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · x / √(mean(x²) + eps)``: the mean of squares in float32, cast back to x's dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


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
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half).to(t.device)
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


def apply_rope(x_BHLd: torch.Tensor, cos_BLd: torch.Tensor, sin_BLd: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin, rotate_half(x) = [−x₂, x₁] (halves of the head dim)."""
    cos, sin = cos_BLd[:, None].to(x_BHLd.dtype), sin_BLd[:, None].to(x_BHLd.dtype)
    x1, x2 = x_BHLd.chunk(2, dim=-1)
    return x_BHLd * cos + torch.cat((-x2, x1), dim=-1) * sin


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
        bias = torch.cat((self.q_bias, torch.zeros_like(self.q_bias), self.v_bias))
        qkv = F.linear(h_BLC, self.qkv_proj.weight, bias).view(B, L, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)                  # (B, L, 3, H, d) → 3 × (B, H, L, d)
        if self.l2_norm:
            mult = self.scale_mul_1H11.clamp_max(math.log(100.0)).exp()
            q, k = F.normalize(q, dim=-1) * mult, F.normalize(k, dim=-1)
        return apply_rope(q, cos_BLd, sin_BLd), apply_rope(k, cos_BLd, sin_BLd), v


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

    def forward(self, x_BLC: torch.Tensor, cond_B1C: torch.Tensor) -> torch.Tensor:
        scale, shift = self.ada_lin(cond_B1C).view(-1, 1, 2, x_BLC.shape[-1]).unbind(2)
        return self.ln_wo_grad(x_BLC) * (scale + 1) + shift


# ---- the diffusion head ----------------------------------------------------------------------------
class _ResBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.in_ln = nn.LayerNorm(width, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 3 * width))

    def forward(self, x, y):
        shift, scale, gate = self.adaLN_modulation(y).chunk(3, dim=-1)
        return x + gate * self.mlp(self.in_ln(x) * (1 + scale) + shift)


class _FinalLayer(nn.Module):
    def __init__(self, width: int, out: int):
        super().__init__()
        self.linear = nn.Linear(width, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))

    def forward(self, x, y):
        shift, scale = self.adaLN_modulation(y).chunk(2, dim=-1)
        return self.linear(F.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale) + shift)


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

    def forward(self, x_NC: torch.Tensor, t_N: torch.Tensor, z_NC: torch.Tensor) -> torch.Tensor:
        x = self.input_proj(x_NC)
        y = self.time_embed(t_N) + self.cond_embed(z_NC)
        for block in self.res_blocks:
            x = block(x, y)
        return self.final_layer(x, y)


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

    def at(self, table: np.ndarray, i: int, device) -> torch.Tensor:
        """Entry ``i`` of a float64 table, as the reference reads it (float64 → float32)."""
        return torch.tensor(table[i], dtype=torch.float64, device=device).float()


def sample_residual(net: DiffusionMLP, schedule: RespacedIDDPM, z_cond_NC: torch.Tensor,
                    z_uncond_NC: Optional[torch.Tensor], guidance: float, noise_init_NC: torch.Tensor,
                    noise_steps: Sequence[torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """The continuous residual of N last-scale tokens (N, Cvae), already × 0.6 (hart.md §5).

    With ``z_uncond_NC`` (guidance), each step runs the net on [x; x] with [z_cond; z_uncond],
    guides ε = (1 + t)·ε_cond − t·ε_uncond and keeps the conditional half's variance value; without,
    the net runs on x with z_cond alone. ``noise_steps``: one (N, Cvae) draw per reverse step, in
    loop order (the last is unused)."""
    x = noise_init_NC.float()
    C = x.shape[1]
    dev = x.device
    for i in reversed(range(len(schedule.timesteps))):
        t_N = torch.full((x.shape[0],), schedule.timesteps[i], device=dev, dtype=torch.int64)
        if z_uncond_NC is not None:
            out = net(torch.cat((x, x)), t_N.repeat(2), torch.cat((z_cond_NC, z_uncond_NC)))
            eps_c, eps_u = out[:, :C].chunk(2)
            eps, v = eps_c * (1 + guidance) - guidance * eps_u, out[:x.shape[0], C:]
        else:
            out = net(x, t_N, z_cond_NC)
            eps, v = out[:, :C], out[:, C:]
        x0 = (schedule.at(schedule.sqrt_recip, i, dev) * x - schedule.at(schedule.sqrt_recipm1, i, dev) * eps).clamp(-1, 1)
        mean = schedule.at(schedule.coef1, i, dev) * x0 + schedule.at(schedule.coef2, i, dev) * x
        frac = (v + 1) / 2
        log_var = frac * schedule.at(schedule.log_var_max, i, dev) + (1 - frac) * schedule.at(schedule.log_var_min, i, dev)
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

    @staticmethod
    def official_extra_keys(depth: int) -> set:
        """Official buffers this module rebuilds instead of loading."""
        return {"lvl_1L", "attn_bias_for_masking"} | {f"blocks.{i}.attn.zero_k_bias" for i in range(depth)}

    # ---- pieces the generation loop uses ------------------------------------------------------------
    def level_embedding(self, levels: torch.Tensor) -> torch.Tensor:
        """(n, C) level embedding of the (n,) integer levels (text = 0, scale k = k)."""
        if isinstance(self.lvl_embed, TimestepEmbedder):
            return self.lvl_embed(levels)
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

    def logits(self, x_BLC: torch.Tensor, cond_BTC: torch.Tensor) -> torch.Tensor:
        """Float32 logits (B, L, V): AdaLN before the head from the max over the text embeddings."""
        c = cond_BTC.float().max(1, keepdim=True).values
        return self.head(self.head_nm(x_BLC.float(), c).float()).float()

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
        return self.logits(x[:, T - 1:], cond_BTC)
