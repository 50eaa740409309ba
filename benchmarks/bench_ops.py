"""Per-op benchmark of ``sparse_ops``: every Triton kernel against its pure-torch twin and the roof.

    python -m sparsevar.benchmarks.bench_ops --out benchmarks/results/ops_H100.csv

For each op and shape it times the Triton kernel and the torch reference twice: ``ms`` is the GPU
time per call (10 calls captured in a CUDA graph, median of 20 replays: how the policies' layer
stacks run them) and ``ms_eager`` one call between CUDA events (median of ``--runs``), which also
counts host launch overhead when that is longer. One CSV row per implementation: the op's minimal
bytes (each input read once, each output written once) over ``ms`` as GB/s and the fraction of
the HBM roof, or TFLOP/s and the fraction of the bf16 tensor-core roof for the attention column sums (research/kernels.md §6: H100 ≈ 3.0 TB/s and
790 TFLOP/s; H200 4.3 TB/s). Targets (sparse_ops issue): each fused memory-bound op ≥ 60 % of HBM
bandwidth at 4096 tokens × 2048 channels; SparseVAR's selection + anchor matching ≤ 1 ms per
64×64 scale. GPU name, torch and triton versions go into every row.

Also times the attention backends on a padded batch (images with different kept counts): varlen
flash attention versus SDPA with a key mask, and dense SDPA on the same keys as a bound.
"""
from __future__ import annotations

import argparse
import itertools
import math
import statistics
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ._results import write_csv

from ..sparse_ops.kernels import dense_linear as _dense_linear
from ..sparse_ops import ref
from ..sparse_ops.attention import attention

PEAK_TBPS = {"H100": 3.0, "H200": 4.3}
PEAK_TFLOPS = {"H100": 790.0, "H200": 790.0}
TARGET_BW = 0.60                  # fraction of HBM bandwidth for the fused memory-bound ops
TARGET_SELECT_MS = 1.0            # selection + anchor matching per 64×64 scale


def _gpu_key(name: str) -> Optional[str]:
    return next((k for k in PEAK_TBPS if k in name), None)


def time_ms(fn: Callable[[], object], runs: int = 50, warmup: int = 10) -> float:
    """Eager: median of ``runs`` single calls, CUDA events around each, so host launch overhead
    (Python, Triton's launcher, allocations) counts whenever it exceeds the GPU time."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in times)


def time_graph_ms(fn: Callable[[], object], runs: int = 20, calls: int = 10) -> float:
    """GPU time per call: ``calls`` calls captured into one CUDA graph (as the policies' layer
    stacks run), median of ``runs`` replays / ``calls``. Raises if the call cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    del graph
    return statistics.median(a.elapsed_time(b) for a, b in times) / calls


def _cases(dev) -> list[dict]:
    """Each case: name, shape text, the inputs' dtypes, bytes / FLOPs of one call, and the call of
    either implementation (``fn(module)`` with the Triton module or ``ref``)."""
    from .. import sparse_ops
    from ..policies.sparsevar import anchor_candidates, anchor_count, anchor_mask, nearest_source
    from ..sparse_ops import anchor, colsum, dense_fused, gather_modulate, restore, select

    g = torch.Generator(device=dev).manual_seed(0)
    cases = []
    R, L, C = 2, 4096, 2048                         # one image with CFG at 64×64, Infinity-2B width
    x = torch.randn(R, L, C, device=dev, generator=g)
    mul = torch.randn(R, 1, C, device=dev, generator=g) * 0.1 + 1
    shift = torch.randn(R, 1, C, device=dev, generator=g) * 0.1
    for keep in (1.0, 0.5):
        n = int(L * keep)
        idx = torch.rand(R, L, device=dev, generator=g).argsort(dim=1)[:, :n].sort(dim=1).values
        by = R * n * C * (4 + 2) + idx.numel() * 8 + 2 * R * C * 4
        cases.append(dict(op="gather_norm_modulate", shape=f"R{R} L{L} n{n} C{C}", dtype="fp32→bf16", bytes=by,
                          memory_bound=True, target=True,
                          run={"triton": lambda idx=idx: gather_modulate.gather_norm_modulate(x, idx, mul, shift, 1e-6,
                                                                                              torch.bfloat16),
                               "torch": lambda idx=idx: ref.gather_norm_modulate(x, idx, mul, shift, 1e-6,
                                                                                 torch.bfloat16)}))
    n = L // 2
    idx = torch.rand(R, L, device=dev, generator=g).argsort(dim=1)[:, :n].sort(dim=1).values
    by = 2 * R * n * C * 4 + idx.numel() * 8
    cases.append(dict(op="gather_rows", shape=f"R{R} L{L} n{n} C{C}", dtype="fp32", bytes=by, memory_bound=True,
                      target=False, run={"triton": lambda: gather_modulate.gather_rows(x, idx),
                                         "torch": lambda: ref.gather_rows(x, idx)}))
    y = torch.randn(R, n, C, device=dev, generator=g)
    by = 2 * R * L * C * 4 + R * n * C * 4 + idx.numel() * 8
    cases.append(dict(op="scatter_rows", shape=f"R{R} L{L} n{n} C{C}", dtype="fp32", bytes=by, memory_bound=True,
                      target=False, run={"triton": lambda: gather_modulate.scatter_rows(x, idx, y),
                                         "torch": lambda: ref.scatter_rows(x, idx, y)}))
    branch = torch.randn(R, n, C, device=dev, generator=g).to(torch.bfloat16)
    gate = torch.randn(R, 1, C, device=dev, generator=g)
    for cache_hw in ((48, 48), (24, 24)):
        cache = torch.randn(R, cache_hw[0] * cache_hw[1], C, device=dev, generator=g)
        by = R * L * C * (4 + 4) + R * n * C * 2 + cache.numel() * 4 + idx.numel() * 8 + R * C * 4
        cases.append(dict(op="restore_residual", shape=f"R{R} 64x64 from {cache_hw[0]}x{cache_hw[1]} n{n} C{C}",
                          dtype="fp32 + bf16 branch", bytes=by, memory_bound=True, target=True,
                          run={"triton": lambda cache=cache, hw=cache_hw: restore.restore_residual(
                                   x, idx, branch, gate, cache, hw, (64, 64)),
                               "torch": lambda cache=cache, hw=cache_hw: ref.restore_residual(
                                   x, idx, branch, gate, cache, hw, (64, 64))}))
    # as FastVAR runs it: the inverse map comes from the selection, so the restore is one launch
    slot = ref.slot_map(idx, L)
    cases.append(dict(op="restore_residual", shape=f"R{R} 64x64 from 24x24 n{n} C{C} slot map given",
                      dtype="fp32 + bf16 branch", bytes=by + slot.numel() * 4, memory_bound=True, target=False,
                      run={"triton": lambda: restore.restore_residual(x, idx, branch, gate, cache, (24, 24), (64, 64),
                                                                      slot),
                           "torch": lambda: ref.restore_residual(x, idx, branch, gate, cache, (24, 24), (64, 64),
                                                                 slot)}))
    # FastVAR's selection before each pruned sub-layer: Infinity-2B's 40 × 40 scale and VAR-d30's
    # 13 × 13 at batch 1 and 8 with CFG (two reads of the float32 residual stream), with the inverse
    # map for the restore, as the policy calls it
    from ..sparse_ops import pivotal
    for Rp, hp_, Cp in ((2, 40, 2048), (2, 13, 1920), (16, 13, 1920)):
        xp = torch.randn(Rp, hp_ * hp_, Cp, device=dev, generator=g)
        kp = hp_ * hp_ - (hp_ * hp_) // 2
        cases.append(dict(op="pivotal_tokens", shape=f"R{Rp} {hp_}x{hp_} keep {kp} C{Cp}", dtype="fp32",
                          bytes=2 * xp.numel() * 4 + Rp * kp * 8 + Rp * hp_ * hp_ * 4, memory_bound=True,
                          target=False,
                          run={"triton": lambda xp=xp, kp=kp: pivotal.pivotal_tokens(xp, kp, slots=True),
                               "torch": lambda xp=xp, kp=kp: ref.pivotal_tokens(xp, kp, slots=True)}))
    # the dense path's fused steps (sparse_ops.dense_fused): at 4096 tokens for the HBM target, and
    # at VAR-d30's first scale (2 rows, one token each), where a launch costs more than the bytes
    for Rd, Ld, Cd in ((R, L, C), (2, 1, 1920)):
        xd = torch.randn(Rd, Ld, Cd, device=dev, generator=g)
        bd = torch.randn(Rd, Ld, Cd, device=dev, generator=g).to(torch.bfloat16)
        md, sd, gd = (torch.randn(Rd, 1, Cd, device=dev, generator=g) for _ in range(3))
        by = Rd * Ld * Cd * (4 + 2 + 4 + 2) + 3 * Rd * Cd * 4
        cases.append(dict(op="residual_norm_modulate", shape=f"R{Rd} L{Ld} C{Cd}", dtype="fp32 + bf16 → fp32, bf16",
                          bytes=by, memory_bound=True, target=Ld == L,
                          run={"triton": lambda a=(xd, bd, gd, md, sd): dense_fused.residual_norm_modulate(
                                   *a, 1e-6, torch.bfloat16),
                               "torch": lambda a=(xd, bd, gd, md, sd): ref.residual_norm_modulate(
                                   *a, 1e-6, torch.bfloat16)}))
    for Rq_, lq_, Hq_, dq_ in ((R, L, 16, 128), (2, 1, 30, 64)):
        qkv = torch.randn(Rq_, lq_, 3, Hq_, dq_, device=dev, generator=g).to(torch.bfloat16)
        mult = torch.rand(2, Hq_, 1, device=dev, generator=g) + 1
        kc, vc = (torch.empty(Rq_, Hq_, lq_ + 64, dq_, device=dev, dtype=torch.bfloat16) for _ in range(2))
        by = qkv.numel() * 2 * 2                     # read q, k, v; write q, k, v
        cases.append(dict(op="qk_norm_store", shape=f"R{Rq_} l{lq_} H{Hq_} d{dq_}", dtype="bf16", bytes=by,
                          memory_bound=True, target=lq_ == L,
                          run={"triton": lambda a=(qkv, mult, kc[:, :, 64:], vc[:, :, 64:]): dense_fused.qk_norm_store(*a),
                               "torch": lambda a=(qkv, mult, kc[:, :, 64:], vc[:, :, 64:]): ref.qk_norm_store(*a)}))
    # VAR's attention step in one launch (sparse_ops.cache_attention) against its twin and against the
    # two launches it replaces (the Triton norm + cache write, then SDPA as dispatched): VAR-d30's
    # first and last scale at batch 1, its last at batch 8 (CFG doubles the rows)
    from ..sparse_ops import cache_attention
    from ..sparse_ops.attention import dense_attention
    for Ra, la, start in ((2, 1, 0), (2, 256, 424), (16, 256, 424)):
        Ha, da = 30, 64
        qkv = torch.randn(Ra, la, 3, Ha, da, device=dev, generator=g).to(torch.bfloat16)
        mult = torch.rand(2, Ha, 1, device=dev, generator=g) + 1
        ka, va = (torch.randn(Ra, Ha, start + la, da, device=dev, generator=g).to(torch.bfloat16) for _ in range(2))
        La = start + la
        by = qkv.numel() * 2 + 2 * Ra * Ha * (start * da * 2 + la * da * 2) + Ra * la * Ha * da * 2
        fl = 4 * Ra * Ha * la * La * da

        def unfused(a=(qkv, mult, ka, va, start)):
            q = dense_fused.qk_norm_store(a[0], a[1], a[2][:, :, a[4]:], a[3][:, :, a[4]:])
            return dense_attention(q, a[2], a[3], scale=1.0)

        cases.append(dict(op="qk_norm_attend", shape=f"R{Ra} l{la} after {start} H{Ha} d{da}", dtype="bf16", bytes=by,
                          flops=fl, memory_bound=False, target=False,
                          run={"triton": lambda a=(qkv, mult, ka, va): cache_attention.qk_norm_attend(*a),
                               "torch": lambda a=(qkv, mult, ka, va): ref.qk_norm_attend(*a),
                               "triton norm + sdpa": unfused}))
    x_out = x + 0.1 * torch.randn(R, L, C, device=dev, generator=g)
    by = 2 * R * L * C * 4 + L * 4
    cases.append(dict(op="change_map", shape=f"R{R} L{L} C{C}", dtype="fp32", bytes=by, memory_bound=True,
                      target=True, run={"triton": lambda: select.change_map(x, x_out, 1, None, L),
                                        "torch": lambda: ref.change_map(x, x_out, 1, None, L)}))
    # SparseVAR's scale-level work at 64×64 (previous scale 48×48): selection, then anchor matching
    h = w = 64
    hp = wp = 48
    anchors = anchor_mask(h, w, 4, dev).reshape(h * w)
    cand = anchor_candidates(h, w, 4, dev)
    src = nearest_source((hp, wp), (h, w), dev)
    for B in (1, 8):
        change = torch.rand(B, hp * wp, device=dev, generator=g)
        budget = max(math.ceil(0.5 * h * w), anchor_count(h, w, 4))
        for mode, bud in (("tau", None), ("keep 0.5", budget)):
            cases.append(dict(op="select_kept", shape=f"B{B} 64x64 from 48x48 {mode}", dtype="fp32",
                              bytes=change.numel() * 4 + B * h * w * 17, memory_bound=False, target=False,
                              run={"triton": lambda c=change, b=bud: select.select_kept(c, src, anchors, 0.6, b),
                                   "torch": lambda c=change, b=bud: ref.select_kept(c, src, anchors, 0.6, b)}))
        for V in (4096, 64):
            logits = torch.randn(B, hp * wp, V, device=dev, generator=g)
            keep = ref.select_kept(change, src, anchors, 0.6, budget)[2]
            cases.append(dict(op="anchor_match", shape=f"B{B} 64x64 from 48x48 V{V}", dtype="fp32",
                              bytes=logits.numel() * 4 + B * h * w * 14, memory_bound=False, target=False,
                              run={"triton": lambda lg=logits, k=keep: anchor.anchor_match(lg, src, cand, k, anchors,
                                                                                           0.8),
                                   "torch": lambda lg=logits, k=keep: ref.anchor_match(lg, src, cand, k, anchors,
                                                                                       0.8)}))
            cases.append(dict(op="select_kept+anchor_match", shape=f"B{B} 64x64 from 48x48 V{V} keep 0.5",
                              dtype="fp32", bytes=logits.numel() * 4, memory_bound=False, target=B == 1,
                              run={impl: (lambda lg=logits, c=change, impl=impl: sparse_ops.anchor_match(
                                  lg, src, cand, sparse_ops.select_kept(c, src, anchors, 0.6, budget, backend=impl)[2],
                                  anchors, 0.8, backend=impl)) for impl in ("triton", "torch")}))
            del logits
    # SparVAR decision scale: 40×40 queries against the 1024-px cache up to that scale
    Rq, H, lq, Lk, d = 2, 16, 1600, 4121, 128
    q = torch.randn(Rq, H, lq, d, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(Rq, H, Lk, d, device=dev, generator=g).to(torch.bfloat16)
    flops = 2 * (2 * Rq * H * lq * Lk * d)              # q·kᵀ twice (LSE pass, column-sum pass)
    cases.append(dict(op="attention_colsum", shape=f"R{Rq} H{H} l{lq} Lk{Lk} d{d} group 192", dtype="bf16",
                      flops=flops, memory_bound=False, target=False,
                      run={"triton": lambda: colsum.attention_colsum(q, k, d ** -0.5, 192),
                           "torch": lambda: ref.attention_colsum(q, k, d ** -0.5, 192)}))
    # the few-row GEMM: VAR-d30's fc1 / fc2 and Infinity-2B's fc2 at 2 rows (batch 1 with CFG at the 1×1
    # scale); memory-bound: the weights are streamed once. Eight weight copies rotate past the 50 MB L2
    from ..sparse_ops import linear as linear_mod
    for N, K, gelu, what in ((7680, 1920, True, "VAR-d30 fc1"), (1920, 7680, False, "VAR-d30 fc2"),
                             (2048, 8192, False, "Infinity-2B fc2")):
        ws = [torch.randn(N, K, device=dev, generator=g).to(torch.bfloat16) * K ** -0.5 for _ in range(8)]
        bs = torch.randn(N, device=dev, generator=g).to(torch.bfloat16)
        xs = torch.randn(2, K, device=dev, generator=g).to(torch.bfloat16)
        pick = itertools.cycle(ws).__next__                 # the next of this case's weight copies
        cases.append(dict(op="linear", shape=f"{what}: M2 N{N} K{K}{' +GELU' if gelu else ''}", dtype="bf16",
                          bytes=N * K * 2, memory_bound=True, target=False,
                          run={"triton": lambda x=xs, b=bs, gl=gelu, p=pick: linear_mod.linear(x, p(), b, gl),
                               "torch": lambda x=xs, b=bs, gl=gelu, p=pick: _dense_linear(x, p(), b, gl)}))
    # an output projection into the residual stream (sparse_ops.linear_residual) at VAR-d30's first
    # scales: the product streams its weights (eight copies rotate past L2, as above); against its
    # twin and the unfused Triton path (the product, then the gated residual + LayerNorm + AdaLN)
    from ..sparse_ops import linear_residual
    for Rl, ll, Kl in ((2, 1, 1920), (2, 1, 7680), (2, 16, 7680)):
        Cl = 1920
        hl = torch.randn(Rl, ll, Kl, device=dev, generator=g).to(torch.bfloat16)
        wls = [(torch.randn(Cl, Kl, device=dev, generator=g) * Kl ** -0.5).to(torch.bfloat16) for _ in range(8)]
        bl = torch.randn(Cl, device=dev, generator=g).to(torch.bfloat16)
        xl = torch.randn(Rl, ll, Cl, device=dev, generator=g)
        gl, ml, sl = (torch.randn(Rl, 1, Cl, device=dev, generator=g) for _ in range(3))
        pick = itertools.cycle(wls).__next__
        by = Cl * Kl * 2 + hl.numel() * 2 + Rl * ll * Cl * (4 + 4 + 2)
        rest = (xl, gl, ml, sl, 1e-6, torch.bfloat16)
        cases.append(dict(op="linear_residual_norm_modulate", shape=f"R{Rl} l{ll} K{Kl} C{Cl}", dtype="bf16 + fp32",
                          bytes=by, flops=2 * Rl * ll * Kl * Cl, memory_bound=True, target=False,
                          run={"triton": lambda h=hl, b=bl, p=pick, r=rest: linear_residual.linear_residual_norm_modulate(
                                   h, p(), b, *r),
                               "torch": lambda h=hl, b=bl, p=pick, r=rest: ref.linear_residual_norm_modulate(h, p(), b, *r),
                               "triton unfused": lambda h=hl, b=bl, p=pick, r=rest: dense_fused.residual_norm_modulate(
                                   r[0], linear_mod.linear(h, p(), b), *r[1:])}))
    # top-k 900 / top-p 0.96 sampling of 4096-way logits: VAR-d30's last scale at batch 1 (256 rows)
    from ..sparse_ops import sample as sample_mod
    logits_s = torch.randn(256, 4096, device=dev, generator=g) * 3
    noise_s = torch.empty_like(logits_s).exponential_(generator=g)
    cases.append(dict(op="sample_top_k_top_p", shape="N256 V4096 top-k 900 top-p 0.96", dtype="fp32",
                      bytes=logits_s.numel() * 8, memory_bound=False, target=False,
                      run={"triton": lambda: sample_mod.sample_top_k_top_p(logits_s, noise_s, 900, 0.96),
                           "torch": lambda: ref.sample_top_k_top_p(logits_s, noise_s, 900, 0.96)}))
    # classifier-free guidance of VAR-d30's last scale at batch 8 (16 rows of 256 × 4096 bf16 logits
    # in, 8 of float32 out): one pass against torch's cast, two scalings and a subtraction
    from ..sparse_ops import guidance as guidance_mod
    logits_c = (torch.randn(16, 256, 4096, device=dev, generator=g) * 3).to(torch.bfloat16)
    cases.append(dict(op="cfg_guide", shape="B8 l256 V4096", dtype="bf16 → fp32",
                      bytes=logits_c.numel() * 2 + logits_c.numel() // 2 * 4, memory_bound=True, target=False,
                      run={"triton": lambda: guidance_mod.cfg_guide(logits_c, 8, 4.0),
                           "torch": lambda: ref.cfg_guide(logits_c, 8, 4.0)}))
    # VAR-d30's input map of its last scale at batch 8 (8 × 16 × 16 latent → 16 rows of 256 × 1920
    # float32): one launch against torch's pooling, casts, embedding, position add and CFG copy
    from ..sparse_ops import stage_embed as stage_mod
    f_se = torch.randn(8, 32, 16, 16, device=dev, generator=g)
    w_se = (torch.randn(1920, 32, device=dev, generator=g) * 0.2).to(torch.bfloat16)
    b_se = torch.randn(1920, device=dev, generator=g).to(torch.bfloat16)
    pos_se = torch.randn(256, 1920, device=dev, generator=g)
    cases.append(dict(op="stage_embed", shape="B8 16x16 from 16x16 K32 C1920, 2 copies", dtype="fp32 (bf16 embedding)",
                      bytes=f_se.numel() * 4 + pos_se.numel() * 4 + 16 * 256 * 1920 * 4, memory_bound=True,
                      target=False,
                      run={"triton": lambda: stage_mod.stage_embed(f_se, 16, 16, w_se, b_se, pos_se, 2),
                           "torch": lambda: ref.stage_embed(f_se, 16, 16, w_se, b_se, pos_se, 2)}))
    # VAR's latent update at batch 8 (8 × 32 × 16 × 16 float32: f_hat += φ(h)): one launch against
    # torch's cuDNN convolution and four elementwise passes; latency-bound at this size (in place: the
    # repeated calls keep adding into f_hat, which changes nothing about the time)
    from ..sparse_ops import phi as phi_mod
    h_phi = torch.randn(8, 32, 16, 16, device=dev, generator=g)
    f_phi = torch.randn(8, 32, 16, 16, device=dev, generator=g)
    w_phi = torch.randn(32, 32, 3, 3, device=dev, generator=g) * 0.1
    b_phi = torch.randn(32, device=dev, generator=g) * 0.1
    cases.append(dict(op="phi_accumulate", shape="B8 C32 16x16", dtype="fp32",
                      bytes=h_phi.numel() * 4 * 3, memory_bound=True, target=False,
                      run={"triton": lambda: phi_mod.phi_accumulate(h_phi, w_phi, b_phi, 0.5, f_phi),
                           "torch": lambda: ref.phi_accumulate(h_phi, w_phi, b_phi, 0.5, f_phi)}))
    # the absorbed cross-attention's softmax: Infinity-2B's last scale with CFG, 16 heads × a 32-token
    # prompt bucket (float32 logits in, bf16 probabilities out); memory-bound
    from ..sparse_ops import softmax as softmax_mod
    logits_a = torch.randn(2, 4096, 16 * 32, device=dev, generator=g) * 4
    bias_a = torch.randn(2, 1, 16 * 32, device=dev, generator=g)
    cases.append(dict(op="bias_softmax", shape="R2 l4096 16 groups of 32", dtype="fp32 → bf16",
                      bytes=logits_a.numel() * 6 + bias_a.numel() * 4, memory_bound=True, target=False,
                      run={"triton": lambda: softmax_mod.bias_softmax(logits_a, bias_a, 16, torch.bfloat16),
                           "torch": lambda: ref.bias_softmax(logits_a, bias_a, 16, torch.bfloat16)}))
    # the BSQ-VAE decoder's GroupNorm + SiLU at its largest map (1024², 128 channels, channels-last
    # bf16): three passes (partial statistics, their combination, normalise) against PyTorch's
    # GroupNorm then SiLU
    from ..sparse_ops import group_norm as gn_mod
    x_gn = torch.randn(1, 128, 1024, 1024, device=dev, generator=g).to(torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    w_gn = torch.randn(128, device=dev, generator=g)
    b_gn = torch.randn(128, device=dev, generator=g)
    cases.append(dict(op="group_norm_silu", shape="B1 C128 1024x1024 32 groups, channels-last", dtype="bf16",
                      bytes=x_gn.numel() * 2 * 3, memory_bound=True, target=False,
                      run={"triton": lambda: gn_mod.group_norm_silu(x_gn, w_gn, b_gn, 32, 1e-6, True),
                           "torch": lambda: ref.group_norm_silu(x_gn, w_gn, b_gn, 32, 1e-6, True)}))
    # the VQVAE decoders' GroupNorm + SiLU (VAR, FlexVAR, HART) at HART's largest map, channels-first
    # bf16: the channels-first kernels against PyTorch's GroupNorm then SiLU in bf16 (what those
    # decoders ran before)
    x_nchw = x_gn.contiguous()
    w_bf, b_bf = w_gn.to(torch.bfloat16), b_gn.to(torch.bfloat16)
    cases.append(dict(op="group_norm_silu", shape="B1 C128 1024x1024 32 groups, channels-first", dtype="bf16",
                      bytes=x_nchw.numel() * 2 * 3, memory_bound=True, target=False,
                      run={"triton": lambda: gn_mod.group_norm_silu(x_nchw, w_bf, b_bf, 32, 1e-6, True),
                           "torch": lambda: F.silu(F.group_norm(x_nchw, 32, w_bf, b_bf, 1e-6))}))
    # attention with padding keys: VAR-d30, 8 images with CFG at 13×13 whose kept counts differ;
    # Infinity-2B's last scale (2 images, half the 4096 tokens kept, 10k-token cache); Infinity's
    # cross-attention to padded prompts
    for Ra, Ha, da, la, Lka, frac, what in ((16, 30, 64, 120, 680, 0.85, "VAR-d30 b8 13x13"),
                                            (4, 16, 128, 2048, 8000, 0.85, "Infinity-2B b2 64x64"),
                                            (4, 16, 128, 4096, 128, 0.6, "Infinity cross-attn, text 128")):
        qa = torch.randn(Ra, Ha, la, da, device=dev, generator=g).to(torch.bfloat16)
        ka, va = (torch.randn(Ra, Ha, Lka, da, device=dev, generator=g).to(torch.bfloat16) for _ in range(2))
        valid = torch.rand(Ra, Lka, device=dev, generator=g) < frac
        valid[:, 0] = True
        cases.append(dict(op="attention with padding keys", shape=f"{what}: R{Ra} H{Ha} l{la} Lk{Lka} d{da} "
                                                               f"{frac:.0%} valid",
                          dtype="bf16", flops=4 * Ra * Ha * la * Lka * da, memory_bound=False, target=False,
                          run={"varlen": lambda q=qa, k=ka, v=va, m=valid, d=da: attention(
                                   q, k, v, d ** -0.5, key_valid_RL=m, backend="varlen"),
                               "sdpa+mask": lambda q=qa, k=ka, v=va, m=valid, d=da: attention(
                                   q, k, v, d ** -0.5, key_valid_RL=m, backend="sdpa"),
                               "sdpa dense (bound)": lambda q=qa, k=ka, v=va, d=da: attention(q, k, v, d ** -0.5)}))
    cases += _csla_cases(dev, g)
    cases += _cs4a_cases(dev, g)
    return cases


def _cs4a_cases(dev, g) -> list[dict]:
    """SparVAR's CS4A at the last scale of Infinity-2B 1024² (decision scale 40×40, 16 heads of 128)
    and of HART (decision scale 36×36, 24 of 64), lists as the policy builds them: each decision-scale
    group keeps a random ``top_keys`` = 0.2 of its keys (ascending), moved to the last scale by the
    relative map, the sinks (first 5 scales) and the group's band read as ranges, + the bilinear
    resize of O_cache. Three rows: the gathered kernel on one list a group, the policy's path (the
    decision scale's lists mapped, each group reading its source group's list, the keys read
    counted by the kernel), and dense attention over the whole cache. FLOPs count the keys each
    query reads."""
    from ..engine.schedule import ScaleSchedule
    from ..policies.sparvar import SparVARConfig, band_ranges, relative_key_map
    from ..sparse_ops import group_attention
    c = SparVARConfig()
    cases = []
    for name, hw, H, d, decision in (
            ("Infinity-2B 1024² 64x64", tuple((p, p) for p in (1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)), 16,
             128, 10),
            ("HART 1024² 64x64", ((1, 300),) + tuple((p, p) for p in (2, 3, 4, 5, 7, 9, 12, 16, 21, 27, 36, 48, 64)),
             24, 64, 10)):
        off = ScaleSchedule(hw).offsets
        si, R, C = len(hw) - 1, 2, c.query_group
        (h, w), (hS, wS) = hw[si], hw[decision]
        l, L, L_dec = h * w, off[si + 1], off[decision + 1]
        G_dec, G = -(-hS * wS // C), -(-l // C)
        K = max(1, round(c.top_keys * L_dec))
        idx = torch.rand(R, H, G_dec, L_dec, device=dev, generator=g).topk(K, dim=-1).indices.sort(-1).values
        map_L, sinks = relative_key_map(hw, decision, si)
        prefix = off[min(max(sinks, c.sink_scales), si + 1)]
        src_G = torch.clamp(((torch.arange(G, dtype=torch.float64) + 0.5) * G_dec / G - 0.5).round().long(), 0,
                            G_dec - 1)
        lists = map_L.to(dev)[idx[:, :, src_G.to(dev)]].to(torch.int32).contiguous()     # (R, H, G, K)
        count = torch.full((R, H, G), K, device=dev, dtype=torch.int32)
        idx_dec, count_dec = idx.to(torch.int32).contiguous(), torch.full((R, H, G_dec), K, device=dev,
                                                                            dtype=torch.int32)
        map_i32, src_i32 = map_L.to(dev, torch.int32), src_G.to(dev, torch.int32)
        reads_out = torch.empty(R, H, G, device=dev, dtype=torch.int32)
        band = (off[si] + band_ranges(h, w, C, c.local_window + 2 * (si - decision - 1))).to(dev, torch.int32)
        lo, hi = band[:, 0].clamp(min=prefix), band[:, 1]
        outside = (lists >= prefix) & ((lists < lo[:, None]) | (lists > hi[:, None]))
        per_group = prefix + (hi - lo + 1).clamp(min=0) + outside.sum(-1)                 # (R, H, G) keys read
        sizes = torch.full((G,), float(C), device=dev)
        sizes[-1] = l - C * (G - 1)
        reads = int((per_group.float() * sizes).sum())                                     # query-key pairs
        qc, kc, vc = (torch.randn(R, H, n, d, device=dev, generator=g).to(torch.bfloat16) for n in (l, L, L))
        o_cache = torch.randn(R, H, hS * wS, d, device=dev, generator=g).to(torch.bfloat16)
        cases.append(dict(op="cs4a attention", shape=f"{name}: R{R} H{H} l{l} Lk{L} d{d}, "
                                                      f"{reads / (R * H * l):.0f} keys a query",
                          dtype="bf16", flops=4 * reads * d, memory_bound=False, target=False,
                          run={"gathered": lambda q=qc, k=kc, v=vc, i=lists, n=count, p=prefix, b=band, a=o_cache,
                                   hw_=(h, w), ahw=(hS, wS), d=d: group_attention.group_sparse_attention(
                                       q, k, v, i, n, C, d ** -0.5, p, b, a, hw_, ahw),
                               "gathered, the policy's path (one list a source group, reads counted)":
                                   lambda q=qc, k=kc, v=vc, m=map_i32, i=idx_dec, n=count_dec, p=prefix, b=band,
                                   a=o_cache, hw_=(h, w), ahw=(hS, wS), d=d, s=src_i32, r=reads_out:
                                   group_attention.group_sparse_attention(q, k, v, m[i], n, C, d ** -0.5, p, b, a, hw_,
                                                                          ahw, s, r),
                               "sdpa dense (bound)": lambda q=qc, k=kc, v=vc, d=d: attention(q, k, v, d ** -0.5)}))
    return cases


def _csla_cases(dev, g) -> list[dict]:
    """SparVAR's CSLA at the last scale of Infinity-2B 1024² (16 heads of 128) and of HART (24 of 64;
    its 300 text slots first), paper windows 7/5/3 and 5 sink scales, two rows: the gathered windows
    (``window_attention``) against FlexAttention over a block mask of the same rule (128 × 64 blocks,
    compiled) and dense attention over the whole cache. FLOPs count the keys each query reads."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from ..policies.sparvar import csla_mask, csla_tables, csla_tiles
    from ..sparse_ops import window_attention
    flex = torch.compile(flex_attention, dynamic=False)
    cases = []
    for name, hw, H, d in (("Infinity-2B 1024² 64x64", tuple((p, p) for p in (1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40,
                                                                               48, 64)), 16, 128),
                           ("HART 1024² 64x64", ((1, 300),) + tuple((p, p) for p in (2, 3, 4, 5, 7, 9, 12, 16, 21, 27,
                                                                                     36, 48, 64)), 24, 64)):
        si, sinks, windows = len(hw) - 1, 5, (7, 5, 3)
        mask = csla_mask(hw, si, sinks, windows)
        l, L = mask.shape
        qc, kc, vc = (torch.randn(2, H, n, d, device=dev, generator=g).to(torch.bfloat16) for n in (l, L, L))
        tiles = [t.to(dev) if isinstance(t, torch.Tensor) else t for t in csla_tiles(hw, si, sinks, windows)]
        ylo, yhi, xlo, xhi = csla_tables(hw, si, sinks, windows).to(dev)
        w = hw[si][1]

        def mask_mod(b, h, q_idx, kv_idx, ylo=ylo, yhi=yhi, xlo=xlo, xhi=xhi, w=w):
            y = q_idx // w
            x = q_idx - y * w
            return (ylo[kv_idx] <= y) & (y <= yhi[kv_idx]) & (xlo[kv_idx] <= x) & (x <= xhi[kv_idx])

        bm = create_block_mask(mask_mod, B=None, H=None, Q_LEN=l, KV_LEN=L, device=dev, BLOCK_SIZE=(128, 64))
        per_query = mask.sum(1).float().mean()
        cases.append(dict(op="csla attention", shape=f"{name}: R2 H{H} l{l} Lk{L} d{d}, {per_query:.0f} keys a query",
                          dtype="bf16",
                          flops=4 * 2 * H * int(mask.sum()) * d, memory_bound=False, target=False,
                          run={"window": lambda q=qc, k=kc, v=vc, t=tiles, w=w, d=d: window_attention.window_attention(
                                   q, k, v, *t, w, d ** -0.5),
                               "flex": lambda q=qc, k=kc, v=vc, bm=bm, d=d: flex(
                                   q, k, v, block_mask=bm, scale=d ** -0.5, kernel_options={"BLOCK_N": 64}),
                               "sdpa dense (bound)": lambda q=qc, k=kc, v=vc, d=d: attention(q, k, v, d ** -0.5)}))
    return cases


def run_ops(out: Optional[Path] = None, runs: int = 50, ops: Optional[Sequence[str]] = None, log=print) -> list[dict]:
    """Benchmark every op (or those named in ``ops``) on the current CUDA device; rows as dicts,
    written to ``out`` as CSV when given."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_ops times GPU kernels: no CUDA device is available here")
    import triton
    gpu = torch.cuda.get_device_name()
    key = _gpu_key(gpu)
    tbps, tflops = (PEAK_TBPS[key], PEAK_TFLOPS[key]) if key else (float("nan"), float("nan"))
    if runs < 1:
        raise ValueError(f"runs={runs!r}: time each op at least once (e.g. --runs 50)")
    cases = _cases("cuda")
    unknown = sorted(set(ops or ()) - {c["op"] for c in cases})
    if unknown:
        raise ValueError(f"ops {unknown} are unknown; choose from {sorted({c['op'] for c in cases})}")
    rows = []
    for c in cases:
        if ops and c["op"] not in ops:
            continue
        base_ms = None
        for impl, fn in c["run"].items():
            try:
                eager_ms = time_ms(fn, runs=runs)
            except Exception as e:                 # record the failure and go on
                log(f"{c['op']:<26} {c['shape']:<42} {impl:<20} FAILED: {type(e).__name__}: {e}")
                continue
            try:
                ms = time_graph_ms(fn)
            except Exception as e:                 # not capturable: the eager time stands
                log(f"{c['op']:<26} {c['shape']:<42} {impl:<20} no CUDA graph ({type(e).__name__}: {e})")
                ms = eager_ms
            if impl in ("torch", "sdpa+mask"):
                base_ms = ms
            gbps = c["bytes"] / ms / 1e6 if "bytes" in c else float("nan")
            tfl = c["flops"] / ms / 1e9 if "flops" in c else float("nan")
            roof = gbps / (tbps * 1e3) if c.get("memory_bound") else (tfl / tflops if "flops" in c else float("nan"))
            if c["op"] == "select_kept+anchor_match":        # eager: the plan runs outside the graphs
                target, met = f"<= {TARGET_SELECT_MS} ms", eager_ms <= TARGET_SELECT_MS
            elif c["target"]:
                target, met = f">= {TARGET_BW:.0%} of HBM", roof >= TARGET_BW
            else:
                target, met = "", ""
            rows.append(dict(op=c["op"], shape=c["shape"], dtype=c["dtype"], impl=impl, ms=round(ms, 4),
                             ms_eager=round(eager_ms, 4),
                             gb_per_s=round(gbps, 1), tflop_per_s=round(tfl, 2), fraction_of_roof=round(roof, 3),
                             target=target if impl in ("triton", "varlen") else "",
                             meets_target=met if impl in ("triton", "varlen") else "",
                             speedup_vs_torch="", gpu=gpu, torch=torch.__version__, triton=triton.__version__))
            log(f"{c['op']:<24} {c['shape']:<40} {impl:<18} {ms:7.4f} ms (eager {eager_ms:7.4f})  {gbps:7.1f} GB/s  "
                f"{tfl:6.1f} TFLOP/s  {roof:6.1%} of roof")
        for r in rows:
            if r["op"] == c["op"] and r["shape"] == c["shape"] and base_ms:
                r["speedup_vs_torch"] = round(base_ms / r["ms"], 2)
        torch.cuda.empty_cache()
    if out is not None:
        write_csv(rows, out, log)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sparsevar.benchmarks.bench_ops", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="CSV file to write (e.g. benchmarks/results/ops_H100.csv)")
    p.add_argument("--runs", type=int, default=50, help="timed calls per op and implementation (median reported)")
    p.add_argument("--ops", nargs="*", default=None, help="only these ops (default: all)")
    args = p.parse_args(argv)
    run_ops(args.out, runs=args.runs, ops=args.ops)


if __name__ == "__main__":
    main()
