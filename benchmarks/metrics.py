"""Full-reference image metrics for the quality harness (``bench_quality``), in plain torch.

Both take two image batches ``(B, C, H, W)`` of the same shape with values in ``[0, data_range]``
(pipelines' ``output_type="pt"`` gives RGB in [0, 1]) and return one value per image, ``(B,)``
float64, on the inputs' device.

- :func:`psnr`: ``10 · log10(data_range² / MSE)`` over all channels and pixels. Identical images
  have MSE 0 and give ``+inf`` (not capped: callers that must plot or average decide what to do).
- :func:`ssim`: the structural similarity of Wang et al. (2004) with its standard constants —
  an 11×11 Gaussian window with σ = 1.5, K1 = 0.01, K2 = 0.03 — evaluated on every colour
  channel separately and averaged over the channels (the per-channel mean, not luma), over the
  "valid" window positions only (no padding; the reference implementation's choice). Identical
  images give exactly 1.

Over seeds, :func:`mean_ci95` gives a mean and the half-width of its 95 % Student-t interval
(:func:`t_quantile` computes the quantile exactly for integer degrees of freedom).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_K1 = 0.01
SSIM_K2 = 0.03


def _check_pair(a: torch.Tensor, b: torch.Tensor, fn: str, data_range: float) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}({name}=...) takes a (B, C, H, W) tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{fn}({name}=...) takes a (B, C, H, W) image batch, got shape {tuple(t.shape)}; "
                             f"add a batch dimension with {name}[None] for a single image")
    if a.shape != b.shape:
        raise ValueError(f"{fn}: a and b must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if isinstance(data_range, bool) or not isinstance(data_range, (int, float)) or not data_range > 0:
        raise ValueError(f"{fn}(data_range={data_range!r}): the value range of the images must be a number > 0 "
                         f"(1.0 for images in [0, 1], 255 for 8-bit)")


def mse(a_BCHW: torch.Tensor, b_BCHW: torch.Tensor) -> torch.Tensor:
    """(B,) float64 mean squared error per image."""
    _check_pair(a_BCHW, b_BCHW, "mse", 1.0)
    d_BCHW = a_BCHW.double() - b_BCHW.double()
    return d_BCHW.pow(2).flatten(1).mean(dim=1)


def psnr(a_BCHW: torch.Tensor, b_BCHW: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """(B,) float64 peak signal-to-noise ratio in dB; ``+inf`` where the images are identical."""
    _check_pair(a_BCHW, b_BCHW, "psnr", data_range)
    err_B = mse(a_BCHW, b_BCHW)
    # err 0 → log10(0) = -inf → +inf dB, without a division warning
    return 10.0 * (2.0 * torch.log10(torch.tensor(float(data_range), dtype=torch.float64,
                                                  device=err_B.device)) - torch.log10(err_B))


def gaussian_window(size: int = SSIM_WINDOW, sigma: float = SSIM_SIGMA, device=None) -> torch.Tensor:
    """(size,) float64 normalised 1-D Gaussian; the 2-D window is its outer product."""
    x_K = torch.arange(size, dtype=torch.float64, device=device) - (size - 1) / 2.0
    g_K = torch.exp(-(x_K ** 2) / (2.0 * sigma ** 2))
    return g_K / g_K.sum()


def _filter(x_NHW: torch.Tensor, g_K: torch.Tensor) -> torch.Tensor:
    """Separable Gaussian filter, "valid" positions: (N, H, W) → (N, H−K+1, W−K+1)."""
    K = g_K.shape[0]
    x_N1HW = x_NHW[:, None]
    x_N1HW = F.conv2d(x_N1HW, g_K.view(1, 1, K, 1))                    # along H
    x_N1HW = F.conv2d(x_N1HW, g_K.view(1, 1, 1, K))                    # along W
    return x_N1HW[:, 0]


def ssim(a_BCHW: torch.Tensor, b_BCHW: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """(B,) float64 SSIM per image: the mean SSIM map of each channel, averaged over channels.

    Needs H, W ≥ 11 (the window). 1 for identical images; decreases towards 0 (can go below for
    anti-correlated content) as they differ.
    """
    _check_pair(a_BCHW, b_BCHW, "ssim", data_range)
    B, C, H, W = a_BCHW.shape
    if H < SSIM_WINDOW or W < SSIM_WINDOW:
        raise ValueError(f"ssim needs images of at least {SSIM_WINDOW}×{SSIM_WINDOW} pixels (the Gaussian "
                         f"window), got {H}×{W}; use psnr for smaller images")
    g_K = gaussian_window(device=a_BCHW.device)
    x_NHW = a_BCHW.double().reshape(B * C, H, W)                          # (B, C, H, W) → (B·C, H, W)
    y_NHW = b_BCHW.double().reshape(B * C, H, W)
    c1 = (SSIM_K1 * data_range) ** 2
    c2 = (SSIM_K2 * data_range) ** 2
    mu_x = _filter(x_NHW, g_K)
    mu_y = _filter(y_NHW, g_K)
    var_x = _filter(x_NHW * x_NHW, g_K) - mu_x * mu_x
    var_y = _filter(y_NHW * y_NHW, g_K) - mu_y * mu_y
    cov_xy = _filter(x_NHW * y_NHW, g_K) - mu_x * mu_y
    num = (2.0 * mu_x * mu_y + c1) * (2.0 * cov_xy + c2)
    den = (mu_x * mu_x + mu_y * mu_y + c1) * (var_x + var_y + c2)
    map_Nhw = num / den
    return map_Nhw.flatten(1).mean(dim=1).view(B, C).mean(dim=1)      # (B·C,) → (B, C) → (B,)


def _t_two_sided(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with ``df`` degrees of freedom (Abramowitz & Stegun 26.7.3-4:
    a finite series in θ = atan(t / √df) for integer df)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:                              # odd: 2/π (θ + sinθ cosθ (1 + 2/3 cos²θ + 2·4/(3·5) cos⁴θ …))
        term, total = 1.0, 0.0
        for k in range(1, (df - 1) // 2 + 1):
            total += term
            term *= c2 * (2 * k) / (2 * k + 1)
        return 2.0 / math.pi * (theta + s * math.cos(theta) * total) if df > 1 else 2.0 / math.pi * theta
    term, total = 1.0, 0.0                  # even: sinθ (1 + 1/2 cos²θ + 1·3/(2·4) cos⁴θ + …)
    for k in range(1, df // 2 + 1):
        total += term
        term *= c2 * (2 * k - 1) / (2 * k)
    return s * total


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (0.5 <= p < 1) of Student's t with ``df`` >= 1 degrees of freedom, to about
    1e-12 relative (bisection on the exact distribution function)."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"t_quantile(df={df!r}): the degrees of freedom must be an int >= 1")
    if not 0.5 <= p < 1.0:
        raise ValueError(f"t_quantile(p={p!r}): give a probability in [0.5, 1), e.g. 0.975 for a 95 % interval")
    target = 2.0 * p - 1.0                  # P(|T| <= t)
    lo, hi = 0.0, 1.0
    while _t_two_sided(hi, df) < target:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _t_two_sided(mid, df) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return 0.5 * (lo + hi)


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of its 95 % Student-t interval: t(0.975, n − 1) · s / √n, s the sample
    standard deviation) of per-seed values. The half-width is nan for fewer than two values or when
    any value is infinite (the mean is then ±inf or nan)."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("mean_ci95(values=[]): give at least one value")
    n = len(xs)
    mean = math.fsum(xs) / n if all(math.isfinite(x) for x in xs) else sum(xs) / n
    if n < 2 or not all(math.isfinite(x) for x in xs):
        return mean, math.nan
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    return mean, t_quantile(0.975, n - 1) * sd / math.sqrt(n)


__all__ = ["gaussian_window", "mean_ci95", "mse", "psnr", "ssim", "t_quantile"]
