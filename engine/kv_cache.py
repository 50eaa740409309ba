"""A KV cache preallocated once and written in place (no ``torch.cat`` growth).

One buffer holds every layer: ``k_NRHTd`` = (layers, rows, heads, capacity, head_dim). Each layer
keeps its own fill length on the host, because per-layer pruning (FastVAR) lets layers append
different token counts at the same scale. Attention reads the sequence-sliced view
``k[layer, :, :, :length]``, which keeps the last dimension contiguous as SDPA / flash need.
The buffers keep their addresses for the life of the cache, a precondition for CUDA graphs.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, rows: int, heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, rows, heads, capacity, head_dim)
        self.k_NRHTd = torch.zeros(shape, dtype=dtype, device=device)
        self.v_NRHTd = torch.zeros(shape, dtype=dtype, device=device)
        # absolute token position (on the dense concatenated token axis) of every filled slot
        self.pos_NT = torch.full((num_layers, capacity), -1, dtype=torch.long, device=device)
        self.capacity = capacity
        self.lengths = [0] * num_layers   # host ints: fill length per layer
        self.rows = rows

    @property
    def num_layers(self) -> int:
        return len(self.lengths)

    def reset(self) -> None:
        """Forget the contents (no memory is freed or zeroed)."""
        self.lengths = [0] * self.num_layers
        self.rows = self.k_NRHTd.shape[1]
        self.pos_NT.fill_(-1)

    def append(self, layer: int, k_RHld: torch.Tensor, v_RHld: torch.Tensor,
               pos_l: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this scale's keys/values of ``layer`` after what it holds; return views of all of it."""
        start = self.lengths[layer]
        n = k_RHld.shape[2]
        end = start + n
        assert end <= self.capacity, f"KV cache overflow: {end} > {self.capacity}"
        R = self.rows
        self.k_NRHTd[layer, :R, :, start:end].copy_(k_RHld)
        self.v_NRHTd[layer, :R, :, start:end].copy_(v_RHld)
        if pos_l is not None:
            self.pos_NT[layer, start:end].copy_(pos_l)
        self.lengths[layer] = end
        return self.k_NRHTd[layer, :R, :, :end], self.v_NRHTd[layer, :R, :, :end]

    def reserve(self, layer: int, n: int, pos_l: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Claim the next ``n`` slots of ``layer`` and return them as (R, H, n, d) views to write
        into (e.g. from a fused kernel); ``view`` then includes them."""
        start = self.lengths[layer]
        end = start + n
        assert end <= self.capacity, f"KV cache overflow: {end} > {self.capacity}"
        if pos_l is not None:
            self.pos_NT[layer, start:end].copy_(pos_l)
        self.lengths[layer] = end
        R = self.rows
        return self.k_NRHTd[layer, :R, :, start:end], self.v_NRHTd[layer, :R, :, start:end]

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        R, end = self.rows, self.lengths[layer]
        return self.k_NRHTd[layer, :R, :, :end], self.v_NRHTd[layer, :R, :, :end]

    def keep_rows(self, n: int) -> None:
        """Keep the first ``n`` rows (e.g. drop the unconditional CFG half). Rows are [cond; uncond]."""
        if not 0 < n <= self.rows:
            raise ValueError(f"cannot keep {n} of {self.rows} cache rows")
        self.rows = n

    def nbytes(self) -> int:
        return self.k_NRHTd.nbytes + self.v_NRHTd.nbytes + self.pos_NT.nbytes
