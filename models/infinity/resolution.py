"""Infinity's output sizes and positions: the official h/w templates and their scale schedules,
the resolution a (height, width) maps to, and the 2-D RoPE and level embedding indices of a schedule."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ...engine.schedule import ScaleSchedule

VAE_STRIDE = 16                       # pixels per transformer token (also with the 8B's 8-px VAE + 2×2 patchify)

# ---- resolutions: the official h/w templates (infinity/utils/dynamic_resolution.py) ----------------
# Token map (h, w) of each of the 13 scales of the 1M schedule per h/w ratio; the wide ratios are the
# transposes, keyed by int(1000 / ratio) / 1000 like the reference. 0.06M / 0.25M / 0.60M are the
# first 7 / 10 / 12 scales. Images use one frame per scale.
_TALL_TEMPLATES: dict[float, tuple[tuple[int, int], ...]] = {
    1.000: ((1, 1), (2, 2), (4, 4), (6, 6), (8, 8), (12, 12), (16, 16), (20, 20), (24, 24), (32, 32), (40, 40),
            (48, 48), (64, 64)),
    1.250: ((1, 1), (2, 2), (3, 3), (5, 4), (10, 8), (15, 12), (20, 16), (25, 20), (30, 24), (35, 28), (45, 36),
            (55, 44), (70, 56)),
    1.333: ((1, 1), (2, 2), (4, 3), (8, 6), (12, 9), (16, 12), (20, 15), (24, 18), (28, 21), (36, 27), (48, 36),
            (60, 45), (72, 54)),
    1.500: ((1, 1), (2, 2), (3, 2), (6, 4), (9, 6), (15, 10), (21, 14), (27, 18), (33, 22), (39, 26), (48, 32),
            (63, 42), (78, 52)),
    1.750: ((1, 1), (2, 2), (3, 3), (7, 4), (11, 6), (14, 8), (21, 12), (28, 16), (35, 20), (42, 24), (56, 32),
            (70, 40), (84, 48)),
    2.000: ((1, 1), (2, 2), (4, 2), (6, 3), (10, 5), (16, 8), (22, 11), (30, 15), (38, 19), (46, 23), (60, 30),
            (74, 37), (90, 45)),
    2.500: ((1, 1), (2, 2), (5, 2), (10, 4), (15, 6), (20, 8), (25, 10), (30, 12), (40, 16), (50, 20), (65, 26),
            (80, 32), (100, 40)),
    3.000: ((1, 1), (2, 2), (6, 2), (9, 3), (15, 5), (21, 7), (27, 9), (36, 12), (45, 15), (54, 18), (72, 24),
            (90, 30), (111, 37)),
}
PN_SCALES: dict[str, int] = {"0.06M": 7, "0.25M": 10, "0.60M": 12, "1M": 13}
TRAINED_SCALES = 13                   # scales the released models were trained on (level embeddings 0..12)

# Zero-shot sizes beyond the trained ones (FastVAR's 2K extension). Its schedule is unpublished
# (FastVAR issue #9), so ours is stated here: the 1M template followed by 1.5× and 2× its final map
# (1:1 → 96×96 and 128×128 tokens = 2048 × 2048 px). The added scales reuse the last trained level
# embedding, and RoPE positions stay scaled to the 1M final grid (the official rule for every size),
# so the model sees only positions and levels it was trained on.
ZERO_SHOT_PN: dict[str, tuple[float, ...]] = {"4M": (1.5, 2.0)}


def _all_templates() -> dict[float, tuple[tuple[int, int], ...]]:
    out = {}
    for ratio, hws in _TALL_TEMPLATES.items():
        out[ratio] = hws
        if ratio != 1.0:
            out[int(1000 / ratio) / 1000] = tuple((w, h) for h, w in hws)
    return out


INFINITY_TEMPLATES: dict[float, tuple[tuple[int, int], ...]] = _all_templates()


@dataclass(frozen=True)
class InfinityResolution:
    """One output size: the template it comes from and its token schedule.

    h_div_w: the template's h/w key (1.0, 0.75, 1.333, ...); pn: "0.06M", "0.25M", "0.60M" or "1M"
    (official), or a zero-shot size of ``ZERO_SHOT_PN`` ("4M");
    hw: (h, w) token map of every scale; rope_grid: the final (h, w) of the template's 1M schedule,
    to which RoPE positions are scaled whatever the output size.
    """

    h_div_w: float
    pn: str
    hw: tuple[tuple[int, int], ...]
    rope_grid: tuple[int, int]

    @property
    def schedule(self) -> ScaleSchedule:
        return ScaleSchedule(self.hw)

    @property
    def height(self) -> int:
        return VAE_STRIDE * self.hw[-1][0]

    @property
    def width(self) -> int:
        return VAE_STRIDE * self.hw[-1][1]

    def __str__(self) -> str:
        return f"{self.height}x{self.width}"


def infinity_resolution(h_div_w: float, pn: str = "1M") -> InfinityResolution:
    """The schedule of template ``h_div_w`` (nearest template) at size ``pn``: an official size
    (``PN_SCALES``) or a zero-shot one (``ZERO_SHOT_PN``)."""
    if pn not in PN_SCALES and pn not in ZERO_SHOT_PN:
        raise ValueError(f"pn={pn!r} is not an Infinity size; choose one of {list(PN_SCALES)} "
                         f"(or the zero-shot {list(ZERO_SHOT_PN)})")
    key = min(INFINITY_TEMPLATES, key=lambda r: abs(r - float(h_div_w)))
    hws = INFINITY_TEMPLATES[key]
    if pn in ZERO_SHOT_PN:
        (h, w) = hws[-1]
        extra = tuple((round(f * h), round(f * w)) for f in ZERO_SHOT_PN[pn])
        return InfinityResolution(key, pn, hws + extra, hws[-1])
    return InfinityResolution(key, pn, hws[:PN_SCALES[pn]], hws[-1])


def zero_shot_resolutions() -> list[InfinityResolution]:
    """Every zero-shot size (15 aspect ratios × ``ZERO_SHOT_PN``): beyond what the models were trained on."""
    return [infinity_resolution(r, pn) for r in INFINITY_TEMPLATES for pn in ZERO_SHOT_PN]


def infinity_resolutions() -> list[InfinityResolution]:
    """Every official size (15 aspect ratios × 4 sizes)."""
    return [infinity_resolution(r, pn) for r in INFINITY_TEMPLATES for pn in PN_SCALES]


def _exact_sizes() -> dict[tuple[int, int], InfinityResolution]:
    """(height, width) in pixels → the schedule producing exactly that size: an official one before a
    zero-shot one, and of several the template nearest the size's own aspect ratio (the first in
    template order on a tie)."""
    table: dict[tuple[int, int], InfinityResolution] = {}
    for sizes in (infinity_resolutions(), zero_shot_resolutions()):
        found: dict[tuple[int, int], list[InfinityResolution]] = {}
        for r in sizes:
            found.setdefault((r.height, r.width), []).append(r)
        for (h, w), rs in found.items():
            table.setdefault((h, w), min(rs, key=lambda r: abs(r.h_div_w - h / w)))
    return table


EXACT_SIZES = _exact_sizes()                 # a constant of the templates, made once at import


def resolve_resolution(height: int, width: int) -> InfinityResolution:
    """The official schedule producing exactly ``height`` × ``width`` pixels (``EXACT_SIZES``), or a
    ValueError listing the sizes of the nearest aspect ratio."""
    for h, name in ((height, "height"), (width, "width")):
        if isinstance(h, bool) or not isinstance(h, int) or h <= 0:
            raise ValueError(f"{name} must be a positive int number of pixels, got {h!r}")
    exact = EXACT_SIZES.get((height, width))
    if exact is not None:
        return exact
    near = infinity_resolution(height / width)
    sizes = ", ".join(f"{r.height}x{r.width}" for r in (infinity_resolution(near.h_div_w, pn) for pn in PN_SCALES))
    zs = ", ".join(f"{r.height}x{r.width}" for r in (infinity_resolution(near.h_div_w, pn) for pn in ZERO_SHOT_PN))
    raise ValueError(f"height={height}, width={width} is not an Infinity size: the model only generates the sizes "
                     f"of its aspect-ratio templates. For h/w ≈ {near.h_div_w} use one of {sizes} (height x width), "
                     f"or zero-shot {zs} (beyond the trained scales)")


DEFAULT_RESOLUTION = infinity_resolution(1.0, "1M")


# ---- RoPE ---------------------------------------------------------------------------------------------
def rope_positions(hw: Sequence[tuple[int, int]], rope_grid: tuple[int, int]) -> torch.Tensor:
    """(L, 2) int64 (row, column) RoPE position of every token of the schedule: integer grid positions
    scaled to ``rope_grid`` and rounded half to even (the reference's float32 ``.round()``)."""
    uh, uw = rope_grid
    out = []
    for h, w in hw:
        # the clamp acts only on maps finer than the grid (zero-shot sizes), where the last row would round up to uh
        rows = (torch.arange(h) * (uh / h)).round().long().clamp_max(uh - 1)
        cols = (torch.arange(w) * (uw / w)).round().long().clamp_max(uw - 1)
        out.append(torch.stack((rows.view(h, 1).expand(h, w), cols.view(1, w).expand(h, w)), dim=-1).reshape(h * w, 2))
    return torch.cat(out)


def rope_cos_sin(hw: Sequence[tuple[int, int]], rope_grid: tuple[int, int], head_dim: int,
                 base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (L, head_dim/2) float32 of the angle rotating channel pair p of every token: pairs
    p < head_dim/4 by row·θ_p, the others by column·θ_(p − head_dim/4), θ_i = base^(−4i/head_dim)."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs a head width divisible by 4, got {head_dim}")
    half = head_dim // 2
    inv_freq = 1.0 / (base ** (torch.arange(0, half, 2, dtype=torch.int64).float() / half))    # (hd/4,)
    pos_L2 = rope_positions(hw, rope_grid).float()
    angle_LD = torch.cat((pos_L2[:, :1] * inv_freq, pos_L2[:, 1:] * inv_freq), dim=-1)      # (L, hd/2)
    return torch.cos(angle_LD), torch.sin(angle_LD)


def level(si: int) -> int:
    """The level-embedding row of scale ``si``: zero-shot scales past the trained ones reuse the last."""
    return min(si, TRAINED_SCALES - 1)


def level_index(hw: Sequence[tuple[int, int]], device=None) -> torch.Tensor:
    counts = torch.tensor([h * w for h, w in hw])
    levels = torch.tensor([level(si) for si in range(len(hw))])
    return torch.repeat_interleave(levels, counts).to(device)


def rope_at(cos_LD: torch.Tensor, sin_LD: torch.Tensor, pos: torch.Tensor):
    """cos, sin of positions (l,) → (1, l, 1, D) or (R, n) → (R, n, 1, D)."""
    if pos.ndim == 1:
        return cos_LD[pos][None, :, None], sin_LD[pos][None, :, None]
    return cos_LD[pos][:, :, None], sin_LD[pos][:, :, None]
