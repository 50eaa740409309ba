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
        if not names or (self.on is not None and set(names) <= set(self.on)):        # already there (the decoder after the loop)
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



def _blocks_of(module: torch.nn.Module) -> Optional[torch.nn.ModuleList]:
    """The module's largest ``ModuleList`` by parameter count: a text encoder's layers (T5's
    ``encoder.block``, Qwen2's ``layers``)."""
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


def _tensors(module: torch.nn.Module) -> list:
    return [*module.parameters(), *module.buffers()]


def _linear_weights(block: torch.nn.Module) -> list:
    """The weight matrices of a block's ``nn.Linear`` layers: what a layer stream moves (its vectors,
    norms and gains stay on the device)."""
    return [m.weight for m in block.modules() if isinstance(m, torch.nn.Linear)]


def _slot_bytes(groups) -> int:
    """One slot's bytes: the largest group of tensors, each 256-byte aligned."""
    return _round_up(max((sum(_round_up(t.numel() * t.element_size(), ALIGN) for t in g) for g in groups),
                         default=0), SEGMENT)


def stream_bytes(module: torch.nn.Module) -> int:
    """GPU bytes of ``module`` under :class:`BlockStream`: everything but its blocks, and two slots of
    the largest block."""
    blocks = _blocks_of(module)
    inside = {id(t) for t in _tensors(blocks)} if blocks is not None else set()
    rest = sum(t.numel() * t.element_size() for t in _tensors(module) if id(t) not in inside)
    return rest + 2 * (_slot_bytes([_tensors(b) for b in blocks]) if blocks is not None else 0)


def layer_stream_bytes(blocks: Sequence[torch.nn.Module]) -> tuple[int, int]:
    """(bytes a :class:`LayerStream` of ``blocks`` keeps off the device, bytes of its two slots)."""
    groups = [_linear_weights(b) for b in blocks]
    return sum(t.numel() * t.element_size() for g in groups for t in g), 2 * _slot_bytes(groups)


class _SlotStream:
    """Groups of tensors (one per block) kept in pinned CPU memory and put on ``device`` one group at a
    time through two GPU slots that take turns: :meth:`enter` points group i's tensors at its slot
    (waiting for that slot's copy) and starts copying the next group into the other slot on a copy
    stream, which first waits until the group that last used that slot has run; :meth:`leave` points
    them back at the CPU. So the copy of group i + 1 overlaps the work of group i, and the device
    holds two groups at a time. ``cyclic``: after the last group the first is fetched again (a
    transformer's layers run once per scale)."""

    def __init__(self, groups: Sequence[Sequence[torch.Tensor]], device: torch.device, cyclic: bool):
        self.device, self.cyclic = torch.device(device), cyclic
        self.host = []                                     # per group: [(tensor whose .data is swapped, pinned copy)]
        for g in groups:
            pairs = []
            for t in g:
                pinned = t.data.to("cpu").pin_memory()
                pairs.append((t, pinned))
                t.data = pinned
            self.host.append(pairs)
        self.slot_bytes = _slot_bytes([[p for _, p in pairs] for pairs in self.host])
        self.views: Optional[list] = None                  # per group: its tensors' views into its slot
        self.slots: Optional[torch.Tensor] = None          # (2, slot_bytes) uint8
        self.copy_stream = torch.cuda.Stream(self.device)
        self.holds = [-1, -1]                              # the group whose copy each slot holds (or is getting)
        self.copied: list = [None, None]                   # per slot: event after its copy
        self.used: list = [None, None]                     # per slot: event after the last group that read it

    def _allocate(self) -> None:
        self.slots = torch.empty(2, self.slot_bytes, dtype=torch.uint8, device=self.device)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))     # the slots exist before the copies
        self.views = []
        for i, pairs in enumerate(self.host):
            offset, views = 0, []
            for _, p in pairs:
                n = p.numel() * p.element_size()
                views.append(self.slots[i % 2, offset:offset + n].view(p.dtype).view(p.shape))
                offset += _round_up(n, ALIGN)
            self.views.append(views)

    def _copy(self, i: int) -> None:
        """Start copying group ``i`` into its slot, once the group that last read the slot has run."""
        k = i % 2
        with torch.cuda.stream(self.copy_stream):
            if self.used[k] is not None:
                self.copy_stream.wait_event(self.used[k])
            for (_, pinned), view in zip(self.host[i], self.views[i]):
                view.copy_(pinned, non_blocking=True)
            self.copied[k] = torch.cuda.Event()
            self.copied[k].record(self.copy_stream)
        self.holds[k] = i

    def enter(self, i: int) -> None:
        """Group ``i``'s tensors on the device (work queued after this reads them)."""
        if self.slots is None:
            self._allocate()
        k = i % 2
        if self.holds[k] != i:
            self._copy(i)
        torch.cuda.current_stream(self.device).wait_event(self.copied[k])
        for (t, _), view in zip(self.host[i], self.views[i]):
            t.data = view
        n = len(self.host)
        j = (i + 1) % n if self.cyclic else i + 1
        if j < n and j % 2 != k and self.holds[j % 2] != j:     # (an odd count's wrap shares i's slot: not yet)
            self._copy(j)

    def leave(self, i: int) -> None:
        """Group ``i``'s tensors back on their CPU copies (its slot is free once the work queued so far
        has run)."""
        k = i % 2
        self.used[k] = torch.cuda.Event()
        self.used[k].record(torch.cuda.current_stream(self.device))
        for t, pinned in self.host[i]:
            t.data = pinned

    def forget(self) -> None:
        """Copy every group again at its next :meth:`enter` (its CPU copy may have changed)."""
        self.holds = [-1, -1]

    def release(self) -> None:
        """Free the two slots (the next :meth:`enter` allocates them again); every group back on its CPU
        copy, also after work that raised between an enter and its leave."""
        self.copy_stream.synchronize()
        torch.cuda.current_stream(self.device).synchronize()
        for pairs in self.host:
            for t, pinned in pairs:
                t.data = pinned
        self.slots, self.views, self.holds = None, None, [-1, -1]
        self.copied, self.used = [None, None], [None, None]


class BlockStream(_SlotStream):
    """A module (a text encoder) whose blocks live in pinned CPU memory and stream to ``device`` as its
    ``forward`` reaches them (a forward pre-hook enters a block, a forward hook leaves it); the rest
    of it (embeddings, final norm) stays on ``device``. The GPU holds two blocks at a time
    (:func:`stream_bytes`)."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        blocks = _blocks_of(module)
        if blocks is None:
            raise ValueError(f"{type(module).__name__} has no list of blocks to stream")
        inside = {id(t) for t in _tensors(blocks)}
        for t in _tensors(module):
            if id(t) not in inside:
                t.data = t.data.to(device)
        super().__init__([_tensors(b) for b in blocks], device, cyclic=False)
        self.blocks = blocks
        self.handles = []
        for i, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(lambda m, args, i=i: self.enter(i)))
            self.handles.append(block.register_forward_hook(lambda m, args, out, i=i: self.leave(i)))

    def close(self) -> None:
        """Stop streaming: the hooks go; the blocks stay in (pinned) CPU memory, the rest on the device."""
        self.release()
        for h in self.handles:
            h.remove()
        self.handles.clear()


class LayerStream(_SlotStream):
    """A transformer whose blocks' linear weights (nearly all of its weights) live in pinned CPU
    memory and stream to ``device`` layer by layer as the engine runs them (engine/layers.py enters
    and leaves each layer; a family's ``begin`` walks its blocks through
    :meth:`~..engine.adapter.ModelAdapter.streamed_blocks`); everything else of the transformer — the
    blocks' vectors and norms, embeddings, head — stays on ``device``. The GPU holds two blocks'
    matrices at a time (:func:`layer_stream_bytes`); each scale copies every block once."""

    def __init__(self, blocks: Sequence[torch.nn.Module], device: torch.device):
        super().__init__([_linear_weights(b) for b in blocks], device, cyclic=True)

    def close(self) -> None:
        """Stop streaming: the matrices stay in (pinned) CPU memory."""
        self.release()
