"""SparseVAR: frequency-aware token exclusion with anchor tokens (arXiv 2507.20454, ICCV'25).

From the start scale P on, tokens in low-frequency regions are not run through the transformer.
Which ones is read off how much one block (or block group) s changed each token at the previous
scale: the per-token MSE between its input and output, averaged over the CFG halves, upsampled to
this scale. Tokens whose change is at most ``tau`` × the image's maximum are excluded; exclusion
accumulates (an excluded token's change is 0, so its region stays excluded). An alpha-strided grid
of anchor tokens (last row and column included) is always computed. After the kept tokens ran,
every excluded token takes the final hidden state of the most similar anchor of its grid cell when
the cosine similarity of their previous-scale distributions (``similarity``) is ≥ ``beta``;
otherwise its residual at this scale is zero. Research notes: research/accel.md §2.

Differences from the only public re-implementation (accel.md §2.9), all deliberate: logits are
permuted before they are reshaped to a map; ``beta`` is honoured; anchors are always in the kept
set; zeroing works for any batch and code width; every image keeps its own token set (padding with
a key mask, never truncation); no discarded probe computations.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F

from ..sparse_ops import ops as sparse_ops
from ..sparse_ops._backend import check_backend, resolve_backend
# token roles in the maps stored for visualisation (GenerationStats.token_maps); defined beside the ops
from ..sparse_ops.ref import TOKEN_ANCHOR, TOKEN_COPIED, TOKEN_EXCLUDED, TOKEN_KEPT  # noqa: F401
from ..engine.contract import Policy, ScalePlan
from .scale_skip import resolve_scale_index

INTERPOLATIONS = ("nearest", "bilinear")
SIMILARITIES = ("logits", "probs")


@dataclass(frozen=True)
class SparseVARConfig:
    """SparseVAR settings. Defaults per model family: :data:`SPARSEVAR_PRESETS`.

    tau: relative change threshold in [0, 1). A token is excluded when its upsampled change at the
        observed block is ≤ tau × the image's largest change. Higher → fewer tokens computed, more
        speed, less detail. 0 keeps every token that changed at all (the neutral setting).
        Paper/re-implementation: 0.6.
    start_scale: first scale with exclusion, 0-based; negative counts from the end (-3 = third
        scale from the end), which keeps a preset valid at every resolution. Needs a previous scale.
        Infinity-2B 1024²: 40×40 = -3.
    block: index of the observed layer (``granularity="layer"``) or block group ("group", Infinity's
        chunks); None = the layer at 2/3 of the depth (the middle group). Which layer serves best
        differs per checkpoint: ``sparsevar calibrate`` measures it and stores it with the model,
        and ``pipe.sparsevar_preset`` (what ``enable_sparsevar()`` starts from) applies it.
    granularity: "layer" or "group".
    alpha: anchor stride in tokens (≥ 1): rows and columns 0, α, 2α, … and the last. Smaller →
        more anchors computed, better copies, less speed. Paper: 4.
    beta: cosine-similarity threshold in [0, 1] for copying an anchor's hidden state; below it the
        excluded token contributes nothing at this scale; 1 turns copying off. Paper: 0.9 (the
        re-implementation runs 0.8).
    interpolation: how the change map and logits are upsampled to the next scale: "nearest"
        (keeps exclusion exact across integer ratios; the re-implementation) or "bilinear".
    similarity: what the cosine compares: "probs" (the softmax of the previous scale's guided
        logits: the distributions sampling draws from, per categorical of the family — a bit pair
        for Infinity; the default) or "logits" (the logits themselves, as the paper writes; on
        1024-way logits unrelated tokens already score about 0.8, so nearly every excluded token
        copies). Measured on the demo model: benchmarks/results/README.md, Session 20.
    keep_ratio: instead of the tau rule, keep this fraction of each scale's tokens (anchors
        count towards it; at least the anchors are kept), so the speed-up is predictable and every
        image of a batch keeps the same count. In (0, 1]; None uses tau.
    backend: kernels for the selection, anchor matching and row gathers: "auto" (Triton on a CUDA
        GPU where it can run, else pure torch; the default), "triton" (require the kernels: a
        ValueError at generation if they cannot run on the model's device) or "torch" (the
        pure-torch references, bit-identical to earlier releases). Same decisions either way up
        to float rounding of the similarities.
    """

    tau: float = 0.6
    start_scale: int = -3
    block: Optional[int] = None
    granularity: str = "layer"
    alpha: int = 4
    beta: float = 0.9
    interpolation: str = "nearest"
    similarity: str = "probs"
    keep_ratio: Optional[float] = None
    backend: str = "auto"

    def __post_init__(self):
        check_backend(self.backend, "backend")
        _number(self.tau, "tau")
        if not 0.0 <= self.tau < 1.0:
            raise ValueError(f"tau must be in [0, 1) (0 = keep every token that changes), got {self.tau}")
        _number(self.beta, "beta")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1] (cosine similarity for copying an anchor), got {self.beta}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int) or self.alpha < 1:
            raise ValueError(f"alpha must be an int >= 1 (anchor stride in tokens), got {self.alpha!r}")
        if self.granularity not in ("layer", "group"):
            raise ValueError(f"granularity must be 'layer' or 'group', got {self.granularity!r}")
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {self.interpolation!r}")
        if self.similarity not in SIMILARITIES:
            raise ValueError(f"similarity must be one of {SIMILARITIES}, got {self.similarity!r}")
        if self.keep_ratio is not None:
            _number(self.keep_ratio, "keep_ratio")
            if not 0.0 < self.keep_ratio <= 1.0:
                raise ValueError(f"keep_ratio must be in (0, 1] (fraction of tokens computed) or None, "
                                 f"got {self.keep_ratio}")
        if self.block is not None and (isinstance(self.block, bool) or not isinstance(self.block, int)):
            raise ValueError(f"block must be an int index or None (family default), got {self.block!r}")
        if isinstance(self.start_scale, bool) or not isinstance(self.start_scale, int):
            raise ValueError(f"start_scale must be an int scale index, got {self.start_scale!r}")

    @property
    def neutral(self) -> bool:
        return self.tau == 0.0 and self.keep_ratio in (None, 1.0)


def _number(v, name):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {v!r}")


# One registry of defaults, per model family (the ComfyUI settings node reads the same).
SPARSEVAR_PRESETS: dict[str, SparseVARConfig] = {
    # Infinity-2B (paper / re-implementation): group 3 of 8, first pruned scale 40×40 of 13.
    "infinity-2b": SparseVARConfig(tau=0.6, start_scale=-3, block=3, granularity="group", alpha=4, beta=0.9),
    # HART-0.7B: paper block 16 (a layer; HART has no groups), last three scales.
    "hart": SparseVARConfig(tau=0.6, start_scale=-3, block=16, granularity="layer", alpha=4, beta=0.9),
    # VAR (class-conditional; no published setting). The last two scales (13×13, 16×16 at 256 px)
    # hold 63 % of the FLOPs, and earlier ones are too small for a 4-stride anchor grid to leave
    # anything out, so exclusion starts at the second-to-last scale; the observed layer sits at 2/3
    # of the depth (accel.md §9.4; `sparsevar bench observe` measures the others:
    # benchmarks/results/observe_demo_cpu.md). beta 1 (no copies): on the demo model an excluded
    # token that copies its anchor's hidden state draws its own code from the anchor's distribution
    # and lands further from the dense picture than one that adds nothing, even where the
    # distributions are alike (benchmarks/results/README.md, Session 20).
    "var": SparseVARConfig(tau=0.6, start_scale=-2, block=None, granularity="layer", alpha=4, beta=1.0),
    # FlexVAR (VAR's blocks; the paper's appendix A gives no setting): VAR's. Excluded tokens keep the
    # interpolated previous prediction (FlexVARAdapter.residual).
    "flexvar": SparseVARConfig(tau=0.6, start_scale=-2, block=None, granularity="layer", alpha=4, beta=1.0),
}


def anchor_mask(h: int, w: int, alpha: int, device=None) -> torch.Tensor:
    """(h, w) bool: rows and columns 0, α, 2α, … plus the last row / column."""
    # arithmetic on aranges, not item assignment: ``rows[-1] = True`` on a CUDA tensor copies a host
    # scalar and synchronises the stream
    r, c = torch.arange(h, device=device), torch.arange(w, device=device)
    rows = (r % alpha == 0) | (r == h - 1)
    cols = (c % alpha == 0) | (c == w - 1)
    return rows[:, None] & cols[None, :]


def anchor_count(h: int, w: int, alpha: int) -> int:
    """Number of anchors of an (h, w) map (host arithmetic, no tensor)."""
    return len(set(range(0, h, alpha)) | {h - 1}) * len(set(range(0, w, alpha)) | {w - 1})


def anchor_candidates(h: int, w: int, alpha: int, device=None) -> torch.Tensor:
    """(h·w, 4) token indices of the anchors at the corners of each token's anchor-grid cell
    (the nearest anchor rows above/below × nearest anchor columns left/right; corners coincide on
    anchor rows / columns). An anchor's own candidates are itself."""
    def bracket(n):
        # the anchor lines 0, α, 2α, … and n − 1, built on the device: a host list copied with
        # torch.tensor would synchronise the stream and stall the loop at every pruned scale
        t = torch.arange(0, n, alpha, device=device)
        if (n - 1) % alpha:
            t = torch.cat((t, torch.full((1,), n - 1, device=device, dtype=t.dtype)))
        pos = torch.arange(n, device=device)
        hi = torch.searchsorted(t, pos, right=False).clamp(max=t.shape[0] - 1)     # first line >= pos
        lo = torch.where(t[hi] == pos, hi, (hi - 1).clamp(min=0))                  # last line <= pos
        return t[lo], t[hi]

    r0, r1 = bracket(h)
    c0, c1 = bracket(w)
    rr = torch.stack((r0, r0, r1, r1), dim=-1)[:, None, :].expand(h, w, 4)
    cc = torch.stack((c0, c1, c0, c1), dim=-1)[None, :, :].expand(h, w, 4)
    return (rr * w + cc).reshape(h * w, 4)                                          # (h, w, 4) → (hw, 4)


def upsample_map(m_Bhw: torch.Tensor, hw: tuple[int, int], mode: str) -> torch.Tensor:
    """(B, h', w') or (B, h', w', V) → (B, h, w) / (B, h, w, V) at the next scale's size."""
    if m_Bhw.dim() == 3:
        x = m_Bhw[:, None]
    else:
        x = m_Bhw.permute(0, 3, 1, 2)                                               # (B, h, w, V) → (B, V, h, w)
    kw = {"align_corners": False} if mode == "bilinear" else {}
    x = F.interpolate(x.float(), size=hw, mode=mode, **kw)
    return x[:, 0] if m_Bhw.dim() == 3 else x.permute(0, 2, 3, 1)


def nearest_source(src_hw: tuple[int, int], hw: tuple[int, int], device=None) -> torch.Tensor:
    """(h·w,) int64: the token of an (h', w') map that nearest upsampling to (h, w) copies into each
    token (the mapping ``upsample_map(..., "nearest")`` applies)."""
    (hs, ws), (h, w) = src_hw, hw
    pos_1hw = torch.arange(hs * ws, device=device, dtype=torch.float32).view(1, hs, ws)   # (M,) → (1, h', w'); exact
    return upsample_map(pos_1hw, (h, w), "nearest").reshape(h * w).long()                 # (1, h, w) → (L,)


class SparseVARPolicy(Policy):
    name = "sparsevar"
    incompatible = ("fastvar",)

    def __init__(self, config: SparseVARConfig = SparseVARConfig()):
        self.config = config

    # ---- settings ---------------------------------------------------------------------------------
    def resolved(self, info) -> tuple[int, int, int]:
        """(first pruned scale P, first observed layer, last observed layer) for this model."""
        c = self.config
        S = info.schedule.num_scales
        P = resolve_scale_index(c.start_scale, S, "start_scale")
        if P == 0:
            raise ValueError(f"start_scale={c.start_scale} is the first scale, which has no previous scale to "
                             f"measure changes on; use 1..{S - 1} or -{S - 1}..-1")
        if c.granularity == "group":
            if not info.layer_groups:
                raise ValueError(f"granularity='group': {info.family} has no block groups; use granularity='layer' "
                                 f"with block 0..{info.num_layers - 1}")
            block = c.block if c.block is not None else info.layer_groups // 2
            if not 0 <= block < info.layer_groups:
                raise ValueError(f"block={block} is not a block group of this model: use 0..{info.layer_groups - 1}")
            per = info.layers_per_group
            return P, block * per, block * per + per - 1
        block = c.block if c.block is not None else (2 * info.num_layers) // 3
        if not 0 <= block < info.num_layers:
            raise ValueError(f"block={block} is not a layer of this model: use 0..{info.num_layers - 1}")
        return P, block, block

    def validate(self, info) -> None:
        self.resolved(info)

    def begin(self, run) -> None:
        P, first, last = self.resolved(run.info)
        backend = resolve_backend(self.config.backend, run.device, "backend")
        run.policy_state[self.name] = {"P": P, "first": first, "last": last, "x_in": None,
                                       "change": None, "logits": None, "roles": None, "backend": backend}

    # ---- hooks ------------------------------------------------------------------------------------
    def _geometry(self, run, hw: tuple[int, int], prev_hw: tuple[int, int], device):
        """(anchors_L, cand_L4, src_L) of a map size: anchor grid, each token's candidate anchors,
        and the previous-scale token nearest upsampling maps onto it. Built once per size pair and
        kept in ``run.shape_cache`` (reused by later generations of the same shape)."""
        key = ("sparsevar-geometry", hw, prev_hw, self.config.alpha, str(device))
        geo = run.shape_cache
        if key not in geo:
            # a stride at or past the map's longer side gives the same grid (row / column 0 and the last)
            (h, w), a = hw, min(self.config.alpha, max(hw))
            geo[key] = (anchor_mask(h, w, a, device).reshape(h * w),                    # (h, w) → (L,)
                        anchor_candidates(h, w, a, device),
                        nearest_source(prev_hw, hw, device))
        return geo[key]

    def _plan(self, si: int, run, static: bool = True, **excluded) -> ScalePlan:
        """This policy's hooks at ``si``: it observes the scales whose change map a later scale reads
        (the one before the first pruned scale, and every pruned one but the last) and stores their
        guided logits; at a pruned scale with ``excluded`` tokens (the plan's subset and tensors) it
        copies anchors into them and zeroes their residual."""
        st = run.policy_state[self.name]
        if si < st["P"] - 1:
            return ScalePlan(hooks=frozenset(), static=True)
        observes = si < run.schedule.num_scales - 1
        hooks = {"after_scale"} | ({"observe"} if observes else set()) | \
            ({"post_hidden", "post_residual"} if excluded else set())
        return ScalePlan(hooks=frozenset(hooks), layers=frozenset({st["first"], st["last"]}), static=static,
                         writes=("change",) if observes else (), **excluded)

    def plan_scale(self, si: int, run) -> Optional[ScalePlan]:
        st = run.policy_state[self.name]
        st["roles"] = None
        if self.config.neutral:
            return ScalePlan(hooks=frozenset(), static=True)
        if si < st["P"] or st["change"] is None:
            return self._plan(si, run)
        c, sch, backend = self.config, run.schedule, st["backend"]
        h, w = sch.hw[si]
        L = h * w
        change_Bhw = st["change"]                         # the previous scale's map (B, h', w')
        B, hp, wp = change_Bhw.shape
        anchors_L, cand_L4, src_L = self._geometry(run, (h, w), (hp, wp), change_Bhw.device)
        if c.interpolation == "nearest":                  # index-mapped: the upsampled map is never built
            change_BM = change_Bhw.reshape(B, hp * wp)                                  # (B, h', w') → (B, M)
        else:
            change_BM = upsample_map(change_Bhw, (h, w), c.interpolation).reshape(B, L)  # (B, h, w) → (B, L)
            src_L = torch.arange(L, device=change_Bhw.device)
        budget = None
        if c.keep_ratio is not None:
            budget = max(math.ceil(c.keep_ratio * L), anchor_count(h, w, c.alpha))
        idx_BL, count_B, keep_BL = sparse_ops.select_kept(change_BM, src_L, anchors_L, c.tau, budget, backend=backend)
        if budget is not None:
            # the count follows from the settings: no host read of the kept set
            n, valid_Bn, all_kept = budget, None, budget == L
        else:
            # a host read of a pruned scale's kept counts: the shapes of every kernel after it depend on it
            counts = count_B.tolist()
            n, all_kept = max(counts), min(counts) == L
            valid_Bn = None
            if any(k != n for k in counts):
                valid_Bn = torch.arange(n, device=count_B.device)[None, :] < count_B[:, None]
        index_Bn = idx_BL[:, :n].contiguous()
        if all_kept:                                      # nothing excluded: the dense path
            roles_L = torch.where(anchors_L, TOKEN_ANCHOR, TOKEN_KEPT).to(torch.uint8)
            st["roles"] = roles_L.view(1, h, w).expand(B, h, w).clone()                 # (L,) → (B, h, w)
            return self._plan(si, run)
        # anchor assignment from the previous scale's guided logits (upsampled per token)
        lg_BhwV = st["logits"]                            # (B, h', w', V)
        if c.similarity == "probs" and c.beta < 1.0:      # each categorical's distribution: (…, V/g, g) → (…, V)
            g = run.info.choices or lg_BhwV.shape[-1]
            lg_BhwV = lg_BhwV.unflatten(-1, (-1, g)).softmax(dim=-1).flatten(-2)
        if c.interpolation == "nearest":
            logits_BMV = lg_BhwV.reshape(B, hp * wp, -1)                               # (B, h', w', V) → (B, M, V)
        else:
            logits_BMV = upsample_map(lg_BhwV, (h, w), c.interpolation).reshape(B, L, -1)  # (B, h, w, V) → (B, L, V)
        beta = c.beta if c.beta < 1.0 else math.inf       # 1 turns copying off (no rounding knife edge at 1)
        copy_src_BL, zero_BL, roles_BL, _ = sparse_ops.anchor_match(logits_BMV, src_L, cand_L4, keep_BL, anchors_L,
                                                                    beta, backend=backend)
        st["roles"] = roles_BL.view(B, h, w)           # (B, L) → (B, h, w); recorded once the scale has run
        return self._plan(si, run, static=c.keep_ratio is not None and valid_Bn is None,
                          token_index=index_Bn, token_valid=valid_Bn,
                          tensors={"sparsevar.copy_src": copy_src_BL, "sparsevar.zero": zero_BL})

    def observe(self, si: int, unit, x_in, x_out, run) -> None:
        st = run.policy_state[self.name]
        if unit[0] != "layer":
            return
        if unit[1] == st["first"]:
            st["x_in"] = x_in
        if unit[1] != st["last"]:
            return
        B = run.batch_size
        h, w = run.schedule.hw[si]
        idx_Bn = run.plan.token_index
        if idx_Bn is not None:                  # excluded tokens did not change: 0
            idx_Bn = idx_Bn.to(x_out.device)
        full_BL = sparse_ops.change_map(st["x_in"], x_out, B, idx_Bn, h * w, backend=st["backend"])
        st["change"] = full_BL.view(B, h, w)                                             # (B, hw) → (B, h, w)
        st["x_in"] = None

    def post_hidden(self, si: int, h_RLC: torch.Tensor, run) -> torch.Tensor:
        src_BL = run.plan.tensors["sparsevar.copy_src"]
        R = h_RLC.shape[0]
        src_RL = src_BL.repeat(R // src_BL.shape[0], 1)                                 # one map per image
        return sparse_ops.gather_rows(h_RLC, src_RL, backend=run.policy_state[self.name]["backend"])  # anchor copies

    def post_residual(self, si: int, residual_BLc: torch.Tensor, run) -> torch.Tensor:
        zero_BL = run.plan.tensors["sparsevar.zero"]
        return residual_BLc.masked_fill(zero_BL.unsqueeze(-1), 0.0)

    def after_scale(self, si: int, guided_logits_BLV: torch.Tensor, run) -> None:
        st = run.policy_state[self.name]
        if st["roles"] is not None:
            run.stats.token_maps[si] = st["roles"]
        if si >= st["P"] - 1 and si < run.schedule.num_scales - 1:
            h, w = run.schedule.hw[si]
            st["logits"] = guided_logits_BLV.reshape(guided_logits_BLV.shape[0], h, w, -1)  # (B, hw, V) → (B, h, w, V)


def sparsevar_config_for(family: str, calibration: Optional[dict] = None, **overrides) -> SparseVARConfig:
    """The preset of a model family, with a checkpoint's ``calibration`` applied (see
    :func:`check_calibration`), with some fields changed (unknown field names raise)."""
    base = SPARSEVAR_PRESETS.get(family, SparseVARConfig())
    if calibration:
        base = _replace(base, {k: v for k, v in calibration.items() if k != "measured"})
    return _replace(base, overrides)


# What `sparsevar calibrate` measures per checkpoint and stores in the pipeline's config
# (model_index.json "sparsevar_calibration"): the observed layer or block group (always), and the
# threshold and first pruned scale (where a setting was found; text-to-image models keep the family's).
CALIBRATED_FIELDS = ("block", "granularity", "tau", "start_scale")
REQUIRED_CALIBRATED_FIELDS = ("block", "granularity")


def check_calibration(calibration, where: str = "sparsevar_calibration") -> Optional[dict]:
    """A checkpoint's SparseVAR calibration, checked: None, or a dict holding the
    :data:`REQUIRED_CALIBRATED_FIELDS`, optionally the rest of :data:`CALIBRATED_FIELDS` (the preset
    fields the measurement chose) and optionally ``"measured"``
    (a dict: what was measured, how, and the numbers; informational). Anything else is a ValueError
    naming ``where``, the key or value and the fix. Returns a plain-dict copy."""
    if calibration is None:
        return None
    fix = "run `sparsevar calibrate --model FOLDER` again, or remove the key"
    if not isinstance(calibration, dict):
        raise ValueError(f"{where} must be a dict such as {{\"block\": 7, \"granularity\": \"layer\"}}, got "
                         f"{type(calibration).__name__} {str(calibration)[:60]}; {fix}")
    keys = set(calibration) - {"measured"}
    if not set(REQUIRED_CALIBRATED_FIELDS) <= keys <= set(CALIBRATED_FIELDS):
        raise ValueError(f"{where} has the keys {sorted(calibration)}; it holds {list(REQUIRED_CALIBRATED_FIELDS)} "
                         f"(both), optionally 'tau', 'start_scale' and 'measured'; {fix}")
    if "measured" in calibration and not isinstance(calibration["measured"], dict):
        raise ValueError(f"{where}[\"measured\"] must be a dict of what was measured, got "
                         f"{type(calibration['measured']).__name__}; {fix}")
    try:
        SparseVARConfig(**{k: v for k, v in calibration.items() if k != "measured"})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}; {fix}") from None
    return copy.deepcopy(calibration)


def _replace(cfg, overrides: dict):
    fields = set(cfg.__dataclass_fields__)
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown {type(cfg).__name__} setting(s) {unknown}; valid: {sorted(fields)}")
    return replace(cfg, **overrides)
