"""Triton: classifier-free guidance in one pass, twin of ``ref.cfg_guide``.

Why: VAR's guidance ``(1 + t)·cond − t·uncond`` on the head's logits is four launches per scale in
torch — the head's bf16 → float32 cast, two scalings and a subtraction — each a full pass over the
(rows, tokens, vocab) logits. Here one pass reads both halves in the head's dtype and writes the
guided float32 logits.

Same bits as the torch path: the cast to float32 is exact, and each product and the difference are
rounded on their own — the kernel is compiled without fused multiply-adds (``enable_fp_fusion``),
which would round ``(1 + t)·cond − (t·uncond)`` once instead of twice.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _cfg_guide_kernel(x_ptr, out_ptr, n, one_plus_t, t, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    cond = tl.load(x_ptr + i, mask=ok, other=0.0).to(tl.float32)
    uncond = tl.load(x_ptr + n + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, one_plus_t * cond - t * uncond, mask=ok)


def cfg_guide(logits_RlV: torch.Tensor, batch: int, t: float) -> torch.Tensor:
    """Triton twin of ``ref.cfg_guide``: (batch, l, V) float32."""
    R, l, V = logits_RlV.shape
    assert R == 2 * batch, f"{R} rows: guidance needs the [cond; uncond] halves of {batch} images"
    x = logits_RlV.contiguous()
    out = torch.empty(batch, l, V, device=x.device, dtype=torch.float32)
    n = out.numel()
    if n:
        BLOCK = 4096
        _cfg_guide_kernel[(triton.cdiv(n, BLOCK),)](x, out, n, 1.0 + t, t, BLOCK=BLOCK, num_warps=8,
                                                    enable_fp_fusion=False)
    return out
