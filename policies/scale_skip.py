"""Scale skipping: stop before the last N scales, and/or drop the unconditional CFG half from a
given scale on (research/accel.md §5).

Skipping is legal for every family because the latent is accumulated at full resolution: the
skipped scales simply add no residual, and the latent accumulated so far is decoded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..engine.contract import Policy, ScalePlan


def resolve_scale_index(value: int, num_scales: int, name: str) -> int:
    """A scale index from a setting: 0-based, negative counts from the end (-1 = last scale)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int scale index, got {value!r}")
    if not -num_scales <= value < num_scales:
        raise ValueError(f"{name}={value} is past the schedule: this model has {num_scales} scales, so use "
                         f"0..{num_scales - 1} or -{num_scales}..-1 (counted from the end)")
    return value % num_scales


@dataclass(frozen=True)
class ScaleSkipConfig:
    """Skip the last scales and/or run the last scales without guidance.

    skip_last: number of final scales not run at all (0 = none). The last scales hold most of the
        tokens (VAR 256 px: the last one 38 % of the FLOPs, the last two 63 %), so each skipped
        scale saves a lot, at the cost of fine detail. Range 0 .. number of scales − 1.
    cond_only_from: first scale run without the unconditional CFG half (0-based; negative counts
        from the end, -1 = last scale); None keeps guidance everywhere. Halves the rows of the
        remaining scales; guidance there is off (SkipVAR's "unconditional-branch replacement").
    """

    skip_last: int = 0
    cond_only_from: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.skip_last, bool) or not isinstance(self.skip_last, int) or self.skip_last < 0:
            raise ValueError(f"skip_last must be an int >= 0 (0 = run every scale), got {self.skip_last!r}")
        if self.cond_only_from is not None and (isinstance(self.cond_only_from, bool)
                                                or not isinstance(self.cond_only_from, int)):
            raise ValueError(f"cond_only_from must be a scale index (int) or None, got {self.cond_only_from!r}")

    @property
    def neutral(self) -> bool:
        return self.skip_last == 0 and self.cond_only_from is None


class ScaleSkipPolicy(Policy):
    name = "scale_skip"

    def __init__(self, config: ScaleSkipConfig = ScaleSkipConfig()):
        self.config = config

    def validate(self, info) -> None:
        S = info.schedule.num_scales
        if self.config.skip_last > S - 1:
            raise ValueError(f"skip_last={self.config.skip_last} would skip every scale: this model has {S} "
                             f"scales, so use 0..{S - 1}")
        if self.config.cond_only_from is not None:
            resolve_scale_index(self.config.cond_only_from, S, "cond_only_from")

    def scales_run(self, num_scales: int) -> int:
        return max(1, num_scales - self.config.skip_last)

    def plan_scale(self, si: int, run) -> Optional[ScalePlan]:
        c = self.config
        if c.neutral:
            return None
        skip = run.schedule.from_end(si) < c.skip_last
        cond_only = c.cond_only_from is not None and si >= resolve_scale_index(
            c.cond_only_from, run.schedule.num_scales, "cond_only_from")
        if not skip and not cond_only:
            return None
        return ScalePlan(skip=skip, cond_only=cond_only)
