"""Triton: top-k / top-p filtering and one categorical draw per row in one launch, twin of
``ref.sample_top_k_top_p``.

Why: the torch path spends about 17 small launches per scale on it (top-k, sort, softmax, cumulative
sum, scatter, masked fills, softmax, exponential noise, division, argmax), most of their time launch
latency. Here one program handles one row of logits in registers and draws with the exponential-race
identity that ``torch.multinomial`` itself uses for a single sample: ``argmax(p / q)`` with
``q ~ Exp(1)`` drawn by the caller from its generator.

No sort (a sort in one program is slower, per row, whatever the number of rows): both cut-offs are
found by a bitwise search over the logits' order-preserving integer keys (the float32 bits as int32,
with the magnitude bits of negative values flipped), 32 steps of one masked reduction each:

- top-k: the largest key ``t`` with ``count(key >= t) >= k`` is exactly the k-th largest logit;
- top-p: the largest key ``t`` with ``mass(key < t) <= (1 - top_p) · mass(kept)`` is the smallest
  logit the nucleus keeps (the sorted path's first entry whose ascending cumulative probability
  exceeds ``1 - top_p``); the largest logit always survives.

The kept set is decided by value (keep ``x >= cut``), so where logits tie exactly at the nucleus
boundary all tied entries survive (the torch path keeps an arbitrary subset of them); where the
float32 probability sums land within rounding of ``1 - top_p`` the two paths may cut one entry
apart. Otherwise the draws are the same given the same noise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _order_key(x):
    """float32 → int32 with the same order (−0.0 just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)                  # negative: flip the magnitude


@triton.jit
def _sample_kernel(logits_ptr, q_ptr, out_ptr, V, stride_l, stride_q, top_k, one_minus_p,
                   USE_K: tl.constexpr, USE_P: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    valid = offs < V
    x = tl.load(logits_ptr + row * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    keep = valid
    if USE_K or USE_P:
        # a bitwise search over signed keys: the sign first, then bits 30 … 0 (setting a bit raises
        # the value on either side of zero)
        key = tl.where(valid, _order_key(x), -2147483648)                 # padding at the bottom
        if USE_K:                                                         # the k-th largest key
            t = tl.where(tl.sum((key >= 0).to(tl.int32)) >= top_k, 0, -2147483648)
            for b in tl.static_range(30, -1, -1):
                cand = t | (1 << b)
                t = tl.where(tl.sum((key >= cand).to(tl.int32)) >= top_k, cand, t)
            keep = keep & (key >= t)
        if USE_P:                                                         # the smallest key kept
            m = tl.max(tl.where(keep, x, float("-inf")))
            e = tl.where(keep, tl.exp(x - m), 0.0)
            limit = one_minus_p * tl.sum(e)
            t = tl.where(tl.sum(tl.where(key < 0, e, 0.0)) <= limit, 0, -2147483648)
            for b in tl.static_range(30, -1, -1):
                cand = t | (1 << b)
                t = tl.where(tl.sum(tl.where(key < cand, e, 0.0)) <= limit, cand, t)
            top = tl.max(tl.where(keep, key, -2147483648))                # the largest always survives
            keep = keep & (key >= tl.minimum(t, top))
    m = tl.max(tl.where(keep, x, float("-inf")))
    p = tl.where(keep, tl.exp(x - m), 0.0)
    q = tl.load(q_ptr + row * stride_q + offs, mask=valid, other=1.0).to(tl.float32)
    score = tl.where(keep, p / q, -1.0)
    tl.store(out_ptr + row, tl.argmax(score, 0).to(tl.int64))


def sample_top_k_top_p(logits_NV: torch.Tensor, noise_NV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Triton twin of ``ref.sample_top_k_top_p``: (N,) int64 draws."""
    N, V = logits_NV.shape
    out = torch.empty(N, device=logits_NV.device, dtype=torch.int64)
    if N == 0:
        return out
    x = logits_NV if logits_NV.stride(-1) == 1 else logits_NV.contiguous()
    q = noise_NV if noise_NV.stride(-1) == 1 else noise_NV.contiguous()
    block_v = triton.next_power_of_2(V)
    use_k = 0 < top_k < V
    use_p = top_p > 0.0
    # 8 warps: fastest at every row count of the sweep (benchmarks/results/README.md)
    warps = 8 if block_v >= 4096 else 4
    _sample_kernel[(N,)](x, q, out, V, x.stride(0), q.stride(0), top_k if use_k else 0, 1.0 - float(top_p),
                         USE_K=use_k, USE_P=use_p, BLOCK_V=block_v, num_warps=warps)
    return out
