"""The few layers every model family shares."""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..sparse_ops._backend import CHAIN_ROWS

MAX_LOG_TEMPERATURE = math.log(100.0)    # cosine attention: q's learned temperature is exp(min(τ, ln 100))


class TanhGeluFFN(nn.Module):
    """fc1 → GELU (tanh approximation) → fc2; keys ``fc1``, ``fc2``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, ops: Optional["ElementwiseOps"] = None) -> torch.Tensor:
        linear_fn = ops.linear if ops is not None else dense_linear
        return linear_fn(self.hidden(x, ops), self.fc2.weight, self.fc2.bias)

    def hidden(self, x: torch.Tensor, ops: Optional["ElementwiseOps"] = None) -> torch.Tensor:
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


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 gelu: bool = False) -> torch.Tensor:
    """``x · weightᵀ + bias``, then tanh-GELU when ``gelu``, through cuBLAS."""
    if gelu and x.is_cuda and x.dtype == weight.dtype and bias is not None and x.numel() > x.shape[-1] \
            and not torch.is_grad_enabled():
        # cuBLASLt's GELU epilogue (the tanh approximation) applies bias and activation inside the
        # matrix product: one launch fewer per layer, and the activation is rounded once. Inference
        # only: autograd has no derivative for it (training takes the two-step path)
        x2 = x.reshape(-1, x.shape[-1])                                                 # (…, K) → (M, K)
        h = torch._addmm_activation(bias, x2, weight.t(), use_gelu=True)
        return h.view(*x.shape[:-1], h.shape[-1])                                       # (M, N) → (…, N)
    y = F.linear(x, weight, bias)
    return F.gelu(y, approximate="tanh") if gelu else y


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
    the projections have C, so it does less work while H·T ≤ C/2 (T ≤ head_dim / 2). On an H100 with
    Infinity-2B's shapes it took 137 against 224 µs per layer at 4096 queries and T = 32, 194 against
    227 µs at T = 64, and lost at T = 128 (318 against 223 µs). ``memory_bytes``: what its buffers
    would take for every layer and row, kept to 1 GiB (Infinity-2B, one image, T = 32: 0.27 GB;
    Infinity-8B: 1.0 GB; larger batches keep K/V)."""
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
                             ops: Optional["ElementwiseOps"] = None) -> torch.Tensor:
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
    p_RlN = (ops or EAGER_OPS).bias_softmax(logits_RlN, mem.bias_R1N, mem.heads, mem.vo_RNC.dtype)
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


# ---- the elementwise steps of an AdaLN block, as plain functions --------------------------------
# At batch 1 a VAR layer is dominated by small elementwise kernels, not by its GEMMs. These
# functions each do one step in as few kernels as eager PyTorch allows; on CUDA the adapter may
# hand them to torch.compile (one fused kernel each, see ``ElementwiseOps``).

def modulate(x_RlC: torch.Tensor, mul_R1C: torch.Tensor, shift_R1C: torch.Tensor, eps: float,
             out_dtype: torch.dtype) -> torch.Tensor:
    """LN(x)·mul + shift (LayerNorm without affine, in float32), returned in ``out_dtype``.
    ``mul`` is 1 + scale (precomputed once per image)."""
    y = F.layer_norm(x_RlC.float(), (x_RlC.shape[-1],), eps=eps)
    return torch.addcmul(shift_R1C, y, mul_R1C).to(out_dtype)


def qk_normalize(qk_Rl2Hd: torch.Tensor, mult_2H1: torch.Tensor) -> torch.Tensor:
    """L2-normalise q and k over the head dim in one pass and scale q by its temperature:
    ``mult_2H1`` = [exp(min(τ, ln 100)); 1] per head."""
    norm = torch.linalg.vector_norm(qk_Rl2Hd, dim=-1, keepdim=True, dtype=torch.float32)
    return (qk_Rl2Hd * (mult_2H1 / norm.clamp_min(1e-12))).to(qk_Rl2Hd.dtype)


def residual_modulate(x_RlC: torch.Tensor, branch_RlC: torch.Tensor, gate_R1C: torch.Tensor,
                      mul_R1C: torch.Tensor, shift_R1C: torch.Tensor, eps: float, out_dtype: torch.dtype):
    """``gated_residual`` followed by the next sub-layer's ``modulate``: (new x, next branch input)."""
    x_RlC = gated_residual(x_RlC, branch_RlC, gate_R1C)
    return x_RlC, modulate(x_RlC, mul_R1C, shift_R1C, eps, out_dtype)


def gated_residual(x_RlC: torch.Tensor, branch_RlC: torch.Tensor, gate_R1C: torch.Tensor) -> torch.Tensor:
    """x + gate · branch, in x's dtype (float32 residual stream)."""
    return torch.addcmul(x_RlC, branch_RlC, gate_R1C).to(x_RlC.dtype)


def _qk_rope(qk_Rl2Hd: torch.Tensor, q_mult_H1: torch.Tensor, cos_Rl1P: torch.Tensor, sin_Rl1P: torch.Tensor):
    """Infinity's cosine q/k with RoPE (``ref.qk_norm_rope_store`` without the cache write), for
    torch.compile: (q, k) as (R, l, H, d), q in the input dtype, k in float32."""
    from ..sparse_ops.ref import rope_pairs

    qk = qk_Rl2Hd.float()
    qk = qk / torch.linalg.vector_norm(qk, dim=-1, keepdim=True).clamp_min(1e-12)
    q = rope_pairs(qk[:, :, 0] * q_mult_H1, cos_Rl1P, sin_Rl1P).to(qk_Rl2Hd.dtype)
    return q, rope_pairs(qk[:, :, 1].contiguous(), cos_Rl1P, sin_Rl1P)


class ElementwiseOps:
    """The per-layer steps, eager or fused. One instance per adapter (no global cache).

    kind: ``"eager"`` (plain torch); ``"compile"`` (each step compiled lazily by torch.compile at
    its first call, with dynamic token counts so every scale shares a kernel); ``"fused"`` (the
    hand-written Triton kernels of ``sparse_ops.dense_fused`` for the LayerNorm + AdaLN steps and
    the q/k norm + KV-cache write, one kernel each; torch.compile for the gated residual), the
    Triton GEMM of ``sparse_ops.linear`` for products of at most ``SMALL_GEMM_ROWS`` rows, and
    ``qk_norm_attend`` (``sparse_ops.cache_attention``: VAR's q/k norm, cache write and unmasked
    attention in one launch; None under the other kinds); ``cfg_guide``, ``stage_embed`` and
    ``phi_accumulate`` (VAR's guidance, scale input and latent update) are one launch each under
    ``"fused"`` and their torch twins otherwise.

    ``linear(x, weight, bias=None, gelu=False)`` is the layers' matrix product: cuBLAS, except
    under ``"fused"`` at few rows. Under ``"fused"`` with ``row_padding`` (default) a cuBLAS product
    runs on the row count that this GPU's shipped table gives for its shape, where its input has the
    spare rows (``sparse_ops.gemm_rows``): the table lists row counts at which cuBLAS picks a slow
    kernel; no timing is taken at run time.
    """

    # Up to this many rows the Triton GEMM beats cuBLAS on an H100 (torch 2.11): a chain of VAR-d30's
    # four per-layer GEMMs ran 44.9 against 47.6 µs at 2 rows and 54.3 against 55.7 µs at 32 rows,
    # with the norms between them. At 50 rows the two were level until the layer's kernels, all this
    # package's then, were chained by programmatic dependent launch (sparse_ops._gdc, up to
    # _backend.CHAIN_ROWS rows): VAR-d30's 5 × 5 scale at batch 1 then took 1.80 against 1.94 ms with
    # cuBLAS; at 72 rows cuBLAS stays faster (1.97 against 2.28–2.37 ms with 128-row tiles)
    SMALL_GEMM_ROWS = CHAIN_ROWS

    KINDS = ("eager", "compile", "fused")

    def __init__(self, compiled: bool = False, kind: Optional[str] = None, row_padding: bool = True):
        kind = kind or ("compile" if compiled else "eager")
        if kind not in self.KINDS:
            raise ValueError(f"kind={kind!r}: choose one of {self.KINDS}")
        self.kind = kind
        self.compiled = kind != "eager"
        # "fused" only: cuBLAS products on the row counts of this GPU's shipped table (sparse_ops.gemm_rows)
        self.row_padding = row_padding
        self._row_tables: dict = {}      # CUDA device index → its table or None, read at first use
        self._compiled_rope = None
        self.linear = dense_linear
        self.qk_norm_attend = None          # VAR's norm + cache write + attention in one launch ("fused" only)
        from ..sparse_ops import ref as sparse_ref

        self.bias_softmax = sparse_ref.bias_softmax
        self.cfg_guide = sparse_ref.cfg_guide      # (1 + t)·cond − t·uncond in float32 (one launch when fused)
        self.stage_embed = sparse_ref.stage_embed  # VAR's input map of a scale (one launch when fused)
        self.phi_accumulate = sparse_ref.phi_accumulate  # VAR's latent update f_hat += φ(h) (one launch when fused)
        fns = dict(modulate=modulate, qk_normalize=qk_normalize, gated_residual=gated_residual,
                   residual_modulate=residual_modulate)
        for name, fn in fns.items():
            setattr(self, name, torch.compile(fn, dynamic=True, fullgraph=True) if self.compiled else fn)
        if kind == "fused":
            from ..sparse_ops import ops as sparse_ops

            self.modulate = functools.partial(self._fused_modulate, sparse_ops.residual_norm_modulate)
            self.residual_modulate = functools.partial(sparse_ops.residual_norm_modulate, backend="triton")
            self.qk_normalize_store = functools.partial(sparse_ops.qk_norm_store, backend="triton")
            self.qk_norm_rope_store = functools.partial(sparse_ops.qk_norm_rope_store, backend="triton")
            self.qk_norm_attend = functools.partial(sparse_ops.qk_norm_attend, backend="triton")
            self.linear = functools.partial(self._fused_linear, sparse_ops.linear)        # bound: reads the table
            self.bias_softmax = functools.partial(sparse_ops.bias_softmax, backend="triton")
            self.cfg_guide = functools.partial(sparse_ops.cfg_guide, backend="triton")
            self.stage_embed = functools.partial(sparse_ops.stage_embed, backend="triton")
            self.phi_accumulate = functools.partial(sparse_ops.phi_accumulate, backend="triton")
        elif kind == "compile":
            # Compiling the cache write into the norm produced four kernels instead of one on an H100
            # (torch 2.11): keep the compiled norm and let two plain copies write the cache.
            self.qk_normalize_store = self._norm_then_store
            self.qk_norm_rope_store = self._rope_norm_then_store
        else:
            from ..sparse_ops import ref

            self.qk_normalize_store = ref.qk_norm_store
            self.qk_norm_rope_store = ref.qk_norm_rope_store

    # A long reduction (K ≥ 2N, the FFN's second product) on (CHUNK_ROWS, 2·CHUNK_ROWS) rows runs
    # through cuBLAS in row blocks of CHUNK_ROWS: its heuristic takes a slow kernel there. VAR-d30's
    # fc2 (H100, torch 2.11, cuBLASLt): 50.0 → 37.4 µs at 576 rows, 59.7 → 42.5 µs at 800 (41.5 µs at
    # 1024); the other three products gained nothing from it
    CHUNK_ROWS = 512

    def row_table(self, device: torch.device):
        """The GEMM row table of this CUDA device (None: no padding — not fused, switched off, not
        CUDA, or no table shipped for this GPU and CUDA version)."""
        if self.kind != "fused" or not self.row_padding or device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._row_tables:
            from ..sparse_ops.gemm_rows import GemmRowTable

            self._row_tables[index] = GemmRowTable.for_device(torch.device("cuda", index))
        return self._row_tables[index]

    def _fused_linear(self, kernel, x, weight, bias=None, gelu=False):
        K, N = x.shape[-1], weight.shape[0]
        rows = x.numel() // K if K else 0
        if x.is_cuda and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16):
            if rows <= ElementwiseOps.SMALL_GEMM_ROWS:
                return kernel(x, weight, bias, gelu, backend="triton")
            table = self.row_table(x.device)
            epilogue = "gelu" if gelu else ("bias" if bias is not None else "none")
            if table is not None and table.covers(N, K, epilogue, x.dtype) and not torch.is_grad_enabled() \
                    and (bias is not None or not gelu):
                # a shape this GPU's table measured: its row counts replace the row blocks below
                from ..sparse_ops.gemm_rows import linear_rows, padded_rows

                return linear_rows(x, weight, bias, gelu, padded_rows(table, x, N, epilogue))
            chunk = ElementwiseOps.CHUNK_ROWS
            if chunk < rows < 2 * chunk and K >= 2 * N and not gelu and not torch.is_grad_enabled():
                x2 = x.reshape(rows, K)                                                 # (…, K) → (M, K)
                y = torch.empty(rows, N, device=x.device, dtype=x.dtype)
                for lo in (0, chunk):
                    hi = min(lo + chunk, rows)
                    if bias is None:
                        torch.mm(x2[lo:hi], weight.t(), out=y[lo:hi])
                    else:
                        torch.addmm(bias, x2[lo:hi], weight.t(), out=y[lo:hi])
                return y.view(*x.shape[:-1], N)                                         # (M, N) → (…, N)
        return dense_linear(x, weight, bias, gelu)

    def linear_residual_modulate(self, h_RlK, weight, bias, x_RlC, gate_R1C, mul_R1C, shift_R1C, eps, out_dtype):
        """``residual_modulate(x, linear(h, weight, bias), gate, mul, shift, …)``: an output projection
        into the residual stream and the next sub-layer's AdaLN input. Under ``"fused"`` at most
        ``SMALL_GEMM_ROWS`` rows run as a split-K product whose splits the norm's launch adds
        (``sparse_ops.linear_residual``): no reduction launch, and the same bits."""
        rows = h_RlK.numel() // h_RlK.shape[-1] if h_RlK.shape[-1] else 0
        if self.kind == "fused" and h_RlK.is_cuda and h_RlK.dtype == weight.dtype \
                and h_RlK.dtype in (torch.bfloat16, torch.float16) and 0 < rows <= ElementwiseOps.SMALL_GEMM_ROWS:
            from ..sparse_ops import ops as sparse_ops

            return sparse_ops.linear_residual_norm_modulate(h_RlK, weight, bias, x_RlC, gate_R1C, mul_R1C, shift_R1C,
                                                            eps, out_dtype, backend="triton")
        return self.residual_modulate(x_RlC, self.linear(h_RlK, weight, bias), gate_R1C, mul_R1C, shift_R1C, eps,
                                      out_dtype)

    @staticmethod
    def _fused_modulate(kernel, x, mul, shift, eps, out_dtype):
        return kernel(x, None, None, mul, shift, eps, out_dtype, backend="triton")[1]

    def _rope_norm_then_store(self, qkv_Rl3Hd, q_mult_H1, cos_Rl1P, sin_Rl1P, k_dst_RHld, v_dst_RHld):
        if self._compiled_rope is None:
            self._compiled_rope = torch.compile(_qk_rope, dynamic=True, fullgraph=True)
        q_RlHd, k_RlHd = self._compiled_rope(qkv_Rl3Hd[:, :, :2], q_mult_H1, cos_Rl1P, sin_Rl1P)
        k_dst_RHld.copy_(k_RlHd.transpose(1, 2))
        v_dst_RHld.copy_(qkv_Rl3Hd[:, :, 2].transpose(1, 2))
        return q_RlHd.transpose(1, 2)

    def _norm_then_store(self, qkv_Rl3Hd, mult_2H1, k_dst_RHld, v_dst_RHld):
        qk_Rl2Hd = self.qk_normalize(qkv_Rl3Hd[:, :, :2], mult_2H1)
        k_dst_RHld.copy_(qk_Rl2Hd[:, :, 1].transpose(1, 2))
        v_dst_RHld.copy_(qkv_Rl3Hd[:, :, 2].transpose(1, 2))
        return qk_Rl2Hd[:, :, 0].transpose(1, 2)


EAGER_OPS = ElementwiseOps(compiled=False)
