"""``sparsevar generate | convert | info | bench`` — argument parsing only; the work is library calls."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

DTYPES = ("auto", "float32", "bfloat16", "float16")


class CLIError(Exception):
    """A user mistake: printed as one line, exit status 2."""


def _device(name: str):
    import torch
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {name}: no CUDA device is available on this machine; use --device cpu")
    return dev


def _dtype(name: str, device):
    import torch
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _load_pipeline(args, device, dtype, say):
    from .pipelines.var_pipeline import VARPipeline

    if args.model and (args.var_ckpt or args.vae_ckpt):
        raise CLIError("give either --model FOLDER or --var-ckpt/--vae-ckpt, not both")
    if args.model:
        pipe = VARPipeline.from_pretrained(args.model, dtype=dtype)
    elif args.var_ckpt or args.vae_ckpt:
        if not (args.var_ckpt and args.vae_ckpt):
            missing = "--vae-ckpt (vae_ch160v4096z32.pth)" if args.var_ckpt else "--var-ckpt (var_d16.pth … var_d36.pth)"
            raise CLIError(f"official checkpoints come in pairs: also pass {missing}")
        pipe = VARPipeline.from_single_file(args.var_ckpt, args.vae_ckpt, dtype=dtype)
    else:
        say("no model given: using the built-in demo model (12 procedural classes: "
            "disc, box, triangle, star, ring, cross, crescent, house, tree, flower, car, fish)")
        pipe = VARPipeline.from_demo(dtype=dtype)
    return pipe.to(device)


def _load_infinity(args, device, dtype, say):
    import torch
    from .pipelines.infinity_pipeline import InfinityPipeline

    if args.var_ckpt:
        raise CLIError("--var-ckpt is a class-conditional VAR file; text prompts need an Infinity model: pass "
                       "--model (Infinity .pth, 8B shard folder or converted folder) --vae-ckpt and --text-encoder")
    te_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model:
        pipe = InfinityPipeline.from_path(args.model, vae=args.vae_ckpt, text_encoder=args.text_encoder, dtype=dtype,
                                          text_encoder_dtype=te_dtype)
    else:
        if args.vae_ckpt or args.text_encoder:
            raise CLIError("--vae-ckpt / --text-encoder go with an Infinity transformer: add --model infinity_2b_reg.pth")
        say("no model given: using infinity-tiny, a small RANDOMLY INITIALISED Infinity model (it draws noise, "
            "not pictures). Pass --model, --vae-ckpt and --text-encoder for real images.")
        pipe = InfinityPipeline.from_random("infinity-tiny", dtype=dtype)
    return pipe.to(device)


def _save_images(images, out: Path, say) -> list[Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    if len(images) == 1:
        paths = [out]
    else:
        paths = [out.with_name(f"{out.stem}_{i}{out.suffix or '.png'}") for i in range(len(images))]
    for img, p in zip(images, paths):
        tmp = p.with_name(f".{p.name}.tmp")
        img.save(tmp, format=(p.suffix.lstrip(".") or "png").upper().replace("JPG", "JPEG"))
        os.replace(tmp, p)                          # never leave a half-written image behind
    return paths


def cmd_generate(args) -> int:
    import torch
    say = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr))
    if args.out.suffix.lower() not in (".png", ".jpg", ".jpeg", ".webp"):
        raise CLIError(f"--out {args.out}: use a .png, .jpg or .webp file name")
    text = args.prompt is not None
    if text and args.class_labels is not None:
        raise CLIError("--class is for class-conditional VAR models and --prompt for text-to-image (Infinity): "
                       "give one of them")
    if not text and (args.negative_prompt or args.text_encoder or args.height or args.width):
        raise CLIError("--negative-prompt / --text-encoder / --height / --width are for text-to-image: add --prompt")
    device = _device(args.device)
    dtype = _dtype(args.dtype, device)
    pipe = (_load_infinity if text else _load_pipeline)(args, device, dtype, say)
    pipe.set_progress_bar_config(disable=args.quiet, desc="scales")
    _apply_acceleration(pipe, args)
    gen = torch.Generator(device).manual_seed(args.seed)
    t0 = time.perf_counter()
    if text:
        out = pipe(args.prompt, negative_prompt=args.negative_prompt, height=args.height or 1024,
                   width=args.width or 1024, guidance_scale=3.0 if args.cfg is None else args.cfg,
                   temperature=args.temperature, top_k=args.top_k, top_p=0.97 if args.top_p is None else args.top_p,
                   num_images_per_prompt=args.num, generator=gen)
    else:
        labels = [int(c) if c.strip().lstrip("-").isdigit() else c for c in (args.class_labels or ["0"])]
        out = pipe(labels, guidance_scale=4.0 if args.cfg is None else args.cfg, top_k=args.top_k,
                   top_p=0.95 if args.top_p is None else args.top_p, num_images_per_prompt=args.num, generator=gen)
    dt = time.perf_counter() - t0
    paths = _save_images(out.images, args.out, say)
    st = out.stats[0]
    print(f"{len(paths)} image(s) → {', '.join(str(p) for p in paths)} | {dt * 1e3:.0f} ms | {st.summary()}")
    if args.save_token_maps:
        from .viz import save_token_maps
        maps = save_token_maps(st, out.images, args.save_token_maps, prefix=args.out.stem + "_tokens")
        print(f"token maps → {', '.join(str(p) for p in maps)}")
    if args.stats:
        print(st.table())
    return 0


def _apply_acceleration(pipe, args) -> None:
    """--sparsevar / --fastvar / --skip-last / --cond-only-from → the pipeline's enable_* calls."""
    sv = {k: v for k, v in (("tau", args.tau), ("keep_ratio", args.keep_ratio), ("start_scale", args.start_scale),
                            ("block", args.block), ("alpha", args.alpha), ("beta", args.beta)) if v is not None}
    if sv and not args.sparsevar:
        raise CLIError(f"{', '.join('--' + k.replace('_', '-') for k in sv)} set SparseVAR options: add --sparsevar")
    if args.save_token_maps and not args.sparsevar:
        raise CLIError("--save-token-maps shows SparseVAR's token maps: add --sparsevar")
    if args.sparsevar:
        pipe.enable_sparsevar(**sv)
    if args.fastvar is not None:
        pipe.enable_fastvar(**({"ratios": tuple(args.fastvar)} if args.fastvar else {}))
    if args.skip_last or args.cond_only_from is not None:
        pipe.enable_scale_skip(skip_last=args.skip_last or 0, cond_only_from=args.cond_only_from)
    if args.compile:
        pipe.enable_compiled_elementwise()


def cmd_convert(args) -> int:
    """Official files → a safetensors pipeline folder, written to ``.<out>.partial`` and renamed at the
    end, so a failure (or Ctrl-C) leaves nothing behind. The family is read off the checkpoint's keys."""
    import shutil

    import torch
    from .models.loading import checkpoint_family

    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.float32
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out} is a file; give a folder name")
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise CLIError(f"--out {out} exists and is not empty; choose a new folder or pass --overwrite")
    family = checkpoint_family(args.ckpt)
    if family == "var":
        from .pipelines.var_pipeline import VARPipeline
        if args.text_encoder:
            raise CLIError(f"--text-encoder is for Infinity; {args.ckpt} is a class-conditional VAR transformer")
        pipe = VARPipeline.from_single_file(args.ckpt, args.vae_ckpt, dtype=dtype)
        cfg = pipe.transformer.config
        what = f"VAR depth {cfg.depth}, {16 * cfg.patch_nums[-1]} px, {args.dtype}"
        usage = f"VARPipeline.from_pretrained({str(out)!r}) or `sparsevar generate --model {out} --class 0`"
    elif family == "infinity":
        from .pipelines.infinity_pipeline import InfinityPipeline
        if not args.text_encoder:
            raise CLIError(f"{args.ckpt} is an Infinity transformer: also pass --text-encoder FOLDER, a local copy of "
                           f"google/flan-t5-xl (T5 weights + tokenizer); it is saved into the pipeline folder")
        pipe = InfinityPipeline.from_single_file(args.ckpt, args.vae_ckpt, text_encoder=args.text_encoder,
                                                 dtype=dtype)
        cfg = pipe.transformer.config
        what = f"Infinity {cfg.depth} layers × {cfg.embed_dim}, {args.dtype}, with its T5 text encoder"
        usage = (f"InfinityPipeline.from_pretrained({str(out)!r}) or "
                 f"`sparsevar generate --model {out} --prompt \"...\"`")
    else:
        hint = {"var-vqvae": "the VAR VQVAE: pass it as --vae-ckpt, and var_d*.pth as --ckpt",
                "infinity-vae": "the Infinity VAE: pass it as --vae-ckpt, and infinity_2b_reg.pth as --ckpt"}.get(
            family, "neither a VAR nor an Infinity transformer checkpoint (var_d*.pth, infinity_2b_reg.pth or the "
                    "8B shard folder)")
        raise CLIError(f"--ckpt {args.ckpt} is {hint}")
    tmp = out.with_name(f".{out.name}.partial")
    old = out.with_name(f".{out.name}.old")
    for leftover in (tmp, old):
        if leftover.exists():
            shutil.rmtree(leftover)
    try:
        pipe.save_pretrained(tmp)
        if out.exists():
            os.replace(out, old)                    # (--overwrite) the new folder replaces the old one whole
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
    print(f"converted → {out} ({what}); load it with {usage}")
    return 0


def cmd_info(args) -> int:
    if args.backends:
        from .sparse_ops.attention import describe_backends
        print(describe_backends())
        if not args.path:
            return 0
    if not args.path:
        raise CLIError("info needs a checkpoint file or model folder (or --backends)")
    from .models.loading import describe_checkpoint, describe_infinity_checkpoint
    info = describe_checkpoint(args.path)
    if info.get("family") == "unknown":
        try:
            info = describe_infinity_checkpoint(args.path)
        except ValueError:
            pass
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for k, v in info.items():
        if isinstance(v, dict):
            print(f"{k}:")
            for kk, vv in v.items():
                print(f"  {kk}: {vv}")
        else:
            print(f"{k}: {v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{k}: {v}")
    return 0


def cmd_bench_quality(args) -> int:
    from .benchmarks.bench_quality import describe_settings, run_from_args
    if args.list_settings:
        print(describe_settings())
        return 0
    run_from_args(args)
    return 0


def cmd_bench_ops(args) -> int:
    import torch
    from .benchmarks.bench_ops import run_ops
    if not torch.cuda.is_available():
        raise CLIError("bench ops times the GPU kernels: no CUDA device is available on this machine "
                       "(the kernels' correctness tests run on CPU: python -m pytest tests/test_sparse_ops.py)")
    out = args.out
    if out is None:
        out = Path("benchmarks/results") / f"ops_{torch.cuda.get_device_name().replace(' ', '_')}.csv"
    run_ops(out=out, runs=args.runs, ops=args.ops)
    return 0


def cmd_bench_gemm_rows(args) -> int:
    from .benchmarks.bench_gemm_rows import run_from_args
    try:
        run_from_args(args, "sparsevar bench gemm-rows")
    except (ValueError, RuntimeError) as e:
        raise CLIError(str(e)) from None
    return 0


def cmd_bench(args) -> int:
    if args.what == "speed":
        from .benchmarks.bench_speed import run_speed
        out = args.out
        if out is None:
            import torch
            gpu = torch.cuda.get_device_name().replace(" ", "_") if torch.cuda.is_available() else "cpu"
            out = Path("benchmarks/results") / f"speed_{gpu}.csv"
        methods = args.methods
        if methods == ["all"]:
            from .benchmarks.bench_speed import METHODS
            methods = list(METHODS)
        run_speed(args.models, args.batch, runs=args.runs, warmup=args.warmup, methods=methods,
                  dtype=args.dtype, out=out, device=args.device, resolution=args.resolution,
                  vae_dtype=args.vae_dtype)
        return 0
    raise CLIError(f"unknown benchmark {args.what!r}")


def cmd_train_demo(args) -> int:
    from dataclasses import replace

    from .demo import DEMO_MODEL_DIR
    from .demo.train import DemoTrainConfig, train_demo

    cfg = DemoTrainConfig(seed=args.seed)
    if args.quick:
        cfg = cfg.quick()
    steps = {k: v for k, v in (("vq_steps", args.vq_steps), ("var_steps", args.var_steps),
                               ("cls_steps", args.cls_steps), ("var_data", args.var_data),
                               ("cls_data", args.cls_data)) if v is not None}
    cfg = replace(cfg, **steps)
    out = Path(args.out) if args.out else DEMO_MODEL_DIR
    device = _device(args.device)
    say = (lambda m: None) if args.quiet else (lambda m: print(m, flush=True))
    t0 = time.perf_counter()
    train_demo(out, cfg, stages=args.stages, device=device, log=say)
    print(f"demo model ({', '.join(args.stages)}) → {out} in {time.perf_counter() - t0:.0f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsevar", description="Fast next-scale-prediction image generation.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate images (class-conditional VAR, or text-to-image Infinity)")
    g.add_argument("--model", help="a folder written by `sparsevar convert` / save_pretrained; with --prompt also an "
                                    "Infinity .pth file or 8B shard folder (default: the built-in demo model)")
    g.add_argument("--var-ckpt", help="official transformer file, e.g. var_d16.pth")
    g.add_argument("--vae-ckpt", help="official VAE file: vae_ch160v4096z32.pth (VAR) or infinity_vae_d32reg.pth")
    g.add_argument("--class", dest="class_labels", nargs="+",
                   help="class ids or names (the model's labels: ImageNet names, or the demo's 'tree', 'car', …; "
                        "default 0)")
    g.add_argument("--prompt", nargs="+", help="text prompt(s): text-to-image with an Infinity model")
    g.add_argument("--negative-prompt", help="Infinity: what to steer away from")
    g.add_argument("--text-encoder", help="Infinity: a local Flan-T5 folder (T5EncoderModel + tokenizer)")
    g.add_argument("--height", type=int, help="Infinity: image height (default 1024; see the valid sizes)")
    g.add_argument("--width", type=int, help="Infinity: image width (default 1024)")
    g.add_argument("--temperature", type=float, help="Infinity: sampling temperature (default 0.5, 1.0 for 8B)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cfg", type=float, help="guidance scale (VAR default 4, ramped over scales; Infinity 3)")
    g.add_argument("--top-k", type=int, default=900)
    g.add_argument("--top-p", type=float, help="nucleus sampling (VAR default 0.95, Infinity 0.97)")
    g.add_argument("--num", type=int, default=1, help="images per class")
    g.add_argument("--out", type=Path, default=Path("out.png"), help="image path; several images get _0, _1, …")
    g.add_argument("--device", default="auto")
    g.add_argument("--dtype", default="auto", choices=DTYPES)
    g.add_argument("--quiet", action="store_true")
    g.add_argument("--stats", action="store_true", help="print the per-scale table")
    a = g.add_argument_group("acceleration")
    a.add_argument("--sparsevar", action="store_true", help="SparseVAR token exclusion (family preset)")
    a.add_argument("--tau", type=float, help="SparseVAR change threshold in [0, 1)")
    a.add_argument("--keep-ratio", type=float, help="SparseVAR: fixed share of tokens computed per scale, (0, 1]")
    a.add_argument("--start-scale", type=int, help="SparseVAR: first pruned scale (negative: from the end)")
    a.add_argument("--block", type=int, help="SparseVAR: observed layer")
    a.add_argument("--alpha", type=int, help="SparseVAR: anchor stride")
    a.add_argument("--beta", type=float, help="SparseVAR: anchor-copy similarity threshold")
    a.add_argument("--save-token-maps", type=Path, metavar="DIR", help="write SparseVAR's token maps as PNGs")
    a.add_argument("--fastvar", type=float, nargs="*", metavar="RATIO",
                   help="FastVAR; optional prune ratios of the last scales, earliest first (1.0 skips)")
    a.add_argument("--skip-last", type=int, default=0, help="skip the last N scales")
    a.add_argument("--cond-only-from", type=int, help="run from this scale on without guidance (negative: from the end)")
    a.add_argument("--compile", action="store_true", help="fuse elementwise steps with torch.compile (CUDA)")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="official .pth files → safetensors pipeline folder (VAR, or Infinity with "
                                        "its T5 text encoder)")
    c.add_argument("--ckpt", "--var-ckpt", dest="ckpt", required=True,
                   help="the transformer: var_d*.pth, infinity_2b_reg.pth or the Infinity 8B shard folder "
                        "(the family is read off its keys)")
    c.add_argument("--vae-ckpt", required=True,
                   help="its VAE: vae_ch160v4096z32.pth (VAR) or infinity_vae_d32reg.pth (Infinity)")
    c.add_argument("--text-encoder", help="Infinity: a local google/flan-t5-xl folder (T5EncoderModel + tokenizer), "
                                          "saved into the pipeline folder")
    c.add_argument("--out", required=True)
    c.add_argument("--dtype", default="auto", choices=DTYPES, help="transformer weight dtype (auto = float32)")
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("info", help="what a checkpoint file or model folder is")
    i.add_argument("path", nargs="?")
    i.add_argument("--json", action="store_true")
    i.add_argument("--backends", action="store_true", help="attention / kernel backends available here")
    i.set_defaults(func=cmd_info)

    t = sub.add_parser("train-demo", help="train the embedded demo model on procedural scenes (≈15 min on an H100)")
    t.add_argument("--out", help="model folder to write (default: the package's demo/weights)")
    t.add_argument("--stages", nargs="+", default=["vqvae", "var", "classifier"],
                   choices=["vqvae", "var", "classifier"], help="stages to run; later ones read earlier ones from --out")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="auto")
    t.add_argument("--quick", action="store_true", help="a few steps of each stage (smoke test; no real pictures)")
    t.add_argument("--vq-steps", type=int)
    t.add_argument("--var-steps", type=int)
    t.add_argument("--cls-steps", type=int)
    t.add_argument("--var-data", type=int, help="tokenised scenes the transformer trains on")
    t.add_argument("--cls-data", type=int, help="scenes the classifier trains on")
    t.add_argument("--quiet", action="store_true")
    t.set_defaults(func=cmd_train_demo)

    b = sub.add_parser("bench", help="benchmarks: `bench speed` (GPU) and `bench quality`")
    bsub = b.add_subparsers(dest="what", required=True)
    q = bsub.add_parser("quality", help="PSNR / SSIM against dense, speed-up and kept ratio per setting; CSV, "
                                         "plot and image grids (default model: the demo)")
    from .benchmarks.bench_quality import add_arguments as add_quality_arguments
    add_quality_arguments(q)
    q.set_defaults(func=cmd_bench_quality)
    o = bsub.add_parser("ops", help="each sparse op (Triton and its torch twin) in GB/s or TFLOP/s against the roof (GPU)")
    o.add_argument("--ops", nargs="+", help="ops to run (default: all)")
    o.add_argument("--runs", type=int, default=50)
    o.add_argument("--out", type=Path, default=None, help="CSV path (default benchmarks/results/ops_<GPU>.csv)")
    o.set_defaults(func=cmd_bench_ops)
    g = bsub.add_parser("gemm-rows", help="sweep cuBLAS over row counts for the layer products and write this GPU's "
                                          "row padding table (GPU; a few minutes)")
    from .benchmarks.bench_gemm_rows import add_arguments as add_gemm_rows_arguments
    add_gemm_rows_arguments(g)
    g.set_defaults(func=cmd_bench_gemm_rows)
    b = bsub.add_parser("speed", help="per-scale speed of dense and accelerated generation at real model sizes")
    b.add_argument("--models", nargs="+", default=["var-d16", "var-d30"],
                   help="VAR_PRESETS (var-tiny, var-d16 … var-d36) or INFINITY_PRESETS (infinity-tiny, infinity-2b, "
                        "infinity-8b); random weights at real size")
    b.add_argument("--resolution", type=int, help="Infinity models: square image side (default 1024; VAR models keep their own)")
    b.add_argument("--batch", type=int, nargs="+", default=[1])
    b.add_argument("--runs", type=int, default=10)
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument("--methods", nargs="+", default=["dense", "dense-graphs", "dense-eager"],
                   help="dense, dense-compile, dense-graphs, dense-eager, " + ", ".join(
                       ["sparsevar-keep1.0", "sparsevar-keep0.5", "sparsevar-keep0.3", "sparsevar-preset",
                        "fastvar-preset", "skip-last-1", "skip-last-2"]) + ", or 'all'")
    b.add_argument("--dtype", default="bfloat16", choices=DTYPES[1:])
    b.add_argument("--vae-dtype", default="float32", choices=DTYPES[1:],
                   help="Infinity models: the VAE's dtype (bfloat16: channels-last decode with fused norms)")
    b.add_argument("--device", default="cuda")
    b.add_argument("--out", type=Path, default=None)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CLIError, ValueError, FileNotFoundError) as e:
        if os.environ.get("SPARSEVAR_DEBUG"):
            raise
        print(f"sparsevar {args.command}: error: {e}", file=sys.stderr)
        return 2
