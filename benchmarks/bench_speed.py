"""Speed benchmark: dense generation of real-size models with random weights.

    sparsevar bench speed --models var-d16 var-d30 --batch 1 8 --runs 10
    sparsevar bench speed --models infinity-2b --methods dense sparsevar-preset sparsevar-keep0.3 \
        fastvar-preset skip-last-2          # Infinity at 1024 × 1024 (--resolution for others)

For each model × batch × method it times whole generations after warm-up and writes one CSV row:
median / min of the scale loop (sum of per-scale CUDA-event times), end-to-end wall time with
decode (and per image: ms and images per second), per-scale medians, peak memory, and the hardware floor of the scale loop
(research/kernels.md §6: per scale, max(FLOPs / peak, bytes of weights + KV cache / bandwidth)),
so every number says how far it is from the roof. Each method's speed-up over the dense row of the
same run sits beside two ideals: the ratio of FLOPs (``ideal_speedup``) and the ratio of floors
(``roofline_ideal_speedup``: the same floor model with the tokens the method computed, where a
weight-bound scale gains nothing from fewer tokens).
"""
from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from ._profile import profile_call
from ._results import atomic_write, write_csv


# H100 SXM ceilings used for the floor (kernels.md §6): dense bf16 tensor-core peak and HBM copy rate.
PEAK_TFLOPS = {"H100": 790.0, "H200": 790.0}
PEAK_TBPS = {"H100": 3.0, "H200": 4.3}

def _dense(pipe):
    pass


def _sparvar_dense():
    from ..policies.sparvar import SparVARConfig
    return SparVARConfig.dense()


def _sparsevar(**kw):
    return lambda pipe: pipe.enable_sparsevar(**kw)


# method → (policy setup on the pipeline, pipeline call arguments, kernels (pipe.set_kernels), settings text)
METHODS = {
    "dense": (_dense, dict(use_cuda_graphs=True), "triton", "graphs + this package's Triton kernels"),
    "dense-compile": (_dense, dict(use_cuda_graphs=True), "compile", "graphs + torch.compile kernels"),
    "dense-graphs": (_dense, dict(use_cuda_graphs=True), "torch", "graphs"),
    "dense-eager": (_dense, dict(use_cuda_graphs=False), "torch", "eager"),
    "sparsevar-keep1.0": (_sparsevar(keep_ratio=1.0, start_scale=-3), {}, "triton", "keep_ratio=1.0 on the last 3 scales"),
    "sparsevar-keep0.5": (_sparsevar(keep_ratio=0.5, start_scale=-3), {}, "triton", "keep_ratio=0.5 on the last 3 scales"),
    "sparsevar-keep0.3": (_sparsevar(keep_ratio=0.3, start_scale=-3), {}, "triton", "keep_ratio=0.3 on the last 3 scales"),
    "sparsevar-preset": (_sparsevar(), {}, "triton", "family preset (SPARSEVAR_PRESETS)"),
    "fastvar-preset": (lambda pipe: pipe.enable_fastvar(), {}, "triton", "family preset"),
    "skip-last-1": (lambda pipe: pipe.enable_scale_skip(skip_last=1), {}, "triton", "skip_last=1"),
    "skip-last-2": (lambda pipe: pipe.enable_scale_skip(skip_last=2), {}, "triton", "skip_last=2"),
    "sparvar-preset": (lambda pipe: pipe.enable_sparvar(), {}, "triton", "family preset (SPARVAR_PRESETS)"),
    "sparvar-neutral": (lambda pipe: pipe.enable_sparvar(_sparvar_dense()), {}, "triton",
                        "SparVARConfig.dense(): every key through the sparse machinery"),
    "sparvar+skip-last-2": (lambda pipe: (pipe.enable_scale_skip(skip_last=2), pipe.enable_sparvar()), {}, "triton",
                            "skip_last=2 + SparVAR preset (decision scale the third-last computed)"),
    "scalekv-preset": (lambda pipe: pipe.enable_scalekv(), {}, "triton",
                       "ScaleKV preset (SCALEKV_PRESETS; Infinity: the release's 10 % budgets)"),
    "scalekv-0.1": (lambda pipe: pipe.enable_scalekv(budget=0.1), {}, "triton",
                    "ScaleKV budget 0.1 after every scale past 650 cached tokens"),
    "scalekv+cond-only-last-3": (lambda pipe: (pipe.enable_scalekv(), pipe.enable_scale_skip(cond_only_from=-3)), {},
                                 "triton", "ScaleKV preset + the last 3 scales without the unconditional half"),
}
POLICY_METHODS = [m for m in METHODS if not m.startswith("dense")]


def _gpu_key(name: str) -> Optional[str]:
    for k in PEAK_TBPS:
        if k in name:
            return k
    return None


def _floor_ms(per_scale, gpu: str) -> float:
    """Sum over scales of max(FLOPs / peak, bytes / bandwidth); ``per_scale`` yields (FLOPs, bytes)."""
    key = _gpu_key(gpu)
    if key is None:
        return float("nan")
    return 1e3 * sum(max(flops / (PEAK_TFLOPS[key] * 1e12), nbytes / (PEAK_TBPS[key] * 1e12))
                     for flops, nbytes in per_scale)


def _scale_counts(patch_counts, stats):
    """(tokens, rows per image) of each scale: every token and 2 rows (dense), or what ``stats``
    (a generation's ``GenerationStats``) says ran."""
    if stats is None:
        return [(n, 2) for n in patch_counts]
    return [(s.tokens_computed, s.rows) for s in stats.scales]


def var_floor_ms(cfg, batch: int, weight_bytes: int, gpu: str, stats=None) -> float:
    """Lower bound of the scale loop of a VAR model with CFG (2·batch rows), AdaLN hoisted. With
    ``stats``, the bound for the tokens and rows that generation computed (a skipped scale costs
    nothing; excluded tokens add no K/V): dense floor / this floor is the roofline ideal of a method."""
    C, V, depth = cfg.embed_dim, cfg.vocab_size, cfg.depth
    hidden = round(C * cfg.mlp_ratio)
    block_w = (4 * C * C + 2 * C * hidden) * weight_bytes        # qkv + proj + fc1 + fc2
    head_w = C * V * weight_bytes

    def per_scale():
        prefix = 0
        for p, (n, r) in zip(cfg.patch_nums, _scale_counts([p * p for p in cfg.patch_nums], stats)):
            if n == 0:
                continue
            rows = r * batch
            prefix += n
            flops = rows * (depth * (2 * n * (4 * C * C + 2 * C * hidden) + 4 * n * prefix * C) + 2 * p * p * C * V)
            kv_bytes = depth * 2 * rows * prefix * C * weight_bytes
            yield flops, depth * block_w + head_w + kv_bytes

    return _floor_ms(per_scale(), gpu)


def infinity_floor_ms(cfg, hw, text_tokens: int, batch: int, weight_bytes: int, gpu: str, stats=None) -> float:
    """Lower bound of an Infinity scale loop with CFG (2·batch rows), the same model as
    :func:`var_floor_ms`: per scale max(FLOPs / peak, (block weights + head + K/V read) / bandwidth),
    FLOPs as ``infinity_loop_flops`` counts them (the projections of the cross-attention included);
    ``stats`` as for :func:`var_floor_ms`."""
    from ..models.infinity import ffn_hidden

    C, depth, V = cfg.embed_dim, cfg.depth, 2 * cfg.token_dim
    hidden = ffn_hidden(C, cfg.mlp_ratio)
    block_w = (6 * C * C + 2 * C * hidden) * weight_bytes        # qkv + proj + ca q + ca out + fc1 + fc2
    head_w = C * V * 4                                             # the head runs in float32

    def per_scale():
        prefix = 0
        for (h, w), (n, r) in zip(hw, _scale_counts([h * w for h, w in hw], stats)):
            if n == 0:
                continue
            rows = r * batch
            prefix += n
            flops = rows * (depth * (2 * n * (6 * C * C + 2 * C * hidden) + 4 * n * prefix * C
                                     + 4 * n * text_tokens * C) + 2 * h * w * C * V)
            kv_bytes = depth * 2 * rows * (prefix + text_tokens) * C * weight_bytes
            yield flops, depth * block_w + head_w + kv_bytes

    return _floor_ms(per_scale(), gpu)


def hart_floor_ms(cfg, batch: int, weight_bytes: int, gpu: str, stats=None) -> float:
    """Lower bound of HART's loop with CFG (2·batch rows), the same model as :func:`var_floor_ms`
    over the engine's scales (the text first): FLOPs as ``hart_loop_flops`` counts them per scale,
    bytes the block weights, the float32 head and the K/V read; ``stats`` as for :func:`var_floor_ms`."""
    from ..models.hart import hart_loop_flops

    C, depth, V = cfg.embed_dim, cfg.depth, cfg.vocab_size
    hidden = int((C * cfg.mlp_ratio * 2) / 3 + 255) // 256 * 256
    block_w = (4 * C * C + 3 * C * hidden) * weight_bytes
    sizes = [cfg.context_token] + [p * p for p in cfg.patch_nums[1:]]

    def per_scale():
        prefix = 0
        for k, (n, r) in enumerate(_scale_counts(sizes, stats)):
            if n == 0:
                continue
            prefix += n
            only = [0] * len(sizes)
            only[k] = n
            kv = [0] * len(sizes)
            kv[k] = prefix
            flops = hart_loop_flops(cfg, batch, r, tokens_per_scale=only, kv_per_scale=kv)
            yield flops, depth * block_w + C * V * 4 + depth * 2 * r * batch * prefix * C * weight_bytes

    return _floor_ms(per_scale(), gpu)


def _time_runs(call, kw, warmup, runs, device, loop_ms, e2e_ms, decode_ms, per_scale, tokens, policy, ideal,
               floors, floor_of) -> None:
    for i in range(warmup + runs):
        gen = torch.Generator(device).manual_seed(i)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result, flop_speedup = call(gen, kw)
        if device == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        if i < warmup:
            continue
        st = result.stats[0]
        loop_ms.append(st.transformer_ms)
        decode_ms.append(st.decode_ms)
        e2e_ms.append((t1 - t0) * 1e3)
        per_scale.append([s.ms for s in st.scales])
        tokens.append([s.tokens_computed for s in st.scales])
        policy.append([s.policy_ms for s in st.scales])
        ideal.append(flop_speedup(st))
        floors.append(floor_of(st))


# the text-to-image models' timed prompt: words of the tiny random tokenizers' vocabulary
PROMPT = "w3 w4 w5 w6"


def _prompt(pipe, prompt: str, encode_once: bool) -> dict:
    """The text arguments of a text-to-image call: the prompt itself (encoded in every call), or with
    ``encode_once`` its features, encoded here once (the official samplers' timings leave the text
    encoder out); ``num_images_per_prompt`` then makes the batch."""
    if not encode_once:
        return {}
    return {"prompt_features": pipe.encode_prompt([prompt])}


def _text_call(pipe, prompt: str, features: dict, batch: int, **kw):
    if features:
        return pipe(**features, num_images_per_prompt=batch, **kw)
    return pipe([prompt] * batch, **kw)


def text_encoder_ms(pipe, prompt: str, batch: int, runs: int, device: str) -> float:
    """Median wall time of encoding ``batch`` prompts with the pipeline's text encoder."""
    times = []
    for _ in range(runs + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        pipe.encode_prompt([prompt] * batch)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def _model(name: str, device: str, dtype: torch.dtype, resolution: Optional[int],
           vae_dtype: torch.dtype = torch.float32, output_type: str = "pt", encode_once: bool = False):
    """(pipeline, resolution, call(generator, kwargs, batch) → (output, flop-speed-up fn), floor fn).
    ``resolution`` applies to Infinity models; a VAR model has one (its patch schedule). The calls
    return ``output_type``; with ``encode_once`` a text-to-image model's prompt is encoded once,
    before the timed calls."""
    if name.startswith("hart"):
        from ..pipelines.hart_pipeline import HARTPipeline

        pipe = HARTPipeline.from_random(name, device=device, dtype=dtype, vae_dtype=vae_dtype)
        prompt = PROMPT
        features = _prompt(pipe, prompt, encode_once)

        def call(gen, kw, batch):
            out = _text_call(pipe, prompt, features, batch, generator=gen, output_type=output_type, **kw)
            return out, pipe.flop_speedup

        cfg = pipe.transformer.config
        return pipe, cfg.patch_nums[-1] * pipe.vqvae.downsample_factor, call, \
            lambda batch, wbytes, gpu, stats=None: hart_floor_ms(cfg, batch, wbytes, gpu, stats)
    if name.startswith("flexvar"):
        from types import SimpleNamespace

        from ..pipelines.flexvar_pipeline import FlexVARPipeline

        pipe = FlexVARPipeline.from_random(name, device=device, dtype=dtype)
        res = resolution or 256
        pn = pipe.resolve_schedule(res, res)
        c = pipe.transformer.config
        cfg = SimpleNamespace(embed_dim=c.embed_dim, vocab_size=c.vocab_size, depth=c.depth, mlp_ratio=c.mlp_ratio,
                              patch_nums=pn)

        def call(gen, kw, batch):
            out = pipe(torch.arange(batch) % c.num_classes, patch_nums=pn, generator=gen, output_type=output_type,
                       **kw)
            return out, lambda st: pipe.flop_speedup(st, pn)

        return pipe, res, call, lambda batch, wbytes, gpu, stats=None: var_floor_ms(cfg, batch, wbytes, gpu, stats)
    if name.startswith("infinity"):
        from ..models.infinity import resolve_resolution
        from ..pipelines.infinity_pipeline import InfinityPipeline

        pipe = InfinityPipeline.from_random(name, device=device, dtype=dtype, vae_dtype=vae_dtype)
        res = resolution or 1024
        prompt = PROMPT
        features = _prompt(pipe, prompt, encode_once)

        def call(gen, kw, batch):
            out = _text_call(pipe, prompt, features, batch, height=res, width=res, generator=gen,
                             output_type=output_type, **kw)
            return out, lambda st: pipe.flop_speedup(st, height=res, width=res)

        hw = resolve_resolution(res, res).hw
        text_tokens = pipe.encode_prompt(prompt).lens[0]
        return pipe, res, call, lambda batch, wbytes, gpu, stats=None: infinity_floor_ms(
            pipe.transformer.config, hw, text_tokens, batch, wbytes, gpu, stats)
    from ..pipelines.var_pipeline import VARPipeline

    pipe = VARPipeline.from_random(name, device=device, dtype=dtype)
    cfg = pipe.transformer.config

    def call(gen, kw, batch):
        labels = torch.arange(batch) % cfg.num_classes     # a tensor: its count is checked before its entries
        out = pipe(labels, guidance_scale=4.0, top_k=900, top_p=0.95, generator=gen, output_type=output_type, **kw)
        return out, pipe.flop_speedup

    return pipe, 16 * cfg.patch_nums[-1], call, lambda batch, wbytes, gpu, stats=None: var_floor_ms(
        cfg, batch, wbytes, gpu, stats)


def run_speed(models: Sequence[str], batches: Sequence[int], runs: int = 10, warmup: int = 3,
              methods: Sequence[str] = ("dense", "dense-graphs", "dense-eager"), dtype: str = "bfloat16",
              out: Optional[Path] = None, device: str = "cuda", log=print,
              resolution: Optional[int] = None, vae_dtype: str = "float32", output_type: str = "pt",
              encode_once: bool = False, profile_out: Optional[Path] = None) -> list[dict]:
    """Time every (model, batch, method) and write one CSV row each. ``output_type``: what the calls
    return ("pt", or "pil": the pictures as the default output hands them over); ``encode_once``: a
    text-to-image model's prompt is encoded before the timed calls, whose end-to-end time then leaves
    the text encoder out (its own time is the ``text_encoder_ms`` column). ``rest_ms_median``: the
    median over the runs of end to end − loop − decode, what a call spends outside the two.
    ``profile_out``: after each setting's timed runs, one more call under ``torch.profiler``, its
    phases and the GPU's waits written to this text file (``benchmarks/_profile.py``)."""
    if output_type not in ("pt", "pil"):
        raise ValueError(f"output_type={output_type!r}: choose 'pt' or 'pil'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda': bench speed measures GPU generation and no CUDA device is available "
                         "here (pass --device cpu for a functional run without meaningful numbers)")
    methods = list(methods)
    if any(m in POLICY_METHODS for m in methods) and "dense" not in methods:
        methods.insert(0, "dense")             # speed-ups are measured against our dense path, same run
    if "dense" in methods:
        methods.remove("dense")
        methods.insert(0, "dense")
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; choose from {sorted(METHODS)}")
    torch_dtype = getattr(torch, dtype)
    gpu = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    rows, profiles = [], []
    for name in models:
        pipe, res, call_model, floor_fn = _model(name, device, torch_dtype, resolution, getattr(torch, vae_dtype),
                                                 output_type, encode_once)
        pipe.set_progress_bar_config(disable=True)
        text_model = hasattr(pipe, "encode_prompt")
        encoder_ms: dict[int, float] = {}
        dense_ms: dict[int, float] = {}
        for batch in batches:
            wbytes = torch.finfo(torch_dtype).bits // 8
            floor = floor_fn(batch, wbytes, gpu)
            for method in methods:
                setup, kw, kernels, settings = METHODS[method]
                for name_ in [p.name for p in pipe.policies]:
                    pipe.remove_policy(name_)
                try:
                    setup(pipe)
                except ValueError as e:     # a setting this model cannot take: say so, go on
                    log(f"{name} b{batch} {method}: skipped: {e}")
                    continue
                pipe.set_kernels(kernels if device == "cuda" else "torch")
                pipe.release_memory()
                if device == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                loop_ms, e2e_ms, decode_ms, per_scale, tokens, policy, ideals, floors = [], [], [], [], [], [], [], []
                try:
                    _time_runs(lambda gen, kw_: call_model(gen, kw_, batch), kw, warmup, runs, device, loop_ms,
                               e2e_ms, decode_ms, per_scale, tokens, policy, ideals, floors,
                               lambda st: floor_fn(batch, wbytes, gpu, st))
                except Exception as e:      # record the failure and go on with the other settings
                    log(f"{name} b{batch} {method}: FAILED: {type(e).__name__}: {e}")
                    continue
                peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
                rest = [e - lo - d for e, lo, d in zip(e2e_ms, loop_ms, decode_ms)]
                if text_model and batch not in encoder_ms:            # the encoder's time does not depend on the method
                    encoder_ms[batch] = round(text_encoder_ms(pipe, PROMPT, batch, runs, device), 3)
                encoder = encoder_ms.get(batch, "")
                scale_med = [statistics.median(col) for col in zip(*per_scale)]
                tok_mean = [statistics.fmean(col) for col in zip(*tokens)]
                pol_med = [statistics.median(col) for col in zip(*policy)]
                ideal = statistics.fmean(ideals)
                roof_ideal = floor / statistics.fmean(floors)     # nan off the known GPUs
                base = dense_ms.get(batch)
                speedup = base / statistics.median(loop_ms) if base else float("nan")
                if method == "dense":
                    dense_ms[batch] = statistics.median(loop_ms)
                    speedup = 1.0
                if name.startswith("infinity") and vae_dtype != "float32":
                    settings = f"{settings}; VAE {vae_dtype} (channels-last, fused norms)"
                elif name.startswith("hart") and vae_dtype != "float32":
                    settings = f"{settings}; VAE {vae_dtype}"
                row = dict(model=name, resolution=res, batch=batch, method=method, settings=settings,
                           dtype=dtype, ms_median=round(statistics.median(loop_ms), 3),
                           ms_min=round(min(loop_ms), 3), floor_ms=round(floor, 3),
                           e2e_ms_median=round(statistics.median(e2e_ms), 3),
                           decode_ms_median=round(statistics.median(decode_ms), 3),
                           rest_ms_median=round(statistics.median(rest), 3), output_type=output_type,
                           prompt=("encoded once" if encode_once else "encoded in each call") if text_model else "",
                           text_encoder_ms=encoder,
                           e2e_ms_per_image=round(statistics.median(e2e_ms) / batch, 3),
                           images_per_s=round(1e3 * batch / statistics.median(e2e_ms), 3),
                           speedup_vs_dense=round(speedup, 3), ideal_speedup=round(ideal, 3),
                           roofline_ideal_speedup=round(roof_ideal, 3),
                           kept_tokens=round(sum(tok_mean), 1),
                           per_scale_ms=";".join(f"{x:.3f}" for x in scale_med),
                           per_scale_policy_ms=";".join(f"{x:.3f}" for x in pol_med),
                           peak_mem_gb=round(peak, 3), runs=runs, gpu=gpu, torch=torch.__version__,
                           triton=triton_version)
                rows.append(row)
                if profile_out is not None:
                    gen = torch.Generator(device).manual_seed(0)
                    profiles.append(f"== {name} {res}px batch {batch} {method} ({settings}; output {output_type})\n"
                                    + profile_call(lambda: call_model(gen, kw, batch), device))
                log(f"{name:>9} {res}px b{batch:<2} {method:<18} loop {row['ms_median']:8.2f} ms "
                    f"speed-up {speedup:5.2f}x (ideal {ideal:4.2f}x FLOPs, {roof_ideal:4.2f}x roofline) "
                    f"(min {row['ms_min']:.2f}, floor {row['floor_ms']:.2f}) e2e {row['e2e_ms_median']:.1f} ms "
                    f"decode {row['decode_ms_median']:.1f} ms rest {row['rest_ms_median']:.1f} ms "
                    f"({row['e2e_ms_per_image']:.1f} ms / "
                    f"{row['images_per_s']:.1f} images per s) peak {row['peak_mem_gb']:.2f} GB")
        del pipe
        if device == "cuda":
            torch.cuda.empty_cache()
    if out is not None:
        write_csv(rows, out, log)
    if profile_out is not None and profiles:
        head = f"# bench speed profiles: {gpu}, torch {torch.__version__}, triton {triton_version or 'none'}\n"
        text = head + "\n\n".join(profiles) + "\n"
        profile_out = Path(profile_out)
        profile_out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(profile_out, lambda p: p.write_text(text))
        log(f"wrote {profile_out}")
    return rows
