"""A KV cache preallocated once and written in place (no ``torch.cat`` growth).

One buffer holds every layer: ``k_NRHTd`` = (layers, rows, heads, capacity, head_dim). Each layer
keeps its own fill length on the host, because per-layer pruning (FastVAR) lets layers append
different token counts at the same scale. Attention reads the sequence-sliced view
``k[layer, :, :, :length]``, which keeps the last dimension contiguous as SDPA / flash need.
The buffers keep their addresses for the life of the cache, a precondition for CUDA graphs.

Every slot also records the absolute token position it holds, per row (``pos_NRT``; -1 = empty),
so policies can build position-based masks whatever subset each row kept. Rows of a batch whose
images keep different token counts are padded: the padding slots are marked invalid in
``valid_NRT`` (allocated at the first padded write) and masked out of every later attention.
"""
from __future__ import annotations

from typing import Optional

import torch


class KVCache:
    def __init__(self, num_layers: int, rows: int, heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, rows, heads, capacity, head_dim)
        self.k_NRHTd = torch.zeros(shape, dtype=dtype, device=device)
        self.v_NRHTd = torch.zeros(shape, dtype=dtype, device=device)
        self.pos_NRT = torch.full((num_layers, rows, capacity), -1, dtype=torch.long, device=device)
        self.valid_NRT: Optional[torch.Tensor] = None
        self.capacity = capacity
        self.lengths = [0] * num_layers   # host ints: fill length per layer
        self.rows = rows

    @property
    def num_layers(self) -> int:
        return len(self.lengths)

    @property
    def masked(self) -> bool:
        """True once a padded (partly invalid) write happened in this generation."""
        return self.valid_NRT is not None

    def reset(self) -> None:
        """Forget the contents (no memory is freed)."""
        self.lengths = [0] * self.num_layers
        self.rows = self.k_NRHTd.shape[1]
        self.pos_NRT.fill_(-1)
        self.valid_NRT = None

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
        assert end <= self.capacity, f"KV cache overflow: {end} > {self.capacity}"
        R = self.rows
        if pos is not None:
            self.pos_NRT[layer, :R, start:end].copy_(pos.expand(R, n))
        if valid_Rn is not None:
            if self.valid_NRT is None:
                self.valid_NRT = torch.ones_like(self.pos_NRT, dtype=torch.bool)
            self.valid_NRT[layer, :R, start:end].copy_(valid_Rn)
        elif self.valid_NRT is not None:
            self.valid_NRT[layer, :R, start:end] = True
        self.lengths[layer] = end
        return self.k_NRHTd[layer, :R, :, start:end], self.v_NRHTd[layer, :R, :, start:end]

    def append(self, layer: int, k_RHld: torch.Tensor, v_RHld: torch.Tensor, pos: Optional[torch.Tensor] = None,
               valid_Rn: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write keys/values after what ``layer`` holds; return views of everything it holds."""
        k_dst, v_dst = self.reserve(layer, k_RHld.shape[2], pos, valid_Rn)
        k_dst.copy_(k_RHld)
        v_dst.copy_(v_RHld)
        return self.view(layer)

    def record_positions(self, start: int, pos_l: torch.Tensor) -> None:
        """Record positions ``pos_l`` for slots [start, start + l) of every layer (one write)."""
        self.pos_NRT[:, :self.rows, start:start + pos_l.shape[0]] = pos_l

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        R, end = self.rows, self.lengths[layer]
        return self.k_NRHTd[layer, :R, :, :end], self.v_NRHTd[layer, :R, :, :end]

    def key_mask(self, layer: int) -> Optional[torch.Tensor]:
        """(R, 1, 1, length) bool (True = attend) once padding exists, else None (no mask)."""
        if self.valid_NRT is None:
            return None
        return self.valid_NRT[layer, :self.rows, :self.lengths[layer]][:, None, None, :]

    def keep_rows(self, n: int) -> None:
        """Keep the first ``n`` rows (e.g. drop the unconditional CFG half). Rows are [cond; uncond]."""
        if not 0 < n <= self.rows:
            raise ValueError(f"cannot keep {n} of {self.rows} cache rows")
        self.rows = n

    def nbytes(self) -> int:
        extra = self.valid_NRT.nbytes if self.valid_NRT is not None else 0
        return self.k_NRHTd.nbytes + self.v_NRHTd.nbytes + self.pos_NRT.nbytes + extra
