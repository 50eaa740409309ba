"""Triton: VAR's φ latent update in one launch, twin of ``ref.phi_accumulate``.

Each scale of a VAR generation adds its upsampled residual ``h`` to the latent through the VQVAE's
φ: ``f_hat += (1 − r)·h + r·(conv3×3(h) + bias)``, in float32. In torch that is a cuDNN convolution
(on such small maps almost all of it ramp) and four elementwise launches. Here one program owns (a
block of pixels, a block of output channels, one image): it sums the nine taps as nine small
products (weights of the tap × the input channels at the shifted pixels, zero outside the map), adds
the bias, mixes with ``h`` and adds the result into ``f_hat``.

The products run in float32 (``input_precision="ieee"``: no TF32) and sum the taps and channels in
another order than cuDNN, so the two paths agree to float32 rounding, not bit for bit (on a
channels-last input cuDNN may run the convolution in TF32, torch's default for cuDNN). The tests
hold the kernel to the tolerance rule of ``tests/test_sparse_ops.py`` against a float64 oracle
computed on the CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _phi_kernel(h_ptr, w_ptr, b_ptr, f_ptr, keep, ratio, H, W,
                s_hb, s_hc, s_hy, s_hx, s_fb, s_fc, s_fy, s_fx,
                C: tl.constexpr, C_PAD: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_P: tl.constexpr):
    pb = tl.program_id(0)
    ob = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)                     # this program's pixels (row-major)
    p_ok = p < H * W
    y = p // W
    x = p % W
    o = ob * BLOCK_O + tl.arange(0, BLOCK_O)                     # its output channels
    o_ok = o < C
    i = tl.arange(0, C_PAD)                                      # input channels
    i_ok = i < C
    h_img = h_ptr + b * s_hb
    acc = tl.zeros((BLOCK_O, BLOCK_P), dtype=tl.float32)
    for t in tl.static_range(9):                                 # tap (dy, dx) = (t // 3 − 1, t % 3 − 1)
        yy = y + (t // 3 - 1)
        xx = x + (t % 3 - 1)
        inside = p_ok & (yy >= 0) & (yy < H) & (xx >= 0) & (xx < W)
        h_t = tl.load(h_img + i[:, None] * s_hc + yy[None, :] * s_hy + xx[None, :] * s_hx,
                      mask=i_ok[:, None] & inside[None, :], other=0.0).to(tl.float32)          # (C_PAD, BLOCK_P)
        w_t = tl.load(w_ptr + o[:, None] * (C * 9) + i[None, :] * 9 + t,
                      mask=o_ok[:, None] & i_ok[None, :], other=0.0).to(tl.float32)            # (BLOCK_O, C_PAD)
        acc = tl.dot(w_t, h_t, acc, input_precision="ieee")
    conv = acc + tl.load(b_ptr + o, mask=o_ok, other=0.0).to(tl.float32)[:, None]
    ok = o_ok[:, None] & p_ok[None, :]
    h_c = tl.load(h_img + o[:, None] * s_hc + y[None, :] * s_hy + x[None, :] * s_hx, mask=ok, other=0.0).to(tl.float32)
    f_ptrs = f_ptr + b * s_fb + o[:, None] * s_fc + y[None, :] * s_fy + x[None, :] * s_fx
    f = tl.load(f_ptrs, mask=ok, other=0.0)
    tl.store(f_ptrs, f + (h_c * keep + conv * ratio), mask=ok)


def launch_shape(C: int, HW: int) -> tuple[int, int, int]:
    """(padded channels, output-channel block, pixel block): ``tl.dot`` needs every side ≥ 16; blocks
    of 16 channels × 32 pixels give VAR's 32-channel 16 × 16 latent 16 programs per image."""
    c_pad = max(16, triton.next_power_of_2(C))
    return c_pad, min(c_pad, 16), 32 if HW >= 32 else 16


def phi_accumulate(h_BChw: torch.Tensor, weight_CC33: torch.Tensor, bias_C: torch.Tensor, ratio: float,
                   f_hat_BChw: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``ref.phi_accumulate``: ``f_hat += (1 − r)·h + r·(conv3×3(h) + bias)`` in place
    (``f_hat`` float32; ``h`` any float dtype and strides). Returns ``f_hat``."""
    B, C, H, W = h_BChw.shape
    assert weight_CC33.shape == (C, C, 3, 3) and bias_C.shape == (C,), (weight_CC33.shape, bias_C.shape, C)
    assert f_hat_BChw.shape == (B, C, H, W) and f_hat_BChw.dtype == torch.float32, (f_hat_BChw.shape, f_hat_BChw.dtype)
    assert h_BChw.data_ptr() != f_hat_BChw.data_ptr(), "h and f_hat must not share memory (f_hat is written)"
    if B == 0 or C == 0 or H * W == 0:
        return f_hat_BChw
    w = weight_CC33.contiguous()                                  # a no-op for a module's weight
    c_pad, block_o, block_p = launch_shape(C, H * W)
    _phi_kernel[(triton.cdiv(H * W, block_p), triton.cdiv(C, block_o), B)](
        h_BChw, w, bias_C, f_hat_BChw, 1.0 - ratio, ratio, H, W, *h_BChw.stride(), *f_hat_BChw.stride(),
        C=C, C_PAD=c_pad, BLOCK_O=block_o, BLOCK_P=block_p, num_warps=4)
    return f_hat_BChw
