"""Infinity's engine adapter (engine/adapter.py): conditioning on T5 prompt features, the workspace of
one shape (KV cache, text memory, latent), guidance with a temperature, one draw per bit, and the
BSQ-VAE latent."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch
import torch.nn.functional as F

from ...engine.adapter import ModelAdapter
from ...engine.kv_cache import KVCache
from ...engine.sampling import sample_codes_per_image, takes_drawn_noise
from ...engine.state import RunState
from ...engine.workspace import Workspace
from .._blocks import AbsorbedCrossMemory, CrossMemory, absorbs_cross_attention
from ..bsq_vae import code_value, next_scale_input, upsample_codes
from ..text_encoder import TextFeatures
from .resolution import DEFAULT_RESOLUTION, VAE_STRIDE, InfinityResolution, level, rope_at, rope_cos_sin
from .transformer import InfinityBlock, InfinityTransformer, _Call

TEXT_BUCKET = 32                      # CUDA: text K/V padded to a multiple of this many tokens (shared graphs)


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


class _InfinityWorkspace(Workspace):
    """Buffers of one batch size and schedule, reused across generations of the same shape. The adapter
    keeps one at a time (``InfinityAdapter.begin``): a call of another shape frees it first."""

    def __init__(self, model: InfinityTransformer, batch: int, resolution: InfinityResolution, vae_dim: int,
                 patchify: bool, device, dtype, kv_tail: bool = False, kv_slots=None):
        hw = resolution.hw
        L = sum(h * w for h, w in hw)
        super().__init__(device, L)
        cfg = model.config
        R, C, N = 2 * batch, cfg.embed_dim, cfg.depth
        self.kv_tail = kv_tail                # the last scale's K/V in a tail shared by the layers (kv_tail_used)
        self._kv_args = (N, R, cfg.num_heads, model.head_dim, [h * w for h, w in hw], dtype, device, kv_slots,
                         kv_tail)
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
        self.qkv_bias_N3C = torch.zeros(N, 3 * C, device=device, dtype=dtype)
        self.q_mult_NH1 = torch.zeros(N, cfg.num_heads, 1, device=device, dtype=torch.float32)
        self.ada_gss_N6C = torch.zeros(N, 6, C, device=device, dtype=torch.float32)
        self.weights = None                   # the weights_key the three buffers above were filled from
        cos, sin = rope_cos_sin(hw, resolution.rope_grid, model.head_dim)
        self.cos_LD, self.sin_LD = cos.to(device), sin.to(device)
        # the text memory of every layer's cross-attention (text_inputs, fill_text), padded to a bucket of TEXT_BUCKET
        # tokens on CUDA so that prompts of similar length share captured graphs
        self._ca_args = (N, R, cfg.num_heads, model.head_dim, dtype, device)
        self.ca_k_NRHTd: Optional[torch.Tensor] = None
        self.ca_v_NRHTd: Optional[torch.Tensor] = None
        self.ca_valid_R11T: Optional[torch.Tensor] = None
        self.text_RTC: Optional[torch.Tensor] = None       # fill_text's inputs (text_inputs): features, lengths
        self.text_lens_R = torch.zeros(R, device=device, dtype=torch.long)
        self.text_tokens = 0                               # their padded length (text_inputs)
        self.cond_RC = torch.zeros(R, C, device=device, dtype=torch.float32)    # the pooled prompt (prepare)
        self.ca_masked = False
        self.ca_kq_NRMC: Optional[torch.Tensor] = None      # absorbed form (M = H·T): see text_inputs
        self.ca_bias_NR1M: Optional[torch.Tensor] = None
        self.ca_vo_NRMC: Optional[torch.Tensor] = None
        self.image_buffer: Optional[torch.Tensor] = None   # decoded images of graphed runs (see decode)
        self.graph_inputs = None              # what captured graphs point at (weights, KV cache, text buffers)

    def text_inputs(self, ca_RTC: torch.Tensor, lens: Sequence[int], absorb: str = "auto") -> int:
        """Take the projected T5 features ``ca_RTC`` (R, T, C) and the prompts' token counts into the
        static input buffers that :meth:`fill_text` reads, zero-padded to the bucket of TEXT_BUCKET
        tokens on CUDA (so that prompts of similar length share captured graphs), and make the text
        memory buffers of that bucket: the absorbed form (``_blocks.absorb_cross_attention``: each
        layer's query and output projections folded into the memory) where
        ``absorbs_cross_attention`` says so — less work (H·T ≤ C/2 for the padded length T) and at
        most 1 GiB of buffers — else K/V; ``absorb`` ``"always"`` / ``"never"`` force one form
        (``InfinityAdapter.absorb_cross_attention``). Returns the padded length."""
        N, Rmax, H, d, dtype, device = self._ca_args
        R, T, _ = ca_RTC.shape
        C = H * d
        bucket = TEXT_BUCKET if device.type == "cuda" else 1
        Tb = -(-T // bucket) * bucket
        if absorb not in ("auto", "always", "never"):
            raise ValueError(f"absorb_cross_attention={absorb!r}: choose 'auto', 'always' or 'never'")
        absorbed_bytes = 2 * N * Rmax * H * Tb * C * torch.empty((), dtype=dtype).element_size()
        absorbed = absorb == "always" or (absorb == "auto" and absorbs_cross_attention(H, Tb, C, absorbed_bytes))
        if absorbed and (self.ca_kq_NRMC is None or self.ca_kq_NRMC.shape[2] != H * Tb):
            self.ca_k_NRHTd = self.ca_v_NRHTd = self.ca_valid_R11T = None
            self.ca_kq_NRMC = torch.zeros(N, Rmax, H * Tb, C, device=device, dtype=dtype)
            self.ca_vo_NRMC = torch.zeros_like(self.ca_kq_NRMC)
            self.ca_bias_NR1M = torch.zeros(N, Rmax, 1, H * Tb, device=device, dtype=torch.float32)
        if not absorbed and (self.ca_k_NRHTd is None or self.ca_k_NRHTd.shape[3] != Tb):
            self.ca_kq_NRMC = self.ca_vo_NRMC = self.ca_bias_NR1M = None
            self.ca_k_NRHTd = torch.zeros(N, Rmax, H, Tb, d, device=device, dtype=dtype)
            self.ca_v_NRHTd = torch.zeros_like(self.ca_k_NRHTd)
            self.ca_valid_R11T = torch.zeros(Rmax, 1, 1, Tb, device=device, dtype=torch.bool)
        if self.text_RTC is None or self.text_RTC.shape[1] != Tb:
            self.text_RTC = torch.zeros(Rmax, Tb, C, device=device, dtype=torch.float32)
        self.text_RTC[:R, :T].copy_(ca_RTC)
        self.text_RTC[:R, T:].zero_()
        self.text_lens_R[:R].copy_(torch.tensor(list(lens), dtype=torch.long))
        # equal lengths filling the buffer need no key mask (keeps the fast SDPA kernels available)
        self.ca_masked = not absorbed and any(n != Tb for n in lens)
        return Tb

    def fill_text(self, blocks: Iterable[InfinityBlock], R: int) -> None:
        """Every layer's text memory for the first ``R`` rows, from the inputs :meth:`text_inputs`
        took, into the buffers it made: tensor work alone (``InfinityAdapter.prepare``). Keys past
        a row's prompt length are masked out (the absorbed form: a -inf bias; K/V: the key mask);
        their entries are computed from the zero padding and never attended."""
        ca_RTC = self.text_RTC[:R]
        Tb = ca_RTC.shape[1]
        valid_RT = torch.arange(Tb, device=ca_RTC.device)[None, :] < self.text_lens_R[:R, None]    # (R, Tb)
        for i, blk in enumerate(blocks):
            k_RHTd, v_RHTd = blk.ca.text_kv(ca_RTC)
            if self.ca_absorbed:
                mem = blk.ca.absorb(k_RHTd, v_RHTd, valid_RT)
                self.ca_kq_NRMC[i, :R].copy_(mem.kq_RNC)
                self.ca_vo_NRMC[i, :R].copy_(mem.vo_RNC)
                self.ca_bias_NR1M[i, :R].copy_(mem.bias_R1N)
            else:
                self.ca_k_NRHTd[i, :R].copy_(k_RHTd)
                self.ca_v_NRHTd[i, :R].copy_(v_RHTd)
        if not self.ca_absorbed:
            self.ca_valid_R11T[:R, 0, 0].copy_(valid_RT)

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

    def check_graphs(self, param_ptrs: tuple) -> None:
        """Drop captured graphs whose buffers moved (a re-allocated KV cache, weights moved away and
        back by offloading — ``param_ptrs``, the model's parameter addresses —, another text bucket
        or mask): they would read freed memory."""
        inputs = (param_ptrs, self.kv.storage_ptrs(),
                  self.text_buffers(), self.ca_absorbed, self.ca_masked)
        if inputs != self.graph_inputs:
            self.graphs.clear()
            self.graph_inputs = inputs

    def ensure_kv(self) -> KVCache:
        """The KV cache, allocated again if :meth:`drop_kv` freed it for the decoder."""
        if self.kv is None:
            self.kv = KVCache.for_schedule(*self._kv_args)
        return self.kv

    def drop_kv(self) -> None:
        """Free the KV cache before the VAE decodes: the decoder's activations can then reuse its
        memory, so the peak is the larger of the two phases, not their sum (2B at 2048²: 10 GB of
        K/V against a decoder working on 2048² maps)."""
        self.kv = None


class InfinityAdapter(ModelAdapter):
    """The engine's view of an Infinity transformer + its BSQ-VAE (engine/adapter.py).

    Conditioning is an :class:`InfinityConditioning`; rows through the transformer are
    [cond (B); uncond (B)] while guidance is on (guidance_scale != 1). Guidance: logits/τ, then
    cfg·cond + (1 − cfg)·uncond per bit pair. Sampling: top-k / top-p and one draw per bit.
    """

    family = "infinity"
    supports_scale_graphs = True
    sublayers = ("self_attn", "cross_attn", "ffn")
    choices = 2                                        # a bit per pair of logits

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
        super().__init__(transformer, resolution.schedule, transformer.blocks)
        self.vae, self.resolution = vae, resolution
        self.layer_groups = transformer.config.num_block_chunks
        self._code = code_value(d_vae)                 # every code entry is ±this (1/√d of the VAE's bits)
        # "auto" | "always" | "never": fold the cross-attention's projections into the text memory
        # (_InfinityWorkspace.text_inputs); "auto" does where that is less work (short prompts)
        self.absorb_cross_attention = "auto"
        # the last scale's K/V in one buffer shared by the layers when the whole cache would be large
        # (ModelAdapter.kv_tail_used; 2B in bf16, tail included: 1024² 3.5 GB of K/V instead of 5.5 GB,
        # 2048² 10.9 GB instead of 18.9)
        self.kv_tail = "auto"

    @property
    def device(self) -> torch.device:
        return self.transformer.pos_start.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.block_dtype()

    def kv_layout(self) -> tuple[int, int, int]:
        cfg = self.transformer.config
        return cfg.depth, cfg.num_heads, self.transformer.head_dim

    # ---- adapter interface ----------------------------------------------------------------------
    @torch.no_grad()
    def begin(self, run: RunState, cond: InfinityConditioning) -> None:
        """Set up a generation in the workspace of this batch size, resolution, device, dtype and
        ``kv_tail`` (:meth:`~...engine.adapter.ModelAdapter.workspace`: one kept at a time)."""
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
        tail = self.kv_tail_used(res.schedule, 2 * B, run.kv_slots)
        key = (B, res.hw, res.rope_grid, self.device, self.dtype, tail, run.kv_slots)
        ws = self.workspace(key, lambda: _InfinityWorkspace(m, B, res, self.vae.config.codebook_dim, self.patchify,
                                                            self.device, self.dtype, tail, run.kv_slots))
        run.cfg_active = float(run.settings.guidance_scale) != 1.0
        text = cond.prompt
        if run.cfg_active:
            text = TextFeatures.cat([cond.prompt, cond.negative if cond.negative is not None
                                     else m.uncond_text(cond.prompt.lens)])
        R = text.batch
        cond_RD, ca_RTC, mask_RT = m.encode_text(text.to(self.device, torch.float32))
        ws.cond_RC[:R].copy_(cond_RD)
        # what depends on the weights alone is filled again only when they changed (a new storage or
        # in-place version; parameters made under inference mode keep no version: every call)
        weights, versioned = m.weights_key()
        if not versioned or ws.weights != weights:
            m.weight_constants(ws.qkv_bias_N3C, ws.q_mult_NH1, ws.ada_gss_N6C)
            ws.weights = weights if versioned else None
        ws.text_tokens = ws.text_inputs(ca_RTC, text.lens, self.absorb_cross_attention)
        run.model_state.update(temperature=float(cond.temperature))
        ws.ensure_kv().reset()
        ws.check_graphs(tuple(k[0] for k in weights) if versioned else weights)          # the addresses
        if run.cuda_graphs and ws.image_buffer is None:          # see decode: made while the KV cache is held
            H, W = res.hw[-1]
            ws.image_buffer = torch.empty(B, 3, H * VAE_STRIDE, W * VAE_STRIDE, device=self.device)
        if not run.cfg_active:
            ws.kv.keep_rows(B)
        run.workspace = ws

    @torch.no_grad()
    def prepare(self, run: RunState) -> None:
        """From the pooled prompt and the text features :meth:`begin` took: the start token, every
        block's modulation (``InfinityBlock.modulation``: ada_gss + shared, then the "+1" of the two
        scales), the text memory of every layer, the head's modulation; the latent cleared."""
        m, ws, R = self.transformer, run.workspace, run.rows
        cond_RD = ws.cond_RC[:R]
        ws.sos_R1C[:R].copy_(cond_RD.unsqueeze(1) + m.pos_start + m.lvl_embed.weight[0].float())
        ada_NR6C = ws.ada_NR6C[:, :R]
        torch.add(ws.ada_gss_N6C[:, None], m.shared_adaln(cond_RD)[None], out=ada_NR6C)
        ada_NR6C[:, :, 2:4] += 1
        ws.fill_text(self.streamed_blocks(), R)
        ws.head_mod_R2C[:R].copy_(m.head_adaln(cond_RD))
        ws.summed_BdHW.zero_()

    def prepare_key(self, run: RunState) -> tuple:
        ws = run.workspace
        return run.rows, ws.text_tokens, ws.ca_absorbed

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

    # ---- the layer loop's family part (engine/layers.py) -------------------------------------------
    def chains_layers(self) -> bool:
        return self.ops.kind != "torch"

    def chains_into_head(self) -> bool:
        return False

    def scale_constants(self, si: int, run: RunState, pos: torch.Tensor):
        """RoPE of the scale's tokens, shared by its layers."""
        return rope_at(run.workspace.cos_LD, run.workspace.sin_LD, pos)

    def layer_call(self, si: int, i: int, run: RunState, pos, valid_Rn, record: bool, rope_l) -> _Call:
        ws = run.workspace
        return _Call(kv=ws.kv, si=si, layer=i, run=run, qkv_bias=ws.qkv_bias_N3C[i], q_mult=ws.q_mult_NH1[i],
                     cos_LD=ws.cos_LD, sin_LD=ws.sin_LD, pos=pos, valid_Rl=valid_Rn, record=record,
                     ca=ws.text_memory(i), rope_l=rope_l, ops=self.ops)

    def chained_layer(self, i: int, x_RlC: torch.Tensor, y_RlC: torch.Tensor, chain_next: bool, call: _Call):
        ws, R = call.run.workspace, call.run.rows
        next_mod = ws.ada_NR6C[i + 1, :R] if chain_next else None
        return self.blocks[i].forward_chained(x_RlC, y_RlC, ws.ada_NR6C[i, :R], next_mod, call, ws.ones_R1C)

    def head(self, x_RLC: torch.Tensor, run: RunState, modulated: bool = False) -> torch.Tensor:
        """Raw float32 bit logits (R, L, 2d)."""
        return self.transformer.logits(x_RLC, run.workspace.head_mod_R2C[:run.rows], self.ops)

    def guide(self, si: int, logits_RlV: torch.Tensor, run: RunState) -> torch.Tensor:
        """logits/τ, then cfg·cond + (1 − cfg)·uncond (the reference's order of operations)."""
        inv_tau = 1.0 / run.model_state["temperature"]
        B = run.batch_size
        if not run.cfg_active:
            return logits_RlV[:B].mul(inv_tau)
        cfg = float(run.settings.guidance_scale)
        scaled = logits_RlV.mul(inv_tau)
        return cfg * scaled[:B] + (1 - cfg) * scaled[B:]

    def scale_noise(self, si: int, run: RunState) -> Optional[tuple]:
        """The (B·l·d, 2) Exp(1) noise of one draw per bit, when one generator on the model's device
        draws it."""
        if not takes_drawn_noise(run.generator, self.device):
            return None
        h, w = run.schedule.hw[si]
        return (("exponential", (run.batch_size * h * w * self.transformer.config.token_dim, 2)),)

    def scale_graph_constants(self, run: RunState) -> tuple:
        return (run.model_state["temperature"],)

    def sample(self, si: int, guided_BlV: torch.Tensor, run: RunState) -> torch.Tensor:
        """One draw per bit: (B, l, 2d) logits → (B, l, d) int64 bits (top-k / top-p over each bit's
        two values; only top_k = 1 changes anything — greedy)."""
        B, l, V = guided_BlV.shape
        s = run.settings
        bits_Bn = sample_codes_per_image(guided_BlV.reshape(B, l * V // 2, 2), s.top_k, s.top_p, run.generator,
                                         noise_NV=run.drawn(0))
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
        self._write_next_input(si, run)

    def _write_next_input(self, si: int, run: RunState) -> None:
        """Scale si + 1's input map, from the summed codes."""
        ws, sch = run.workspace, run.schedule
        start, end = sch.offsets[si + 1], sch.offsets[si + 2]
        ws.next_BLD[:, start:end].copy_(next_scale_input(ws.summed_BdHW, sch.hw[si + 1], self.patchify))

    def latent(self, run: RunState) -> torch.Tensor:
        return run.workspace.summed_BdHW

    @torch.no_grad()
    def replace_latent(self, si: int, latent: torch.Tensor, run: RunState) -> None:
        run.workspace.summed_BdHW.copy_(latent)
        if si < run.schedule.num_scales - 1:
            self._write_next_input(si, run)

    @torch.no_grad()
    def decode(self, run: RunState) -> torch.Tensor:
        ws = run.workspace
        ws.drop_kv()                                   # the scale loop is over: lend the cache's memory to the decoder
        img = self.vae.decode(ws.summed_BdHW)
        if not run.cuda_graphs:
            return (img + 1) * 0.5                                                   # [-1, 1] → [0, 1]
        # Captured graphs hold the cache's addresses. Allocated again while anything the decoder
        # made is still alive, the cache can land elsewhere and every graph would be captured again
        # at every call. So the image goes to a buffer made before the
        # loop, the decoder's memory is released, and the cache is taken back at once.
        out = ws.image_buffer
        out.copy_(img)
        del img
        ws.ensure_kv()
        return out.add_(1).mul_(0.5).clone()                                         # [-1, 1] → [0, 1]
