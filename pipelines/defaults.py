"""The sampling defaults of each model family, defined once: the pipelines' ``__call__``
signatures, the CLI and the ComfyUI sampler's widgets read them from here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class FamilyDefaults:
    """How a family samples when the caller says nothing.

    guidance_scale: classifier-free guidance strength (VAR ramps it from 0 at the first scale to
        this at the last; Infinity applies cfg·cond + (1 − cfg)·uncond at every scale).
    guidance_off: the guidance_scale that disables guidance (VAR 0, Infinity 1).
    top_k, top_p: the sampling filters per token (top_k 0 = no limit, 1 = greedy; top_p 0 = off).
    temperature, patchify_temperature: Infinity's τ for a model without / with spatial patchify
        (2B / 8B), as the official scripts use; None where the family has no temperature.
    """

    guidance_scale: float
    guidance_off: float
    top_k: int
    top_p: float
    temperature: Optional[float] = None
    patchify_temperature: Optional[float] = None


VAR_DEFAULTS = FamilyDefaults(guidance_scale=4.0, guidance_off=0.0, top_k=900, top_p=0.95)      # official demo
INFINITY_DEFAULTS = FamilyDefaults(guidance_scale=3.0, guidance_off=1.0, top_k=900, top_p=0.97,  # 2B notebook
                                   temperature=0.5, patchify_temperature=1.0)
