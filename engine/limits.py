"""Limits of the sampling settings, in a module without torch (the CLI checks its flags with them
before torch is imported)."""

GUIDANCE_SCALE_MAX = 100.0        # classifier-free guidance: 0 … this
