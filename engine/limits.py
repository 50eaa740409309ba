"""Limits of the sampling settings, in a module without torch (the CLI checks its flags with them
before torch is imported)."""

GUIDANCE_SCALE_MAX = 100.0
"""The largest guidance scale accepted. Past a few units guidance only sharpens sampling towards
greedy (``top_k=1`` is greedy outright); far larger values overflow the guided logits to inf, which
samples garbage."""
