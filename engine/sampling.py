"""Top-k / top-p sampling of codebook logits, drawing only from the caller's ``torch.Generator``.

Semantics follow the official VAR sampler (research/var.md §3.9):
- top_k > 0: logits strictly below the k-th largest become -inf (ties at the threshold survive);
- top_p > 0: sorted ascending, entries whose cumulative probability is <= 1 - top_p become -inf; the
  largest entry always survives;
- one draw per token from softmax(masked logits).
With a generator on the logits' device the draw is ``torch.multinomial``'s own one-sample
algorithm (:func:`draw_one`, the same codes as the reference call, so CPU runs reproduce the
official random stream); with a generator on another device (a CPU generator for
a CUDA model, the diffusers habit) uniforms are drawn from it and inverted through the CDF on the
logits' device. Neither path syncs the host.
"""
from __future__ import annotations

import torch

from ..sparse_ops.ref import filter_top_k_top_p


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are one device when 0 is the current one (a generator made with
    ``torch.Generator("cuda")`` may carry no index)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


# the fused sampler serves codebook logits; Infinity's 2-way bit logits stay on the torch path
FUSED_MIN_VOCAB = 16


def draw_one(probs_NV: torch.Tensor, generator: torch.Generator | None,
             noise_NV: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row, (N,) int64: what ``torch.multinomial(probs, 1, generator=generator)`` returns
    (for one sample it draws Exp(1) noise q with ``exponential_`` and takes ``argmax(p / q)``; the same
    calls here give the same codes), without its input checks, which are a handful of reductions
    and device asserts per call on a GPU. ``noise_NV``: that noise, already drawn (see
    :func:`takes_drawn_noise`)."""
    if noise_NV is None:
        noise_NV = torch.empty_like(probs_NV).exponential_(generator=generator)
    return (probs_NV / noise_NV).argmax(dim=-1)


def takes_drawn_noise(generators, device: torch.device) -> bool:
    """Whether :func:`sample_codes_per_image` with these generators draws exactly one float32
    ``exponential_`` tensor of shape (B·l, V) per call, which a caller may then draw beforehand into
    a buffer of its own (``noise_NV``) and get the same codes: one generator (or None, the default
    one) on the logits' device. Not with a list of generators, nor with a generator on another
    device (those draw uniforms instead)."""
    if isinstance(generators, (list, tuple)):
        return False
    return generators is None or _same_device(generators.device, device)


def sample_codes(logits_BlV: torch.Tensor, top_k: int, top_p: float,
                 generator: torch.Generator | None, fused: bool = False,
                 noise_NV: torch.Tensor | None = None) -> torch.Tensor:
    """Sample one code per token: (B, l, V) float logits -> (B, l) int64 codes.

    fused: on CUDA with a generator on the logits' device, filter and draw in one Triton launch
    (``sparse_ops.sample``) from exponential noise drawn here, the same noise ``torch.multinomial``
    draws for one sample; the draws then equal the torch path's except at exact ties of the
    nucleus boundary (``sparse_ops/sample.py``).
    noise_NV: the (B·l, V) float32 Exp(1) noise this call would draw, drawn beforehand from the same
    generator (only where :func:`takes_drawn_noise` holds): the same codes, and no draw inside the
    call, so the call can sit in a CUDA graph."""
    B, l, V = logits_BlV.shape
    if noise_NV is not None:
        if not takes_drawn_noise(generator, logits_BlV.device):
            raise ValueError("noise_NV: pre-drawn noise needs one generator on the logits' device "
                             f"(got {generator!r}); pass noise_NV=None to draw here")
        if tuple(noise_NV.shape) != (B * l, V):
            raise ValueError(f"noise_NV has shape {tuple(noise_NV.shape)}; it must be (B·l, V) = ({B * l}, {V}) "
                             f"for logits of shape {(B, l, V)}: one Exp(1) draw per token and code")
    if fused and logits_BlV.is_cuda and V >= FUSED_MIN_VOCAB \
            and (generator is None or _same_device(generator.device, logits_BlV.device)):
        from ..sparse_ops import ops as sparse_ops

        logits_NV = logits_BlV.reshape(B * l, V).float()                      # (B, l, V) → (B·l, V)
        if noise_NV is None:
            noise_NV = torch.empty_like(logits_NV).exponential_(generator=generator)
        return sparse_ops.sample_top_k_top_p(logits_NV, noise_NV, top_k, top_p, backend="triton").view(B, l)
    masked_NV = filter_top_k_top_p(logits_BlV.reshape(B * l, V), top_k, top_p)  # (B·l, V)
    probs_NV = masked_NV.softmax(dim=-1)
    if generator is None or _same_device(generator.device, probs_NV.device):
        idx_N = draw_one(probs_NV, generator, noise_NV)
    else:
        u_N = torch.rand(B * l, generator=generator, device=generator.device, dtype=torch.float64)
        u_N = u_N.to(probs_NV.device, non_blocking=True)
        cdf_NV = probs_NV.double().cumsum_(dim=-1)
        cdf_NV = cdf_NV / cdf_NV[:, -1:]
        idx_N = torch.searchsorted(cdf_NV, u_N[:, None], right=True)[:, 0].clamp_(max=V - 1)
    return idx_N.view(B, l)                                                    # (B, l)


def sample_codes_per_image(logits_BlV: torch.Tensor, top_k: int, top_p: float,
                           generators: list[torch.Generator] | torch.Generator | None,
                           fused: bool = False, noise_NV: torch.Tensor | None = None) -> torch.Tensor:
    """As :func:`sample_codes`, with one generator per image when a list is given.

    With a list, image b draws only from ``generators[b]``, so a batch draws the same codes as its
    images generated one by one with the same generators (images then agree to float rounding:
    batched convolutions and matmuls round slightly differently).
    """
    if isinstance(generators, (list, tuple)):
        if noise_NV is not None:
            raise ValueError("noise_NV: pre-drawn noise needs one generator, not a list; pass noise_NV=None")
        return torch.cat([sample_codes(logits_BlV[b:b + 1], top_k, top_p, g, fused)
                          for b, g in enumerate(generators)], dim=0)
    return sample_codes(logits_BlV, top_k, top_p, generators, fused, noise_NV)
