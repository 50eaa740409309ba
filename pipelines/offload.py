"""Model CPU offload with diffusers' semantics: every component lives in CPU memory and is on the
GPU only while it runs (the text encoder for the prompt, the transformer for the scale loop — with
the tokenizer, where its quantizer works in the loop —, the tokenizer for the picture); those
before leave first.

diffusers does this with accelerate hooks on each component's ``forward``, but generation here
never calls the transformer's or the tokenizer's ``forward`` (the engine drives their parts), so
the hooks would not fire; the pipelines call :meth:`ModelOffload.load` where each phase begins.

Each component's weights are kept once in pinned (page-locked) CPU memory, so a load is one fast
host-to-device copy and an offload only drops the GPU copy; a component's GPU weights are one
allocation, which the caching allocator hands back at the same address call after call, so the
transformer's captured CUDA graphs stay valid across calls.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch


class ModelOffload:
    """The components of a pipeline (``name → module``), offloaded to pinned CPU memory, loaded onto
    ``device`` one at a time."""

    def __init__(self, components: Mapping[str, torch.nn.Module], device: torch.device):
        self.device = torch.device(device)
        self.host: dict[str, list] = {}             # name → [(tensor whose .data is swapped, pinned copy)]
        self.on: Optional[tuple[str, ...]] = None
        for name, module in components.items():
            tensors = []
            for t in (*module.parameters(), *module.buffers()):
                pinned = t.data.to("cpu").pin_memory()
                tensors.append((t, pinned))
                t.data = pinned
            self.host[name] = tensors

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.host)

    def nbytes(self, name: str) -> int:
        return sum(p.numel() * p.element_size() for _, p in self.host[name])

    def load(self, *names: str) -> None:
        """Put components ``names`` on the device (those there before go back to the CPU first)."""
        names = tuple(n for n in self.host if n in names)
        if self.on == names:
            return
        self.offload()
        tensors = [x for n in names for x in self.host[n]]
        sizes = [p.numel() * p.element_size() for _, p in tensors]
        total = sum(-(-n // 256) * 256 for n in sizes)
        buf = torch.empty(total, dtype=torch.uint8, device=self.device)
        offset = 0
        for (t, pinned), n in zip(tensors, sizes):
            view = buf[offset:offset + n].view(pinned.dtype).view(pinned.shape)
            view.copy_(pinned, non_blocking=True)
            t.data = view
            offset += -(-n // 256) * 256
        self.on = names

    def offload(self) -> None:
        """Every component back to its CPU copy (the GPU copies are freed)."""
        if self.on is None:
            return
        for name in self.on:
            for t, pinned in self.host[name]:
                t.data = pinned
        self.on = None

    def close(self) -> None:
        """Offload, and stop: the components stay in (pinned) CPU memory."""
        self.offload()
        self.host.clear()

