"""diffusers-style pipelines (one per model family)."""
from .var_pipeline import VARPipeline, VARPipelineOutput

__all__ = ["VARPipeline", "VARPipelineOutput"]
