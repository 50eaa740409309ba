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

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from ..engine.kv_cache import KVCache
from ..engine.sampling import sample_codes_per_image
from ..engine.schedule import ScaleSchedule
from ..engine.state import RunState
from ..engine.workspace import Workspace
from ._blocks import weight_ptrs
from .var import VAR_SCHEDULES, VARAdapter, VARBlock, VARTransformer

TRAINED_SIDES = frozenset((1, 2, 3, 4, 5, 6, 8, 10, 13, 16, 23, 24, 32))   # sampled with top-k; others greedy
MAX_PN = 16                          # above this side: greedy, and the full guidance (the reference's max_pn)

PATCH = 16                           # pixels per token side (the VQ-16's downsampling)
# The reference's schedules (README / eval_c2i.py), by (last side, steps): what flexvar_schedule returns for them.
REFERENCE_SCHEDULES = {
    (16, 10): (1, 2, 3, 4, 5, 6, 8, 10, 13, 16),                         # the training default, 256 px
    (16, 9): (1, 2, 3, 4, 5, 7, 10, 13, 16),
    (16, 13): (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16),
    (32, 15): (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 23, 32),      # 512 px zero-shot
}
DEFAULT_STEPS = {16: 10, 32: 15}     # steps when none are asked for, where the reference has a schedule


def flexvar_schedule(side: int, steps: Optional[int] = None) -> tuple[int, ...]:
    """Square sides (tokens) of a FlexVAR schedule ending at ``side`` (the picture is 16·side px),
    in ``steps`` steps.

    The reference's schedules where it has one (256 px: 10 steps by default, 9 or 13; 512 px: its
    15-step zero-shot schedule). Otherwise, without ``steps``: the default 10-step sides below
    ``side`` (up to 16 px·16), then above 16 the 13-step schedule followed by steps of at most √2
    in side up to ``side`` (so 384 px: …, 14, 16, 20, 24). With ``steps``: sides spaced
    geometrically from 1 to ``side``, each at least one more than the last. Raises ValueError for
    a side below 1 or more steps than sides."""
    if isinstance(side, bool) or not isinstance(side, (int, np.integer)) or side < 1:
        raise ValueError(f"side={side!r}: give the last scale's side in tokens, an int >= 1")
    if steps is None:
        steps = DEFAULT_STEPS.get(int(side))
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or not 1 <= steps <= side or \
                (steps == 1) != (side == 1):
            raise ValueError(f"steps={steps!r}: a schedule ending at side {side} ({side * PATCH} px) takes 2 to {side} "
                             f"steps (increasing sides from 1)" if side > 1 else
                             f"steps={steps!r}: a {PATCH}-px picture is one step")
        known = REFERENCE_SCHEDULES.get((int(side), int(steps)))
        if known is not None:
            return known
        sides = [1]
        for k in range(1, steps):
            room = side - (steps - 1 - k)                   # leave one side for every step still to come
            sides.append(min(max(round(side ** (k / (steps - 1))), sides[-1] + 1), room))
        return tuple(sides)
    if side <= 16:
        return tuple(p for p in REFERENCE_SCHEDULES[(16, 10)] if p < side) + (side,)
    sides = list(REFERENCE_SCHEDULES[(16, 13)])
    n = math.ceil(math.log(side / 16) / math.log(math.sqrt(2)) - 1e-9)
    sides += [round(16 * (side / 16) ** (k / n)) for k in range(1, n + 1)]
    return tuple(sides)


POS_GRID = 32                        # the position grid's side (fixed by the released models)
# Sizes for models built with random weights (FlexVARPipeline.from_random): the releases and a tiny
# one of the parity fixture's shape.
FLEXVAR_PRESETS = {
    "flexvar-tiny": dict(transformer=dict(vocab_size=96, num_classes=10, depth=2, embed_dim=128, num_heads=2),
                         vqvae=dict(vocab_size=96, ch=32)),
    **{f"flexvar-d{d}": dict(transformer=dict(depth=d, embed_dim=64 * d, num_heads=d), vqvae=dict())
       for d in (16, 20, 24)},
}


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

    # VAR's AdaLN, head and random init (its parameters are VAR's, positions and blocks), unchanged
    init_random_weights = VARTransformer.init_random_weights
    null_class = VARTransformer.null_class
    block_adaln = VARTransformer.block_adaln
    weights_key = VARTransformer.weights_key
    attention_constants = VARTransformer.attention_constants
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


@dataclass(frozen=True)
class FlexVARConditioning:
    """One generation's inputs: class ids (B,), the schedule (square sides, the first 1), and the
    guidance form: VAR's ramp t = cfg·si/min(K−1, 9) (t = cfg above ``max_pn``; the evaluation
    script's) or LlamaGen's constant uncond + cfg·(cond − uncond) (``llamagen_cfg``, the demo's)."""

    class_labels: torch.Tensor
    patch_nums: tuple
    llamagen_cfg: bool = False
    max_pn: int = MAX_PN


class _FlexVARWorkspace(Workspace):
    """The buffers of one batch size and schedule: the KV cache, the per-row AdaLN and head
    modulation, the positions of every token, the next scales' inputs and the last codes."""

    def __init__(self, model: FlexVARTransformer, batch: int, schedule: ScaleSchedule, device, dtype, kv_slots=None):
        cfg = model.config
        super().__init__(device, schedule.total_tokens)
        R, C, L = 2 * batch, cfg.embed_dim, schedule.total_tokens
        self.kv = KVCache.for_schedule(cfg.depth, R, cfg.num_heads, C // cfg.num_heads,
                                       [schedule.tokens(si) for si in range(schedule.num_scales)], dtype, device,
                                       kv_slots)
        self.ada_NR6C = torch.zeros(cfg.depth, R, 6, C, device=device, dtype=torch.float32)
        self.head_mod_R2C = torch.zeros(R, 2, C, device=device, dtype=torch.float32)
        self.sos_R1C = torch.zeros(R, 1, C, device=device, dtype=torch.float32)
        self.labels_B = torch.zeros(batch, device=device, dtype=torch.long)        # the class ids (prepare's input)
        self.pos_1LC = torch.zeros(1, L, C, device=device, dtype=torch.float32)
        self.qkv_bias_N3C = torch.zeros(cfg.depth, 3 * C, device=device, dtype=dtype)
        self.qk_mult_N2H1 = torch.zeros(cfg.depth, 2, cfg.num_heads, 1, device=device, dtype=torch.float32)
        self.fill_weight_constants(model, schedule)
        self.next_BLC = torch.zeros(batch, L, cfg.z_channels, device=device, dtype=torch.float32)
        # every scale's code vectors (B, c, pn, pn), written in place (a replayed scale refreshes them)
        self.codes = [torch.zeros(batch, cfg.z_channels, h, w, device=device, dtype=torch.float32)
                      for h, w in schedule.hw]

    @torch.no_grad()
    def fill_weight_constants(self, model: FlexVARTransformer, schedule: ScaleSchedule) -> None:
        """The buffers that are functions of the weights (and this schedule) alone: positions, qkv
        biases, q/k multipliers."""
        self.pos_1LC.copy_(model.positions(tuple(h for h, _ in schedule.hw)))
        model.attention_constants(self.qkv_bias_N3C, self.qk_mult_N2H1)


class FlexVARAdapter(VARAdapter):
    """VAR's adapter with what FlexVAR changes: the schedule comes with each call
    (:class:`FlexVARConditioning`), the input of scale k+1 is ``word_embed`` of the bicubic upsample
    of scale k's normalised code vectors plus the area-resized positions, guidance ramps over at most
    nine steps, sides it was not trained on are drawn greedily, and the picture is decoded from the
    last scale's codes alone (the unclamped decoder output, mapped to [0, 1] after a clamp to [−1, 1];
    after skipped scales, from the last computed codes upsampled to the last scale's size)."""

    family = "flexvar"

    def __init__(self, transformer: FlexVARTransformer, vqvae, schedule: Optional[ScaleSchedule] = None):
        if transformer.config.vocab_size != vqvae.config.vocab_size or \
                transformer.config.z_channels != vqvae.config.embed_dim:
            raise ValueError(
                f"transformer and tokenizer do not match: transformer expects vocab {transformer.config.vocab_size} × "
                f"{transformer.config.z_channels} channels, the tokenizer has {vqvae.config.vocab_size} × "
                f"{vqvae.config.embed_dim}; pass the VQ-16 the transformer was trained with")
        schedule = schedule or ScaleSchedule.square(transformer.config.patch_nums)
        super(VARAdapter, self).__init__(transformer, schedule, transformer.blocks)
        self.vqvae = vqvae

    @property
    def device(self) -> torch.device:
        return self.transformer.pos_1LC.device

    @torch.no_grad()
    def begin(self, run: RunState, cond: FlexVARConditioning) -> None:
        m, B, sch = self.transformer, run.batch_size, run.schedule
        if tuple(h for h, _ in sch.hw) != tuple(cond.patch_nums):
            raise ValueError(f"the run's schedule {sch} is not the conditioning's {cond.patch_nums}")
        # captured graphs hold the weights' addresses: a model moved away and back has new storage
        # (weights changed in place have a new version: the workspace holds what depends on them alone);
        # the scales' graphs read the tokenizer's codebook too
        weights, versioned = m.weights_key()
        ws = self.workspace((B, sch.hw, self.device, self.dtype, weights, weight_ptrs(self.vqvae), run.kv_slots),
                            lambda: _FlexVARWorkspace(m, B, sch, self.device, self.dtype, run.kv_slots))
        if not versioned:
            ws.fill_weight_constants(m, sch)
        ws.labels_B.copy_(cond.class_labels)
        ws.kv.reset()
        run.model_state.update(llamagen_cfg=cond.llamagen_cfg, max_pn=int(cond.max_pn))
        run.workspace = ws

    @torch.no_grad()
    def prepare(self, run: RunState) -> None:
        """VAR's rows (no latent to clear: the last codes are decoded)."""
        self._condition_rows(run.workspace)

    def _start_tokens(self, cond_RD: torch.Tensor, ws) -> torch.Tensor:
        return cond_RD.unsqueeze(1) + self.transformer.pos_start + ws.pos_1LC[:, :1]

    def stage_input(self, si: int, run: RunState) -> torch.Tensor:
        ws, R, B, sch = run.workspace, run.rows, run.batch_size, run.schedule
        if si == 0:
            return ws.sos_R1C[:R]
        start, end = sch.offsets[si], sch.offsets[si + 1]
        embed = self.transformer.word_embed
        x_BlC = embed(ws.next_BLC[:, start:end].to(embed.weight.dtype)).float() + ws.pos_1LC[0, start:end]
        return x_BlC.repeat(R // B, 1, 1)

    def chains_into_head(self) -> bool:
        return False

    def guide(self, si: int, logits_RlV: torch.Tensor, run: RunState) -> torch.Tensor:
        if not run.cfg_active:
            return logits_RlV.float()
        B, cfg, sch = run.batch_size, float(run.settings.guidance_scale), run.schedule
        cond, uncond = logits_RlV[:B].float(), logits_RlV[B:].float()
        if run.model_state["llamagen_cfg"]:
            return uncond + (cond - uncond) * cfg
        pn = sch.hw[si][0]
        t = cfg if pn > run.model_state["max_pn"] else cfg * si / max(min(sch.num_scales - 1, 9), 1)
        return (1 + t) * cond - t * uncond

    def sample(self, si: int, guided_BlV: torch.Tensor, run: RunState) -> torch.Tensor:
        """Top-k / top-p draws; greedy (top-k 1, the noise still drawn) at sides the model was not
        trained on and above ``max_pn``, as the reference."""
        s, pn = run.settings, run.schedule.hw[si][0]
        greedy = pn > run.model_state["max_pn"] or pn not in TRAINED_SIDES
        return sample_codes_per_image(guided_BlV, 1 if greedy else s.top_k, s.top_p, run.generator,
                                      fused=self.ops.kind == "triton", noise_NV=run.drawn(0))

    def residual(self, si: int, codes_Bl: torch.Tensor, run: RunState) -> torch.Tensor:
        """What the scale changes, (B, l, Cvae): the normalised code vectors minus the scale's input
        (the previous scale's vectors, upsampled). FlexVAR predicts whole maps, not residuals, so a
        token whose change a policy zeroes keeps the interpolated previous prediction — SparseVAR on
        FlexVAR as the paper's appendix A runs it."""
        vec_BlC = F.embedding(codes_Bl, self.vqvae.codebook())
        if si == 0:
            return vec_BlC
        sch = run.schedule
        return vec_BlC - run.workspace.next_BLC[:, sch.offsets[si]:sch.offsets[si + 1]]

    @torch.no_grad()
    def accumulate(self, si: int, residual_BlC: torch.Tensor, run: RunState) -> None:
        ws, sch = run.workspace, run.schedule
        B, l, c = residual_BlC.shape
        pn = sch.hw[si][0]
        q_BlC = residual_BlC if si == 0 else residual_BlC + ws.next_BLC[:, sch.offsets[si]:sch.offsets[si + 1]]
        q_BChw = q_BlC.transpose(1, 2).reshape(B, c, pn, pn)                          # (B, l, c) → (B, c, pn, pn)
        ws.codes[si].copy_(q_BChw)
        if si + 1 < sch.num_scales:
            self._write_next_input(si, run)

    def _write_next_input(self, si: int, run: RunState) -> None:
        """Scale si + 1's input: scale si's code vectors, bicubic-upsampled to its size."""
        ws, sch = run.workspace, run.schedule
        nxt = sch.hw[si + 1][0]
        up = F.interpolate(ws.codes[si], size=(nxt, nxt), mode="bicubic")
        ws.next_BLC[:, sch.offsets[si + 1]:sch.offsets[si + 2]].copy_(up.flatten(2).transpose(1, 2))   # → (B, hw, c)

    def latent(self, run: RunState) -> torch.Tensor:
        """The code vectors (B, c, pn, pn) of the last scale computed so far (FlexVAR decodes the
        last map alone)."""
        done = [s.si for s in run.stats.scales if not s.skipped]
        return run.workspace.codes[done[-1] if done else 0]

    @torch.no_grad()
    def replace_latent(self, si: int, latent: torch.Tensor, run: RunState) -> None:
        run.workspace.codes[si].copy_(latent)
        if si + 1 < run.schedule.num_scales:
            self._write_next_input(si, run)

    @torch.no_grad()
    def decode(self, run: RunState) -> torch.Tensor:
        """The last computed scale's code vectors through the decoder; when later scales were skipped,
        bicubic-upsampled to the last scale's size first (as the model's own next input would be),
        so the picture keeps the schedule's size."""
        q = self.latent(run)
        side = run.schedule.hw[-1][0]
        if q.shape[-1] != side:
            q = F.interpolate(q, size=(side, side), mode="bicubic")
        img = self.vqvae.decoder(self.vqvae.post_quant_conv(q.to(self.vqvae.post_quant_conv.weight.dtype))).float()
        return (img.clamp(-1, 1) + 1) * 0.5

    def decode_key(self, run: RunState) -> None:
        """None: the decode reads the last computed scale's codes, whose buffer and size change with
        the skipped scales, so it runs eagerly (VAR's key would replay one scale's buffer for all)."""
        return None


__all__ = ["FlexVARTransformer", "FlexVARAdapter", "FlexVARConditioning", "FLEXVAR_PRESETS", "POS_GRID"]
