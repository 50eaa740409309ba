"""SparseVAR: fast next-scale-prediction image generation with training-free acceleration.

The repository root is both the pip package ``sparsevar`` and a ComfyUI node folder. Importing it
never imports ComfyUI; the nodes are registered only when ComfyUI itself loads this folder.
"""
from __future__ import annotations

from ._lazy import lazy_exports

# the public names, imported at first use (PEP 562): the CLI parses and checks its arguments, and a
# wrong one gets its error line, before torch and diffusers are imported
_PUBLIC = {
    ".engine": ("GenerationStats", "SamplingSettings", "ScaleSchedule"),
    ".models": ("MultiScaleVQVAE", "VARTransformer", "load_var_transformer", "load_var_vqvae"),
    ".pipelines": ("VARPipeline", "VARPipelineOutput", "InfinityPipeline", "InfinityPipelineOutput", "HARTPipeline",
                   "HARTPipelineOutput", "FlexVARPipeline", "FlexVARPipelineOutput"),
    ".models.hart": ("HARTTransformer",),
    ".models.flexvar": ("FlexVARTransformer",),
    ".models.flexvar_vq": ("FlexVQ16",),
    ".models.infinity": ("InfinityTransformer",),
    ".models.bsq_vae": ("BSQVAE",),
    ".models.loading": ("load_hart_tokenizer", "load_hart_transformer", "load_infinity_transformer",
                        "load_infinity_vae"),
    ".policies": ("FastVARConfig", "Policy", "PolicyStack", "ScaleKVConfig", "ScalePlan", "ScaleSkipConfig",
                  "SparseVARConfig", "SparVARConfig", "FASTVAR_PRESETS", "SCALEKV_PRESETS", "SPARSEVAR_PRESETS",
                  "SPARVAR_PRESETS"),
    # diffusers resolves saved components by looking up its loading base classes on the library module
    # named in model_index.json ("sparsevar"); exposing them here keeps such folders loadable by
    # DiffusionPipeline machinery too (research/ecosystem.md §4.3)
    "diffusers": ("ConfigMixin", "ModelMixin"),
}
_SOURCE = {name: module for module, names in _PUBLIC.items() for name in names}


__getattr__, __dir__ = lazy_exports(__name__, _SOURCE)


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
