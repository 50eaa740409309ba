"""diffusers-style pipelines (one per model family), imported at first use (PEP 562): importing a
submodule such as ``pipelines.defaults`` does not import every pipeline, torch and diffusers."""
from __future__ import annotations

_SOURCE = {"VARPipeline": ".var_pipeline", "VARPipelineOutput": ".var_pipeline",
           "InfinityPipeline": ".infinity_pipeline", "InfinityPipelineOutput": ".infinity_pipeline",
           "HARTPipeline": ".hart_pipeline", "HARTPipelineOutput": ".hart_pipeline",
           "FlexVARPipeline": ".flexvar_pipeline", "FlexVARPipelineOutput": ".flexvar_pipeline"}

__all__ = list(_SOURCE)


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
