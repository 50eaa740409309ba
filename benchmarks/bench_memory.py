"""Peak GPU memory and time per memory setting, on a simulated card size (issue #32).

For each model (random weights at real size; Infinity with Flan-T5-XL's encoder and HART with
Qwen2-1.5B at their real sizes, random weights, so the text encoders' 2.4 / 3.1 GB are counted), each card size and each setting, one row:
the peak memory PyTorch allocated during a call (``torch.cuda.max_memory_allocated``, the call's
KV cache, activations and weights on the GPU included; the CUDA context is not) and the most its
allocator held (``max_memory_reserved``: what a card must have, CUDA-graph pools included) and the call's wall
time end to end (prompt encoding and decode included), median of ``runs`` after ``warmup``; or,
where the setting does not fit the card, the reason (the pipeline's own refusal before it starts,
or the out-of-memory error).

A card of ``G`` GB is simulated with ``torch.cuda.set_per_process_memory_fraction(G / total)``:
the allocator refuses past it as a card of that size would (the context and cuBLAS workspace of a
real card come on top). Each row records the allocator's configuration (``PYTORCH_CUDA_ALLOC_CONF``;
``sparsevar bench memory`` sets expandable segments unless the variable is set).
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Sequence

import torch

from ._results import write_csv

# setting → (what it enables on the pipeline, description)
SETTINGS: dict[str, tuple[Callable, str]] = {
    "dense": (lambda pipe: None, "every component on the GPU"),
    "offload": (lambda pipe: pipe.enable_model_cpu_offload(), "enable_model_cpu_offload()"),
    "scalekv": (lambda pipe: pipe.enable_scalekv(), "ScaleKV preset"),
    "stream": (lambda pipe: pipe.enable_text_encoder_streaming(), "text encoder streamed block by block"),
    "stream+scalekv": (lambda pipe: (pipe.enable_scalekv(), pipe.enable_text_encoder_streaming()),
                       "ScaleKV preset + text encoder streamed block by block"),
    "scalekv+offload": (lambda pipe: (pipe.enable_scalekv(), pipe.enable_model_cpu_offload()),
                        "ScaleKV preset + model CPU offload"),
    "sequential": (lambda pipe: pipe.enable_sequential_cpu_offload(),
                   "enable_sequential_cpu_offload(): the blocks' matrices and the text encoder's blocks streamed"),
    "sequential+scalekv": (lambda pipe: (pipe.enable_scalekv(), pipe.enable_sequential_cpu_offload()),
                           "ScaleKV preset + sequential CPU offload"),
    "scalekv+offload+cond-only-last-3": (
        lambda pipe: (pipe.enable_scalekv(), pipe.enable_scale_skip(cond_only_from=-3),
                      pipe.enable_model_cpu_offload()),
        "ScaleKV preset + model CPU offload + the last 3 scales without the unconditional half"),
}


def _pipeline(name: str, dtype: torch.dtype, vae_dtype: torch.dtype, real_text_encoder: bool):
    """(pipeline on the GPU, call() → output)."""
    if name.startswith("infinity"):
        from ..models.text_encoder import random_t5_xl
        from ..pipelines.infinity_pipeline import InfinityPipeline
        pipe = InfinityPipeline.from_random(name, device="cuda", dtype=dtype, vae_dtype=vae_dtype)
        if real_text_encoder:
            tokenizer, t5 = random_t5_xl("cuda", torch.bfloat16)
            pipe = InfinityPipeline(transformer=pipe.transformer, vae=pipe.vae, text_encoder=t5, tokenizer=tokenizer)
        return pipe, lambda gen: pipe("w3 w4 w5 w6 w7 w8", generator=gen)
    if name.startswith("hart"):
        from ..models.hart_text import random_qwen2_1_5b
        from ..pipelines.hart_pipeline import HARTPipeline
        pipe = HARTPipeline.from_random(name, device="cuda", dtype=dtype, vae_dtype=vae_dtype)
        if real_text_encoder:
            tokenizer, qwen = random_qwen2_1_5b("cuda", torch.bfloat16)
            pipe = HARTPipeline(transformer=pipe.transformer, vqvae=pipe.vqvae, text_encoder=qwen, tokenizer=tokenizer)
        return pipe, lambda gen: pipe("w3 w4 w5 w6", generator=gen)
    from ..pipelines.var_pipeline import VARPipeline
    pipe = VARPipeline.from_random(name, device="cuda", dtype=dtype)
    return pipe, lambda gen: pipe([1], generator=gen)


def _reset(pipe) -> None:
    """Back to every component on the GPU, no policy, no workspace."""
    pipe.disable_model_cpu_offload()
    pipe.disable_sequential_cpu_offload()
    pipe.disable_text_encoder_streaming()
    pipe.to("cuda")
    for name in [p.name for p in pipe.policies]:
        pipe.remove_policy(name)
    pipe.release_memory()
    torch.cuda.empty_cache()


def run_memory(models: Sequence[str], cards_gb: Sequence[float], settings: Sequence[str], runs: int = 3,
               warmup: int = 1, dtype: str = "bfloat16", vae_dtype: str = "bfloat16",
               real_text_encoder: bool = True, out=None, log: Callable[[str], None] = print) -> list[dict]:
    """One row per (model, card, setting); see the module docstring. Writes ``out`` (CSV) if given."""
    total = torch.cuda.get_device_properties(0).total_memory
    gpu = torch.cuda.get_device_name()
    rows = []
    for name in models:
        pipe, call = _pipeline(name, getattr(torch, dtype), getattr(torch, vae_dtype), real_text_encoder)
        pipe.set_progress_bar_config(disable=True)
        pipe.set_kernels("triton")
        for card in cards_gb:
            for setting in settings:
                enable, text = SETTINGS[setting]
                _reset(pipe)
                torch.cuda.set_per_process_memory_fraction(min(1.0, card * 1e9 / total))
                row = dict(model=name, card_gb=card, setting=setting, settings=text, fits=False, peak_gb=float("nan"),
                           reserved_gb=float("nan"),
                           e2e_ms=float("nan"), loop_ms=float("nan"), decode_ms=float("nan"), reason="", runs=runs,
                           gpu=gpu, torch=torch.__version__,
                           allocator=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or "default")
                try:
                    enable(pipe)
                    torch.cuda.reset_peak_memory_stats()
                    times, loops, decodes = [], [], []
                    for i in range(warmup + runs):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        out_ = call(torch.Generator("cuda").manual_seed(i))
                        torch.cuda.synchronize()
                        if i >= warmup:
                            times.append((time.perf_counter() - t0) * 1e3)
                            loops.append(out_.stats[0].transformer_ms)
                            decodes.append(out_.stats[0].decode_ms)
                    row.update(fits=True, peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 3),
                               reserved_gb=round(torch.cuda.max_memory_reserved() / 1e9, 3),
                               e2e_ms=round(statistics.median(times), 1), loop_ms=round(statistics.median(loops), 1),
                               decode_ms=round(statistics.median(decodes), 1))
                except torch.cuda.OutOfMemoryError as e:
                    row["reason"] = "out of memory: " + " ".join(str(e).split())[:600]
                except ValueError as e:                         # the pipeline's own refusal, before any work
                    row["reason"] = str(e)
                finally:
                    torch.cuda.set_per_process_memory_fraction(1.0)
                rows.append(row)
                if row["fits"]:
                    log(f"{name} card {card:g} GB {setting:34s} peak {row['peak_gb']:.2f} GB (reserved "
                        f"{row['reserved_gb']:.2f}) e2e {row['e2e_ms']:.1f} ms "
                        f"(loop {row['loop_ms']:.1f}, decode {row['decode_ms']:.1f})")
                else:
                    log(f"{name} card {card:g} GB {setting:34s} does not fit: {row['reason'][:200]}")
        _reset(pipe)
        del pipe
        torch.cuda.empty_cache()
    if out is not None:
        write_csv(rows, out, log)
    return rows


__all__ = ["SETTINGS", "run_memory"]
