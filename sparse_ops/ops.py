"""The sparse ops as the policies and adapters call them: each picks its Triton kernel or its
pure-torch twin per call (``_backend.resolve_backend``) and has the twins' signature plus
``backend="auto" | "triton" | "torch"``. Callers inside the scale loop resolve the backend once per
generation and pass ``"triton"`` or ``"torch"``, so a call costs one string test.

The Triton modules are imported only when their kernels run: importing ``sparse_ops`` never
imports triton.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch

from . import ref
from ._backend import resolve_backend

# op → the module holding its Triton twin
_TRITON_MODULES = {
    "gather_norm_modulate": "gather_modulate", "gather_rows": "gather_modulate", "scatter_rows": "gather_modulate",
    "restore_residual": "restore", "pivotal_tokens": "pivotal", "change_map": "select", "select_kept": "select",
    "anchor_match": "anchor", "attention_colsum": "colsum", "group_sparse_attention": "group_attention",
    "window_attention": "window_attention",
    "residual_norm_modulate": "dense_fused", "token_residual_norm_modulate": "dense_fused",
    "linear_residual_norm_modulate": "linear_residual", "qk_norm_store": "dense_fused",
    "qk_norm_rope_store": "dense_fused", "rope_half_store": "dense_fused", "qk_norm_attend": "cache_attention", "linear": "linear",
    "sample_top_k_top_p": "sample", "bias_softmax": "softmax", "cfg_guide": "guidance",
    "group_norm_silu": "group_norm", "residual_bias_add": "bias_add", "stage_embed": "stage_embed", "phi_accumulate": "phi",
}


def implementation(op: str, backend: str, device: torch.device | str):
    """The function that runs ``op`` for tensors on ``device`` under ``backend``."""
    if backend != "torch" and resolve_backend(backend, device) == "triton":
        module = importlib.import_module(f".{_TRITON_MODULES[op]}", __package__)
        return getattr(module, op)
    return getattr(ref, op)


def gather_rows(x_RLC: torch.Tensor, idx_Rn: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """(R, n, C) rows ``idx_Rn`` of every batch row (see ``ref.gather_rows``)."""
    return implementation("gather_rows", backend, x_RLC.device)(x_RLC, idx_Rn)


def scatter_rows(base_RLC: torch.Tensor, idx_Rn: torch.Tensor, y_RnC: torch.Tensor, *,
                 backend: str = "auto") -> torch.Tensor:
    """A copy of ``base_RLC`` with rows ``idx_Rn`` replaced by ``y_RnC`` (see ``ref.scatter_rows``)."""
    return implementation("scatter_rows", backend, base_RLC.device)(base_RLC, idx_Rn, y_RnC)


def gather_norm_modulate(x_RLC: torch.Tensor, idx_Rn: Optional[torch.Tensor], mul_R1C: torch.Tensor,
                         shift_R1C: torch.Tensor, eps: float, out_dtype: torch.dtype, *,
                         backend: str = "auto") -> torch.Tensor:
    """(R, n, C) ``LN(x[idx])·mul + shift`` in ``out_dtype`` (see ``ref.gather_norm_modulate``)."""
    return implementation("gather_norm_modulate", backend, x_RLC.device)(x_RLC, idx_Rn, mul_R1C, shift_R1C, eps,
                                                                         out_dtype)


def restore_residual(x_RLC: torch.Tensor, idx_Rn: torch.Tensor, branch_RnC: torch.Tensor, gate_R1C: torch.Tensor,
                     cache_RlC: torch.Tensor, cache_hw: tuple[int, int], hw: tuple[int, int],
                     slot_RL: Optional[torch.Tensor] = None, *, backend: str = "auto") -> torch.Tensor:
    """(R, L, C) ``x + (kept ? gate·branch : area(cache))`` (see ``ref.restore_residual``);
    ``slot_RL``: the subset's inverse map when the caller has it."""
    return implementation("restore_residual", backend, x_RLC.device)(x_RLC, idx_Rn, branch_RnC, gate_R1C, cache_RlC,
                                                                     cache_hw, hw, slot_RL)


def pivotal_tokens(x_RLC: torch.Tensor, keep: int, slots: bool = False, *, backend: str = "auto"):
    """(R, keep) FastVAR pivotal positions, ascending; with ``slots`` also their (R, L) int32
    inverse map (see ``ref.pivotal_tokens``)."""
    return implementation("pivotal_tokens", backend, x_RLC.device)(x_RLC, keep, slots)


def change_map(x_in_RnC: torch.Tensor, x_out_RnC: torch.Tensor, batch: int, idx_Bn: Optional[torch.Tensor], L: int,
               *, backend: str = "auto") -> torch.Tensor:
    """(B, L) float32 per-token change of the observed block (see ``ref.change_map``)."""
    return implementation("change_map", backend, x_out_RnC.device)(x_in_RnC, x_out_RnC, batch, idx_Bn, L)


def select_kept(change_BM: torch.Tensor, src_L: torch.Tensor, anchors_L: torch.Tensor, tau: float,
                budget: Optional[int], *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(idx_BL, count_B, keep_BL): kept tokens compacted on the device (see ``ref.select_kept``)."""
    return implementation("select_kept", backend, change_BM.device)(change_BM, src_L, anchors_L, tau, budget)


def anchor_match(logits_BMV: torch.Tensor, src_L: torch.Tensor, cand_L4: torch.Tensor, keep_BL: torch.Tensor,
                 anchors_L: torch.Tensor, beta: float, *, backend: str = "auto"
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(copy_src_BL, zero_BL, roles_BL, best_sim_BL) (see ``ref.anchor_match``)."""
    return implementation("anchor_match", backend, keep_BL.device)(logits_BMV, src_L, cand_L4, keep_BL, anchors_L,
                                                                   beta)


def attention_colsum(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, scale: float, group: int,
                     lse_RHl: Optional[torch.Tensor] = None, *, backend: str = "auto") -> torch.Tensor:
    """(R, H, G, Lk) float32 attention probabilities summed per query group (see ``ref.attention_colsum``)."""
    return implementation("attention_colsum", backend, q_RHld.device)(q_RHld, k_RHLd, scale, group, lse_RHl)


def group_sparse_attention(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, v_RHLd: torch.Tensor, idx_RHGK: torch.Tensor,
                           count_RHG: torch.Tensor, group: int, scale: float, prefix: int = 0,
                           band_G2: Optional[torch.Tensor] = None, add_RHpd: Optional[torch.Tensor] = None,
                           hw: Optional[tuple[int, int]] = None, add_hw: Optional[tuple[int, int]] = None,
                           list_of_G: Optional[torch.Tensor] = None, reads_RHG: Optional[torch.Tensor] = None, *,
                           backend: str = "auto") -> torch.Tensor:
    """(R, H, l, d): each query group attends to a shared prefix, its band and its listed keys (or
    another group's, through a map), plus an optional map resized bilinearly to the
    queries; ``reads_RHG`` receives the listed keys read (see ``ref.group_sparse_attention``)."""
    return implementation("group_sparse_attention", backend, q_RHld.device)(
        q_RHld, k_RHLd, v_RHLd, idx_RHGK, count_RHG, group, scale, prefix, band_G2, add_RHpd, hw, add_hw, list_of_G,
        reads_RHG)


def window_attention(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, v_RHLd: torch.Tensor, tile_q_TM: torch.Tensor,
                     tile_keys_TK: torch.Tensor, count_T: torch.Tensor, prefix: int, tables_4L: torch.Tensor, w: int,
                     scale: float, *, backend: str = "auto") -> torch.Tensor:
    """(R, H, l, d): each query tile reads a shared prefix and its listed keys, each listed key only by
    the queries inside its window (see ``ref.window_attention``)."""
    return implementation("window_attention", backend, q_RHld.device)(
        q_RHld, k_RHLd, v_RHLd, tile_q_TM, tile_keys_TK, count_T, prefix, tables_4L, w, scale)


def residual_norm_modulate(x_RlC: torch.Tensor, branch_RlC: Optional[torch.Tensor], gate_R1C: Optional[torch.Tensor],
                           mul_R1C: torch.Tensor, shift_R1C: torch.Tensor, eps: float, out_dtype: torch.dtype,
                           rms: bool = False, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(x + gate·branch, LN(·)·mul + shift) in one pass; RMSNorm with ``rms`` (see
    ``ref.residual_norm_modulate``)."""
    return implementation("residual_norm_modulate", backend, x_RlC.device)(x_RlC, branch_RlC, gate_R1C, mul_R1C,
                                                                           shift_R1C, eps, out_dtype, rms)


def token_residual_norm_modulate(x_NC: torch.Tensor, branch_NC: Optional[torch.Tensor], gate_NC: Optional[torch.Tensor],
                                 scale_NC: torch.Tensor, shift_NC: torch.Tensor, weight_C: Optional[torch.Tensor],
                                 bias_C: Optional[torch.Tensor], eps: float, out_dtype: torch.dtype, *,
                                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(x + gate·branch, (LN(·)·weight + bias)·(1 + scale) + shift) with a modulation per token, in
    one pass (see ``ref.token_residual_norm_modulate``)."""
    return implementation("token_residual_norm_modulate", backend, x_NC.device)(
        x_NC, branch_NC, gate_NC, scale_NC, shift_NC, weight_C, bias_C, eps, out_dtype)


def linear_residual_norm_modulate(h_RlK: torch.Tensor, weight_CK: torch.Tensor, bias_C: Optional[torch.Tensor],
                                  x_RlC: torch.Tensor, gate_R1C: torch.Tensor, mul_R1C: torch.Tensor,
                                  shift_R1C: torch.Tensor, eps: float, out_dtype: torch.dtype, rms: bool = False, *,
                                  backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(x + gate·(h·wᵀ + b), LN(·)·mul + shift): an output projection into the residual stream and the
    next AdaLN input; RMSNorm with ``rms`` (see ``ref.linear_residual_norm_modulate``)."""
    return implementation("linear_residual_norm_modulate", backend, x_RlC.device)(
        h_RlK, weight_CK, bias_C, x_RlC, gate_R1C, mul_R1C, shift_R1C, eps, out_dtype, rms)


def qk_norm_store(qkv_Rl3Hd: torch.Tensor, mult_2H1: torch.Tensor, k_dst_RHld: torch.Tensor,
                  v_dst_RHld: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Cosine q (R, H, l, d); normalised k and raw v into their cache slots (see ``ref.qk_norm_store``)."""
    return implementation("qk_norm_store", backend, qkv_Rl3Hd.device)(qkv_Rl3Hd, mult_2H1, k_dst_RHld, v_dst_RHld)


def qk_norm_attend(qkv_Rl3Hd: torch.Tensor, mult_2H1: torch.Tensor, k_RHLd: torch.Tensor, v_RHLd: torch.Tensor, *,
                   backend: str = "auto") -> torch.Tensor:
    """VAR's q/k norm, cache write and unmasked attention over the cache in one step: (R, l, H, d)
    out (see ``ref.qk_norm_attend``)."""
    return implementation("qk_norm_attend", backend, qkv_Rl3Hd.device)(qkv_Rl3Hd, mult_2H1, k_RHLd, v_RHLd)


def qk_norm_rope_store(qkv_Rl3Hd: torch.Tensor, q_mult_H1: torch.Tensor, cos_Rl1P: torch.Tensor,
                       sin_Rl1P: torch.Tensor, k_dst_RHld: torch.Tensor, v_dst_RHld: torch.Tensor, *,
                       backend: str = "auto") -> torch.Tensor:
    """Cosine q/k with RoPE (Infinity); k and v into their cache slots (see ``ref.qk_norm_rope_store``)."""
    return implementation("qk_norm_rope_store", backend, qkv_Rl3Hd.device)(qkv_Rl3Hd, q_mult_H1, cos_Rl1P, sin_Rl1P,
                                                                         k_dst_RHld, v_dst_RHld)


def rope_half_store(qkv_Rl3Hd: torch.Tensor, cos_Rld: torch.Tensor, sin_Rld: torch.Tensor, q_scale: float,
                    k_dst_RHld: torch.Tensor, v_dst_RHld: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Rotate-half RoPE of q (× ``q_scale``) and k (HART); k and v into their cache slots (see
    ``ref.rope_half_store``)."""
    return implementation("rope_half_store", backend, qkv_Rl3Hd.device)(qkv_Rl3Hd, cos_Rld, sin_Rld, q_scale,
                                                                      k_dst_RHld, v_dst_RHld)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, gelu: bool = False, *,
           backend: str = "auto") -> torch.Tensor:
    """``x · weightᵀ + bias``, then tanh-GELU when ``gelu`` (see ``ref.linear``)."""
    return implementation("linear", backend, x.device)(x, weight, bias, gelu)


def sample_top_k_top_p(logits_NV: torch.Tensor, noise_NV: torch.Tensor, top_k: int, top_p: float, *,
                       backend: str = "auto") -> torch.Tensor:
    """(N,) draws from the top-k / top-p filtered softmax given Exp(1) noise (see ``ref.sample_top_k_top_p``)."""
    return implementation("sample_top_k_top_p", backend, logits_NV.device)(logits_NV, noise_NV, top_k, top_p)


def cfg_guide(logits_RlV: torch.Tensor, batch: int, t: float, *, backend: str = "auto") -> torch.Tensor:
    """(batch, l, V) float32 ``(1 + t)·cond − t·uncond`` of the [cond; uncond] rows (see ``ref.cfg_guide``)."""
    return implementation("cfg_guide", backend, logits_RlV.device)(logits_RlV, batch, t)


def stage_embed(f_hat_BChw: torch.Tensor, h: int, w: int, weight_CK: torch.Tensor, bias_C: Optional[torch.Tensor],
                pos_lC: torch.Tensor, copies: int, *, backend: str = "auto") -> torch.Tensor:
    """VAR's (copies·B, h·w, C) float32 input map of a scale from its latent (see ``ref.stage_embed``)."""
    return implementation("stage_embed", backend, f_hat_BChw.device)(f_hat_BChw, h, w, weight_CK, bias_C, pos_lC,
                                                                     copies)


def bias_softmax(logits_RlN: torch.Tensor, bias_R1N: torch.Tensor, groups: int, out_dtype: torch.dtype, *,
                 backend: str = "auto") -> torch.Tensor:
    """softmax(logits + bias) per group of the last dim, in ``out_dtype`` (see ``ref.bias_softmax``)."""
    return implementation("bias_softmax", backend, logits_RlN.device)(logits_RlN, bias_R1N, groups, out_dtype)


def group_norm_silu(x_BCHW: torch.Tensor, weight_C: torch.Tensor, bias_C: torch.Tensor, groups: int, eps: float,
                    silu: bool = True, x_bias_C: Optional[torch.Tensor] = None, channels_first_out: bool = False,
                    *, backend: str = "auto") -> torch.Tensor:
    """GroupNorm + affine (+ SiLU) of x (+ ``x_bias_C`` per channel) in x's dtype; on the Triton path
    channels-last input keeps its layout (unless ``channels_first_out``) and contiguous
    channels-first input takes the channels-first kernels (see ``ref.group_norm_silu``)."""
    return implementation("group_norm_silu", backend, x_BCHW.device)(x_BCHW, weight_C, bias_C, groups, eps, silu,
                                                                     x_bias_C, channels_first_out)


def residual_bias_add(x_BCHW: torch.Tensor, h_BCHW: torch.Tensor, bias_C: torch.Tensor, *,
                      backend: str = "auto") -> torch.Tensor:
    """``x + h + bias`` per channel in h's dtype and layout (see ``ref.residual_bias_add``)."""
    return implementation("residual_bias_add", backend, h_BCHW.device)(x_BCHW, h_BCHW, bias_C)


def phi_accumulate(h_BChw: torch.Tensor, weight_CC33: torch.Tensor, bias_C: torch.Tensor, ratio: float,
                   f_hat_BChw: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """VAR's φ latent update in place: ``f_hat += (1 − r)·h + r·(conv3×3(h) + bias)`` (see
    ``ref.phi_accumulate``)."""
    return implementation("phi_accumulate", backend, h_BChw.device)(h_BChw, weight_CC33, bias_C, ratio, f_hat_BChw)
