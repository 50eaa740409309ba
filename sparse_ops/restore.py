"""Triton: FastVAR's restore with the gated residual add, twin of ``ref.restore_residual``.

One pass over all L tokens of a row: ``out = x + (kept ? gate · branch[slot] : area(cache))``.
The area upsampling of the cached map (hc·wc tokens, small and L2-resident) is done in the kernel
from each token's source window, so neither the upsampled map nor an expanded index is ever
written: bytes = read x + write out (fp32) + read the kept rows of ``branch`` (research/kernels.md
§2, "fused restore of all rows"). The inverse map slot[r, i] (which packed row holds token i, or
-1) comes from the selection (``pivotal_tokens(..., slots=True)``) or is built with one small
int32 scatter first.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import ref
from .gather_modulate import _launch_shape as _restore_launch
from .gather_modulate import _rows_contiguous


def _max_window(n_in: int, n_out: int) -> int:
    """Largest source window of area interpolation from n_in to n_out cells (adaptive pooling:
    cell i reads [floor(i·n_in/n_out), ceil((i+1)·n_in/n_out)))."""
    if n_in <= n_out:
        return 1 if n_out % n_in == 0 else 2
    return max(-(-((i + 1) * n_in) // n_out) - (i * n_in) // n_out for i in range(n_out))


@triton.jit
def _restore_kernel(x_ptr, slot_ptr, br_ptr, gate_ptr, cache_ptr, out_ptr,
                    L, C, h, w, hc, wc,
                    stride_xr, stride_xl, stride_sr, stride_br, stride_bl, stride_gr,
                    stride_cr, stride_cl, stride_or, stride_ol,
                    WIN_H: tl.constexpr, WIN_W: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(1).to(tl.int64)
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)                 # token positions
    im = i < L
    slot = tl.load(slot_ptr + r * stride_sr + i, mask=im, other=-1)
    kept = slot >= 0
    c = tl.arange(0, BLOCK_C)
    cm = c < C
    m2 = im[:, None] & cm[None, :]
    x = tl.load(x_ptr + r * stride_xr + i[:, None].to(tl.int64) * stride_xl + c[None, :], mask=m2, other=0.0)
    gate = tl.load(gate_ptr + r * stride_gr + c, mask=cm, other=0.0).to(tl.float32)
    slot_safe = tl.where(kept, slot, 0).to(tl.int64)
    br = tl.load(br_ptr + r * stride_br + slot_safe[:, None] * stride_bl + c[None, :],
                 mask=m2 & kept[:, None], other=0.0).to(tl.float32)
    fresh = br * gate[None, :]
    # area upsampling of the cache: token (ti, tj) averages source rows [rs, re) × cols [cs, ce)
    ti = i // w
    tj = i % w
    rs = (ti * hc) // h
    re = ((ti + 1) * hc + h - 1) // h
    cs = (tj * wc) // w
    ce = ((tj + 1) * wc + w - 1) // w
    todo = im & (slot < 0)
    acc = tl.zeros([ROWS, BLOCK_C], dtype=tl.float32)
    for a in tl.static_range(WIN_H):
        for b in tl.static_range(WIN_W):
            rr = rs + a
            cc = cs + b
            ok = todo & (rr < re) & (cc < ce)
            src = (rr * wc + cc).to(tl.int64)
            acc += tl.load(cache_ptr + r * stride_cr + src[:, None] * stride_cl + c[None, :],
                           mask=ok[:, None] & cm[None, :], other=0.0).to(tl.float32)
    kh = tl.maximum(re - rs, 1).to(tl.float32)
    kw = tl.maximum(ce - cs, 1).to(tl.float32)
    up = acc / kh[:, None] / kw[:, None]
    out = x.to(tl.float32) + tl.where(kept[:, None], fresh, up)
    tl.store(out_ptr + r * stride_or + i[:, None].to(tl.int64) * stride_ol + c[None, :], out, mask=m2)


def restore_residual(x_RLC: torch.Tensor, idx_Rn: torch.Tensor, branch_RnC: torch.Tensor, gate_R1C: torch.Tensor,
                     cache_RlC: torch.Tensor, cache_hw: tuple[int, int], hw: tuple[int, int],
                     slot_RL: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton twin of ``ref.restore_residual``: (R, L, C) float32
    ``x + (kept ? gate · branch[slot] : area_upsample(cache))``. Without ``slot_RL`` the inverse
    map is built first (``ref.slot_map``: three small torch launches)."""
    x_RLC = _rows_contiguous(x_RLC)
    R, L, C = x_RLC.shape
    (hc, wc), (h, w) = cache_hw, hw
    assert h * w == L and cache_RlC.shape[1] == hc * wc, "restore_residual: map sizes do not match the tensors"
    dev = x_RLC.device
    out = torch.empty(R, L, C, device=dev, dtype=torch.promote_types(x_RLC.dtype, torch.float32))
    if R == 0:
        return out
    if slot_RL is None:
        slot_RL = ref.slot_map(idx_Rn, L)
    else:
        assert slot_RL.shape == (R, L) and slot_RL.dtype == torch.int32, "slot_RL: ref.slot_map(idx_Rn, L)"
        slot_RL = slot_RL if slot_RL.stride(-1) == 1 else slot_RL.contiguous()
    branch_RnC = _rows_contiguous(branch_RnC)
    gate_R1C = _rows_contiguous(gate_R1C.expand(R, 1, C))
    cache_RlC = _rows_contiguous(cache_RlC[:R])
    block_c, rows, num_warps = _restore_launch(C)
    _restore_kernel[(triton.cdiv(L, rows), R)](
        x_RLC, slot_RL, branch_RnC, gate_R1C, cache_RlC, out,
        L, C, h, w, hc, wc,
        x_RLC.stride(0), x_RLC.stride(1), slot_RL.stride(0), branch_RnC.stride(0), branch_RnC.stride(1),
        gate_R1C.stride(0), cache_RlC.stride(0), cache_RlC.stride(1), out.stride(0), out.stride(1),
        WIN_H=_max_window(hc, h), WIN_W=_max_window(wc, w), ROWS=rows, BLOCK_C=block_c, num_warps=num_warps)
    return out
