"""The sampling defaults of each model family, defined once: the pipelines' ``__call__``
signatures, the CLI and the ComfyUI sampler's widgets read them from here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class FamilyDefaults:
    """guidance_scale: CFG strength; guidance_off: the value that disables guidance (VAR ramps
    from 0 over the scales: 0; Infinity's cfg·cond + (1 − cfg)·uncond: 1). top_k, top_p: the
    per-token filters (0 = off). temperature / patchify_temperature: Infinity's τ without / with
    spatial patchify (2B / 8B), None where the family has none."""

    guidance_scale: float
    guidance_off: float
    top_k: int
    top_p: float
    temperature: Optional[float] = None
    patchify_temperature: Optional[float] = None


VAR_DEFAULTS = FamilyDefaults(guidance_scale=4.0, guidance_off=0.0, top_k=900, top_p=0.95)      # official demo
INFINITY_DEFAULTS = FamilyDefaults(guidance_scale=3.0, guidance_off=1.0, top_k=900, top_p=0.97,  # 2B notebook
                                   temperature=0.5, patchify_temperature=1.0)
# the reference's sample.py: cfg 4.5 on its ramp (0 = off); top_k 0 = its hard-coded rule (600 below scale 7, then 300)
HART_DEFAULTS = FamilyDefaults(guidance_scale=4.5, guidance_off=0.0, top_k=0, top_p=0.0)
# the evaluation script's VAR-ramp setting (README: cfg 2.5 at 256 px; top-k 900, top-p 0.95)
FLEXVAR_DEFAULTS = FamilyDefaults(guidance_scale=2.5, guidance_off=0.0, top_k=900, top_p=0.95)
