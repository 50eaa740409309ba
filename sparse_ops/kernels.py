"""Which implementation runs each step of a block and of the scale loop: the one place that chooses
kernels for the models (``Kernels``), over the plain-torch steps below and the Triton kernels of
this package (``sparse_ops.ops``, whose functions take a ``backend`` per call)."""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from . import ref
from ._backend import CHAIN_ROWS


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


# ---- the steps of an AdaLN block in plain torch ----------------------------------------------------
# At batch 1 a VAR layer is dominated by small elementwise kernels, not by its GEMMs. These
# functions each do one step in as few kernels as eager PyTorch allows: the "torch" kernels, and
# what torch.compile fuses under "compile".

def modulate(x_RlC: torch.Tensor, mul_R1C: torch.Tensor, shift_R1C: torch.Tensor, eps: float,
             out_dtype: torch.dtype, rms: bool = False) -> torch.Tensor:
    """LN(x)·mul + shift (LayerNorm without affine, in float32; with ``rms`` RMSNorm without its
    weight, which ``mul`` then holds), returned in ``out_dtype``. ``mul`` is 1 + scale (precomputed
    once per image)."""
    if rms:
        y = ref.rms_normalize(x_RlC.float(), eps)
    else:
        y = F.layer_norm(x_RlC.float(), (x_RlC.shape[-1],), eps=eps)
    return torch.addcmul(shift_R1C, y, mul_R1C).to(out_dtype)


def qk_normalize(qk_Rl2Hd: torch.Tensor, mult_2H1: torch.Tensor) -> torch.Tensor:
    """L2-normalise q and k over the head dim in one pass and scale q by its temperature:
    ``mult_2H1`` = [exp(min(τ, ln 100)); 1] per head."""
    norm = torch.linalg.vector_norm(qk_Rl2Hd, dim=-1, keepdim=True, dtype=torch.float32)
    return (qk_Rl2Hd * (mult_2H1 / norm.clamp_min(1e-12))).to(qk_Rl2Hd.dtype)


def residual_modulate(x_RlC: torch.Tensor, branch_RlC: torch.Tensor, gate_R1C: torch.Tensor,
                      mul_R1C: torch.Tensor, shift_R1C: torch.Tensor, eps: float, out_dtype: torch.dtype,
                      rms: bool = False):
    """``gated_residual`` followed by the next sub-layer's ``modulate``: (new x, next branch input)."""
    x_RlC = gated_residual(x_RlC, branch_RlC, gate_R1C)
    return x_RlC, modulate(x_RlC, mul_R1C, shift_R1C, eps, out_dtype, rms)


def gated_residual(x_RlC: torch.Tensor, branch_RlC: torch.Tensor, gate_R1C: torch.Tensor) -> torch.Tensor:
    """x + gate · branch, in x's dtype (float32 residual stream)."""
    return torch.addcmul(x_RlC, branch_RlC, gate_R1C).to(x_RlC.dtype)


def _qk_rope(qk_Rl2Hd: torch.Tensor, q_mult_H1: torch.Tensor, cos_Rl1P: torch.Tensor, sin_Rl1P: torch.Tensor):
    """Infinity's cosine q/k with RoPE (``ref.qk_norm_rope_store`` without the cache write), for
    torch.compile: (q, k) as (R, l, H, d), q in the input dtype, k in float32."""
    from .ref import rope_pairs

    qk = qk_Rl2Hd.float()
    qk = qk / torch.linalg.vector_norm(qk, dim=-1, keepdim=True).clamp_min(1e-12)
    q = rope_pairs(qk[:, :, 0] * q_mult_H1, cos_Rl1P, sin_Rl1P).to(qk_Rl2Hd.dtype)
    return q, rope_pairs(qk[:, :, 1].contiguous(), cos_Rl1P, sin_Rl1P)


# ---- HART's llama steps (RMSNorm, rotate-half RoPE, SwiGLU) in plain torch ------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · x / √(mean(x²) + eps)``: the mean of squares in float32, cast back to x's dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_rotate_half(x_BHLd: torch.Tensor, cos_BLd: torch.Tensor, sin_BLd: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin, rotate_half(x) = [−x₂, x₁] (halves of the head dim)."""
    return ref.rope_half(x_BHLd, cos_BLd[:, None].to(x_BHLd.dtype), sin_BLd[:, None].to(x_BHLd.dtype))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up (SwiGLU's middle)."""
    return F.silu(gate) * up


def _rope_half(qk_Rl2Hd: torch.Tensor, cos_Rld: torch.Tensor, sin_Rld: torch.Tensor, q_scale: float):
    """``ref.rope_half_store`` without the cache write, for torch.compile: (q in the input dtype, k in
    float32), each (R, l, H, d)."""
    qk = ref.rope_half(qk_Rl2Hd.float(), cos_Rld[:, :, None, None], sin_Rld[:, :, None, None])
    return (qk[:, :, 0] * q_scale).to(qk_Rl2Hd.dtype), qk[:, :, 1]


KERNEL_KINDS = ("torch", "triton", "compile")


class Kernels:
    """The implementation of every step a model runs per layer and per scale, chosen once: one
    instance per adapter (no global cache); the attributes are the steps.

    kind: ``"torch"`` (plain torch: the reference, and the only kind on the CPU); ``"triton"`` (this
    package's hand-written Triton kernels: ``sparse_ops.dense_fused`` for LayerNorm or RMSNorm + AdaLN
    with the residual add and for the q/k norm or RoPE + KV-cache write, one launch each; the GEMM of
    ``sparse_ops.linear`` for products of at most ``SMALL_GEMM_ROWS`` rows; ``qk_norm_attend`` —
    VAR's q/k norm, cache write and unmasked attention in one launch, None under the other kinds;
    VAR's guidance (``cfg_guide``), scale input (``stage_embed``) and latent update
    (``phi_accumulate``), the cross-attention softmax and HART's diffusion-head AdaLN step
    (``token_residual_norm_modulate``, None under the other kinds) in one launch each; torch.compile for the
    gated residual and HART's ``silu_mul``); ``"compile"``
    (each plain-torch step compiled by torch.compile at its first call, with dynamic token counts so
    every scale shares a kernel).

    ``linear(x, weight, bias=None, gelu=False)`` is the layers' matrix product: cuBLAS, except under
    ``"triton"`` at few rows. Under ``"triton"`` with ``row_padding`` (default) a cuBLAS product runs
    on the row count that this GPU's shipped table gives for its shape, where its input has the spare
    rows (``sparse_ops.gemm_rows``): the table lists row counts at which cuBLAS picks a slow kernel;
    no timing is taken at run time.
    """

    # Up to this many rows the Triton GEMM, chained by programmatic dependent launch, beats cuBLAS
    # (benchmarks/results/README.md)
    SMALL_GEMM_ROWS = CHAIN_ROWS

    def __init__(self, kind: str = "torch", row_padding: bool = True):
        if kind not in KERNEL_KINDS:
            raise ValueError(f"kernels={kind!r}: choose one of {KERNEL_KINDS}")
        self.kind = kind
        self.compiled = kind != "torch"
        # "triton" only: cuBLAS products on the row counts of this GPU's shipped table (sparse_ops.gemm_rows)
        self.row_padding = row_padding
        self._row_tables: dict = {}      # CUDA device index → its table or None, read at first use
        self._compiled: dict = {}         # a q/k step → its torch.compile wrapper ("compile" only)
        self.linear = dense_linear
        self.qk_norm_attend = None          # VAR's norm + cache write + attention in one launch ("triton" only)
        # HART's diffusion head: gated residual + LayerNorm + per-token AdaLN in one launch ("triton" only)
        self.token_residual_norm_modulate = None
        self.bias_softmax = ref.bias_softmax
        self.cfg_guide = ref.cfg_guide      # (1 + t)·cond − t·uncond in float32
        self.stage_embed = ref.stage_embed  # VAR's input map of a scale
        self.phi_accumulate = ref.phi_accumulate  # VAR's latent update f_hat += φ(h)
        fns = dict(modulate=modulate, qk_normalize=qk_normalize, gated_residual=gated_residual,
                   residual_modulate=residual_modulate, silu_mul=silu_mul)
        # not fullgraph: Dynamo counts recompilations per function, over every Kernels instance of the
        # process (each model, dtype and rank compiles its own variant); past its limit a fullgraph
        # function fails, this one runs the plain-torch step
        for name, fn in fns.items():
            setattr(self, name, torch.compile(fn, dynamic=True) if self.compiled else fn)
        if kind == "triton":
            from . import ops as sparse_ops

            self.modulate = functools.partial(self._fused_modulate, sparse_ops.residual_norm_modulate)
            self.residual_modulate = functools.partial(sparse_ops.residual_norm_modulate, backend="triton")
            self.qk_normalize_store = functools.partial(sparse_ops.qk_norm_store, backend="triton")
            self.qk_norm_rope_store = functools.partial(sparse_ops.qk_norm_rope_store, backend="triton")
            self.rope_half_store = functools.partial(sparse_ops.rope_half_store, backend="triton")
            self.qk_norm_attend = functools.partial(sparse_ops.qk_norm_attend, backend="triton")
            self.token_residual_norm_modulate = functools.partial(sparse_ops.token_residual_norm_modulate,
                                                                  backend="triton")
            self.linear = functools.partial(self._fused_linear, sparse_ops.linear)        # bound: reads the table
            self.bias_softmax = functools.partial(sparse_ops.bias_softmax, backend="triton")
            self.cfg_guide = functools.partial(sparse_ops.cfg_guide, backend="triton")
            self.stage_embed = functools.partial(sparse_ops.stage_embed, backend="triton")
            self.phi_accumulate = functools.partial(sparse_ops.phi_accumulate, backend="triton")
        elif kind == "compile":
            # compiling the cache write into the norm gave four kernels instead of one (torch 2.11):
            # the compiled norm, and two plain copies write the cache
            self.qk_normalize_store = self._norm_then_store
            self.qk_norm_rope_store = self._rope_norm_then_store
            self.rope_half_store = self._rope_half_then_store
        else:
            self.qk_normalize_store = ref.qk_norm_store
            self.qk_norm_rope_store = ref.qk_norm_rope_store
            self.rope_half_store = ref.rope_half_store

    # A long reduction (K ≥ 2N, the FFN's second product) on (CHUNK_ROWS, 2·CHUNK_ROWS) rows runs
    # through cuBLAS in row blocks of CHUNK_ROWS: its heuristic takes a slow kernel there
    # (benchmarks/results/README.md)
    CHUNK_ROWS = 512

    def row_table(self, device: torch.device):
        """The GEMM row table of this CUDA device (None: no padding — not "triton", switched off, not
        CUDA, or no table shipped for this GPU and CUDA version)."""
        if self.kind != "triton" or not self.row_padding or device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._row_tables:
            from .gemm_rows import GemmRowTable

            self._row_tables[index] = GemmRowTable.for_device(torch.device("cuda", index))
        return self._row_tables[index]

    def _fused_linear(self, kernel, x, weight, bias=None, gelu=False):
        K, N = x.shape[-1], weight.shape[0]
        rows = x.numel() // K if K else 0
        if x.is_cuda and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16):
            if rows <= Kernels.SMALL_GEMM_ROWS:
                return kernel(x, weight, bias, gelu, backend="triton")
            table = self.row_table(x.device)
            epilogue = "gelu" if gelu else ("bias" if bias is not None else "none")
            if table is not None and table.covers(N, K, epilogue, x.dtype) and not torch.is_grad_enabled() \
                    and (bias is not None or not gelu):
                # a shape this GPU's table measured: its row counts replace the row blocks below
                from .gemm_rows import linear_rows, padded_rows

                return linear_rows(x, weight, bias, gelu, padded_rows(table, x, N, epilogue))
            chunk = Kernels.CHUNK_ROWS
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

    def linear_residual_modulate(self, h_RlK, weight, bias, x_RlC, gate_R1C, mul_R1C, shift_R1C, eps, out_dtype,
                                 rms=False):
        """``residual_modulate(x, linear(h, weight, bias), gate, mul, shift, …)``: an output projection
        into the residual stream and the next sub-layer's AdaLN input. Under ``"triton"`` at most
        ``SMALL_GEMM_ROWS`` rows run as a split-K product whose splits the norm's launch adds
        (``sparse_ops.linear_residual``): no reduction launch, and the same bits."""
        rows = h_RlK.numel() // h_RlK.shape[-1] if h_RlK.shape[-1] else 0
        if self.kind == "triton" and h_RlK.is_cuda and h_RlK.dtype == weight.dtype \
                and h_RlK.dtype in (torch.bfloat16, torch.float16) and 0 < rows <= Kernels.SMALL_GEMM_ROWS:
            from . import ops as sparse_ops

            return sparse_ops.linear_residual_norm_modulate(h_RlK, weight, bias, x_RlC, gate_R1C, mul_R1C, shift_R1C,
                                                            eps, out_dtype, rms, backend="triton")
        return self.residual_modulate(x_RlC, self.linear(h_RlK, weight, bias), gate_R1C, mul_R1C, shift_R1C, eps,
                                      out_dtype, rms)

    @staticmethod
    def _fused_modulate(kernel, x, mul, shift, eps, out_dtype, rms=False):
        return kernel(x, None, None, mul, shift, eps, out_dtype, rms, backend="triton")[1]

    def _compiled_then_store(self, fn, qkv_Rl3Hd, k_dst_RHld, v_dst_RHld, *args):
        """The q/k step ``fn`` of q and k (compiled at its first call), then k and raw v into their cache
        slots as plain copies (compiled in, the writes gave more kernels); returns q (R, H, l, d)."""
        if fn not in self._compiled:
            self._compiled[fn] = torch.compile(fn, dynamic=True)          # not fullgraph: see __init__
        q_RlHd, k_RlHd = self._compiled[fn](qkv_Rl3Hd[:, :, :2], *args)
        k_dst_RHld.copy_(k_RlHd.transpose(1, 2))
        v_dst_RHld.copy_(qkv_Rl3Hd[:, :, 2].transpose(1, 2))
        return q_RlHd.transpose(1, 2)

    def _rope_half_then_store(self, qkv_Rl3Hd, cos_Rld, sin_Rld, q_scale, k_dst_RHld, v_dst_RHld):
        return self._compiled_then_store(_rope_half, qkv_Rl3Hd, k_dst_RHld, v_dst_RHld, cos_Rld, sin_Rld, q_scale)

    def _rope_norm_then_store(self, qkv_Rl3Hd, q_mult_H1, cos_Rl1P, sin_Rl1P, k_dst_RHld, v_dst_RHld):
        return self._compiled_then_store(_qk_rope, qkv_Rl3Hd, k_dst_RHld, v_dst_RHld, q_mult_H1, cos_Rl1P, sin_Rl1P)

    def _norm_then_store(self, qkv_Rl3Hd, mult_2H1, k_dst_RHld, v_dst_RHld):
        qk_Rl2Hd = self.qk_normalize(qkv_Rl3Hd[:, :, :2], mult_2H1)
        k_dst_RHld.copy_(qk_Rl2Hd[:, :, 1].transpose(1, 2))
        v_dst_RHld.copy_(qkv_Rl3Hd[:, :, 2].transpose(1, 2))
        return qk_Rl2Hd[:, :, 0].transpose(1, 2)


TORCH_KERNELS = Kernels("torch")
