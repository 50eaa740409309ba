"""The model-agnostic staged sampler (DESIGN.md §2). Its public names are imported at first use
(PEP 562), so that a light submodule (``engine.limits``) does not import torch."""
from __future__ import annotations

_SOURCE = {"KVCache": ".kv_cache", "GenerationResult": ".sampler", "generate": ".sampler",
           "ScaleSchedule": ".schedule", "GenerationStats": ".state", "ModelInfo": ".state", "RunState": ".state",
           "SamplingSettings": ".state", "ScaleStats": ".state"}

__all__ = ["generate", "GenerationResult", "KVCache", "ScaleSchedule", "GenerationStats", "RunState",
           "SamplingSettings", "ScaleStats", "ModelInfo"]


def __getattr__(name: str):
    module = _SOURCE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_SOURCE))
