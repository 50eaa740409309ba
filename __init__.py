"""SparseVAR: fast next-scale-prediction image generation with training-free acceleration.

The repository root is both the pip package ``sparsevar`` and a ComfyUI node folder. Importing it
never imports ComfyUI; the nodes are registered only when ComfyUI itself loads this folder.
"""
from __future__ import annotations

from .engine import GenerationStats, SamplingSettings, ScaleSchedule
from .models import MultiScaleVQVAE, VARTransformer, load_var_transformer, load_var_vqvae
from .pipelines import VARPipeline, VARPipelineOutput
from .pipelines import InfinityPipeline, InfinityPipelineOutput
from .pipelines import HARTPipeline, HARTPipelineOutput
from .pipelines import FlexVARPipeline, FlexVARPipelineOutput
from .models.hart import HARTTransformer
from .models.flexvar import FlexVARTransformer
from .models.flexvar_vq import FlexVQ16
from .models.infinity import InfinityTransformer
from .models.bsq_vae import BSQVAE
from .models.loading import load_hart_tokenizer, load_hart_transformer, load_infinity_transformer, load_infinity_vae
from .policies import (FastVARConfig, Policy, PolicyStack, ScaleKVConfig, ScalePlan, ScaleSkipConfig,
                       SparseVARConfig, SparVARConfig, FASTVAR_PRESETS, SCALEKV_PRESETS, SPARSEVAR_PRESETS,
                       SPARVAR_PRESETS)

# diffusers resolves saved components by looking up its loading base classes on the library module
# named in model_index.json ("sparsevar"); exposing them here keeps such folders loadable by
# DiffusionPipeline machinery too (research/ecosystem.md §4.3).
from diffusers import ConfigMixin, ModelMixin  # noqa: E402,F401

__version__ = "0.1.0"

__all__ = ["VARPipeline", "VARPipelineOutput", "VARTransformer", "MultiScaleVQVAE", "load_var_transformer",
           "load_var_vqvae", "GenerationStats", "SamplingSettings", "ScaleSchedule", "Policy", "PolicyStack",
           "ScalePlan", "SparseVARConfig", "FastVARConfig", "ScaleSkipConfig", "SparVARConfig", "SPARSEVAR_PRESETS",
           "FASTVAR_PRESETS", "SPARVAR_PRESETS", "ScaleKVConfig", "SCALEKV_PRESETS", "__version__",
           "InfinityPipeline", "InfinityPipelineOutput", "InfinityTransformer", "BSQVAE", "load_infinity_transformer",
           "load_infinity_vae", "HARTPipeline", "HARTPipelineOutput", "HARTTransformer", "load_hart_transformer",
           "load_hart_tokenizer", "FlexVARPipeline", "FlexVARPipelineOutput", "FlexVARTransformer", "FlexVQ16"]


def _inside_comfyui() -> bool:
    import sys
    return "comfy" in sys.modules and "folder_paths" in sys.modules


NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
if _inside_comfyui():  # pragma: no cover - exercised by the ComfyUI tests
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F401,F811
