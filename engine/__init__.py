"""The model-agnostic staged sampler (DESIGN.md §2)."""
from .kv_cache import KVCache
from .sampler import GenerationResult, generate
from .schedule import ScaleSchedule
from .state import GenerationStats, ModelInfo, RunState, SamplingSettings, ScaleStats

__all__ = ["generate", "GenerationResult", "KVCache", "ScaleSchedule", "GenerationStats", "RunState",
           "SamplingSettings", "ScaleStats", "ModelInfo"]
