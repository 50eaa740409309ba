"""Infinity (FoundationVision/Infinity), the bitwise text-to-image family: its sizes and positions
(``resolution.py``), the transformer (``transformer.py``) and its engine adapter (``adapter.py``)."""
from .adapter import InfinityAdapter, InfinityConditioning
from .resolution import (DEFAULT_RESOLUTION, INFINITY_TEMPLATES, PN_SCALES, TRAINED_SCALES, VAE_STRIDE,
                         ZERO_SHOT_PN, InfinityResolution, infinity_resolution, infinity_resolutions, level_index,
                         resolve_resolution, rope_cos_sin, rope_positions, zero_shot_resolutions)
from .transformer import (INFINITY_PRESETS, InfinityCrossAttention, InfinityTransformer, ffn_hidden, infinity_loop_flops,
                          text_pool_heads)

__all__ = ["InfinityTransformer", "InfinityAdapter", "InfinityConditioning", "InfinityResolution", "INFINITY_PRESETS",
           "INFINITY_TEMPLATES", "PN_SCALES", "TRAINED_SCALES", "ZERO_SHOT_PN", "VAE_STRIDE", "zero_shot_resolutions",
           "DEFAULT_RESOLUTION", "infinity_resolution", "infinity_resolutions", "resolve_resolution", "rope_cos_sin",
           "rope_positions", "level_index", "infinity_loop_flops", "text_pool_heads", "ffn_hidden",
           "InfinityCrossAttention"]
