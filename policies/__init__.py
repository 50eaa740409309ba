"""Acceleration methods as policies over the staged sampler (one file per method)."""
from .base import DENSE, Policy, PolicyStack, ScalePlan, SubLayer, SubLayerContext

__all__ = ["Policy", "PolicyStack", "ScalePlan", "SubLayer", "SubLayerContext", "DENSE"]
