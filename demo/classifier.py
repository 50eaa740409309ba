"""A small CNN that names the class of a demo scene: the judge of the demo model's quality tests."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

INPUT_SIZE = 64


class SceneClassifier(nn.Module):
    """Four strided conv layers and a linear head over 64×64 inputs (≈0.4 M parameters).

    forward: images (B, 3, H, W) in [0, 1], any size (resized with antialiasing) → logits (B, K).
    """

    def __init__(self, num_classes: int):
        super().__init__()
        chans = (3, 32, 64, 128, 256)
        self.convs = nn.ModuleList(nn.Conv2d(a, b, 3, stride=2, padding=1) for a, b in zip(chans, chans[1:]))
        self.norms = nn.ModuleList(nn.GroupNorm(8, b) for b in chans[1:])
        self.head = nn.Linear(chans[-1], num_classes)

    def forward(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        x = img_B3HW.float()
        if x.shape[-2:] != (INPUT_SIZE, INPUT_SIZE):
            x = F.interpolate(x, size=(INPUT_SIZE, INPUT_SIZE), mode="bilinear", antialias=True, align_corners=False)
        x = x * 2 - 1
        for conv, norm in zip(self.convs, self.norms):
            x = F.silu(norm(conv(x)))
        return self.head(x.mean(dim=(2, 3)))

    @classmethod
    def from_file(cls, path, num_classes: int) -> "SceneClassifier":
        from safetensors.torch import load_file

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: `sparsevar train-demo --stages classifier --out "
                                    f"{path.parent}` trains it")
        model = cls(num_classes)
        model.load_state_dict({k: v.float() for k, v in load_file(path).items()})
        return model.eval().requires_grad_(False)
