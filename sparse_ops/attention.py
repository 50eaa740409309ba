"""Attention backend dispatch, chosen explicitly per call (never at import time).

Three cases, each with its backend (research/kernels.md §0, §1):

- **dense scale, no mask** → ``F.scaled_dot_product_attention`` without a mask, so torch keeps
  its fast kernels eligible (cuDNN, then flash, then memory-efficient). A VAR step is
  plain non-causal attention of this scale's queries against the KV cache (``Lq != Lk``). With
  at most ``SMALL_QUERY_TOKENS`` queries per row (VAR's first scales) the memory-efficient kernel
  is put first ("sdpa-small"): measured faster than cuDNN there, slower above.
- **images of a batch keep different token counts** (SparseVAR with padding; the cache holds
  padding keys between each scale's tokens; Infinity's padded prompts) → SDPA with the key mask.
  Varlen flash attention (``torch.nn.attention.varlen``, ``backend="varlen"``) needs every row's
  valid keys packed back to back first, which makes it slower than the masked SDPA at every
  measured shape (benchmarks/results/README.md), so "auto" does not pick it. It pays off only once
  the KV cache stores each row's keys compacted.
- **block-sparse pattern** (a FlexAttention ``BlockMask`` the caller made; no policy passes one:
  SparVAR's CSLA reads its windows through ``window_attention``) → FlexAttention, which skips the
  empty blocks. Pass a compiled ``flex_attention`` as ``flex_fn`` for speed.

Every call logs its choice and the reason at DEBUG (``logging.getLogger(__name__)``).
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "sdpa", "varlen", "flex")
# Up to this many queries per row (VAR's first scales) SDPA's memory-efficient kernel beats cuDNN's
SMALL_QUERY_TOKENS = 32


@functools.lru_cache(maxsize=None)
def _varlen_probe(device_index: int) -> tuple[Optional[Callable], bool, str]:
    """(varlen_attn or None, whether it takes ``scale``, reason) on one CUDA device. A pure probe of
    the installed torch and the hardware, cached because neither changes while the process runs."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False, f"torch {torch.__version__} has no torch.nn.attention.varlen (needs torch >= 2.9)"
    if torch.version.hip is not None:
        return None, False, "varlen attention is used on NVIDIA GPUs only"
    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 8:
        return None, False, f"flash varlen needs sm_80 or newer, this GPU is sm_{major}{minor}"
    return varlen_attn, "scale" in inspect.signature(varlen_attn).parameters, "flash varlen available"


def _varlen_usable(q_RHld: torch.Tensor) -> tuple[bool, str]:
    if q_RHld.device.type != "cuda":
        return False, f"varlen attention runs on CUDA only (tensors on {q_RHld.device.type})"
    if q_RHld.dtype not in (torch.float16, torch.bfloat16):
        return False, f"varlen flash attention needs fp16/bf16, got {q_RHld.dtype}"
    d = q_RHld.shape[-1]
    if d % 8 or d > 256:
        return False, f"varlen flash attention needs a head dim that is a multiple of 8 and <= 256, got {d}"
    index = q_RHld.device.index if q_RHld.device.index is not None else torch.cuda.current_device()
    fn, _, why = _varlen_probe(index)
    return fn is not None, why


def choose_attention(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, *, attn_mask: Optional[torch.Tensor] = None,
                     key_valid_RL: Optional[torch.Tensor] = None, block_mask=None,
                     backend: str = "auto") -> tuple[str, str]:
    """(backend, reason) for one attention call: ``"sdpa"``, ``"sdpa-small"`` (SDPA with the
    memory-efficient kernel first, for ≤ ``SMALL_QUERY_TOKENS`` queries under ``backend="auto"``),
    ``"sdpa-cudnn"`` (cuDNN first, above that), ``"varlen"`` or ``"flex"``."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"backend={backend!r} is not an attention backend: use one of {ATTENTION_BACKENDS} "
                         f"('auto' picks per call)")
    if block_mask is not None:
        if backend not in ("auto", "flex"):
            raise ValueError(f"backend={backend!r} cannot run a block mask: use backend='flex' or 'auto'")
        return "flex", "block-sparse pattern (BlockMask): FlexAttention skips the empty blocks"
    if backend == "flex":
        raise ValueError("backend='flex' needs a block_mask (a FlexAttention BlockMask); use 'auto' for dense calls")
    if key_valid_RL is not None and attn_mask is None:
        if backend == "varlen":
            ok, why = _varlen_usable(q_RHld)
            if not ok:
                raise ValueError(f"backend='varlen' cannot run here: {why}; use backend='auto' or 'sdpa'")
            return "varlen", "requested: varlen flash attention over each row's valid keys, packed"
        return "sdpa", ("rows keep different valid key counts: SDPA with a key mask (packing the keys for varlen "
                        "measured slower; backend='varlen' forces it)")
    if backend == "varlen":
        raise ValueError("backend='varlen' needs key_valid_RL (rows with different valid key counts); use 'auto'")
    if attn_mask is not None:
        return "sdpa", "explicit attention mask (e.g. block-causal teacher forcing): SDPA with a mask"
    if backend == "auto" and q_RHld.is_cuda and q_RHld.shape[-1] <= 128 and _sdpa_priority_supported():
        if q_RHld.shape[2] <= SMALL_QUERY_TOKENS and torch.backends.cuda.mem_efficient_sdp_enabled():
            return "sdpa-small", (f"dense, ≤ {SMALL_QUERY_TOKENS} queries per row: SDPA's memory-efficient kernel "
                                  f"(1.5–5 µs faster than cuDNN there on an H100; cuDNN wins from 36 queries up)")
        if q_RHld.shape[2] > SMALL_QUERY_TOKENS and torch.backends.cuda.cudnn_sdp_enabled():
            return "sdpa-cudnn", (f"dense, > {SMALL_QUERY_TOKENS} queries per row: SDPA with cuDNN first (faster "
                                  f"than the default order's flash kernel at every measured VAR and Infinity scale)")
    return "sdpa", "dense, no mask: SDPA keeps cuDNN / flash / memory-efficient eligible"


# With many (row, head) pairs and 89–112 queries per row, SDPA's cuDNN kernel beats the fused one;
# elsewhere the separate norm + cache write launch and the idle time around cuDNN's kernel outweigh
# its faster attention.
FUSED_CACHE_ATTENTION_GAP = (256, 88, 112)        # (row-heads at least, queries above, queries at most)


def use_fused_cache_attention(available: bool, attn_mask: Optional[torch.Tensor], policy_attends: bool,
                              rows: int, heads: int, queries: int, keys: int, head_dim: int = 64) -> bool:
    """Whether VAR's attention step runs as one fused launch (``sparse_ops.cache_attention``: q/k
    norm, cache write, attention) instead of the norm + cache write followed by :func:`attention`.

    It does when the fused kernels are in use (``available``), no key mask is needed (every row
    attends to every cached key), no policy chooses the attention itself (sparse attention), the
    head dim is a power of two from 16 to 256 (the kernel's tiles), and the shape is not one where
    cuDNN measured faster (``FUSED_CACHE_ATTENTION_GAP``)."""
    min_rh, lo, hi = FUSED_CACHE_ATTENTION_GAP
    if not available:
        ok, why = False, "this package's Triton kernels not in use (Kernels kind is not 'triton')"
    elif attn_mask is not None:
        ok, why = False, "key-padding mask (rows kept different token counts): norm + cache write, then SDPA"
    elif policy_attends:
        ok, why = False, "a policy chooses the attention pattern: norm + cache write, then the policy"
    elif head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        ok, why = False, f"head dim {head_dim} is not a power of two in [16, 256]: norm + cache write, then SDPA"
    elif rows * heads >= min_rh and lo < queries <= hi:
        ok, why = False, f"≥ {min_rh} row-heads and {lo + 1}–{hi} queries: cuDNN measured faster than the fused kernel"
    else:
        ok, why = True, "unmasked: one Triton launch for q/k norm, cache write and attention"
    if log.isEnabledFor(logging.DEBUG):
        log.debug("cache attention fused=%s: %s (%d rows × %d heads, %d queries, %d keys)", ok, why, rows, heads,
                  queries, keys)
    return ok


@functools.lru_cache(maxsize=None)
def _sdpa_priority_supported() -> bool:
    """Whether this torch's ``sdpa_kernel`` takes a priority order (``set_priority``, torch ≥ 2.6):
    a probe of the installed package, which does not change while the process runs."""
    return "set_priority" in inspect.signature(sdpa_kernel).parameters


def attention(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, v_RHLd: torch.Tensor, scale: float, *,
              attn_mask: Optional[torch.Tensor] = None, key_valid_RL: Optional[torch.Tensor] = None,
              block_mask=None, backend: str = "auto", flex_fn: Optional[Callable] = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale [+ mask])·v: (R, H, l, d) out, with the backend chosen per call.

    attn_mask: a full SDPA mask (bool, True = attend, or additive), e.g. block-causal.
    key_valid_RL: (R, Lk) bool, False for padding keys of rows whose images kept fewer tokens.
    block_mask: a FlexAttention BlockMask (block-sparse attention).
    backend: "auto" (the rules above), or force "sdpa" / "varlen" / "flex" (ValueError if it cannot run).
    flex_fn: the flex_attention to call (e.g. a torch.compile'd one); default the eager one.
    """
    if q_RHld.dtype != k_RHLd.dtype:
        q_RHld = q_RHld.to(k_RHLd.dtype)
    name, why = choose_attention(q_RHld, k_RHLd, attn_mask=attn_mask, key_valid_RL=key_valid_RL,
                                 block_mask=block_mask, backend=backend)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("attention backend %s: %s (q %s, k %s, %s)", name, why, tuple(q_RHld.shape), tuple(k_RHLd.shape),
                  q_RHld.dtype)
    if name == "flex":
        if flex_fn is None:
            from torch.nn.attention.flex_attention import flex_attention as flex_fn
        return flex_fn(q_RHld, k_RHLd, v_RHLd, block_mask=block_mask, scale=scale)
    if name == "varlen":
        return _varlen_attention(q_RHld, k_RHLd, v_RHLd, scale, key_valid_RL)
    if name in ("sdpa-small", "sdpa-cudnn"):
        # a priority order over the backends the user left enabled (none is switched back on)
        b = torch.backends.cuda
        first = SDPBackend.EFFICIENT_ATTENTION if name == "sdpa-small" else SDPBackend.CUDNN_ATTENTION
        order = [first] + [be for be, on in ((SDPBackend.EFFICIENT_ATTENTION, b.mem_efficient_sdp_enabled()),
                           (SDPBackend.CUDNN_ATTENTION, b.cudnn_sdp_enabled()),
                           (SDPBackend.FLASH_ATTENTION, b.flash_sdp_enabled()),
                           (SDPBackend.MATH, b.math_sdp_enabled())) if on and be != first]
        with sdpa_kernel(order, set_priority=True):
            return F.scaled_dot_product_attention(q_RHld, k_RHLd, v_RHLd, scale=scale)
    if key_valid_RL is not None and attn_mask is None:
        attn_mask = key_valid_RL[:, None, None, :]                                  # (R, Lk) → (R, 1, 1, Lk)
    return F.scaled_dot_product_attention(q_RHld, k_RHLd, v_RHLd, attn_mask=attn_mask, scale=scale)


def _varlen_attention(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, v_RHLd: torch.Tensor, scale: float,
                      key_valid_RL: torch.Tensor) -> torch.Tensor:
    """Varlen flash attention: every row's valid keys packed back to back (positions from a prefix
    sum on the device, padding keys sent to one spare slot), queries packed row after row."""
    R, H, l, d = q_RHld.shape
    Lk = k_RHLd.shape[2]
    index = q_RHld.device.index if q_RHld.device.index is not None else torch.cuda.current_device()
    varlen_attn, takes_scale, _ = _varlen_probe(index)
    valid_RL = key_valid_RL.bool()
    cu_k = torch.zeros(R + 1, device=q_RHld.device, dtype=torch.int32)
    cu_k[1:] = valid_RL.sum(dim=1, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    rank_RL = valid_RL.cumsum(dim=1, dtype=torch.int32) - 1
    dest_RL = torch.where(valid_RL, cu_k[:-1, None] + rank_RL, R * Lk).long()     # padding → spare slot R·Lk
    k_TkHd = k_RHLd.new_empty(R * Lk + 1, H, d)
    v_TkHd = v_RHLd.new_empty(R * Lk + 1, H, d)
    k_TkHd[dest_RL] = k_RHLd.transpose(1, 2)                                       # (R, H, Lk, d) → (R, Lk, H, d)
    v_TkHd[dest_RL] = v_RHLd.transpose(1, 2)
    q_TqHd = q_RHld.transpose(1, 2).reshape(R * l, H, d)                            # (R, H, l, d) → (R·l, H, d)
    cu_q = torch.arange(0, (R + 1) * l, l, device=q_RHld.device, dtype=torch.int32)
    if takes_scale:
        out = varlen_attn(q_TqHd, k_TkHd, v_TkHd, cu_q, cu_k, l, Lk, scale=scale)
    else:                                   # older torch: its fixed 1/sqrt(d) scale, so pre-scale q
        out = varlen_attn(q_TqHd * (scale * d ** 0.5), k_TkHd, v_TkHd, cu_q, cu_k, l, Lk)
    return out.view(R, l, H, d).transpose(1, 2)                                     # (R·l, H, d) → (R, H, l, d)


def dense_attention(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, v_RHLd: torch.Tensor,
                    scale: float, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The adapters' entry: softmax(q·kᵀ·scale + mask)·v, (R, H, l, d) out. A boolean mask of shape
    (R, 1, 1, Lk) is the KV cache's key-padding mask (``KVCache.key_mask``) and goes to
    :func:`attention` as ``key_valid_RL``; any other mask is passed to SDPA as it is."""
    key_valid_RL = None
    if attn_mask is not None and attn_mask.dtype == torch.bool and attn_mask.dim() == 4 \
            and attn_mask.shape[1] == 1 and attn_mask.shape[2] == 1 and attn_mask.shape[0] == q_RHld.shape[0]:
        key_valid_RL, attn_mask = attn_mask[:, 0, 0], None
    return attention(q_RHld, k_RHLd, v_RHLd, scale, attn_mask=attn_mask, key_valid_RL=key_valid_RL)


_CUDNN_LSE = {"usable": True}


def dense_attention_lse(q_RHld: torch.Tensor, k_RHLd: torch.Tensor, v_RHLd: torch.Tensor,
                        scale: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(softmax(q·kᵀ·scale)·v (R, H, l, d), each query's natural log-sum-exp (R, H, l) float32 or
    None): unmasked dense attention that also returns its softmax statistics where the kernel
    gives them at no cost (cuDNN's on a CUDA GPU, bf16/fp16), so a caller that needs them (SparVAR's
    column sums) skips its own pass; elsewhere None and the plain :func:`dense_attention`."""
    if _CUDNN_LSE["usable"] and q_RHld.is_cuda and q_RHld.dtype in (torch.float16, torch.bfloat16) \
            and k_RHLd.dtype == v_RHLd.dtype == q_RHld.dtype and torch.backends.cuda.cudnn_sdp_enabled():
        try:
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(q_RHld, k_RHLd, v_RHLd, None, True, 0.0, False,
                                                                     False, scale=scale)
            R, H, l, _ = q_RHld.shape
            return out[0], out[1].reshape(R, H, l)
        except (RuntimeError, AttributeError, NotImplementedError, TypeError, IndexError) as e:   # not on offer here
            _CUDNN_LSE["usable"] = False
            log.debug("cuDNN attention with log-sum-exp unavailable (%s); plain dense attention", e)
    return dense_attention(q_RHld, k_RHLd, v_RHLd, scale), None


def describe_backends() -> str:
    """What attention / kernel backends this machine offers, and why (for ``sparsevar info --backends``)."""
    from ._backend import interpreting, triton_status

    lines = [f"torch {torch.__version__}"]
    cuda = torch.cuda.is_available()
    if cuda:
        cap = torch.cuda.get_device_capability()
        lines.append(f"CUDA device: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})")
    else:
        lines.append("no CUDA device: SDPA math/CPU kernels; CUDA graphs unavailable")
    lines.append("attention, chosen per call (log level DEBUG on sparsevar.sparse_ops.attention shows each choice):")
    if cuda:
        b = torch.backends.cuda
        flags = (f"cuDNN {'on' if b.cudnn_sdp_enabled() else 'off'}, flash {'on' if b.flash_sdp_enabled() else 'off'}, "
                 f"memory-efficient {'on' if b.mem_efficient_sdp_enabled() else 'off'}, "
                 f"math {'on' if b.math_sdp_enabled() else 'off'}")
        lines.append(f"  dense scales: SDPA without a mask ({flags}); CUDA graphs for dense scales")
        lines.append("  VAR with the fused kernels, no key mask: q/k norm, cache write and attention in one Triton launch "
                     "(cuDNN where it measured faster: use_fused_cache_attention)")
        small = ("the memory-efficient kernel first" if _sdpa_priority_supported()
                 else "the default order (this torch's sdpa_kernel has no priority order)")
        lines.append(f"  scales with ≤ {SMALL_QUERY_TOKENS} queries per row: {small}")
        if _sdpa_priority_supported():
            lines.append(f"  scales with > {SMALL_QUERY_TOKENS} queries per row: cuDNN first")
        fn, _, why = _varlen_probe(torch.cuda.current_device())
        varlen = ("available with backend='varlen' (fp16/bf16; slower than the mask while the cache keeps "
                  "padding keys)" if fn is not None else f"unavailable: {why}")
        lines.append(f"  images with different token counts: SDPA with a key mask; varlen flash attention {varlen}")
    else:
        lines.append("  dense scales: SDPA without a mask (CPU kernels)")
        lines.append("  images with different token counts: SDPA with a key mask (varlen attention needs CUDA)")
    try:
        from torch.nn.attention.flex_attention import BlockMask  # noqa: F401
        lines.append("  block-sparse patterns: FlexAttention (torch.nn.attention.flex_attention; compile it for speed)")
    except ImportError:
        lines.append(f"  block-sparse patterns: unavailable (torch {torch.__version__} has no FlexAttention)")
    lines.append("sparse ops (gather + LayerNorm + AdaLN, restore, selection, anchor matching, attention column sums, "
                 "the dense path's fused residual + LayerNorm + AdaLN, q/k norm (+ RoPE) + cache write, VAR's "
                 "attention step, few-row GEMM, projection into the residual stream, classifier-free guidance and "
                 "top-k / top-p sampler):")
    try:
        import triton
        lines.append(f"  triton {triton.__version__}: installed")
    except ImportError:
        lines.append("  triton: not installed (pip install 'sparsevar[triton]'); pure-torch ops are used")
    device = ("cuda", torch.cuda.current_device()) if cuda else ("cpu", -1)
    ok, why = triton_status(device[0], device[1], interpreting())
    where = "Triton kernels" if ok and cuda else "pure-torch references"
    lines.append(f"  backend='auto' on {device[0]}: {where} ({why})")
    if cuda:
        from .gemm_rows import GemmRowTable, file_name, table_dirs

        try:
            table = GemmRowTable.for_device(torch.device("cuda", torch.cuda.current_device()))
        except ValueError as e:
            table, bad = None, str(e)
        else:
            bad = None
        name = file_name(torch.cuda.get_device_name(), torch.version.cuda or "")
        if table is not None:
            lines.append(f"GEMM row padding (fused kernels): {len(table)} row counts of {len(table.entries)} product "
                         f"shapes from {table.source}")
        else:
            where = " or ".join(str(d) for d in table_dirs())
            lines.append(f"GEMM row padding: off ({bad or f'no {name} in {where}'}; write one with "
                         "sparsevar bench gemm-rows)")
    return "\n".join(lines)
