"""Class-conditional VAR (FoundationVision/VAR): the transformer and its engine adapter.

Architecture (research/var.md §3), reproduced exactly so the official ``var_d*.pth`` files load
key for key:
- a class embedding with a null class (row ``num_classes``) that is both the start token and the
  AdaLN condition; absolute position (``pos_1LC``) and level (``lvl_embed``) embeddings;
- blocks ``x += γ1·Attn(LN(x)·(1+s1)+b1)``, ``x += γ2·FFN(LN(x)·(1+s2)+b2)`` with the AdaLN chunk
  order γ1, γ2, s1, s2, b1, b2, LayerNorm without affine (eps 1e-6), a tanh-GELU FFN;
- cosine attention: q, k L2-normalised, q times the per-head temperature exp(min(τ, ln 100)),
  softmax scale 1, key bias fixed at zero;
- head: LN(x)·(1+scale)+shift (AdaLN, order scale, shift) → Linear(C → V), logits in float32;
- d36 ("shared AdaLN"): one ``shared_ada_lin`` plus a learned per-block ``ada_gss``.

Inference differs from the reference in ways that do not change the numbers: the AdaLN
projections are computed once per image instead of once per scale, the KV cache is preallocated,
and the residual stream stays in float32 while the linear layers run in the weight dtype (what
the reference gets from autocast).
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from ..engine.kv_cache import KVCache
from ..engine.layers import LayerCall
from ..engine.sampling import sample_codes_per_image, takes_drawn_noise
from ..engine.schedule import ScaleSchedule
from ..engine.state import RunState
from ..engine.contract import SubLayer, SubLayerContext
from ..engine.adapter import ModelAdapter
from ..engine.workspace import Workspace
from ..sparse_ops.attention import dense_attention, use_fused_cache_attention
from ..sparse_ops.gemm_rows import empty_rows
from ..sparse_ops.kernels import TORCH_KERNELS, Kernels
from ._blocks import (CosineSelfAttentionWeights, TanhGeluFFN, decode_graph_key, layer_norm_no_affine,
                      trunc_normal_init_, weight_ptrs, weights_key)
from .vqvae import bicubic_operator

# Patch schedules of the official training arguments (--pn); image side = 16 × last entry.
VAR_SCHEDULES: dict[int, tuple[int, ...]] = {
    256: (1, 2, 3, 4, 5, 6, 8, 10, 13, 16),
    512: (1, 2, 3, 4, 6, 9, 13, 18, 24, 32),
    1024: (1, 2, 3, 4, 5, 7, 9, 12, 16, 21, 27, 36, 48, 64),
}

# Official releases: depth d → width 64·d, heads d; d36 is the 512-px shared-AdaLN model.
VAR_PRESETS: dict[str, dict] = {
    f"var-d{d}": dict(depth=d, embed_dim=64 * d, num_heads=d, shared_aln=(d == 36),
                      patch_nums=VAR_SCHEDULES[512 if d == 36 else 256])
    for d in (16, 20, 24, 30, 36)
}
# A small model for smoke tests and the README's first command until a trained demo model ships.
VAR_PRESETS["var-tiny"] = dict(depth=4, embed_dim=256, num_heads=4, shared_aln=False, patch_nums=VAR_SCHEDULES[256])

class VARSelfAttention(CosineSelfAttentionWeights):
    """Cosine self-attention over this scale's tokens and everything in the KV cache: q, k
    L2-normalised, q times its head's temperature, softmax scale 1."""

    def qk_multiplier(self) -> torch.Tensor:
        """(2, H, 1) float32: q's temperature exp(min(τ, ln 100)) and k's 1, per head."""
        temperature_H = self.temperature()
        return torch.stack((temperature_H, torch.ones_like(temperature_H))).unsqueeze(-1)

    def forward(self, x_RlC: torch.Tensor, ctx: Optional["_LayerCall"] = None,
                attn_mask: Optional[torch.Tensor] = None, idx_Rn: Optional[torch.Tensor] = None,
                project: bool = True) -> torch.Tensor:
        """Attention of tokens ``x_RlC``; during generation their K/V join the cache first.
        ``idx_Rn`` says which of the layer's current tokens these are, when a policy runs a subset.
        ``project=False`` returns the heads' output (R, l, C) before the output projection."""
        R, l, C = x_RlC.shape
        H, d = self.num_heads, self.head_dim
        ops = ctx.ops if ctx is not None else TORCH_KERNELS
        bias = ctx.qkv_bias if ctx is not None else self.qkv_bias()
        mult = ctx.qk_mult if ctx is not None else self.qk_multiplier()
        qkv_Rl3Hd = ops.linear(x_RlC, self.mat_qkv.weight, bias).view(R, l, 3, H, d)
        out = None
        if ctx is None:
            qk_Rl2Hd = ops.qk_normalize(qkv_Rl3Hd[:, :, :2], mult)                # cosine q (×temperature), k
            q, k = qk_Rl2Hd[:, :, 0].transpose(1, 2), qk_Rl2Hd[:, :, 1].transpose(1, 2)  # (R, H, l, d) views
            v = qkv_Rl3Hd[:, :, 2].transpose(1, 2)
        else:
            k_dst, v_dst = ctx.reserve(l, idx_Rn)                                  # this scale's cache slots
            k, v = ctx.kv.view(ctx.layer)                                          # (R, H, L, d), ending with them
            attn_mask = ctx.kv.key_mask(ctx.layer)
            if use_fused_cache_attention(ops.qk_norm_attend is not None, attn_mask, ctx.run.hooks.attends(ctx.layer),
                                         R, H, l, k.shape[2], d):
                out_RlC = ops.qk_norm_attend(qkv_Rl3Hd, mult, k, v).view(R, l, C)  # norm, cache write, attention
                return ops.linear(out_RlC, self.proj.weight, self.proj.bias) if project else out_RlC
            q = ops.qk_normalize_store(qkv_Rl3Hd, mult, k_dst, v_dst)
            if ctx.run.hooks.attends(ctx.layer):
                out = ctx.run.policies.attention(SubLayerContext(ctx.si, ctx.layer, "self_attn"), q, k, v, ctx.run)
        if out is None:
            out = dense_attention(q, k, v, scale=1.0, attn_mask=attn_mask)
        out_RlC = empty_rows((R, l, C), dtype=out.dtype, device=out.device)      # spare rows: proj may pad
        out_RlC.view(R, l, H, d).copy_(out.transpose(1, 2))                      # (R, H, l, d) → (R, l, C)
        return ops.linear(out_RlC, self.proj.weight, self.proj.bias) if project else out_RlC


class _LayerCall(LayerCall):
    """Where a VAR block runs (engine/layers.py), with the layer's per-image constants: the qkv bias
    and the q/k multipliers."""

    __slots__ = ("qkv_bias", "qk_mult")

    def __init__(self, kv, si: int, layer: int, run: RunState, ops: Kernels, qkv_bias: torch.Tensor,
                 qk_mult: torch.Tensor, pos: torch.Tensor, valid_Rl: Optional[torch.Tensor], record: bool):
        super().__init__(kv, si, layer, run, ops, pos, valid_Rl, record)
        self.qkv_bias, self.qk_mult = qkv_bias, qk_mult


class VARBlock(nn.Module):
    """AdaLN self-attention block (``AdaLNSelfAttn``). Keys: ``attn.*``, ``ffn.*`` and either
    ``ada_lin.1.*`` (per-block AdaLN) or ``ada_gss`` (shared AdaLN)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, norm_eps: float, shared_aln: bool):
        super().__init__()
        self.dim, self.norm_eps, self.shared_aln = dim, norm_eps, shared_aln
        self.attn = VARSelfAttention(dim, num_heads)
        self.ffn = TanhGeluFFN(dim, round(dim * mlp_ratio))
        if shared_aln:
            self.ada_gss = nn.Parameter(torch.zeros(1, 1, 6, dim))
        else:
            self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def adaln(self, cond_R6C_or_RD: torch.Tensor) -> torch.Tensor:
        """(R, 6, C) float32 modulation γ1, γ2, 1+s1, 1+s2, b1, b2: from the raw condition (R, D),
        or from the shared projection (R, 6, C) when AdaLN is shared."""
        if self.shared_aln:
            ada = (self.ada_gss[0] + cond_R6C_or_RD).float()                          # (1,6,C)+(R,6,C)
        else:
            R = cond_R6C_or_RD.shape[0]
            ada = self.ada_lin(cond_R6C_or_RD).view(R, 6, self.dim).float()           # (R, 6C) → (R, 6, C)
        return torch.cat((ada[:, :2], ada[:, 2:4] + 1, ada[:, 4:]), dim=1)

    def forward(self, x_RlC: torch.Tensor, mod_R6C: torch.Tensor, ctx: Optional[_LayerCall] = None,
                attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        g1, g2, m1, m2, b1, b2 = mod_R6C.unsqueeze(2).unbind(1)                     # each (R, 1, C)
        wdtype = self.ffn.fc1.weight.dtype
        ops = ctx.ops if ctx is not None else TORCH_KERNELS
        eps = self.norm_eps

        def attn_branch(y, idx_Rn=None):
            return self.attn(y, ctx, attn_mask, idx_Rn)

        def ffn_branch(y, idx_Rn=None):
            return self.ffn(y, ops)

        def modulate(x, mul, shift):
            return ops.modulate(x, mul, shift, eps, wdtype)

        if ctx is not None and ctx.run.hooks.wraps(ctx.layer):
            stack, run = ctx.run.policies, ctx.run
            x_RlC = stack.wrap_sublayer(SubLayer(SubLayerContext(ctx.si, ctx.layer, "self_attn"), m1, b1, g1,
                                                 attn_branch, modulate, ops.gated_residual, eps, wdtype), x_RlC, run)
            return stack.wrap_sublayer(SubLayer(SubLayerContext(ctx.si, ctx.layer, "ffn"), m2, b2, g2,
                                                ffn_branch, modulate, ops.gated_residual, eps, wdtype), x_RlC, run)
        x_RlC, y_RlC = ops.residual_modulate(x_RlC, attn_branch(modulate(x_RlC, m1, b1)), g1, m2, b2, eps, wdtype)
        return ops.gated_residual(x_RlC, self.ffn(y_RlC, ops), g2)

    def forward_chained(self, x_RlC: torch.Tensor, y_RlC: torch.Tensor, mod_R6C: torch.Tensor,
                        next_mul_shift: Optional[tuple[torch.Tensor, torch.Tensor]], ctx: _LayerCall):
        """The dense path without sub-layer wrappers, chained across blocks: ``y_RlC`` is this
        block's attention input, already modulated (by the previous block's last step); returns
        (x, the next step's input or None). The FFN's gated residual and the next LayerNorm + AdaLN
        — ``next_mul_shift``, (R, 1, C) each: the next block's attention input, or the head's —
        run as one step: one launch fewer per layer."""
        g1, g2, _, m2, _, b2 = mod_R6C.unsqueeze(2).unbind(1)                        # each (R, 1, C)
        ops, eps, wdtype = ctx.ops, self.norm_eps, self.ffn.fc1.weight.dtype
        proj, fc2 = self.attn.proj, self.ffn.fc2
        x_RlC, y_RlC = ops.linear_residual_modulate(self.attn(y_RlC, ctx, project=False), proj.weight, proj.bias,
                                                    x_RlC, g1, m2, b2, eps, wdtype)
        h_RlF = self.ffn.hidden(y_RlC, ops)
        if next_mul_shift is None:
            return ops.gated_residual(x_RlC, ops.linear(h_RlF, fc2.weight, fc2.bias), g2), None
        m_next, b_next = next_mul_shift
        return ops.linear_residual_modulate(h_RlF, fc2.weight, fc2.bias, x_RlC, g2, m_next, b_next, eps, wdtype)


class VARTransformer(ModelMixin, ConfigMixin):
    """The class-conditional VAR transformer (official key layout, derived buffers excluded).

    Args:
        vocab_size: codebook size V of the tokenizer (4096 for the official VQVAE).
        z_channels: code dimension Cvae (32).
        num_classes: real classes; id ``num_classes`` is the null class used for guidance.
        depth, embed_dim, num_heads, mlp_ratio, norm_eps: transformer size (official: width 64·depth,
            heads = depth, mlp_ratio 4, eps 1e-6).
        shared_aln: one AdaLN projection shared by all blocks (the 512-px d36 model).
        patch_nums: the square patch schedule; it ties the checkpoint to its resolution through
            ``pos_1LC`` and ``lvl_embed``.
    """

    _no_split_modules = ["VARBlock"]

    @register_to_config
    def __init__(self, vocab_size: int = 4096, z_channels: int = 32, num_classes: int = 1000, depth: int = 16,
                 embed_dim: int = 1024, num_heads: int = 16, mlp_ratio: float = 4.0, norm_eps: float = 1e-6,
                 shared_aln: bool = False, patch_nums: Sequence[int] = VAR_SCHEDULES[256]):
        super().__init__()
        C = embed_dim
        self.schedule = ScaleSchedule.square(patch_nums)
        L, S = self.schedule.total_tokens, self.schedule.num_scales
        first_l = self.schedule.tokens(0)
        # 1. inputs: start token position, word (code) embedding, class embedding with the null class
        self.pos_start = nn.Parameter(torch.zeros(1, first_l, C))
        self.pos_1LC = nn.Parameter(torch.zeros(1, L, C))
        self.word_embed = nn.Linear(z_channels, C)
        self.class_emb = nn.Embedding(num_classes + 1, C)
        self.lvl_embed = nn.Embedding(S, C)
        # 2. AdaLN (shared for d36) and the blocks
        if shared_aln:
            self.shared_ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(C, 6 * C))
        self.blocks = nn.ModuleList(VARBlock(C, num_heads, mlp_ratio, norm_eps, shared_aln) for _ in range(depth))
        # 3. head
        self.head_nm = nn.Module()
        self.head_nm.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(C, 2 * C))
        self.head = nn.Linear(C, vocab_size)
        self.register_buffer("lvl_1L", self._level_index(), persistent=False)

    def _level_index(self, device=None) -> torch.Tensor:
        """(1, L) int64 scale index of every token (derived; never loaded from a checkpoint)."""
        counts = torch.tensor([h * w for h, w in self.schedule.hw], device=device)
        return torch.repeat_interleave(torch.arange(len(counts), device=device), counts).view(1, -1)

    def rebuild_buffers(self) -> "VARTransformer":
        """Recompute derived buffers in place (after ``to_empty`` or meta-device construction)."""
        self.lvl_1L = self._level_index(self.pos_1LC.device)
        return self

    # ---- pieces shared by teacher forcing and generation ----------------------------------------
    @property
    def null_class(self) -> int:
        return self.config.num_classes

    def block_adaln(self, cond_RD: torch.Tensor, blocks: Optional[Iterable[VARBlock]] = None) -> torch.Tensor:
        """Every block's modulation for the condition rows: (depth, R, 6, C) float32, in the order
        γ1, γ2, 1+s1, 1+s2, b1, b2. ``blocks``: the blocks as the caller walks them (default
        ``self.blocks``; the adapter's ``streamed_blocks``)."""
        R, C = cond_RD.shape[0], self.config.embed_dim
        blocks = self.blocks if blocks is None else blocks
        if self.config.shared_aln:
            shared = self.shared_ada_lin(cond_RD).view(R, 6, C)
            return torch.stack([blk.adaln(shared) for blk in blocks])
        # every block's ada_lin is SiLU then its own Linear: the SiLU once, the products stacked, the
        # "+ 1" of the scales once over all blocks (the per-block path launched ~6 kernels a block)
        act_RD = F.silu(cond_RD)
        ada_NR6C = torch.stack([F.linear(act_RD, blk.ada_lin[1].weight, blk.ada_lin[1].bias)
                                for blk in blocks]).view(len(self.blocks), R, 6, C).float()
        ada_NR6C[:, :, 2:4] += 1
        return ada_NR6C

    weights_key = weights_key                    # (models/_blocks.py)

    def attention_constants(self, qkv_bias_N3C: torch.Tensor, qk_mult_N2H1: torch.Tensor) -> None:
        """Fill every block's qkv bias (depth, 3C) and q/k multipliers (depth, 2, H, 1): functions of
        the weights alone, computed once per workspace."""
        for i, blk in enumerate(self.blocks):
            qkv_bias_N3C[i].copy_(blk.attn.qkv_bias())
            qk_mult_N2H1[i].copy_(blk.attn.qk_multiplier())

    def head_adaln(self, cond_RD: torch.Tensor) -> torch.Tensor:
        """(R, 2, C) float32: 1 + scale, shift of the head's AdaLN."""
        ada = self.head_nm.ada_lin(cond_RD).view(cond_RD.shape[0], 2, self.config.embed_dim).float()
        return torch.stack((ada[:, 0] + 1, ada[:, 1]), dim=1)

    def logits(self, h_RlC: torch.Tensor, head_mod_R2C: Optional[torch.Tensor],
               ops: Optional[Kernels] = None, float32: bool = True) -> torch.Tensor:
        """Codebook logits (R, l, V) of hidden states, float32 (or the head's dtype without
        ``float32``); ``head_mod_R2C`` from :meth:`head_adaln`, or None when ``h_RlC`` already is
        the head's LayerNorm + AdaLN output (the last block chained into it). Fused ``ops`` run the
        LayerNorm + AdaLN in one kernel and the product through ``ops.linear`` (this package's
        GEMM at few rows)."""
        if head_mod_R2C is None:
            y = h_RlC
        elif ops is not None and ops.kind != "torch":
            mul_R1C, shift_R1C = head_mod_R2C[:, 0:1], head_mod_R2C[:, 1:2]
            y = ops.modulate(h_RlC, mul_R1C, shift_R1C, self.config.norm_eps, self.head.weight.dtype)
        else:
            mul_R1C, shift_R1C = head_mod_R2C[:, 0:1], head_mod_R2C[:, 1:2]
            y = (layer_norm_no_affine(h_RlC, self.config.norm_eps) * mul_R1C + shift_R1C).to(self.head.weight.dtype)
        if ops is not None and ops.kind == "triton":
            logits_RlV = ops.linear(y, self.head.weight, self.head.bias)
        else:
            logits_RlV = self.head(y)
        return logits_RlV.float() if float32 else logits_RlV

    def lvl_pos(self) -> torch.Tensor:
        """(1, L, C) level + position embedding of every token."""
        return self.lvl_embed(self.lvl_1L) + self.pos_1LC

    def init_random_weights(self, std: float = 0.02) -> "VARTransformer":
        """Random weights for a model built by size (benchmarks, smoke tests); draws noise."""
        trunc_normal_init_(self, std)
        for p in (self.pos_start, self.pos_1LC):
            nn.init.trunc_normal_(p, std=std)
        for blk in self.blocks:
            nn.init.trunc_normal_(blk.attn.q_bias, std=std)
            nn.init.trunc_normal_(blk.attn.v_bias, std=std)
            nn.init.constant_(blk.attn.scale_mul_1H11, math.log(4.0))     # (built on meta: not set otherwise)
            if self.config.shared_aln:
                nn.init.trunc_normal_(blk.ada_gss, std=std)
        return self

    # ---- teacher forcing (training layout; used by the parity tests) --------------------------
    def forward(self, label_B: torch.Tensor, x_BLCv_wo_first_l: torch.Tensor) -> torch.Tensor:
        """Logits (B, L, V) for every position given the teacher-forcing inputs (B, L - first_l, Cvae).
        Position l predicts the code of token l. No label dropout."""
        B = label_B.shape[0]
        first_l, L = self.schedule.tokens(0), self.schedule.total_tokens
        wdtype = self.word_embed.weight.dtype
        cond_BD = self.class_emb(label_B)
        sos_BlC = cond_BD.unsqueeze(1).expand(B, first_l, -1) + self.pos_start.expand(B, first_l, -1)
        x_BLC = torch.cat((sos_BlC, self.word_embed(x_BLCv_wo_first_l.to(wdtype))), dim=1).float()
        x_BLC = x_BLC + self.lvl_pos().float()
        lvl = self.lvl_1L[0]
        visible_LL = lvl.view(L, 1) >= lvl.view(1, L)                               # block-causal
        ada_NB6C = self.block_adaln(cond_BD)
        for i, blk in enumerate(self.blocks):
            x_BLC = blk(x_BLC, ada_NB6C[i], None, attn_mask=visible_LL)
        return self.logits(x_BLC, self.head_adaln(cond_BD))


def var_loop_flops(cfg, batch: int, tokens_per_scale, kv_per_scale=None, rows_per_scale=None) -> float:
    """FLOPs of the scale loop with CFG (2·batch rows) when scale k runs ``tokens_per_scale[k]``
    tokens per image (0 = skipped) and attends to ``kv_per_scale[k]`` cached tokens (default: the
    running sum); ``rows_per_scale[k]`` rows per image (default 2; 1 in cond-only mode). The head
    always runs on the full map (excluded tokens still get logits)."""
    C, V, depth = cfg.embed_dim, cfg.vocab_size, cfg.depth
    hidden = round(C * cfg.mlp_ratio)
    rows, total, prefix = 2 * batch, 0.0, 0.0
    for k, (p, n) in enumerate(zip(cfg.patch_nums, tokens_per_scale)):
        if n == 0:
            continue
        prefix += n
        kv = prefix if kv_per_scale is None else kv_per_scale[k]
        if rows_per_scale is not None:
            rows = batch * rows_per_scale[k]
        total += rows * (depth * (2 * n * (4 * C * C + 2 * C * hidden) + 4 * n * kv * C) + 2 * p * p * C * V)
    return total


class _VARWorkspace(Workspace):
    """Static buffers of one batch size, reused across generations (CUDA graphs capture them).

    What it holds, for batch B: the KV cache (2·B rows × the schedule's tokens × depth, the bulk: 22 MB
    per image on the demo model in float32), the latent, the per-row conditioning, and — once the
    engine replays from CUDA graphs — the graphs with their memory pool (engine/graphs.py)."""

    def __init__(self, model: VARTransformer, vae_channels: int, batch: int, device, dtype, kv_slots=None):
        cfg, sch = model.config, model.schedule
        super().__init__(device, sch.total_tokens)
        R, C = 2 * batch, cfg.embed_dim
        self.kv = KVCache.for_schedule(cfg.depth, R, cfg.num_heads, C // cfg.num_heads,
                                       [sch.tokens(si) for si in range(sch.num_scales)], dtype, device, kv_slots)
        H, W = sch.latent_hw
        self.f_hat_BChw = torch.zeros(batch, vae_channels, H, W, device=device, dtype=torch.float32)
        self.ada_NR6C = torch.zeros(cfg.depth, R, 6, C, device=device, dtype=torch.float32)
        self.head_mod_R2C = torch.zeros(R, 2, C, device=device, dtype=torch.float32)
        self.sos_R1C = torch.zeros(R, sch.tokens(0), C, device=device, dtype=torch.float32)
        self.labels_B = torch.zeros(batch, device=device, dtype=torch.long)        # the class ids (prepare's input)
        self.lvl_pos_1LC = torch.zeros(1, sch.total_tokens, C, device=device, dtype=torch.float32)
        self.qkv_bias_N3C = torch.zeros(cfg.depth, 3 * C, device=device, dtype=dtype)
        self.qk_mult_N2H1 = torch.zeros(cfg.depth, 2, cfg.num_heads, 1, device=device, dtype=torch.float32)
        self.fill_weight_constants(model)
        self.upsample_ops: dict = {}     # (h, w) → bicubic operator to the latent size (accumulate)

    @torch.no_grad()
    def fill_weight_constants(self, model: VARTransformer) -> None:
        """The buffers that are functions of the weights alone: level + position rows, qkv biases,
        q/k multipliers."""
        self.lvl_pos_1LC.copy_(model.lvl_pos())
        model.attention_constants(self.qkv_bias_N3C, self.qk_mult_N2H1)


class VARAdapter(ModelAdapter):
    """The engine's view of a VAR transformer + its multi-scale VQVAE (engine/adapter.py).

    Conditioning is a LongTensor of class ids (B,). Rows through the transformer are
    [cond (B); uncond (B)] while guidance is on. Guidance ramps with the scale index:
    t = cfg·si/(S−1), guided = (1+t)·cond − t·uncond (so cfg 0 is the only "off").
    """

    family = "var"
    # guide, sample (with its noise drawn beforehand), residual and accumulate capture with the
    # scale's compute into one CUDA graph; accumulate changes only the latent (engine/adapter.py)
    supports_scale_graphs = True

    def __init__(self, transformer: VARTransformer, vqvae):
        if transformer.config.vocab_size != vqvae.config.vocab_size or \
                transformer.config.z_channels != vqvae.config.z_channels:
            raise ValueError(
                f"transformer and VQVAE do not match: transformer expects vocab {transformer.config.vocab_size} × "
                f"{transformer.config.z_channels} channels, the VQVAE has {vqvae.config.vocab_size} × "
                f"{vqvae.config.z_channels}; pass the VQVAE the transformer was trained with")
        super().__init__(transformer, transformer.schedule, transformer.blocks)
        self.vqvae = vqvae

    @property
    def device(self) -> torch.device:
        return self.transformer.pos_1LC.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.head.weight.dtype

    # ---- adapter interface ----------------------------------------------------------------------
    @torch.no_grad()
    def begin(self, run: RunState, class_labels_B: torch.Tensor) -> None:
        """Set up a generation in the workspace of this batch size, device, dtype and weights
        (:meth:`~..engine.adapter.ModelAdapter.workspace`: one kept at a time)."""
        m, B = self.transformer, run.batch_size
        # captured graphs hold the weights' addresses: a model moved away and back (ComfyUI offloading,
        # a dtype round trip) has new storage, so its old workspace and graphs must go; the workspace
        # also holds what depends on the weights alone (positions, qkv biases, q/k multipliers),
        # so weights changed in place (a new version) make a new one too. The scales' graphs read the
        # VQVAE's codebook and φ too: a VQVAE moved on its own makes a new workspace as well
        weights, versioned = m.weights_key()
        ws = self.workspace((B, self.device, self.dtype, weights, weight_ptrs(self.vqvae), run.kv_slots),
                            lambda: _VARWorkspace(m, self.vqvae.config.z_channels, B, self.device, self.dtype,
                                                  run.kv_slots))
        if not versioned:
            ws.fill_weight_constants(m)
        ws.labels_B.copy_(class_labels_B)
        ws.kv.reset()
        run.workspace = ws

    @torch.no_grad()
    def prepare(self, run: RunState) -> None:
        """:meth:`_condition_rows`; the latent cleared."""
        self._condition_rows(run.workspace)
        run.workspace.f_hat_BChw.zero_()

    def prepare_key(self, run: RunState) -> tuple:
        return ()                                      # one workspace per batch size and weights

    def _condition_rows(self, ws) -> None:
        """From the class ids :meth:`begin` took: the rows' conditions [cond; null], the start tokens,
        every block's and the head's modulation."""
        m = self.transformer
        cond_RD = m.class_emb(torch.cat((ws.labels_B, torch.full_like(ws.labels_B, m.null_class))))  # (2B, D)
        ws.sos_R1C.copy_(self._start_tokens(cond_RD, ws))
        ws.ada_NR6C.copy_(m.block_adaln(cond_RD, self.streamed_blocks()))
        ws.head_mod_R2C.copy_(m.head_adaln(cond_RD))

    def _start_tokens(self, cond_RD: torch.Tensor, ws) -> torch.Tensor:
        """(R, first scale's tokens, C): the condition + start position + level and position rows."""
        first_l = self.schedule.tokens(0)
        return cond_RD.unsqueeze(1).expand(-1, first_l, -1) + self.transformer.pos_start + ws.lvl_pos_1LC[:, :first_l]

    def stage_input(self, si: int, run: RunState) -> torch.Tensor:
        """The full token map entering the blocks at scale ``si``: (R, h·w, C) float32."""
        ws, R = run.workspace, run.rows
        if si == 0:
            return ws.sos_R1C[:R]
        h, w = self.schedule.hw[si]
        start, end = self.schedule.offsets[si], self.schedule.offsets[si + 1]
        embed = self.transformer.word_embed
        # the latent area-pooled to (h, w), embedded, plus level + position; the same map for both CFG halves
        return self.ops.stage_embed(ws.f_hat_BChw, h, w, embed.weight, embed.bias, ws.lvl_pos_1LC[0, start:end],
                                    R // run.batch_size)

    # ---- the layer loop's family part (engine/layers.py) -------------------------------------------
    def chains_layers(self) -> bool:
        return True

    def chains_into_head(self) -> bool:
        return self.ops.kind == "triton"

    def scale_constants(self, si: int, run: RunState, pos: torch.Tensor) -> None:
        return None

    def layer_call(self, si: int, i: int, run: RunState, pos, valid_Rn, record: bool, shared) -> _LayerCall:
        ws = run.workspace
        return _LayerCall(ws.kv, si, i, run, self.ops, ws.qkv_bias_N3C[i], ws.qk_mult_N2H1[i], pos, valid_Rn, record)

    def chained_layer(self, i: int, x_RlC: torch.Tensor, y_RlC: torch.Tensor, chain_next: bool, call: _LayerCall):
        """Block ``i`` on the chained path; with ``chain_next`` its last step also modulates the next
        block's attention input (or, after the last block, the head's)."""
        ws, R = call.run.workspace, call.run.rows
        nxt = None
        if chain_next and i + 1 < self.num_layers:
            nxt = (ws.ada_NR6C[i + 1, :R, 2:3], ws.ada_NR6C[i + 1, :R, 4:5])
        elif chain_next:
            nxt = (ws.head_mod_R2C[:R, 0:1], ws.head_mod_R2C[:R, 1:2])
        return self.blocks[i].forward_chained(x_RlC, y_RlC, ws.ada_NR6C[i, :R], nxt, call)

    def head(self, x_RLC: torch.Tensor, run: RunState, modulated: bool = False) -> torch.Tensor:
        """Raw logits (R, L, V): float32, except under fused ops (there in the head's dtype; :meth:`guide`
        casts them in its pass). ``modulated``: ``x_RLC`` is already the head's LayerNorm + AdaLN."""
        head_mod_R2C = None if modulated else run.workspace.head_mod_R2C[:run.rows]
        return self.transformer.logits(x_RLC, head_mod_R2C, self.ops, float32=self.ops.kind != "triton")

    def guide(self, si: int, logits_RlV: torch.Tensor, run: RunState) -> torch.Tensor:
        """Classifier-free guidance with VAR's ramp: t = cfg·si/(S−1), (1+t)·cond − t·uncond, float32
        (under fused ops in one Triton pass that also casts the head's logits; the same bits)."""
        if not run.cfg_active:
            return logits_RlV.float()
        B = run.batch_size
        t = run.settings.guidance_scale * si / max(self.schedule.num_scales - 1, 1)
        return self.ops.cfg_guide(logits_RlV, B, t)

    def scale_noise(self, si: int, run: RunState) -> Optional[tuple]:
        """The (B·h·w, V) Exp(1) noise :meth:`sample` draws at ``si``, when it can take it drawn
        beforehand (one generator on the model's device); None otherwise."""
        if not takes_drawn_noise(run.generator, self.device):
            return None
        h, w = run.schedule.hw[si]
        return (("exponential", (run.batch_size * h * w, self.transformer.config.vocab_size)),)

    def sample(self, si: int, guided_BlV: torch.Tensor, run: RunState) -> torch.Tensor:
        s = run.settings
        return sample_codes_per_image(guided_BlV, s.top_k, s.top_p, run.generator, fused=self.ops.kind == "triton",
                                      noise_NV=run.drawn(0))

    def residual(self, si: int, codes_Bl: torch.Tensor, run: RunState) -> torch.Tensor:
        # indexing, not F.embedding, whose index_select kernel for few indices is slower (the same
        # values: a copy of the rows)
        return self.vqvae.quantize.embedding.weight[codes_Bl].float()                # (B, l, Cvae)

    @torch.no_grad()
    def accumulate(self, si: int, residual_BlC: torch.Tensor, run: RunState) -> None:
        ws, sch = run.workspace, self.schedule
        h, w = sch.hw[si]
        B, l, c = residual_BlC.shape
        h_BChw = residual_BlC.transpose(1, 2).reshape(B, c, h, w)                      # (B, l, c) → (B, c, h, w)
        H, W = sch.latent_hw
        if (h, w) != (H, W) and not h_BChw.is_cuda:
            h_BChw = F.interpolate(h_BChw, size=(H, W), mode="bicubic")
        elif (h, w) != (H, W):
            # bicubic upsampling as one product with its (h·w, H·W) operator (vqvae.bicubic_operator:
            # PyTorch's CUDA kernel loops over the B·c planes in every thread)
            op = ws.upsample_ops.get((h, w))
            if op is None:
                op = ws.upsample_ops[(h, w)] = bicubic_operator((h, w), (H, W), h_BChw.device)
            h_BChw = torch.mm(h_BChw.reshape(B * c, h * w), op).view(B, c, H, W)     # (B·c, hw) → (B·c, HW)
        weight, bias, ratio = self.vqvae.phi_parameters(si, sch.num_scales)
        self.ops.phi_accumulate(h_BChw, weight, bias, ratio, ws.f_hat_BChw)            # f_hat += φ(h), float32

    def latent(self, run: RunState) -> torch.Tensor:
        return run.workspace.f_hat_BChw

    @torch.no_grad()
    def decode(self, run: RunState) -> torch.Tensor:
        f_hat = run.workspace.f_hat_BChw
        img = self.vqvae.fhat_to_img(f_hat.to(self.vqvae.quantize.embedding.weight.dtype)).float()
        return (img + 1) * 0.5                                                         # [-1, 1] → [0, 1]

    def decode_key(self, run: RunState) -> Optional[tuple]:
        """A graph up to one 1024² picture (the workspace key holds the VQVAE's weights)."""
        return decode_graph_key(run.workspace.f_hat_BChw, self.vqvae.downsample_factor)

