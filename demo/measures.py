"""Picture measures the demo model is held to (``measure_demo``, the demo tests, ``bench quality``).

``strong_edge_fraction``: the share of pixels on a strong edge, where the summed absolute RGB
difference (0–255 units) to the right neighbour plus that to the neighbour below exceeds 120.
Rendered scenes have 0.6–5.6 % (median about 2 %); a picture that an autoencoder has softened
has almost none, which is what "acceleration has nothing to lose" looks like.

``corner_smudge_ratio``: the mean |gradient| in the top-left k×k pixels over that in the k×k
pixels to their right; clean pictures are near 1 (a noisy corner artefact reads 4–8).
"""
from __future__ import annotations

import torch

STRONG_EDGE_THRESHOLD = 120


def _check_images(images_B3HW: torch.Tensor, fn: str) -> None:
    if images_B3HW.ndim != 4 or images_B3HW.shape[1] != 3 or min(images_B3HW.shape[-2:]) < 2:
        raise ValueError(f"{fn}: images must be (B, 3, H, W) in [0, 1] with H, W >= 2, got shape "
                         f"{tuple(images_B3HW.shape)}")


def strong_edge_fraction(images_B3HW: torch.Tensor, threshold: float = STRONG_EDGE_THRESHOLD) -> torch.Tensor:
    """(B,) float64: per picture (RGB in [0, 1]) the share of pixels (all but the last row and
    column) whose |right − here| + |below − here|, summed over RGB in 0–255 units, is over
    ``threshold``. Pictures are rounded to 8 bits first, as they are saved."""
    _check_images(images_B3HW, "strong_edge_fraction")
    x = (images_B3HW.double().clamp(0, 1) * 255).round()
    right = (x[..., :-1, 1:] - x[..., :-1, :-1]).abs().sum(1)              # (B, H-1, W-1)
    below = (x[..., 1:, :-1] - x[..., :-1, :-1]).abs().sum(1)
    return ((right + below) > threshold).double().mean(dim=(1, 2))


def corner_smudge_ratio(images_B3HW: torch.Tensor, k: int = 12) -> torch.Tensor:
    """(B,) float64: mean |∂x| + |∂y| (forward differences, averaged over RGB) in the top-left k×k
    pixels over the same in the k×k pixels to their right."""
    _check_images(images_B3HW, "corner_smudge_ratio")
    if images_B3HW.shape[-1] < 2 * k + 1 or images_B3HW.shape[-2] < k + 1:
        raise ValueError(f"corner_smudge_ratio: k={k} needs pictures of at least {k + 1}×{2 * k + 1} px, got "
                         f"{tuple(images_B3HW.shape[-2:])}")
    x = images_B3HW.double()
    g = (x[..., :-1, 1:] - x[..., :-1, :-1]).abs() + (x[..., 1:, :-1] - x[..., :-1, :-1]).abs()
    return g[..., :k, :k].mean(dim=(1, 2, 3)) / g[..., :k, k:2 * k].mean(dim=(1, 2, 3)).clamp(min=1e-12)
