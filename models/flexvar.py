"""FlexVAR (research/flexvar.md): VAR's transformer blocks trained to predict each scale's whole
token map from the previous scale's codes, at any schedule. Only what differs from VAR
(models/var.py, whose blocks, AdaLN and head it reuses) lives here:

- positions: ``pos_1LC`` is a (1, C, 32, 32) grid, area-resized to every scale of the schedule
  (no level embedding), so any schedule and size has positions; ``pos_start`` (1, 1, C) goes on the
  first token only;
- inputs: scale k+1 reads ``word_embed`` of the bicubic upsample of scale k's normalised code
  vectors (no accumulated latent); the tokenizer is LlamaGen's VQ-16 (models/flexvar_vq.py).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from .var import VAR_SCHEDULES, VARBlock, VARTransformer

POS_GRID = 32                        # the position grid's side (fixed by the released models)


class FlexVARTransformer(ModelMixin, ConfigMixin):
    """FlexVAR's class-conditional transformer (official key layout; ``attn_bias_for_masking`` and
    ``zero_k_bias`` are derived and not kept). Sizes as VAR's (released: d16/d20/d24, width 64·depth,
    heads = depth); ``patch_nums`` is only the default schedule — every call may take its own."""

    _no_split_modules = ["VARBlock"]

    @register_to_config
    def __init__(self, vocab_size: int = 8912, z_channels: int = 32, num_classes: int = 1000, depth: int = 16,
                 embed_dim: int = 1024, num_heads: int = 16, mlp_ratio: float = 4.0, norm_eps: float = 1e-6,
                 shared_aln: bool = False, patch_nums: Sequence[int] = VAR_SCHEDULES[256]):
        super().__init__()
        C = embed_dim
        self.pos_start = nn.Parameter(torch.zeros(1, 1, C))
        self.pos_1LC = nn.Parameter(torch.zeros(1, C, POS_GRID, POS_GRID))
        self.word_embed = nn.Linear(z_channels, C)
        self.class_emb = nn.Embedding(num_classes + 1, C)
        if shared_aln:
            self.shared_ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(C, 6 * C))
        self.blocks = nn.ModuleList(VARBlock(C, num_heads, mlp_ratio, norm_eps, shared_aln) for _ in range(depth))
        self.head_nm = nn.Module()
        self.head_nm.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(C, 2 * C))
        self.head = nn.Linear(C, vocab_size)

    @staticmethod
    def official_extra_keys(depth: int) -> set:
        return {"attn_bias_for_masking"} | {f"blocks.{i}.attn.zero_k_bias" for i in range(depth)}

    # VAR's AdaLN and head, unchanged
    null_class = VARTransformer.null_class
    block_adaln = VARTransformer.block_adaln
    head_adaln = VARTransformer.head_adaln
    logits = VARTransformer.logits

    def positions(self, patch_nums: Sequence[int]) -> torch.Tensor:
        """(1, L, C) float32: the position grid area-resized to every scale, row-major, concatenated."""
        grid = self.pos_1LC.float()
        return torch.cat([F.interpolate(grid, size=(pn, pn), mode="area").flatten(2).transpose(1, 2)
                          for pn in patch_nums], dim=1)                        # (1, C, pn, pn) → (1, pn², C)

    def forward(self, label_B: torch.Tensor, x_BLCv_wo_first_l: torch.Tensor,
                patch_nums: Sequence[int] = None) -> torch.Tensor:
        """Teacher-forced logits (B, L, V) for the schedule ``patch_nums`` (default: the config's),
        with the block-causal mask by scale. No label dropout."""
        patch_nums = tuple(patch_nums or self.config.patch_nums)
        if patch_nums[0] != 1:
            raise ValueError(f"patch_nums={patch_nums}: FlexVAR's first scale is 1×1 (the class token)")
        B = label_B.shape[0]
        cond_BD = self.class_emb(label_B)
        sos_B1C = cond_BD.unsqueeze(1) + self.pos_start
        x_BLC = torch.cat((sos_B1C, self.word_embed(x_BLCv_wo_first_l.to(self.word_embed.weight.dtype))), dim=1)
        x_BLC = x_BLC.float() + self.positions(patch_nums)
        lvl = torch.repeat_interleave(torch.arange(len(patch_nums)), torch.tensor([p * p for p in patch_nums]))
        visible_LL = (lvl.view(-1, 1) >= lvl.view(1, -1)).to(x_BLC.device)       # block-causal
        ada_NB6C = self.block_adaln(cond_BD)
        for i, blk in enumerate(self.blocks):
            x_BLC = blk(x_BLC, ada_NB6C[i], None, attn_mask=visible_LL)
        return self.logits(x_BLC, self.head_adaln(cond_BD))


__all__ = ["FlexVARTransformer", "POS_GRID"]
