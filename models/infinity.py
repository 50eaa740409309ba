"""Infinity (FoundationVision/Infinity): the bitwise text-to-image transformer and its engine adapter.

Architecture (research/infinity.md §1), reproduced exactly so the official ``infinity_2b_reg.pth``
and the 8B shards load key for key:
- text path: RMSNorm over the T5 features (``text_norm``), an attentive pool with one learned
  query per head whose head count comes from the T5 width (Ct5/128, or Ct5/64 above width 4096)
  giving the condition / start vector, and a GELU(tanh) MLP giving the cross-attention memory;
- shared AdaLN (``shared_ada_lin`` + a learned per-block ``ada_gss``; chunk order γ1, γ2, s1, s2,
  b1, b2), a level embedding added once before the first block, no absolute positions;
- blocks ``x += γ1·SA(LN(x)(1+s1)+b1)``, ``x += CA(ca_norm(x), text)`` (affine LayerNorm, no gate),
  ``x += γ2·FFN(LN(x)(1+s2)+b2)``;
- cosine self-attention: q, k L2-normalised, q times exp(min(τ_h, ln 100)), softmax scale 1, zero
  key bias, then 2-D RoPE on adjacent channel pairs (rows in the first half, columns in the
  second), positions scaled to the final grid of the 1M template of the aspect ratio with
  round-half-to-even;
- cross-attention: standard softmax 1/√hd to each image's own prompt tokens;
- head: AdaLN (scale, shift) → Linear(C → 2d) in float32; logits of bit j are entries (2j, 2j+1).

Blocks are stored as ``block_chunks.{chunk}.module.{i}`` (the released checkpoints' layout).

Inference differs from the reference in ways that do not change the numbers: text projections,
AdaLN and cross-attention K/V are computed once per generation, the KV cache is preallocated, the
residual stream stays in float32 while the blocks' linear layers run in their weight dtype, and
cross-attention runs in float32 where the reference rounds q/k/v to bf16 (research/infinity.md §8.1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from ..engine.kv_cache import KVCache
from ..engine.memory import trim_host_heap
from ..engine.sampling import sample_codes_per_image
from ..engine.schedule import ScaleSchedule
from ..engine.state import ModelInfo, RunState
from ..engine.contract import ScalePlan, SubLayer, SubLayerContext
from ..engine.graphs import GraphStreams
from ..engine.workspace import Workspace
from ..sparse_ops.attention import dense_attention
from ..sparse_ops.ops import gather_rows, scatter_rows
from ..sparse_ops.ref import rope_pairs
from ._blocks import (EAGER_OPS, AbsorbedCrossMemory, CrossMemory, ElementwiseOps, TanhGeluFFN, absorb_cross_attention,
                      absorbed_cross_attention, absorbs_cross_attention, dense_linear, layer_norm_no_affine,
                      trunc_normal_init_)
from .bsq_vae import code_value, next_scale_input, upsample_codes
from .text_encoder import TextFeatures

MAX_LOG_TEMPERATURE = math.log(100.0)
TEXT_BUCKET = 32                      # CUDA: text K/V padded to a multiple of this many tokens (shared graphs)
VAE_STRIDE = 16                       # pixels per transformer token (also with the 8B's 8-px VAE + 2×2 patchify)

# ---- resolutions: the official h/w templates (infinity/utils/dynamic_resolution.py) ----------------
# Token map (h, w) of each of the 13 scales of the 1M schedule per h/w ratio; the wide ratios are the
# transposes, keyed by int(1000 / ratio) / 1000 like the reference. 0.06M / 0.25M / 0.60M are the
# first 7 / 10 / 12 scales. Images use one frame per scale.
_TALL_TEMPLATES: dict[float, tuple[tuple[int, int], ...]] = {
    1.000: ((1, 1), (2, 2), (4, 4), (6, 6), (8, 8), (12, 12), (16, 16), (20, 20), (24, 24), (32, 32), (40, 40),
            (48, 48), (64, 64)),
    1.250: ((1, 1), (2, 2), (3, 3), (5, 4), (10, 8), (15, 12), (20, 16), (25, 20), (30, 24), (35, 28), (45, 36),
            (55, 44), (70, 56)),
    1.333: ((1, 1), (2, 2), (4, 3), (8, 6), (12, 9), (16, 12), (20, 15), (24, 18), (28, 21), (36, 27), (48, 36),
            (60, 45), (72, 54)),
    1.500: ((1, 1), (2, 2), (3, 2), (6, 4), (9, 6), (15, 10), (21, 14), (27, 18), (33, 22), (39, 26), (48, 32),
            (63, 42), (78, 52)),
    1.750: ((1, 1), (2, 2), (3, 3), (7, 4), (11, 6), (14, 8), (21, 12), (28, 16), (35, 20), (42, 24), (56, 32),
            (70, 40), (84, 48)),
    2.000: ((1, 1), (2, 2), (4, 2), (6, 3), (10, 5), (16, 8), (22, 11), (30, 15), (38, 19), (46, 23), (60, 30),
            (74, 37), (90, 45)),
    2.500: ((1, 1), (2, 2), (5, 2), (10, 4), (15, 6), (20, 8), (25, 10), (30, 12), (40, 16), (50, 20), (65, 26),
            (80, 32), (100, 40)),
    3.000: ((1, 1), (2, 2), (6, 2), (9, 3), (15, 5), (21, 7), (27, 9), (36, 12), (45, 15), (54, 18), (72, 24),
            (90, 30), (111, 37)),
}
PN_SCALES: dict[str, int] = {"0.06M": 7, "0.25M": 10, "0.60M": 12, "1M": 13}
TRAINED_SCALES = 13                   # scales the released models were trained on (level embeddings 0..12)

# Zero-shot sizes beyond the trained ones (FastVAR's 2K extension). Its schedule is unpublished
# (FastVAR issue #9), so ours is stated here: the 1M template followed by 1.5× and 2× its final map
# (1:1 → 96×96 and 128×128 tokens = 2048 × 2048 px). The added scales reuse the last trained level
# embedding, and RoPE positions stay scaled to the 1M final grid (the official rule for every size),
# so the model sees only positions and levels it was trained on.
ZERO_SHOT_PN: dict[str, tuple[float, ...]] = {"4M": (1.5, 2.0)}


def _all_templates() -> dict[float, tuple[tuple[int, int], ...]]:
    out = {}
    for ratio, hws in _TALL_TEMPLATES.items():
        out[ratio] = hws
        if ratio != 1.0:
            out[int(1000 / ratio) / 1000] = tuple((w, h) for h, w in hws)
    return out


INFINITY_TEMPLATES: dict[float, tuple[tuple[int, int], ...]] = _all_templates()


@dataclass(frozen=True)
class InfinityResolution:
    """One output size: the template it comes from and its token schedule.

    h_div_w: the template's h/w key (1.0, 0.75, 1.333, ...); pn: "0.06M", "0.25M", "0.60M" or "1M"
    (official), or a zero-shot size of ``ZERO_SHOT_PN`` ("4M");
    hw: (h, w) token map of every scale; rope_grid: the final (h, w) of the template's 1M schedule,
    to which RoPE positions are scaled whatever the output size.
    """

    h_div_w: float
    pn: str
    hw: tuple[tuple[int, int], ...]
    rope_grid: tuple[int, int]

    @property
    def schedule(self) -> ScaleSchedule:
        return ScaleSchedule(self.hw)

    @property
    def height(self) -> int:
        return VAE_STRIDE * self.hw[-1][0]

    @property
    def width(self) -> int:
        return VAE_STRIDE * self.hw[-1][1]

    def __str__(self) -> str:
        return f"{self.height}x{self.width}"


def infinity_resolution(h_div_w: float, pn: str = "1M") -> InfinityResolution:
    """The schedule of template ``h_div_w`` (nearest template) at size ``pn``: an official size
    (``PN_SCALES``) or a zero-shot one (``ZERO_SHOT_PN``)."""
    if pn not in PN_SCALES and pn not in ZERO_SHOT_PN:
        raise ValueError(f"pn={pn!r} is not an Infinity size; choose one of {list(PN_SCALES)} "
                         f"(or the zero-shot {list(ZERO_SHOT_PN)})")
    key = min(INFINITY_TEMPLATES, key=lambda r: abs(r - float(h_div_w)))
    hws = INFINITY_TEMPLATES[key]
    if pn in ZERO_SHOT_PN:
        (h, w) = hws[-1]
        extra = tuple((round(f * h), round(f * w)) for f in ZERO_SHOT_PN[pn])
        return InfinityResolution(key, pn, hws + extra, hws[-1])
    return InfinityResolution(key, pn, hws[:PN_SCALES[pn]], hws[-1])


def zero_shot_resolutions() -> list[InfinityResolution]:
    """Every zero-shot size (15 aspect ratios × ``ZERO_SHOT_PN``): beyond what the models were trained on."""
    return [infinity_resolution(r, pn) for r in INFINITY_TEMPLATES for pn in ZERO_SHOT_PN]


def infinity_resolutions() -> list[InfinityResolution]:
    """Every official size (15 aspect ratios × 4 sizes)."""
    return [infinity_resolution(r, pn) for r in INFINITY_TEMPLATES for pn in PN_SCALES]


def resolve_resolution(height: int, width: int) -> InfinityResolution:
    """The official schedule producing exactly ``height`` × ``width`` pixels, or a ValueError listing the
    sizes of the nearest aspect ratio."""
    for h, name in ((height, "height"), (width, "width")):
        if isinstance(h, bool) or not isinstance(h, int) or h <= 0:
            raise ValueError(f"{name} must be a positive int number of pixels, got {h!r}")
    for sizes in (infinity_resolutions(), zero_shot_resolutions()):
        exact = [r for r in sizes if (r.height, r.width) == (height, width)]
        if exact:
            return min(exact, key=lambda r: abs(r.h_div_w - height / width))
    near = infinity_resolution(height / width)
    sizes = ", ".join(f"{r.height}x{r.width}" for r in (infinity_resolution(near.h_div_w, pn) for pn in PN_SCALES))
    zs = ", ".join(f"{r.height}x{r.width}" for r in (infinity_resolution(near.h_div_w, pn) for pn in ZERO_SHOT_PN))
    raise ValueError(f"height={height}, width={width} is not an Infinity size: the model only generates the sizes "
                     f"of its aspect-ratio templates. For h/w ≈ {near.h_div_w} use one of {sizes} (height x width), "
                     f"or zero-shot {zs} (beyond the trained scales)")


DEFAULT_RESOLUTION = infinity_resolution(1.0, "1M")


# ---- RoPE ---------------------------------------------------------------------------------------------
def rope_positions(hw: Sequence[tuple[int, int]], rope_grid: tuple[int, int]) -> torch.Tensor:
    """(L, 2) int64 (row, column) RoPE position of every token of the schedule: integer grid positions
    scaled to ``rope_grid`` and rounded half to even (the reference's float32 ``.round()``)."""
    uh, uw = rope_grid
    out = []
    for h, w in hw:
        # the clamp acts only on maps finer than the grid (zero-shot sizes), where the last row would round up to uh
        rows = (torch.arange(h) * (uh / h)).round().long().clamp_max(uh - 1)
        cols = (torch.arange(w) * (uw / w)).round().long().clamp_max(uw - 1)
        out.append(torch.stack((rows.view(h, 1).expand(h, w), cols.view(1, w).expand(h, w)), dim=-1).reshape(h * w, 2))
    return torch.cat(out)


def rope_cos_sin(hw: Sequence[tuple[int, int]], rope_grid: tuple[int, int], head_dim: int,
                 base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (L, head_dim/2) float32 of the angle rotating channel pair p of every token: pairs
    p < head_dim/4 by row·θ_p, the others by column·θ_(p − head_dim/4), θ_i = base^(−4i/head_dim)."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs a head width divisible by 4, got {head_dim}")
    half = head_dim // 2
    inv_freq = 1.0 / (base ** (torch.arange(0, half, 2, dtype=torch.int64).float() / half))    # (hd/4,)
    pos_L2 = rope_positions(hw, rope_grid).float()
    angle_LD = torch.cat((pos_L2[:, :1] * inv_freq, pos_L2[:, 1:] * inv_freq), dim=-1)      # (L, hd/2)
    return torch.cos(angle_LD), torch.sin(angle_LD)


def apply_rope(x_RlHd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (2p, 2p+1) of (R, l, H, d) by cos/sin (R or 1, l, 1, d/2)."""
    return rope_pairs(x_RlHd, cos, sin)


def level(si: int) -> int:
    """The level-embedding row of scale ``si``: zero-shot scales past the trained ones reuse the last."""
    return min(si, TRAINED_SCALES - 1)


def level_index(hw: Sequence[tuple[int, int]], device=None) -> torch.Tensor:
    counts = torch.tensor([h * w for h, w in hw])
    levels = torch.tensor([level(si) for si in range(len(hw))])
    return torch.repeat_interleave(levels, counts).to(device)


# ---- layers --------------------------------------------------------------------------------------------
class _Call:
    """Where a block runs: the KV cache (None in teacher forcing, with ``attn_mask`` instead), scale,
    layer, the run (None in teacher forcing), the layer's per-image constants, RoPE tables of the whole
    schedule, the absolute positions of the tokens it runs on (``start`` + ``n`` for a contiguous
    scale, or ``pos`` (R, n)), their key validity, and the text memory of the cross-attention
    (``ca``: a ``CrossMemory`` or an ``AbsorbedCrossMemory``, all rows)."""

    __slots__ = ("kv", "si", "layer", "run", "qkv_bias", "q_mult", "cos_LD", "sin_LD", "start", "pos", "valid_Rl",
                 "record", "ca", "attn_mask", "rope_l", "ops")

    def __init__(self, *, kv, si, layer, run, qkv_bias, q_mult, cos_LD, sin_LD, start, pos, valid_Rl, record,
                 ca, attn_mask=None, rope_l=None, ops: ElementwiseOps = EAGER_OPS):
        self.kv, self.si, self.layer, self.run = kv, si, layer, run
        self.qkv_bias, self.q_mult, self.cos_LD, self.sin_LD = qkv_bias, q_mult, cos_LD, sin_LD
        self.start, self.pos, self.valid_Rl, self.record = start, pos, valid_Rl, record
        self.ca, self.attn_mask = ca, attn_mask
        self.rope_l = rope_l          # cos, sin of ``pos`` gathered once per scale (shared by the layers)
        self.ops = ops                # the elementwise steps: eager, torch.compile or fused Triton kernels

    def positions(self, idx_Rn: Optional[torch.Tensor]):
        """(absolute positions (l,) or (R, n), validity or None) of the tokens being written."""
        if idx_Rn is None:
            return self.pos, self.valid_Rl
        R = idx_Rn.shape[0]
        pos_Rn = self.pos.expand(R, -1).gather(1, idx_Rn)
        valid = self.valid_Rl.gather(1, idx_Rn) if self.valid_Rl is not None else None
        return pos_Rn, valid

    def rope(self, pos: torch.Tensor):
        """cos, sin for positions (l,) → (1, l, 1, D) or (R, n) → (R, n, 1, D)."""
        if pos is self.pos and self.rope_l is not None:
            return self.rope_l
        if pos.ndim == 1:
            return self.cos_LD[pos][None, :, None], self.sin_LD[pos][None, :, None]
        return self.cos_LD[pos][:, :, None], self.sin_LD[pos][:, :, None]


class InfinitySelfAttention(nn.Module):
    """Cosine self-attention with 2-D RoPE. Keys: ``mat_qkv.weight`` (3C, C), ``q_bias``, ``v_bias``,
    ``scale_mul_1H11`` (1, H, 1, 1), ``proj``. The key bias is fixed at zero."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by {num_heads} heads")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.mat_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.scale_mul_1H11 = nn.Parameter(torch.full((1, num_heads, 1, 1), math.log(4.0)))
        self.proj = nn.Linear(dim, dim)

    def q_multiplier(self) -> torch.Tensor:
        """(H, 1) float32: q's temperature exp(min(τ, ln 100)) per head."""
        return self.scale_mul_1H11.float().clamp_max(MAX_LOG_TEMPERATURE).exp().view(-1, 1)

    def qkv_bias(self) -> torch.Tensor:
        return torch.cat((self.q_bias, torch.zeros_like(self.q_bias), self.v_bias))

    def forward(self, x_RlC: torch.Tensor, ctx: _Call, idx_Rn: Optional[torch.Tensor] = None) -> torch.Tensor:
        R, l, C = x_RlC.shape
        H, d = self.num_heads, self.head_dim
        w = self.mat_qkv.weight
        qkv_Rl3Hd = ctx.ops.linear(x_RlC.to(w.dtype), w, ctx.qkv_bias).view(R, l, 3, H, d)
        pos, valid = ctx.positions(idx_Rn)
        cos, sin = ctx.rope(pos)
        out = None
        if ctx.kv is None:                                                          # teacher forcing: one pass
            k_RHld = torch.empty(R, H, l, d, device=w.device, dtype=w.dtype)
            v_RHld = torch.empty_like(k_RHld)
            q = ctx.ops.qk_norm_rope_store(qkv_Rl3Hd, ctx.q_mult, cos, sin, k_RHld, v_RHld)
            k, v, attn_mask = k_RHld, v_RHld, ctx.attn_mask
        else:
            record = ctx.record or idx_Rn is not None
            k_dst, v_dst = ctx.kv.reserve(ctx.layer, l, pos if record else None, valid)
            # cosine q/k (float32), q's temperature, RoPE, and the cache write: one step
            q = ctx.ops.qk_norm_rope_store(qkv_Rl3Hd, ctx.q_mult, cos, sin, k_dst, v_dst)  # (R, H, l, d)
            k, v = ctx.kv.view(ctx.layer)
            attn_mask = ctx.kv.key_mask(ctx.layer)
            if ctx.run.hooks["attention"]:
                out = ctx.run.policies.attention(SubLayerContext(ctx.si, ctx.layer, "self_attn"), q, k, v, ctx.run)
        if out is None:
            out = dense_attention(q, k, v, scale=1.0, attn_mask=attn_mask)
        out_RlC = out.transpose(1, 2).reshape(R, l, C)                              # (R, H, l, d) → (R, l, C)
        return ctx.ops.linear(out_RlC.to(self.proj.weight.dtype), self.proj.weight, self.proj.bias)


class InfinityCrossAttention(nn.Module):
    """Attention of image tokens to their prompt's text memory. Keys: ``mat_q`` (C, C)+bias,
    ``mat_kv.weight`` (2C, C), ``v_bias``, ``proj``; the key bias is fixed at zero."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.mat_q = nn.Linear(dim, dim)
        self.mat_kv = nn.Linear(dim, 2 * dim, bias=False)
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.proj = nn.Linear(dim, dim)

    def text_kv(self, ca_RTC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V (R, H, T, d) of the text memory (computed once per generation)."""
        R, T, C = ca_RTC.shape
        w = self.mat_kv.weight
        bias = torch.cat((torch.zeros_like(self.v_bias), self.v_bias))
        kv_RT2Hd = F.linear(ca_RTC.to(w.dtype), w, bias).view(R, T, 2, self.num_heads, self.head_dim)
        return kv_RT2Hd[:, :, 0].transpose(1, 2), kv_RT2Hd[:, :, 1].transpose(1, 2)

    def absorb(self, k_RHTd: torch.Tensor, v_RHTd: torch.Tensor, valid_RT: Optional[torch.Tensor]) -> AbsorbedCrossMemory:
        """The text memory with ``mat_q`` and ``proj`` folded in (``_blocks.absorb_cross_attention``)."""
        return absorb_cross_attention(k_RHTd, v_RHTd, valid_RT, self.mat_q.weight, self.mat_q.bias, self.proj.weight,
                                      self.proj.bias, 1.0 / math.sqrt(self.head_dim), self.proj.weight.dtype)

    def forward(self, y_RlC: torch.Tensor, mem, ops: Optional[ElementwiseOps] = None) -> torch.Tensor:
        """``mem``: a ``CrossMemory`` (text K/V, key mask) or an ``AbsorbedCrossMemory`` of these rows."""
        if isinstance(mem, AbsorbedCrossMemory):
            return absorbed_cross_attention(y_RlC, mem, ops)
        R, l, C = y_RlC.shape
        linear_fn = ops.linear if ops is not None else dense_linear
        q = linear_fn(y_RlC, self.mat_q.weight, self.mat_q.bias).view(R, l, self.num_heads, self.head_dim).transpose(1, 2)   # (R, l, C) → (R, H, l, d)
        out = dense_attention(q, mem.k_RHTd, mem.v_RHTd, scale=1.0 / math.sqrt(self.head_dim), attn_mask=mem.mask_R11T)
        out_RlC = out.transpose(1, 2).reshape(R, l, C).to(self.proj.weight.dtype)          # (R, H, l, d) → (R, l, C)
        return linear_fn(out_RlC, self.proj.weight, self.proj.bias)


class InfinityBlock(nn.Module):
    """``CrossAttnBlock`` with shared AdaLN. Keys: ``ada_gss``, ``sa.*``, ``ca.*``, ``ffn.*``, ``ca_norm.*``."""

    def __init__(self, dim: int, num_heads: int, ffn_hidden: int, norm_eps: float):
        super().__init__()
        self.dim, self.norm_eps = dim, norm_eps
        self.ada_gss = nn.Parameter(torch.zeros(1, 1, 6, dim))
        self.sa = InfinitySelfAttention(dim, num_heads)
        self.ca = InfinityCrossAttention(dim, num_heads)
        self.ffn = TanhGeluFFN(dim, ffn_hidden)
        self.ca_norm = nn.LayerNorm(dim, eps=norm_eps)

    def modulation(self, shared_R6C: torch.Tensor) -> torch.Tensor:
        """(R, 6, C) float32: γ1, γ2, 1+s1, 1+s2, b1, b2 from the shared AdaLN projection."""
        ada = (self.ada_gss[0] + shared_R6C).float()                                # (1,6,C)+(R,6,C)
        return torch.cat((ada[:, :2], ada[:, 2:4] + 1, ada[:, 4:]), dim=1)

    def _ca_norm(self, x_RlC: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x_RlC.float(), (self.dim,), weight.view(-1).float(), bias.view(-1).float(), self.norm_eps)

    def forward(self, x_RlC: torch.Tensor, mod_R6C: torch.Tensor, ctx: _Call) -> torch.Tensor:
        g1, g2, m1, m2, b1, b2 = mod_R6C.unsqueeze(2).unbind(1)                     # each (R, 1, C)
        wdtype = self.ffn.fc1.weight.dtype
        ops, eps = ctx.ops, self.norm_eps
        R = x_RlC.shape[0]
        ca_mem = ctx.ca.rows(R)

        def sa_branch(y, idx_Rn=None):
            return self.sa(y, ctx, idx_Rn)

        def ca_branch(y, idx_Rn=None):
            return self.ca(y, ca_mem, ops)

        def ffn_branch(y, idx_Rn=None):
            return self.ffn(y, ops)

        def modulate(x, mul, shift):
            return ops.modulate(x, mul, shift, eps, wdtype)

        def ca_modulate(x, weight, bias):
            return self._ca_norm(x, weight, bias).to(wdtype)

        run = ctx.run
        if run is not None and run.hooks.wraps(ctx.layer):
            stack = run.policies
            w, b = self.ca_norm.weight.view(1, 1, -1), self.ca_norm.bias.view(1, 1, -1)
            ones = torch.ones_like(g1[:1])
            x_RlC = stack.wrap_sublayer(SubLayer(SubLayerContext(ctx.si, ctx.layer, "self_attn"), m1, b1, g1,
                                                 sa_branch, modulate, ops.gated_residual), x_RlC, run)
            x_RlC = stack.wrap_sublayer(SubLayer(SubLayerContext(ctx.si, ctx.layer, "cross_attn"), w, b, ones,
                                                 ca_branch, ca_modulate, ops.gated_residual), x_RlC, run)
            return stack.wrap_sublayer(SubLayer(SubLayerContext(ctx.si, ctx.layer, "ffn"), m2, b2, g2,
                                                ffn_branch, modulate, ops.gated_residual), x_RlC, run)
        x_RlC = ops.gated_residual(x_RlC, sa_branch(modulate(x_RlC, m1, b1)), g1)
        x_RlC = x_RlC + ca_branch(ca_modulate(x_RlC, self.ca_norm.weight, self.ca_norm.bias)).float()
        return ops.gated_residual(x_RlC, self.ffn(modulate(x_RlC, m2, b2), ops), g2)

    def forward_chained(self, x_RlC: torch.Tensor, y_RlC: torch.Tensor, mod_R6C: torch.Tensor,
                        next_mod_R6C: Optional[torch.Tensor], ctx: _Call, ones_R1C: torch.Tensor):
        """The dense path without sub-layer wrappers, chained across blocks (fused elementwise ops
        only): ``y_RlC`` is this block's self-attention input, already modulated; each residual add
        runs in one step with the next sub-layer's norm — the cross-attention's affine LayerNorm
        as LN·weight + bias, its ungated residual with a gate of ones (``ones_R1C``). Returns (x,
        the next block's self-attention input, or None after the last block)."""
        g1, g2, _, m2, _, b2 = mod_R6C.unsqueeze(2).unbind(1)                        # each (R, 1, C)
        ops, eps, wdtype = ctx.ops, self.norm_eps, self.ffn.fc1.weight.dtype
        R = x_RlC.shape[0]
        ca_w, ca_b = self.ca_norm.weight.view(1, 1, -1), self.ca_norm.bias.view(1, 1, -1)
        x_RlC, y_RlC = ops.residual_modulate(x_RlC, self.sa(y_RlC, ctx), g1, ca_w, ca_b, eps, wdtype)
        x_RlC, y_RlC = ops.residual_modulate(x_RlC, self.ca(y_RlC, ctx.ca.rows(R), ops),
                                             ones_R1C[:R], m2, b2, eps, wdtype)
        branch_RlC = self.ffn(y_RlC, ops)
        if next_mod_R6C is None:
            return ops.gated_residual(x_RlC, branch_RlC, g2), None
        _, _, m1_next, _, b1_next, _ = next_mod_R6C.unsqueeze(2).unbind(1)
        return ops.residual_modulate(x_RlC, branch_RlC, g2, m1_next, b1_next, eps, wdtype)


class _TextPoolAttention(nn.Module):
    """``text_proj_for_sos.ca``: one learned query per head over a prompt's tokens. Keys: ``mat_q``
    (1, Hp, C/Hp), ``v_bias``, ``mat_kv.weight`` (2C, Ct5), ``proj``."""

    def __init__(self, dim: int, text_channels: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.mat_q = nn.Parameter(torch.zeros(1, num_heads, dim // num_heads))
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.mat_kv = nn.Linear(text_channels, 2 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, text_BTC: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
        B, T, _ = text_BTC.shape
        Hp, d = self.num_heads, self.head_dim
        w = self.mat_kv.weight
        bias = torch.cat((torch.zeros_like(self.v_bias), self.v_bias))
        kv_BT2Hd = F.linear(text_BTC.to(w.dtype), w, bias).view(B, T, 2, Hp, d)
        k, v = kv_BT2Hd[:, :, 0].transpose(1, 2), kv_BT2Hd[:, :, 1].transpose(1, 2)  # (B, Hp, T, d)
        q = self.mat_q.to(k.dtype).unsqueeze(2).expand(B, Hp, 1, d)
        out = dense_attention(q, k, v, scale=1.0 / math.sqrt(d), attn_mask=mask_BT[:, None, None, :])
        return self.proj(out.reshape(B, Hp * d).to(self.proj.weight.dtype))          # (B, Hp, 1, d) → (B, C)


class _TextPool(nn.Module):
    def __init__(self, dim: int, text_channels: int, num_heads: int):
        super().__init__()
        self.ca = _TextPoolAttention(dim, text_channels, num_heads)


class _RMSNorm(nn.Module):
    """``text_norm``: x·rsqrt(mean(x²)+eps)·w in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(self.eps))) * self.weight.float()


class _Chunk(nn.Module):
    """``block_chunks.{c}``: one group of consecutive blocks (``module.{i}``)."""

    def __init__(self, blocks: Sequence[InfinityBlock]):
        super().__init__()
        self.module = nn.ModuleList(blocks)


def text_pool_heads(text_channels: int, embed_dim: int) -> int:
    """The attentive pool's head count: it follows the T5 width, not the model's heads."""
    return text_channels // (64 if embed_dim > 4096 else 128)


def ffn_hidden(embed_dim: int, mlp_ratio: float) -> int:
    """FFN width: C·mlp_ratio snapped to a multiple of 256 (Python round, ties to even)."""
    return round(embed_dim * mlp_ratio / 256) * 256


def _official_uncond_rows(text_maxlen: int, text_channels: int) -> torch.Tensor:
    """The reference constructor's ``cfg_uncond`` init (its loader pads short tables with these rows)."""
    t = torch.empty(text_maxlen, text_channels)
    nn.init.trunc_normal_(t, std=1.2, generator=torch.Generator().manual_seed(0))
    return t / text_channels ** 0.5


class InfinityTransformer(ModelMixin, ConfigMixin):
    """The Infinity transformer (official key layout, ``*.zero_k_bias`` buffers excluded).

    Args:
        token_dim: input/bit width d of one token (32 for the 2B model; 56 = 4·14 for the 8B model,
            whose tokens are 2×2 patches of its 14-bit VAE); the head has 2d outputs.
        depth, embed_dim, num_heads, mlp_ratio, norm_eps: size (2B: 32, 2048, 16; 8B: 40, 3584, 28).
        text_channels: T5 width Ct5 (2048 for Flan-T5-XL); text_maxlen: rows of the learned
            unconditional text table (512).
        num_block_chunks: block groups of the checkpoint layout, ``block_chunks.{chunk}.module.{i}``
            (8 for the released models).
        num_levels: rows of the level embedding (15).
    """

    _no_split_modules = ["InfinityBlock"]

    @register_to_config
    def __init__(self, token_dim: int = 32, depth: int = 32, embed_dim: int = 2048, num_heads: int = 16,
                 mlp_ratio: float = 4.0, norm_eps: float = 1e-6, text_channels: int = 2048, text_maxlen: int = 512,
                 num_block_chunks: int = 8, num_levels: int = 15):
        super().__init__()
        C = embed_dim
        if depth % num_block_chunks:
            raise ValueError(f"depth {depth} is not divisible by num_block_chunks={num_block_chunks}")
        pool_heads = text_pool_heads(text_channels, C)
        if pool_heads < 1 or C % pool_heads:
            raise ValueError(f"text_channels={text_channels} gives {pool_heads} text-pool heads, which do not divide "
                             f"the width {C}")
        self.cfg_uncond = nn.Parameter(torch.zeros(text_maxlen, text_channels))
        self.pos_start = nn.Parameter(torch.zeros(1, 1, C))
        self.text_norm = _RMSNorm(text_channels, norm_eps)
        self.text_proj_for_sos = _TextPool(C, text_channels, pool_heads)
        self.text_proj_for_ca = nn.Sequential(nn.Linear(text_channels, C), nn.GELU(approximate="tanh"), nn.Linear(C, C))
        self.lvl_embed = nn.Embedding(num_levels, C)
        self.word_embed = nn.Linear(token_dim, C)
        self.shared_ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(C, 6 * C))
        per = depth // num_block_chunks
        hidden = ffn_hidden(C, mlp_ratio)
        self.block_chunks = nn.ModuleList(
            _Chunk([InfinityBlock(C, num_heads, hidden, norm_eps) for _ in range(per)]) for _ in range(num_block_chunks))
        self.head_nm = nn.Module()
        self.head_nm.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(C, 2 * C))
        self.head = nn.Linear(C, 2 * token_dim)

    @property
    def blocks(self) -> list[InfinityBlock]:
        """The blocks in order (chunk-major), as one flat list."""
        return [blk for chunk in self.block_chunks for blk in chunk.module]

    @property
    def head_dim(self) -> int:
        return self.config.embed_dim // self.config.num_heads

    def block_dtype(self) -> torch.dtype:
        return self.block_chunks[0].module[0].ffn.fc1.weight.dtype

    def set_block_dtype(self, dtype: torch.dtype) -> "InfinityTransformer":
        """The reference's ``bf16`` mode: blocks in ``dtype``; embeddings, text projections, AdaLN and
        the head stay float32 (they are small and the head runs in float32 anyway)."""
        nn.Module.to(self, torch.float32)
        self.block_chunks.to(dtype)
        return self

    def init_random_weights(self, std: float = 0.02) -> "InfinityTransformer":
        """Random weights for a model built by size (benchmarks, smoke tests); draws noise."""
        trunc_normal_init_(self, std)
        C, Ct5 = self.config.embed_dim, self.config.text_channels
        nn.init.trunc_normal_(self.pos_start, std=std)
        nn.init.trunc_normal_(self.text_proj_for_sos.ca.mat_q, std=std)
        nn.init.zeros_(self.text_proj_for_sos.ca.v_bias)
        nn.init.ones_(self.text_norm.weight)
        with torch.no_grad():
            self.cfg_uncond.copy_(_official_uncond_rows(self.config.text_maxlen, Ct5))
        for blk in self.blocks:
            nn.init.trunc_normal_(blk.ada_gss, std=1.0 / C ** 0.5)
            nn.init.constant_(blk.sa.scale_mul_1H11, math.log(4.0))
            nn.init.ones_(blk.ca_norm.weight)
            nn.init.zeros_(blk.ca_norm.bias)
            for p in (blk.sa.q_bias, blk.sa.v_bias, blk.ca.v_bias):
                nn.init.zeros_(p)
        return self

    # ---- pieces shared by teacher forcing and generation ----------------------------------------
    def uncond_text(self, lens: Sequence[int]) -> TextFeatures:
        """The unconditional branch of prompts of these lengths: ``cfg_uncond[:len]`` each."""
        n = self.cfg_uncond.shape[0]
        if max(lens) > n:
            raise ValueError(f"a prompt has {max(lens)} tokens but the unconditional table holds {n}; prompts are "
                             f"truncated at {n} tokens")
        return TextFeatures(torch.cat([self.cfg_uncond[:int(m)] for m in lens]).float(), tuple(int(m) for m in lens))

    def encode_text(self, text: TextFeatures, taps: Optional[dict] = None):
        """Packed T5 features → (cond_RD (R, C) float32, ca_RTC (R, T, C) padded text memory, mask_RT)."""
        if text.channels != self.config.text_channels:
            raise ValueError(f"text features have {text.channels} channels, this model reads "
                             f"{self.config.text_channels} (the T5 width it was trained with)")
        x_NC = self.text_norm(text.kv_compact_NC)
        ca_NC = self.text_proj_for_ca(x_NC.to(self.text_proj_for_ca[0].weight.dtype)).float()
        x_RTC, mask_RT = TextFeatures(x_NC, text.lens).padded()
        ca_RTC, _ = TextFeatures(ca_NC, text.lens).padded()
        cond_RD = self.text_proj_for_sos.ca(x_RTC, mask_RT).float()
        if taps is not None:
            taps.update(text_norm_out=x_NC, cond_BD=cond_RD, ca_kv=ca_NC)
        return cond_RD, ca_RTC, mask_RT

    def shared_adaln(self, cond_RD: torch.Tensor) -> torch.Tensor:
        """(R, 6, C) float32 shared AdaLN projection (γ1, γ2, s1, s2, b1, b2) before each block's ``ada_gss``."""
        R = cond_RD.shape[0]
        return self.shared_ada_lin(cond_RD.to(self.shared_ada_lin[1].weight.dtype)).float().view(R, 6, -1)

    def head_adaln(self, cond_RD: torch.Tensor) -> torch.Tensor:
        """(R, 2, C) float32: 1 + scale, shift of the head's AdaLN."""
        lin = self.head_nm.ada_lin
        ada = lin(cond_RD.to(lin[1].weight.dtype)).float().view(cond_RD.shape[0], 2, -1)
        return torch.stack((ada[:, 0] + 1, ada[:, 1]), dim=1)

    def logits(self, h_RlC: torch.Tensor, head_mod_R2C: torch.Tensor,
               ops: Optional[ElementwiseOps] = None) -> torch.Tensor:
        """Bit logits (R, l, 2d) float32: entries 2j / 2j+1 = bit j is 0 / 1. ``head_mod_R2C`` from
        :meth:`head_adaln`; fused ``ops`` run the LayerNorm + AdaLN in one kernel."""
        mul_R1C, shift_R1C = head_mod_R2C[:, 0:1], head_mod_R2C[:, 1:2]
        if ops is not None and ops.kind != "eager":
            y = ops.modulate(h_RlC, mul_R1C, shift_R1C, self.config.norm_eps, torch.float32)
        else:
            y = layer_norm_no_affine(h_RlC, self.config.norm_eps) * mul_R1C + shift_R1C
        return F.linear(y, self.head.weight.float(), self.head.bias.float())

    # ---- teacher forcing (training layout; used by the parity tests) --------------------------
    def forward(self, text: TextFeatures, x_BLd_wo_prefix: torch.Tensor, resolution: InfinityResolution,
                taps: Optional[dict] = None) -> torch.Tensor:
        """Logits (B, L, 2d) of every position given the next-scale inputs of scales 1.. (B, L − 1, d),
        with a block-causal mask. Position 0 is predicted from the start token. No text dropout.
        ``taps`` (a dict) receives intermediates: text_norm_out, cond_BD, ca_kv, ada_cond, block0_in,
        block0_out, last_block_out, rope_cos_sin."""
        hw = resolution.hw
        B, L = text.batch, sum(h * w for h, w in hw)
        if x_BLd_wo_prefix.shape[:2] != (B, L - 1):
            raise ValueError(f"x_BLd_wo_prefix must be ({B}, {L - 1}, d) for this schedule, got "
                             f"{tuple(x_BLd_wo_prefix.shape)}")
        device = self.pos_start.device
        text = text.to(device, torch.float32)
        cond_RD, ca_RTC, mask_RT = self.encode_text(text, taps)
        shared = self.shared_adaln(cond_RD)
        lvl_L = level_index(hw, device)
        sos_B1C = cond_RD.unsqueeze(1) + self.pos_start
        words = self.word_embed(x_BLd_wo_prefix.to(device, self.word_embed.weight.dtype)).float()
        x_BLC = torch.cat((sos_B1C, words), dim=1) + self.lvl_embed(lvl_L).float()
        cos, sin = rope_cos_sin(hw, resolution.rope_grid, self.head_dim)
        cos_LD, sin_LD, pos_L = cos.to(device), sin.to(device), torch.arange(L, device=device)
        scale_L = torch.repeat_interleave(torch.arange(len(hw)), torch.tensor([h * w for h, w in hw])).to(device)
        visible_LL = scale_L.view(L, 1) >= scale_L.view(1, L)                         # block-causal
        if taps is not None:
            taps.update(ada_cond=shared.unsqueeze(1), block0_in=x_BLC, rope_cos_sin=torch.stack((cos, sin)))
        blocks = self.blocks
        for i, blk in enumerate(blocks):
            k, v = blk.ca.text_kv(ca_RTC)
            ctx = _Call(kv=None, si=-1, layer=i, run=None, qkv_bias=blk.sa.qkv_bias(), q_mult=blk.sa.q_multiplier(),
                        cos_LD=cos_LD, sin_LD=sin_LD, start=0, pos=pos_L,
                        valid_Rl=None, record=False, ca=CrossMemory(k, v, mask_RT[:, None, None, :]),
                        attn_mask=visible_LL)
            x_BLC = blk(x_BLC, blk.modulation(shared), ctx)
            if taps is not None and i == 0:
                taps["block0_out"] = x_BLC
        if taps is not None:
            taps["last_block_out"] = x_BLC
        return self.logits(x_BLC, self.head_adaln(cond_RD))


# ---- presets ---------------------------------------------------------------------------------------------
# Official releases (research/infinity.md §1) and a tiny model for tests; VAE arguments of BSQVAE.
INFINITY_PRESETS: dict[str, dict] = {
    "infinity-2b": dict(transformer=dict(token_dim=32, depth=32, embed_dim=2048, num_heads=16, text_channels=2048,
                                         num_block_chunks=8),
                        vae=dict(codebook_dim=32, base_ch=128, ch_mult=(1, 2, 4, 4, 4), num_res_blocks=2, patch_size=16),
                        guidance_scale=3.0, temperature=0.5),
    "infinity-8b": dict(transformer=dict(token_dim=56, depth=40, embed_dim=3584, num_heads=28, text_channels=2048,
                                         num_block_chunks=8),
                        vae=dict(codebook_dim=14, base_ch=128, ch_mult=(1, 2, 4, 4), num_res_blocks=2, patch_size=8),
                        guidance_scale=3.0, temperature=1.0),
    "infinity-tiny": dict(transformer=dict(token_dim=32, depth=4, embed_dim=128, num_heads=4, text_channels=256,
                                           num_block_chunks=2),
                          vae=dict(codebook_dim=32, base_ch=32, ch_mult=(1, 1, 1, 1, 2), num_res_blocks=2,
                                   patch_size=16),
                          guidance_scale=3.0, temperature=0.5),
}


def infinity_loop_flops(cfg, hw: Sequence[tuple[int, int]], text_tokens: int, batch: int = 1, cfg_rows: int = 2,
                        tokens_per_scale: Optional[Sequence[float]] = None,
                        rows_per_scale: Optional[Sequence[int]] = None) -> float:
    """FLOPs of the scale loop (multiply-add = 2) for ``batch`` images with ``cfg_rows`` rows each
    (2 with guidance; ``rows_per_scale[k]`` overrides it per scale, 1 in cond-only mode), when scale
    k runs ``tokens_per_scale[k]`` tokens (default: all; 0 = skipped) and attends to the running
    sum. Text K/V are counted once (they are hoisted)."""
    C, depth, V = cfg.embed_dim, cfg.depth, 2 * cfg.token_dim
    hidden = ffn_hidden(C, cfg.mlp_ratio)
    rows = batch * cfg_rows
    total, prefix = 4.0 * text_tokens * C * C * depth * rows, 0.0
    for k, (h, w) in enumerate(hw):
        n = h * w if tokens_per_scale is None else tokens_per_scale[k]
        if n == 0:
            continue
        prefix += n
        per_layer = 2 * n * (4 * C * C + 2 * C * C + 2 * C * hidden) + 4 * n * prefix * C + 4 * n * text_tokens * C
        scale_rows = rows if rows_per_scale is None else batch * rows_per_scale[k]
        total += scale_rows * (depth * per_layer + 2 * h * w * C * V)
    return total


# ---- the engine adapter ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InfinityConditioning:
    """What one generation is conditioned on.

    prompt: packed T5 features of the B images' prompts.
    negative: features of B negative prompts, replacing the unconditional branch; None uses the
        learned table truncated to each prompt's length (the official default).
    temperature: τ, dividing the logits before guidance (official 2B: 0.5, 8B: 1.0).
    resolution: the output size (schedule and RoPE grid).
    """

    prompt: TextFeatures
    negative: Optional[TextFeatures] = None
    temperature: float = 1.0
    resolution: InfinityResolution = field(default=DEFAULT_RESOLUTION)


# The full KV cache (no shared last-scale tail) is kept up to this size: the tail costs one copy of
# each layer's cache at the last scale (4.6 ms of 240 for Infinity-2B at 1024² on an H100) and saves
# the last scale's K/V of all but one layer (2.0 GB there; 8.0 GB at 2048²)
KV_FULL_MAX_BYTES = 8 << 30
KV_FULL_MAX_DEVICE_FRACTION = 0.25


def kv_tail_needed(full_bytes: int, device: torch.device) -> bool:
    """Whether a KV cache of ``full_bytes`` should share one last-scale tail between its layers:
    when it is larger than 8 GiB, or than a quarter of the GPU's memory (so that a 16 GB card keeps
    the smaller cache at 1024² and an 80 GB one the faster one). Both forms give the same numbers."""
    if device.type != "cuda":
        return full_bytes > KV_FULL_MAX_BYTES
    total = torch.cuda.get_device_properties(device).total_memory
    return full_bytes > min(KV_FULL_MAX_BYTES, KV_FULL_MAX_DEVICE_FRACTION * total)


class _InfinityWorkspace(Workspace):
    """Buffers of one batch size and schedule, reused across generations of the same shape. The adapter
    keeps one at a time (``InfinityAdapter.begin``): a call of another shape frees it first."""

    def __init__(self, model: InfinityTransformer, batch: int, resolution: InfinityResolution, vae_dim: int,
                 patchify: bool, device, dtype, kv_tail="auto"):
        super().__init__()
        cfg = model.config
        R, C, N = 2 * batch, cfg.embed_dim, cfg.depth
        hw = resolution.hw
        L = sum(h * w for h, w in hw)
        last = hw[-1][0] * hw[-1][1]
        if kv_tail not in ("auto", True, False):
            raise ValueError(f"kv_tail={kv_tail!r}: choose 'auto', True (a last-scale tail shared by the layers) "
                             f"or False (the whole cache per layer)")
        full_bytes = 2 * N * R * L * C * torch.empty((), dtype=dtype).element_size()
        self.kv_tail = kv_tail_needed(full_bytes, torch.device(device)) if kv_tail == "auto" else bool(kv_tail)
        if self.kv_tail:
            # nothing attends to the last scale's keys afterwards: it gets a tail shared by all layers
            # (2B in bf16, tail included: 1024² 3.5 GB of K/V instead of 5.5 GB; 2048² 10.9 GB instead of 18.9)
            self._kv_args = (N, R, cfg.num_heads, model.head_dim, L - last, dtype, device)
            self._kv_transient = last
        else:
            self._kv_args = (N, R, cfg.num_heads, model.head_dim, L, dtype, device)
            self._kv_transient = 0
        self.kv: Optional[KVCache] = None
        self.ensure_kv()
        H, W = hw[-1]
        if patchify:
            H, W = 2 * H, 2 * W
        self.summed_BdHW = torch.zeros(batch, vae_dim, H, W, device=device, dtype=torch.float32)
        # every scale's next-scale input (B, L, d), written by accumulate, read by stage_input
        self.next_BLD = torch.zeros(batch, L, cfg.token_dim, device=device, dtype=torch.float32)
        self.ones_R1C = torch.ones(R, 1, C, device=device, dtype=torch.float32)
        self.ada_NR6C = torch.zeros(N, R, 6, C, device=device, dtype=torch.float32)
        self.head_mod_R2C = torch.zeros(R, 2, C, device=device, dtype=torch.float32)
        self.sos_R1C = torch.zeros(R, 1, C, device=device, dtype=torch.float32)
        self.positions_L = torch.arange(L, device=device)
        self.qkv_bias_N3C = torch.zeros(N, 3 * C, device=device, dtype=dtype)
        self.q_mult_NH1 = torch.zeros(N, cfg.num_heads, 1, device=device, dtype=torch.float32)
        cos, sin = rope_cos_sin(hw, resolution.rope_grid, model.head_dim)
        self.cos_LD, self.sin_LD = cos.to(device), sin.to(device)
        # the text memory of every layer's cross-attention (set_text), padded to a bucket of TEXT_BUCKET
        # tokens on CUDA so that prompts of similar length share captured graphs
        self._ca_args = (N, R, cfg.num_heads, model.head_dim, dtype, device)
        self.ca_k_NRHTd: Optional[torch.Tensor] = None
        self.ca_v_NRHTd: Optional[torch.Tensor] = None
        self.ca_valid_R11T: Optional[torch.Tensor] = None
        self.ca_masked = False
        self.ca_kq_NRMC: Optional[torch.Tensor] = None      # absorbed form (M = H·T): see set_text
        self.ca_bias_NR1M: Optional[torch.Tensor] = None
        self.ca_vo_NRMC: Optional[torch.Tensor] = None
        self.image_buffer: Optional[torch.Tensor] = None   # decoded images of graphed runs (see decode)
        self.graph_inputs = None              # what captured graphs point at (weights, KV cache, text buffers)

    def set_text(self, blocks: Sequence[InfinityBlock], ca_RTC: torch.Tensor, lens: Sequence[int],
                 absorb: str = "auto") -> None:
        """Compute every layer's text memory from the projected T5 features ``ca_RTC`` (R, T, C) into
        the static buffers; keys past a row's prompt length are masked out.

        absorb: ``"auto"`` folds each layer's query and output projections into the memory
        (``_blocks.absorb_cross_attention``) where ``absorbs_cross_attention`` says so — less work
        (H·T ≤ C/2 for the padded length T) and at most 1 GiB of buffers — and otherwise stores
        K/V; ``"always"`` / ``"never"`` force one form (``InfinityAdapter.absorb_cross_attention``)."""
        N, Rmax, H, d, dtype, device = self._ca_args
        R, T, _ = ca_RTC.shape
        C = H * d
        bucket = TEXT_BUCKET if device.type == "cuda" else 1
        Tb = -(-T // bucket) * bucket
        if absorb not in ("auto", "always", "never"):
            raise ValueError(f"absorb_cross_attention={absorb!r}: choose 'auto', 'always' or 'never'")
        absorbed_bytes = 2 * N * Rmax * H * Tb * C * torch.empty((), dtype=dtype).element_size()
        absorbed = absorb == "always" or (absorb == "auto" and absorbs_cross_attention(H, Tb, C, absorbed_bytes))
        lens_R = torch.tensor(list(lens), device=device)
        valid_RT = torch.arange(Tb, device=device)[None, :] < lens_R[:, None]           # (R, Tb)
        if absorbed:
            if self.ca_kq_NRMC is None or self.ca_kq_NRMC.shape[2] != H * Tb:
                self.ca_k_NRHTd = self.ca_v_NRHTd = self.ca_valid_R11T = None
                self.ca_kq_NRMC = torch.zeros(N, Rmax, H * Tb, C, device=device, dtype=dtype)
                self.ca_vo_NRMC = torch.zeros_like(self.ca_kq_NRMC)
                self.ca_bias_NR1M = torch.zeros(N, Rmax, 1, H * Tb, device=device, dtype=torch.float32)
            for i, blk in enumerate(blocks):
                k_RHTd, v_RHTd = blk.ca.text_kv(ca_RTC)
                mem = blk.ca.absorb(k_RHTd, v_RHTd, valid_RT[:, :T])
                self.ca_kq_NRMC[i, :R].view(R, H, Tb, C)[:, :, :T].copy_(mem.kq_RNC.view(R, H, T, C))
                self.ca_vo_NRMC[i, :R].view(R, H, Tb, C)[:, :, :T].copy_(mem.vo_RNC.view(R, H, T, C))
                bias_RHTb = self.ca_bias_NR1M[i, :R].view(R, H, Tb)
                bias_RHTb.fill_(float("-inf"))                      # the bucket's padding: never attended
                bias_RHTb[:, :, :T].copy_(mem.bias_R1N.view(R, H, T))
            self.ca_masked = False
            return
        if self.ca_k_NRHTd is None or self.ca_k_NRHTd.shape[3] != Tb:
            self.ca_kq_NRMC = self.ca_vo_NRMC = self.ca_bias_NR1M = None
            self.ca_k_NRHTd = torch.zeros(N, Rmax, H, Tb, d, device=device, dtype=dtype)
            self.ca_v_NRHTd = torch.zeros_like(self.ca_k_NRHTd)
            self.ca_valid_R11T = torch.zeros(Rmax, 1, 1, Tb, device=device, dtype=torch.bool)
        for i, blk in enumerate(blocks):
            k_RHTd, v_RHTd = blk.ca.text_kv(ca_RTC)
            self.ca_k_NRHTd[i, :R, :, :T].copy_(k_RHTd)
            self.ca_v_NRHTd[i, :R, :, :T].copy_(v_RHTd)
        self.ca_valid_R11T[:R, 0, 0].copy_(valid_RT)
        # equal lengths filling the buffer need no key mask (keeps the fast SDPA kernels available)
        self.ca_masked = any(n != Tb for n in lens)

    @property
    def ca_absorbed(self) -> bool:
        return self.ca_kq_NRMC is not None

    def text_memory(self, layer: int):
        """``layer``'s cross-attention memory, all rows: an ``AbsorbedCrossMemory`` or a ``CrossMemory``."""
        if self.ca_absorbed:
            return AbsorbedCrossMemory(self.ca_kq_NRMC[layer], self.ca_bias_NR1M[layer], self.ca_vo_NRMC[layer],
                                       self._ca_args[2])
        return CrossMemory(self.ca_k_NRHTd[layer], self.ca_v_NRHTd[layer], self.ca_valid_R11T if self.ca_masked else None)

    def text_buffers(self) -> tuple:
        """Addresses of the text-memory buffers, which captured graphs read."""
        bufs = (self.ca_kq_NRMC, self.ca_bias_NR1M, self.ca_vo_NRMC) if self.ca_absorbed else \
            (self.ca_k_NRHTd, self.ca_v_NRHTd, self.ca_valid_R11T)
        return tuple(b.data_ptr() for b in bufs)

    def check_graphs(self, model: "InfinityTransformer") -> None:
        """Drop captured graphs whose buffers moved (a re-allocated KV cache, weights moved away and
        back by offloading, another text bucket or mask): they would read freed memory."""
        inputs = (tuple(p.data_ptr() for p in model.parameters()), self.kv.storage_ptrs(),
                  self.text_buffers(), self.ca_absorbed, self.ca_masked)
        if inputs != self.graph_inputs:
            self.graphs.clear()
            self.graph_inputs = inputs

    def ensure_kv(self) -> KVCache:
        """The KV cache, allocated again if :meth:`drop_kv` freed it for the decoder."""
        if self.kv is None:
            self.kv = KVCache(*self._kv_args, transient=self._kv_transient)
        return self.kv

    def drop_kv(self) -> None:
        """Free the KV cache before the VAE decodes: the decoder's activations can then reuse its
        memory, so the peak is the larger of the two phases, not their sum (2B at 2048²: 10 GB of
        K/V against a decoder working on 2048² maps)."""
        self.kv = None


class InfinityAdapter:
    """The engine's view of an Infinity transformer + its BSQ-VAE (engine/adapter.py).

    Conditioning is an :class:`InfinityConditioning`; rows through the transformer are
    [cond (B); uncond (B)] while guidance is on (guidance_scale != 1). Guidance: logits/τ, then
    cfg·cond + (1 − cfg)·uncond per bit pair. Sampling: top-k / top-p and one draw per bit.
    """

    family = "infinity"
    supports_cuda_graphs = True
    supports_scale_graphs = False    # its sample takes no pre-drawn noise: guidance and sampling stay eager

    def __init__(self, transformer: InfinityTransformer, vae, resolution: InfinityResolution = DEFAULT_RESOLUTION):
        d_tok, d_vae = transformer.config.token_dim, vae.config.codebook_dim
        if d_tok == d_vae:
            self.patchify = False
        elif d_tok == 4 * d_vae:
            self.patchify = True
        else:
            raise ValueError(f"transformer and VAE do not match: the transformer reads {d_tok}-bit tokens, the VAE has "
                             f"{d_vae} bits per position (expected {d_tok}, or {d_tok // 4} for a 2×2-patchify VAE); "
                             f"pass the VAE the transformer was trained with")
        self.transformer, self.vae = transformer, vae
        self.graph_streams = GraphStreams()
        self._code = code_value(d_vae)                 # every code entry is ±this (1/√d of the VAE's bits)
        self.resolution = resolution
        self.schedule = resolution.schedule
        self.num_layers = transformer.config.depth
        self._workspace: Optional[_InfinityWorkspace] = None
        self._workspace_key = None
        self.ops = EAGER_OPS
        # "auto" | "always" | "never": fold the cross-attention's projections into the text memory
        # (_InfinityWorkspace.set_text); "auto" does where that is less work (short prompts)
        self.absorb_cross_attention = "auto"
        # "auto" | True | False: give the last scale's K/V one buffer shared by the layers (kv_tail_needed)
        self.kv_tail = "auto"

    def set_compiled_elementwise(self, enabled) -> None:
        """Fuse the blocks' elementwise steps (CUDA + Triton only): ``True`` / ``"fused"`` for the
        hand-written kernels (LayerNorm + AdaLN with the residual add; q/k norm + RoPE + KV-cache
        write), ``"compile"`` for torch.compile alone, ``False`` for eager."""
        kind = {False: "eager", True: "fused"}.get(enabled, enabled)
        if kind != self.ops.kind:
            self.ops = EAGER_OPS if kind == "eager" else ElementwiseOps(kind=kind)
            self.release()

    @property
    def device(self) -> torch.device:
        return self.transformer.pos_start.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.block_dtype()

    def model_info(self) -> ModelInfo:
        return ModelInfo(family=self.family, schedule=self.schedule, num_layers=self.num_layers,
                         layer_groups=self.transformer.config.num_block_chunks,
                         sublayers=("self_attn", "cross_attn", "ffn"))

    def release(self) -> None:
        """Free the workspace (KV cache, CUDA graphs); on the CPU, hand the freed memory back to the
        operating system (engine/memory.py)."""
        ws, self._workspace, self._workspace_key = self._workspace, None, None
        if ws is not None:
            device = ws.summed_BdHW.device
            del ws
            trim_host_heap(device)

    # ---- adapter interface ----------------------------------------------------------------------
    @torch.no_grad()
    def begin(self, run: RunState, cond: InfinityConditioning) -> None:
        """Set up a generation. One workspace is kept at a time: the last call's, reused when the
        batch size, resolution, device, dtype and ``kv_tail`` match, else freed before the new one
        is made (memory is bounded by the largest shape in flight, not by every shape seen)."""
        m, B = self.transformer, run.batch_size
        if not isinstance(cond, InfinityConditioning):
            raise TypeError(f"Infinity conditioning must be an InfinityConditioning, got {type(cond).__name__}")
        if cond.prompt.batch != B:
            raise ValueError(f"{cond.prompt.batch} prompts for a batch of {B} images")
        if cond.negative is not None and cond.negative.batch != B:
            raise ValueError(f"{cond.negative.batch} negative prompts for a batch of {B} images")
        if run.schedule.hw != cond.resolution.hw:
            raise ValueError(f"the run's schedule {run.schedule} is not that of {cond.resolution}")
        res = cond.resolution
        key = (B, res.hw, res.rope_grid, self.device, self.dtype, self.kv_tail)
        if self._workspace_key != key:
            self.release()                           # one workspace at a time: a KV cache can be gigabytes
            self._workspace = _InfinityWorkspace(m, B, res, self.vae.config.codebook_dim, self.patchify,
                                                 self.device, self.dtype, self.kv_tail)
            self._workspace_key = key
        ws = self._workspace
        run.cfg_active = float(run.settings.guidance_scale) != 1.0
        text = cond.prompt
        if run.cfg_active:
            text = TextFeatures.cat([cond.prompt, cond.negative if cond.negative is not None
                                     else m.uncond_text(cond.prompt.lens)])
        R = text.batch
        cond_RD, ca_RTC, mask_RT = m.encode_text(text.to(self.device, torch.float32))
        ws.sos_R1C[:R].copy_(cond_RD.unsqueeze(1) + m.pos_start + m.lvl_embed.weight[0].float())
        shared = m.shared_adaln(cond_RD)
        blocks = m.blocks
        for i, blk in enumerate(blocks):
            ws.ada_NR6C[i, :R].copy_(blk.modulation(shared))
            ws.qkv_bias_N3C[i].copy_(blk.sa.qkv_bias())
            ws.q_mult_NH1[i].copy_(blk.sa.q_multiplier())
        ws.set_text(blocks, ca_RTC, text.lens, self.absorb_cross_attention)
        ws.head_mod_R2C[:R].copy_(m.head_adaln(cond_RD))
        run.model_state.update(temperature=float(cond.temperature))
        ws.summed_BdHW.zero_()
        ws.ensure_kv().reset()
        ws.check_graphs(m)
        if run.cuda_graphs and ws.image_buffer is None:          # see decode: made while the KV cache is held
            H, W = res.hw[-1]
            ws.image_buffer = torch.empty(B, 3, H * VAE_STRIDE, W * VAE_STRIDE, device=self.device)
        if not run.cfg_active:
            ws.kv.keep_rows(B)
        run.workspace = ws

    def stage_input(self, si: int, run: RunState) -> torch.Tensor:
        """The full token map entering the blocks at scale ``si``: (R, h·w, C) float32 (level embedding
        included)."""
        ws, R, B = run.workspace, run.rows, run.batch_size
        if si == 0:
            return ws.sos_R1C[:R]
        m = self.transformer
        start, end = run.schedule.offsets[si], run.schedule.offsets[si + 1]
        next_BlD = ws.next_BLD[:, start:end]
        x_BlC = m.word_embed(next_BlD.to(m.word_embed.weight.dtype)).float() + m.lvl_embed.weight[level(si)].float()
        return x_BlC.repeat(R // B, 1, 1)                                            # same tokens for both CFG halves

    @torch.no_grad()
    def compute_scale(self, si: int, plan: ScalePlan, run: RunState, graphs=None) -> Optional[torch.Tensor]:
        """Raw float32 bit logits of every row, (R, h·w, 2d); reads only workspace buffers.

        With ``graphs`` (the engine's CUDA-graph runner) the layer stack — stage input, gather,
        layers, scatter — is replayed from a graph keyed by scale and subset size; the policies'
        taps are read from it afterwards, and post_hidden and the head run eagerly. Returns None
        when the graph cannot be used (the engine then calls again without it)."""
        if graphs is not None:
            x_RLC = self._layers_graphed(si, plan, run, graphs)
            if x_RLC is None:
                return None
        else:
            idx = plan.token_index.to(self.device, torch.long) if plan.token_index is not None else None
            valid = plan.token_valid.to(self.device) if plan.token_valid is not None else None
            x_RLC, _ = self._layers(si, idx, valid, run)
        x_RLC = run.policies.post_hidden(si, x_RLC, run)
        return self.transformer.logits(x_RLC, run.workspace.head_mod_R2C[:run.rows], self.ops)

    def _layers_graphed(self, si: int, plan: ScalePlan, run: RunState, graphs) -> Optional[torch.Tensor]:
        return graphs.layer_stack(si, plan, run, lambda idx_Bn, collect: self._layers(si, idx_Bn, None, run, collect))

    def _layers(self, si: int, idx_Bn: Optional[torch.Tensor], valid_Bn: Optional[torch.Tensor],
                run: RunState, collect: bool = False):
        """Stage input → gather ``idx_Bn`` (None: every token) → blocks → scatter: (x, taps). The
        tapped layers' (``run.hooks``) input and output go to the policies' observe, or with
        ``collect`` are returned instead."""
        ws, R, B = run.workspace, run.rows, run.batch_size
        stack = run.policies
        x0_RLC = self.stage_input(si, run)
        start, L = run.schedule.offsets[si], x0_RLC.shape[1]
        kv = ws.kv
        valid_Rn = None
        if idx_Bn is not None:
            idx_Rn = idx_Bn.repeat(R // B, 1)                                          # one token set per image
            x_RlC = gather_rows(x0_RLC, idx_Rn)                                      # (R, L, C) → (R, n, C)
            pos = idx_Rn + start
            if valid_Bn is not None:
                valid_Rn = valid_Bn.repeat(R // B, 1)
        else:
            idx_Rn = None
            x_RlC = x0_RLC
            pos = ws.positions_L[start:start + L]
        record = len(set(kv.lengths)) > 1              # layers out of step (per-layer pruning): record per layer
        if not record:
            kv.record_positions(kv.lengths[0], pos)    # layers in step: one write for all ((L,) or (R, n))
        hooks, collected = run.hooks, []
        rope_l = _Call(kv=None, si=si, layer=-1, run=None, qkv_bias=None, q_mult=None, cos_LD=ws.cos_LD,
                       sin_LD=ws.sin_LD, start=start, pos=pos, valid_Rl=None, record=False, ca=None).rope(pos)
        blocks = self.transformer.blocks
        # fused elementwise kernels, and layers no sub-layer wrapper changes: chain each residual add
        # with the next norm
        chained = [self.ops.kind != "eager" and not hooks.wraps(i) for i in range(len(blocks))]
        y_RlC = None                                   # a chained layer's modulated self-attention input
        for i, blk in enumerate(blocks):
            x_in = x_RlC
            call = _Call(kv=kv, si=si, layer=i, run=run, qkv_bias=ws.qkv_bias_N3C[i], q_mult=ws.q_mult_NH1[i],
                         cos_LD=ws.cos_LD, sin_LD=ws.sin_LD, start=start, pos=pos, valid_Rl=valid_Rn, record=record,
                         ca=ws.text_memory(i), rope_l=rope_l, ops=self.ops)
            if chained[i]:
                if y_RlC is None:
                    y_RlC = self.ops.modulate(x_RlC, ws.ada_NR6C[i, :R, 2:3], ws.ada_NR6C[i, :R, 4:5], blk.norm_eps,
                                              blk.ffn.fc1.weight.dtype)
                next_mod = ws.ada_NR6C[i + 1, :R] if i + 1 < len(blocks) and chained[i + 1] else None
                x_RlC, y_RlC = blk.forward_chained(x_RlC, y_RlC, ws.ada_NR6C[i, :R], next_mod, call, ws.ones_R1C)
            else:
                x_RlC, y_RlC = blk(x_RlC, ws.ada_NR6C[i, :R], call), None
            if hooks.tapped(i):
                if collect:
                    collected.append((i, x_in, x_RlC))
                else:
                    stack.observe(si, ("layer", i), x_in, x_RlC, run)
        if idx_Rn is not None:
            x_RlC = scatter_rows(x0_RLC, idx_Rn, x_RlC)                              # (R, n, C) → (R, L, C)
        return x_RlC, collected

    def guide(self, si: int, logits_RlV: torch.Tensor, run: RunState) -> torch.Tensor:
        """logits/τ, then cfg·cond + (1 − cfg)·uncond (the reference's order of operations)."""
        inv_tau = 1.0 / run.model_state["temperature"]
        B = run.batch_size
        if not run.cfg_active:
            return logits_RlV[:B].mul(inv_tau)
        cfg = float(run.settings.guidance_scale)
        scaled = logits_RlV.mul(inv_tau)
        return cfg * scaled[:B] + (1 - cfg) * scaled[B:]

    def sample(self, si: int, guided_BlV: torch.Tensor, run: RunState) -> torch.Tensor:
        """One draw per bit: (B, l, 2d) logits → (B, l, d) int64 bits (top-k / top-p over each bit's
        two values; only top_k = 1 changes anything — greedy)."""
        B, l, V = guided_BlV.shape
        s = run.settings
        bits_Bn = sample_codes_per_image(guided_BlV.reshape(B, l * V // 2, 2), s.top_k, s.top_p, run.generator)
        return bits_Bn.view(B, l, V // 2)                                             # (B, l·d) → (B, l, d)

    def residual(self, si: int, bits_Bld: torch.Tensor, run: RunState) -> torch.Tensor:
        """Per-token codes ±1/√d (B, h·w, d) float32 (with patchify, d = 4 × the VAE's bits)."""
        return torch.where(bits_Bld.bool(), self._code, -self._code).float()

    @torch.no_grad()
    def accumulate(self, si: int, residual_BlD: torch.Tensor, run: RunState) -> None:
        ws, sch = run.workspace, run.schedule
        h, w = sch.hw[si]
        B, l, D = residual_BlD.shape
        codes_BDhw = residual_BlD.transpose(1, 2).reshape(B, D, h, w)                   # (B, hw, D) → (B, D, h, w)
        if self.patchify:
            codes_BDhw = F.pixel_shuffle(codes_BDhw, 2)                               # (B, 4d, h, w) → (B, d, 2h, 2w)
        if si == sch.num_scales - 1:
            ws.summed_BdHW.add_(codes_BDhw)                                          # full size already
            return
        ws.summed_BdHW.add_(upsample_codes(codes_BDhw, ws.summed_BdHW.shape[-2:]))
        start, end = sch.offsets[si + 1], sch.offsets[si + 2]
        ws.next_BLD[:, start:end].copy_(next_scale_input(ws.summed_BdHW, sch.hw[si + 1], self.patchify))

    def drop_uncond(self, run: RunState) -> None:
        run.workspace.kv.keep_rows(run.batch_size)

    def latent(self, run: RunState) -> torch.Tensor:
        return run.workspace.summed_BdHW

    @torch.no_grad()
    def decode(self, run: RunState) -> torch.Tensor:
        ws = run.workspace
        ws.drop_kv()                                   # the scale loop is over: lend the cache's memory to the decoder
        img = self.vae.decode(ws.summed_BdHW)
        if not run.cuda_graphs:
            return (img + 1) * 0.5                                                   # [-1, 1] → [0, 1]
        # Captured graphs hold the cache's addresses. Allocated again while anything the decoder
        # made is still alive, the cache can land elsewhere and every graph would be captured again
        # (measured: 0.8 s instead of 0.1 s per call). So the image goes to a buffer made before the
        # loop, the decoder's memory is released, and the cache is taken back at once.
        out = ws.image_buffer
        out.copy_(img)
        del img
        ws.ensure_kv()
        return out.add_(1).mul_(0.5).clone()                                         # [-1, 1] → [0, 1]

    def end(self, run: RunState, keep_workspace: bool) -> None:
        run.workspace = None
        if not keep_workspace:
            self.release()


__all__ = ["InfinityTransformer", "InfinityAdapter", "InfinityConditioning", "InfinityResolution", "INFINITY_PRESETS",
           "INFINITY_TEMPLATES", "PN_SCALES", "ZERO_SHOT_PN", "zero_shot_resolutions", "DEFAULT_RESOLUTION", "infinity_resolution", "infinity_resolutions",
           "resolve_resolution", "rope_cos_sin", "rope_positions", "infinity_loop_flops", "text_pool_heads",
           "ffn_hidden"]
