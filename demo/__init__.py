"""The embedded demo model: procedural scenes, its training command and its classifier.

``DEMO_MODEL_DIR`` is the trained ``VARPipeline`` folder that ships with the package (loaded by
``VARPipeline.from_demo()`` and by ``sparsevar generate`` when no model is given).
"""
from pathlib import Path

from .scenes import CLASS_NAMES, NUM_CLASSES, SceneConfig, class_id, render_scenes

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "weights"

__all__ = ["CLASS_NAMES", "DEMO_MODEL_DIR", "NUM_CLASSES", "SceneConfig", "class_id", "render_scenes"]
