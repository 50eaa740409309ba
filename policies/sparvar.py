"""SparVAR: sparse cross-scale attention (CS4A + CSLA), training-free (research/accel.md §4; the
paper's supplement in research/papers/sparvar_supplement.txt).

Every token is computed and every key/value is cached; only which cached keys each query reads
changes, from the decision scale S on (scales before it attend densely):

- **CS4A** (the first ``cs4a_layers`` of the layers). At S the layer attends densely, sums the
  attention probabilities of every query group (``query_group`` consecutive queries in raster
  order) over its queries per key, keeps each group's ``top_keys`` fraction of keys with the largest
  sums, and stores ``O_cache = O_dense − O_sparse``: what the unselected keys contributed. At a later
  scale k each query group takes the keys of the proportionally nearest group of the previous
  sparse scale (``mapping``: "relative" maps S's selection to each later scale, every key moved to
  the scale as far behind the query's scale as it was behind S at the proportional position, and
  reads the first ``sink_scales`` scales (at least those with no source) whole — the supplement's
  Decompose-Align-Project with its attention sink; "verbatim" reuses the previous sparse scale's
  cache positions, as the authors' development code does), plus a band of its own scale (every key of the group's
  ``local_window``-sided windows, as one contiguous raster range; the side grows by 2 per scale),
  and its output is ``upsample(O_cache) + attention over those keys``.
- **CSLA** (the other layers, from S on): a query reads every key of the first ``sink_scales``
  scales, and in each later key scale the square window of side ``windows[e]`` (e = that key
  scale's position from the end, 0 = last) around its proportionally mapped position; key scales
  with no window (past the tuple, or 0) are not read; -1 reads a whole scale. On the Triton
  backend it runs as gathered attention over 8 × 8 patches of queries, each reading the sinks and
  the keys its queries' windows reach, exact per score (``sparse_ops.window_attention``; the tiles
  built once per shape); on the torch backend through SDPA with the boolean mask.

CS4A's sparse pass gathers each group's keys by index lists (``sparse_ops.group_sparse_attention``,
a Triton kernel on the GPU); the lists are sized by a bound known on the host (the decision
scale's keys, plus the sinks and the largest band), so no step waits on the device.

Positions are keyed on scales counted from the end of the scales that run (a skipped tail moves
S with it) and on proportional positions, so a setting holds at every resolution and aspect ratio.
The families fold the attention temperature into q, so attention runs at scale 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..engine.contract import Policy, ScalePlan
from ..engine.schedule import ScaleSchedule
from ..sparse_ops import ops as sparse_ops
from ..sparse_ops import ref
from ..sparse_ops._backend import check_backend, resolve_backend
from ..sparse_ops.attention import dense_attention, dense_attention_lse
from .scale_skip import resolve_scale_index

MAPPINGS = ("relative", "verbatim")
# CSLA's query tiles on the GPU (rows, columns of the query map): 64 queries, whose windows reach a
# small patch of each key scale
CSLA_TILE = (8, 8)


@dataclass(frozen=True)
class SparVARConfig:
    """SparVAR settings. Defaults per model family: :data:`SPARVAR_PRESETS`; ``SparVARConfig.dense()``
    reads every key through the same machinery (the neutral setting, equal to dense attention up to
    float rounding).

    decision_scale: the scale where CS4A picks its keys and from which CSLA acts: 0-based, negative
        counts from the end of the scales that run (-3 = third-last; with the last two skipped it
        moves back with them). Needs a later scale. Paper (Infinity-2B 1024²): 40×40 = -3.
    cs4a_layers: the fraction of the layers, from the first, that use CS4A; the rest use CSLA, in
        [0, 1]. Paper: about 0.6 ("6:4"); the development code's 11 of 32 is 0.34.
    query_group: queries per group (raster order) that share one key selection, ≥ 1. Paper: 192
        (the kernel's tile).
    top_keys: the fraction of the keys at the decision scale each query group keeps, in (0, 1].
        Lower → fewer keys read, less detail. Paper: 0.2; 1 keeps every key.
    local_window: side of CS4A's band in the query's own scale at the first sparse scale (odd, ≥ 1;
        it grows by 2 per later scale), or -1 for the whole scale. Paper: 7 (then 9).
    mapping: how CS4A's keys follow the query to later scales: "relative" (the paper's mapping, see
        the module docstring) or "verbatim" (the same cache positions; the development code).
    sink_scales: CSLA, and CS4A with the "relative" mapping, read every key of the first this-many
        scales, ≥ 0. Paper: 5 (121 tokens on Infinity).
    windows: CSLA's window side per key scale counted from the end (windows[0] = the last scale):
        odd ≥ 1, 0 = not read, -1 = the whole scale; key scales past the tuple are not read.
        Paper: (7, 5, 3, 1, 1).
    backend: kernels for the column sums and the gathered sparse attention: "auto" (Triton on a
        CUDA GPU where it can run, else pure torch), "triton" or "torch".
    """

    decision_scale: int = -3
    cs4a_layers: float = 0.6
    query_group: int = 192
    top_keys: float = 0.2
    local_window: int = 7
    mapping: str = "relative"
    sink_scales: int = 5
    windows: tuple[int, ...] = (7, 5, 3, 1, 1)
    backend: str = "auto"

    def __post_init__(self):
        check_backend(self.backend, "backend")
        if isinstance(self.decision_scale, bool) or not isinstance(self.decision_scale, int):
            raise ValueError(f"decision_scale must be an int scale index, got {self.decision_scale!r}")
        _in_range(self.cs4a_layers, "cs4a_layers", 0.0, 1.0, "the fraction of layers that use CS4A")
        if isinstance(self.query_group, bool) or not isinstance(self.query_group, int) or self.query_group < 1:
            raise ValueError(f"query_group must be an int >= 1 (queries sharing one key selection), "
                             f"got {self.query_group!r}")
        if isinstance(self.top_keys, bool) or not isinstance(self.top_keys, (int, float)) \
                or not 0.0 < self.top_keys <= 1.0:
            raise ValueError(f"top_keys must be in (0, 1] (the fraction of keys each query group keeps), "
                             f"got {self.top_keys!r}")
        if not _window_ok(self.local_window) or self.local_window == 0:
            raise ValueError(f"local_window must be an odd int >= 1 or -1 (the whole scale), got "
                             f"{self.local_window!r}")
        if self.mapping not in MAPPINGS:
            raise ValueError(f"mapping must be one of {MAPPINGS}, got {self.mapping!r}")
        if isinstance(self.sink_scales, bool) or not isinstance(self.sink_scales, int) or self.sink_scales < 0:
            raise ValueError(f"sink_scales must be an int >= 0, got {self.sink_scales!r}")
        if not isinstance(self.windows, tuple) or not all(_window_ok(w) for w in self.windows):
            raise ValueError(f"windows must be a tuple of odd ints >= 1, 0 (not read) or -1 (whole scale), "
                             f"one per key scale from the end, got {self.windows!r}")
        if self.cs4a_layers < 1 and self.sink_scales == 0 and not any(self.windows):
            raise ValueError(f"sink_scales=0 with windows={self.windows!r} leaves CSLA's queries (the layers past "
                             f"cs4a_layers={self.cs4a_layers}) no key to read: give sink_scales >= 1 or a window "
                             f"(e.g. windows=(7, 5, 3))")

    @classmethod
    def dense(cls, **fields_) -> "SparVARConfig":
        """Every key read: all of them at the decision scale, the whole current scale as the band,
        verbatim reuse, whole windows. Equal to dense attention up to float rounding."""
        return cls(**{**dict(top_keys=1.0, local_window=-1, mapping="verbatim", sink_scales=0, windows=(-1,) * 64),
                      **fields_})


def _in_range(v, name, lo, hi, what):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ValueError(f"{name} must be a number in [{lo:g}, {hi:g}] ({what}), got {v!r}")


def _window_ok(w) -> bool:
    return isinstance(w, int) and not isinstance(w, bool) and (w in (-1, 0) or (w >= 1 and w % 2 == 1))


SPARVAR_PRESETS: dict[str, SparVARConfig] = {
    # Infinity-2B 1024² (paper): decision scale 40×40, sparse on 48 and 64, sinks the first 5 scales.
    "infinity-2b": SparVARConfig(),
    # HART-0.7B: the supplement's "Scale 11" of 14, counted from 1 as its Infinity "Scale 11 (40×40)"
    # is: index 10, 27×27 at 1024²; no skipping.
    "hart": SparVARConfig(decision_scale=-4),
    # VAR (class-conditional; no published setting): the paper's rule at 256 px, unmeasured.
    "var": SparVARConfig(),
    "flexvar": SparVARConfig(),                                  # VAR's blocks: VAR's
}


# ---- position maps (shape constants, cached per schedule in run.shape_cache) ----------------------
def _proportional(idx: torch.Tensor, n_from: int, n_to: int) -> torch.Tensor:
    """Row (or column) ``idx`` of an ``n_from`` map to the nearest row of an ``n_to`` map by centres."""
    return torch.clamp(((idx.double() + 0.5) * n_to / n_from).floor().long(), 0, n_to - 1)


def relative_key_map(hw, si_from: int, si_to: int) -> tuple[torch.Tensor, int]:
    """(map (offsets[si_from + 1],) int64, sinks): the supplement's Decompose-Align-Project. Key
    position p of scale l ≤ ``si_from`` moves to scale l' = l + (si_to − si_from), its (u, v) to
    (⌊u·h_l'/h_l⌋, ⌊v·w_l'/w_l⌋); keys of the first ``sinks`` = si_to − si_from scales have no
    source."""
    offsets = ScaleSchedule(tuple(hw)).offsets
    shift = si_to - si_from
    out = []
    for j in range(si_from + 1):
        (h, w), (H, W) = hw[j], hw[j + shift]
        y, x = torch.arange(h).repeat_interleave(w), torch.arange(w).repeat(h)
        out.append(offsets[j + shift] + (y * H // h) * W + (x * W // w))
    return torch.cat(out), shift


def band_ranges(h: int, w: int, group: int, side: int) -> torch.Tensor:
    """(G, 2) int64 [lo, hi] raster positions (inclusive) inside an h×w scale covering every
    ``side``×``side`` window (clamped to the map) of each query group's queries; side -1 = the map."""
    l = h * w
    G = -(-l // group)
    if side < 0:
        return torch.tensor([[0, l - 1]] * G, dtype=torch.long)
    r = side // 2
    q = torch.arange(l)
    y, x = q // w, q % w
    lo = (y - r).clamp(min=0) * w + (x - r).clamp(min=0)
    hi = (y + r).clamp(max=h - 1) * w + (x + r).clamp(max=w - 1)
    pad = G * group - l
    lo = torch.cat([lo, lo[-1:].expand(pad)]).view(G, group).amin(1)
    hi = torch.cat([hi, hi[-1:].expand(pad)]).view(G, group).amax(1)
    return torch.stack([lo, hi], 1)


def csla_mask(hw, si: int, sink_scales: int, windows: tuple[int, ...]) -> torch.Tensor:
    """(l_si, offsets[si + 1]) bool: which keys each query of scale ``si`` reads under CSLA."""
    h, w = hw[si]
    y, x = torch.arange(h).repeat_interleave(w), torch.arange(w).repeat(h)          # (l,) query rows, cols
    parts = []
    S = len(hw)
    for j in range(si + 1):
        hj, wj = hw[j]
        e = S - 1 - j
        side = windows[e] if e < len(windows) else 0
        if j < sink_scales or side == -1:
            parts.append(torch.ones(h * w, hj * wj, dtype=torch.bool))
        elif side == 0:
            parts.append(torch.zeros(h * w, hj * wj, dtype=torch.bool))
        else:
            r = side // 2
            cy, cx = _proportional(y, h, hj), _proportional(x, w, wj)                # (l,)
            ky, kx = torch.arange(hj).repeat_interleave(wj), torch.arange(wj).repeat(hj)
            parts.append(((cy[:, None] - ky[None]).abs() <= r) & ((cx[:, None] - kx[None]).abs() <= r))
    return torch.cat(parts, dim=1)


def csla_tables(hw, si: int, sink_scales: int, windows: tuple[int, ...]) -> torch.Tensor:
    """(4, offsets[si + 1]) int64: for every cached key up to scale ``si``, the ranges [ylo, yhi] and
    [xlo, xhi] of the query rows and columns of scale ``si`` whose CSLA window holds it (every row
    for a sink or a whole-read scale, none — lo > hi — for an unread one). The proportional centre
    of a query row in key scale j, ⌊(y + ½)·h_j / h⌋, does not decrease with y, so the query rows
    whose window holds key row ky form one range (columns likewise): ``csla_mask`` is the product
    of the two range tests."""
    S = len(hw)
    h, w = hw[si]
    tables = ([], [], [], [])                                     # ylo, yhi, xlo, xhi per cached key
    for j in range(si + 1):
        hj, wj = hw[j]
        side = windows[S - 1 - j] if S - 1 - j < len(windows) else 0
        ranges = []
        for n, nj in ((h, hj), (w, wj)):
            key = torch.arange(nj)
            if j < sink_scales or side == -1:                    # every query reads it
                lo, hi = torch.zeros(nj, dtype=torch.long), torch.full((nj,), n - 1)
            elif side == 0:                                      # none does
                lo, hi = torch.ones(nj, dtype=torch.long), torch.zeros(nj, dtype=torch.long)
            else:
                centre = _proportional(torch.arange(n), n, nj)   # non-decreasing in the query's row
                lo = torch.searchsorted(centre, key - side // 2, side="left")
                hi = torch.searchsorted(centre, key + side // 2, side="right") - 1
            ranges.append((lo, hi))
        (ylo, yhi), (xlo, xhi) = ranges
        for t, v in zip(tables, (ylo.repeat_interleave(wj), yhi.repeat_interleave(wj), xlo.repeat(hj), xhi.repeat(hj))):
            t.append(v)
    return torch.stack([torch.cat(t) for t in tables])


def csla_tiles(hw, si: int, sink_scales: int, windows: tuple[int, ...], tile: Optional[tuple[int, int]] = None):
    """What ``sparse_ops.window_attention`` reads to run CSLA at scale ``si``: (tile_q_TM int32, the
    query positions of each ``tile`` = (rows, cols) patch of the map, -1 padded; tile_keys_TK int32,
    the keys past the prefix that any query of the patch may read — those whose row and column
    ranges (``csla_tables``) meet the patch's — zero padded; count_T int32; prefix, the keys of the
    first ``sink_scales`` scales, read by every query; tables_4L int32). Built once per shape."""
    th, tw = tile or CSLA_TILE
    h, w = hw[si]
    tables = csla_tables(hw, si, sink_scales, windows)
    prefix = ScaleSchedule(tuple(hw)).offsets[min(sink_scales, si + 1)]
    past = (torch.arange(tables.shape[1]) >= prefix) & (tables[0] <= tables[1]) & (tables[2] <= tables[3])  # read
    tile_q, tile_keys = [], []
    for y0 in range(0, h, th):
        for x0 in range(0, w, tw):
            y1, x1 = min(y0 + th, h) - 1, min(x0 + tw, w) - 1
            q = (torch.arange(y0, y1 + 1)[:, None] * w + torch.arange(x0, x1 + 1)[None]).flatten()
            tile_q.append(torch.cat([q, q.new_full((th * tw - q.numel(),), -1)]))
            meets = (tables[0] <= y1) & (tables[1] >= y0) & (tables[2] <= x1) & (tables[3] >= x0) & past
            tile_keys.append(meets.nonzero().flatten())      # host tensors, once per shape: not in the loop
    count = torch.tensor([k.numel() for k in tile_keys], dtype=torch.int32)
    K = max(1, int(count.max()))
    keys_TK = torch.stack([torch.cat([k, k.new_zeros(K - k.numel())]) for k in tile_keys])
    return (torch.stack(tile_q).to(torch.int32), keys_TK.to(torch.int32), count, prefix, tables.to(torch.int32))


# ---- the policy ---------------------------------------------------------------------------------
class SparVARPolicy(Policy):
    name = "sparvar"
    incompatible = ("sparsevar", "fastvar")
    incompatible_why = ("SparVAR selects keys among every token of the cache, and SparseVAR and FastVAR compute "
                        "token subsets, which leave masked holes in it")

    def __init__(self, config: SparVARConfig = SparVARConfig()):
        self.config = config

    def validate(self, info) -> None:
        S = info.schedule.num_scales
        si = resolve_scale_index(self.config.decision_scale, S, "decision_scale")
        if si >= S - 1:
            raise ValueError(f"decision_scale={self.config.decision_scale} is the last scale: SparVAR needs a "
                             f"later scale to make sparse; use -{S} … -2 (counted from the end) or 0 … {S - 2}")

    def _cs4a_layers(self, run) -> int:
        return int(round(self.config.cs4a_layers * run.info.num_layers))

    def begin(self, run) -> None:
        n = run.policies.scales_run(run.schedule.num_scales)
        si = resolve_scale_index(self.config.decision_scale, n, "decision_scale") if n > 1 else n
        run.policy_state[self.name] = {"decision": si if si < n - 1 else None, "cs4a": {}, "keys": [],
                                       "backend": resolve_backend(self.config.backend, run.device, "backend")}

    def plan_scale(self, si: int, run) -> Optional[ScalePlan]:
        S = run.policy_state[self.name]["decision"]
        if S is None or si < S:
            return ScalePlan(hooks=frozenset())
        # static: every hook does tensor work of shapes fixed by the settings and the schedule, with no
        # host read (the bounds are host numbers, the shape constants made at the first call), so the
        # engine may replay the scale from a CUDA graph; "keys" (the counts after_scale reads) and
        # "cs4a" (the selection later scales read) are set by assignment and put back after a replay
        hooks = frozenset({"attention", "after_scale"})
        if si == S:                   # attends densely while it picks each layer's keys for later scales
            return ScalePlan(hooks=hooks, static=True, writes=("cs4a", "keys"))
        chained = self.config.mapping == "verbatim"      # each scale's keys feed the next
        return ScalePlan(hooks=hooks, static=True, writes=("cs4a", "keys") if chained else ("keys",),
                         reads=("cs4a",))

    def attention(self, ctx, q_RHld, k_RHLd, v_RHLd, run):
        st = run.policy_state[self.name]
        if ctx.layer < self._cs4a_layers(run):
            return self._cs4a(ctx, q_RHld, k_RHLd, v_RHLd, run, st)
        mask_lL, keys = self._csla_mask(ctx.si, run, q_RHld.device, need_mask=st["backend"] != "triton")
        st["keys"] = st["keys"] + [keys]
        if st["backend"] == "triton":            # gathered: each patch of queries reads its windows' keys
            tile_q, tile_keys, count, prefix, tables = self._csla_tiles(ctx.si, run, q_RHld.device)
            return sparse_ops.window_attention(q_RHld, k_RHLd, v_RHLd, tile_q, tile_keys, count, prefix, tables,
                                               run.schedule.hw[ctx.si][1], 1.0, backend="triton")
        return dense_attention(q_RHld, k_RHLd, v_RHLd, scale=1.0, attn_mask=mask_lL[None, None])

    def after_scale(self, si, guided_logits_BLV, run) -> None:
        """The keys a query read this scale, averaged over the layers, for the stats (FLOP counts);
        one host read per scale (CS4A's counts are device tensors), as every scale's stats are
        host numbers."""
        st = run.policy_state[self.name]
        counts = st["keys"]
        if counts:     # per layer: a host mean, a device mean, or (host mean, reads_RHG, group sizes, rows·queries)
            read = [k for k in counts if isinstance(k, tuple)]
            on_device = [k for k in counts if isinstance(k, torch.Tensor)]
            if read:              # one weighted sum over every layer's counts (group sizes and rows are the scale's)
                _, _, sizes_G, queries = read[0]
                on_device.append((torch.stack([r for _, r, _, _ in read]).float() * sizes_G).sum() / queries)
            total = sum(k for k in counts if isinstance(k, (int, float))) + sum(k[0] for k in read)
            if on_device:
                total += torch.stack(on_device).sum().item()
            run.keys_read = total / len(counts)
        st["keys"] = []

    def _csla_mask(self, si, run, device, need_mask: bool = True) -> tuple[Optional[torch.Tensor], float]:
        """CSLA's (l, L) mask for scale ``si`` on ``device`` (None unless ``need_mask``: the
        gathered path reads the per-key tables instead) and the mean keys a query reads."""
        c = self.config
        cache = run.shape_cache
        key = ("sparvar.csla_keys", run.schedule.hw, si, c.sink_scales, c.windows)
        if key not in cache:            # the (query, key) pairs read, from the per-key ranges (no (l, L) mask)
            ylo, yhi, xlo, xhi = csla_tables(run.schedule.hw, si, c.sink_scales, c.windows)
            pairs = ((yhi - ylo + 1).clamp(min=0) * (xhi - xlo + 1).clamp(min=0)).sum().item()
            cache[key] = pairs / run.schedule.tokens(si)
        if not need_mask:
            return None, cache[key]
        mkey = ("sparvar.csla", run.schedule.hw, si, c.sink_scales, c.windows, str(device))
        if mkey not in cache:
            cache[mkey] = csla_mask(run.schedule.hw, si, c.sink_scales, c.windows).to(device)
        return cache[mkey], cache[key]

    def _csla_tiles(self, si, run, device):
        """``csla_tiles`` for scale ``si`` on ``device``, built once per shape (``run.shape_cache``)."""
        c = self.config
        key = ("sparvar.csla_tiles", run.schedule.hw, si, c.sink_scales, c.windows, str(device))
        cache = run.shape_cache
        if key not in cache:
            tile_q, tile_keys, count, prefix, tables = csla_tiles(run.schedule.hw, si, c.sink_scales, c.windows)
            cache[key] = (tile_q.to(device), tile_keys.to(device), count.to(device), prefix, tables.to(device))
        return cache[key]

    def _cs4a(self, ctx, q_RHld, k_RHLd, v_RHLd, run, st):
        c, si, R = self.config, ctx.si, q_RHld.shape[0]
        Lk, C, backend = k_RHLd.shape[2], c.query_group, st["backend"]
        if si == st["decision"]:
            o_dense, lse_RHl = dense_attention_lse(q_RHld, k_RHLd, v_RHLd, 1.0)   # lse None: colsum computes it
            colsum_RHGL = sparse_ops.attention_colsum(q_RHld, k_RHLd, 1.0, C, lse_RHl, backend=backend)
            K = max(1, min(Lk, int(round(c.top_keys * Lk))))
            idx_RHGK = colsum_RHGL.topk(K, dim=-1).indices.sort(dim=-1).values.to(torch.int32)   # ascending
            lent = (ctx.layer, *q_RHld.shape, q_RHld.dtype, *idx_RHGK.shape[2:])
            o_cache, idx_kept = self._lent(*lent, run)
            lent = lent if o_cache is not None else None
            idx_RHGK = idx_kept.copy_(idx_RHGK) if lent is not None else idx_RHGK
            count_RHG = self._full_count(idx_RHGK.shape[:3], K, run, idx_RHGK.device)
            o_sparse = sparse_ops.group_sparse_attention(q_RHld, k_RHLd, v_RHLd, idx_RHGK, count_RHG, C, 1.0,
                                                         backend=backend)
            # what the unselected keys contributed, (R, H, hS·wS, d) in q's dtype: later scales' sparse pass
            # adds its bilinear resize. bf16/fp16: subtracted in float32, rounded once
            o_cache = o_cache.copy_(o_dense - o_sparse) if lent is not None else (o_dense - o_sparse).to(q_RHld.dtype)
            st["cs4a"] = {**st["cs4a"], ctx.layer: dict(o_cache=None if lent else o_cache, idx=None if lent else idx_RHGK,
                                                        lent=lent, o_hw=run.schedule.hw[si], si=si, width=K)}
            # the decision scale's work in keys per query: the dense pass, the column sums (q·kᵀ
            # only: half a pass) and the sparse pass over the kept keys
            st["keys"] = st["keys"] + [1.5 * Lk + K]
            return o_dense
        # "relative" (the paper) follows the decision scale's selection: its entry is never rewritten;
        # "verbatim" (the development code) follows the previous sparse scale's keys
        entry = st["cs4a"][ctx.layer]
        o_cache, idx_S = self._state(entry, run)
        h, w = run.schedule.hw[si]
        band_G2, sizes_G, band_max = self._band(si, st["decision"], run, q_RHld.device)
        maps = self._relative_maps(idx_S.shape[2], entry["si"], si, run, q_RHld.device) \
            if c.mapping == "relative" else None
        if maps is not None:
            # the decision scale's lists moved to this scale (still distinct and ascending); each group
            # reads its source group's list, and the kernel counts the keys it read past the ranges
            key_map_P, list_of_G, prefix, ranges_mean = maps
            idx_RHGK = key_map_P[idx_S[:R]]
            count_RHG = self._full_count(idx_RHGK.shape[:3], idx_RHGK.shape[-1], run, idx_RHGK.device)
            reads_RHG = torch.empty(R, idx_RHGK.shape[1], band_G2.shape[0], device=q_RHld.device, dtype=torch.int32)
            st["keys"] = st["keys"] + [(ranges_mean, reads_RHG, sizes_G, R * idx_RHGK.shape[1] * h * w)]
            return sparse_ops.group_sparse_attention(q_RHld, k_RHLd, v_RHLd, idx_RHGK, count_RHG, C, 1.0, prefix,
                                                     band_G2, o_cache, (h, w), entry["o_hw"], list_of_G,
                                                     reads_RHG, backend=backend)
        # masks: verbatim chaining, or a schedule whose scales do not map one to one
        keys_RHGL, followed_max = self._follow(self._keys_of(entry, idx_S, R, run), entry["si"], si, run,
                                               entry["width"])
        keys_RHGL = keys_RHGL | self._band_mask(si, st["decision"], run, q_RHld.device)[None, None]
        width = min(Lk, followed_max + band_max)           # a bound on any group's keys, known on the host
        if c.mapping == "verbatim":
            st["cs4a"] = {**st["cs4a"], ctx.layer: {**entry, "keys": keys_RHGL, "si": si, "width": width}}
        idx_RHGK, count_RHG = ref.key_lists(keys_RHGL, width)
        st["keys"] = st["keys"] + [(count_RHG.float() * sizes_G).sum() / (R * idx_RHGK.shape[1] * h * w)]
        # the sparse pass + upsample(O_cache) (bilinear, in the kernel's epilogue)
        return sparse_ops.group_sparse_attention(q_RHld, k_RHLd, v_RHLd, idx_RHGK, count_RHG, C, 1.0, 0, None,
                                                 o_cache, (h, w), entry["o_hw"], backend=backend)

    @staticmethod
    def _lent(layer: int, R: int, H: int, l: int, d: int, dtype: torch.dtype, G: int, K: int, run):
        """A CS4A layer's O_cache (R, H, l, d) and key lists (R, H, G, K) int32 in the next layer's
        last-scale V and K slots (``KVCache.lend``), which the next layer writes only at the last
        scale, after this layer's last read: the decision scale's state then costs no memory beside
        the cache. The same views for the same arguments (the entry keeps the arguments, not the
        views: a view would keep a freed cache's memory alive). (None, None) where the cache has no
        such room (a transient tail, per-layer capacities, the last layer, another head layout or
        dtype); the caller allocates."""
        kv = run.workspace.kv if run.workspace is not None else None
        slots = kv.lend(layer + 1, l) if kv is not None and layer + 1 < kv.num_layers else None
        if slots is None:
            return None, None
        k_RHld, v_RHld = (t[:R] for t in slots)
        if v_RHld.shape != (R, H, l, d) or v_RHld.dtype != dtype or (d * k_RHld.element_size()) % 4 \
                or G * K * 4 > l * d * k_RHld.element_size():
            return None, None
        # each (image, head) plane of the slots is one contiguous run of l·d elements: seen as int32
        # words, its first G·K hold the lists
        return v_RHld, k_RHld.flatten(2).view(torch.int32)[..., :G * K].unflatten(-1, (G, K))

    def _state(self, entry: dict, run) -> tuple[torch.Tensor, torch.Tensor]:
        """A CS4A entry's (O_cache, key lists): its own tensors, or the cache slots lent to it."""
        if entry["lent"] is None:
            return entry["o_cache"], entry["idx"]
        o_cache, idx = self._lent(*entry["lent"], run)
        assert o_cache is not None, "the KV cache changed its layout within a generation"
        return o_cache, idx

    def _full_count(self, shape, K: int, run, device) -> torch.Tensor:
        """An (R, H, G) int32 tensor of K (every list entry counts), kept per shape."""
        key = ("sparvar.count", tuple(shape), K, str(device))
        cache = run.shape_cache
        if key not in cache:
            cache[key] = torch.full(tuple(shape), K, device=device, dtype=torch.int32)
        return cache[key]

    def _keys_of(self, entry, idx_RHGK: torch.Tensor, R: int, run) -> torch.Tensor:
        """The entry's (R, H, G, L) key mask: stored (verbatim chaining) or made from its index lists."""
        if "keys" in entry:
            return entry["keys"][:R]
        idx_RHGK = idx_RHGK[:R]
        L = run.schedule.offsets[entry["si"] + 1]
        return torch.zeros(*idx_RHGK.shape[:3], L, device=idx_RHGK.device, dtype=torch.bool).scatter_(
            -1, idx_RHGK.long(), True)

    def _band(self, si: int, decision: int, run, device) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(G, 2) int32 [lo, hi] cache positions of scale ``si``'s own band per query group (the
        side grows by 2 per scale after the first sparse one); (G,) float32 the queries of each
        group; the largest band."""
        c = self.config
        key = ("sparvar.band", run.schedule.hw, si, decision, c.query_group, c.local_window, str(device))
        cache = run.shape_cache
        if key not in cache:
            band_G2, sizes_G = self._band_host(si, decision, run)
            band_max = int((band_G2[:, 1] - band_G2[:, 0]).max()) + 1
            cache[key] = (band_G2.to(device=device, dtype=torch.int32), sizes_G.to(device), band_max)
        return cache[key]

    def _band_host(self, si: int, decision: int, run) -> tuple[torch.Tensor, torch.Tensor]:
        """``_band``'s (G, 2) ranges and (G,) group sizes, on the host."""
        c = self.config
        h, w = run.schedule.hw[si]
        side = c.local_window if c.local_window < 0 else c.local_window + 2 * (si - decision - 1)
        band_G2 = run.schedule.offsets[si] + band_ranges(h, w, c.query_group, side)
        G = band_G2.shape[0]
        sizes_G = torch.full((G,), float(c.query_group))
        sizes_G[-1] = h * w - c.query_group * (G - 1)                                    # the last group's queries
        return band_G2, sizes_G

    def _band_mask(self, si: int, decision: int, run, device) -> torch.Tensor:
        """(G, L) bool: ``_band`` as a mask over the cache (the mask paths)."""
        band_G2 = self._band(si, decision, run, device)[0]
        pos_L = torch.arange(run.schedule.offsets[si + 1], device=device)
        return (pos_L[None] >= band_G2[:, :1]) & (pos_L[None] <= band_G2[:, 1:])

    def _group_map(self, G_from: int, G_to: int, run, device) -> torch.Tensor:
        """(G_to,) int64: the supplement's query-block map g_k → g_S (proportionally nearest group)."""
        key = ("sparvar.groups", G_from, G_to, str(device))
        cache = run.shape_cache
        if key not in cache:
            cache[key] = torch.clamp(((torch.arange(G_to, dtype=torch.float64) + 0.5) * G_from / G_to - 0.5).round()
                                     .long(), 0, G_from - 1).to(device)
        return cache[key]

    def _relative_map(self, si_from: int, si_to: int, run, device) -> tuple[torch.Tensor, int, bool]:
        """``relative_key_map`` on ``device`` (int32), the prefix every group of scale ``si_to``
        reads whole (its sinks, or ``sink_scales`` if more), and whether the map is one to one past
        that prefix (keys mapped into it are read once anyway: HART's text slots, a
        1 × n first "scale", land there)."""
        key = ("sparvar.relative", run.schedule.hw, si_from, si_to, self.config.sink_scales, str(device))
        cache = run.shape_cache
        if key not in cache:
            map_L, sinks = relative_key_map(run.schedule.hw, si_from, si_to)
            prefix = run.schedule.offsets[min(max(sinks, self.config.sink_scales), si_to + 1)]
            past = map_L[map_L >= prefix]
            cache[key] = (map_L.to(device=device, dtype=torch.int32), prefix, past.unique().numel() == past.numel())
        return cache[key]

    def _relative_maps(self, G_from: int, si_from: int, si_to: int, run, device):
        """What follows the decision scale's lists at scale ``si_to``: (the key map (int32,
        ``relative_key_map``: it keeps raster order, so mapped lists stay ascending and distinct),
        the list each group reads (G_to,) int32, the sink prefix, the mean over the queries of the
        keys the prefix and the group's band give), or None where the map is not one to one (the
        mask path dedupes). Built once per shape."""
        c, sched = self.config, run.schedule
        map_L, prefix, injective = self._relative_map(si_from, si_to, run, device)
        if not injective:
            return None
        key = ("sparvar.relative_maps", sched.hw, G_from, si_from, si_to, c.sink_scales, c.query_group,
               c.local_window, str(device))
        cache = run.shape_cache
        if key not in cache:
            band_G2, sizes_G = self._band_host(si_to, si_from, run)
            lo_G, hi_G = band_G2[:, 0].clamp(min=prefix), band_G2[:, 1]
            ranges = float(((prefix + (hi_G - lo_G + 1).clamp(min=0)) * sizes_G).sum()) / sched.tokens(si_to)
            list_of_G = self._group_map(G_from, band_G2.shape[0], run, device).to(torch.int32)
            cache[key] = (map_L, list_of_G, prefix, ranges)
        return cache[key]

    def _follow(self, keys_RHGL: torch.Tensor, si_from: int, si_to: int, run, width: int) -> tuple[torch.Tensor, int]:
        """Scale ``si_from``'s key selection for scale ``si_to``'s query groups as a mask: group g
        takes the proportionally nearest source group, keys moved by ``mapping``; extended to the
        new length. With the bound on the keys a group can now hold, from ``width``, the bound at
        ``si_from``."""
        c = self.config
        sched = run.schedule
        R, H, G_from, L_from = keys_RHGL.shape
        G_to = -(-sched.tokens(si_to) // c.query_group)
        picked_RHGL = keys_RHGL[:, :, self._group_map(G_from, G_to, run, keys_RHGL.device)]   # (R, H, G_to, L_from)
        L_to = sched.offsets[si_to + 1]
        out = picked_RHGL.new_zeros(R, H, G_to, L_to)
        if c.mapping == "verbatim":
            out[..., :L_from] = picked_RHGL
            return out, width
        map_L, sink_end, _ = self._relative_map(si_from, si_to, run, keys_RHGL.device)
        src = picked_RHGL[..., :map_L.shape[0]].to(torch.uint8)
        out = out.to(torch.uint8).scatter_reduce_(-1, map_L.long().expand_as(src), src, reduce="amax").bool()
        out[..., :sink_end] = True                                                       # A_sink ∪ mapped keys
        return out, width + sink_end
