"""Triton: a sub-layer's output projection, its gated residual and the next sub-layer's AdaLN input.
Twin of ``ref.linear_residual_norm_modulate``.

At VAR's first scales (a few rows) the output projections stream their weights, and they fill the
GPU only when the reduction is split (split-K: each split writes float32 partial sums). Unfused,
the splits are added by a reduction launch and the result is read again by the gated residual +
LayerNorm + AdaLN launch (``dense_fused.residual_norm_modulate``). Here the second launch adds the
splits itself, so a split costs no extra launch, and the projection may be split further (the
attention output's projection, K = C, is split too).

The sum of the splits plus the bias is rounded to the input dtype before it is used, exactly as
the unfused path rounds its product, so both paths give the same bits.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _gdc
from ._backend import dependent_launch, shared_memory, sm_count
from .dense_fused import _add_gated_store
from .gather_modulate import _launch_shape, _load_row, _norm_modulate_rows
from .gemm_rows import empty_rows
from .linear import LinearConfig, choose_config, partial_products

# the product's dtype (the unfused path rounds it to the input's dtype before the residual)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

# each split keeps at least this much of the reduction dimension (the splits cost no launch here);
# the best measured at VAR-d30's output projections (K = 1920 and 7680, 2–32 rows)
MIN_SPLIT_K = 512


@triton.jit
def _reduce_residual_norm_kernel(ws_ptr, b_ptr, x_ptr, g_ptr, mul_ptr, shift_ptr, xo_ptr, y_ptr, n, C, M, eps,
                                 s_xr, s_xl, s_gr, s_mr, s_sr, s_or, s_ol, s_yr, s_yl,
                                 SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BRANCH_DTYPE: tl.constexpr,
                                 RMS: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    _gdc.release_then_wait(PDL)
    r = tl.program_id(1).to(tl.int64)
    j = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    cm = c < C
    m2 = (j < n)[:, None] & cm[None, :]
    mul = _load_row(mul_ptr + r * s_mr, c, cm)
    shift = _load_row(shift_ptr + r * s_sr, c, cm)
    g = _load_row(g_ptr + r * s_gr, c, cm)
    ws_rows = ws_ptr + (r * n + j)[:, None] * C + c[None, :]             # rows of the (split, M, C) sums
    acc = tl.load(ws_rows, mask=m2, other=0.0)
    for s in tl.static_range(1, SPLIT_K):                                # fixed order: deterministic
        acc += tl.load(ws_rows + s * M * C, mask=m2, other=0.0)
    if HAS_BIAS:
        acc += _load_row(b_ptr, c, cm)[None, :]
    branch = acc.to(BRANCH_DTYPE).to(tl.float32)                         # the product, rounded as unfused
    x = tl.load(x_ptr + r * s_xr + j[:, None] * s_xl + c[None, :], mask=m2, other=0.0).to(tl.float32)
    x = _add_gated_store(x, branch, g, m2, xo_ptr + r * s_or + j[:, None] * s_ol + c[None, :])
    y = _norm_modulate_rows(x, m2, C, eps, mul, shift, RMS)
    tl.store(y_ptr + r * s_yr + j[:, None] * s_yl + c[None, :], y.to(y_ptr.dtype.element_ty), mask=m2)


def linear_residual_norm_modulate(h_RlK: torch.Tensor, weight_CK: torch.Tensor, bias_C: Optional[torch.Tensor],
                                  x_RlC: torch.Tensor, gate_R1C: torch.Tensor, mul_R1C: torch.Tensor,
                                  shift_R1C: torch.Tensor, eps: float, out_dtype: torch.dtype, rms: bool = False,
                                  config: Optional[LinearConfig] = None,
                                  pdl: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``ref.linear_residual_norm_modulate``: (x + gate·(h·wᵀ + b), LN(that)·mul + shift;
    RMSNorm with ``rms``).
    ``config`` overrides the product's launch shape (benchmarks), ``pdl`` where programmatic
    dependent launch is used (``_backend.dependent_launch``; tests)."""
    R, l, K = h_RlK.shape
    C = weight_CK.shape[0]
    assert x_RlC.shape == (R, l, C) and weight_CK.shape[1] == K, (h_RlK.shape, weight_CK.shape, x_RlC.shape)
    assert h_RlK.dtype == weight_CK.dtype, "the product's operands share one dtype"
    h_MK = h_RlK.reshape(R * l, K)                                       # (R, l, K) → (R·l, K)
    if h_MK.stride(-1) != 1:
        h_MK = h_MK.contiguous()
    w = weight_CK if weight_CK.stride(-1) == 1 else weight_CK.contiguous()
    if x_RlC.stride(-1) != 1:
        x_RlC = x_RlC.contiguous()
    if K == 0:                                                           # an empty product: the bias alone
        from . import ref
        return ref.linear_residual_norm_modulate(h_RlK, weight_CK, bias_C, x_RlC, gate_R1C, mul_R1C, shift_R1C, eps,
                                                 out_dtype, rms)
    xo = torch.empty_like(x_RlC, memory_format=torch.contiguous_format)
    y = empty_rows((R, l, C), dtype=out_dtype, device=x_RlC.device)      # spare rows: the next product may pad
    if R == 0 or l == 0 or C == 0:
        return xo, y
    if config is None:
        config = choose_config(R * l, C, K, sm_count(h_RlK.device), min_split_k=MIN_SPLIT_K, elem=h_RlK.element_size(),
                               limit=shared_memory(h_RlK.device))
    ws = partial_products(h_MK, w, config, pdl)
    mul_R1C, shift_R1C, gate_R1C = mul_R1C.expand(R, 1, C), shift_R1C.expand(R, 1, C), gate_R1C.expand(R, 1, C)
    for t in (mul_R1C, shift_R1C, gate_R1C):
        assert t.stride(-1) == 1, "modulation rows must be contiguous in C"
    block_c, rows, warps = _launch_shape(C, R * l)
    b = bias_C if bias_C is not None else h_MK                            # never read without HAS_BIAS
    pdl = dependent_launch(x_RlC.device, R * l, pdl)
    _reduce_residual_norm_kernel[(triton.cdiv(l, rows), R)](
        ws, b, x_RlC, gate_R1C, mul_R1C, shift_R1C, xo, y, l, C, R * l, float(eps),
        x_RlC.stride(0), x_RlC.stride(1), gate_R1C.stride(0), mul_R1C.stride(0), shift_R1C.stride(0),
        xo.stride(0), xo.stride(1), y.stride(0), y.stride(1),
        SPLIT_K=ws.shape[0], HAS_BIAS=bias_C is not None, BRANCH_DTYPE=_TL_DTYPES[h_RlK.dtype], RMS=rms, ROWS=rows,
        BLOCK_C=block_c, num_warps=warps, PDL=pdl, launch_pdl=pdl)
    return xo, y
