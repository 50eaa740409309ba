"""The few layers every model family shares."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class TanhGeluFFN(nn.Module):
    """fc1 → GELU (tanh approximation) → fc2; keys ``fc1``, ``fc2``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def layer_norm_no_affine(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim without affine parameters, computed in float32."""
    return F.layer_norm(x.float(), (x.shape[-1],), eps=eps)


def trunc_normal_init_(module: nn.Module, std: float = 0.02) -> None:
    """Random weights for models built by size alone (benchmarks, demos): trunc-normal linears and
    embeddings, zero biases. Not the official training init."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.trunc_normal_(m.weight, std=std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
