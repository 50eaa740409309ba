"""A KV cache preallocated once and written in place (no ``torch.cat`` growth).

One buffer holds every layer: ``k_NRHTd`` = (layers, rows, heads, capacity, head_dim) — or one per
capacity, when a policy that compresses the cache (ScaleKV) gives the layers different ones
(``capacities``; :func:`layer_capacities`). Each layer keeps its own fill length on the host,
because per-layer pruning (FastVAR) lets layers append different token counts at the same scale.
Attention reads the sequence-sliced view ``k[layer, :, :, :length]``, which keeps the last
dimension contiguous as SDPA / flash need.
The buffers keep their addresses for the life of the cache, a precondition for CUDA graphs.

Every slot also records the absolute token position it holds, per row (``pos_NRT``; -1 = empty),
so policies can build position-based masks whatever subset each row kept. Rows of a batch whose
images keep different token counts are padded: the padding slots are marked invalid in
a per-slot validity (allocated at the first padded write) and masked out of every later attention.

``transient``: slots that only the current layer needs. Nothing attends to the last scale's keys
after that scale, so a model may size the per-layer buffers for everything but the last scale and
give the last scale a transient tail: when a layer's write runs past its capacity, the layer's
contents move into one buffer shared by all layers (``capacity + transient`` slots, ``capacity``
the largest layer's) and attention
reads them there, until the next layer takes the buffer over. For Infinity-2B at 2048 × 2048 this
holds the K/V of 19.7k tokens per layer instead of 36.1k (8.0 GB less in bf16, net of the 0.6 GB
tail), at the price of one copy of each layer's cache at the last scale.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


COMPACTED = -2     # position recorded for slots a compression filled: each head kept its own keys


class KVCache:
    def __init__(self, num_layers: int, rows: int, heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str, transient: int = 0,
                 capacities: Optional[Sequence[int]] = None):
        caps = tuple(int(c) for c in capacities) if capacities is not None else (capacity,) * num_layers
        assert len(caps) == num_layers and max(caps) <= capacity, (caps, num_layers, capacity)
        self.capacities = caps
        self._k: list = [None] * num_layers
        self._v: list = [None] * num_layers
        self._pos: list = [None] * num_layers
        self._groups: list = []            # (layers, k, v, pos) per capacity, the largest first
        groups = [(c, [i for i, x in enumerate(caps) if x == c]) for c in sorted(set(caps), reverse=True)]
        shapes = [s for c, layers in groups for s in (((len(layers), rows, heads, c, head_dim), dtype),) * 2
                  + (((len(layers), rows, c), torch.long),)]
        if transient:
            tshape = (rows, heads, capacity + transient, head_dim)
            shapes += [(tshape, dtype), (tshape, dtype), ((rows, capacity + transient), torch.long)]
        # one allocation for every buffer: freed for the decoder and made again (Infinity), a single block
        # comes back at the same address, which the captured graphs hold. Uninitialised: only written
        # slots (below each layer's length) are ever read, and a 3.5 GB memset would cost a millisecond
        # at every (re)allocation; the positions are set to -1 (empty)
        views = _carve(shapes, device)
        for g, (c, layers) in enumerate(groups):
            k, v, pos = views[3 * g:3 * g + 3]
            pos.fill_(-1)
            self._groups.append((layers, k, v, pos))
            for j, i in enumerate(layers):
                self._k[i], self._v[i], self._pos[i] = k[j], v[j], pos[j]
        self._valid: Optional[list] = None          # per layer (rows, slots) bool, once a padded write happened
        self._valid_groups: list = []
        self._undo: Optional[list] = None            # (slots, their contents) overwritten while recording (keep_undo)
        self._undo_lent: set = set()                 # layers whose lent slots were kept while recording
        self.capacity = capacity
        self.lengths = [0] * num_layers   # host ints: fill length per layer
        self.rows = rows
        self.transient = transient
        self.tail_owner: Optional[int] = None      # the layer whose contents the shared tail holds
        # (first slot, slots) of the last scale in every layer's own buffer (for_schedule sets it where
        # the layers hold it: no tail, one capacity)
        self.last_scale: Optional[tuple[int, int]] = None
        # layer -> (k, v) views of its last-scale slots lent (lend): for the cache's life, since a
        # generation that replays the lending scale from a graph does not lend again
        self._lent: dict = {}
        if transient:
            self.tail_k_RHTd, self.tail_v_RHTd, self.tail_pos_RT = views[-3:]
            self.tail_pos_RT.fill_(-1)
            self.tail_valid_RT: Optional[torch.Tensor] = None

    @classmethod
    def for_schedule(cls, num_layers: int, rows: int, heads: int, head_dim: int, token_counts: Sequence[int],
                     dtype: torch.dtype, device, slots: Optional[Sequence[Sequence[int]]] = None,
                     tail: bool = False) -> "KVCache":
        """The cache of a generation whose scales have ``token_counts`` tokens: every layer holds
        them all, or with ``slots`` (a compressing policy's ``kv_slots``, over the scales that
        run) what it keeps (:func:`layer_capacities`: a scale it compresses after, and the last
        one, pass through the transient tail); with ``tail`` the last scale's K/V go to a
        transient tail shared by the layers."""
        if slots is not None:
            token_counts = token_counts[:len(slots[0])]
            caps, need = layer_capacities(slots, token_counts)
            capacity = max(caps)
            return cls(num_layers, rows, heads, head_dim, capacity, dtype, device,
                       transient=max(0, need - capacity), capacities=caps)
        L, last = sum(token_counts), token_counts[-1]
        cache = cls(num_layers, rows, heads, head_dim, L - last if tail else L, dtype, device,
                    transient=last if tail else 0)
        if not tail:
            cache.last_scale = (L - last, last)
        return cache

    def lend(self, layer: int, count: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``count`` slots of ``layer``'s last scale as (rows, heads, count, head_dim) K and V
        views, lent for the cache's life; None where the layers' buffers hold no last
        scale (a transient tail, per-layer capacities) or it has fewer than ``count`` slots.

        Nothing reads or writes these slots before ``layer`` writes the last scale: every write of an
        earlier scale ends where that scale ends (a pruned scale writes fewer slots, never more), and
        attention reads written slots only. A policy may keep there state that an earlier layer
        reads for the last time at the last scale (SparVAR's O_cache), instead of allocating it
        beside the cache. A CUDA-graph capture's warm-up run of the last scale overwrites them
        before the captured run reads them: while :meth:`keep_undo` records, the first write into
        lent slots copies them to the host, and :meth:`undo` puts them back."""
        if self.last_scale is None or count > self.last_scale[1]:
            return None
        a = self.last_scale[0]
        self._lent[layer] = (self._k[layer][:, :, a:a + count], self._v[layer][:, :, a:a + count])
        return self._lent[layer]

    # the buffers of the layers of the largest capacity (every layer's, unless capacities differ)
    @property
    def k_NRHTd(self) -> torch.Tensor:
        return self._groups[0][1]

    @property
    def v_NRHTd(self) -> torch.Tensor:
        return self._groups[0][2]

    @property
    def pos_NRT(self) -> torch.Tensor:
        return self._groups[0][3]

    @property
    def num_layers(self) -> int:
        return len(self.lengths)

    @property
    def masked(self) -> bool:
        """True once a padded (partly invalid) write happened in this generation."""
        return self._valid is not None

    def reset(self) -> None:
        """Forget the contents (no memory is freed)."""
        self.lengths = [0] * self.num_layers
        self.rows = self._groups[0][1].shape[1]
        for _, _, _, pos in self._groups:
            pos.fill_(-1)
        self._valid, self._valid_groups = None, []
        self.tail_owner = None
        if self.transient:
            self.tail_pos_RT.fill_(-1)
            self.tail_valid_RT = None

    def _make_valid(self) -> None:
        """Per-slot validity for every layer (all valid so far): the first padded write needs it."""
        self._valid = [None] * self.num_layers
        for layers, _, _, pos in self._groups:
            valid = torch.ones_like(pos, dtype=torch.bool)
            self._valid_groups.append(valid)
            for j, i in enumerate(layers):
                self._valid[i] = valid[j]

    def _in_tail(self, layer: int, end: int) -> bool:
        if end <= self.capacities[layer]:
            return False
        if not self.transient or end > self.capacity + self.transient:
            raise AssertionError(f"KV cache overflow at layer {layer}: {end} > {self.capacities[layer]} + transient "
                                 f"{self.transient}")
        return True

    def _take_tail(self, layer: int, start: int) -> None:
        """Move ``layer``'s first ``start`` slots into the shared tail (its last scale begins)."""
        R = self.rows
        self.tail_k_RHTd[:R, :, :start].copy_(self._k[layer][:R, :, :start])
        self.tail_v_RHTd[:R, :, :start].copy_(self._v[layer][:R, :, :start])
        self.tail_pos_RT[:R, :start].copy_(self._pos[layer][:R, :start])
        if self._valid is not None:
            if self.tail_valid_RT is None:
                self.tail_valid_RT = torch.ones_like(self.tail_pos_RT, dtype=torch.bool)
            self.tail_valid_RT[:R, :start].copy_(self._valid[layer][:R, :start])
        self.tail_owner = layer

    def _buffers(self, layer: int, end: int):
        """(k, v, pos, valid-or-None) of ``layer``, each with the row dim first, for slots < end."""
        if self._in_tail(layer, end):
            assert self.tail_owner == layer, f"layer {layer}'s last-scale keys were overwritten by layer {self.tail_owner}"
            return self.tail_k_RHTd, self.tail_v_RHTd, self.tail_pos_RT, self.tail_valid_RT
        valid = self._valid[layer] if self._valid is not None else None
        return self._k[layer], self._v[layer], self._pos[layer], valid

    def reserve(self, layer: int, n: int, pos: Optional[torch.Tensor] = None,
                valid_Rn: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Claim the next ``n`` slots of ``layer``; return them as (R, H, n, d) views to write into.

        pos: absolute positions of the ``n`` tokens, (n,) shared by all rows or (R, n) per row;
            None leaves them unrecorded (the caller records a dense scale for all layers at once
            with :meth:`record_positions`).
        valid_Rn: False marks padding slots (batch rows that kept fewer tokens).
        """
        start = self.lengths[layer]
        end = start + n
        R = self.rows
        if self._undo is not None and layer in self._lent and layer not in self._undo_lent \
                and end > self.last_scale[0]:
            # a capture's warm-up writes lent slots (lend): keep them on the host until undo()
            self._undo_lent.add(layer)
            self._undo.extend((t, t.to("cpu", copy=True)) for t in self._lent[layer])
        if self._in_tail(layer, end):
            if self.tail_owner != layer:
                self._take_tail(layer, start)
            if valid_Rn is not None and self._valid is None:
                self._make_valid()
            if self._valid is not None and self.tail_valid_RT is None:
                self.tail_valid_RT = torch.ones_like(self.tail_pos_RT, dtype=torch.bool)
        elif valid_Rn is not None and self._valid is None:
            self._make_valid()
        k_RHTd, v_RHTd, pos_RT, valid_RT = self._buffers(layer, end)
        if pos is not None:
            pos_RT[:R, start:end].copy_(pos.expand(R, n))
        if valid_Rn is not None:
            valid_RT[:R, start:end].copy_(valid_Rn)
        elif valid_RT is not None:
            valid_RT[:R, start:end] = True
        self.lengths[layer] = end
        return k_RHTd[:R, :, start:end], v_RHTd[:R, :, start:end]

    def append(self, layer: int, k_RHld: torch.Tensor, v_RHld: torch.Tensor, pos: Optional[torch.Tensor] = None,
               valid_Rn: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write keys/values after what ``layer`` holds; return views of everything it holds."""
        k_dst, v_dst = self.reserve(layer, k_RHld.shape[2], pos, valid_Rn)
        k_dst.copy_(k_RHld)
        v_dst.copy_(v_RHld)
        return self.view(layer)

    def record_positions(self, start: int, pos_l: torch.Tensor) -> None:
        """Record positions ``pos_l`` — (l,) shared by all rows or (R, l) per row — for slots
        [start, start + l) of every layer (one write per capacity)."""
        end = start + pos_l.shape[-1]
        for _, k, _, pos in self._groups:
            pos[:, :self.rows, start:end] = pos_l[..., :max(0, k.shape[3] - start)]
        if end > min(self.capacities) and self.transient:     # every layer's tail holds the same positions
            self.tail_pos_RT[:self.rows, start:end] = pos_l

    def compact(self, layer: int, idx_RHn: torch.Tensor) -> None:
        """Keep only the slots ``idx_RHn`` (R, H, n) of ``layer`` — each row and head its own, in
        increasing order — moved to its first ``n`` slots (KV-cache compression). Their position
        becomes ``COMPACTED`` (heads kept different tokens). Not after a padded write."""
        assert self._valid is None, "compressing a cache with padding slots"
        R, end, n = self.rows, self.lengths[layer], idx_RHn.shape[-1]
        assert n <= self.capacities[layer], f"layer {layer} keeps {n} slots, more than its {self.capacities[layer]}"
        src_k, src_v, _, _ = self._buffers(layer, end)             # its own buffer, or the tail it is in
        k_RHTd, v_RHTd, pos_RT = self._k[layer], self._v[layer], self._pos[layer]
        if self._undo is not None:
            self._undo.extend((t, t.clone()) for t in (k_RHTd[:R, :, :n], v_RHTd[:R, :, :n], pos_RT[:R, :n]))
        take_RHnd = idx_RHn[..., None].expand(-1, -1, -1, k_RHTd.shape[-1])
        # gather reads every kept slot into a new tensor before the front slots are overwritten
        k_RHTd[:R, :, :n] = src_k[:R, :, :end].gather(2, take_RHnd)
        v_RHTd[:R, :, :n] = src_v[:R, :, :end].gather(2, take_RHnd)
        pos_RT[:R, :n] = COMPACTED
        if self.tail_owner == layer:
            self.tail_owner = None
        self.lengths[layer] = n

    def keep_undo(self) -> None:
        """From now on, keep what each :meth:`compact` and each write into lent slots (:meth:`lend`)
        overwrites, so that :meth:`undo` can put it back: a CUDA-graph capture runs a scale once
        before capturing it (engine/graphs.py), and these writes, unlike a write of new slots,
        would change what the captured run reads."""
        self._undo, self._undo_lent = [], set()

    def undo(self) -> None:
        """Put back what was overwritten since :meth:`keep_undo` (the fill lengths are host state,
        restored by the caller; lent slots stay lent) and stop keeping it."""
        for dst, saved in reversed(self._undo or []):
            dst.copy_(saved)
        self._undo = None

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        R, end = self.rows, self.lengths[layer]
        k_RHTd, v_RHTd, _, _ = self._buffers(layer, end)
        return k_RHTd[:R, :, :end], v_RHTd[:R, :, :end]

    def key_mask(self, layer: int) -> Optional[torch.Tensor]:
        """(R, 1, 1, length) bool (True = attend) once padding exists, else None (no mask)."""
        if self._valid is None:
            return None
        end = self.lengths[layer]
        valid_RT = self._buffers(layer, end)[3]
        return valid_RT[:self.rows, :end][:, None, None, :]

    def host_state(self) -> tuple:
        """The host-side bookkeeping (fill lengths, tail owner), which a CUDA-graph replay does not
        advance: the graph runner saves it at capture and sets it after each replay."""
        return tuple(self.lengths), self.tail_owner

    def set_host_state(self, state: tuple) -> None:
        lengths, self.tail_owner = state
        self.lengths = list(lengths)

    def storage_ptrs(self) -> tuple:
        """Addresses of every buffer, which captured graphs hold (a re-allocated cache invalidates them)."""
        bufs = [t for _, k, v, pos in self._groups for t in (k, v, pos)]
        if self.transient:
            bufs += [self.tail_k_RHTd, self.tail_v_RHTd, self.tail_pos_RT]
        return tuple(b.data_ptr() for b in bufs)

    def keep_rows(self, n: int) -> None:
        """Keep the first ``n`` rows (e.g. drop the unconditional CFG half). Rows are [cond; uncond]."""
        if not 0 < n <= self.rows:
            raise ValueError(f"cannot keep {n} of {self.rows} cache rows")
        self.rows = n

    def nbytes(self) -> int:
        total = sum(t.nbytes for _, k, v, pos in self._groups for t in (k, v, pos))
        total += sum(v.nbytes for v in self._valid_groups)
        if self.transient:
            total += self.tail_k_RHTd.nbytes + self.tail_v_RHTd.nbytes + self.tail_pos_RT.nbytes
            total += self.tail_valid_RT.nbytes if self.tail_valid_RT is not None else 0
        return total


def _carve(shapes: Sequence[tuple[tuple[int, ...], torch.dtype]], device) -> list[torch.Tensor]:
    """Tensors of these (shape, dtype) as views of one allocation, each at a 256-byte boundary."""
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in shapes]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // 256) * 256
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    return [buf[o:o + n].view(dtype).view(shape) for o, n, (shape, dtype) in zip(offsets, sizes, shapes)]


def layer_capacities(slots_after: Sequence[Sequence[int]], token_counts: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """(the slots each layer's own buffer needs, the slots the shared transient tail needs) when a
    policy compresses the cache (``Policy.kv_slots``: ``slots_after[layer][si]``, what the layer
    holds after scale ``si``). A layer holds what it kept plus the scale being computed; at a scale
    after which it compresses, and at the last scale, that sum lives in the tail — one layer at a
    time — and only what it keeps (or held before the last scale) in its own buffer."""
    S = len(token_counts)
    caps, need = [], 0
    for after in slots_after:
        cap = 0
        for si in range(S):
            before = after[si - 1] if si else 0
            during = before + token_counts[si]
            if si == S - 1:                                          # the last scale: through the tail
                cap, need = max(cap, before), max(need, during)
            elif after[si] < during:                                 # compressed after it: through the tail
                cap, need = max(cap, after[si]), max(need, during)
            else:
                cap = max(cap, during)
        caps.append(cap)
    return tuple(caps), need


# The full KV cache (no shared last-scale tail) is kept up to this size: the tail costs one copy of
# each layer's cache at the last scale and saves the last scale's K/V of all but one layer
KV_FULL_MAX_BYTES = 8 << 30
KV_FULL_MAX_DEVICE_FRACTION = 0.25


def kv_tail_needed(full_bytes: int, device: torch.device) -> bool:
    """Whether a KV cache of ``full_bytes`` should share one last-scale tail between its layers:
    when it is larger than 8 GiB, or than a quarter of the GPU's memory (so that a 16 GB card keeps
    the smaller cache at 1024² and an 80 GB one the faster one). Both forms give the same numbers."""
    if device.type != "cuda":
        return full_bytes > KV_FULL_MAX_BYTES
    total = torch.cuda.get_device_properties(device).total_memory
    return full_bytes > min(KV_FULL_MAX_BYTES, KV_FULL_MAX_DEVICE_FRACTION * total)
