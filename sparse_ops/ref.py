"""Pure-torch references of every sparse op: the CPU path, the fallback where Triton cannot run,
and the oracle the Triton kernels are tested against (tests/test_sparse_ops.py).

Each function here has a Triton twin of the same name and signature in its op's file
(``gather_modulate.py``, ``restore.py``, ``pivotal.py``, ``select.py``, ``anchor.py``, ``colsum.py``, …); the
dispatching front ends are in ``ops.py``. None of them reads a tensor's value on the host, so
they are safe inside the scale loop and under CUDA-graph capture.

Row indices are 1-D per row and applied with ``index_select`` / ``index_copy`` on the flattened
rows, never with ``gather``/``scatter`` over an index expanded to (n, C) (research/kernels.md §2:
that index is 4× the bytes of bf16 data).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# token roles in SparseVAR's per-scale maps (GenerationStats.token_maps, sparsevar.viz)
TOKEN_EXCLUDED = 0        # not computed, zero residual at this scale
TOKEN_COPIED = 1          # not computed, hidden state copied from its anchor
TOKEN_KEPT = 2            # computed (high-frequency)
TOKEN_ANCHOR = 3          # computed (anchor grid)


def _flat_rows(idx_Rn: torch.Tensor, L: int) -> torch.Tensor:
    """(R, n) positions inside each row → (R·n,) positions in the flattened (R·L) rows."""
    R = idx_Rn.shape[0]
    offsets_R1 = torch.arange(R, device=idx_Rn.device, dtype=torch.long)[:, None] * L
    return (idx_Rn.long() + offsets_R1).reshape(-1)                                # (R, n) → (R·n,)


# ---- (e) the dense path's fused elementwise steps ---------------------------------------------------
def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / √(mean(x²) + eps)`` over the last dim, in x's dtype (RMSNorm without its weight)."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def residual_norm_modulate(x_RlC: torch.Tensor, branch_RlC: Optional[torch.Tensor], gate_R1C: Optional[torch.Tensor],
                           mul_R1C: torch.Tensor, shift_R1C: torch.Tensor, eps: float,
                           out_dtype: torch.dtype, rms: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x', y): ``x' = x + gate · branch`` in x's dtype (``x' = x`` when ``branch`` is None) and
    ``y = LN(x') · mul + shift`` (LayerNorm without affine, in float32; with ``rms`` RMSNorm without
    its weight, which the caller folds into ``mul``) as ``out_dtype`` — a sub-layer's gated residual
    followed by the next sub-layer's AdaLN input."""
    if branch_RlC is not None:
        x_RlC = torch.addcmul(x_RlC, branch_RlC, gate_R1C).to(x_RlC.dtype)
    if rms:
        y_RlC = rms_normalize(x_RlC.to(torch.promote_types(x_RlC.dtype, torch.float32)), eps)  # float64 oracle
    else:
        y_RlC = F.layer_norm(x_RlC.float(), (x_RlC.shape[-1],), eps=eps)
    return x_RlC, torch.addcmul(shift_R1C, y_RlC, mul_R1C).to(out_dtype)


def token_residual_norm_modulate(x_NC: torch.Tensor, branch_NC: Optional[torch.Tensor], gate_NC: Optional[torch.Tensor],
                                 scale_NC: torch.Tensor, shift_NC: torch.Tensor, weight_C: Optional[torch.Tensor],
                                 bias_C: Optional[torch.Tensor], eps: float,
                                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x', y) with a modulation per token (MAR's diffusion MLP, HART's head): ``x' = x + gate ·
    branch`` in x's dtype (``x' = x`` when ``branch`` is None) and ``y = (LN(x') · weight + bias) ·
    (1 + scale) + shift`` in float32 (LayerNorm's affine optional: None, None for none) as
    ``out_dtype``. ``gate``, ``scale`` and ``shift`` are (N, C) — column blocks of one modulation
    product, with its row stride."""
    if branch_NC is not None:
        x_NC = torch.addcmul(x_NC, branch_NC, gate_NC).to(x_NC.dtype)
    dt = torch.promote_types(x_NC.dtype, torch.float32)                                 # float64 oracle
    w, b = (weight_C.to(dt), bias_C.to(dt)) if weight_C is not None else (None, None)
    y = F.layer_norm(x_NC.to(dt), (x_NC.shape[-1],), w, b, eps)
    return x_NC, torch.addcmul(shift_NC, y, 1 + scale_NC).to(out_dtype)


def linear_residual_norm_modulate(h_RlK: torch.Tensor, weight_CK: torch.Tensor, bias_C: Optional[torch.Tensor],
                                  x_RlC: torch.Tensor, gate_R1C: torch.Tensor, mul_R1C: torch.Tensor,
                                  shift_R1C: torch.Tensor, eps: float,
                                  out_dtype: torch.dtype, rms: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A sub-layer's output projection, its gated residual and the next sub-layer's AdaLN input:
    ``branch = h · weightᵀ + bias`` in h's dtype, then ``residual_norm_modulate(x, branch, …)``."""
    return residual_norm_modulate(x_RlC, linear(h_RlK, weight_CK, bias_C), gate_R1C, mul_R1C, shift_R1C, eps,
                                  out_dtype, rms)


def qk_norm_store(qkv_Rl3Hd: torch.Tensor, mult_2H1: torch.Tensor, k_dst_RHld: torch.Tensor,
                  v_dst_RHld: torch.Tensor) -> torch.Tensor:
    """Cosine attention's q/k step with the KV-cache write: q and k L2-normalised over the head
    dim (float32, norm clamped at 1e-12) and scaled by ``mult_2H1`` = [temperature; 1] per head;
    normalised k and raw v are written into their cache slots (R, H, l, d); returns q (R, H, l, d)."""
    qk_Rl2Hd = qkv_Rl3Hd[:, :, :2]
    acc = torch.promote_types(qkv_Rl3Hd.dtype, torch.float32)                       # float32 (float64 oracle)
    norm = torch.linalg.vector_norm(qk_Rl2Hd, dim=-1, keepdim=True, dtype=acc)
    qk_Rl2Hd = (qk_Rl2Hd * (mult_2H1 / norm.clamp_min(1e-12))).to(qkv_Rl3Hd.dtype)
    k_dst_RHld.copy_(qk_Rl2Hd[:, :, 1].transpose(1, 2))                           # (R, l, H, d) → (R, H, l, d)
    v_dst_RHld.copy_(qkv_Rl3Hd[:, :, 2].transpose(1, 2))
    return qk_Rl2Hd[:, :, 0].transpose(1, 2)


def qk_norm_attend(qkv_Rl3Hd: torch.Tensor, mult_2H1: torch.Tensor, k_RHLd: torch.Tensor,
                   v_RHLd: torch.Tensor) -> torch.Tensor:
    """VAR's whole attention step over the KV cache: ``qk_norm_store`` of this scale's ``l`` tokens
    into the last ``l`` slots of the cache views ``k_RHLd`` / ``v_RHLd`` (R, H, L, d), then
    softmax(q·kᵀ)·v over all ``L`` slots (scale 1: the temperature is in q). Returns (R, l, H, d),
    which reshapes to (R, l, C) for the output projection."""
    l, L = qkv_Rl3Hd.shape[1], k_RHLd.shape[2]
    q_RHld = qk_norm_store(qkv_Rl3Hd, mult_2H1, k_RHLd[:, :, L - l:], v_RHLd[:, :, L - l:])
    return F.scaled_dot_product_attention(q_RHld, k_RHLd, v_RHLd, scale=1.0).transpose(1, 2)


# ---- (a) gather → LayerNorm → AdaLN modulation, and its inverse ------------------------------------
def rope_pairs(x_RlHd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (2p, 2p+1) of (R, l, H, d) by cos/sin (R or 1, l, 1, d/2)."""
    R, l, H, d = x_RlHd.shape
    pair = x_RlHd.view(R, l, H, d // 2, 2)                                           # (R, l, H, d) → pairs
    a, b = pair[..., 0], pair[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).view(R, l, H, d)


def qk_norm_rope_store(qkv_Rl3Hd: torch.Tensor, q_mult_H1: torch.Tensor, cos_Rl1P: torch.Tensor,
                       sin_Rl1P: torch.Tensor, k_dst_RHld: torch.Tensor, v_dst_RHld: torch.Tensor) -> torch.Tensor:
    """Infinity's q/k step with the KV-cache write: q and k L2-normalised over the head dim (float32,
    norm clamped at 1e-12), q times its temperature ``q_mult_H1`` per head, both rotated by 2-D RoPE
    on adjacent channel pairs (``cos``/``sin`` (R or 1, l, 1, d/2) float32); k (rounded to the
    cache dtype) and raw v are written into their cache slots (R, H, l, d); returns q (R, H, l, d)
    in qkv's dtype."""
    qk_Rl2Hd = qkv_Rl3Hd[:, :, :2].float()
    qk_Rl2Hd = qk_Rl2Hd / torch.linalg.vector_norm(qk_Rl2Hd, dim=-1, keepdim=True).clamp_min(1e-12)
    q_RlHd = rope_pairs(qk_Rl2Hd[:, :, 0] * q_mult_H1, cos_Rl1P, sin_Rl1P)
    k_RlHd = rope_pairs(qk_Rl2Hd[:, :, 1].contiguous(), cos_Rl1P, sin_Rl1P)
    k_dst_RHld.copy_(k_RlHd.transpose(1, 2))                                       # (R, l, H, d) → (R, H, l, d)
    v_dst_RHld.copy_(qkv_Rl3Hd[:, :, 2].transpose(1, 2))
    return q_RlHd.transpose(1, 2).to(qkv_Rl3Hd.dtype)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the last dim: ``x·cos + [−x₂, x₁]·sin`` (channel j pairs with j ± d/2;
    ``cos``/``sin`` broadcast against x, in the dtype the caller computes in)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_half_store(qkv_Rl3Hd: torch.Tensor, cos_Rld: torch.Tensor, sin_Rld: torch.Tensor, q_scale: float,
                    k_dst_RHld: torch.Tensor, v_dst_RHld: torch.Tensor) -> torch.Tensor:
    """HART's q/k step with the KV-cache write: q and k rotated by rotate-half RoPE (channel j pairs
    with j ± d/2: ``x·cos + [−x₂, x₁]·sin``, ``cos``/``sin`` (R or 1, l, d) float32), in float32 and
    rounded once; q then times ``q_scale`` (the attention temperature). k (rounded to the cache
    dtype) and raw v are written into their cache slots (R, H, l, d); returns q (R, H, l, d) in
    qkv's dtype."""
    acc = torch.promote_types(qkv_Rl3Hd.dtype, torch.float32)                       # float32 (float64 oracle)
    cos, sin = cos_Rld[:, :, None, None].to(acc), sin_Rld[:, :, None, None].to(acc)    # (R, l, 1, 1, d)
    qk_Rl2Hd = rope_half(qkv_Rl3Hd[:, :, :2].to(acc), cos, sin)
    k_dst_RHld.copy_(qk_Rl2Hd[:, :, 1].transpose(1, 2))                            # (R, l, H, d) → (R, H, l, d)
    v_dst_RHld.copy_(qkv_Rl3Hd[:, :, 2].transpose(1, 2))
    return (qk_Rl2Hd[:, :, 0] * q_scale).transpose(1, 2).to(qkv_Rl3Hd.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           gelu: bool = False) -> torch.Tensor:
    """``x`` (…, K) · ``weight`` (N, K)ᵀ + ``bias`` (N,), then tanh-GELU when ``gelu``: (…, N)."""
    y = F.linear(x, weight, bias)
    return F.gelu(y, approximate="tanh") if gelu else y


def stage_embed(f_hat_BChw: torch.Tensor, h: int, w: int, weight_CK: torch.Tensor, bias_C: Optional[torch.Tensor],
                pos_lC: torch.Tensor, copies: int) -> torch.Tensor:
    """VAR's input map of a scale: the latent area-pooled to (h, w), each pixel's K channels embedded
    by ``F.linear`` in the weight's dtype, cast to float32, plus the scale's level + position rows
    ``pos_lC``; the batch repeated ``copies`` times (the CFG halves). (copies·B, h·w, C) float32."""
    B, K = f_hat_BChw.shape[:2]
    pooled_BKhw = F.interpolate(f_hat_BChw, size=(h, w), mode="area")
    tokens_BlK = pooled_BKhw.view(B, K, h * w).transpose(1, 2)                      # (B, K, h, w) → (B, hw, K)
    x_BlC = F.linear(tokens_BlK.to(weight_CK.dtype), weight_CK, bias_C).float() + pos_lC
    return x_BlC.repeat(copies, 1, 1)


def phi(h_BChw: torch.Tensor, weight_CC33: torch.Tensor, bias_C: torch.Tensor, ratio: float) -> torch.Tensor:
    """The VQVAE's φ: ``(1 − r)·h + r·(conv3×3(h) + bias)`` (zero padding), float32 with autocast off,
    each product and sum rounding on its own; a new tensor."""
    with torch.autocast(device_type=h_BChw.device.type, enabled=False):
        h_BChw = h_BChw.float()
        conv_BChw = F.conv2d(h_BChw, weight_CC33.float(), bias_C.float(), stride=1, padding=1)
        return h_BChw.mul(1.0 - ratio) + conv_BChw.mul_(ratio)


def phi_accumulate(h_BChw: torch.Tensor, weight_CC33: torch.Tensor, bias_C: torch.Tensor, ratio: float,
                   f_hat_BChw: torch.Tensor) -> torch.Tensor:
    """VAR's latent update at one scale, in place: ``f_hat += φ(h)`` (:func:`phi`), ``h`` being the
    scale's residual upsampled to the latent's size. Returns ``f_hat``."""
    return f_hat_BChw.add_(phi(h_BChw, weight_CC33, bias_C, ratio))


def cfg_guide(logits_RlV: torch.Tensor, batch: int, t: float) -> torch.Tensor:
    """Classifier-free guidance ``(1 + t)·cond − t·uncond`` over the [cond; uncond] halves of the rows
    (``batch`` images each), in float32: (batch, l, V). Each product and the difference round on
    their own (the scalars are float32)."""
    return (1 + t) * logits_RlV[:batch].float() - t * logits_RlV[batch:].float()


def filter_top_k_top_p(logits_NV: torch.Tensor, top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
    """A masked copy of ``logits_NV`` (the input is not modified).

    With both filters on, one ascending sort serves both: the k-th largest logit is read from it
    (instead of a separate top-k pass, which costs as much as the sort), and masking the sorted copy
    below it gives exactly the sorted masked logits the nucleus step needs. Only where logits tie
    exactly at the nucleus boundary can the surviving one of them differ from sorting the masked
    logits (the order of ties is arbitrary either way)."""
    if logits_NV.shape[-1] == 2:
        return _filter_pairs(logits_NV, top_k, top_p)
    return _filter_sorted(logits_NV, top_k, top_p)


def _filter_sorted(logits_NV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """:func:`filter_top_k_top_p` for any vocabulary: a sort and a cumulative sum."""
    V = logits_NV.shape[-1]
    use_k = 0 < top_k < V
    if top_p <= 0.0:
        if not use_k:
            return logits_NV
        kth_N1 = torch.topk(logits_NV, top_k, dim=-1, largest=True, sorted=False).values.amin(dim=-1, keepdim=True)
        return logits_NV.masked_fill(logits_NV < kth_N1, float("-inf"))
    sorted_NV, order_NV = torch.sort(logits_NV, dim=-1, descending=False)
    out = logits_NV
    if use_k:
        kth_N1 = sorted_NV[:, V - top_k:V - top_k + 1]                        # the k-th largest
        sorted_NV = sorted_NV.masked_fill(sorted_NV < kth_N1, float("-inf"))
        out = logits_NV.masked_fill(logits_NV < kth_N1, float("-inf"))
    cum_NV = sorted_NV.softmax(dim=-1).cumsum_(dim=-1)
    remove_sorted = cum_NV <= (1.0 - top_p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(-1, order_NV, remove_sorted)
    return out.masked_fill(remove, float("-inf"))


def _filter_pairs(logits_N2: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """:func:`filter_top_k_top_p` for two-way logits (Infinity's bits) in closed form, without the
    sort and the cumulative sum, which are slow over many rows of two. Same result as the sorted
    path: top_k = 1 keeps the larger entry (both at a tie), any other top_k keeps both; the nucleus
    removes the smaller entry when its probability is <= 1 - top_p (at a tie entry 0 counts as the
    smaller, where the sort may take either)."""
    out = logits_N2
    if top_k == 1:
        out = logits_N2.masked_fill(logits_N2 < logits_N2.amax(dim=-1, keepdim=True), float("-inf"))
    if top_p <= 0.0:
        return out
    p_N2 = out.softmax(dim=-1)
    first_is_0_N = logits_N2[:, 0] <= logits_N2[:, 1]                       # the ascending sort's first entry
    p_first_N = torch.where(first_is_0_N, p_N2[:, 0], p_N2[:, 1])
    drop_first_N = p_first_N <= (1.0 - top_p)
    remove_N2 = torch.stack((drop_first_N & first_is_0_N, drop_first_N & ~first_is_0_N), dim=-1)
    return out.masked_fill(remove_N2, float("-inf"))


def sample_top_k_top_p(logits_NV: torch.Tensor, noise_NV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One draw per row from softmax(top-k / top-p filtered logits), given exponential noise
    ``noise_NV`` (``Exp(1)``, same shape): ``argmax(p / noise)``, the identity ``torch.multinomial``
    uses for a single sample. (N,) int64."""
    probs_NV = filter_top_k_top_p(logits_NV.float(), top_k, top_p).softmax(dim=-1)
    return (probs_NV / noise_NV).argmax(dim=-1)


def bias_softmax(logits_RlN: torch.Tensor, bias_R1N: torch.Tensor, groups: int, out_dtype: torch.dtype) -> torch.Tensor:
    """softmax(logits + bias) over each of ``groups`` consecutive segments of the last dim (one per
    attention head), in float32, returned in ``out_dtype``: (R, l, N). ``bias`` may hold −inf (masked
    keys); every segment needs one finite entry."""
    R, l, N = logits_RlN.shape
    x = (logits_RlN.float() + bias_R1N.float()).view(R, l, groups, N // groups)
    return torch.softmax(x, dim=-1).view(R, l, N).to(out_dtype)


def group_norm_silu(x_BCHW: torch.Tensor, weight_C: torch.Tensor, bias_C: torch.Tensor, groups: int, eps: float,
                    silu: bool = True, x_bias_C: Optional[torch.Tensor] = None,
                    channels_first_out: bool = False) -> torch.Tensor:
    """GroupNorm (statistics and normalisation in float32) with its affine, then SiLU when ``silu``;
    returned in x's dtype (contiguous channels-first with ``channels_first_out``). ``x_bias_C``: a
    per-channel bias added to x first (in float32), e.g. the bias of the convolution that made x."""
    x = x_BCHW.float()
    if x_bias_C is not None:
        x = x + x_bias_C.float().view(1, -1, 1, 1)
    y = F.group_norm(x, groups, weight_C.float(), bias_C.float(), eps)
    if silu:
        y = F.silu(y)
    y = y.to(x_BCHW.dtype)
    return y.contiguous() if channels_first_out else y


def residual_bias_add(x_BCHW: torch.Tensor, h_BCHW: torch.Tensor, bias_C: torch.Tensor) -> torch.Tensor:
    """``x + h + bias`` per channel, added in float32 and returned in h's dtype and memory layout:
    a residual connection whose branch is a convolution run without its bias."""
    y = x_BCHW.float() + h_BCHW.float() + bias_C.float().view(1, -1, 1, 1)
    return y.to(h_BCHW.dtype).contiguous(memory_format=_layout(h_BCHW))


def _layout(x_BCHW: torch.Tensor) -> torch.memory_format:
    """channels_last where x is stored so (and is not also plain contiguous), else contiguous."""
    if x_BCHW.is_contiguous(memory_format=torch.channels_last) and not x_BCHW.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format


def gather_rows(x_RLC: torch.Tensor, idx_Rn: torch.Tensor) -> torch.Tensor:
    """Rows ``idx_Rn`` of every batch row: (R, n, C) with ``out[r, j] = x[r, idx[r, j]]``."""
    R, L, C = x_RLC.shape
    n = idx_Rn.shape[1]
    return x_RLC.reshape(R * L, C).index_select(0, _flat_rows(idx_Rn, L)).view(R, n, C)  # (R, L, C) → (R·L, C)


def scatter_rows(base_RLC: torch.Tensor, idx_Rn: torch.Tensor, y_RnC: torch.Tensor) -> torch.Tensor:
    """A copy of ``base_RLC`` with rows ``idx_Rn`` replaced by ``y_RnC`` (the inverse of
    :func:`gather_rows`; repeated indices must carry equal rows, as SparseVAR's padding does)."""
    R, L, C = base_RLC.shape
    out = base_RLC.reshape(R * L, C).clone()                                        # (R, L, C) → (R·L, C)
    out.index_copy_(0, _flat_rows(idx_Rn, L), y_RnC.reshape(-1, C).to(out.dtype))  # (R, n, C) → (R·n, C)
    return out.view(R, L, C)                                                        # (R·L, C) → (R, L, C)


def gather_norm_modulate(x_RLC: torch.Tensor, idx_Rn: Optional[torch.Tensor], mul_R1C: torch.Tensor,
                         shift_R1C: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """``LN(x[idx]) · mul + shift`` (LayerNorm without affine, in float32) as ``out_dtype``:
    (R, n, C), the packed input of a sub-layer run on a token subset (``idx_Rn`` None: every
    token). ``mul`` is 1 + the AdaLN scale; both are (R, 1, C)."""
    x_RnC = x_RLC if idx_Rn is None else gather_rows(x_RLC, idx_Rn)
    y_RnC = F.layer_norm(x_RnC.float(), (x_RnC.shape[-1],), eps=eps)
    return torch.addcmul(shift_R1C, y_RnC, mul_R1C).to(out_dtype)


def slot_map(idx_Rn: torch.Tensor, L: int) -> torch.Tensor:
    """(R, L) int32 inverse of a token subset: which of the ``n`` entries of ``idx_Rn`` holds token
    i, or -1 for a token not in the subset."""
    R, n = idx_Rn.shape
    slot_RL = torch.full((R, L), -1, device=idx_Rn.device, dtype=torch.int32)
    return slot_RL.scatter_(1, idx_Rn.long(), torch.arange(n, device=idx_Rn.device, dtype=torch.int32).expand(R, n))


def restore_residual(x_RLC: torch.Tensor, idx_Rn: torch.Tensor, branch_RnC: torch.Tensor, gate_R1C: torch.Tensor,
                     cache_RlC: torch.Tensor, cache_hw: tuple[int, int], hw: tuple[int, int],
                     slot_RL: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FastVAR's restore: ``x + (kept ? gate · branch[slot] : area_upsample(cache))`` over all L
    tokens, in float32. ``branch_RnC`` is the sub-layer's output for tokens ``idx_Rn``; the cache
    (gated branch output of the same sub-layer at the cache scale, (≥R, hc·wc, C), any float dtype) is upsampled
    from ``cache_hw`` to ``hw`` with area interpolation. ``slot_RL``: ``slot_map(idx_Rn, L)`` when
    the caller already has it (``pivotal_tokens(..., slots=True)``), so the Triton twin need not
    build it; the result is defined by ``idx_Rn`` alone."""
    R, L, C = x_RLC.shape
    (hc, wc), (h, w) = cache_hw, hw
    cache_RlC = cache_RlC[:R].to(torch.promote_types(cache_RlC.dtype, torch.float32))   # a bf16 cache: float32
    cached_RChw = cache_RlC.transpose(1, 2).reshape(R, C, hc, wc)                     # (R, hw, C) → (R, C, h, w)
    update_RLC = F.interpolate(cached_RChw, size=(h, w), mode="area").reshape(R, C, L).transpose(1, 2)  # → (R, L, C)
    fresh_RnC = branch_RnC.float() * gate_R1C
    update_RLC = update_RLC.scatter(1, idx_Rn.long().unsqueeze(-1).expand(R, idx_Rn.shape[1], C), fresh_RnC)
    return x_RLC + update_RLC


def pivotal_tokens(x_RLC: torch.Tensor, keep: int, slots: bool = False):
    """FastVAR's pivotal tokens: (R, keep) int64 positions, ascending, of the ``keep`` tokens of
    each row farthest from the row's spatial mean, by ``Σ_c (x − mean_L x)²`` in float32 (ties:
    the earlier position first). ``slots``: return (positions, ``slot_map(positions, L)``)."""
    if not 0 <= keep <= x_RLC.shape[1]:
        raise ValueError(f"keep={keep}: choose between 0 and the {x_RLC.shape[1]} tokens of the map")
    x_RLC = x_RLC.float()
    score_RL = (x_RLC - x_RLC.mean(dim=1, keepdim=True)).pow(2).sum(dim=-1)
    order_Rk = torch.sort(score_RL, dim=1, descending=True, stable=True).indices[:, :keep]
    idx_Rk = order_Rk.sort(dim=1).values
    return (idx_Rk, slot_map(idx_Rk, x_RLC.shape[1])) if slots else idx_Rk


# ---- (b) SparseVAR: change map, then threshold / budget selection and compaction --------------------
def change_map(x_in_RnC: torch.Tensor, x_out_RnC: torch.Tensor, batch: int, idx_Bn: Optional[torch.Tensor],
               L: int) -> torch.Tensor:
    """Per-token change of the observed block, ``mean_c (out - in)²``, averaged over the CFG halves
    (rows are [half 0 images; half 1 images; …]), placed at the tokens' positions ``idx_Bn`` of a
    zero (B, L) float32 map (excluded tokens did not change); ``idx_Bn`` None: all L tokens ran."""
    R, n, _ = x_out_RnC.shape
    change_Rn = (x_out_RnC.float() - x_in_RnC.float()).pow(2).mean(dim=-1)           # (R, n)
    change_Bn = change_Rn.view(R // batch, batch, n).mean(dim=0)                     # (R, n) → (halves, B, n)
    if idx_Bn is None:
        return change_Bn
    full_BL = torch.zeros(batch, L, device=x_out_RnC.device, dtype=torch.float32)
    return full_BL.scatter_(1, idx_Bn.long(), change_Bn)


def select_kept(change_BM: torch.Tensor, src_L: torch.Tensor, anchors_L: torch.Tensor, tau: float,
                budget: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept tokens of every image, compacted on the device (no host read).

    The score of token i is ``change_BM[b, src_L[i]]`` (``src_L`` maps this scale's L tokens onto
    the M entries of the previous scale's map: nearest upsampling; identity for a map already at
    this size). Kept = anchors ∪ (score > tau · the image's largest score); with ``budget`` instead
    the anchors plus the largest scores up to ``budget`` tokens in all (ties: earlier position).

    Returns ``idx_BL`` (B, L) int64: the kept positions ascending, then padding entries that repeat
    the first kept position; ``count_B`` (B,) int64 kept counts; ``keep_BL`` (B, L) bool.
    """
    B = change_BM.shape[0]
    L = src_L.shape[0]
    change_BL = change_BM.float().index_select(1, src_L.long())
    anchors_BL = anchors_L.bool()[None].expand(B, L)
    if budget is None:
        top_B1 = change_BL.amax(dim=1, keepdim=True)
        keep_BL = (change_BL > tau * top_B1) | anchors_BL
    else:
        score_BL = change_BL.masked_fill(anchors_BL, float("inf"))
        # stable descending order: equal changes keep the earlier position
        order_Bk = torch.sort(score_BL, dim=1, descending=True, stable=True).indices[:, :budget]
        keep_BL = torch.zeros_like(anchors_BL).scatter(1, order_Bk, True) | anchors_BL
    count_B = keep_BL.sum(dim=1)
    order_BL = torch.sort((~keep_BL).to(torch.uint8), dim=1, stable=True).indices      # kept first, in order
    pad_BL = torch.arange(L, device=keep_BL.device)[None, :] >= count_B[:, None]
    idx_BL = torch.where(pad_BL, order_BL[:, :1], order_BL)
    return idx_BL, count_B, keep_BL


# ---- (c) SparseVAR: anchor matching ---------------------------------------------------------------
def anchor_match(logits_BMV: torch.Tensor, src_L: torch.Tensor, cand_L4: torch.Tensor, keep_BL: torch.Tensor,
                 anchors_L: torch.Tensor, beta: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every excluded token, the most similar of its 4 candidate anchors by cosine similarity
    of their upsampled previous-scale logits (token i's vector is ``logits_BMV[b, src_L[i]]``),
    and whether it is similar enough (≥ ``beta``) to take that anchor's hidden state.

    Returns ``copy_src_BL`` (B, L) int64: the chosen anchor of copied tokens, the token itself
    otherwise; ``zero_BL`` (B, L) bool: excluded and not copied (zero residual); ``roles_BL``
    (B, L) uint8 TOKEN_* codes; ``best_sim_BL`` (B, L) float32: the best similarity of excluded
    tokens (0 for kept ones). On equal similarities the earlier candidate wins.
    """
    B, L = keep_BL.shape
    lg_BLV = F.normalize(logits_BMV.float().index_select(1, src_L.long()), dim=-1)
    sims_BL4 = torch.stack([(lg_BLV * lg_BLV[:, cand_L4[:, j]]).sum(-1) for j in range(4)], dim=-1)
    best_sim_BL, best_j_BL = sims_BL4.max(dim=-1)
    ar_L = torch.arange(L, device=keep_BL.device)
    anchor_BL = cand_L4.long()[ar_L[None, :], best_j_BL]                             # (B, L) chosen anchor
    keep_BL = keep_BL.bool()
    excluded_BL = ~keep_BL
    copied_BL = excluded_BL & (best_sim_BL >= beta)
    copy_src_BL = torch.where(copied_BL, anchor_BL, ar_L[None].expand(B, L))
    zero_BL = excluded_BL & ~copied_BL
    roles_BL = torch.full((B, L), TOKEN_EXCLUDED, dtype=torch.uint8, device=keep_BL.device)
    roles_BL = roles_BL.masked_fill(copied_BL, TOKEN_COPIED).masked_fill(keep_BL, TOKEN_KEPT)
    roles_BL = roles_BL.masked_fill(anchors_L.bool()[None], TOKEN_ANCHOR)
    return copy_src_BL, zero_BL, roles_BL, best_sim_BL.masked_fill(keep_BL, 0.0)


# ---- (d) SparVAR: column sums of attention probabilities per query group --------------------------
def attention_colsum(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, scale: float, group: int,
                     lse_RHl: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(R, H, G, Lk) float32: for each group of ``group`` consecutive queries (G = ceil(l / group),
    the last group may be shorter), the sum over its queries of softmax(q·kᵀ·scale) over all Lk
    keys — SparVAR's decision-scale statistic (research/accel.md §4.2). ``lse_RHl``: each query's
    natural log-sum-exp of q·kᵀ·scale, when the dense pass already has it (else computed here).
    Computed one group at a time, so memory stays at (R, H, group, Lk)."""
    R, H, l, _ = q_RHld.shape
    Lk = k_RHLd.shape[2]
    G = -(-l // group)
    out_RHGL = torch.empty(R, H, G, Lk, device=q_RHld.device, dtype=torch.float32)
    k_T = k_RHLd.float().transpose(-1, -2)
    for g in range(G):
        s = q_RHld[:, :, g * group:(g + 1) * group].float() @ k_T * scale              # (R, H, ≤group, Lk)
        lse = s.logsumexp(-1) if lse_RHl is None else lse_RHl[:, :, g * group:(g + 1) * group].float()
        out_RHGL[:, :, g] = (s - lse[..., None]).exp().sum(dim=-2)
    return out_RHGL


def attention_lse(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, scale: float) -> torch.Tensor:
    """(R, H, l) float32: each query's natural log-sum-exp of q·kᵀ·scale over all keys."""
    return (q_RHld.float() @ k_RHLd.float().transpose(-1, -2) * scale).logsumexp(-1)


def key_lists(keys_RHGL: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The index form of a per-group key mask that ``group_sparse_attention`` reads: (idx (R, H, G,
    width) int32, each group's kept key positions ascending, then filler; count (R, H, G) int32).
    ``width`` is a host-side bound on any group's key count (no device sync): a group with more
    keys keeps its first ``width``. A prefix sum on the device places each key (plain torch on every
    backend)."""
    R, H, G, L = keys_RHGL.shape
    pos_RHGL = keys_RHGL.cumsum(-1, dtype=torch.int32) - 1                         # a kept key's slot
    dest_RHGL = torch.where(keys_RHGL & (pos_RHGL < width), pos_RHGL, width).long()  # others → spare slot
    idx_RHGW = torch.zeros(R, H, G, width + 1, device=keys_RHGL.device, dtype=torch.int32)
    src_RHGL = torch.arange(L, device=keys_RHGL.device, dtype=torch.int32).expand(R, H, G, L)
    idx_RHGW.scatter_(-1, dest_RHGL, src_RHGL)
    count_RHG = pos_RHGL[..., -1].add(1).clamp(max=width) if L else keys_RHGL.new_zeros(R, H, G, dtype=torch.int32)
    return idx_RHGW[..., :width], count_RHG.to(torch.int32)


def group_sparse_attention(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, v_RHLd: torch.Tensor, idx_RHGK: torch.Tensor,
                           count_RHG: torch.Tensor, group: int, scale: float, prefix: int = 0,
                           band_G2: Optional[torch.Tensor] = None, add_RHpd: Optional[torch.Tensor] = None,
                           hw: Optional[tuple[int, int]] = None, add_hw: Optional[tuple[int, int]] = None,
                           list_of_G: Optional[torch.Tensor] = None, reads_RHG: Optional[torch.Tensor] = None
                           ) -> torch.Tensor:
    """(R, H, l, d): attention in which query group g (queries g·group … (g+1)·group − 1, the last
    group may be shorter; G = ceil(l / group)) reads only its keys, softmax normalised over those
    keys alone — SparVAR's column-sparse attention (research/accel.md §4.2–4.3). A group's keys
    are the union of the first ``prefix`` keys (every group), the inclusive range ``band_G2[g]``
    = [lo, hi] (None: no range) and the distinct positions ``idx_RHGK[:, :, g, :count_RHG[:, :,
    g]]`` (see ``key_lists``); a listed key inside the prefix or the range counts once. A group
    with no key gives zeros. With ``add_RHpd`` ((R' ≥ R, H, h'·w', d), a map of ``add_hw`` = (h',
    w') in raster order) the queries, an ``hw`` = (h, w) map, get its bilinear resize to (h, w)
    added (align_corners=False, as ``F.interpolate``): CS4A's ``upsample(O_cache) + sparse
    attention``. Float32 softmax and sum, output in q's dtype; one group at a time, so memory
    stays at (R, H, group, Lk).

    ``list_of_G`` (G,): the list each group reads, of G' lists (``idx_RHGK`` / ``count_RHG`` then
    (R, H, G', K) / (R, H, G')): CS4A's groups of a later scale read the decision scale's group
    lists without a copy per group. ``reads_RHG`` (R, H, G) int32, when given, receives the listed
    keys each group read that the prefix and its range did not (its keys read: prefix + range +
    that)."""
    R, H, l, d = q_RHld.shape
    G, K, Lk = -(-l // group), idx_RHGK.shape[-1], k_RHLd.shape[2]
    _check_group_lists(idx_RHGK, count_RHG, band_G2, R, H, G, l, group, list_of_G, reads_RHG)
    _check_add(add_RHpd, hw, add_hw, R, H, l, d)
    if list_of_G is not None:                       # each group's list, copied (no host read: graphs capture this)
        idx_RHGK, count_RHG = (t.index_select(2, list_of_G.long()) for t in (idx_RHGK, count_RHG))
    out_RHld = torch.empty(R, H, l, d, device=q_RHld.device, dtype=torch.float32)
    pos_L = torch.arange(Lk + 1, device=q_RHld.device)
    k_T, v_f = k_RHLd.float().transpose(-1, -2), v_RHLd.float()
    for g in range(G):
        listed_RHK = torch.arange(K, device=q_RHld.device) < count_RHG[:, :, g, None].long()
        key_RHK = idx_RHGK[:, :, g].long()
        keys_RHL = (pos_L < prefix).expand(R, H, Lk + 1).clone()                     # column Lk: a spare slot
        covered_RHK = key_RHK < prefix
        if band_G2 is not None:
            keys_RHL |= (pos_L >= band_G2[g, 0]) & (pos_L <= band_G2[g, 1])
            covered_RHK |= (key_RHK >= band_G2[g, 0]) & (key_RHK <= band_G2[g, 1])
        if reads_RHG is not None:
            reads_RHG[:, :, g] = (listed_RHK & ~covered_RHK).sum(-1).to(reads_RHG.dtype)
        keys_RHL.scatter_(-1, torch.where(listed_RHK, key_RHK, Lk), True)
        keys_RHL = keys_RHL[..., :Lk]
        s = q_RHld[:, :, g * group:(g + 1) * group].float() @ k_T * scale              # (R, H, ≤group, Lk)
        p = s.masked_fill(~keys_RHL[:, :, None], float("-inf")).softmax(dim=-1).nan_to_num(0.0)
        out_RHld[:, :, g * group:(g + 1) * group] = p @ v_f
    if add_RHpd is not None:
        (h, w), (h2, w2) = hw, add_hw
        planes = add_RHpd[:R].float().reshape(R * H, h2, w2, d).permute(0, 3, 1, 2)    # (R·H, d, h', w')
        up = F.interpolate(planes, size=(h, w), mode="bilinear", align_corners=False)
        out_RHld += up.reshape(R, H, d, l).transpose(-1, -2)
    return out_RHld.to(q_RHld.dtype)


def window_attention(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, v_RHLd: torch.Tensor, tile_q_TM: torch.Tensor,
                     tile_keys_TK: torch.Tensor, count_T: torch.Tensor, prefix: int, tables_4L: torch.Tensor,
                     w: int, scale: float) -> torch.Tensor:
    """(R, H, l, d): attention in which each query reads the first ``prefix`` keys and, of the keys its
    tile lists, those whose window holds it — SparVAR's CSLA (research/accel.md §4.4) in gathered form.
    The queries are a map ``w`` wide in raster order, split into tiles: ``tile_q_TM[t]`` the query
    positions of tile t (-1 pads; every query in exactly one tile), ``tile_keys_TK[t, :count_T[t]]``
    the cache positions any of its queries may read past the prefix (distinct). Query (y, x) =
    (q // w, q % w) reads listed key n iff ``tables_4L[0, n] <= y <= tables_4L[1, n]`` and
    ``tables_4L[2, n] <= x <= tables_4L[3, n]``. Float32 softmax and sum, output in q's dtype; a
    query with no key gives zeros. One tile at a time."""
    R, H, l, d = q_RHld.shape
    Lk = k_RHLd.shape[2]
    _check_window_tiles(tile_q_TM, tile_keys_TK, count_T, tables_4L, prefix, l, Lk)
    out_RHld = torch.zeros(R, H, l, d, device=q_RHld.device, dtype=torch.float32)
    qf, kf, vf = q_RHld.float(), k_RHLd.float(), v_RHLd.float()
    for t in range(tile_q_TM.shape[0]):
        rows = tile_q_TM[t][tile_q_TM[t] >= 0].long()
        keys = torch.cat([torch.arange(prefix, device=q_RHld.device),
                          tile_keys_TK[t, :int(count_T[t])].long()])
        y, x = rows // w, rows % w
        lo_y, hi_y, lo_x, hi_x = (tables_4L[i, keys].long() for i in range(4))
        seen = (lo_y <= y[:, None]) & (y[:, None] <= hi_y) & (lo_x <= x[:, None]) & (x[:, None] <= hi_x)
        seen |= (keys < prefix)[None]                                                 # (rows, keys)
        s = qf[:, :, rows] @ kf[:, :, keys].transpose(-1, -2) * scale                  # (R, H, rows, keys)
        p = s.masked_fill(~seen, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
        out_RHld[:, :, rows] = p @ vf[:, :, keys]
    return out_RHld.to(q_RHld.dtype)


def _check_window_tiles(tile_q_TM, tile_keys_TK, count_T, tables_4L, prefix, l, Lk) -> None:
    T = tile_q_TM.shape[0]
    if tile_q_TM.dim() != 2 or tile_keys_TK.dim() != 2 or tile_keys_TK.shape[0] != T or tuple(count_T.shape) != (T,) \
            or tuple(tables_4L.shape) != (4, Lk) or not 0 <= prefix <= Lk:
        raise ValueError(f"window_attention: tile_q_TM {tuple(tile_q_TM.shape)} / tile_keys_TK "
                         f"{tuple(tile_keys_TK.shape)} / count_T {tuple(count_T.shape)} / tables_4L "
                         f"{tuple(tables_4L.shape)} / prefix {prefix} need (T, M), (T, K), (T,), (4, {Lk}) and "
                         f"0 <= prefix <= {Lk} for {l} queries")


def _check_add(add_RHpd, hw, add_hw, R, H, l, d) -> None:
    if add_RHpd is None:
        return
    if hw is None or add_hw is None or hw[0] * hw[1] != l or add_RHpd.dim() != 4 or add_RHpd.shape[0] < R \
            or tuple(add_RHpd.shape[1:]) != (H, add_hw[0] * add_hw[1], d):
        raise ValueError(f"group_sparse_attention: add_RHpd {tuple(add_RHpd.shape)} needs (R' >= {R}, {H}, h'·w', "
                         f"{d}) with add_hw = (h', w') = {add_hw} and hw = {hw} covering the {l} queries")


def _check_group_lists(idx_RHGK, count_RHG, band_G2, R, H, G, l, group, list_of_G=None, reads_RHG=None) -> None:
    lists = G if list_of_G is None else idx_RHGK.shape[2]
    if idx_RHGK.shape[:2] != (R, H) or idx_RHGK.shape[2] != lists or tuple(count_RHG.shape) != (R, H, lists) \
            or (band_G2 is not None and tuple(band_G2.shape) != (G, 2)) \
            or (list_of_G is not None and tuple(list_of_G.shape) != (G,)):
        raise ValueError(f"group_sparse_attention: idx_RHGK {tuple(idx_RHGK.shape)} / count_RHG "
                         f"{tuple(count_RHG.shape)} / band_G2 {None if band_G2 is None else tuple(band_G2.shape)} / "
                         f"list_of_G {None if list_of_G is None else tuple(list_of_G.shape)} need (R, H, G) = "
                         f"{(R, H, G)} and (G, 2) for {l} queries in groups of {group} (with list_of_G: lists "
                         f"(R, H, any) and list_of_G (G,))")
    if reads_RHG is not None and (tuple(reads_RHG.shape) != (R, H, G) or reads_RHG.dtype != torch.int32
                                  or not reads_RHG.is_contiguous()):
        raise ValueError(f"group_sparse_attention: reads_RHG {tuple(reads_RHG.shape)} {reads_RHG.dtype} needs a "
                         f"contiguous (R, H, G) = {(R, H, G)} int32 tensor")
