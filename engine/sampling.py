"""Top-k / top-p sampling of codebook logits, drawing only from the caller's ``torch.Generator``.

Semantics follow the official VAR sampler (research/var.md §3.9):
- top_k > 0: logits strictly below the k-th largest become -inf (ties at the threshold survive);
- top_p > 0: sorted ascending, entries whose cumulative probability is <= 1 - top_p become -inf; the
  largest entry always survives;
- one draw per token from softmax(masked logits).
With a generator on the logits' device the draw is ``torch.multinomial`` (the reference call, so CPU
runs reproduce the official random stream); with a generator on another device (a CPU generator for
a CUDA model, the diffusers habit) uniforms are drawn from it and inverted through the CDF on the
logits' device. Neither path syncs the host.
"""
from __future__ import annotations

import torch


def filter_top_k_top_p(logits_NV: torch.Tensor, top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
    """A masked copy of ``logits_NV`` (the input is not modified)."""
    V = logits_NV.shape[-1]
    out = logits_NV
    if top_k > 0 and top_k < V:
        kth = torch.topk(out, top_k, dim=-1, largest=True, sorted=False).values.amin(dim=-1, keepdim=True)
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p > 0.0:
        sorted_NV, order_NV = torch.sort(out, dim=-1, descending=False)
        cum_NV = sorted_NV.softmax(dim=-1).cumsum_(dim=-1)
        remove_sorted = cum_NV <= (1.0 - top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, order_NV, remove_sorted)
        out = out.masked_fill(remove, float("-inf"))
    return out


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are one device when 0 is the current one (a generator made with
    ``torch.Generator("cuda")`` may carry no index)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def sample_codes(logits_BlV: torch.Tensor, top_k: int, top_p: float,
                 generator: torch.Generator | None) -> torch.Tensor:
    """Sample one code per token: (B, l, V) float logits -> (B, l) int64 codes."""
    B, l, V = logits_BlV.shape
    masked_NV = filter_top_k_top_p(logits_BlV.reshape(B * l, V), top_k, top_p)  # (B·l, V)
    probs_NV = masked_NV.softmax(dim=-1)
    if generator is None or _same_device(generator.device, probs_NV.device):
        idx_N = torch.multinomial(probs_NV, num_samples=1, replacement=True, generator=generator)[:, 0]
    else:
        u_N = torch.rand(B * l, generator=generator, device=generator.device, dtype=torch.float64)
        u_N = u_N.to(probs_NV.device, non_blocking=True)
        cdf_NV = probs_NV.double().cumsum_(dim=-1)
        cdf_NV = cdf_NV / cdf_NV[:, -1:]
        idx_N = torch.searchsorted(cdf_NV, u_N[:, None], right=True)[:, 0].clamp_(max=V - 1)
    return idx_N.view(B, l)                                                    # (B, l)


def sample_codes_per_image(logits_BlV: torch.Tensor, top_k: int, top_p: float,
                           generators: list[torch.Generator] | torch.Generator | None) -> torch.Tensor:
    """As :func:`sample_codes`, with one generator per image when a list is given.

    With a list, image b draws only from ``generators[b]``, so a batch draws the same codes as its
    images generated one by one with the same generators (images then agree to float rounding:
    batched convolutions and matmuls round slightly differently).
    """
    if isinstance(generators, (list, tuple)):
        return torch.cat([sample_codes(logits_BlV[b:b + 1], top_k, top_p, g)
                          for b, g in enumerate(generators)], dim=0)
    return sample_codes(logits_BlV, top_k, top_p, generators)
