"""Plain functions over tensors used by the models and policies.

- ``ref.py``: the pure-torch reference of every op (CPU path, fallback, test oracle);
- one file per op with its Triton kernel and launcher, same signature as the reference:
  ``gather_modulate.py`` (gather → LayerNorm → AdaLN modulation; row gather / scatter),
  ``restore.py`` (FastVAR's restore with the gated residual), ``select.py`` (SparseVAR's change
  map and kept-token selection), ``anchor.py`` (anchor matching), ``colsum.py`` (attention column
  sums per query group), ``group_attention.py`` (SparVAR's CS4A: each query group's listed keys
  gathered), ``window_attention.py`` (SparVAR's CSLA: each patch of queries reads its windows'
  keys), ``dense_fused.py`` (the dense path's gated residual + LayerNorm + AdaLN and
  q/k normalisation + KV-cache write, with Infinity's RoPE in ``qk_norm_rope_store``, each one kernel),
  ``cache_attention.py`` (VAR's q/k norm, KV-cache write and attention over the cache in one
  launch), ``linear.py`` (the dense path's GEMM for a few rows, deterministic split-K),
  ``linear_residual.py`` (an output projection whose split-K sums the gated residual + LayerNorm +
  AdaLN launch adds), ``sample.py`` (top-k /
  top-p filtering and the categorical draw in one launch), ``stage_embed.py`` (VAR's input map of a
  scale: pooling, embedding, positions and the CFG copy in one launch); their front ends are
  ``ops.linear``, ``ops.sample_top_k_top_p`` and ``ops.stage_embed`` (not re-exported here: the
  names are the modules');
- ``ops.py``: the front ends, which pick the kernel or the reference per call
  (``backend="auto" | "triton" | "torch"``, see ``_backend.py``);
- ``attention.py``: the attention backend chosen per call (SDPA, varlen, FlexAttention);
- ``_backend.py``: which implementation runs (Triton or torch), and the shared memory a launch
  shape may use on the GPU at hand (``shared_memory``, ``fit_stages``);
- ``gemm_rows.py``: cuBLAS row padding — buffers with spare rows, and per GPU a measured table of
  the row counts at which cuBLAS picks a slow kernel (``gemm_rows/*.json``, written by
  ``benchmarks/bench_gemm_rows.py``) together with the count to run them on instead.

Importing this package never imports triton.
"""
from ._backend import BACKENDS, resolve_backend
from .ops import (anchor_match, attention_colsum, change_map, gather_norm_modulate, gather_rows, qk_norm_store,
                  residual_norm_modulate, restore_residual, scatter_rows, select_kept)

__all__ = ["BACKENDS", "resolve_backend", "anchor_match", "attention_colsum", "change_map", "gather_norm_modulate",
           "gather_rows", "qk_norm_store", "residual_norm_modulate", "restore_residual", "scatter_rows", "select_kept"]
