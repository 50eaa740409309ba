"""Triton: gather a token subset → LayerNorm → AdaLN modulation into a packed buffer, and plain
row gather / scatter. Twins of ``ref.gather_norm_modulate``, ``ref.gather_rows``,
``ref.scatter_rows`` (same signatures).

One program handles ``ROWS`` rows of one batch row, each row held whole in registers (BLOCK_C ≥ C),
so every input byte is read once and every output byte written once: for a 2048-wide fp32 row
8 KiB in, 4 KiB (bf16) out. No atomics, no ``tl.dot``; bf16 only at load/store, so the kernels
run unchanged in Triton's CPU interpreter (research/kernels.md §4.2).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._backend import interpreting


# A row-wise LayerNorm launch over at most this many rows in all runs one row per program with 8
# warps (4 below 2048-wide rows): faster than two rows and 4 warps at 72–800 rows, as fast at
# 1360 and 2048 (benchmarks/results/README.md).
FEW_ROWS = 1024


def _launch_shape(C: int, rows_total: Optional[int] = None) -> tuple[int, int, int]:
    """(BLOCK_C, ROWS, num_warps): whole rows per program, about 4K elements per program on a GPU
    (16K in the interpreter, where fewer, larger programs run faster). A LayerNorm over
    ``rows_total`` ≤ ``FEW_ROWS`` rows on a GPU takes one row per program instead, so that more
    programs share the (latency-bound) launch."""
    block_c = triton.next_power_of_2(C)
    if rows_total is not None and rows_total <= FEW_ROWS and not interpreting():
        return block_c, 1, 8 if block_c >= 2048 else 4
    budget = 16384 if interpreting() else 4096
    rows = max(1, min(64, budget // block_c))
    num_warps = 4 if block_c * rows <= 4096 else 8
    return block_c, rows, num_warps


@triton.jit
def _norm_modulate_rows(xf, m2, C, eps, mul, shift, RMS: tl.constexpr):
    """LayerNorm (``RMS``: RMSNorm, no mean taken out) of every row of ``xf`` (ROWS, BLOCK_C) float32
    (masked columns ignored), then · ``mul`` + ``shift`` (float32 rows of BLOCK_C, from
    :func:`_load_row`): the float32 result. Shared with ``dense_fused`` and ``linear_residual``."""
    if RMS:
        xc = tl.where(m2, xf, 0.0)
    else:
        mean = tl.sum(xf, axis=1) / C
        xc = tl.where(m2, xf - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / C
    rstd = 1.0 / tl.sqrt(var + eps)
    return xc * rstd[:, None] * mul[None, :] + shift[None, :]


@triton.jit
def _load_row(row_ptr, c, cm):
    """One row of BLOCK_C parameters (a modulation, a gate, a bias) as float32.

    The norm kernels load these first, beside the rows they normalise, so that one memory round trip
    serves both and their latency does not come after the two reductions: at a few rows each of
    these launches is a chain of latencies on the layer's critical path."""
    return tl.load(row_ptr + c, mask=cm, other=0.0).to(tl.float32)


@triton.jit
def _gather_norm_mod_kernel(x_ptr, idx_ptr, mul_ptr, shift_ptr, y_ptr, xg_ptr,
                            n, C, eps,
                            stride_xr, stride_xl, stride_ir, stride_mr, stride_sr,
                            stride_yr, stride_yl, stride_gr, stride_gl,
                            HAS_IDX: tl.constexpr, NORM: tl.constexpr, WRITE_X: tl.constexpr,
                            ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(1).to(tl.int64)
    j = tl.program_id(0) * ROWS + tl.arange(0, ROWS)                 # packed slots
    jm = j < n
    if HAS_IDX:
        src = tl.load(idx_ptr + r * stride_ir + j, mask=jm, other=0).to(tl.int64)
    else:
        src = j.to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    cm = c < C
    m2 = jm[:, None] & cm[None, :]
    x = tl.load(x_ptr + r * stride_xr + src[:, None] * stride_xl + c[None, :], mask=m2, other=0.0)
    if NORM:
        mul = _load_row(mul_ptr + r * stride_mr, c, cm)
        shift = _load_row(shift_ptr + r * stride_sr, c, cm)
    if WRITE_X:
        tl.store(xg_ptr + r * stride_gr + j[:, None].to(tl.int64) * stride_gl + c[None, :], x, mask=m2)
    if NORM:
        y = _norm_modulate_rows(x.to(tl.float32), m2, C, eps, mul, shift, False)
        tl.store(y_ptr + r * stride_yr + j[:, None].to(tl.int64) * stride_yl + c[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _scatter_rows_kernel(y_ptr, idx_ptr, out_ptr, n, C,
                         stride_yr, stride_yl, stride_ir, stride_or, stride_ol,
                         ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(1).to(tl.int64)
    j = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    jm = j < n
    dst = tl.load(idx_ptr + r * stride_ir + j, mask=jm, other=0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    m2 = jm[:, None] & (c < C)[None, :]
    y = tl.load(y_ptr + r * stride_yr + j[:, None].to(tl.int64) * stride_yl + c[None, :], mask=m2, other=0.0)
    tl.store(out_ptr + r * stride_or + dst[:, None] * stride_ol + c[None, :], y.to(out_ptr.dtype.element_ty), mask=m2)


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _run_gather(x_RLC, idx_Rn, mul_R1C, shift_R1C, eps, out_dtype, norm: bool, write_x: bool):
    x_RLC = _rows_contiguous(x_RLC)
    R, L, C = x_RLC.shape
    if idx_Rn is not None:
        idx_Rn = idx_Rn if idx_Rn.stride(-1) == 1 else idx_Rn.contiguous()
    n = L if idx_Rn is None else idx_Rn.shape[1]
    dev = x_RLC.device
    y = torch.empty(R, n, C, device=dev, dtype=out_dtype) if norm else None
    xg = torch.empty(R, n, C, device=dev, dtype=x_RLC.dtype) if write_x else None
    if norm:
        mul_R1C = _rows_contiguous(mul_R1C.expand(R, 1, C))
        shift_R1C = _rows_contiguous(shift_R1C.expand(R, 1, C))
    if R == 0 or n == 0:
        return y, xg
    block_c, rows, num_warps = _launch_shape(C, R * n if norm else None)
    dummy = y if y is not None else xg
    _gather_norm_mod_kernel[(triton.cdiv(n, rows), R)](
        x_RLC, idx_Rn if idx_Rn is not None else dummy,
        mul_R1C if norm else dummy, shift_R1C if norm else dummy,
        y if norm else dummy, xg if write_x else dummy,
        n, C, float(eps),
        x_RLC.stride(0), x_RLC.stride(1), idx_Rn.stride(0) if idx_Rn is not None else 0,
        mul_R1C.stride(0) if norm else 0, shift_R1C.stride(0) if norm else 0,
        y.stride(0) if norm else 0, y.stride(1) if norm else 0,
        xg.stride(0) if write_x else 0, xg.stride(1) if write_x else 0,
        HAS_IDX=idx_Rn is not None, NORM=norm, WRITE_X=write_x, ROWS=rows, BLOCK_C=block_c, num_warps=num_warps)
    return y, xg


def gather_norm_modulate(x_RLC: torch.Tensor, idx_Rn: Optional[torch.Tensor], mul_R1C: torch.Tensor,
                         shift_R1C: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """Triton twin of ``ref.gather_norm_modulate``: (R, n, C) ``LN(x[idx])·mul + shift``."""
    y, _ = _run_gather(x_RLC, idx_Rn, mul_R1C, shift_R1C, eps, out_dtype, norm=True, write_x=False)
    return y


def gather_rows(x_RLC: torch.Tensor, idx_Rn: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``ref.gather_rows``: (R, n, C) rows ``idx_Rn`` of every batch row."""
    _, xg = _run_gather(x_RLC, idx_Rn, None, None, 0.0, x_RLC.dtype, norm=False, write_x=True)
    return xg


def scatter_rows(base_RLC: torch.Tensor, idx_Rn: torch.Tensor, y_RnC: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``ref.scatter_rows``: a copy of ``base_RLC`` with rows ``idx_Rn`` = ``y_RnC``."""
    out = base_RLC.clone(memory_format=torch.contiguous_format)
    R, L, C = out.shape
    n = idx_Rn.shape[1]
    if R == 0 or n == 0:
        return out
    y_RnC = _rows_contiguous(y_RnC)
    idx_Rn = idx_Rn if idx_Rn.stride(-1) == 1 else idx_Rn.contiguous()
    block_c, rows, num_warps = _launch_shape(C)
    _scatter_rows_kernel[(triton.cdiv(n, rows), R)](
        y_RnC, idx_Rn, out, n, C, y_RnC.stride(0), y_RnC.stride(1), idx_Rn.stride(0), out.stride(0), out.stride(1),
        ROWS=rows, BLOCK_C=block_c, num_warps=num_warps)
    return out
