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
