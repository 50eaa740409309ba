"""diffusers-style pipelines (one per model family)."""
from .var_pipeline import VARPipeline, VARPipelineOutput
from .infinity_pipeline import InfinityPipeline, InfinityPipelineOutput
from .hart_pipeline import HARTPipeline, HARTPipelineOutput
from .flexvar_pipeline import FlexVARPipeline, FlexVARPipelineOutput

__all__ = ["VARPipeline", "VARPipelineOutput", "InfinityPipeline", "InfinityPipelineOutput", "HARTPipeline",
           "HARTPipelineOutput", "FlexVARPipeline", "FlexVARPipelineOutput"]
