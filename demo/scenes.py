"""Procedural class-conditional scenes: the demo model's training data.

Every image is one object of a class (built from primitives: discs, boxes, convex polygons) with a
texture (flat, stripes, checks or dots) and often an outline, on a smooth background (a two-colour
gradient plus large soft blobs). Colours, positions, sizes, rotations and textures are random. The
result has what SparseVAR exploits: large low-frequency regions (background, flat fills) next to
sharp edges and fine texture.

Rendering is vectorised over a batch with signed distances on a pixel grid, anti-aliased over one
pixel, and deterministic: the same seed (generator), labels, size and device give the same images.

    >>> imgs_B3HW = render_scenes(torch.tensor([0, 7]), torch.Generator().manual_seed(0))
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

CLASS_NAMES: tuple[str, ...] = (
    "disc", "box", "triangle", "star", "ring", "cross", "crescent", "house",
    "tree", "flower", "car", "fish",
)
NUM_CLASSES = len(CLASS_NAMES)

# Per-sample random numbers drawn up front (fixed order → deterministic for a seed).
_NUM_PARAMS = 128


@dataclass(frozen=True)
class SceneConfig:
    """How scenes look.

    size: image side in pixels (the demo model is trained at 256).
    min_scale, max_scale: object radius as a fraction of the image side.
    outline_prob: chance of a dark or light outline around each object part.
    texture_probs: chances of (flat, stripes, checks, dots) fills.
    blobs: soft background blobs per image.
    """

    size: int = 256
    min_scale: float = 0.22
    max_scale: float = 0.38
    outline_prob: float = 0.5
    texture_probs: tuple[float, float, float, float] = (0.35, 0.25, 0.2, 0.2)
    blobs: int = 3

    def __post_init__(self):
        if self.size < 16:
            raise ValueError(f"size={self.size!r} is too small; use at least 16 pixels")
        if not 0.05 <= self.min_scale <= self.max_scale <= 0.5:
            raise ValueError(f"min_scale={self.min_scale!r}, max_scale={self.max_scale!r}: need "
                             f"0.05 <= min_scale <= max_scale <= 0.5 (fractions of the image side)")


def class_id(name_or_id: Union[int, str]) -> int:
    """A class id from its name (``"tree"``) or id; ValueError listing the names otherwise."""
    if isinstance(name_or_id, str) and not name_or_id.strip().lstrip("-").isdigit():
        key = name_or_id.strip().lower()
        if key not in CLASS_NAMES:
            raise ValueError(f"class {name_or_id!r} is unknown; the demo classes are "
                             + ", ".join(f"{i} {n}" for i, n in enumerate(CLASS_NAMES)))
        return CLASS_NAMES.index(key)
    i = int(name_or_id)
    if not 0 <= i < NUM_CLASSES:
        raise ValueError(f"class {i} is out of range; the demo classes are 0..{NUM_CLASSES - 1}")
    return i


# ---- signed distances (positive outside, in units of the image side) ---------------------------
def _sd_circle(px, py, r):
    return torch.sqrt(px * px + py * py) - r


def _sd_box(px, py, hx, hy):
    qx, qy = px.abs() - hx, py.abs() - hy
    outside = torch.sqrt(qx.clamp(min=0) ** 2 + qy.clamp(min=0) ** 2)
    return outside + torch.maximum(qx, qy).clamp(max=0)


def _sd_convex(px, py, verts):
    """Convex polygon given as a list of (x, y) vertices (tensors broadcastable to (B, 1, 1), either
    winding): the max of the edge half-plane distances (exact inside, close enough outside for a
    1-px anti-aliased edge)."""
    n = len(verts)
    mx = sum(v[0] for v in verts) / n                 # an inside point fixes the sign of the normals
    my = sum(v[1] for v in verts) / n
    d = None
    for i in range(n):
        (ax, ay), (bx, by) = verts[i], verts[(i + 1) % n]
        ex, ey = bx - ax, by - ay
        inv = torch.rsqrt(ex * ex + ey * ey + 1e-12)
        side = torch.sign((mx - ax) * ey - (my - ay) * ex)          # the inside's sign for this edge
        di = -side * ((px - ax) * ey - (py - ay) * ex) * inv
        d = di if d is None else torch.maximum(d, di)
    return d


def _regular_polygon(r, n, rot, cx=0.0, cy=0.0):
    return [(cx + r * torch.cos(rot + 2 * math.pi * k / n), cy + r * torch.sin(rot + 2 * math.pi * k / n))
            for k in range(n)]


def _sd_star(px, py, r, rot):
    """Five-pointed star as the union of five convex kites (centre, inner, tip, inner)."""
    inner = 0.45 * r
    d = None
    for k in range(5):
        a = rot + 2 * math.pi * k / 5
        tip = (r * torch.cos(a), r * torch.sin(a))
        left = (inner * torch.cos(a - math.pi / 5), inner * torch.sin(a - math.pi / 5))
        right = (inner * torch.cos(a + math.pi / 5), inner * torch.sin(a + math.pi / 5))
        zero = torch.zeros_like(r)
        dk = _sd_convex(px, py, [(zero, zero), left, tip, right])
        d = dk if d is None else torch.minimum(d, dk)
    return d


def _rotate(px, py, angle):
    c, s = torch.cos(angle), torch.sin(angle)
    return c * px + s * py, -s * px + c * py


# ---- the renderer --------------------------------------------------------------------------------
class _Draw:
    """Composites textured, outlined parts onto a canvas (all tensors (B, ...), one class)."""

    def __init__(self, canvas_B3HW, u, cfg: SceneConfig):
        self.canvas, self.u, self.cfg = canvas_B3HW, u, cfg
        self.px = 1.0 / cfg.size                      # one pixel in image units
        self.k = 0                                    # next unused random column

    def rand(self):
        """(B, 1, 1) uniform numbers, a fresh column of the pre-drawn table each call."""
        assert self.k < self.u.shape[1], "scene needs more random parameters than drawn"
        col = self.u[:, self.k].view(-1, 1, 1)
        self.k += 1
        return col

    def colour(self, lo=0.0, hi=1.0):
        return torch.stack([lo + (hi - lo) * self.rand() for _ in range(3)], dim=1)  # (B, 3, 1, 1)

    def part(self, sd_BHW, colour_B311, gx, gy, textured=True):
        """Paint a part with signed distance ``sd`` (anti-aliased), a texture and maybe an outline."""
        px = self.px
        alpha = (0.5 - sd_BHW / px).clamp(0, 1).unsqueeze(1)                     # (B, 1, H, W)
        fill = colour_B311.expand_as(self.canvas)
        if textured:
            t, probs = self.rand(), self.cfg.texture_probs
            c2 = (1.0 - colour_B311) * 0.8 + 0.1 * self.colour()                 # a contrasting colour
            freq = 4 + 10 * self.rand()                                           # cycles per image side (18–64 px)
            ang = math.pi * self.rand()
            ux = (gx * torch.cos(ang) + gy * torch.sin(ang)) * freq
            uy = (-gx * torch.sin(ang) + gy * torch.cos(ang)) * freq
            sharp = 2.5 / (freq * px)                                             # ~1-px transitions
            stripes = (torch.sin(2 * math.pi * ux) * sharp).clamp(-1, 1) * 0.5 + 0.5
            checks = (torch.sin(2 * math.pi * ux) * torch.sin(2 * math.pi * uy) * sharp).clamp(-1, 1) * 0.5 + 0.5
            fx, fy = ux - torch.floor(ux) - 0.5, uy - torch.floor(uy) - 0.5
            dots = (0.5 - (torch.sqrt(fx * fx + fy * fy) - 0.25) * sharp).clamp(0, 1)
            p0, p1, p2 = probs[0], probs[0] + probs[1], probs[0] + probs[1] + probs[2]
            mix = torch.where(t < p0, torch.zeros_like(stripes),
                              torch.where(t < p1, stripes, torch.where(t < p2, checks, dots))).unsqueeze(1)
            fill = fill * (1 - mix) + c2 * mix
        has_outline = (self.rand() < self.cfg.outline_prob).float().unsqueeze(1)
        width = (1.5 + 2.5 * self.rand().unsqueeze(1)) * px
        dark = (self.rand() < 0.7).float().unsqueeze(1)
        line = dark * 0.08 + (1 - dark) * 0.95
        inner = (0.5 - (sd_BHW.unsqueeze(1) + width) / px).clamp(0, 1)
        ring = (alpha - inner).clamp(0, 1) * has_outline
        fill = fill * (1 - ring) + line * ring
        self.canvas = self.canvas * (1 - alpha) + fill * alpha


def _background(B, gx, gy, draw: _Draw, cfg: SceneConfig):
    c1, c2 = draw.colour(0.05, 0.95), draw.colour(0.05, 0.95)
    ang = 2 * math.pi * draw.rand()
    t = ((gx - 0.5) * torch.cos(ang) + (gy - 0.5) * torch.sin(ang)) * 0.9 + 0.5
    canvas = c1 * (1 - t.unsqueeze(1)) + c2 * t.unsqueeze(1)
    for _ in range(cfg.blobs):
        cx, cy, r = draw.rand(), draw.rand(), 0.15 + 0.3 * draw.rand()
        w = torch.exp(-((gx - cx) ** 2 + (gy - cy) ** 2) / (2 * r * r)).unsqueeze(1) * (0.6 * draw.rand().unsqueeze(1))
        canvas = canvas * (1 - w) + draw.colour(0.05, 0.95) * w
    return canvas


def _object(name: str, draw: _Draw, gx, gy, cfg: SceneConfig):
    """Draw one object of class ``name`` centred at a random position."""
    r = cfg.min_scale + (cfg.max_scale - cfg.min_scale) * draw.rand()
    cx = r + (1 - 2 * r) * draw.rand()
    cy = r + (1 - 2 * r) * draw.rand()
    rot = 2 * math.pi * draw.rand()
    tilt = (draw.rand() - 0.5) * 0.5                                              # ±14° for upright things
    flip = torch.where(draw.rand() < 0.5, -1.0, 1.0)
    col = draw.colour(0.05, 0.95)
    px, py = gx - cx, gy - cy
    if name in ("house", "tree", "flower", "car", "fish"):
        px, py = _rotate(px, py, tilt)
        px = px * flip
    if name == "disc":
        draw.part(_sd_circle(px, py, r), col, gx, gy)
    elif name == "box":
        qx, qy = _rotate(px, py, rot)
        draw.part(_sd_box(qx, qy, 0.8 * r, 0.8 * r), col, gx, gy)
    elif name == "triangle":
        draw.part(_sd_convex(px, py, _regular_polygon(r, 3, rot)), col, gx, gy)
    elif name == "star":
        draw.part(_sd_star(px, py, 1.1 * r, rot), col, gx, gy)
    elif name == "ring":
        draw.part((_sd_circle(px, py, 0.75 * r)).abs() - 0.22 * r, col, gx, gy)
    elif name == "cross":
        qx, qy = _rotate(px, py, rot)
        arm = 0.28 * r
        draw.part(torch.minimum(_sd_box(qx, qy, r, arm), _sd_box(qx, qy, arm, r)), col, gx, gy)
    elif name == "crescent":
        qx, qy = _rotate(px, py, rot)
        draw.part(torch.maximum(_sd_circle(qx, qy, r), -_sd_circle(qx - 0.45 * r, qy, 0.85 * r)), col, gx, gy)
    elif name == "house":
        draw.part(_sd_box(px, py - 0.3 * r, 0.7 * r, 0.55 * r), col, gx, gy)
        roof = [(-0.95 * r, -0.25 * r), (0.95 * r, -0.25 * r), (0 * r, -1.0 * r)]
        draw.part(_sd_convex(px, py, roof), draw.colour(0.05, 0.7), gx, gy)
        draw.part(_sd_box(px - 0.15 * r, py - 0.55 * r, 0.16 * r, 0.3 * r), draw.colour(0.0, 0.5), gx, gy, False)
        draw.part(_sd_box(px + 0.38 * r, py - 0.15 * r, 0.14 * r, 0.14 * r), draw.colour(0.6, 1.0), gx, gy, False)
    elif name == "tree":
        brown = torch.stack([0.35 + 0.2 * draw.rand(), 0.2 + 0.1 * draw.rand(), 0.05 + 0.1 * draw.rand()], 1)
        draw.part(_sd_box(px, py - 0.55 * r, 0.13 * r, 0.45 * r), brown, gx, gy, False)
        green = torch.stack([0.1 + 0.3 * draw.rand(), 0.45 + 0.45 * draw.rand(), 0.1 + 0.3 * draw.rand()], 1)
        canopy = torch.minimum(_sd_circle(px, py + 0.3 * r, 0.6 * r),
                               torch.minimum(_sd_circle(px - 0.4 * r, py, 0.42 * r),
                                             _sd_circle(px + 0.4 * r, py, 0.42 * r)))
        draw.part(canopy, green, gx, gy)
    elif name == "flower":
        stem = torch.stack([0.1 + 0.2 * draw.rand(), 0.5 + 0.3 * draw.rand(), 0.1 + 0.2 * draw.rand()], 1)
        draw.part(_sd_box(px, py - 0.6 * r, 0.06 * r, 0.45 * r), stem, gx, gy, False)
        petals = None
        for k in range(6):
            a = rot + 2 * math.pi * k / 6
            d = _sd_circle(px - 0.45 * r * torch.cos(a), py + 0.25 * r - 0.45 * r * torch.sin(a), 0.28 * r)
            petals = d if petals is None else torch.minimum(petals, d)
        draw.part(petals, col, gx, gy)
        draw.part(_sd_circle(px, py + 0.25 * r, 0.22 * r), draw.colour(0.6, 1.0), gx, gy, False)
    elif name == "car":
        draw.part(_sd_box(px, py, 0.95 * r, 0.28 * r) - 0.05 * r, col, gx, gy)
        cabin = [(-0.55 * r, -0.25 * r), (0.45 * r, -0.25 * r), (0.25 * r, -0.62 * r), (-0.4 * r, -0.62 * r)]
        draw.part(_sd_convex(px, py, cabin), draw.colour(0.5, 1.0), gx, gy, False)
        for wx in (-0.55, 0.55):
            draw.part(_sd_circle(px - wx * r, py - 0.33 * r, 0.22 * r), draw.colour(0.0, 0.25), gx, gy, False)
    elif name == "fish":
        tail = [(0.55 * r, 0.0 * r), (1.05 * r, -0.45 * r), (1.05 * r, 0.45 * r)]
        draw.part(_sd_convex(px, py, tail), draw.colour(0.05, 0.95), gx, gy, False)
        body = torch.sqrt((px / 0.85) ** 2 + (py / 0.5) ** 2) * 0.5 - 0.5 * r         # ellipse-ish distance
        draw.part(body, col, gx, gy)
        draw.part(_sd_circle(px + 0.45 * r, py + 0.1 * r, 0.09 * r), draw.colour(0.0, 0.15), gx, gy, False)
    else:  # pragma: no cover - CLASS_NAMES and this function are kept in step
        raise AssertionError(name)


def render_scenes(labels_B: torch.Tensor, generator: Optional[torch.Generator] = None,
                  config: SceneConfig = SceneConfig(), device: Optional[torch.device] = None) -> torch.Tensor:
    """Images (B, 3, size, size) float32 in [0, 1] for class ids ``labels_B``.

    All random numbers come from ``generator`` (on ``device``; default: a fresh CPU generator with
    seed 0) in one draw, so a seed fixes the whole batch.
    """
    labels_B = torch.as_tensor(labels_B, dtype=torch.long)
    if labels_B.ndim != 1:
        raise ValueError(f"labels_B must be 1-D class ids, got shape {tuple(labels_B.shape)}")
    if labels_B.numel() and (labels_B.min() < 0 or labels_B.max() >= NUM_CLASSES):
        raise ValueError(f"labels must be in 0..{NUM_CLASSES - 1} ({', '.join(CLASS_NAMES)}), got "
                         f"{sorted(set(labels_B.tolist()))}")
    device = torch.device(device) if device is not None else (generator.device if generator is not None
                                                              else torch.device("cpu"))
    if generator is None:
        generator = torch.Generator(device).manual_seed(0)
    B, S = labels_B.shape[0], config.size
    u_BP = torch.rand(B, _NUM_PARAMS, generator=generator, device=device)
    labels_B = labels_B.to(device)
    coords = (torch.arange(S, device=device, dtype=torch.float32) + 0.5) / S
    gy_HW, gx_HW = torch.meshgrid(coords, coords, indexing="ij")
    out_B3HW = torch.empty(B, 3, S, S, device=device)
    for c, name in enumerate(CLASS_NAMES):
        rows = (labels_B == c).nonzero().flatten()       # grouping by class happens outside any model loop
        if rows.numel() == 0:
            continue
        draw = _Draw(None, u_BP[rows], config)
        gx, gy = gx_HW.expand(rows.numel(), S, S), gy_HW.expand(rows.numel(), S, S)
        draw.canvas = _background(rows.numel(), gx, gy, draw, config)
        draw.k = 32                                       # object draws start at a fixed column
        _object(name, draw, gx, gy, config)
        out_B3HW[rows] = draw.canvas.clamp(0, 1)
    return out_B3HW


def random_labels(batch: int, generator: torch.Generator, device=None) -> torch.Tensor:
    """Uniform class ids (B,) from ``generator``."""
    return torch.randint(0, NUM_CLASSES, (batch,), generator=generator,
                         device=device if device is not None else generator.device)
