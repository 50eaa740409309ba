"""Triton: ``y = x @ wᵀ + b`` (optionally tanh-GELU) for the token counts a VAR-family sampler
runs at, twin of ``ref.linear``.

Why a GEMM of our own: a next-scale sampler multiplies every weight matrix by a few to a few
thousand rows. At 2–128 rows the product is bound by streaming the weights, and at a few hundred to
a few thousand rows a (1920 or 2048)-wide output makes so few 128×256 tiles that most of the GPU
idles under cuBLAS. This kernel takes its tile shape and its split of the reduction dimension
(split-K) from the shape, so every scale fills the GPU.

Split-K is deterministic: each split writes float32 partial sums to its own slice of a workspace
and a second kernel adds them in a fixed order (then the bias and the activation), so the same
inputs always give the same bits — no atomics.

``tl.dot`` on bf16 is wrong in Triton's CPU interpreter (triton#11584), so there the operands are
cast to float32 first (``UPCAST``); float32 operands use IEEE precision (no TF32).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import _gdc
from ._backend import dependent_launch, fit_stages, interpreting, shared_memory, sm_count

# Under programmatic dependent launch (``_gdc``) a program asks L2 for its first PREFETCH_STEPS
# reduction steps of weights before it waits for the previous kernel (2: the fastest of the counts
# measured, benchmarks/results/README.md)
PREFETCH_STEPS = 2
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


class LinearConfig(NamedTuple):
    """One launch shape: tile rows × columns × reduction step, reduction splits, warps, stages."""
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _gelu_tanh(x):
    u = _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    t = 2.0 * tl.sigmoid(2.0 * u) - 1.0                                  # tanh(u)
    return 0.5 * x * (1.0 + t)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_ym, stride_ys,
                   HAS_BIAS: tl.constexpr, GELU: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr, PF_LINES: tl.constexpr, LINE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    if PF_LINES > 0:                         # a hint that returns no data: safe before the wait
        k_line = tl.arange(0, PF_LINES) * LINE
        ok = (offs_n[:, None] < N) & ((k_lo + k_line)[None, :] < K) & (k_line[None, :] < k_per_split)
        _gdc.prefetch_l2(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_lo + k_line)[None, :], ok)
    _gdc.wait(PDL)
    if HAS_BIAS:                             # before the loop, not after it: its latency hides there
        bias_n = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    mask_m = offs_m[:, None] < M
    mask_n = offs_n[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=mask_m, other=0.0)
            b = tl.load(w_ptrs, mask=mask_n, other=0.0)
        else:
            in_k = (k_lo + k + offs_k)[None, :] < K
            a = tl.load(x_ptrs, mask=mask_m & in_k, other=0.0)
            b = tl.load(w_ptrs, mask=mask_n & in_k, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _gdc.release(PDL)                        # the next (short) kernel is set up while this one stores
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if PARTIAL:                                                          # float32 partial sums of this split
        ws_ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(ws_ptrs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += bias_n[None, :]
        if GELU:
            acc = _gelu_tanh(acc)
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, b_ptr, y_ptr, M, N, stride_ys, stride_ym, SPLIT_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, GELU: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _gdc.release_then_wait(PDL)
    pid_m = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs_n < N
    acc = tl.load(ws_ptr + pid_m * N + offs_n, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):                                # fixed order: deterministic
        acc += tl.load(ws_ptr + s * stride_ys + pid_m * N + offs_n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        acc = _gelu_tanh(acc)
    tl.store(y_ptr + pid_m * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, triton.next_power_of_2(n))


def choose_config(M: int, N: int, K: int, num_sms: int, min_split_k: int = 1024, elem: int = 2,
                  limit: Optional[int] = None) -> LinearConfig:
    """The launch shape for an (M × K) · (K × N) product of ``elem``-byte operands on a GPU with
    ``num_sms`` SMs and ``limit`` bytes of shared memory a program (``_backend.shared_memory``; a
    shape whose pipelined tiles do not fit gets fewer stages, then shorter reduction steps).

    Few rows: the product streams the weights, so tiles are narrow (many programs in flight). The
    reduction is split while the output tiles cannot fill the SMs once and each split keeps at
    least ``min_split_k`` of the reduction dimension (lower where the consumer adds the splits, so
    that no reduction launch is paid for them: ``linear_residual``)."""
    if interpreting():
        return LinearConfig(16, 32, 32, 1 if K <= 64 else 2, 4, 1)
    if M <= 64:
        return _fit(_few_rows_config(M, N, K, num_sms, min_split_k), elem, limit)
    if M <= 256:
        block_m, block_n, block_k, warps, stages = 64, 128, 64, 4, 4
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, 64, 8, 3
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    return _fit(LinearConfig(block_m, block_n, block_k, _splits(tiles, K, num_sms, min_split_k), warps, stages),
                elem, limit)


def _fit(config: LinearConfig, elem: int, limit: Optional[int]) -> LinearConfig:
    """``config`` with fewer stages, then shorter reduction steps, where its pipelined x and weight
    tiles do not fit in ``limit`` bytes of shared memory."""
    block_k = config.block_k
    while True:
        stages = fit_stages(config.num_stages, 0, elem * (config.block_m + config.block_n) * block_k, limit)
        if stages is not None or block_k == 16:
            return config._replace(block_k=block_k, num_stages=stages or 1)
        block_k //= 2


def _splits(tiles: int, K: int, fill: float, min_split_k: int) -> int:
    """Reduction splits (a power of two ≤ 16): doubled while ``tiles`` × splits < ``fill`` programs and
    each split keeps at least ``min_split_k`` of ``K``."""
    split = 1
    while tiles * split < fill and K // (2 * split) >= min_split_k and split < 16:
        split *= 2
    return split


def _few_rows_config(M: int, N: int, K: int, num_sms: int, min_split_k: int) -> LinearConfig:
    """The launch shape at 1–64 rows, where the product streams its weights: 128-deep reduction
    steps five stages deep, 4 warps, and as many programs as keep the SMs streaming.

    - Up to 32 rows (row tiles of 16 or 32): 32-wide tiles, split-K while the tiles cannot fill the
      SMs once.
    - 33–64 rows (row tiles of 64): 64-wide tiles, so that each program reads its rows of ``x`` once
      per 64 output columns rather than 32 (at 32 columns the re-reads of ``x`` outweigh the
      weights), split-K while the tiles fill less than 90 % of the SMs; where even so fewer than
      60 % of the SMs would work, 32-wide tiles as above.

    Each choice is level with or faster than the other tile width at VAR-d30's products
    (benchmarks/results/README.md)."""
    block_m = _pow2_at_least(M, 16)
    if block_m == 64:
        tiles = triton.cdiv(N, 64)
        split = _splits(tiles, K, 0.9 * num_sms, min_split_k)
        if tiles * split >= 0.6 * num_sms:
            return LinearConfig(64, 64, 128, split, 4, 5)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, 32)
    return LinearConfig(block_m, 32, 128, _splits(tiles, K, num_sms, min_split_k), 4, 5)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, gelu: bool = False,
           config: Optional[LinearConfig] = None, pdl: Optional[bool] = None) -> torch.Tensor:
    """Triton twin of ``ref.linear``: ``x`` (…, K) times ``weight`` (N, K) transposed, plus ``bias``
    (N,), then tanh-GELU when ``gelu``; output in ``x``'s dtype. ``config`` overrides the launch
    shape (benchmarks); by default ``choose_config`` picks it from the shape. ``pdl`` overrides
    where programmatic dependent launch is used (``_backend.dependent_launch``; tests)."""
    *lead, K = x.shape
    N = weight.shape[0]
    x2 = x.reshape(-1, K)                                                # (…, K) → (M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return y.view(*lead, N)
    if K == 0:
        y.zero_()
        if bias is not None:
            y += bias
        return torch.nn.functional.gelu(y, approximate="tanh").view(*lead, N) if gelu else y.view(*lead, N)
    if config is None:
        config = choose_config(M, N, K, sm_count(x.device), elem=x.element_size(), limit=shared_memory(x.device))
    k_per_split, split = _k_split(K, config)
    if split == 1:
        _launch(x2, w, bias, y, y.stride(0), 0, config, k_per_split, 1, gelu, partial=False, pdl=pdl)
        return y.view(*lead, N)
    ws = partial_products(x2, w, config, pdl)
    b = bias if bias is not None else y                                  # never read without HAS_BIAS
    block = min(1024, triton.next_power_of_2(N))
    pdl = dependent_launch(x.device, M, pdl)
    _splitk_reduce_kernel[(triton.cdiv(N, block), M)](ws, b, y, M, N, M * N, y.stride(0), SPLIT_K=split,
                                                       HAS_BIAS=bias is not None, GELU=gelu, BLOCK=block,
                                                       PDL=pdl, launch_pdl=pdl)
    return y.view(*lead, N)


def _k_split(K: int, config: LinearConfig) -> tuple[int, int]:
    """(reduction length per split, number of splits) of ``config`` for a reduction of ``K``: each
    split a whole number of ``block_k`` steps, so the last may be short and fewer splits result."""
    k_per_split = triton.cdiv(triton.cdiv(K, config.split_k), config.block_k) * config.block_k
    return k_per_split, triton.cdiv(K, k_per_split)


def _launch(x_MK, w_NK, bias, out, stride_o, stride_s, config, k_per_split, split, gelu, partial, pdl=None):
    """One launch of ``_linear_kernel``: the finished product into ``out`` (M, N), or with ``partial``
    the float32 sums of each split into ``out`` (splits, M, N)."""
    M, K = x_MK.shape
    N = w_NK.shape[0]
    bm, bn, bk, _, warps, stages = config
    upcast = interpreting() and x_MK.dtype not in (torch.float32, torch.float64)
    precision = "ieee" if x_MK.dtype == torch.float32 else None           # float32: no TF32
    b = bias if bias is not None else out                                # never read without HAS_BIAS
    pdl = dependent_launch(x_MK.device, M, pdl)
    line = 128 // w_NK.element_size()                                    # elements per 128-byte line
    _linear_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm), split)](
        x_MK, w_NK, b, out, M, N, K, k_per_split, x_MK.stride(0), w_NK.stride(0), stride_o, stride_s,
        HAS_BIAS=bias is not None and not partial, GELU=gelu and not partial, PARTIAL=partial,
        EVEN_K=K % k_per_split == 0, UPCAST=upcast, PRECISION=precision,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl, PF_LINES=max(1, PREFETCH_STEPS * bk // line) if pdl else 0,
        LINE=line, num_warps=warps, num_stages=stages, launch_pdl=pdl)


def partial_products(x_MK: torch.Tensor, weight_NK: torch.Tensor, config: LinearConfig,
                     pdl: Optional[bool] = None) -> torch.Tensor:
    """float32 partial sums (splits, M, N) of ``x_MK · weight_NKᵀ``, one slice per split of K (the
    first step of a split-K product; the caller adds the slices in order). ``x_MK`` and the weight
    rows must be contiguous in K."""
    M, K = x_MK.shape
    N = weight_NK.shape[0]
    k_per_split, split = _k_split(K, config)
    ws = torch.empty(split, M, N, device=x_MK.device, dtype=torch.float32)
    _launch(x_MK, weight_NK, None, ws, N, M * N, config, k_per_split, split, False, partial=True, pdl=pdl)
    return ws
