"""The model-agnostic staged sampler (DESIGN.md §2). Its public names are imported at first use
(PEP 562), so that a light submodule (``engine.limits``) does not import torch."""
from __future__ import annotations

from .._lazy import lazy_exports

_SOURCE = {"KVCache": ".kv_cache", "GenerationResult": ".sampler", "generate": ".sampler",
           "ScaleSchedule": ".schedule", "GenerationStats": ".state", "ModelInfo": ".state", "RunState": ".state",
           "SamplingSettings": ".state", "ScaleStats": ".state"}

__all__ = ["generate", "GenerationResult", "KVCache", "ScaleSchedule", "GenerationStats", "RunState",
           "SamplingSettings", "ScaleStats", "ModelInfo"]


__getattr__, __dir__ = lazy_exports(__name__, _SOURCE)
