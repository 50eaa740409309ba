"""diffusers-style pipelines (one per model family)."""
from .var_pipeline import VARPipeline, VARPipelineOutput
from .infinity_pipeline import InfinityPipeline, InfinityPipelineOutput
from .hart_pipeline import HARTPipeline, HARTPipelineOutput

__all__ = ["VARPipeline", "VARPipelineOutput", "InfinityPipeline", "InfinityPipelineOutput", "HARTPipeline",
           "HARTPipelineOutput"]
