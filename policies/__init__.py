"""Acceleration methods as policies over the staged sampler (one file per method)."""
from ..engine.contract import DENSE, Policy, PolicyStack, ScalePlan, SubLayer, SubLayerContext
from .fastvar import FASTVAR_PRESETS, FastVARConfig, FastVARPolicy
from .scale_skip import ScaleSkipConfig, ScaleSkipPolicy
from .scalekv import SCALEKV_PRESETS, ScaleKVConfig, ScaleKVPolicy
from .sparsevar import SPARSEVAR_PRESETS, SparseVARConfig, SparseVARPolicy
from .sparvar import SPARVAR_PRESETS, SparVARConfig, SparVARPolicy

__all__ = ["Policy", "PolicyStack", "ScalePlan", "SubLayer", "SubLayerContext", "DENSE",
           "SparseVARConfig", "SparseVARPolicy", "SPARSEVAR_PRESETS",
           "FastVARConfig", "FastVARPolicy", "FASTVAR_PRESETS",
           "SparVARConfig", "SparVARPolicy", "SPARVAR_PRESETS",
           "ScaleSkipConfig", "ScaleSkipPolicy", "ScaleKVConfig", "ScaleKVPolicy", "SCALEKV_PRESETS"]
