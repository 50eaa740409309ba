"""Model CPU offload with diffusers' semantics: every component lives in CPU memory and is on the
GPU only while it runs (the text encoder for the prompt, the transformer for the scale loop — with
the tokenizer, where its quantizer works in the loop —, the tokenizer for the picture); those
before leave first.

diffusers does this with accelerate hooks on each component's ``forward``, but generation here
never calls the transformer's or the tokenizer's ``forward`` (the engine drives their parts), so
the hooks would not fire; the pipelines call :meth:`ModelOffload.load` where each phase begins.

Each component's weights are kept once in pinned (page-locked) CPU memory, so a load is one fast
host-to-device copy and an offload only drops the GPU copy. Every load goes into one GPU buffer,
the weight buffer, sized for the largest group of components that load together and allocated at
the first load: the components take turns in it instead of each allocating and freeing its own,
which on a small card splits the caching allocator's segments until the next call's weights no
longer fit (a freed 2.4 GB text-encoder segment, reused for the KV cache, cannot then take the
4.3 GB transformer), and the transformer comes back at the same address call after call, so its
captured CUDA graphs stay valid. The buffer stays between calls; :meth:`ModelOffload.release`
frees it.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

ALIGN = 256                 # bytes: where each tensor starts in the weight buffer
SEGMENT = 2 << 20           # the caching allocator's large-segment granule: no split-off tail


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


class ModelOffload:
    """The components of a pipeline (``name → module``), offloaded to pinned CPU memory, loaded onto
    ``device`` one at a time."""

    def __init__(self, components: Mapping[str, torch.nn.Module], device: torch.device,
                 groups: Sequence[Sequence[str]] = ()):
        """``groups``: the sets of components that load together (each component alone is one too);
        the weight buffer holds the largest."""
        self.device = torch.device(device)
        self.host: dict[str, list] = {}             # name → [(tensor whose .data is swapped, pinned copy)]
        self.on: Optional[tuple[str, ...]] = None
        self.buffer: Optional[torch.Tensor] = None  # the weight buffer, (buffer_bytes,) uint8 on the device
        for name, module in components.items():
            tensors = []
            for t in (*module.parameters(), *module.buffers()):
                pinned = t.data.to("cpu").pin_memory()
                tensors.append((t, pinned))
                t.data = pinned
            self.host[name] = tensors
        sets = [(n,) for n in self.host] + [tuple(g) for g in groups]
        self.buffer_bytes = _round_up(max((self._span(g) for g in sets), default=0), SEGMENT)

    def _span(self, names) -> int:
        """Bytes components ``names`` take in the weight buffer (each tensor 256-byte aligned)."""
        return sum(_round_up(p.numel() * p.element_size(), ALIGN) for n in names if n in self.host
                   for _, p in self.host[n])

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
        if self._span(names) > self.buffer_bytes:            # a group the constructor was not told of
            self.release()
            self.buffer_bytes = _round_up(self._span(names), SEGMENT)
        if self.buffer is None:
            self.buffer = torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device)
        offset = 0
        for t, pinned in (x for n in names for x in self.host[n]):
            n = pinned.numel() * pinned.element_size()
            # stream-ordered: the copy overwrites the previous group only after the work queued on it
            view = self.buffer[offset:offset + n].view(pinned.dtype).view(pinned.shape)
            view.copy_(pinned, non_blocking=True)
            t.data = view
            offset += _round_up(n, ALIGN)
        self.on = names

    def offload(self) -> None:
        """Every component back to its CPU copy (the weight buffer stays for the next load)."""
        if self.on is None:
            return
        for name in self.on:
            for t, pinned in self.host[name]:
                t.data = pinned
        self.on = None

    def release(self) -> None:
        """Offload, and free the weight buffer (the next load allocates it again)."""
        self.offload()
        self.buffer = None

    def close(self) -> None:
        """Offload, and stop: the components stay in (pinned) CPU memory."""
        self.release()
        self.host.clear()

