"""Triton: top-k / top-p filtering and one categorical draw per row in one launch, twin of
``ref.sample_top_k_top_p``.

Why: the torch path spends about 17 small launches per scale on it (top-k, sort, softmax,
cumulative sum, scatter, masked fills, softmax, exponential noise, division, argmax); on an H100
that was ~0.1 ms of VAR-d30's 2–4 ms scales, most of it launch latency. Here one program sorts
one row of logits in registers, finds the top-k threshold and the nucleus cut-off from the sorted
copy, and draws with the exponential-race identity that ``torch.multinomial`` itself uses for a
single sample: ``argmax(p / q)`` with ``q ~ Exp(1)`` drawn by the caller from its generator.

The kept set is decided by value (keep ``x >= cut``), so where logits tie exactly at the nucleus
boundary all tied entries survive (the torch path keeps an arbitrary subset of them); where the
float32 cumulative sum lands within rounding of ``1 - top_p`` the two paths may cut one entry
apart. Otherwise the draws are the same given the same noise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_kernel(logits_ptr, q_ptr, out_ptr, V, stride_l, stride_q, top_k, one_minus_p,
                   USE_K: tl.constexpr, USE_P: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    valid = offs < V
    x = tl.load(logits_ptr + row * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    keep = valid
    if USE_K or USE_P:
        s = tl.sort(x)                                               # ascending; the padding (-inf) first
        pos = offs - (BLOCK_V - V)                                   # rank among the row's V entries
        if USE_K:
            kth = tl.sum(tl.where(pos == V - top_k, s, 0.0))         # the k-th largest logit
            keep = keep & (x >= kth)
            s = tl.where(s >= kth, s, float("-inf"))
        if USE_P:
            e = tl.exp(s - tl.max(s))
            cum = tl.cumsum(e / tl.sum(e), 0)
            removed = (cum <= one_minus_p) & (pos >= 0) & (pos < V - 1)   # a prefix; the largest survives
            r = tl.sum(removed.to(tl.int32))
            cut = tl.sum(tl.where(pos == r, s, 0.0))                 # smallest surviving value
            keep = keep & (x >= cut)
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
    warps = 8 if block_v >= 4096 else 4
    _sample_kernel[(N,)](x, q, out, V, x.stride(0), q.stride(0), top_k if use_k else 0, 1.0 - float(top_p),
                         USE_K=use_k, USE_P=use_p, BLOCK_V=block_v, num_warps=warps)
    return out
