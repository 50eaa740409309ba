"""diffusers-style pipelines (one per model family), imported at first use (PEP 562): importing a
submodule such as ``pipelines.defaults`` does not import every pipeline, torch and diffusers."""
from __future__ import annotations

from .._lazy import lazy_exports

_SOURCE = {"VARPipeline": ".var_pipeline", "VARPipelineOutput": ".var_pipeline",
           "InfinityPipeline": ".infinity_pipeline", "InfinityPipelineOutput": ".infinity_pipeline",
           "HARTPipeline": ".hart_pipeline", "HARTPipelineOutput": ".hart_pipeline",
           "FlexVARPipeline": ".flexvar_pipeline", "FlexVARPipelineOutput": ".flexvar_pipeline"}

__all__ = list(_SOURCE)


__getattr__, __dir__ = lazy_exports(__name__, _SOURCE)
