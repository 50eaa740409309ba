"""The one module that imports ComfyUI (the V3 schema API and the runtime services the nodes use).

Everything else in the package imports without ComfyUI; the root ``__init__`` imports ``nodes``
only when ComfyUI itself is loading this folder.
"""
from comfy_api.latest import io  # noqa: F401

import comfy.model_management as model_management  # noqa: F401
import comfy.model_patcher as model_patcher  # noqa: F401
import comfy.utils as comfy_utils  # noqa: F401
import folder_paths  # noqa: F401
