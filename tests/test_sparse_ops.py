"""sparse_ops: every Triton kernel against its pure-torch twin, the references against the
policies' rules, the backend choice and the attention dispatch.

Kernels run twice over the same cases (``CASES`` below):
- in CI through Triton's CPU interpreter, in one subprocess (``TRITON_INTERPRET=1`` must be set
  before triton is imported, and diffusers imports triton whenever it is installed, so the
  variable cannot be set inside this test session): this file run as a script does that, started
  in the background as soon as the tests are collected (tests/conftest.py), one thread;
- natively in bf16 on a GPU (``pytest -m gpu``), at odd and at production shapes.

Tolerance rule for every float output, with its reason: the kernel's largest error against a
float64 oracle may be at most twice the largest error of the torch path on the same inputs (both
round the same quantities once; only the order of float32 sums and the rounding of the final bf16
differ), plus a floor of 1e-5 × the output scale where both errors are float32 summation noise.
"""
from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# ---- cases: one function per op and shape, run by the interpreter subprocess and on the GPU --------
CASES: dict = {}

# (B, h, w) maps: a 13×13 scale, a non-square 37×53 one, and a batch of 3 on a small non-square map
SHAPES = {"1x13x13": (1, 13, 13), "2x37x53": (2, 37, 53), "3x11x19": (3, 11, 19)}


def case(name):
    def deco(fn):
        CASES[name] = fn
        return fn
    return deco


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_close_to_oracle(name, got, torch_path, oracle, floor_rel=1e-5, one_step=False, extra_abs=0.0):
    """``got`` (kernel) within 2× the torch path's error against ``oracle`` (float64), plus float32
    summation noise (``floor_rel`` × the output scale) — or within one rounding step of a bf16 /
    fp16 output with ``one_step`` (the dense fused ops): both paths round a float32 result once, and
    a last-bit difference in a float32 norm can move that rounding by one step where the torch path
    happened to land closer. ``extra_abs``: a rounding the kernel does by design and the torch path
    does not, bounded by the caller (stated where it is passed)."""
    assert got.shape == oracle.shape, (name, got.shape, oracle.shape)
    assert torch.isfinite(got.double()).all(), f"{name}: non-finite kernel output"
    scale = max(oracle.abs().max().item(), 1.0) if oracle.numel() else 1.0
    e_kernel, e_torch = _err(got, oracle), _err(torch_path, oracle)
    step = torch.finfo(got.dtype).eps * scale if one_step and got.dtype in (torch.bfloat16, torch.float16) else 0.0
    bound = max(2 * e_torch + floor_rel * scale + extra_abs, step)
    assert e_kernel <= bound, \
        f"{name}: kernel error {e_kernel:.3g} > 2 × torch error {e_torch:.3g} + {floor_rel * scale:.3g} (one step {step:.3g})"


def _gen(seed):
    return torch.Generator().manual_seed(seed)          # CPU generator: the same inputs on every device


def _rand(shape, g, device, dtype=torch.float32, scale=1.0, offset=0.0):
    return (torch.randn(shape, generator=g) * scale + offset).to(device=device, dtype=dtype)


def _subset(R, L, n, g, device):
    """(R, n) sorted distinct positions per row."""
    return torch.stack([torch.randperm(L, generator=g)[:n].sort().values for _ in range(R)]).to(device)


def _ops():
    from sparsevar.sparse_ops import anchor, colsum, gather_modulate, ref, restore, select
    return ref, gather_modulate, restore, select, anchor, colsum


def _residual_norm_case(R, l, C, out_dtype, device, rms=False):
    """Gated residual + LayerNorm (``rms``: RMSNorm, HART's, whose weight comes folded into mul) +
    AdaLN, with and without the residual."""
    from sparsevar.sparse_ops import dense_fused, ref
    g = _gen(7)
    x = _rand((R, l, C), g, device, scale=3.0, offset=0.5)                    # float32 residual stream
    branch = _rand((R, l, C), g, device, dtype=torch.bfloat16)
    ada = _rand((R, 6, C), g, device, scale=0.3) + torch.tensor([0, 0, 1, 1, 0, 0], device=device)[None, :, None]
    gate, mul, shift = ada[:, 0:1], ada[:, 2:3], ada[:, 4:5]      # (R, 1, C) rows of an (R, 6, C) table, as VAR passes
    x_new, y = dense_fused.residual_norm_modulate(x, branch, gate, mul, shift, 1e-6, out_dtype, rms)
    assert y.dtype == out_dtype and x_new.dtype == x.dtype
    want_x, want_y = ref.residual_norm_modulate(x, branch, gate, mul, shift, 1e-6, out_dtype, rms)
    ox, oy = ref.residual_norm_modulate(x.double(), branch.double(), gate.double(), mul.double(), shift.double(),
                                        1e-6, torch.float64, rms)
    assert_close_to_oracle("residual_norm_modulate (x)", x_new, want_x, ox, one_step=True)
    assert_close_to_oracle("residual_norm_modulate (y)", y, want_y, oy, one_step=True)
    x_same, y_only = dense_fused.residual_norm_modulate(x, None, None, mul, shift, 1e-6, out_dtype, rms)
    assert x_same is x                                                       # no residual: x untouched
    _, oy = ref.residual_norm_modulate(x.double(), None, None, mul.double(), shift.double(), 1e-6, torch.float64, rms)
    assert_close_to_oracle("residual_norm_modulate (no residual)", y_only,
                           ref.residual_norm_modulate(x, None, None, mul, shift, 1e-6, out_dtype, rms)[1], oy,
                           one_step=True)
    if rms:        # the oracle's own rule: x / √(mean(x²) + eps) · mul + shift, the mean left in
        xd = x.double()
        direct = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-6) * mul.double() + shift.double()
        torch.testing.assert_close(oy, direct, rtol=1e-12, atol=1e-12)


def _qk_norm_case(R, l, H, d, T, dtype, device):
    """q/k norm with the cache write into slots [3, 3 + l) of layer 1 of a (2, R, H, T, d) cache."""
    from sparsevar.sparse_ops import dense_fused, ref
    g = _gen(8)
    qkv = _rand((R, l, 3, H, d), g, device, dtype=dtype, scale=2.0)
    mult = torch.stack((_rand((H,), g, device, scale=1.0, offset=4.0).abs(), torch.ones(H, device=device)))[..., None]
    caches = [tuple(torch.zeros(2, R, H, T, d, device=device, dtype=dtype) for _ in "kv") for _ in range(2)]
    outs = []
    for fn, (k_c, v_c) in zip((dense_fused.qk_norm_store, ref.qk_norm_store), caches):
        outs.append(fn(qkv, mult, k_c[1, :, :, 3:3 + l], v_c[1, :, :, 3:3 + l]))
    (kk, vk), (rk, rv) = caches
    oq = ref.qk_norm_store(qkv.double(), mult.double(), torch.zeros(R, H, l, d, dtype=torch.float64),
                           torch.zeros(R, H, l, d, dtype=torch.float64))
    assert outs[0].shape == (R, H, l, d)
    assert_close_to_oracle("qk_norm_store (q)", outs[0], outs[1], oq, one_step=True)
    ok = (qkv.double()[:, :, 1] / qkv.double()[:, :, 1].norm(dim=-1, keepdim=True)).transpose(1, 2)
    assert_close_to_oracle("qk_norm_store (k)", kk[1, :, :, 3:3 + l], rk[1, :, :, 3:3 + l], ok, one_step=True)
    assert torch.equal(vk, rv)                                                # v: a plain copy
    assert not kk[0].any() and not kk[1, :, :, :3].any() and not kk[1, :, :, 3 + l:].any()   # only its slots
    empty = dense_fused.qk_norm_store(qkv[:, :0], mult, kk[1, :, :, :0], vk[1, :, :, :0])  # a scale with no tokens
    assert empty.shape == (R, H, 0, d)


def _qk_attend_case(R, l, H, d, start, dtype, device):
    """VAR's fused attention step: this scale's ``l`` tokens written into slots [start, start + l) of
    layer 1 of a (2, R, H, start + l + 5, d) cache whose first ``start`` slots hold earlier keys;
    attention over all ``start + l`` slots."""
    from sparsevar.sparse_ops import cache_attention, ref
    g = _gen(10)
    qkv = _rand((R, l, 3, H, d), g, device, dtype=dtype, scale=2.0)
    mult = torch.stack((_rand((H,), g, device, scale=1.0, offset=4.0).abs(), torch.ones(H, device=device)))[..., None]
    T, L = start + l + 5, start + l
    earlier = _rand((2, 2, R, H, T, d), g, device)
    earlier[0] = earlier[0] / earlier[0].norm(dim=-1, keepdim=True)          # earlier keys: unit rows, as cached
    earlier = earlier.to(dtype)
    caches = [tuple(earlier[i].clone() for i in range(2)) for _ in range(2)]
    outs = [fn(qkv, mult, k_c[1, :, :, :L], v_c[1, :, :, :L])
            for fn, (k_c, v_c) in zip((cache_attention.qk_norm_attend, ref.qk_norm_attend), caches)]
    (kk, vk), (rk, rv) = caches
    ok, ov = earlier[0, 1, :, :, :L].double().clone(), earlier[1, 1, :, :, :L].double().clone()
    oracle = ref.qk_norm_attend(qkv.double(), mult.double(), ok, ov)
    assert outs[0].shape == (R, l, H, d) and outs[0].is_contiguous() and outs[0].dtype == dtype
    # the kernel rounds the softmax probabilities to the operand dtype before P·V, as SDPA's flash and
    # cuDNN kernels do, and the CPU math path does not: that moves each output by at most half a
    # rounding step of P (relative) times the largest |v|, since the probabilities sum to 1
    p_round = torch.finfo(dtype).eps / 2 * ov.abs().max().item() if dtype != torch.float32 else 0.0
    assert_close_to_oracle("qk_norm_attend (out)", outs[0], outs[1], oracle, extra_abs=p_round)
    assert_close_to_oracle("qk_norm_attend (k)", kk[1, :, :, start:L], rk[1, :, :, start:L], ok[:, :, start:],
                           one_step=True)
    assert torch.equal(vk, rv)                                         # v: a plain copy into its slots
    assert torch.equal(kk[0], earlier[0, 0]) and torch.equal(kk[1, :, :, :start], earlier[0, 1, :, :, :start]) \
        and torch.equal(kk[1, :, :, L:], earlier[0, 1, :, :, L:])      # nothing outside its slots changes


def _qk_rope_case(R, l, H, d, T, dtype, per_row, device):
    """Infinity's q/k norm + RoPE with the cache write into slots [3, 3 + l) of layer 1; RoPE tables
    shared by the rows (1, l, 1, d/2) or per row (R, l, 1, d/2), as a subset of tokens has them."""
    from sparsevar.sparse_ops import dense_fused, ref
    g = _gen(9)
    qkv = _rand((R, l, 3, H, d), g, device, dtype=dtype, scale=2.0)
    mult = _rand((H, 1), g, device, scale=1.0, offset=4.0).abs()
    angle = _rand((R if per_row else 1, l, 1, d // 2), g, device, scale=3.0)
    cos, sin = angle.cos(), angle.sin()
    caches = [tuple(torch.zeros(2, R, H, T, d, device=device, dtype=dtype) for _ in "kv") for _ in range(2)]
    outs = []
    for fn, (k_c, v_c) in zip((dense_fused.qk_norm_rope_store, ref.qk_norm_rope_store), caches):
        outs.append(fn(qkv, mult, cos, sin, k_c[1, :, :, 3:3 + l], v_c[1, :, :, 3:3 + l]))
    (kk, vk), (rk, rv) = caches
    ok = torch.zeros(R, H, l, d, dtype=torch.float64, device=device)
    oq = ref.qk_norm_rope_store(qkv.double(), mult.double(), cos.double(), sin.double(), ok, torch.zeros_like(ok))
    assert outs[0].shape == (R, H, l, d) and outs[0].dtype == dtype
    assert_close_to_oracle("qk_norm_rope_store (q)", outs[0], outs[1], oq, one_step=True)
    assert_close_to_oracle("qk_norm_rope_store (k)", kk[1, :, :, 3:3 + l], rk[1, :, :, 3:3 + l], ok, one_step=True)
    assert torch.equal(vk, rv)                                                # v: a plain copy
    assert not kk[0].any() and not kk[1, :, :, :3].any() and not kk[1, :, :, 3 + l:].any()   # only its slots
    empty = dense_fused.qk_norm_rope_store(qkv[:, :0], mult, cos[:, :0], sin[:, :0], kk[1, :, :, :0], vk[1, :, :, :0])
    assert empty.shape == (R, H, 0, d)


def _token_residual_case(N, C, dtype, device, affine=True):
    """HART's diffusion-head step: gated residual + LayerNorm (with and without its affine) + AdaLN
    per token, the modulation read as column blocks of one (N, 3C) product; with and without the
    residual."""
    from sparsevar.sparse_ops import dense_fused, ref
    g = _gen(11)
    x = _rand((N, C), g, device, dtype, scale=2.0, offset=0.3)
    branch = _rand((N, C), g, device, dtype)
    shift, scale, gate = _rand((N, 3 * C), g, device, dtype, scale=0.5).chunk(3, dim=-1)   # strided views
    w, b = (_rand((C,), g, device, scale=0.2, offset=1.0), _rand((C,), g, device, scale=0.2)) if affine else (None, None)
    d = [None if t is None else t.double() for t in (x, branch, gate, scale, shift, w, b)]
    for res in (True, False):
        args = (x, branch if res else None, gate if res else None, scale, shift, w, b, 1e-6, dtype)
        got_x, got_y = dense_fused.token_residual_norm_modulate(*args)
        want_x, want_y = ref.token_residual_norm_modulate(*args)
        ox, oy = ref.token_residual_norm_modulate(d[0], d[1] if res else None, d[2] if res else None, *d[3:], 1e-6,
                                                  torch.float64)
        assert got_y.dtype == dtype and got_x.dtype == x.dtype
        if res:
            assert_close_to_oracle("token_residual_norm_modulate (x)", got_x, want_x, ox, one_step=True)
        else:
            assert got_x is x
        # y normalises the float32 x' the kernel holds, the torch path its rounded copy: one step of x'
        # in the normalised units at most (≈ eps · |x'| / std(x')), bounded by the oracle's scale
        assert_close_to_oracle("token_residual_norm_modulate (y)", got_y, want_y, oy, one_step=True,
                               extra_abs=8 * torch.finfo(dtype).eps * float(oy.abs().max())
                               if res and dtype != torch.float32 else 0.0)


def _rope_half_case(R, l, H, d, T, dtype, per_row, device):
    """HART's rotate-half RoPE with the cache write into slots [3, 3 + l) of layer 1; RoPE tables
    shared by the rows (1, l, d) or per row (R, l, d), as a subset of tokens has them."""
    from sparsevar.sparse_ops import dense_fused, ref
    g = _gen(13)
    qkv = _rand((R, l, 3, H, d), g, device, dtype=dtype, scale=2.0)
    half = _rand((R if per_row else 1, l, d // 2), g, device, scale=3.0)
    angle = torch.cat((half, half), dim=-1)                                  # [θ, θ], as HART's tables
    cos, sin = angle.cos(), angle.sin()
    caches = [tuple(torch.zeros(2, R, H, T, d, device=device, dtype=dtype) for _ in "kv") for _ in range(2)]
    outs = []
    for fn, (k_c, v_c) in zip((dense_fused.rope_half_store, ref.rope_half_store), caches):
        outs.append(fn(qkv, cos, sin, 0.125, k_c[1, :, :, 3:3 + l], v_c[1, :, :, 3:3 + l]))
    (kk, vk), (rk, rv) = caches
    ok = torch.zeros(R, H, l, d, dtype=torch.float64, device=device)
    oq = ref.rope_half_store(qkv.double(), cos.double(), sin.double(), 0.125, ok, torch.zeros_like(ok))
    # the oracle's own rule, written out: channel j < d/2 gives x_j·cos − x_{j+d/2}·sin, the rest x_j·cos + x_{j−d/2}·sin
    x = qkv.double()[:, :, 0].transpose(1, 2)                                 # (R, H, l, d)
    c, s_ = cos.double()[:, None], sin.double()[:, None]
    direct = torch.cat((x[..., :d // 2] * c[..., :d // 2] - x[..., d // 2:] * s_[..., :d // 2],
                        x[..., d // 2:] * c[..., d // 2:] + x[..., :d // 2] * s_[..., d // 2:]), dim=-1) * 0.125
    torch.testing.assert_close(oq, direct, rtol=1e-12, atol=1e-12)
    assert outs[0].shape == (R, H, l, d) and outs[0].dtype == dtype
    assert_close_to_oracle("rope_half_store (q)", outs[0], outs[1], oq, one_step=True)
    assert_close_to_oracle("rope_half_store (k)", kk[1, :, :, 3:3 + l], rk[1, :, :, 3:3 + l], ok, one_step=True)
    assert torch.equal(vk, rv) and torch.equal(vk[1, :, :, 3:3 + l], qkv[:, :, 2].transpose(1, 2))   # v: a copy
    assert not kk[0].any() and not kk[1, :, :, :3].any() and not kk[1, :, :, 3 + l:].any()   # only its slots
    empty = dense_fused.rope_half_store(qkv[:, :0], cos[:, :0], sin[:, :0], 0.125, kk[1, :, :, :0], vk[1, :, :, :0])
    assert empty.shape == (R, H, 0, d)


def _linear_case(M, N, K, bias, gelu, dtype, device, configs=()):
    """y = x·wᵀ (+ b) (then tanh-GELU) with the shape's own launch and the given ones (split-K
    among them): each within 2× the torch path's error of the float64 result (or one rounding step
    of a bf16 output), and split-K bit-identical on a second run (no atomics)."""
    from sparsevar.sparse_ops import linear as L, ref
    g = _gen(10)
    x = _rand((M, K), g, device, dtype=dtype)
    w = _rand((N, K), g, device, dtype=dtype, scale=K ** -0.5)
    b = _rand((N,), g, device, dtype=dtype) if bias else None
    oracle = ref.linear(x.double(), w.double(), None if b is None else b.double(), gelu)
    torch_path = ref.linear(x, w, b, gelu)
    for cfg in (None, *configs):
        got = L.linear(x, w, b, gelu, config=cfg)
        assert got.dtype == dtype and got.shape == (M, N)
        assert_close_to_oracle(f"linear {M}x{N}x{K} {cfg}", got, torch_path, oracle, one_step=True)
        assert torch.equal(got, L.linear(x, w, b, gelu, config=cfg)), f"linear {cfg}: not deterministic"
    lead = L.linear(x.view(1, M, K), w, b, gelu)                               # leading dims kept
    assert lead.shape == (1, M, N) and torch.equal(lead[0], L.linear(x, w, b, gelu))


def _linear_residual_case(R, l, K, C, bias, dtype, device, configs=(), rms=False):
    """Output projection + gated residual + LayerNorm (``rms``: RMSNorm) + AdaLN, the splits added by
    the norm's launch: within 2× the torch path's error of the float64 result (or one rounding
    step), and bit for bit the unfused Triton path (the product, then ``residual_norm_modulate``) at
    the same launch shape."""
    from sparsevar.sparse_ops import dense_fused, linear as L, linear_residual, ref
    g = _gen(12)
    h = _rand((R, l, K), g, device, dtype=dtype)
    w = _rand((C, K), g, device, dtype=dtype, scale=K ** -0.5)
    b = _rand((C,), g, device, dtype=dtype) if bias else None
    x = _rand((R, l, C), g, device, scale=3.0, offset=0.5)                    # float32 residual stream
    ada = _rand((R, 6, C), g, device, scale=0.3) + torch.tensor([0, 0, 1, 1, 0, 0], device=device)[None, :, None]
    gate, mul, shift = ada[:, 0:1], ada[:, 2:3], ada[:, 4:5]
    ox, oy = ref.linear_residual_norm_modulate(h.double(), w.double(), None if b is None else b.double(), x.double(),
                                               gate.double(), mul.double(), shift.double(), 1e-6, torch.float64, rms)
    tx, ty = ref.linear_residual_norm_modulate(h, w, b, x, gate, mul, shift, 1e-6, dtype, rms)
    for cfg in (None, *configs):
        gx, gy = linear_residual.linear_residual_norm_modulate(h, w, b, x, gate, mul, shift, 1e-6, dtype, rms,
                                                               config=cfg)
        assert gx.dtype == x.dtype and gy.dtype == dtype and gy.shape == (R, l, C)
        # the branch is rounded to bf16 before the residual: the one-step rule applies to it, scaled
        # by the gate, on top of the float32 stream's own error
        step = torch.finfo(dtype).eps * (ref.linear(h, w, b).abs().max().item() * gate.abs().max().item())
        assert_close_to_oracle(f"linear_residual x {cfg}", gx, tx, ox, extra_abs=step)
        assert_close_to_oracle(f"linear_residual y {cfg}", gy, ty, oy, one_step=True)
        use = cfg or L.choose_config(R * l, C, K, 1 if device == "cpu" else
                                     torch.cuda.get_device_properties(device).multi_processor_count,
                                     min_split_k=linear_residual.MIN_SPLIT_K)
        ux, uy = dense_fused.residual_norm_modulate(x, L.linear(h, w, b, config=use), gate, mul, shift, 1e-6, dtype,
                                                    rms)
        assert torch.equal(gx, ux) and torch.equal(gy, uy), f"linear_residual {cfg}: differs from the unfused path"


def _sample_case(N, V, top_k, top_p, device, ties=False, dtype=torch.float32, shift=0.0):
    """Fused top-k / top-p draw against the torch twin with the same exponential noise: the same
    codes (continuous random logits: no exact ties at the nucleus boundary; ``ties``: integer
    logits, for top-k alone, where both paths keep every logit equal to the k-th largest; bf16
    logits, which the kernel reads as they are, likewise for top-k alone: bf16 has ties)."""
    from sparsevar.sparse_ops import ref, sample
    g = _gen(11)
    x = (_rand((N, V), g, device, scale=3.0) + shift).to(dtype)
    if ties:
        x = x.round()
    q = torch.empty(N, V).exponential_(generator=g).to(device)
    got = sample.sample_top_k_top_p(x, q, top_k, top_p)
    want = ref.sample_top_k_top_p(x, q, top_k, top_p)
    assert got.dtype == torch.int64 and got.shape == (N,)
    assert torch.equal(got, want), f"sample_top_k_top_p: {(got != want).sum().item()} of {N} draws differ"


def _cfg_guide_case(B, l, V, t, dtype, device):
    """Classifier-free guidance in one pass against the torch twin: the same bits (the cast to
    float32 is exact and each product and the difference round on their own, no FMA)."""
    from sparsevar.sparse_ops import guidance, ref
    g = _gen(14)
    x = _rand((2 * B, l, V), g, device, scale=8.0).to(dtype)
    got = guidance.cfg_guide(x, B, t)
    want = ref.cfg_guide(x, B, t)
    assert got.dtype == torch.float32 and got.shape == (B, l, V)
    assert torch.equal(got, want), f"cfg_guide: {(got != want).sum().item()} of {got.numel()} values differ"
    assert torch.equal(want, (1 + t) * x[:B].float() - t * x[B:].float())      # VAR's guidance formula
    assert guidance.cfg_guide(x[:, :0], B, t).shape == (B, 0, V)              # no tokens


def _bias_softmax_case(R, l, G, T, out_dtype, device, masked=True):
    """Bias add + softmax per group + cast in one pass against the torch twin, float64 oracle; with
    -inf bias entries (masked keys) that leave at least one key per group."""
    from sparsevar.sparse_ops import ref, softmax
    g = _gen(13)
    x = _rand((R, l, G * T), g, device, scale=4.0)
    b = _rand((R, 1, G * T), g, device, scale=2.0)
    if masked:
        lens = torch.randint(1, T + 1, (R,), generator=g)
        dead = torch.arange(T)[None, :] >= lens[:, None]                           # (R, T): past each prompt
        b = b.masked_fill(dead.repeat(1, G).view(R, 1, G * T).to(device), float("-inf"))
    got = softmax.bias_softmax(x, b, G, out_dtype)
    want = ref.bias_softmax(x, b, G, out_dtype)
    oracle = torch.softmax((x.double() + b.double()).view(R, l, G, T), -1).view(R, l, G * T)
    assert got.dtype == out_dtype and got.shape == (R, l, G * T)
    assert_close_to_oracle(f"bias_softmax {R}x{l}x{G}x{T}", got, want, oracle, one_step=True)
    if masked:
        assert (got.view(R, l, G, T).float().masked_select(dead.to(device)[:, None, None, :]) == 0).all()


def _group_norm_case(B, C, H, W, G, dtype, silu, device, offset=0.0, channels_last=True, x_bias=False,
                     partial_programs=None, channels_first_out=False):
    """GroupNorm + affine (+ SiLU) on channels-last (or contiguous channels-first) input against the
    torch twin, float64 oracle; ``offset`` shifts the input's mean far from 0 (the statistics must
    not cancel); ``x_bias``: a per-channel bias added to the input first; ``partial_programs``: fewer
    statistics programs than tiles, so each merges several (Chan's formula across tiles);
    ``channels_first_out``: the result written contiguous channels-first."""
    from sparsevar.sparse_ops import group_norm, ref
    g = _gen(17)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    x = _rand((B, C, H, W), g, device, dtype, scale=2.0, offset=offset).contiguous(memory_format=layout)
    w = _rand((C,), g, device, scale=0.5, offset=1.0)
    b = _rand((C,), g, device, scale=0.5)
    xb = _rand((C,), g, device, dtype, scale=1.0, offset=0.5) if x_bias else None
    assert group_norm.supported(x, G)
    kept = group_norm.PARTIAL_PROGRAMS
    try:
        if partial_programs is not None:
            group_norm.PARTIAL_PROGRAMS = partial_programs
        got = group_norm.group_norm_silu(x, w, b, G, 1e-6, silu, xb, channels_first_out)
    finally:
        group_norm.PARTIAL_PROGRAMS = kept
    want = ref.group_norm_silu(x, w, b, G, 1e-6, silu, xb, channels_first_out)
    xd = x.double() if xb is None else x.double() + xb.double().view(1, -1, 1, 1)
    oracle = torch.nn.functional.group_norm(xd, G, w.double(), b.double(), 1e-6)
    if silu:
        oracle = torch.nn.functional.silu(oracle)
    out_layout = torch.contiguous_format if channels_first_out else layout
    assert got.dtype == dtype and got.is_contiguous(memory_format=out_layout)
    assert not channels_first_out or want.is_contiguous()          # (PyTorch's CUDA GroupNorm returns NCHW)
    assert_close_to_oracle(f"group_norm_silu {B}x{C}x{H}x{W} G{G} {layout}", got, want, oracle, one_step=True)


def _residual_bias_case(B, C, H, W, dtype, channels_last, device):
    """``x + h + bias`` per channel against the torch twin, float64 oracle, in h's layout."""
    from sparsevar.sparse_ops import bias_add, ref
    g = _gen(19)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    x = _rand((B, C, H, W), g, device, dtype, scale=2.0).contiguous(memory_format=layout)
    h = _rand((B, C, H, W), g, device, dtype).contiguous(memory_format=layout)
    bias = _rand((C,), g, device, dtype, offset=1.0)
    got = bias_add.residual_bias_add(x, h, bias)
    want = ref.residual_bias_add(x, h, bias)
    oracle = x.double() + h.double() + bias.double().view(1, -1, 1, 1)
    assert got.dtype == dtype and got.is_contiguous(memory_format=layout)
    assert_close_to_oracle(f"residual_bias_add {B}x{C}x{H}x{W} {layout}", got, want, oracle, one_step=True)


def _gather_norm_case(shape, C, out_dtype, device):
    ref, gm, *_ = _ops()
    B, h, w = shape
    R, L = 2 * B, h * w
    g = _gen(1)
    x = _rand((R, L, C), g, device, scale=3.0, offset=0.5)
    n = max(1, L // 2 + 3)
    idx = _subset(R, L, n, g, device)
    mul = _rand((R, 1, C), g, device, scale=0.3, offset=1.0)
    shift = _rand((R, 1, C), g, device, scale=0.3)
    got = gm.gather_norm_modulate(x, idx, mul, shift, 1e-6, out_dtype)
    assert got.dtype == out_dtype
    want = ref.gather_norm_modulate(x, idx, mul, shift, 1e-6, out_dtype)
    oracle = ref.gather_norm_modulate(x.double(), idx, mul.double(), shift.double(), 1e-6, torch.float64)
    assert_close_to_oracle("gather_norm_modulate", got, want, oracle)
    all_rows = gm.gather_norm_modulate(x, None, mul, shift, 1e-6, out_dtype)
    oracle = ref.gather_norm_modulate(x.double(), None, mul.double(), shift.double(), 1e-6, torch.float64)
    assert_close_to_oracle("gather_norm_modulate (all rows)", all_rows,
                           ref.gather_norm_modulate(x, None, mul, shift, 1e-6, out_dtype), oracle)
    xb = x.to(torch.bfloat16)          # plain row copies: exact in any dtype
    assert torch.equal(gm.gather_rows(xb, idx), ref.gather_rows(xb, idx))
    y = _rand((R, n, C), g, device, dtype=torch.bfloat16)
    assert torch.equal(gm.scatter_rows(xb, idx, y), ref.scatter_rows(xb, idx, y))


def _restore_case(shape, cache_hw, C, device, cache_dtype=torch.float32):
    ref, _, rs, *_ = _ops()
    B, h, w = shape
    R, L = 2 * B, h * w
    g = _gen(2)
    x = _rand((R, L, C), g, device, scale=2.0)
    n = L - math.floor(L * 0.6)
    idx = _subset(R, L, n, g, device)
    branch = _rand((R, n, C), g, device, dtype=torch.bfloat16)
    gate = _rand((R, 1, C), g, device, scale=0.5)
    cache = _rand((R + 2, cache_hw[0] * cache_hw[1], C), g, device, cache_dtype)   # may hold more rows (CFG dropped)
    got = rs.restore_residual(x, idx, branch, gate, cache, cache_hw, (h, w))
    want = ref.restore_residual(x, idx, branch, gate, cache, cache_hw, (h, w))
    oracle = ref.restore_residual(x.double(), idx, branch.double(), gate.double(), cache.double(), cache_hw, (h, w))
    assert_close_to_oracle("restore_residual", got, want, oracle)
    # the inverse map handed in (as FastVAR gets it from the selection): the same kernel, the same bits
    slot = ref.slot_map(idx, L)
    assert slot.dtype == torch.int32 and bool((slot.gather(1, idx) == torch.arange(n, device=device)).all())
    assert int((slot >= 0).sum()) == R * n
    assert torch.equal(rs.restore_residual(x, idx, branch, gate, cache, cache_hw, (h, w), slot), got)


def _change_case(shape, C, device, halves=2):
    ref, _, _, sl, *_ = _ops()
    B, h, w = shape
    R, L = halves * B, h * w
    g = _gen(3)
    n = max(1, (2 * L) // 3)
    x_in = _rand((R, n, C), g, device)
    x_out = x_in + _rand((R, n, C), g, device, scale=0.1)
    idx = _subset(B, L, n, g, device)
    for i in (idx, None):
        LL = L if i is not None else n
        got = sl.change_map(x_in, x_out, B, i, LL)
        want = ref.change_map(x_in, x_out, B, i, LL)
        oracle = ref.change_map(x_in.double(), x_out.double(), B, i, LL).double()
        assert_close_to_oracle("change_map", got, want, oracle)


def _select_case(shape, prev_hw, device):
    ref, _, _, sl, *_ = _ops()
    from sparsevar.policies.sparsevar import anchor_count, anchor_mask, nearest_source
    B, h, w = shape
    L = h * w
    g = _gen(4)
    change = torch.rand((B, prev_hw[0] * prev_hw[1]), generator=g).to(device)
    change[:, :7] = change[:, 7:8]                 # ties: equal scores at neighbouring positions
    src = nearest_source(prev_hw, (h, w), device)
    anchors = anchor_mask(h, w, 4, device).reshape(L)
    for budget in (None, max(math.ceil(0.3 * L), anchor_count(h, w, 4)), L):
        got = sl.select_kept(change, src, anchors, 0.6, budget)
        want = ref.select_kept(change, src, anchors, 0.6, budget)
        assert len(got) == len(want) == 3
        for a, b, what in zip(got, want, ("idx", "count", "keep")):
            assert a.dtype == b.dtype and torch.equal(a, b), f"select_kept budget={budget}: {what} differs"


def _pivotal_case(shape, C, dtype, device):
    """FastVAR's selection: the kernel keeps the reference's tokens except where float32 rounding
    decides — a token kept by one and not the other scores within 1e-5 (relative, float64 oracle)
    of the cut (the kernel and torch sum the C squares in different orders; at production sizes
    neighbouring scores can lie that close) — and exactly on ties of exact scores."""
    from sparsevar.sparse_ops import pivotal, ref
    R, h, w = shape
    L = h * w
    g = _gen(9)
    x = _rand((R, L, C), g, device, dtype=dtype, scale=2.0, offset=0.7)
    score64 = (x.double() - x.double().mean(1, keepdim=True)).pow(2).sum(-1)
    srt = score64.sort(dim=1, descending=True).values
    for keep in (1, L // 3, L - L // 2, L - 1, L, 0):
        got = pivotal.pivotal_tokens(x, keep)
        want = ref.pivotal_tokens(x, keep)
        assert got.shape == (R, keep) and got.dtype == torch.long, (got.shape, got.dtype)
        assert bool((got[:, 1:] > got[:, :-1]).all()), "positions must ascend"
        # with the inverse map the selection is the same, and the map is the selection's inverse
        got2, slot = pivotal.pivotal_tokens(x, keep, slots=True)
        assert torch.equal(got2, got) and torch.equal(slot, ref.slot_map(got, L)), f"slots, keep={keep}"
        want2, slot_ref = ref.pivotal_tokens(x, keep, slots=True)
        assert torch.equal(want2, want) and torch.equal(slot_ref, ref.slot_map(want, L))
        if torch.equal(got, want):
            continue
        cut = srt[:, keep - 1:keep]                                             # (R, 1) the keep-th score
        in_got = torch.zeros(R, L, dtype=torch.bool, device=device).scatter(1, got, True)
        in_want = torch.zeros(R, L, dtype=torch.bool, device=device).scatter(1, want, True)
        differ = in_got ^ in_want
        near = (score64 - cut).abs() <= 1e-5 * srt[:, :1]
        assert bool((near | ~differ).all()), f"pivotal_tokens keep={keep}: a token away from the cut differs"
    # ties: integer-valued rows whose scores are exact in float32; the earlier position wins
    xt = torch.zeros(R, L, C, device=device, dtype=dtype)
    xt[:, ::3] = 2.0
    xt[:, 1::7] = -2.0
    for keep in (1, L // 4, L // 2):
        assert torch.equal(pivotal.pivotal_tokens(xt, keep), ref.pivotal_tokens(xt, keep)), f"ties, keep={keep}"


def _anchor_case(shape, prev_hw, V, device):
    ref, _, _, _, an, _ = _ops()
    from sparsevar.policies.sparsevar import anchor_candidates, anchor_mask, nearest_source
    B, h, w = shape
    L = h * w
    g = _gen(5)
    M = prev_hw[0] * prev_hw[1]
    base = _rand((B, 1, V), g, device)
    logits = base + _rand((B, M, V), g, device, scale=0.7)     # similar rows: cosines spread around 0.5-0.8
    src = nearest_source(prev_hw, (h, w), device)
    cand = anchor_candidates(h, w, 4, device)
    anchors = anchor_mask(h, w, 4, device).reshape(L)
    keep = (torch.rand((B, L), generator=g) < 0.4).to(device) | anchors
    lg64 = torch.nn.functional.normalize(logits.double()[:, src], dim=-1)
    oracle = torch.stack([(lg64 * lg64[:, cand[:, j]]).sum(-1) for j in range(4)], -1)     # (B, L, 4)
    beta = oracle.max(-1).values[~keep].median().item()          # about half the excluded tokens are copied
    copy_k, zero_k, roles_k, sim_k = an.anchor_match(logits, src, cand, keep, anchors, beta)
    copy_r, zero_r, roles_r, sim_r = ref.anchor_match(logits, src, cand, keep, anchors, beta)
    best64 = oracle.max(-1).values.masked_fill(keep, 0.0)
    assert_close_to_oracle("anchor_match similarity", sim_k, sim_r, best64)
    # decisions agree except where float rounding may flip them: the similarity within 1e-5 of
    # beta, or two candidates within 1e-5 of each other
    top2 = oracle.topk(2, dim=-1).values
    fragile = (((best64 - beta).abs() < 1e-5) | ((top2[..., 0] - top2[..., 1]) < 1e-5)) & ~keep
    for a, b, what in ((copy_k, copy_r, "copy_src"), (zero_k, zero_r, "zero"), (roles_k, roles_r, "roles")):
        assert a.dtype == b.dtype, what
        assert torch.equal(a[~fragile], b[~fragile]), f"anchor_match {what} differs"
    assert bool((roles_k == ref.TOKEN_COPIED).any()) and bool((roles_k == ref.TOKEN_EXCLUDED).any())


def _colsum_case(R, H, l, Lk, d, group, dtype, device, with_lse=False):
    """``with_lse``: each query's log-sum-exp handed in (from a float64 pass), as SparVAR's dense
    pass hands cuDNN's; both paths then skip their own."""
    ref, *_, cs = _ops()
    g = _gen(6)
    q = _rand((R, H, l, d), g, device, dtype=dtype)
    k = _rand((R, H, Lk, d), g, device, dtype=dtype)
    scale = d ** -0.5
    lse = (q.double() @ k.double().transpose(-1, -2) * scale).logsumexp(-1).float() if with_lse else None
    got = cs.attention_colsum(q, k, scale, group, lse)
    want = ref.attention_colsum(q, k, scale, group, lse)
    G = -(-l // group)
    oracle = torch.zeros(R, H, G, Lk, dtype=torch.float64, device=device)
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) * scale, dim=-1)
    for gi in range(G):
        oracle[:, :, gi] = p[:, :, gi * group:(gi + 1) * group].sum(-2)
    assert_close_to_oracle("attention_colsum", got, want, oracle)
    # every query's probabilities sum to 1, so each group's column sums add up to its query count
    torch.testing.assert_close(got.sum(-1).double(), oracle.sum(-1), rtol=1e-4, atol=0)


def _attention_lse_case(R, H, l, Lk, d, dtype, device):
    """SparVAR's decision-scale pass: the output of plain dense attention, and on a CUDA GPU each
    query's log-sum-exp (cuDNN's), within float32 summation error of a float64 pass."""
    from sparsevar.sparse_ops.attention import dense_attention, dense_attention_lse
    g = _gen(8)
    q, k, v = (_rand((R, H, n, d), g, device, dtype=dtype) for n in (l, Lk, Lk))
    out, lse = dense_attention_lse(q, k, v, d ** -0.5)
    torch.testing.assert_close(out, dense_attention(q, k, v, d ** -0.5), rtol=0, atol=1e-4)   # |out| ~ 0.02
    assert lse is not None and lse.shape == (R, H, l) and lse.dtype == torch.float32
    want = (q.double() @ k.double().transpose(-1, -2) * d ** -0.5).logsumexp(-1)
    torch.testing.assert_close(lse.double(), want, rtol=0, atol=1e-3)


def _group_attention_case(R, H, l, Lk, d, group, keep, dtype, device, prefix=0, band=False, width_slack=3, add=None,
                          sources=None, one_step=False):
    """Random per-group key masks (about ``keep`` of the keys, compacted by ``ref.key_lists``; the
    lists overlap the prefix and the bands, which must count once), a shared ``prefix``, and with
    ``band`` a random range per group. Group 0 of row 0 lists no key and, without a prefix or band,
    reads none; the last group is partial when ``group`` does not divide ``l``. ``add`` = (h, w,
    h', w'): the queries are an h × w map and get a random h' × w' map (one row more than R, as
    CS4A's O_cache has after the guidance rows halve) resized bilinearly and added. ``sources`` = G':
    there are G' lists, each group reading a random one (``list_of_G``); the kernel's and the torch
    path's counts of the listed keys read past the prefix and band are checked against a count made
    here. ``one_step``: a bf16 output within one rounding step (``assert_close_to_oracle``), as
    ``_window_attention_case`` has it: Triton's interpreter casts the float32 result to bf16 by
    truncation, a step from torch's rounding (every output of a d=16 and a d=128 case measured equal
    to the truncated float32 twin)."""
    from sparsevar.sparse_ops import group_attention, ref
    g = _gen(7)
    q = _rand((R, H, l, d), g, device, dtype=dtype)
    k = _rand((R, H, Lk, d), g, device, dtype=dtype)
    v = _rand((R, H, Lk, d), g, device, dtype=dtype)
    G = -(-l // group)
    by_source = {}
    entries = torch.rand(R, H, G if sources is None else sources, Lk, generator=g) < keep
    entries[0, 0, 0] = False
    listed = entries
    if sources is not None:                 # group → the list it reads
        list_of_G = torch.randint(0, sources, (G,), generator=g)
        listed = entries[:, :, list_of_G]
        by_source = dict(list_of_G=list_of_G.to(device))
    band_G2 = None
    if band:
        lo = torch.randint(0, Lk, (G,), generator=g)
        band_G2 = torch.stack([lo, (lo + torch.randint(0, 40, (G,), generator=g)).clamp(max=Lk - 1)], 1).to(device)
    width = int(entries.sum(-1).max()) + width_slack
    idx, count = ref.key_lists(entries.to(device), width)
    assert torch.equal(count.long().cpu(), entries.sum(-1))
    extra, up = (), 0.0
    if add is not None:
        h, w, h2, w2 = add
        add_RHpd = _rand((R + 1, H, h2 * w2, d), g, device, dtype=dtype)
        extra = (add_RHpd, (h, w), (h2, w2))
        planes = add_RHpd[:R].double().reshape(R * H, h2, w2, d).permute(0, 3, 1, 2)
        up = torch.nn.functional.interpolate(planes, size=(h, w), mode="bilinear", align_corners=False)
        up = up.reshape(R, H, d, l).transpose(-1, -2)
    if by_source:
        reads_got, reads_want = (torch.full((R, H, G), -1, device=device, dtype=torch.int32) for _ in range(2))
    got = group_attention.group_sparse_attention(q, k, v, idx, count, group, d ** -0.5, prefix, band_G2, *extra,
                                                 **by_source, **(dict(reads_RHG=reads_got) if by_source else {}))
    want = ref.group_sparse_attention(q, k, v, idx, count, group, d ** -0.5, prefix, band_G2, *extra, **by_source,
                                      **(dict(reads_RHG=reads_want) if by_source else {}))
    keys = listed.to(device).clone()
    covered = torch.zeros_like(keys)
    covered[..., :prefix] = True
    if band:
        pos = torch.arange(Lk, device=device)
        covered |= ((pos >= band_G2[:, :1]) & (pos <= band_G2[:, 1:]))[None, None]
    if by_source:                           # listed keys the prefix and band did not cover, counted here
        reads = (keys & ~covered).sum(-1).to(torch.int32)
        assert reads.sum() > 0
        assert torch.equal(reads_want, reads), "torch path's read counts"
        assert torch.equal(reads_got, reads), "kernel's read counts"
    keys |= covered
    s = q.double() @ k.double().transpose(-1, -2) * d ** -0.5                       # (R, H, l, Lk)
    mask = keys.repeat_interleave(group, dim=2)[:, :, :l]
    oracle = (s.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0) @ v.double()) + up
    assert_close_to_oracle("group_sparse_attention", got, want, oracle, one_step=one_step)
    if not prefix and not band and add is None:
        assert got[0, 0, :group].abs().max().item() == 0.0                          # a group with no key: zeros


def _window_attention_case(hw, si, sinks, windows, tile, R, H, d, dtype, device):
    """CSLA on the schedule ``hw`` at scale ``si`` (``policies.sparvar.csla_tiles``: ``tile`` patches
    of queries, each listing the keys its queries' windows reach): the kernel against the torch twin
    and a float64 oracle masked by ``csla_mask`` (what the torch backend feeds SDPA)."""
    from sparsevar.policies.sparvar import csla_mask, csla_tiles
    from sparsevar.sparse_ops import ref, window_attention
    g = _gen(9)
    mask_lL = csla_mask(hw, si, sinks, windows).to(device)
    l, L = mask_lL.shape
    q, k, v = (_rand((R, H, n, d), g, device, dtype=dtype) for n in (l, L, L))
    tile_q, tile_keys, count, prefix, tables = (t.to(device) if isinstance(t, torch.Tensor) else t
                                                for t in csla_tiles(hw, si, sinks, windows, tile))
    args = (tile_q, tile_keys, count, prefix, tables, hw[si][1], d ** -0.5)
    got = window_attention.window_attention(q, k, v, *args)
    want = ref.window_attention(q, k, v, *args)
    s = q.double() @ k.double().transpose(-1, -2) * d ** -0.5
    oracle = s.masked_fill(~mask_lL, float("-inf")).softmax(-1).nan_to_num(0.0) @ v.double()
    # one step: both paths round one float32 result (equal to 5e-7 in the float32 cases), but Triton's
    # interpreter casts to bf16 by truncation (its output is the float32 one with the low bits cut),
    # a step from torch's rounding where an output is as large as v (a query reading ~10 keys)
    assert_close_to_oracle("window_attention", got, want, oracle, one_step=True)


# odd, small shapes for the interpreter (about 0.6 ms per program instance on 2 cores)
@case("gather_norm_modulate-1x13x13-C96-bf16")
def _(device="cpu"):
    _gather_norm_case(SHAPES["1x13x13"], 96, torch.bfloat16, device)


@case("gather_norm_modulate-2x37x53-C160-fp32")
def _(device="cpu"):
    _gather_norm_case(SHAPES["2x37x53"], 160, torch.float32, device)


@case("restore_residual-1x13x13-from-10x10-C96")
def _(device="cpu"):
    _restore_case(SHAPES["1x13x13"], (10, 10), 96, device)


@case("restore_residual-1x9x9-from-6x6-C48-bf16-cache")
def _(device="cpu"):       # FastVAR keeps its cache in the blocks' dtype
    _restore_case((1, 9, 9), (6, 6), 48, device, cache_dtype=torch.bfloat16)


@case("restore_residual-3x11x19-from-5x7-C64")
def _(device="cpu"):
    _restore_case(SHAPES["3x11x19"], (5, 7), 64, device)


@case("change_map-2x37x53-C96")
def _(device="cpu"):
    _change_case(SHAPES["2x37x53"], 96, device)


@case("change_map-3x11x19-cond-only-C160")
def _(device="cpu"):
    _change_case(SHAPES["3x11x19"], 160, device, halves=1)


@case("select_kept-1x13x13-from-10x10")
def _(device="cpu"):
    _select_case(SHAPES["1x13x13"], (10, 10), device)


@case("select_kept-2x37x53-from-29x41")
def _(device="cpu"):
    _select_case(SHAPES["2x37x53"], (29, 41), device)


@case("pivotal_tokens-1x13x13-C40-fp32")
def _(device="cpu"):
    _pivotal_case(SHAPES["1x13x13"], 40, torch.float32, device)


@case("pivotal_tokens-3x11x19-C33-bf16")
def _(device="cpu"):
    _pivotal_case(SHAPES["3x11x19"], 33, torch.bfloat16, device)


@case("anchor_match-3x11x19-V64")
def _(device="cpu"):
    _anchor_case(SHAPES["3x11x19"], (7, 13), 64, device)


@case("anchor_match-1x13x13-V160")
def _(device="cpu"):           # VAR/HART's 4096-way logits run in the GPU tier (gathered loads are slow here)
    _anchor_case(SHAPES["1x13x13"], (10, 10), 160, device)


@case("attention_colsum-R2H3-l37-Lk101-d24-fp32")
def _(device="cpu"):
    _colsum_case(2, 3, 37, 101, 24, 12, torch.float32, device)


@case("group_sparse_attention-R2H3-l37-Lk101-d24-g12-fp32")
def _(device="cpu"):
    _group_attention_case(2, 3, 37, 101, 24, 12, 0.3, torch.float32, device)


@case("group_sparse_attention-R1H2-l50-Lk77-d32-g16-bf16")
def _(device="cpu"):
    _group_attention_case(1, 2, 50, 77, 32, 16, 0.5, torch.bfloat16, device, one_step=True)  # (interpreter truncates)


@case("group_sparse_attention-R2H2-l45-Lk90-d16-g16-prefix21-band-fp32")
def _(device="cpu"):
    _group_attention_case(2, 2, 45, 90, 16, 16, 0.2, torch.float32, device, prefix=21, band=True)


@case("group_sparse_attention-R2H2-l45-Lk90-d16-g16-prefix21-band-add-fp32")
def _(device="cpu"):
    _group_attention_case(2, 2, 45, 90, 16, 16, 0.2, torch.float32, device, prefix=21, band=True, add=(5, 9, 3, 4))


@case("group_sparse_attention-R2H2-l45-Lk90-d16-g16-prefix21-band-add-lists2-fp32")
def _(device="cpu"):
    _group_attention_case(2, 2, 45, 90, 16, 16, 0.3, torch.float32, device, prefix=21, band=True, add=(5, 9, 3, 4),
                          sources=2)


# the families' head widths (VAR and HART 64, Infinity 128), at small lengths
@case("group_sparse_attention-R2H1-l29-Lk61-d64-g8-fp32")
def _(device="cpu"):
    _group_attention_case(2, 1, 29, 61, 64, 8, 0.3, torch.float32, device)


@case("group_sparse_attention-R1H2-l30-Lk61-d64-g8-prefix9-band-add-lists2-bf16")
def _(device="cpu"):
    _group_attention_case(1, 2, 30, 61, 64, 8, 0.3, torch.bfloat16, device, prefix=9, band=True, add=(5, 6, 3, 4),
                          sources=2, one_step=True)


@case("group_sparse_attention-R1H1-l29-Lk61-d128-g8-fp32")
def _(device="cpu"):
    _group_attention_case(1, 1, 29, 61, 128, 8, 0.3, torch.float32, device)


@case("group_sparse_attention-R1H2-l30-Lk61-d128-g8-prefix9-band-add-lists2-bf16")
def _(device="cpu"):
    _group_attention_case(1, 2, 30, 61, 128, 8, 0.3, torch.bfloat16, device, prefix=9, band=True, add=(5, 6, 3, 4),
                          sources=2, one_step=True)


_CSLA_HW = ((1, 1), (2, 2), (3, 3), (4, 6), (9, 13), (12, 17))
_CSLA_HW_SMALL = ((1, 1), (2, 2), (3, 3), (4, 6), (6, 9))        # 86 keys, a 6×9 query map


@case("window_attention-csla-12x17-sinks2-w3.1.-1-tile4x4-R2H2-d16-fp32")
def _(device="cpu"):
    _window_attention_case(_CSLA_HW, 5, 2, (3, 1, -1), (4, 4), 2, 2, 16, torch.float32, device)


@case("window_attention-csla-9x13-sinks1-w7.0.3-tile3x5-R1H2-d32-bf16")
def _(device="cpu"):
    _window_attention_case(_CSLA_HW, 4, 1, (7, 0, 3), (3, 5), 1, 2, 32, torch.bfloat16, device)


@case("window_attention-csla-6x9-sinks2-w3.1-tile4x4-R2H1-d64-fp32")
def _(device="cpu"):
    _window_attention_case(_CSLA_HW_SMALL, 4, 2, (3, 1), (4, 4), 2, 1, 64, torch.float32, device)


@case("window_attention-csla-6x9-sinks1-w5.0.-1-tile3x5-R1H2-d64-bf16")
def _(device="cpu"):
    _window_attention_case(_CSLA_HW_SMALL, 4, 1, (5, 0, -1), (3, 5), 1, 2, 64, torch.bfloat16, device)


@case("window_attention-csla-6x9-sinks2-w3.1-tile4x4-R1H1-d128-fp32")
def _(device="cpu"):
    _window_attention_case(_CSLA_HW_SMALL, 4, 2, (3, 1), (4, 4), 1, 1, 128, torch.float32, device)


@case("window_attention-csla-6x9-sinks1-w5.3.1-tile3x5-R1H2-d128-bf16")
def _(device="cpu"):
    _window_attention_case(_CSLA_HW_SMALL, 4, 1, (5, 3, 1), (3, 5), 1, 2, 128, torch.bfloat16, device)


@case("attention_colsum-R1H2-l50-Lk77-d32-bf16")
def _(device="cpu"):
    _colsum_case(1, 2, 50, 77, 32, 16, torch.bfloat16, device)


@case("attention_colsum-R2H1-l37-Lk61-d16-lse-fp32")
def _(device="cpu"):
    _colsum_case(2, 1, 37, 61, 16, 16, torch.float32, device, with_lse=True)


@case("attention_colsum-R2H2-l331-Lk70-d16-g100-fp32")
def _(device="cpu"):       # groups of several query tiles, the last partial, summed by one program each run
    _colsum_case(2, 2, 331, 70, 16, 100, torch.float32, device)


@case("residual_norm_modulate-R2-l13-C96-bf16")
def _(device="cpu"):
    _residual_norm_case(2, 13, 96, torch.bfloat16, device)


@case("residual_norm_modulate-R3-l37-C160-fp32")
def _(device="cpu"):
    _residual_norm_case(3, 37, 160, torch.float32, device)


@case("residual_norm_modulate-R2-l13-C96-rms-bf16")
def _(device="cpu"):
    _residual_norm_case(2, 13, 96, torch.bfloat16, device, rms=True)


@case("token_residual_norm_modulate-N37-C96-bf16")
def _(device="cpu"):
    _token_residual_case(37, 96, torch.bfloat16, device)


@case("token_residual_norm_modulate-N37-C96-fp32")
def _(device="cpu"):
    _token_residual_case(37, 96, torch.float32, device)


@case("token_residual_norm_modulate-N19-C160-fp32-no-affine")
def _(device="cpu"):
    _token_residual_case(19, 160, torch.float32, device, affine=False)


@case("rope_half_store-R2-l13-H3-d16-bf16-shared")
def _(device="cpu"):
    _rope_half_case(2, 13, 3, 16, 29, torch.bfloat16, False, device)


@case("rope_half_store-R3-l7-H5-d24-fp32-per-row")
def _(device="cpu"):
    _rope_half_case(3, 7, 5, 24, 12, torch.float32, True, device)


@case("qk_norm_store-R2-l13-H3-d16-bf16")
def _(device="cpu"):
    _qk_norm_case(2, 13, 3, 16, 29, torch.bfloat16, device)


@case("qk_norm_store-R3-l7-H5-d24-fp32")
def _(device="cpu"):
    _qk_norm_case(3, 7, 5, 24, 12, torch.float32, device)


@case("qk_norm_attend-R1-l1-H3-d16-first-scale-fp32")
def _(device="cpu"):
    _qk_attend_case(1, 1, 3, 16, 0, torch.float32, device)


@case("qk_norm_attend-R2-l13-H2-d32-after30-bf16")
def _(device="cpu"):
    _qk_attend_case(2, 13, 2, 32, 30, torch.bfloat16, device)


@case("qk_norm_attend-R3-l37-H2-d64-after53-fp32")
def _(device="cpu"):
    _qk_attend_case(3, 37, 2, 64, 53, torch.float32, device)


@case("qk_norm_rope_store-R2-l13-H3-d16-bf16-shared")
def _(device="cpu"):
    _qk_rope_case(2, 13, 3, 16, 29, torch.bfloat16, False, device)


@case("qk_norm_rope_store-R3-l7-H5-d24-fp32-per-row")
def _(device="cpu"):
    _qk_rope_case(3, 7, 5, 24, 12, torch.float32, True, device)


@case("linear-M3-N37-K53-bias-gelu-bf16")
def _(device="cpu"):
    from sparsevar.sparse_ops.linear import LinearConfig
    _linear_case(3, 37, 53, True, True, torch.bfloat16, device, [LinearConfig(16, 16, 16, 3, 4, 1)])


@case("linear-M40-N33-K160-nobias-fp32")
def _(device="cpu"):
    from sparsevar.sparse_ops.linear import LinearConfig
    _linear_case(40, 33, 160, False, False, torch.float32, device, [LinearConfig(32, 32, 32, 2, 4, 1)])


@case("linear_residual-R2-l3-K53-C37-bias-split3-bf16")
def _(device="cpu"):
    from sparsevar.sparse_ops.linear import LinearConfig
    _linear_residual_case(2, 3, 53, 37, True, torch.bfloat16, device, [LinearConfig(16, 16, 16, 3, 4, 1)])

def _stage_embed_case(B, K, hw_in, hw, C, copies, dtype, device, bias=True):
    """VAR's input map of a scale against the float64 oracle of the same definition (pooling as
    torch does it, the pooled tokens cast to the weights' dtype, the embedding rounded to it once,
    float32 positions added): within the tolerance rule. The pooling alone — an identity embedding
    in float32 — gives torch's area pooling bit for bit (the same sum order and divisions)."""
    import torch.nn.functional as F
    from sparsevar.sparse_ops import ref, stage_embed
    g = _gen(15)
    (Hi, Wi), (h, w) = hw_in, hw
    f = _rand((B, K, Hi, Wi), g, device)
    weight = _rand((C, K), g, device, scale=0.2).to(dtype)
    b = _rand((C,), g, device, scale=0.1).to(dtype) if bias else None
    pos = _rand((h * w, C), g, device)
    got = stage_embed.stage_embed(f, h, w, weight, b, pos, copies)
    want = ref.stage_embed(f, h, w, weight, b, pos, copies)
    assert got.dtype == torch.float32 and got.shape == want.shape == (copies * B, h * w, C)
    for r in range(1, copies):                                                # every CFG half the same map
        assert torch.equal(got[r * B:(r + 1) * B], got[:B])
    tokens = F.interpolate(f, size=(h, w), mode="area").view(B, K, h * w).transpose(1, 2)
    e = tokens.to(dtype).double() @ weight.double().t() + (b.double() if bias else 0.0)
    oracle = (e + pos.double()).repeat(copies, 1, 1)
    assert_close_to_oracle(f"stage_embed-{dtype}", got, want, oracle)
    eye = torch.eye(K, device=device)
    pooled = stage_embed.stage_embed(f, h, w, eye, None, torch.zeros(h * w, K, device=device), 1)
    assert torch.equal(pooled, tokens), "the kernel's area pooling differs from torch's"


@case("stage_embed-B1-13x13-from-16x16-C120-bf16")
def _(device="cpu"):
    _stage_embed_case(1, 32, (16, 16), (13, 13), 120, 2, torch.bfloat16, device)


@case("stage_embed-B2-3x5-from-16x16-C130-nobias-bf16")
def _(device="cpu"):
    _stage_embed_case(2, 32, (16, 16), (3, 5), 130, 2, torch.bfloat16, device, bias=False)


@case("stage_embed-B3-5x7-from-12x20-C64-fp32")
def _(device="cpu"):
    _stage_embed_case(3, 16, (12, 20), (5, 7), 64, 1, torch.float32, device)


@case("stage_embed-B2-1x4-from-32x32-C48-fp16")
def _(device="cpu"):
    _stage_embed_case(2, 32, (32, 32), (1, 4), 48, 2, torch.float16, device)


@case("stage_embed-B1-1x1-from-16x16-C40-bf16")
def _(device="cpu"):
    _stage_embed_case(1, 32, (16, 16), (1, 1), 40, 2, torch.bfloat16, device)     # torch's mean: the reference runs


def _phi_case(B, C, H, W, weight_dtype, device, channels_last=False):
    """VAR's φ latent update (f_hat += (1 − r)·h + r·(conv3×3(h) + bias)) in place, against the
    float64 oracle of the same definition: within the tolerance rule (the 9·C-term float32 sums of
    the kernel and of cuDNN / oneDNN run in different orders). ``channels_last``: ``h`` as a
    (B, H, W, C) buffer seen as (B, C, H, W), as a strided input must work."""
    from sparsevar.sparse_ops import phi, ref
    g = _gen(21)
    h = _rand((B, H, W, C), g, device).permute(0, 3, 1, 2) if channels_last else _rand((B, C, H, W), g, device)
    weight = _rand((C, C, 3, 3), g, device, scale=0.1).to(weight_dtype)
    bias = _rand((C,), g, device, scale=0.1).to(weight_dtype)
    f = _rand((B, C, H, W), g, device, scale=2.0)
    ratio = 0.5
    got = phi.phi_accumulate(h, weight, bias, ratio, f.clone())
    want = ref.phi_accumulate(h, weight, bias, ratio, f.clone())
    # the oracle on the CPU: on an H100 torch's float64 convolution of a channels-last input was 9e-4 off
    # it, as far as its float32 one (which cuDNN runs in TF32, torch's default); this kernel was 2.4e-7 off
    cpu = [t.double().cpu() for t in (h, weight, bias, f)]
    oracle = ref.phi_accumulate(cpu[0], cpu[1], cpu[2], ratio, cpu[3]).to(device)
    assert got.dtype == torch.float32 and got.shape == (B, C, H, W)
    assert_close_to_oracle(f"phi_accumulate-{weight_dtype}", got, want, oracle)
    untouched = f.clone()
    out = phi.phi_accumulate(h, weight, bias, ratio, untouched)
    assert out is untouched and not torch.equal(untouched, f), "the update must be written into f_hat itself"


@case("phi_accumulate-B1-C32-16x16")
def _(device="cpu"):
    _phi_case(1, 32, 16, 16, torch.float32, device)


@case("phi_accumulate-B2-C5-7x9-bf16-weights")
def _(device="cpu"):
    _phi_case(2, 5, 7, 9, torch.bfloat16, device)


@case("phi_accumulate-B3-C32-13x11-channels-last")
def _(device="cpu"):
    _phi_case(3, 32, 13, 11, torch.float32, device, channels_last=True)


@case("phi_accumulate-B1-C20-1x1")
def _(device="cpu"):
    _phi_case(1, 20, 1, 1, torch.float32, device)


@case("linear_residual-R2-l5-K64-C48-rms-split2-bf16")
def _(device="cpu"):
    from sparsevar.sparse_ops.linear import LinearConfig
    _linear_residual_case(2, 5, 64, 48, True, torch.bfloat16, device, [LinearConfig(16, 16, 16, 2, 4, 1)], rms=True)


@case("linear_residual-R1-l20-K96-C33-nobias-fp32")
def _(device="cpu"):
    from sparsevar.sparse_ops.linear import LinearConfig
    _linear_residual_case(1, 20, 96, 33, False, torch.float32, device, [LinearConfig(16, 32, 32, 1, 4, 1)])


@case("cfg_guide-B3-l13-V300-bf16")
def _(device="cpu"):
    _cfg_guide_case(3, 13, 300, 4.0 * 7 / 9, torch.bfloat16, device)


@case("cfg_guide-B1-l5-V37-fp32")
def _(device="cpu"):
    _cfg_guide_case(1, 5, 37, 0.3, torch.float32, device)


@case("sample_top_k_top_p-N5-V300-k30-bf16-logits")
def _(device="cpu"):
    _sample_case(5, 300, 30, 0.0, device, dtype=torch.bfloat16)


@case("sample_top_k_top_p-N3-V300-k30-p0.9")
def _(device="cpu"):
    _sample_case(3, 300, 30, 0.9, device)


@case("sample_top_k_top_p-N4-V37-p0.5")
def _(device="cpu"):
    _sample_case(4, 37, 0, 0.5, device)


@case("sample_top_k_top_p-N5-V64-k1-p0.9")
def _(device="cpu"):
    _sample_case(5, 64, 1, 0.9, device)


@case("sample_top_k_top_p-N3-V50-p1e-9")
def _(device="cpu"):
    _sample_case(3, 50, 0, 1e-9, device)           # (1 - top_p) rounds to 1: only the largest survives


@case("sample_top_k_top_p-N4-V300-k299-p0.99-all-negative")
def _(device="cpu"):
    _sample_case(4, 300, 299, 0.99, device, shift=-40.0)   # every key below zero (the sign bit's search)


@case("sample_top_k_top_p-N3-V129-k2-all-positive")
def _(device="cpu"):
    _sample_case(3, 129, 2, 0.0, device, shift=40.0)


@case("sample_top_k_top_p-ties-N6-V40-k10")
def _(device="cpu"):
    _sample_case(6, 40, 10, 0.0, device, ties=True)  # integer logits: ties at the k-th largest all kept


@case("bias_softmax-R3-l13-G4-T7-fp32")
def _(device="cpu"):
    _bias_softmax_case(3, 13, 4, 7, torch.float32, device)


@case("bias_softmax-R2-l5-G3-T33-bf16")
def _(device="cpu"):
    _bias_softmax_case(2, 5, 3, 33, torch.bfloat16, device)


@case("group_norm_silu-B2-C64-5x7-G8-fp32")
def _(device="cpu"):
    _group_norm_case(2, 64, 5, 7, 8, torch.float32, True, device)


@case("group_norm_silu-B1-C32-13x3-G32-bf16-offset-nosilu")
def _(device="cpu"):
    _group_norm_case(1, 32, 13, 3, 32, torch.bfloat16, False, device, offset=50.0)


@case("group_norm_silu-B2-C40-5x7-G8-fp32-masked")
def _(device="cpu"):       # 40 channels: one block of 64, 24 lanes masked (5 channels per group, as the VQVAE's 160)
    _group_norm_case(2, 40, 5, 7, 8, torch.float32, True, device)


@case("group_norm_silu-B1-C60-9x5-G6-bf16-masked-offset")
def _(device="cpu"):       # 6 groups of 10 channels in one masked block of 64
    _group_norm_case(1, 60, 9, 5, 6, torch.bfloat16, True, device, offset=3.0)


@case("group_norm_silu-B2-C96-7x9-G32-fp32-xbias")
def _(device="cpu"):       # three blocks of 32 channels, 3 channels per group; the input's bias added as it is read
    _group_norm_case(2, 96, 7, 9, 32, torch.float32, True, device, x_bias=True)


@case("group_norm_silu-B1-C40-6x5-G8-bf16-xbias-offset-nosilu")
def _(device="cpu"):
    _group_norm_case(1, 40, 6, 5, 8, torch.bfloat16, False, device, offset=20.0, x_bias=True)


@case("group_norm_silu-B2-C40-6x7-G8-bf16-xbias-channels-first-out")
def _(device="cpu"):       # channels-last in, channels-first out (a decoder's last norm)
    _group_norm_case(2, 40, 6, 7, 8, torch.bfloat16, True, device, x_bias=True, channels_first_out=True)


@case("group_norm_silu-B1-C512-20x32-G1-fp32-merges")
def _(device="cpu"):       # one group of 512 channels, 20 tiles in 12 programs: Chan's merge across tiles and in
    _group_norm_case(1, 512, 20, 32, 1, torch.float32, True, device, offset=5.0, partial_programs=48)   # chunks


@case("group_norm_silu-nchw-B2-C48-9x7-G8-fp32-xbias")
def _(device="cpu"):
    _group_norm_case(2, 48, 9, 7, 8, torch.float32, True, device, channels_last=False, x_bias=True)


@case("residual_bias_add-B2-C40-5x7-fp32-channels-last")
def _(device="cpu"):
    _residual_bias_case(2, 40, 5, 7, torch.float32, True, device)


@case("residual_bias_add-B1-C24-9x11-bf16-nchw")
def _(device="cpu"):
    _residual_bias_case(1, 24, 9, 11, torch.bfloat16, False, device)


@case("group_norm_silu-nchw-B2-C64-5x7-G8-fp32")
def _(device="cpu"):
    _group_norm_case(2, 64, 5, 7, 8, torch.float32, True, device, channels_last=False)


@case("group_norm_silu-nchw-B1-C96-43x41-G32-bf16-offset-nosilu")
def _(device="cpu"):                    # 3 channels per group; 5 289 values per group: several partial programs
    _group_norm_case(1, 96, 43, 41, 32, torch.bfloat16, False, device, offset=50.0, channels_last=False)


def run_cases(names, device) -> dict:
    """Run the named cases on ``device``; {name: {"ok", "msg", "sec"}}."""
    results = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            CASES[name](device=device)
            results[name] = {"ok": True, "msg": "", "sec": time.perf_counter() - t0}
        except Exception as e:  # reported per case by the test session
            results[name] = {"ok": False, "msg": f"{type(e).__name__}: {e}", "sec": time.perf_counter() - t0}
    return results


# ---- the interpreter run (CI) ------------------------------------------------------------------------
def _triton_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is not None


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory, interpreter_run):
    if not _triton_installed():
        pytest.skip("triton is not installed (pip install -e '.[dev]' on Linux installs it)")
    from importlib.metadata import version
    import numpy as np
    triton_version = tuple(int(v) for v in version("triton").split(".")[:2])
    if triton_version < (3, 8) and np.lib.NumpyVersion(np.__version__) >= "2.4.0":
        pytest.fail(f"triton {version('triton')}'s interpreter fails on runtime loop bounds with NumPy "
                    f"{np.__version__} (int() of a 1-element array; triton 3.8 works): pip install 'numpy<2.4' "
                    f"or a newer triton", pytrace=False)
    t0 = time.perf_counter()
    if interpreter_run is not None:             # started in the background when the tests were collected
        proc, folder = interpreter_run
        try:
            returncode = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
        out, stdout, stderr = folder / "results.json", (folder / "output.txt").read_text(), ""
    else:
        out = tmp_path_factory.mktemp("interp") / "results.json"
        env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
        res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--interpret", str(out)], env=env,
                             capture_output=True, text=True, timeout=600)
        returncode, stdout, stderr = res.returncode, res.stdout, res.stderr
    assert returncode == 0, f"interpreter run failed:\n{stdout[-4000:]}\n{stderr[-4000:]}"
    results = json.loads(out.read_text())
    print(f"interpreter cases: waited {time.perf_counter() - t0:.1f} s for them; "
          + ", ".join(f"{k} {v['sec']:.1f} s" for k, v in results.items()))
    return results


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_kernel_matches_reference_in_the_interpreter(interpreter_results, name):
    r = interpreter_results[name]
    assert r["ok"], r["msg"]


# ---- the references against the policies' rules -----------------------------------------------------
def test_nearest_source_is_what_nearest_upsampling_copies():
    from sparsevar.policies.sparsevar import nearest_source, upsample_map
    for src_hw, hw in (((10, 10), (13, 13)), ((29, 41), (37, 53)), ((1, 1), (2, 2)), ((5, 7), (11, 19)), ((6, 6), (9, 9))):
        m = torch.randn(2, *src_hw)
        up = upsample_map(m, hw, "nearest").reshape(2, -1)
        assert torch.equal(m.reshape(2, -1)[:, nearest_source(src_hw, hw)], up)


def test_select_kept_compacts_and_pads_with_the_first_kept_token():
    from sparsevar.sparse_ops import ref
    g = torch.Generator().manual_seed(0)
    change = torch.rand(3, 40, generator=g)
    change[1] = 0.0                                      # a flat map: only the anchors survive
    anchors = torch.zeros(40, dtype=torch.bool)
    anchors[::9] = True
    idx, count, keep = ref.select_kept(change, torch.arange(40), anchors, 0.6, None)
    want_keep = anchors | (change > 0.6 * change.amax(dim=1, keepdim=True))   # the rule, strict
    assert torch.equal(keep, want_keep)
    counts = want_keep.sum(dim=1).tolist()
    assert count.tolist() == counts and counts[1] == int(anchors.sum()) and min(counts) < max(counts)
    for b in range(3):                                   # the kept positions first, in order
        assert idx[b, :counts[b]].tolist() == want_keep[b].nonzero().view(-1).tolist()
    assert torch.equal(idx[1, counts[1]:], idx[1, :1].expand(40 - counts[1]))   # padding repeats the first kept


def test_restore_reference_upsamples_the_cache_by_area_and_gates_the_fresh_rows():
    from sparsevar.sparse_ops import ref
    x = torch.zeros(1, 9, 1)                             # a 3×3 map from a 2×2 cache
    cache = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 4, 1)
    out = ref.restore_residual(x, torch.tensor([[4]]), torch.tensor([[[10.0]]]), torch.tensor([[[0.5]]]), cache,
                               (2, 2), (3, 3))
    # area windows: rows/cols [0,1), [0,2), [1,2) → corners copy, edges average 2, centre averages 4
    assert out.view(3, 3).tolist() == [[1.0, 1.5, 2.0], [2.0, 5.0, 3.0], [3.0, 3.5, 4.0]]


def test_gather_and_scatter_rows_use_row_indices():
    from sparsevar.sparse_ops import ref
    x = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    idx = torch.tensor([[4, 0], [1, 1]])
    assert torch.equal(ref.gather_rows(x, idx), x.gather(1, idx.unsqueeze(-1).expand(2, 2, 3)))
    y = -torch.ones(2, 2, 3)
    out = ref.scatter_rows(x, idx, y)
    assert torch.equal(out, x.scatter(1, idx.unsqueeze(-1).expand(2, 2, 3), y)) and not torch.equal(out, x)


# ---- backend choice ----------------------------------------------------------------------------------
def test_backend_choice_on_cpu(caplog, monkeypatch):
    from sparsevar.sparse_ops import _backend
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _backend.triton_status.cache_clear()
    with caplog.at_level(logging.INFO, logger=_backend.log.name):
        assert _backend.resolve_backend("auto", "cpu") == "torch"
        assert _backend.resolve_backend("auto", "cpu") == "torch"
    lines = [r.getMessage() for r in caplog.records if r.name == _backend.log.name]
    assert len(lines) == 1 and "pure-torch path" in lines[0]                # one log line says so
    assert _backend.resolve_backend("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match=r"backend='triton' but the Triton kernels cannot run on cpu.*'auto'"):
        _backend.resolve_backend("triton", "cpu")
    with pytest.raises(ValueError, match=r"backend='cuda' is not a kernel backend: use 'auto'"):
        _backend.resolve_backend("cuda", "cpu")



def test_dependent_launch_only_where_the_gpu_can_and_the_chain_is_ours():
    """Programmatic dependent launch (sparse_ops._gdc) needs sm_90+ outside the interpreter; an
    explicit pdl=True elsewhere names the argument and the fix."""
    from sparsevar.sparse_ops import _backend
    cpu = torch.device("cpu")
    assert _backend.dependent_launch(cpu, 2) is False and _backend.dependent_launch(cpu, 2, False) is False
    with pytest.raises(ValueError, match=r"pdl=True but programmatic dependent launch needs a CUDA GPU of sm_90.*"
                                         r"pdl=None"):
        _backend.dependent_launch(cpu, 2, True)
    from sparsevar.sparse_ops.kernels import Kernels
    assert Kernels.SMALL_GEMM_ROWS == _backend.CHAIN_ROWS       # the chain is ours up to there


def test_few_row_launch_shapes_follow_their_rules():
    """The few-row GEMM's launch shape (``linear._few_rows_config``) and the row-wise norms' (``FEW_ROWS``)
    on a 132-SM GPU, at VAR-d30's products: the rules their docstrings state and measure."""
    if not _triton_installed():
        pytest.skip("triton is not installed")
    from sparsevar.sparse_ops import gather_modulate, linear
    sms = 132
    products = {"qkv": (5760, 1920, 1024), "fc1": (7680, 1920, 1024), "head": (4096, 1920, 1024),
                "proj": (1920, 1920, 512), "fc2": (1920, 7680, 512)}        # N, K, min_split_k
    for name, (N, K, min_split) in products.items():
        for M in (1, 2, 8, 18, 32, 50, 64):
            cfg = linear._few_rows_config(M, N, K, sms, min_split)
            tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)
            assert cfg.block_m >= M and cfg.block_k == 128 and (cfg.num_warps, cfg.num_stages) == (4, 5), (name, M, cfg)
            assert K // cfg.split_k >= min_split or cfg.split_k == 1, (name, M, cfg)      # each split long enough
            if M <= 32:
                assert cfg.block_n == 32, (name, M, cfg)
                assert tiles * cfg.split_k >= sms or 2 * cfg.split_k > K // min_split, (name, M, cfg)
            elif cfg.block_n == 64:                                    # 64-wide only where that fills ≥ 60 %
                assert tiles * cfg.split_k >= 0.6 * sms, (name, M, cfg)
    assert linear._few_rows_config(50, 5760, 1920, sms, 1024).block_n == 64      # x read once per 64 columns
    assert linear._few_rows_config(50, 4096, 1920, sms, 1024).block_n == 32      # 64 wide would fill 64 SMs
    assert linear._few_rows_config(50, 1920, 7680, sms, 512)[1:4] == (64, 128, 4)
    assert linear.choose_config(50, 1920, 7680, sms, 512) == linear._few_rows_config(50, 1920, 7680, sms, 512)
    # the norms: one row per program up to FEW_ROWS rows, the 4K-element programs above (and without a count)
    assert gather_modulate._launch_shape(1920, gather_modulate.FEW_ROWS) == (2048, 1, 8)
    assert gather_modulate._launch_shape(1024, 72) == (1024, 1, 4)
    assert gather_modulate._launch_shape(1920, gather_modulate.FEW_ROWS + 1) == gather_modulate._launch_shape(1920)
    assert gather_modulate._launch_shape(1920) == (2048, 2, 4)


# shared memory a program may use (bytes, per-block opt-in): H100/H200, A100, RTX 3090/4090 (sm_86/sm_89)
SHARED_MEMORY = {"sm90": 232448, "sm80": 166912, "sm86": 101376}


def test_launch_shapes_keep_their_tuned_shape_on_hopper_and_fit_smaller_shared_memory():
    """Each attention kernel's and the GEMM's launch shape: on H100/H200 in bf16 the shape the
    sweeps chose; where shared memory is smaller (A100, RTX 3090/4090) or operands are float32,
    pipelined tiles that fit (q resident, each stage's k/v or x/weight tiles)."""
    from sparsevar.sparse_ops import cache_attention, colsum, group_attention, linear, window_attention
    from sparsevar.sparse_ops._backend import SHARED_MEMORY_SLACK
    hopper = SHARED_MEMORY["sm90"]
    assert group_attention._launch(128, 2, hopper) == (64, 64, 4, 3)
    assert window_attention._launch(64, 128, 2, hopper) == (64, 32, 4, 3)
    assert colsum._colsum_launch(128, 2, hopper) == (64, 128, 4, 3)
    assert cache_attention.launch_shape(2, 30, 256, 680, 64, 2, hopper) == (64, 64, 4, 3)
    assert linear.choose_config(50, 5760, 1920, 132, elem=2, limit=hopper) == \
        linear._few_rows_config(50, 5760, 1920, 132, 1024)
    for limit in SHARED_MEMORY.values():
        room = limit - SHARED_MEMORY_SLACK
        for elem in (2, 4):
            for d in (64, 128):
                bm, bn, _, st = group_attention._launch(d, elem, limit)
                assert elem * d * (bm + st * 2 * bn) <= room, (limit, elem, d)
                bm, bn, _, st = window_attention._launch(64, d, elem, limit)
                assert elem * d * (bm + st * 2 * bn) <= room, (limit, elem, d)
                bm, bn, _, st = colsum._colsum_launch(d, elem, limit)
                assert elem * d * (bm + st * bn) <= room and elem * d * (bn + st * bm) + st * 4 * bm <= room
                bq, bk, _, st = cache_attention.launch_shape(2, 16, 4096, 10521, d, elem, limit)
                assert elem * d * (bq + st * 2 * bk) <= room, (limit, elem, d)
            for M in (2, 50, 200, 4096):
                cfg = linear.choose_config(M, 5760, 1920, 132, elem=elem, limit=limit)
                assert cfg.num_stages * elem * (cfg.block_m + cfg.block_n) * cfg.block_k <= room, (limit, elem, M)
    # an RTX 4090 keeps VAR-d30's 64-row product at three stages instead of five (5 × 32 KB > 99 KB)
    assert linear.choose_config(50, 5760, 1920, 128, elem=2, limit=SHARED_MEMORY["sm86"]).num_stages == 3


def test_kernels_compiled_for_an_rtx_4090_fit_its_shared_memory(monkeypatch):
    """Triton's own compiler, targeting sm_86 (RTX 3090; the 4090's sm_89 has the same 101,376-byte
    limit): the attention kernels and the GEMM, launched as the library launches them on such a card,
    allocate no more shared memory than it has — the launch would fail with OutOfResources. Compiled
    only (no GPU needed), with the argument specialisation Triton's launcher derives (through its
    internals in ``triton.runtime.jit``, which a new Triton release may move: adapt the binding, do
    not drop the check)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature
    from sparsevar.policies.sparvar import csla_tiles
    from sparsevar.sparse_ops import cache_attention, colsum, group_attention, linear, window_attention
    limit = SHARED_MEMORY["sm86"]
    launched = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kw: launched.append((self, args, kw)))
    for module in (cache_attention, colsum, group_attention, linear, window_attention):
        monkeypatch.setattr(module, "shared_memory", lambda device: limit)
    R, H, d, l, L = 2, 2, 128, 256, 600
    q, k, v = (torch.randn(R, H, n, d, dtype=torch.bfloat16) for n in (l, L, L))
    G = -(-l // 192)
    hw = ((1, 1), (2, 2), (4, 4), (8, 8), (16, 16))
    group_attention.group_sparse_attention(q, k, v, torch.zeros(R, H, G, 8, dtype=torch.int32),
                                           torch.full((R, H, G), 8, dtype=torch.int32), 192, 0.1, 5,
                                           torch.tensor([[300, 400]] * G, dtype=torch.int32),
                                           torch.randn(R, H, 64, d, dtype=torch.bfloat16), (16, 16), (8, 8))
    window_attention.window_attention(q, k[:, :, :341], v[:, :, :341], *csla_tiles(hw, 4, 2, (7, 5, 3)), 16, 0.1)
    colsum.attention_colsum(q, k, 0.1, 192, None)
    cache_attention.qk_norm_attend(torch.randn(R, l, 3, H, d, dtype=torch.bfloat16), torch.ones(2, H, 1), k, v)
    for dtype in (torch.bfloat16, torch.float32):
        linear.linear(torch.randn(50, 1920, dtype=dtype), torch.randn(5760, 1920, dtype=dtype))
    names = sorted({kern.__name__ for kern, _, _ in launched})
    assert names == ["_colsum_kernel", "_group_attention_kernel", "_linear_kernel", "_lse_kernel",
                     "_qk_norm_attend_kernel", "_window_attention_kernel"], names
    target = GPUTarget("cuda", 86, 32)
    backend = make_backend(target)
    for kern, args, kw in launched:
        kw = {key: val for key, val in kw.items() if key != "launch_pdl"}
        bound, specialization, options = create_function_from_signature(kern.signature, kern.params, backend)(*args, **kw)
        options, signature, constexprs, attrs = kern._pack_args(backend, kw, bound, specialization, options)
        compiled = triton.compile(ASTSource(kern, signature, constexprs, attrs), target=target, options=options.__dict__)
        assert 0 < compiled.metadata.shared <= limit, (kern.__name__, kw, compiled.metadata.shared)


@pytest.mark.parametrize("make", [
    lambda: __import__("sparsevar").policies.SparseVARConfig(backend="gpu"),
    lambda: __import__("sparsevar").policies.FastVARConfig(backend="Triton"),
])
def test_configs_validate_the_backend(make):
    with pytest.raises(ValueError, match=r"backend='(gpu|Triton)' is not a kernel backend: use 'auto'"):
        make()


def test_configs_document_the_backend():
    from sparsevar.policies import FastVARConfig, SparseVARConfig
    for cfg in (SparseVARConfig, FastVARConfig):
        assert cfg().backend == "auto" and "backend:" in cfg.__doc__


def test_generation_with_backend_triton_on_cpu_names_the_setting():
    from sparsevar import VARPipeline
    pipe = VARPipeline.from_random("var-tiny")
    pipe.set_progress_bar_config(disable=True)
    pipe.enable_fastvar(backend="triton")
    with pytest.raises(ValueError, match=r"backend='triton' but the Triton kernels cannot run on cpu"):
        pipe([1], generator=torch.Generator().manual_seed(0), output_type="latent")


# ---- attention dispatch ------------------------------------------------------------------------------
def test_attention_dispatch_chooses_per_call_and_logs_why(caplog):
    from sparsevar.sparse_ops import attention as A
    q, k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 6:] = False
    assert A.choose_attention(q, k)[0] == "sdpa"
    name, why = A.choose_attention(q, k, key_valid_RL=valid)
    assert name == "sdpa" and "key mask" in why                   # varlen only on request (measured slower)
    with pytest.raises(ValueError, match="backend='varlen' cannot run here: varlen attention runs on CUDA only"):
        A.choose_attention(q, k, key_valid_RL=valid, backend="varlen")
    with pytest.raises(ValueError, match="backend='flex' needs a block_mask"):
        A.choose_attention(q, k, backend="flex")
    with caplog.at_level(logging.DEBUG, logger=A.log.name):
        out = A.dense_attention(q, k, v, 0.3, attn_mask=valid[:, None, None, :])
    assert any("attention backend sdpa" in r.getMessage() for r in caplog.records)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=0.3)
    assert torch.equal(out, want)                                 # the CPU path is the SDPA call it always was


def test_fused_cache_attention_is_chosen_per_call_and_logs_why(caplog):
    """VAR's fused attention step runs only without a key mask, without an attention policy, under
    the fused kernels, and outside the shapes where cuDNN measured faster; each call logs why."""
    from sparsevar.sparse_ops.attention import FUSED_CACHE_ATTENTION_GAP, use_fused_cache_attention
    min_rh, lo, hi = FUSED_CACHE_ATTENTION_GAP
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    with caplog.at_level(logging.DEBUG, logger="sparsevar.sparse_ops.attention"):
        assert use_fused_cache_attention(True, None, False, 2, 30, 256, 680)
        assert use_fused_cache_attention(True, None, False, 1, min_rh - 1, hi, hi + 1)       # few row-heads
        assert use_fused_cache_attention(True, None, False, 1, min_rh, lo, lo + 1)           # at the gap's edges
        assert use_fused_cache_attention(True, None, False, 1, min_rh, hi + 1, hi + 1)
        assert not use_fused_cache_attention(False, None, False, 2, 30, 4, 5)
        assert not use_fused_cache_attention(True, mask, False, 2, 30, 4, 9)
        assert not use_fused_cache_attention(True, None, True, 2, 30, 4, 5)
        assert not use_fused_cache_attention(True, None, False, 1, min_rh, lo + 1, lo + 1)
        assert not use_fused_cache_attention(True, None, False, 2, 30, 4, 5, head_dim=48)    # not a power of two
        assert use_fused_cache_attention(True, None, False, 2, 30, 4, 5, head_dim=128)
    text = caplog.text
    for why in ("unmasked: one Triton launch", "Triton kernels not in use", "key-padding mask",
                "a policy chooses the attention pattern", "cuDNN measured faster", "head dim 48 is not a power of two"):
        assert why in text, why


def test_flex_attention_with_a_block_mask_equals_masked_sdpa():
    from torch.nn.attention.flex_attention import create_block_mask
    from sparsevar.sparse_ops.attention import attention, choose_attention
    L, blk = 256, 128
    q, k, v = (torch.randn(1, 2, L, 16) for _ in range(3))

    def mask_mod(b, h, qi, ki):                                   # query block i attends key blocks 0 and i
        return (ki // blk == 0) | (ki // blk == qi // blk)

    bm = create_block_mask(mask_mod, 1, 2, L, L, device="cpu", BLOCK_SIZE=blk)
    assert choose_attention(q, k, block_mask=bm)[0] == "flex"
    qi, ki = torch.arange(L)[:, None], torch.arange(L)[None, :]
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask_mod(0, 0, qi, ki), scale=0.25)
    torch.testing.assert_close(attention(q, k, v, 0.25, block_mask=bm), dense, atol=1e-5, rtol=1e-5)


def test_describe_backends_says_what_runs_here():
    from sparsevar.sparse_ops.attention import describe_backends
    text = describe_backends()
    assert "torch" in text and "FlexAttention" in text and "backend='auto'" in text


# ---- GPU tier: native kernels in bf16 and production shapes ------------------------------------------
def _needs_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (GPU tier)")
    if not _triton_installed():
        pytest.skip("needs triton")


INFINITY_1024_HW = tuple((p, p) for p in (1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64))
HART_HW = ((1, 300),) + tuple((p, p) for p in (2, 3, 4, 5, 7, 9, 12, 16, 21, 27, 36, 48, 64))    # text slots first

GPU_CASES = {
    **{f"interp-shape:{k}": v for k, v in CASES.items()},
    # production shapes: Infinity-2B width, VAR-d30 width (not a power of 2), 64×64 maps
    # the VQVAE decoders' GroupNorm channels-first: HART's 1024² map in bf16, and more (image, channel)
    # planes than a grid's second axis takes (65 535): the encoder over a batch of 520
    "group_norm_silu-nchw-B1-C128-1024x1024-G32-bf16":
        lambda device: _group_norm_case(1, 128, 1024, 1024, 32, torch.bfloat16, True, device, channels_last=False),
    "group_norm_silu-nchw-B520-C128-3x5-G32-fp32":
        lambda device: _group_norm_case(520, 128, 3, 5, 32, torch.float32, True, device, channels_last=False),
    "gather_norm_modulate-1x64x64-C2048-bf16": lambda device: _gather_norm_case((1, 64, 64), 2048, torch.bfloat16, device),
    "gather_norm_modulate-4x16x16-C1920-bf16": lambda device: _gather_norm_case((4, 16, 16), 1920, torch.bfloat16, device),
    "restore_residual-1x64x64-from-24x24-C2048": lambda device: _restore_case((1, 64, 64), (24, 24), 2048, device),
    "restore_residual-2x48x48-from-36x36-C1536": lambda device: _restore_case((2, 48, 48), (36, 36), 1536, device),
    "change_map-1x64x64-C2048": lambda device: _change_case((1, 64, 64), 2048, device),
    "select_kept-2x64x64-from-48x48": lambda device: _select_case((2, 64, 64), (48, 48), device),
    "select_kept-1x90x120-from-60x80": lambda device: _select_case((1, 90, 120), (60, 80), device),
    "anchor_match-1x64x64-V4096": lambda device: _anchor_case((1, 64, 64), (48, 48), 4096, device),
    # VAR-d30 batch 8's last scale; a vocabulary that leaves a partial 1024-wide chunk, non-square
    "anchor_match-8x16x16-V4096": lambda device: _anchor_case((8, 16, 16), (13, 13), 4096, device),
    "anchor_match-3x13x17-V1500": lambda device: _anchor_case((3, 13, 17), (10, 13), 1500, device),
    # FastVAR's selection: VAR-d30 batch 1 with CFG at 13 × 13, Infinity-2B at 40 × 40 and a 48 × 64 map
    "pivotal_tokens-2x13x13-C1920-fp32": lambda device: _pivotal_case((2, 13, 13), 1920, torch.float32, device),
    "pivotal_tokens-2x40x40-C2048-fp32": lambda device: _pivotal_case((2, 40, 40), 2048, torch.float32, device),
    "pivotal_tokens-4x48x64-C2048-bf16": lambda device: _pivotal_case((4, 48, 64), 2048, torch.bfloat16, device),
    "anchor_match-2x64x64-V64": lambda device: _anchor_case((2, 64, 64), (48, 48), 64, device),
    "group_sparse_attention-R2H16-l2304-Lk6681-d128-g192-bf16":
        lambda device: _group_attention_case(2, 16, 2304, 6681, 128, 192, 0.25, torch.bfloat16, device),
    "group_sparse_attention-R2H6-l1024-Lk2240-d64-g192-fp16":
        lambda device: _group_attention_case(2, 6, 1024, 2240, 64, 192, 0.2, torch.float16, device),
    "group_sparse_attention-R2H4-l4096-Lk10521-d128-g192-prefix121-band-bf16":
        lambda device: _group_attention_case(2, 4, 4096, 10521, 128, 192, 0.2, torch.bfloat16, device, prefix=121,
                                             band=True),
    "group_sparse_attention-R2H4-l4096-Lk10521-d128-g192-prefix121-band-add-bf16":
        lambda device: _group_attention_case(2, 4, 4096, 10521, 128, 192, 0.2, torch.bfloat16, device, prefix=121,
                                             band=True, add=(64, 64, 40, 40)),
    # CS4A's last scale as the policy runs it: 22 groups read the decision scale's 9 lists, counted
    "group_sparse_attention-R2H4-l4096-Lk10521-d128-g192-prefix121-band-add-lists9-bf16":
        lambda device: _group_attention_case(2, 4, 4096, 10521, 128, 192, 0.2, torch.bfloat16, device, prefix=121,
                                             band=True, add=(64, 64, 40, 40), sources=9),
    # CSLA at Infinity-2B 1024²'s last scale (paper windows, 5 sink scales) and HART's (24 heads of 64)
    "window_attention-csla-infinity1024-last-R2H4-d128-bf16":
        lambda device: _window_attention_case(INFINITY_1024_HW, 12, 5, (7, 5, 3), (8, 8), 2, 4, 128, torch.bfloat16,
                                              device),
    "window_attention-csla-infinity1024-third-last-R2H4-d128-bf16":
        lambda device: _window_attention_case(INFINITY_1024_HW, 10, 5, (7, 5, 3), (8, 8), 2, 4, 128, torch.bfloat16,
                                              device),
    "window_attention-csla-hart-last-R2H6-d64-fp16":
        lambda device: _window_attention_case(HART_HW, 13, 5, (7, 5, 3), (8, 8), 2, 6, 64, torch.float16, device),
    "attention_colsum-R2H16-l1600-Lk4121-d128-bf16":
        lambda device: _colsum_case(2, 16, 1600, 4121, 128, 192, torch.bfloat16, device),
    "dense_attention_lse-R2H16-l1600-Lk4121-d128-bf16": lambda device: _attention_lse_case(2, 16, 1600, 4121, 128,
                                                                                         torch.bfloat16, device),
    "attention_colsum-R2H16-l1600-Lk4121-d128-lse-bf16":
        lambda device: _colsum_case(2, 16, 1600, 4121, 128, 192, torch.bfloat16, device, with_lse=True),
    # HART's shapes (24 heads of 64, width 1536): the last scale's rows with CFG, and a subset per row
    "rope_half_store-R2-l4096-H24-d64-bf16": lambda device: _rope_half_case(2, 4096, 24, 64, 9751, torch.bfloat16,
                                                                           False, device),
    "rope_half_store-R2-l777-H24-d64-bf16-per-row": lambda device: _rope_half_case(2, 777, 24, 64, 1200,
                                                                                  torch.bfloat16, True, device),
    "token_residual_norm_modulate-N8192-C1024-bf16": lambda device: _token_residual_case(8192, 1024, torch.bfloat16,
                                                                                        device),
    "residual_norm_modulate-R2-l4096-C1536-rms-bf16": lambda device: _residual_norm_case(2, 4096, 1536, torch.bfloat16,
                                                                                         device, rms=True),
    "linear_residual-R2-l9-K4096-C1536-rms-bf16": lambda device: _linear_residual_case(2, 9, 4096, 1536, False,
                                                                                       torch.bfloat16, device, rms=True),
    "qk_norm_rope_store-R2-l4096-H16-d128-bf16": lambda device: _qk_rope_case(2, 4096, 16, 128, 6000, torch.bfloat16,
                                                                             False, device),
    "qk_norm_rope_store-R2-l999-H16-d128-bf16-per-row": lambda device: _qk_rope_case(2, 999, 16, 128, 1200,
                                                                                    torch.bfloat16, True, device),
    # VAR-d30's attention (30 heads of 64) at the first scale, a middle one (batch 8 with CFG) and the last
    "qk_norm_attend-R2-l1-H30-d64-bf16": lambda device: _qk_attend_case(2, 1, 30, 64, 0, torch.bfloat16, device),
    "qk_norm_attend-R16-l100-H30-d64-bf16": lambda device: _qk_attend_case(16, 100, 30, 64, 155, torch.bfloat16,
                                                                          device),
    "qk_norm_attend-R2-l256-H30-d64-bf16": lambda device: _qk_attend_case(2, 256, 30, 64, 424, torch.bfloat16, device),
    # VAR-d30's four GEMMs at 2 and 18 rows (split-K on fc2 and proj), Infinity-2B's fc2, a 4-row fp16 GELU
    **{f"linear-M{M}-{n}-bf16": (lambda device, M=M, N=N, K=K, gelu=gelu: _linear_case(M, N, K, True, gelu,
                                                                                       torch.bfloat16, device))
       for M in (2, 18) for n, (N, K, gelu) in {"qkv1920": (5760, 1920, False), "proj1920": (1920, 1920, False),
                                                "fc1-1920": (7680, 1920, True), "fc2-1920": (1920, 7680, False),
                                                "fc2-2048": (2048, 8192, False)}.items()},
    # VAR-d30's two output projections into the residual stream at 2 and 32 rows
    **{f"linear_residual-R{R}-l{l}-{n}-bf16": (lambda device, R=R, l=l, K=K: _linear_residual_case(
        R, l, K, 1920, True, torch.bfloat16, device)) for R, l in ((2, 1), (2, 16)) for n, K in
       {"proj1920": 1920, "fc2-1920": 7680}.items()},
    # VAR-d30's guidance at batch 8's last scale (16 rows of 256 tokens × 4096 codes) and at batch 1's
    "cfg_guide-B8-l256-V4096-bf16": lambda device: _cfg_guide_case(8, 256, 4096, 4.0, torch.bfloat16, device),
    "cfg_guide-B1-l169-V4096-bf16": lambda device: _cfg_guide_case(1, 169, 4096, 4.0 * 8 / 9, torch.bfloat16, device),
    # VAR-d30's input map at batch 1's 13 × 13 scale and batch 8's last (16 × 16 from the 16 × 16 latent)
    "stage_embed-B1-13x13-C1920-bf16": lambda device: _stage_embed_case(1, 32, (16, 16), (13, 13), 1920, 2,
                                                                        torch.bfloat16, device),
    "stage_embed-B8-16x16-C1920-bf16": lambda device: _stage_embed_case(8, 32, (16, 16), (16, 16), 1920, 2,
                                                                        torch.bfloat16, device),
    "stage_embed-B2-2x2-from-32x32-C2048-bf16": lambda device: _stage_embed_case(2, 32, (32, 32), (2, 2), 2048, 1,
                                                                                 torch.bfloat16, device),
    # VAR's 4096 codes with its defaults at the last scale's 512 rows; top-k only; greedy
    "sample_top_k_top_p-N512-V4096-k900-p0.96": lambda device: _sample_case(512, 4096, 900, 0.96, device),
    "sample_top_k_top_p-N7-V4096-k600": lambda device: _sample_case(7, 4096, 600, 0.0, device),
    "sample_top_k_top_p-N3-V1000-k1": lambda device: _sample_case(3, 1000, 1, 0.0, device),
    # the absorbed cross-attention of Infinity-2B at its last scale: 16 heads × a 32-token bucket
    "bias_softmax-R2-l4096-G16-T32-bf16": lambda device: _bias_softmax_case(2, 4096, 16, 32, torch.bfloat16, device),
    "bias_softmax-R1-l77-G28-T64-fp16": lambda device: _bias_softmax_case(1, 77, 28, 64, torch.float16, device, False),
    # the BSQ-VAE decoder's norms at 1024²: the top level (128 channels at 1024×1024) and the bottom (512 at 64×64)
    "group_norm_silu-B1-C128-1024x1024-G32-bf16": lambda device: _group_norm_case(1, 128, 1024, 1024, 32,
                                                                                  torch.bfloat16, True, device),
    "group_norm_silu-B1-C160-1024x1024-G32-bf16-xbias": lambda device: _group_norm_case(
        1, 160, 1024, 1024, 32, torch.bfloat16, True, device, x_bias=True),
    "group_norm_silu-B1-C160-1024x1024-G32-bf16-channels-first-out": lambda device: _group_norm_case(
        1, 160, 1024, 1024, 32, torch.bfloat16, True, device, channels_first_out=True),
    "group_norm_silu-B1-C640-64x64-G32-bf16-xbias": lambda device: _group_norm_case(
        1, 640, 64, 64, 32, torch.bfloat16, True, device, offset=2.0, x_bias=True),
    "residual_bias_add-B1-C160-1024x1024-bf16": lambda device: _residual_bias_case(1, 160, 1024, 1024, torch.bfloat16,
                                                                                    True, device),
    "group_norm_silu-B2-C512-64x64-G32-bf16": lambda device: _group_norm_case(2, 512, 64, 64, 32, torch.bfloat16,
                                                                              True, device, offset=3.0),
    # VAR's latent update on its 32-channel 16 × 16 latent at batch 1 and 8; an odd map with a strided input
    "phi_accumulate-B1-C32-16x16": lambda device: _phi_case(1, 32, 16, 16, torch.float32, device),
    "phi_accumulate-B8-C32-16x16": lambda device: _phi_case(8, 32, 16, 16, torch.float32, device),
    "phi_accumulate-B3-C32-13x11-channels-last": lambda device: _phi_case(3, 32, 13, 11, torch.float32, device, True),
    "linear-M4-N1000-K999-fp16-gelu": lambda device: _linear_case(4, 1000, 999, True, True, torch.float16, device),
    "linear-M300-N2048-K2048-bf16": lambda device: _linear_case(300, 2048, 2048, True, False, torch.bfloat16, device),
    "attention_colsum-R1H4-l333-Lk1000-d64-fp16": lambda device: _colsum_case(1, 4, 333, 1000, 64, 192, torch.float16,
                                                                             device),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_triton_kernel_matches_reference_natively_on_gpu(name):
    _needs_gpu()
    GPU_CASES[name](device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("setup", [
    lambda p: p.enable_sparsevar(keep_ratio=0.5, start_scale=-3, backend="triton"),
    lambda p: p.enable_sparsevar(tau=0.3, start_scale=-3, backend="triton"),
    lambda p: p.enable_fastvar(backend="triton"),
], ids=["sparsevar-keep", "sparsevar-tau", "fastvar"])
def test_policies_on_triton_kernels_replay_from_cuda_graphs_exactly(setup):
    """The kernels launch inside captured layer stacks: graphs must give eager's codes bit for bit."""
    _needs_gpu()
    from sparsevar import VARPipeline
    pipe = VARPipeline.from_random("var-tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    setup(pipe)

    def codes(graphs):
        got = []
        pipe([1, 2], generator=torch.Generator("cuda").manual_seed(3), use_cuda_graphs=graphs, output_type="latent",
             callback_on_step_end=lambda p, si, t, k: got.append(k["codes"].clone()))
        return got

    eager = codes(False)
    for _ in range(2):                                             # capture, then replay
        got = codes(True)
        assert len(got) == len(eager) == pipe.num_timesteps
        assert all(torch.equal(a, b) for a, b in zip(got, eager))



@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 50])
def test_a_chain_of_dependent_launches_gives_the_plain_launches_bits(rows):
    """VAR-d30-wide layers at few rows as the fused path runs them (qkv product, attention step over
    a cache, split-K projection + residual + norm, GELU product, split-K fc2 + residual + norm), three
    layers deep and replayed from a CUDA graph: with programmatic dependent launch every kernel
    reads its predecessors' finished results, so the bits equal the plain launches'."""
    _needs_gpu()
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    from sparsevar.sparse_ops import cache_attention, linear, linear_residual
    g = torch.Generator(device="cuda").manual_seed(0)
    C, H, F4, R, L0 = 1920, 30, 7680, 2, 37
    l = rows // R

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    layers = [dict(qkv=rnd(3 * C, C, scale=C ** -0.5), qkv_b=rnd(3 * C, scale=0.1), proj=rnd(C, C, scale=C ** -0.5),
                   fc1=rnd(F4, C, scale=C ** -0.5), fc2=rnd(C, F4, scale=F4 ** -0.5)) for _ in range(3)]
    mod = [rnd(R, 1, C, scale=0.5) for _ in range(3)]
    mult = torch.rand(2, H, 1, generator=g, device="cuda") + 1
    x0, y0 = rnd(R, l, C), rnd(R, l, C)
    cache0 = rnd(2, 3, R, H, L0 + l, C // H)

    def chain(pdl, k, v, x, y):
        for w in layers:
            qkv = linear.linear(y, w["qkv"], w["qkv_b"], pdl=pdl).view(R, l, 3, H, C // H)
            att = cache_attention.qk_norm_attend(qkv, mult, k, v, pdl=pdl).view(R, l, C)
            x, y = linear_residual.linear_residual_norm_modulate(att, w["proj"], None, x, mod[0], mod[1], mod[2],
                                                                 1e-6, torch.bfloat16, pdl=pdl)
            h = linear.linear(y, w["fc1"], None, True, pdl=pdl)
            x, y = linear_residual.linear_residual_norm_modulate(h, w["fc2"], None, x, mod[1], mod[2], mod[0],
                                                                 1e-6, torch.bfloat16, pdl=pdl)
        return x, y

    outs = {}
    for pdl in (False, True):
        cache = cache0.clone()
        k, v = cache[0, 0], cache[1, 0]
        x_in, y_in = x0.clone(), y0.clone()
        chain(pdl, k, v, x_in, y_in)                                 # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            x_out, y_out = chain(pdl, k, v, x_in, y_in)
        cache.copy_(cache0)
        graph.replay()
        torch.cuda.synchronize()
        outs[pdl] = (x_out.clone(), y_out.clone(), cache.clone())
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)
    assert outs[True][1].float().abs().max() > 0 and torch.isfinite(outs[True][1].float()).all()

@pytest.mark.gpu
def test_sparsevar_triton_and_torch_backends_keep_the_same_tokens():
    """keep_ratio fixes the counts; the kept sets come from the same change maps up to float32
    summation order, so they agree on all but near-tied tokens (at most 1 % here)."""
    _needs_gpu()
    from sparsevar import VARPipeline
    pipe = VARPipeline.from_random("var-tiny", device="cuda", dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    maps = {}
    for backend in ("torch", "triton"):
        pipe.enable_sparsevar(keep_ratio=0.4, start_scale=-3, backend=backend)
        out = pipe([1, 2], generator=torch.Generator("cuda").manual_seed(0), output_type="latent")
        maps[backend] = out.stats[0].token_maps
    assert maps["torch"].keys() == maps["triton"].keys() and maps["torch"]
    for si in maps["torch"]:
        kept_t = maps["torch"][si] >= 2
        kept_k = maps["triton"][si] >= 2
        assert kept_t.sum() == kept_k.sum()
        assert (kept_t != kept_k).float().mean() <= 0.01


@pytest.mark.gpu
def test_small_query_attention_uses_the_memory_efficient_kernel_and_matches_sdpa():
    _needs_gpu()
    from sparsevar.sparse_ops import attention as A
    g = torch.Generator(device="cuda").manual_seed(0)
    for l, Lk, want in ((1, 1, "sdpa-small"), (25, 55, "sdpa-small"), (36, 91, "sdpa-cudnn"), (256, 680, "sdpa-cudnn")):
        q = torch.randn(2, 30, l, 64, device="cuda", generator=g).to(torch.bfloat16)
        k, v = (torch.randn(2, 30, Lk, 64, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        name, why = A.choose_attention(q, k)
        assert name == want, (l, name, why)
        got = A.attention(q, k, v, 0.125)
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.125)
        assert (got.float() - ref).abs().max().item() < 2e-2                  # bf16 output, |v| ~ 1


@pytest.mark.gpu
@pytest.mark.parametrize("R, H, l, Lk, d", [(4, 4, 37, 300, 64), (2, 8, 1, 77, 128), (6, 2, 169, 680, 64)])
def test_varlen_attention_equals_masked_sdpa(R, H, l, Lk, d):
    """Tolerance: both run bf16 inputs with float32 softmax; flash varlen and SDPA's kernels sum in
    different orders, so outputs (|o| ≲ 1) differ by a few bf16 ulps: 2e-2 absolute."""
    _needs_gpu()
    from sparsevar.sparse_ops.attention import attention, choose_attention
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(R, H, n, d, device="cuda", generator=g).to(torch.bfloat16) for n in (l, Lk, Lk))
    valid = torch.rand(R, Lk, device="cuda", generator=g) < 0.7
    valid[:, 0] = True
    assert choose_attention(q, k, key_valid_RL=valid, backend="varlen")[0] == "varlen"
    got = attention(q, k, v, d ** -0.5, key_valid_RL=valid, backend="varlen")
    want = attention(q, k, v, d ** -0.5, key_valid_RL=valid)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)


# ---- the interpreter subprocess ----------------------------------------------------------------------
if __name__ == "__main__":
    if len(sys.argv) in (3, 4) and sys.argv[1] == "--interpret":
        assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (set before triton is imported)"
        torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) == 4 else max(1, min(2, os.cpu_count() or 1)))
        Path(sys.argv[2]).write_text(json.dumps(run_cases(sorted(CASES), "cpu"), indent=1))
    else:
        sys.exit(f"usage: TRITON_INTERPRET=1 {sys.argv[0]} --interpret RESULTS.json [THREADS]")
