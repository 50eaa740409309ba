"""Lets diffusers' DiffusionPipeline.from_pretrained(this folder, trust_remote_code=True) load it
with the class of the installed sparsevar package; nothing else runs here."""
from sparsevar import VARPipeline  # noqa: F401
