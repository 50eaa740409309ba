"""Attention backend dispatch, chosen explicitly per call (never at import time).

Dense VAR-family steps are plain non-causal attention of this scale's queries against the KV cache
(``Lq != Lk``), so SDPA without a mask is the right default: it keeps the flash / cuDNN backends
available on GPU. A mask is passed only for teacher forcing (block-causal) or key padding.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def dense_attention(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, v_RHLd: torch.Tensor,
                    scale: float, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v over the whole key axis; (R, H, l, d) out."""
    if q_RHld.dtype != k_RHLd.dtype:
        q_RHld = q_RHld.to(k_RHLd.dtype)
    return F.scaled_dot_product_attention(q_RHld, k_RHLd, v_RHLd, attn_mask=attn_mask, scale=scale)


def describe_backends() -> str:
    """What attention / kernel backends this machine offers, and why (for ``sparsevar info --backends``)."""
    lines = [f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        lines.append(f"CUDA device: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})")
        b = torch.backends.cuda
        lines.append(f"SDPA flash: {'on' if b.flash_sdp_enabled() else 'off'}, "
                     f"memory-efficient: {'on' if b.mem_efficient_sdp_enabled() else 'off'}, "
                     f"cuDNN: {'on' if b.cudnn_sdp_enabled() else 'off'}, math: {'on' if b.math_sdp_enabled() else 'off'}")
        lines.append("dense scales: SDPA without a mask (flash / cuDNN eligible); CUDA graphs for dense scales")
    else:
        lines.append("no CUDA device: SDPA math/CPU kernels; CUDA graphs unavailable")
    try:
        import triton
        lines.append(f"triton {triton.__version__}: installed")
    except ImportError:
        lines.append("triton: not installed (pip install 'sparsevar[triton]'); pure-torch ops are used")
    return "\n".join(lines)
