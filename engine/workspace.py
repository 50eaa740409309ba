"""What an adapter keeps between calls of one generation shape: the base of every family's workspace."""
from __future__ import annotations

from typing import Any, Optional

import torch


class Workspace:
    """Buffers of one batch size and schedule, reused across generations of that shape (an adapter
    keeps one at a time and frees it before making another). A family's workspace adds its static
    buffers (latent, per-row conditioning) and sets ``kv``; the base holds every token's position
    (``positions_L``, read by the layer loop) and what the engine keeps for later calls of this
    shape: policies' constants derived from shapes (``policy_cache``, read through
    ``run.shape_cache``) and the CUDA graphs captured for it with their memory pool, input buffers
    and pre-drawn noise (engine/graphs.py)."""

    def __init__(self, device, total_tokens: int):
        self.device = torch.device(device)
        self.positions_L = torch.arange(total_tokens, device=self.device)   # every token's absolute position
        self.kv: Any = None
        self.policy_cache: dict = {}
        self.graphs: dict = {}
        self.graph_pool: Optional[Any] = None
        self.static_inputs: dict = {}             # buffers captured graphs read (token subsets, plan tensors)
        self.scale_graph_settings: Optional[Any] = None
        self.scale_noise: dict = {}
