"""The few layers every model family shares."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..sparse_ops.kernels import TORCH_KERNELS, Kernels, dense_linear

MAX_LOG_TEMPERATURE = math.log(100.0)    # cosine attention: q's learned temperature is exp(min(τ, ln 100))


# the channels-first kernels pay three launches; below this many values per (image, group) PyTorch's
# GroupNorm is faster (benchmarks/results, Session 24)
FUSED_GROUP_NORM_MIN_VALUES = 1 << 18


def _fused_norm(norm: nn.Module, x_BChw: torch.Tensor) -> bool:
    """Whether :func:`norm_silu` takes the fused kernel for this norm and input."""
    if not (isinstance(norm, nn.GroupNorm) and norm.affine and x_BChw.is_cuda and x_BChw.dim() == 4):
        return False
    if torch.is_grad_enabled() and (x_BChw.requires_grad or norm.weight.requires_grad):
        return False
    B, C, H, W = x_BChw.shape
    return C // norm.num_groups * H * W >= FUSED_GROUP_NORM_MIN_VALUES \
        or x_BChw.is_contiguous(memory_format=torch.channels_last)


def norm_silu(norm: nn.Module, x_BChw: torch.Tensor, silu: bool = True,
              x_bias_C: Optional[torch.Tensor] = None, channels_first_out: bool = False) -> torch.Tensor:
    """``norm(x + x_bias)``, then SiLU when ``silu``: the VAE decoders' GroupNorm + SiLU (``x_bias_C``:
    the per-channel bias of the convolution that made x, run without it). A GroupNorm on a CUDA input
    that autograd does not track takes the fused kernel of ``sparse_ops.group_norm_silu`` (float32
    statistics, the result in x's dtype and memory layout, the bias added as it reads) when the input
    is channels-last, or channels-first with at least ``FUSED_GROUP_NORM_MIN_VALUES`` values per
    (image, group); anything else, and any other norm, runs PyTorch's. ``channels_first_out``: the
    result contiguous channels-first whatever x's layout."""
    if _fused_norm(norm, x_BChw):
        from ..sparse_ops import ops as sparse_ops

        return sparse_ops.group_norm_silu(x_BChw, norm.weight, norm.bias, norm.num_groups, norm.eps, silu, x_bias_C,
                                          channels_first_out)
    if x_bias_C is not None:
        x_BChw = x_BChw + x_bias_C.view(1, -1, 1, 1)
    y = norm(x_BChw)
    y = F.silu(y) if silu else y
    return y.contiguous() if channels_first_out else y


def _conv_without_bias(conv: nn.Conv2d, x_BChw: torch.Tensor) -> torch.Tensor:
    return conv._conv_forward(x_BChw, conv.weight, None)


def resnet_block(x_BChw: torch.Tensor, norm1: nn.Module, conv1: nn.Conv2d, norm2: nn.Module, conv2: nn.Conv2d,
                 shortcut: Optional[nn.Conv2d] = None, fold: Optional[bool] = None) -> torch.Tensor:
    """The VAE decoders' residual block: norm1 → SiLU → conv1 → norm2 → SiLU → conv2, plus x (through
    the 1×1 ``shortcut`` where the width changes).

    Folded, the three convolutions run without their biases: conv1's is added by norm2 as it reads
    (:func:`norm_silu`), conv2's and the shortcut's by the residual add
    (``sparse_ops.residual_bias_add``), which saves two passes over the activation per block. ``fold``
    None folds on the decoders' fast path (channels-last input on the fused norms: the half-precision
    decodes on CUDA); elsewhere (channels-first, CPU, autograd, other norms) the modules run as they
    are. ``fold=True`` folds anywhere (the same sum, in another order)."""
    if fold is None:
        fold = _fused_norm(norm1, x_BChw) and not x_BChw.is_contiguous() \
            and x_BChw.is_contiguous(memory_format=torch.channels_last)
    fold = fold and isinstance(norm2, nn.GroupNorm) and conv1.bias is not None and conv2.bias is not None \
        and (shortcut is None or shortcut.bias is not None)
    if not fold:
        h_BChw = conv2(norm_silu(norm2, conv1(norm_silu(norm1, x_BChw))))
        return (x_BChw if shortcut is None else shortcut(x_BChw)) + h_BChw
    from ..sparse_ops import ops as sparse_ops

    h_BChw = _conv_without_bias(conv1, norm_silu(norm1, x_BChw))
    h_BChw = _conv_without_bias(conv2, norm_silu(norm2, h_BChw, x_bias_C=conv1.bias))          # conv1's bias
    if shortcut is None:
        return sparse_ops.residual_bias_add(x_BChw, h_BChw, conv2.bias)
    return sparse_ops.residual_bias_add(_conv_without_bias(shortcut, x_BChw), h_BChw, conv2.bias + shortcut.bias)


# below this many output channels cuDNN's channels-last half-precision convolution runs a slow
# generic kernel (benchmarks/results, Session 38)
_FEW_OUTPUT_CHANNELS = 8


def rgb_output(norm: nn.Module, conv: nn.Conv2d, x_BChw: torch.Tensor) -> torch.Tensor:
    """A decoder's last step, norm → SiLU → convolution to the image channels. A channels-last input
    is normalised into a channels-first result when the convolution has few output channels: cuDNN
    has no fast channels-last kernel for them, and the norm writes either layout at the same cost."""
    few = conv.out_channels < _FEW_OUTPUT_CHANNELS and x_BChw.is_cuda and not x_BChw.is_contiguous() \
        and x_BChw.is_contiguous(memory_format=torch.channels_last)
    return conv(norm_silu(norm, x_BChw, channels_first_out=few))


def _walk_parameters(module: nn.Module, out: list) -> list:
    """Every parameter of ``module`` and its children in module order (a shared one once per owner):
    a plain walk, several times faster than ``Module.parameters()``, which builds names and a memo
    — it runs at every call (:func:`weights_key`)."""
    for p in module._parameters.values():
        if p is not None:
            out.append(p)
    for child in module._modules.values():
        if child is not None:
            _walk_parameters(child, out)
    return out


def weight_ptrs(module: nn.Module) -> tuple[int, ...]:
    """Each parameter's storage address, in module order: what captured CUDA graphs hold."""
    return tuple(p.data_ptr() for p in _walk_parameters(module, []))


# decodes of up to this many output pixels (batch × height × width: one 1024² picture) replay from a
# CUDA graph; a graph keeps its activations' memory in the workspace's pool between calls, and larger
# decodes keep the GPU busy without one
DECODE_GRAPH_PIXELS = 1 << 20


def decode_graph_key(latent_BChw: torch.Tensor, downsample_factor: int) -> Optional[tuple]:
    """A ``ModelAdapter.decode_key`` for a decoder of ``latent_BChw`` (a workspace buffer) whose weights
    the workspace's own key holds (a moved decoder makes a new workspace): ``()``, or None (decode
    eagerly) past ``DECODE_GRAPH_PIXELS`` output pixels."""
    B, _, h, w = latent_BChw.shape
    return None if B * h * w * downsample_factor ** 2 > DECODE_GRAPH_PIXELS else ()


def weights_key(module: nn.Module) -> tuple[tuple, bool]:
    """(key, versioned): what identifies ``module``'s current weights — each parameter's storage
    address and in-place version, so a model moved away and back or weights loaded in place give a
    new key. Parameters made under ``torch.inference_mode`` (as ComfyUI loads models) keep no
    version: then the key holds the addresses alone and ``versioned`` is False (the caller recomputes
    what depends on the weights at every use)."""
    params = _walk_parameters(module, [])
    try:
        return tuple((p.data_ptr(), p._version) for p in params), True
    except RuntimeError:                         # "Inference tensors do not track version counter"
        return tuple(p.data_ptr() for p in params), False

class TanhGeluFFN(nn.Module):
    """fc1 → GELU (tanh approximation) → fc2; keys ``fc1``, ``fc2``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, ops: Optional[Kernels] = None) -> torch.Tensor:
        linear_fn = ops.linear if ops is not None else dense_linear
        return linear_fn(self.hidden(x, ops), self.fc2.weight, self.fc2.bias)

    def hidden(self, x: torch.Tensor, ops: Optional[Kernels] = None) -> torch.Tensor:
        """GELU(fc1(x)): the input of fc2 (for callers that fuse fc2 with what follows)."""
        return (ops.linear if ops is not None else dense_linear)(x, self.fc1.weight, self.fc1.bias, gelu=True)


class CosineSelfAttentionWeights(nn.Module):
    """The parameters of VAR's and Infinity's cosine self-attention (official key layout):
    ``mat_qkv.weight`` (3C, C, no bias), ``q_bias``, ``v_bias`` (C), ``scale_mul_1H11`` (1, H, 1, 1: the
    log temperature of each head's q), ``proj.{weight,bias}``. The key bias is fixed at zero (the
    official ``zero_k_bias`` buffer is not kept). A family adds its ``forward``."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by {num_heads} heads")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.mat_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.scale_mul_1H11 = nn.Parameter(torch.full((1, num_heads, 1, 1), math.log(4.0)))
        self.proj = nn.Linear(dim, dim)

    def temperature(self) -> torch.Tensor:
        """(H,) float32: each head's q multiplier exp(min(τ, ln 100))."""
        return self.scale_mul_1H11.float().clamp_max(MAX_LOG_TEMPERATURE).exp().view(-1)

    def qkv_bias(self) -> torch.Tensor:
        """(3C,) [q_bias; 0; v_bias] — the key bias is fixed at zero."""
        return torch.cat((self.q_bias, torch.zeros_like(self.q_bias), self.v_bias))


# ---- cross-attention to a text memory ----------------------------------------------------------
class CrossMemory(NamedTuple):
    """One layer's cross-attention memory: text K, V (R, H, T, d) and a key mask (R, 1, 1, T) (True =
    attend) or None."""
    k_RHTd: torch.Tensor
    v_RHTd: torch.Tensor
    mask_R11T: Optional[torch.Tensor]

    def rows(self, R: int) -> "CrossMemory":
        return CrossMemory(self.k_RHTd[:R], self.v_RHTd[:R], None if self.mask_R11T is None else self.mask_R11T[:R])


class AbsorbedCrossMemory(NamedTuple):
    """The same memory with the layer's query and output projections folded in
    (:func:`absorb_cross_attention`): ``kq_RNC`` (R, H·T, C), ``bias_R1N`` (R, 1, H·T) float32 with
    −inf at masked keys, ``vo_RNC`` (R, H·T, C); entry n = h·T + t."""
    kq_RNC: torch.Tensor
    bias_R1N: torch.Tensor
    vo_RNC: torch.Tensor
    heads: int

    def rows(self, R: int) -> "AbsorbedCrossMemory":
        return AbsorbedCrossMemory(self.kq_RNC[:R], self.bias_R1N[:R], self.vo_RNC[:R], self.heads)


# the absorbed text memory holds C values per (head, token) where K/V hold head_dim: H times more
ABSORBED_MAX_BYTES = 1 << 30


def absorbs_cross_attention(heads: int, text_tokens: int, dim: int, memory_bytes: int = 0) -> bool:
    """Whether the absorbed form is the one to use: its two products have H·T columns / rows where
    the projections have C, so it does less work while H·T ≤ C/2 (T ≤ head_dim / 2).
    ``memory_bytes``: what its buffers would take for every layer and row, kept to 1 GiB
    (Infinity-2B, one image, T = 32: 0.27 GB; Infinity-8B: 1.0 GB; larger batches keep K/V)."""
    return 2 * heads * text_tokens <= dim and memory_bytes <= ABSORBED_MAX_BYTES


def absorb_cross_attention(k_RHTd: torch.Tensor, v_RHTd: torch.Tensor, valid_RT: Optional[torch.Tensor],
                           wq_CC: torch.Tensor, bq_C: Optional[torch.Tensor], wo_CC: torch.Tensor,
                           bo_C: Optional[torch.Tensor], scale: float, dtype: torch.dtype) -> AbsorbedCrossMemory:
    """Fold ``q = y·Wqᵀ + bq`` and ``out = o·Woᵀ + bo`` into the text memory (computed in float32,
    once per generation). With q_h = y·Wq,hᵀ + bq,h for head h:

        logits_h,t = scale · q_h·k_h,t = y · (scale · k_h,t·Wq,h) + scale · bq,h·k_h,t
        out = Σ_h P_h·V_h·Wo,hᵀ + bo = Σ_h,t P_h,t · (v_h,t·Wo,hᵀ + bo / H)

    (each head's probabilities sum to 1, so bo / H on every row of Vo adds bo once). The attention
    of l queries to T keys becomes two products of l × C by C × H·T and l × H·T by H·T × C, in place
    of the two l × C by C × C projections: exact in exact arithmetic, and less work while H·T < C."""
    R, H, T, d = k_RHTd.shape
    C = wq_CC.shape[1]
    kq_RHTC = torch.einsum("rhtj,hjc->rhtc", k_RHTd.float(), wq_CC.float().view(H, d, C)).mul_(scale)
    if bq_C is not None:
        bias_RHT = torch.einsum("rhtj,hj->rht", k_RHTd.float(), bq_C.float().view(H, d)).mul_(scale)
    else:
        bias_RHT = torch.zeros(R, H, T, device=k_RHTd.device)
    if valid_RT is not None:
        bias_RHT = bias_RHT.masked_fill(~valid_RT[:, None, :], float("-inf"))
    vo_RHTC = torch.einsum("rhtj,chj->rhtc", v_RHTd.float(), wo_CC.float().view(-1, H, d))
    if bo_C is not None:
        vo_RHTC += bo_C.float() / H
    return AbsorbedCrossMemory(kq_RHTC.reshape(R, H * T, C).to(dtype), bias_RHT.reshape(R, 1, H * T),
                               vo_RHTC.reshape(R, H * T, -1).to(dtype), H)


def absorbed_cross_attention(y_RlC: torch.Tensor, mem: AbsorbedCrossMemory,
                             ops: Optional[Kernels] = None) -> torch.Tensor:
    """softmax(y·Kqᵀ + bias) per head, times Vo: (R, l, C) in the memory's dtype. The logits and the
    softmax are float32 (as inside a flash-attention kernel); on CUDA the first product reads bf16 /
    fp16 operands and writes float32 directly; the bias add, softmax and cast are one step
    (``ops.bias_softmax``: one Triton launch with the fused ops)."""
    kqT_RCN = mem.kq_RNC.transpose(1, 2)
    if y_RlC.is_cuda and y_RlC.dtype == mem.kq_RNC.dtype and y_RlC.dtype in (torch.bfloat16, torch.float16) \
            and hasattr(torch.ops.aten.bmm, "dtype"):                # bmm with out_dtype: torch >= 2.8
        logits_RlN = torch.bmm(y_RlC, kqT_RCN, out_dtype=torch.float32)
    else:
        logits_RlN = torch.bmm(y_RlC.float(), kqT_RCN.float())
    p_RlN = (ops or TORCH_KERNELS).bias_softmax(logits_RlN, mem.bias_R1N, mem.heads, mem.vo_RNC.dtype)
    return torch.bmm(p_RlN, mem.vo_RNC)


def layer_norm_no_affine(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim without affine parameters, computed in float32."""
    return F.layer_norm(x.float(), (x.shape[-1],), eps=eps)


def trunc_normal_init_(module: nn.Module, std: float = 0.02) -> None:
    """Random weights for models built by size alone (benchmarks, demos): trunc-normal linears and
    embeddings, zero biases. Not the official training init."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.trunc_normal_(m.weight, std=std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
