"""Infinity (FoundationVision/Infinity): the bitwise text-to-image transformer.

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
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from ...engine.contract import SubLayer, SubLayerContext
from ...engine.layers import LayerCall
from ...sparse_ops.attention import dense_attention
from ...sparse_ops.kernels import TORCH_KERNELS, Kernels, dense_linear
from .._blocks import (AbsorbedCrossMemory, CosineSelfAttentionWeights, CrossMemory, TanhGeluFFN,
                       absorb_cross_attention, absorbed_cross_attention, layer_norm_no_affine, trunc_normal_init_,
                       weights_key)
from ..text_encoder import TextFeatures
from .resolution import InfinityResolution, level_index, rope_at, rope_cos_sin


# ---- layers --------------------------------------------------------------------------------------------
class _Call(LayerCall):
    """Where an Infinity block runs (engine/layers.py; ``kv`` None in teacher forcing, with
    ``attn_mask`` instead), with the layer's per-image constants, the RoPE tables of the whole
    schedule (and ``rope_l``: those of ``pos``, gathered once per scale), and the text memory of the
    cross-attention (``ca``: a ``CrossMemory`` or an ``AbsorbedCrossMemory``, all rows)."""

    __slots__ = ("qkv_bias", "q_mult", "cos_LD", "sin_LD", "ca", "attn_mask", "rope_l")

    def __init__(self, *, kv, si, layer, run, qkv_bias, q_mult, cos_LD, sin_LD, pos, valid_Rl, record, ca,
                 attn_mask=None, rope_l=None, ops: Kernels = TORCH_KERNELS):
        super().__init__(kv, si, layer, run, ops, pos, valid_Rl, record)
        self.qkv_bias, self.q_mult, self.cos_LD, self.sin_LD = qkv_bias, q_mult, cos_LD, sin_LD
        self.ca, self.attn_mask, self.rope_l = ca, attn_mask, rope_l

    def rope(self, pos: torch.Tensor):
        """cos, sin for positions (l,) → (1, l, 1, D) or (R, n) → (R, n, 1, D)."""
        if pos is self.pos and self.rope_l is not None:
            return self.rope_l
        return rope_at(self.cos_LD, self.sin_LD, pos)


class InfinitySelfAttention(CosineSelfAttentionWeights):
    """Cosine self-attention with 2-D RoPE (q, k L2-normalised, q times its head's temperature,
    then rotated; softmax scale 1)."""

    def q_multiplier(self) -> torch.Tensor:
        """(H, 1) float32: q's temperature exp(min(τ, ln 100)) per head."""
        return self.temperature().view(-1, 1)

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
            k_dst, v_dst = ctx.reserve(l, idx_Rn, pos, valid)
            # cosine q/k (float32), q's temperature, RoPE, and the cache write: one step
            q = ctx.ops.qk_norm_rope_store(qkv_Rl3Hd, ctx.q_mult, cos, sin, k_dst, v_dst)  # (R, H, l, d)
            k, v = ctx.kv.view(ctx.layer)
            attn_mask = ctx.kv.key_mask(ctx.layer)
            if ctx.run.hooks.attends(ctx.layer):
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

    def forward(self, y_RlC: torch.Tensor, mem, ops: Optional[Kernels] = None) -> torch.Tensor:
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

    weights_key = weights_key                    # (models/_blocks.py)

    def weight_constants(self, qkv_bias_N3C: torch.Tensor, q_mult_NH1: torch.Tensor,
                         ada_gss_N6C: torch.Tensor) -> None:
        """Fill every block's qkv bias (depth, 3C), q multiplier (depth, H, 1) and learned AdaLN
        offset ``ada_gss`` as float32 (depth, 6, C): functions of the weights alone, computed once
        per workspace and set of weights."""
        for i, blk in enumerate(self.blocks):
            qkv_bias_N3C[i].copy_(blk.sa.qkv_bias())
            q_mult_NH1[i].copy_(blk.sa.q_multiplier())
            ada_gss_N6C[i].copy_(blk.ada_gss[0, 0])

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
               ops: Optional[Kernels] = None) -> torch.Tensor:
        """Bit logits (R, l, 2d) float32: entries 2j / 2j+1 = bit j is 0 / 1. ``head_mod_R2C`` from
        :meth:`head_adaln`; fused ``ops`` run the LayerNorm + AdaLN in one kernel."""
        mul_R1C, shift_R1C = head_mod_R2C[:, 0:1], head_mod_R2C[:, 1:2]
        if ops is not None and ops.kind != "torch":
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
                        cos_LD=cos_LD, sin_LD=sin_LD, pos=pos_L,
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
                        vae=dict(codebook_dim=32, base_ch=128, ch_mult=(1, 2, 4, 4, 4), num_res_blocks=2, patch_size=16)),
    "infinity-8b": dict(transformer=dict(token_dim=56, depth=40, embed_dim=3584, num_heads=28, text_channels=2048,
                                         num_block_chunks=8),
                        vae=dict(codebook_dim=14, base_ch=128, ch_mult=(1, 2, 4, 4), num_res_blocks=2, patch_size=8)),
    "infinity-tiny": dict(transformer=dict(token_dim=32, depth=4, embed_dim=128, num_heads=4, text_channels=256,
                                           num_block_chunks=2),
                          vae=dict(codebook_dim=32, base_ch=32, ch_mult=(1, 1, 1, 1, 2), num_res_blocks=2,
                                   patch_size=16)),
}


def infinity_loop_flops(cfg, hw: Sequence[tuple[int, int]], text_tokens: int, batch: int = 1, cfg_rows: int = 2,
                        tokens_per_scale: Optional[Sequence[float]] = None,
                        rows_per_scale: Optional[Sequence[int]] = None,
                        kv_per_scale: Optional[Sequence[float]] = None) -> float:
    """FLOPs of the scale loop (multiply-add = 2) for ``batch`` images with ``cfg_rows`` rows each
    (2 with guidance; ``rows_per_scale[k]`` overrides it per scale, 1 in cond-only mode), when scale
    k runs ``tokens_per_scale[k]`` tokens (default: all; 0 = skipped) and attends to
    ``kv_per_scale[k]`` cached tokens (default: the running sum). Text K/V are counted once (they
    are hoisted)."""
    C, depth, V = cfg.embed_dim, cfg.depth, 2 * cfg.token_dim
    hidden = ffn_hidden(C, cfg.mlp_ratio)
    rows = batch * cfg_rows
    total, prefix = 4.0 * text_tokens * C * C * depth * rows, 0.0
    for k, (h, w) in enumerate(hw):
        n = h * w if tokens_per_scale is None else tokens_per_scale[k]
        if n == 0:
            continue
        prefix += n
        kv = prefix if kv_per_scale is None else kv_per_scale[k]
        per_layer = 2 * n * (4 * C * C + 2 * C * C + 2 * C * hidden) + 4 * n * kv * C + 4 * n * text_tokens * C
        scale_rows = rows if rows_per_scale is None else batch * rows_per_scale[k]
        total += scale_rows * (depth * per_layer + 2 * h * w * C * V)
    return total
