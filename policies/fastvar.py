"""FastVAR: cached token pruning (arXiv 2503.23367, ICCV'25; research/accel.md §3).

At the last scales every self-attention / cross-attention / FFN sub-layer of the pruned layers runs
only on its "pivotal" tokens — those farthest from the per-row spatial mean of the residual
stream (a cheap high-frequency proxy), chosen afresh before each sub-layer and per batch row. The
other tokens receive the same sub-layer's gated output cached at the last unpruned scale (in the
blocks' dtype), area-upsampled. Pruned tokens add no K/V to that layer's cache. A ratio of 1.0 skips the scale.

Scales are keyed by their index counted from the end, so a schedule works at every resolution and
aspect ratio (the official code keys on map widths and silently does nothing on non-square maps).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..sparse_ops import ops as sparse_ops
from ..sparse_ops._backend import check_backend, resolve_backend
from ..sparse_ops.ref import pivotal_tokens  # noqa: F401  (the rule, re-exported where FastVAR lives)
from ..engine.contract import Policy, ScalePlan, SubLayer


@dataclass(frozen=True)
class FastVARConfig:
    """FastVAR settings. Defaults per model family: :data:`FASTVAR_PRESETS`.

    ratios: prune ratio of each of the last ``len(ratios)`` scales, earliest first, each in [0, 1]:
        the fraction of tokens a pruned sub-layer leaves out (0 = none, the neutral setting; 1.0 =
        the whole scale is skipped, allowed only on a final run of scales). The scale just before
        the first one with a ratio above 0 is the cache scale. Infinity-2B 1024²: (0.4, 0.5, 1.0, 1.0); HART:
        (0.5, 0.75). Higher ratios: more speed, blurrier detail.
    layer_range: (first, last) layer indices, inclusive, that prune; None = every layer. The
        official Infinity-2B setting prunes layers 3..27 of 32 and runs the rest dense.
    backend: kernels for the per-sub-layer pivotal-token selection, gather + LayerNorm + AdaLN and
        the restore with the gated residual: "auto" (Triton on a CUDA GPU where it can run, else pure torch; the
        default), "triton" (require the kernels: a ValueError at generation if they cannot run on
        the model's device) or "torch" (the pure-torch references; since the selection's ties go
        to the earlier position, they differ from earlier releases only on exactly equal scores).
        The kernels change only float rounding (and so, rarely, a near-tie at the selection's cut).
    """

    ratios: tuple = (0.5, 0.75)
    layer_range: Optional[tuple] = None
    backend: str = "auto"

    def __post_init__(self):
        check_backend(self.backend, "backend")
        if isinstance(self.ratios, (str, bytes)) or not hasattr(self.ratios, "__iter__"):
            raise ValueError(f"ratios must be a sequence of prune ratios, one per final scale, e.g. (0.5, 0.75); "
                             f"got {self.ratios!r}")
        ratios = tuple(self.ratios)
        object.__setattr__(self, "ratios", ratios)
        if not ratios:
            raise ValueError("ratios is empty: give the prune ratio of at least one final scale, e.g. (0.5, 0.75)")
        for r in ratios:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
                raise ValueError(f"every prune ratio must be in [0, 1] (1.0 skips the scale), got {r!r} in {ratios}")
        ones = [r == 1.0 for r in ratios]
        if any(ones) and not all(ones[ones.index(True):]):
            raise ValueError(f"ratios={ratios}: 1.0 (skip the scale) is allowed only on the final scales, since a "
                             f"skipped scale ends generation; e.g. (0.4, 0.5, 1.0, 1.0)")
        if self.layer_range is not None:
            lr = tuple(self.layer_range)
            if len(lr) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in lr) or lr[0] > lr[1]:
                raise ValueError(f"layer_range must be (first, last) ints with first <= last, or None; "
                                 f"got {self.layer_range!r}")
            object.__setattr__(self, "layer_range", lr)

    @property
    def neutral(self) -> bool:
        return all(r == 0.0 for r in self.ratios)


FASTVAR_PRESETS: dict[str, FastVARConfig] = {
    "infinity-2b": FastVARConfig(ratios=(0.4, 0.5, 1.0, 1.0), layer_range=(3, 27)),
    "hart": FastVARConfig(ratios=(0.5, 0.75)),
    # VAR: no published schedule; accel.md §9.4's starting point (cache 10×10, prune 13×13 at 50 %
    # and 16×16 at 75 % at 256 px) — the same positions from the end at every resolution.
    "var": FastVARConfig(ratios=(0.5, 0.75)),
    "flexvar": FastVARConfig(ratios=(0.5, 0.75)),                 # VAR's blocks: VAR's
}


class FastVARPolicy(Policy):
    name = "fastvar"
    incompatible = ("sparsevar",)

    def __init__(self, config: FastVARConfig = FastVARConfig()):
        self.config = config

    def validate(self, info) -> None:
        S, N = info.schedule.num_scales, info.num_layers
        if len(self.config.ratios) > S - 1:
            raise ValueError(f"ratios has {len(self.config.ratios)} entries, but this model has {S} scales and one "
                             f"must stay unpruned as the cache scale: give at most {S - 1}")
        lr = self.config.layer_range
        if lr is not None and not (0 <= lr[0] and lr[1] < N):
            raise ValueError(f"layer_range={lr} is outside this model's layers: use indices 0..{N - 1}")

    def _ratio(self, si: int, run) -> Optional[float]:
        k = run.schedule.from_end(si)
        n = len(self.config.ratios)
        return self.config.ratios[n - 1 - k] if k < n else None

    def _cache_scale(self, run) -> int:
        """The last unpruned scale: the one before the first ratio above 0."""
        ratios = self.config.ratios
        first = next((k for k, r in enumerate(ratios) if r > 0.0), len(ratios))
        return run.schedule.num_scales - len(ratios) + first - 1

    def begin(self, run) -> None:
        run.policy_state[self.name] = {"cache_si": self._cache_scale(run), "cache": {},
                                       "backend": resolve_backend(self.config.backend, run.device, "backend")}

    def plan_scale(self, si: int, run) -> Optional[ScalePlan]:
        """The cache scale stores every gated branch output of the pruned layers (``writes`` the
        cache); pruned scales read it (fixed-size selections: static); a ratio of 1 skips the scale
        and the ones after it."""
        r = self._ratio(si, run)
        if r == 1.0:
            return ScalePlan(skip=True)
        last = si == run.schedule.num_scales - 1
        tail = frozenset({"after_scale"}) if last else frozenset()       # the cache is dropped after the last scale
        if self.config.neutral:
            return ScalePlan(hooks=frozenset(), static=True)
        lr = self.config.layer_range
        layers = None if lr is None else frozenset(range(lr[0], lr[1] + 1))
        if si == run.policy_state[self.name]["cache_si"]:
            return ScalePlan(hooks=frozenset({"wrap_sublayer"}) | tail, layers=layers, static=True, writes=("cache",))
        if r is not None and r > 0.0:
            return ScalePlan(hooks=frozenset({"wrap_sublayer", "after_scale"}), layers=layers, static=True,
                             reads=("cache",))
        return ScalePlan(hooks=tail, static=True)

    def _in_range(self, layer: int) -> bool:
        lr = self.config.layer_range
        return lr is None or lr[0] <= layer <= lr[1]

    def wrap_sublayer(self, sub: SubLayer, x_RLC: torch.Tensor, run) -> torch.Tensor:
        c = self.config
        if c.neutral or not self._in_range(sub.ctx.layer):
            return sub(x_RLC)
        st = run.policy_state[self.name]
        si = sub.ctx.si
        key = (sub.ctx.layer, sub.ctx.kind)
        R, L, C = x_RLC.shape
        if si == st["cache_si"]:                       # remember every gated branch output
            out_RLC = sub.residual(x_RLC)
            # kept in the blocks' dtype (bf16 on a GPU: half the memory of the float32 residual, for
            # values that leave a bf16 product); a new dict: see ScalePlan.writes
            st["cache"] = {**st["cache"], key: (out_RLC.to(run.dtype), run.schedule.hw[si])}
            return x_RLC + out_RLC
        r = self._ratio(si, run)
        if r is None or r == 0.0:
            return sub(x_RLC)
        keep = L - math.floor(L * r)
        backend = st["backend"]
        idx_Rn, slot_RL = sparse_ops.pivotal_tokens(x_RLC, keep, slots=True, backend=backend)
        branch_RnC = sub.branch(sub.gather_modulate(x_RLC, idx_Rn, backend), idx_Rn)
        cached_RlC, cache_hw = st["cache"][key]
        # x + (pivotal ? gate · branch : area-upsampled cache) in one pass over the L tokens
        return sparse_ops.restore_residual(x_RLC, idx_Rn, branch_RnC, sub.gate, cached_RlC, cache_hw,
                                           run.schedule.hw[si], slot_RL, backend=backend)

    def after_scale(self, si: int, guided_logits_BLV: torch.Tensor, run) -> None:
        r = self._ratio(si, run)
        if r is not None and 0.0 < r < 1.0 and not self.config.neutral:
            # tokens per sub-layer, averaged over every sub-layer (unpruned layers count in full);
            # computed from the settings, so it holds for graph replays too
            h, w = run.schedule.hw[si]
            L = h * w
            N = run.info.num_layers
            lr = self.config.layer_range or (0, N - 1)
            pruned = min(lr[1], N - 1) - lr[0] + 1
            keep = L - math.floor(L * r)
            run.tokens_computed = (pruned * keep + (N - pruned) * L) / N
        if si == run.schedule.num_scales - 1:
            run.policy_state[self.name]["cache"] = {}
