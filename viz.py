"""Token maps over the image (the SparseVAR paper's Figure 7): which tokens each pruned scale
computed, which it left out (zero residual), which copied an anchor, and the anchors.

    out = pipe(..., output_type="pil"); paths = save_token_maps(out.stats[0], out.images, "maps/")
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence, Union

import numpy as np
import PIL.Image
import PIL.ImageDraw
import torch

from .engine.state import GenerationStats
from .policies.sparsevar import TOKEN_ANCHOR, TOKEN_COPIED, TOKEN_EXCLUDED, TOKEN_KEPT

# role → (RGB tint, opacity): kept tokens stay as they are
ROLE_STYLE = {
    TOKEN_EXCLUDED: ((20, 20, 20), 0.70),
    TOKEN_COPIED: ((40, 90, 230), 0.45),
    TOKEN_KEPT: ((0, 0, 0), 0.0),
    TOKEN_ANCHOR: ((230, 40, 40), 0.80),
}
LEGEND_ITEMS = ("dark: excluded (zero residual)", "blue: copied from an anchor", "clear: computed", "red: anchors")
LEGEND = " · ".join(LEGEND_ITEMS)


def _as_rgb(image, size: int) -> np.ndarray:
    if image is None:
        return np.full((size, size, 3), 200, dtype=np.float32)
    if isinstance(image, torch.Tensor):                              # (3, H, W) in [0, 1]
        image = PIL.Image.fromarray((image.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255)
                                    .round().astype(np.uint8))
    if isinstance(image, np.ndarray):                                # (H, W, 3) in [0, 1]
        image = PIL.Image.fromarray((np.clip(image, 0, 1) * 255).round().astype(np.uint8))
    return np.asarray(image.convert("RGB").resize((size, size), PIL.Image.BICUBIC), dtype=np.float32)


def token_map_panel(roles_hw: torch.Tensor, image=None, size: int = 256) -> PIL.Image.Image:
    """One scale: the image (or grey) with every token tinted by its role."""
    h, w = roles_hw.shape
    base = _as_rgb(image, size)
    roles = roles_hw.to("cpu", torch.uint8).numpy()
    ys = (np.arange(size) * h // size)[:, None]
    xs = (np.arange(size) * w // size)[None, :]
    per_px = roles[ys, xs]                                           # (size, size) role of each pixel
    out = base.copy()
    for role, (rgb, alpha) in ROLE_STYLE.items():
        if alpha == 0.0:
            continue
        m = per_px == role
        out[m] = (1 - alpha) * base[m] + alpha * np.asarray(rgb, dtype=np.float32)
    return PIL.Image.fromarray(out.round().clip(0, 255).astype(np.uint8))


def _legend_lines(draw: PIL.ImageDraw.ImageDraw, max_width: float) -> list[str]:
    """The legend's items packed into as few lines as fit ``max_width`` pixels (one item per line at
    the least), measured in the font ``draw`` writes with."""
    lines: list[str] = []
    for item in LEGEND_ITEMS:
        if lines and draw.textlength(f"{lines[-1]} · {item}") <= max_width:
            lines[-1] = f"{lines[-1]} · {item}"
        else:
            lines.append(item)
    return lines


def token_map_figure(stats: GenerationStats, image=None, batch_index: int = 0, size: int = 192) -> PIL.Image.Image:
    """All pruned scales of one image side by side, each titled with its size and kept share, and the
    legend below them, wrapped to the figure's width. The layout depends only on the scales, not on
    the image, so the figures of one batch have one size."""
    if not stats.token_maps:
        raise ValueError("these stats hold no token maps: enable SparseVAR (pipe.enable_sparsevar()) and generate "
                         "again; token maps exist for the scales it pruned")
    scales = sorted(stats.token_maps)
    pad, title = 8, 18
    measure = PIL.ImageDraw.Draw(PIL.Image.new("RGB", (1, 1)))
    titles = {si: "scale {}: {}x{}, computed {{:.0%}}".format(si, *stats.token_maps[si].shape[-2:]) for si in scales}
    col = max([size] + [int(math.ceil(measure.textlength(t.format(1.0)))) for t in titles.values()])
    widest_item = max(int(math.ceil(measure.textlength(item))) for item in LEGEND_ITEMS)
    width = max(pad + len(scales) * (col + pad), widest_item + 2 * pad)
    lines = _legend_lines(measure, width - 2 * pad)
    left, top, right, bottom = measure.textbbox((0, 0), "Ag")
    line_h = bottom + 3
    fig = PIL.Image.new("RGB", (width, title + size + pad + len(lines) * line_h + pad), (255, 255, 255))
    draw = PIL.ImageDraw.Draw(fig)
    for j, si in enumerate(scales):
        roles = stats.token_maps[si][batch_index]
        kept = float((roles >= TOKEN_KEPT).float().mean())
        x0 = pad + j * (col + pad)
        fig.paste(token_map_panel(roles, image, size), (x0, title))
        draw.text((x0, 3), titles[si].format(kept), fill=(0, 0, 0))
    for i, line in enumerate(lines):
        draw.text((pad, title + size + pad + i * line_h), line, fill=(60, 60, 60))
    return fig


def token_map_images(stats: GenerationStats, images_BHWC: torch.Tensor) -> torch.Tensor:
    """The token-map figure of every image as a ComfyUI IMAGE batch, (B, H, W, 3) float in [0, 1]."""
    figs = [np.asarray(token_map_figure(stats, images_BHWC[b].permute(2, 0, 1), b), dtype=np.float32) / 255.0
            for b in range(images_BHWC.shape[0])]
    return torch.from_numpy(np.stack(figs))


def save_token_maps(stats: GenerationStats, images: Union[Sequence, torch.Tensor, None], out_dir,
                    prefix: str = "token_maps") -> list[Path]:
    """One PNG per image of the batch, ``{out_dir}/{prefix}_{b}.png``; returns the paths. Each file is
    written under a temporary name and renamed when whole; a failure leaves no temporary file."""
    out_dir = Path(out_dir)
    batch = next(iter(stats.token_maps.values())).shape[0] if stats.token_maps else 0
    if batch == 0:
        token_map_figure(stats)                                      # raises the explanatory error
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for b in range(batch):
        img = images[b] if images is not None else None
        path = out_dir / f"{prefix}_{b}.png"
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            token_map_figure(stats, img, b).save(tmp, format="PNG")
            tmp.replace(path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        paths.append(path)
    return paths
