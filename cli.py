"""``sparsevar generate | convert | info | bench | train-demo`` — argument parsing and checks of the
arguments (each before any model is loaded or any file written); the work is library calls."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from .pipelines.defaults import HART_DEFAULTS, INFINITY_DEFAULTS, VAR_DEFAULTS

DTYPES = ("auto", "float32", "bfloat16", "float16")
SEED_MAX = 2 ** 64 - 1                          # torch.Generator.manual_seed takes 64-bit seeds
IMAGE_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}
DEMO_TRAIN_DIR = Path("sparsevar-demo")         # `sparsevar train-demo` writes here unless --out says otherwise


class CLIError(Exception):
    """A user mistake: printed as one line, exit status 2."""


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt, so that every
    ``except BaseException`` / ``finally`` clean-up runs before the process exits."""


# ---- checks of arguments, before any work ----------------------------------------------------------
def _device(name: str, flag: str = "--device"):
    import torch
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise CLIError(f"{flag} {name}: not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise CLIError(f"{flag} {name}: no CUDA device is available on this machine; use {flag} cpu")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise CLIError(f"{flag} {name}: this machine has {n} CUDA device(s): use cuda:0 … cuda:{n - 1}")
        return dev
    if dev.type == "mps" and torch.backends.mps.is_available():
        return dev
    raise CLIError(f"{flag} {name}: sparsevar runs on cpu or cuda (cuda:N); {dev.type!r} is not available here")


def _dtype(name: str, device):
    import torch
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _at_least(value, low, flag: str, what: str) -> None:
    if value is not None and value < low:
        raise CLIError(f"{flag} {value}: {what}")


def _number_in(value, flag: str, ok, what: str) -> None:
    if value is not None and (not math.isfinite(value) or not ok(value)):
        raise CLIError(f"{flag} {value}: {what}")


def _check_cfg(value, neutral: float) -> None:
    from .engine.limits import GUIDANCE_SCALE_MAX
    _number_in(value, "--cfg", lambda v: 0.0 <= v <= GUIDANCE_SCALE_MAX,
               f"give a guidance scale in [0, {GUIDANCE_SCALE_MAX:g}] ({neutral:g} disables guidance)")


def _no_empty_paths(args, *flags: tuple[str, str]) -> None:
    """An empty path (``--model ""``, often an unset shell variable) is refused rather than read as
    "not given", which would quietly run the default model or write into the current folder."""
    for flag, key in flags:
        value = getattr(args, key, None)
        if value is not None and not str(value).strip():
            raise CLIError(f"{flag} is empty (an unset shell variable?): give a path, or leave {flag} out")


def _can_write_under(folder: Path) -> bool:
    """Whether a file can be created in the existing ``folder``: the permission bits, then a real
    file created and removed (root passes every permission check, a read-only mount fails the probe)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".sparsevar-write-test-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def _check_writable(path: Path, flag: str, folder: bool = False) -> None:
    """That ``path`` (a file, or with ``folder`` a folder) can be created or replaced: nothing in the
    way, its nearest existing folder writable, no name too long (with the temporary names written
    first). Creates nothing."""
    path = Path(path)
    try:
        _check_writable_path(path, flag, folder)
    except OSError as e:                               # e.g. a name too long to even look up
        raise CLIError(f"{flag} {path}: {e.strerror or e}; choose another path") from None


def _check_writable_path(path: Path, flag: str, folder: bool) -> None:
    if path.is_dir() and not folder:
        raise CLIError(f"{flag} {path}: that is a folder; give a file name (e.g. {path / 'out.png'})")
    if path.exists() and not path.is_dir() and folder:
        raise CLIError(f"{flag} {path}: that is a file; give a folder name")
    base = path.absolute() if folder and path.is_dir() else path.absolute().parent
    while not base.exists():
        if base.is_symlink():
            raise CLIError(f"{flag} {path}: {base} is a broken symbolic link; choose another path")
        base = base.parent
    if not base.is_dir():
        raise CLIError(f"{flag} {path}: {base} is a file, so nothing can be written under it; choose another path")
    if not _can_write_under(base):
        raise CLIError(f"{flag} {path}: cannot write in {base} (no permission, or a read-only file system); "
                       f"choose a folder you can write to")
    try:
        name_max = os.pathconf(base, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):      # no such limit here
        return
    temporary = f".{path.name}.partial" if folder else f".{path.name}.tmp"      # what is written first
    longest = max((p for p in (*path.absolute().relative_to(base).parts, temporary)),
                  key=lambda n: len(os.fsencode(n)))
    if len(os.fsencode(longest)) > name_max:
        raise CLIError(f"{flag} {path}: a name in it is too long for this file system ({len(os.fsencode(longest))} "
                       f"bytes, at most {name_max}, temporary name included); choose a shorter one")


def _check_beside(out: Path) -> None:
    """For a folder written as ``.<name>.partial`` beside ``out`` and renamed: that ``out`` has a
    name, and that its parent, when ``out`` already exists, can take the new folder."""
    if out.name in ("", ".", ".."):
        raise CLIError(f"--out {out}: give the new folder a name (e.g. {out / 'model'}); "
                       f"'.', '..' and '/' cannot be replaced")
    parent = out.absolute().parent
    if out.is_dir() and not _can_write_under(parent):
        raise CLIError(f"--out {out}: cannot write in {parent}, where the new folder is made before it replaces "
                       f"{out.name}; choose a folder you can write to")


def _image_paths(out: Path, count: int) -> list[Path]:
    """Where ``count`` images go: ``out`` itself for one, ``out_0``, ``out_1``, … for several."""
    if count == 1:
        return [out]
    return [out.with_name(f"{out.stem}_{i}{out.suffix}") for i in range(count)]


def _check_image_out(out: Path, count: int) -> str:
    """The PIL format of ``--out``, after checking that every image path can be written: the
    folder once, and among what it holds, no folder in the way of one of the ``count`` names."""
    import PIL.Image
    if str(out).endswith(("/", os.sep)):
        raise CLIError(f"--out {out}: that names a folder; give a file name (e.g. {out}out.png)")
    out = Path(out)
    fmt = IMAGE_FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise CLIError(f"--out {out}: use a .png, .jpg or .webp file name")
    PIL.Image.init()
    if fmt not in PIL.Image.SAVE:
        raise CLIError(f"--out {out}: this Pillow cannot write {fmt} files; use a .png or .jpg file name")
    if count == 1:
        _check_writable(out, "--out")
    elif out.parent.is_dir():
        pattern = re.compile(rf"{re.escape(out.stem)}_(\d+){re.escape(out.suffix)}")
        for entry in os.scandir(out.parent):
            m = pattern.fullmatch(entry.name)
            if m and int(m.group(1)) < count and entry.is_dir():
                raise CLIError(f"--out {out}: {count} images go to {out.stem}_0{out.suffix} … "
                               f"{out.stem}_{count - 1}{out.suffix}, and {out.parent / entry.name} is a folder; "
                               f"choose another name")
    if count > 1:
        _check_writable(out.with_name(f"{out.stem}_{count - 1}{out.suffix}"), "--out")     # the longest name
    return fmt


# ---- generate -------------------------------------------------------------------------------------
SPARSEVAR_FLAGS = (("tau", "--tau"), ("keep_ratio", "--keep-ratio"), ("start_scale", "--start-scale"),
                   ("block", "--block"), ("alpha", "--alpha"), ("beta", "--beta"))


def _check_generate_args(args, text: bool) -> None:
    """Every check that needs no model: which flags go together, the range of each number, the
    output paths. Raises CLIError naming the flag."""
    _kernels_flag(args)                                  # --compile beside another --kernels
    if text and args.class_labels is not None:
        raise CLIError("--class is for class-conditional VAR models and --prompt for text-to-image (Infinity): "
                       "give one of them")
    flexvar = not text and _is_flexvar(args)
    if not text:
        extra = [f for f, v in (("--negative-prompt", args.negative_prompt), ("--text-encoder", args.text_encoder),
                                ("--temperature", args.temperature)) if v is not None]
        if not flexvar:
            extra += [f for f, v in (("--height", args.height), ("--width", args.width)) if v is not None]
        if extra:
            raise CLIError(f"{' / '.join(extra)} {'is' if len(extra) == 1 else 'are'} for text-to-image: add --prompt"
                           + ("" if flexvar else " (FlexVAR models take --height / --width)"))
    if args.steps is not None and not flexvar:
        raise CLIError(f"--steps {args.steps}: only FlexVAR takes a number of scales (--var-ckpt FlexVARd*.pth "
                       f"--vae-ckpt FlexVAE.pth, or a converted FlexVAR folder); drop --steps")
    if flexvar:
        from .pipelines.flexvar_pipeline import FlexVARPipeline
        try:
            FlexVARPipeline.resolve_schedule(args.height, args.width, args.steps)
        except ValueError as e:
            flags = {"height": "--height ", "width": "--width ", "num_scales": "--steps "}
            raise CLIError(re.sub(r"\b(height|width|num_scales)=", lambda m: flags[m[1]], str(e))) from None
    _no_empty_paths(args, ("--model", "model"), ("--var-ckpt", "var_ckpt"), ("--vae-ckpt", "vae_ckpt"),
                    ("--text-encoder", "text_encoder"), ("--save-token-maps", "save_token_maps"))
    if not 0 <= args.seed <= SEED_MAX:
        raise CLIError(f"--seed {args.seed}: seeds are 0 … {SEED_MAX} (64 bits)")
    num_flag = "--num-per-prompt" if any(a.startswith("--num-per") for a in getattr(args, "argv", ())) else "--num"
    _at_least(args.num, 1, num_flag, f"give the number of images per {'prompt' if text else 'class'}, 1 or more")
    _at_least(args.top_k, 0, "--top-k", "give 0 (no limit) or more codes per token (1 = greedy)")
    _number_in(args.top_p, "--top-p", lambda v: 0.0 <= v <= 1.0, "give a probability in [0, 1] (0 disables "
                                                                    "nucleus sampling)")
    hart = text and bool(args.model) and _is_hart(args.model)
    _check_cfg(args.cfg, (HART_DEFAULTS if hart else INFINITY_DEFAULTS if text else VAR_DEFAULTS).guidance_off)
    _number_in(args.temperature, "--temperature", lambda v: v > 0.0, "give a temperature > 0 (official: 0.5 for "
                                                                       "Infinity-2B, 1.0 for 8B)")
    if text and not hart:
        _check_size(args)
    _at_least(args.skip_last, 0, "--skip-last", "give the number of final scales to skip, 0 or more")
    given = [flag for key, flag in SPARSEVAR_FLAGS if getattr(args, key) is not None]
    if given and not args.sparsevar:
        raise CLIError(f"{', '.join(given)} set SparseVAR options: add --sparsevar")
    if args.save_token_maps and not args.sparsevar:
        raise CLIError("--save-token-maps shows SparseVAR's token maps: add --sparsevar")
    if args.fastvar_layers is not None and args.fastvar is None:
        raise CLIError("--fastvar-layers sets FastVAR's pruning layers: add --fastvar")
    if args.sparsevar and args.fastvar is not None:
        raise CLIError("--sparsevar and --fastvar cannot be combined (both choose the tokens each scale computes): "
                       "give one of them")
    if args.sparvar is not None and (args.sparsevar or args.fastvar is not None):
        other = "--sparsevar" if args.sparsevar else "--fastvar"
        raise CLIError(f"--sparvar and {other} cannot be combined (SparVAR selects keys among every token of the "
                       f"cache; {other} computes a subset of the tokens): give one of them")
    if args.scalekv is not None and (args.sparsevar or args.fastvar is not None or args.sparvar is not None):
        other = "--sparsevar" if args.sparsevar else "--fastvar" if args.fastvar is not None else "--sparvar"
        raise CLIError(f"--scalekv and {other} cannot be combined (ScaleKV compacts each layer's cache per head "
                       f"after a scale; {other} needs the whole cache or runs token subsets): give one of them")
    count = (len(args.prompt) if text else len(args.class_labels or ["0"])) * args.num
    _at_least(args.batch_size, 1, "--batch-size", "give the number of images per pipeline call, 1 or more")
    _at_least(args.num_processes, 1, "--num-processes", "give the number of processes, 1 or more")
    if args.num_processes is not None and not _folder_out(args.out):
        raise CLIError(f"--num-processes {args.num_processes}: only for a folder --out (a name ending in /), which "
                       f"the processes share")
    if _folder_out(args.out):
        if args.save_token_maps:
            raise CLIError("--save-token-maps writes one generation's maps; with a folder --out, generate the images "
                           "you want maps of with a file --out")
        _check_writable(Path(args.out), "--out", folder=True)
        return
    if args.batch_size is not None:
        raise CLIError(f"--batch-size {args.batch_size}: only for a folder --out (a name ending in /); one file "
                       f"--out generates its images in one call")
    _check_image_out(args.out, count)
    if args.save_token_maps:
        _check_writable(args.save_token_maps, "--save-token-maps", folder=True)
        maps = Path(args.save_token_maps).absolute()
        clash = [p for p in _image_paths(Path(args.out), count) if p.absolute() == maps]
        if clash:
            raise CLIError(f"--save-token-maps {args.save_token_maps}: that is where --out writes an image; give the "
                           f"token maps a folder of their own (e.g. {Path(args.out).with_suffix('')}_maps)")


def _check_size(args) -> None:
    from .models.infinity import infinity_resolution, PN_SCALES
    square = ", ".join(f"{r.height}x{r.width}" for r in (infinity_resolution(1.0, pn) for pn in PN_SCALES))
    for flag, v in (("--height", args.height), ("--width", args.width)):
        if v is not None and v <= 0:
            raise CLIError(f"{flag} {v}: give a positive number of pixels, an Infinity size (height x width): "
                           f"{square} for 1:1, or any other size to be shown the valid ones of its aspect ratio")
    from .models.infinity import resolve_resolution
    h, w = args.height or 1024, args.width or 1024
    try:
        resolve_resolution(h, w)
    except ValueError as e:
        raise CLIError(f"--height {h} --width {w}: {e}") from None


def _policy_configs(args, family: str) -> list:
    """(flags, enable method name, config) of the acceleration asked for, each config built (and its
    ranges checked) before the model is loaded; the model-dependent checks come when it is enabled.
    SparseVAR's entry is the dict of fields the flags set, applied over the loaded model's
    ``sparsevar_preset`` (the family preset with the checkpoint's calibration)."""
    from dataclasses import replace
    out = []
    if args.sparsevar:
        from .policies.sparsevar import SPARSEVAR_PRESETS, SparseVARConfig
        sv = {key: getattr(args, key) for key, _ in SPARSEVAR_FLAGS if getattr(args, key) is not None}
        flags = " ".join(["--sparsevar"] + [f"{flag} {getattr(args, key)}" for key, flag in SPARSEVAR_FLAGS
                                            if key in sv])
        try:
            replace(SPARSEVAR_PRESETS.get(family, SparseVARConfig()), **sv)      # the ranges, before loading
            out.append((flags, "enable_sparsevar", sv))     # over the model's preset (its calibrated layer)
        except ValueError as e:
            raise CLIError(f"{flags}: {e}") from None
    if args.fastvar is not None:
        from .policies.fastvar import FASTVAR_PRESETS, FastVARConfig
        flags = " ".join(["--fastvar"] + [f"{r:g}" for r in args.fastvar])
        fields = {"ratios": tuple(args.fastvar)} if args.fastvar else {}
        if args.fastvar_layers is not None:
            flags += " --fastvar-layers " + " ".join(map(str, args.fastvar_layers))
            fields["layer_range"] = tuple(args.fastvar_layers)
        try:
            out.append((flags, "enable_fastvar", replace(FASTVAR_PRESETS.get(family, FastVARConfig()), **fields)))
        except ValueError as e:
            raise CLIError(f"{flags}: {e}") from None
    if args.sparvar is not None:
        from .policies.sparvar import SPARVAR_PRESETS, SparVARConfig
        preset = args.sparvar is True                   # the flag alone: the family preset
        fields = {} if preset else {"top_keys": args.sparvar}
        flags = "--sparvar" + ("" if preset else f" {args.sparvar:g}")
        try:
            out.append((flags, "enable_sparvar", replace(SPARVAR_PRESETS.get(family, SparVARConfig()), **fields)))
        except ValueError as e:
            raise CLIError(f"{flags}: {e}") from None
    if args.scalekv is not None:
        from .policies.scalekv import ScaleKVConfig
        preset = args.scalekv is True                   # the flag alone: the model's preset (scalekv_preset)
        flags = "--scalekv" + ("" if preset else f" {args.scalekv:g}")
        try:
            if not preset:
                ScaleKVConfig(budget=args.scalekv)                            # the range, before loading
            out.append((flags, "enable_scalekv", {} if preset else {"budget": args.scalekv}))   # over the preset
        except ValueError as e:
            raise CLIError(f"{flags}: {e}") from None
    if args.skip_last or args.cond_only_from is not None:
        from .policies.scale_skip import ScaleSkipConfig
        flags = " ".join(f"{flag} {v}" for flag, v in (("--skip-last", args.skip_last),
                                                       ("--cond-only-from", args.cond_only_from)) if v)
        try:
            out.append((flags, "enable_scale_skip", ScaleSkipConfig(skip_last=args.skip_last,
                                                                    cond_only_from=args.cond_only_from)))
        except ValueError as e:
            raise CLIError(f"{flags}: {e}") from None
    return out


def _apply_acceleration(pipe, args, configs, compile: bool = True) -> None:
    """The configs of :func:`_policy_configs` → the pipeline's enable_* calls; what this model cannot
    take is reported under the flags that asked for it; ``compile``: the kernels of --kernels now (else the
    caller applies them once the pipeline is on its GPU)."""
    for flags, method, cfg in configs:
        try:
            getattr(pipe, method)(**cfg) if isinstance(cfg, dict) else getattr(pipe, method)(cfg)
        except ValueError as e:
            hint = " (--fastvar-layers FIRST LAST)" if "layer_range" in str(e) and method == "enable_fastvar" else ""
            raise CLIError(f"{flags}: {e}{hint}") from None
    if compile:
        _set_kernels(pipe, args)


def _kernels_flag(args) -> tuple[str, str]:
    """(the kernels the flags ask for, the flag that asked): --compile is --kernels triton."""
    if args.compile and args.kernels not in ("auto", "triton"):
        raise CLIError(f"--compile --kernels {args.kernels}: --compile means --kernels triton; give one of them")
    return ("triton", "--compile") if args.compile else (args.kernels, f"--kernels {args.kernels}")


def _set_kernels(pipe, args) -> None:
    kind, flag = _kernels_flag(args)
    try:
        pipe.set_kernels(kind)
    except ValueError as e:
        raise CLIError(f"{flag}: {e}") from None


def _low_vram_gpu(args, device) -> bool:
    """--low-vram on a GPU: the weights stay in CPU memory until enable_low_vram has chosen how they go
    there (a card that cannot hold them all must not receive them all first)."""
    return bool(getattr(args, "low_vram", False)) and device.type == "cuda"


def _place(pipe, device, args):
    return pipe if _low_vram_gpu(args, device) else pipe.to(device)


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
    return _place(pipe, device, args)


def _load_infinity(args, device, dtype, say):
    import torch
    from .pipelines.infinity_pipeline import InfinityPipeline

    if args.var_ckpt:
        raise CLIError("--var-ckpt is a class-conditional VAR file; text prompts need an Infinity model: pass "
                       "--model (Infinity .pth, 8B shard folder or converted folder) --vae-ckpt and --text-encoder")
    # on a GPU the text encoder runs and the VAE decodes in bfloat16, as the reference does (and the ComfyUI loader)
    te_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model:
        pipe = InfinityPipeline.from_path(args.model, vae=args.vae_ckpt, text_encoder=args.text_encoder, dtype=dtype,
                                          vae_dtype=te_dtype, text_encoder_dtype=te_dtype)
    else:
        if args.vae_ckpt or args.text_encoder:
            raise CLIError("--vae-ckpt / --text-encoder go with an Infinity transformer: add --model infinity_2b_reg.pth")
        say("no model given: using infinity-tiny, a small RANDOMLY INITIALISED Infinity model (it draws noise, "
            "not pictures). Pass --model, --vae-ckpt and --text-encoder for real images.")
        pipe = InfinityPipeline.from_random("infinity-tiny", dtype=dtype)
    return _place(pipe, device, args)


def _is_hart(model) -> bool:
    """HART's release folder (or its llm/), or a converted HARTPipeline folder."""
    from .models.loading import hart_folders, pipeline_class_name
    index = Path(model) / "model_index.json"
    if index.is_file():
        try:
            return pipeline_class_name(json.loads(index.read_text())) == "HARTPipeline"
        except (OSError, ValueError, AttributeError):
            return False
    return hart_folders(model) is not None


def _is_flexvar(args) -> bool:
    """A converted FlexVARPipeline folder (--model) or an official FlexVAR transformer (--var-ckpt)."""
    if args.model:
        from .models.loading import pipeline_class_name
        index = Path(args.model) / "model_index.json"
        try:
            return index.is_file() and pipeline_class_name(json.loads(index.read_text())) == "FlexVARPipeline"
        except (OSError, ValueError, AttributeError):
            return False
    if args.var_ckpt and Path(args.var_ckpt).exists():
        from .models.loading import checkpoint_family
        try:
            return checkpoint_family(args.var_ckpt) == "flexvar"
        except (OSError, ValueError):
            return False
    return False


def _load_flexvar(args, device, dtype, say):
    from .pipelines.flexvar_pipeline import FlexVARPipeline

    if args.model and (args.var_ckpt or args.vae_ckpt):
        raise CLIError("give either --model FOLDER or --var-ckpt/--vae-ckpt, not both")
    if args.model:
        return _place(FlexVARPipeline.from_pretrained(args.model, dtype=dtype), device, args)
    if not args.vae_ckpt:
        raise CLIError(f"--var-ckpt {args.var_ckpt} is a FlexVAR transformer: also pass --vae-ckpt FlexVAE.pth, its "
                       f"tokenizer")
    return _place(FlexVARPipeline.from_single_file(args.var_ckpt, args.vae_ckpt, dtype=dtype), device, args)


def _check_hart_args(args) -> None:
    """HART takes no VAE file (its tokenizer folder sits beside llm/), one size and no temperature
    or negative prompt (the reference has neither)."""
    extra = [f for f, v in (("--vae-ckpt", args.vae_ckpt), ("--negative-prompt", args.negative_prompt),
                            ("--temperature", args.temperature)) if v is not None]
    if extra:
        raise CLIError(f"{' / '.join(extra)}: not for HART ({args.model} is a HART model; its tokenizer/ folder sits "
                       f"beside llm/, and it has no temperature or negative prompt): drop {' and '.join(extra)}")
    for flag, v in (("--height", args.height), ("--width", args.width)):
        if v is not None and v != 1024:
            raise CLIError(f"{flag} {v}: HART generates 1024×1024 only; drop {flag} or give 1024")
    converted = (Path(args.model) / "model_index.json").is_file()
    if not args.text_encoder and not converted:
        raise CLIError(f"{args.model} is a HART model: also pass --text-encoder FOLDER, a local copy of its Qwen2 "
                       f"text encoder (mit-han-lab/Qwen2-VL-1.5B-Instruct)")
    if args.text_encoder and converted:
        raise CLIError(f"--text-encoder: {args.model} is a converted HART folder with its text encoder inside; drop "
                       f"--text-encoder")


def _load_hart(args, device, dtype, say):
    import torch
    from .models.loading import hart_folders
    from .pipelines.hart_pipeline import HARTPipeline

    te_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if (Path(args.model) / "model_index.json").is_file():
        return _place(HARTPipeline.from_pretrained(args.model, dtype=dtype, text_encoder_dtype=te_dtype), device, args)
    llm, tokenizer = hart_folders(args.model)
    return _place(HARTPipeline.from_single_file(llm, tokenizer, args.text_encoder, dtype=dtype,
                                                text_encoder_dtype=te_dtype), device, args)


def _plain_class_ids(labels: Sequence[str]) -> Optional[list[int]]:
    """``--class`` values that are all non-negative ids, as ints (what :func:`_class_ids` makes of
    them); None where any is a name or a negative number (resolving those needs the model)."""
    plain = [lab.strip() for lab in labels]
    return [int(lab) for lab in plain] if all(lab.isdecimal() and lab.isascii() for lab in plain) else None


def _early_class_ids(args) -> Optional[list[int]]:
    """``--class`` values as ids before any model is loaded: ids as they are; names through the
    class names of a converted folder (``--model``, or the built-in demo model), read from its JSON
    files. None where only the weights tell (official .pth files) or those files do not say (the
    load then reports what is wrong). An unknown name is reported here, before any loading."""
    labels = args.class_labels or ["0"]
    plain = _plain_class_ids(labels)
    if plain is not None or args.var_ckpt or args.vae_ckpt:
        return plain
    if args.model:
        folder = Path(args.model)
    else:
        from .demo import DEMO_MODEL_DIR
        folder = DEMO_MODEL_DIR
    from .models.loading import pipeline_class_name
    from .pipelines.var_pipeline import ClassLabels, check_id2label, class_names
    try:
        index = json.loads((folder / "model_index.json").read_text())
        num_classes = int(json.loads((folder / "transformer" / "config.json").read_text())["num_classes"])
        flexvar = pipeline_class_name(index) == "FlexVARPipeline"          # FlexVAR folders carry no names
        id2label = None if flexvar or index.get("id2label") is None else check_id2label(index["id2label"], "")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return _class_ids(ClassLabels(class_names(id2label, num_classes), num_classes), labels, args)


def _class_ids(pipe, labels: Sequence[str], args) -> list[int]:
    """``--class`` values → class ids; an unknown name is reported with what the command line offers."""
    from .pipelines.var_pipeline import ClassLabelError
    model = args.model or args.var_ckpt
    ids = []
    for lab in labels:
        digits = lab.strip()
        value = int(digits) if digits.removeprefix("-").isdecimal() else lab     # '²' is a digit, not a number
        try:
            ids += pipe.get_label_ids(value)
        except ClassLabelError as e:
            n = pipe.num_classes
            if pipe.labels:
                fix = (f"`sparsevar info --labels{' ' + str(model) if model else ''}` lists all {len(pipe.labels)} "
                       f"names; or give a class id 0..{n - 1}")
            else:
                fix = f"give a class id 0..{n - 1}"
            problem = e.problem if e.problem.endswith((".", "?")) else e.problem + "."
            raise CLIError(f"--class {lab}: {problem} {fix[0].upper() + fix[1:]}") from None
        except ValueError as e:
            raise CLIError(f"--class {lab}: {e}") from None
    return ids


def _save_images(images, paths: Sequence[Path], fmt: str) -> None:
    """Write every image under a temporary name, then rename them all: a failure (or Ctrl-C,
    SIGTERM) leaves neither a temporary file nor a folder this call created."""
    made = []
    folder = paths[0].absolute().parent
    while not folder.exists():
        made.append(folder)
        folder = folder.parent
    tmps = []
    try:
        for d in reversed(made):
            d.mkdir()
        for img, p in zip(images, paths):
            tmps.append(p.with_name(f".{p.name}.tmp"))
            img.save(tmps[-1], format=fmt)
        for tmp, p in zip(tmps, paths):
            os.replace(tmp, p)
    except BaseException:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
        for d in made:                                # deepest first
            try:
                d.rmdir()
            except OSError:
                pass
        raise


def _is_out_of_memory(e: BaseException) -> bool:
    import torch
    return isinstance(e, torch.cuda.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def _folder_out(out) -> bool:
    """``--out`` names a folder: it ends in a path separator, or is an existing folder whose name is
    not an image file name (``out.png`` as a folder is more likely a mistake: refused as before)."""
    if str(out).endswith(("/", os.sep)):
        return True
    try:
        return Path(out).is_dir() and Path(out).suffix.lower() not in IMAGE_FORMATS
    except OSError:                                  # e.g. a name too long to look up: the file checks say so
        return False


def _read_prompts(path) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise CLIError(f"--prompts {path}: {e.strerror or e}; give a text file with one prompt per line") from None
    except UnicodeDecodeError:
        raise CLIError(f"--prompts {path}: not UTF-8 text; give a text file with one prompt per line") from None
    prompts = [ln.strip() for ln in lines if ln.strip()]
    if not prompts:
        raise CLIError(f"--prompts {path}: no prompt in it; give a text file with one prompt per line")
    return prompts


def _batch_size(pipe, args, device, needed_for) -> int:
    """--batch-size, or the largest of 16, 8, 4, 2, 1 whose memory estimate fits (4 on the CPU)."""
    from .pipelines._accelerated import check_memory
    if args.batch_size is not None:
        try:
            check_memory(pipe, needed_for(args.batch_size), args.batch_size, f"--batch-size {args.batch_size}",
                         "lower --batch-size")
        except ValueError as e:
            raise CLIError(str(e)) from None
        return args.batch_size
    if device.type != "cuda":
        return 4
    for b in (16, 8, 4, 2, 1):
        try:
            check_memory(pipe, needed_for(b), b, "", "")
            return b
        except ValueError:
            continue
    return 1


def _process_state(device):
    """accelerate's state of this process (one process unless started by ``accelerate launch`` or
    ``--num-processes``)."""
    from accelerate import PartialState
    return PartialState(cpu=device.type != "cuda")


def _launch_processes(args) -> int:
    """``--num-processes N`` on GPUs: the same command under ``accelerate launch`` (N fresh processes,
    one GPU each). accelerate's in-process launcher forks, and a forked child cannot use CUDA once
    the parent has asked the driver for its devices, which importing diffusers already does."""
    import subprocess
    argv, drop = [], False
    for a in args.argv:                                  # the command without --num-processes N
        if drop:
            drop = False
        elif a == "--num-processes":
            drop = True
        elif not a.startswith("--num-processes="):
            argv.append(a)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(args.num_processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--multi_gpu",
           "-m", "sparsevar", *argv]
    done = subprocess.run(cmd)
    if done.returncode:
        raise CLIError(f"--num-processes {args.num_processes}: the processes stopped with status {done.returncode} "
                       f"(their messages are above)")
    return 0


def _generate_in_process(args) -> None:
    """One of ``--num-processes`` processes (accelerate's launcher): the same command, its share."""
    args.num_processes = None
    cmd_generate(args)


IMAGE_WRITERS = 4                 # background threads writing a folder run's images on a GPU


RUN_FORMAT_2 = ("dtype", "vae_ckpt", "text_encoder")   # settings run.json records since its "format": 2


def _folder_run(args, items, writers: int = 0):
    """(the folder run of ``--out`` for these items and settings, every (copy, item) in order, what is
    left of them); another run's folder: CLIError naming the setting."""
    from .pipelines.batch import RUN_FILE, FolderRun
    key = "prompt" if args.prompt is not None else "class"
    settings = {"model": str(args.model or args.var_ckpt or "demo"), {"class": "classes"}.get(key, key + "s"): list(items),
                "seed": args.seed, "dtype": str(_dtype(args.dtype, _device(args.device))).removeprefix("torch."),
                **{k: str(getattr(args, k)) for k in ("vae_ckpt", "text_encoder") if getattr(args, k, None)},
                **{k: getattr(args, k) for k in ("cfg", "top_k", "top_p", "temperature", "height", "width", "steps",
                                                 "negative_prompt", "sparsevar", "tau", "keep_ratio", "start_scale",
                                                 "block", "alpha", "beta", "fastvar", "fastvar_layers", "sparvar",
                                                 "scalekv", "skip_last", "cond_only_from") if getattr(args, k, None) is not None}}
    out = Path(args.out)
    try:
        saved = json.loads((out / RUN_FILE).read_text()) if (out / RUN_FILE).is_file() else {}
    except (OSError, ValueError):
        saved = {}                                       # (FolderRun says what is wrong with it)
    if saved and "format" not in saved:                  # a run begun before run.json recorded these
        settings = {k: v for k, v in settings.items() if k not in RUN_FORMAT_2}
    else:
        settings["format"] = 2
    try:
        run = FolderRun(out, settings, writers=writers)
    except ValueError as e:
        raise CLIError(f"--out {out}: {e}") from None
    order = [(j, n) for j in range(args.num) for n in range(len(items))]   # copy-major: a larger --num appends
    return run, order, run.todo(order)


def _nothing_to_do(args, order) -> None:
    from .pipelines.batch import MANIFEST
    print(f"nothing to do: the {len(order)} image(s) are in {args.out} ({MANIFEST} lists them)")


def _generate_folder(args, pipe, device, items, call_for, needed_for) -> int:
    """Folder output: every (item, copy) as a numbered image, resumable (pipelines/batch.py); under
    several processes each takes every n-th batch of what is left (one batch size for all, the
    smallest any process can fit), so the files are those of one process at that batch size; the
    main one prepares the folder first."""
    import torch
    from tqdm.auto import tqdm

    from .pipelines.batch import MANIFEST, image_seed
    key = "prompt" if args.prompt is not None else "class"
    out = Path(args.out)
    # on a GPU a 1024² picture is drawn faster than one CPU core encodes its PNG: write in the background
    writers = min(IMAGE_WRITERS, os.cpu_count() or 1) if device.type == "cuda" else 0
    run, order, todo = _folder_run(args, items, writers)
    state = _process_state(device)
    if not todo:
        if state.is_main_process:
            _nothing_to_do(args, order)
        return 0
    batch = _batch_size(pipe, args, device, needed_for)
    if state.num_processes > 1:                        # one batch size for all: the smallest that fits
        from accelerate.utils import gather_object
        batch = min(gather_object([batch]))
    if state.is_main_process:
        run.start()
    state.wait_for_everyone()                          # the folder is ready before anyone writes into it
    left = len(todo)
    # whole batches in turn: every batch is the one a single process draws, so are the pictures
    batches = [todo[k:k + batch] for k in range(0, len(todo), batch)][state.process_index::state.num_processes]
    mine = sum(len(part) for part in batches)
    desc = "images" if state.num_processes == 1 else f"images (process 0's {mine} of {left})"
    bar = tqdm(total=mine, unit="image", disable=args.quiet or not state.is_main_process, desc=desc)
    t0 = time.perf_counter()
    try:
        for part in batches:
            idx = [i for i, _ in part]
            chosen = [items[n] for _, (j, n) in part]
            seeds = [image_seed(args.seed, i) for i in idx]
            gens = [torch.Generator(device).manual_seed(s) for s in seeds]
            t_call = time.perf_counter()
            res = pipe(**call_for(chosen), num_images_per_prompt=1, generator=gens)
            call_ms = (time.perf_counter() - t_call) * 1e3
            st = res.stats[0]
            stats = {"batch_size": len(part), "call_ms": round(call_ms, 3), "scale_loop_ms": round(st.transformer_ms, 3),
                     "decode_ms": round(st.decode_ms, 3), "tokens_computed": st.tokens_computed, "tokens": st.tokens}
            rows = [{key: item, "seed": s, "process_index": state.process_index,
                     "image_ms": round(call_ms / len(part), 3), "batch": stats} for item, s in zip(chosen, seeds)]
            run.save(idx, res.images, rows, "PNG")
            bar.update(len(part))
        run.flush()
    except BaseException:
        run.close()                                      # nothing half-written stays
        raise
    bar.close()
    dt = time.perf_counter() - t0
    state.wait_for_everyone()
    if state.is_main_process:
        procs = f", {state.num_processes} processes" if state.num_processes > 1 else ""
        print(f"{left} image(s) → {out} ({len(order) - left} already there) | {dt / max(mine, 1) * 1e3:.0f} ms "
              f"per image and process, batch {batch}{procs} | {out / MANIFEST}")
    return 0


def cmd_generate(args) -> int:
    say = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr))
    if args.prompts:
        args.prompt = (args.prompt or []) + _read_prompts(args.prompts)
        args.prompts = None                                # read once (--num-processes on the CPU forks with args)
    text = args.prompt is not None
    _check_generate_args(args, text)
    import torch
    # a finished run of prompts, or of classes (names read from a folder's files): nothing is loaded or started
    items = list(args.prompt) if text else _early_class_ids(args)
    if _folder_out(args.out) and items is not None:
        _, order, todo = _folder_run(args, items)
        if not todo:
            if os.environ.get("RANK", "0") == "0":   # (under accelerate launch every process gets here)
                _nothing_to_do(args, order)
            return 0
    if args.num_processes is not None and args.num_processes > 1:
        if _device(args.device).type == "cuda":
            return _launch_processes(args)
        from accelerate import notebook_launcher                # forks: before any model is loaded
        notebook_launcher(_generate_in_process, (args,), num_processes=args.num_processes)
        return 0
    folder = _folder_out(args.out)
    args.out = Path(args.out)
    fmt = None if folder else IMAGE_FORMATS[args.out.suffix.lower()]
    device = _device(args.device)
    if folder and device.type == "cuda":
        state = _process_state(device)
        if state.num_processes > 1:
            device = state.device                                # each process its own GPU
    kind, flag = _kernels_flag(args)
    if kind in ("triton", "compile") and device.type != "cuda":
        raise CLIError(f"{flag} fuses CUDA kernels; the model runs on {device.type}: drop {flag.split()[0]} or use "
                       f"--device cuda")
    dtype = _dtype(args.dtype, device)
    hart = text and args.model is not None and _is_hart(args.model)
    if hart:
        from .pipelines.hart_pipeline import HARTPipeline as family
        _check_hart_args(args)
    elif text:
        from .pipelines.infinity_pipeline import InfinityPipeline as family
    elif _is_flexvar(args):
        from .pipelines.flexvar_pipeline import FlexVARPipeline as family
    else:
        from .pipelines.var_pipeline import VARPipeline as family
    flexvar = family.__name__ == "FlexVARPipeline"
    from .pipelines._accelerated import check_memory
    configs = _policy_configs(args, family.PRESET_FAMILY)
    if args.quiet and text:                           # transformers' "Loading weights" bar for the T5
        from transformers.utils import logging as transformers_logging
        transformers_logging.disable_progress_bar()
    pipe = (_load_hart if hart else _load_infinity if text else _load_flexvar if flexvar else _load_pipeline)(
        args, device, dtype, say)
    pipe.set_progress_bar_config(disable=args.quiet, desc="scales")
    _apply_acceleration(pipe, args, configs, compile=not _low_vram_gpu(args, device))
    gen = torch.Generator(device).manual_seed(args.seed)
    if hart:
        n, items, cond = len(args.prompt), list(args.prompt), "prompt"
        need = pipe.memory_needed
        call = dict(prompt=args.prompt)
        what = f"{n} prompt(s)"
    elif text:
        height, width = args.height or 1024, args.width or 1024
        n, items, cond = len(args.prompt), list(args.prompt), "prompt"
        need = lambda b: pipe.memory_needed(b, height=height, width=width)        # noqa: E731
        call = dict(prompt=args.prompt, negative_prompt=args.negative_prompt, height=height, width=width)
        what = f"{n} prompt(s)"
    else:
        ids = _class_ids(pipe, args.class_labels or ["0"], args)
        n, items, cond = len(ids), ids, "class_labels"
        call = dict(class_labels=ids)
        if flexvar:
            call["patch_nums"] = pipe.resolve_schedule(args.height, args.width, args.steps)
            need = lambda b: pipe.memory_needed(b, call["patch_nums"])           # noqa: E731
        else:
            need = pipe.memory_needed
        what = f"{n} class(es)"
    call.update((k, v) for k, v in (("guidance_scale", args.cfg), ("top_k", args.top_k), ("top_p", args.top_p),
                                    ("temperature", args.temperature)) if v is not None)   # else the family's defaults
    if args.low_vram:
        per_call = args.batch_size or (n * args.num if not folder else 1)
        size = {"height": call["height"], "width": call["width"]} if text and not hart else \
            {"patch_nums": call["patch_nums"]} if flexvar else {}
        try:
            enabled = pipe.enable_low_vram(per_call, device=device, **size)
        except ValueError as e:
            raise CLIError(f"--low-vram: {e}") from None
        say(f"--low-vram: {', '.join(enabled) if enabled else 'nothing needed'} "
            f"({pipe.estimate_memory(per_call, **size)})")
        if _low_vram_gpu(args, device):
            _set_kernels(pipe, args)
    if folder:
        pipe.set_progress_bar_config(disable=True)                     # one bar over the images instead
        return _generate_folder(args, pipe, device, items, lambda chosen: {**call, cond: list(chosen)}, need)
    needed = need(n * args.num)
    B = n * args.num
    try:
        hw = (getattr(args, "height", None), getattr(args, "width", None)) if text else (None, None)
        check_memory(pipe, needed, B, f"--num {args.num} × {what} = {B} images in one run",
                     "lower --num, or split the run", hw)
    except ValueError as e:
        raise CLIError(str(e)) from None
    t0 = time.perf_counter()
    try:
        out = pipe(**call, num_images_per_prompt=args.num, generator=gen)
    except (RuntimeError, MemoryError) as e:
        if not (_is_out_of_memory(e) or isinstance(e, MemoryError)):
            raise
        raise CLIError(f"--num {args.num}: out of memory generating {B} images at once on {device} "
                       f"({str(e).splitlines()[0][:120]}); lower --num, or split the run") from None
    dt = time.perf_counter() - t0
    st = out.stats[0]
    if args.save_token_maps and not st.token_maps:
        raise CLIError("--save-token-maps: SparseVAR left every token in (no scale was pruned: --tau 0 or "
                       "--keep-ratio 1, or its scales were skipped), so there is no map to show; nothing was written")
    paths = _image_paths(args.out, len(out.images))
    _save_images(out.images, paths, fmt)
    print(f"{len(paths)} image(s) → {', '.join(str(p) for p in paths)} | {dt * 1e3:.0f} ms | {st.summary()}")
    if args.save_token_maps:
        from .viz import save_token_maps
        maps = save_token_maps(st, out.images, Path(args.save_token_maps), prefix=args.out.stem + "_tokens")
        print(f"token maps → {', '.join(str(p) for p in maps)}")
    if args.stats:
        print(st.table())
    return 0


# ---- convert, info --------------------------------------------------------------------------------
def cmd_convert(args) -> int:
    """Official files → a safetensors pipeline folder, written to ``.<out>.partial`` and renamed at the
    end, so a failure, Ctrl-C or SIGTERM leaves nothing behind. The family is read off the checkpoint's keys."""
    import shutil

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out} is a file; give a folder name")
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise CLIError(f"--out {out} exists and is not empty; choose a new folder or pass --overwrite")
    _check_writable(out, "--out", folder=True)
    _check_beside(out)
    for flag, path, what in (("--ckpt", args.ckpt, "the official transformer file (HART: its release folder)"),
                             ("--vae-ckpt", args.vae_ckpt, "the official VAE file (HART takes none)")):
        if path is not None and not Path(path).exists():               # before torch is imported
            raise FileNotFoundError(f"{flag} {path} not found — pass {what}")

    import torch
    from .models.loading import checkpoint_family

    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.float32
    dtype_name = str(dtype).replace("torch.", "")
    from .models.loading import hart_folders
    hart = hart_folders(args.ckpt) if Path(args.ckpt).is_dir() else None
    family = "hart" if hart else checkpoint_family(args.ckpt)
    if family == "hart":
        from .pipelines.hart_pipeline import HARTPipeline
        if not args.text_encoder or args.vae_ckpt:
            raise CLIError(f"{args.ckpt} is a HART model: pass --text-encoder FOLDER (a local copy of its Qwen2 text "
                           f"encoder, saved into the pipeline folder) and no --vae-ckpt (its tokenizer/ sits beside llm/)")
        pipe = HARTPipeline.from_single_file(hart[0], hart[1], args.text_encoder, dtype=dtype)
        cfg = pipe.transformer.config
        what = f"HART {cfg.depth} layers × {cfg.embed_dim}, {dtype_name}, with its Qwen2 text encoder"
        usage = f"HARTPipeline.from_pretrained({str(out)!r}) or `sparsevar generate --model {out} --prompt \"...\"`"
    elif not args.vae_ckpt:
        vae_file = {"var": "VAR's vae_ch160v4096z32.pth", "flexvar": "FlexVAR's FlexVAE.pth",
                    "infinity": "Infinity's infinity_vae_d32reg.pth"}.get(
            family, "vae_ch160v4096z32.pth for VAR, FlexVAE.pth for FlexVAR, infinity_vae_d32reg.pth for Infinity")
        raise CLIError(f"--ckpt {args.ckpt}: also pass --vae-ckpt, its VAE file ({vae_file})")
    elif family == "var":
        from .pipelines.var_pipeline import VARPipeline
        if args.text_encoder:
            raise CLIError(f"--text-encoder is for Infinity; {args.ckpt} is a class-conditional VAR transformer")
        pipe = VARPipeline.from_single_file(args.ckpt, args.vae_ckpt, dtype=dtype)
        cfg = pipe.transformer.config
        what = f"VAR depth {cfg.depth}, {16 * cfg.patch_nums[-1]} px, {dtype_name}"
        usage = f"VARPipeline.from_pretrained({str(out)!r}) or `sparsevar generate --model {out} --class 0`"
    elif family == "flexvar":
        from .pipelines.flexvar_pipeline import FlexVARPipeline
        if args.text_encoder:
            raise CLIError(f"--text-encoder is for Infinity and HART; {args.ckpt} is a class-conditional FlexVAR "
                           f"transformer")
        pipe = FlexVARPipeline.from_single_file(args.ckpt, args.vae_ckpt, dtype=dtype)
        cfg = pipe.transformer.config
        what = f"FlexVAR depth {cfg.depth}, any schedule, {dtype_name}"
        usage = (f"FlexVARPipeline.from_pretrained({str(out)!r}) or `sparsevar generate --model {out} --class 0 "
                 f"--height 256`")
    elif family == "infinity":
        from .pipelines.infinity_pipeline import InfinityPipeline
        if not args.text_encoder:
            raise CLIError(f"{args.ckpt} is an Infinity transformer: also pass --text-encoder FOLDER, a local copy of "
                           f"google/flan-t5-xl (T5 weights + tokenizer); it is saved into the pipeline folder")
        pipe = InfinityPipeline.from_single_file(args.ckpt, args.vae_ckpt, text_encoder=args.text_encoder,
                                                 dtype=dtype)
        cfg = pipe.transformer.config
        what = f"Infinity {cfg.depth} layers × {cfg.embed_dim}, {dtype_name}, with its T5 text encoder"
        usage = (f"InfinityPipeline.from_pretrained({str(out)!r}) or "
                 f"`sparsevar generate --model {out} --prompt \"...\"`")
    else:
        hint = {"var-vqvae": "the VAR VQVAE: pass it as --vae-ckpt, and var_d*.pth as --ckpt",
                "flexvar-vq": "FlexVAR's tokenizer: pass it as --vae-ckpt, and FlexVARd*.pth as --ckpt",
                "infinity-vae": "the Infinity VAE: pass it as --vae-ckpt, and infinity_2b_reg.pth as --ckpt"}.get(
            family, "neither a VAR nor an Infinity transformer checkpoint (var_d*.pth, infinity_2b_reg.pth or the "
                    "8B shard folder)")
        raise CLIError(f"--ckpt {args.ckpt} is {hint}")
    tmp = out.with_name(f".{out.name}.partial")
    old = out.with_name(f".{out.name}.old")
    for leftover in (tmp, old):
        if leftover.exists():
            shutil.rmtree(leftover)
    made = []                                       # parent folders this call creates
    folder = out.absolute().parent
    while not folder.exists():
        made.append(folder)
        folder = folder.parent
    try:
        pipe.save_pretrained(tmp)
        if out.exists():
            os.replace(out, old)                    # (--overwrite) the new folder replaces the old one whole
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            os.replace(old, out)
        for d in made:                              # deepest first; only if left empty
            try:
                d.rmdir()
            except OSError:
                pass
        raise
    shutil.rmtree(old, ignore_errors=True)
    print(f"converted → {out} ({what}); load it with {usage}")
    return 0


def _labels(path: Optional[str]) -> tuple[dict, int, str]:
    """(class id → name, number of classes, what the model is) of a VAR model folder or official
    transformer file (the demo model when ``path`` is None), read without loading its weights."""
    from .models.loading import describe_checkpoint
    if path is None:
        from .demo import DEMO_MODEL_DIR
        path, what = DEMO_MODEL_DIR, "the built-in demo model"
    else:
        what = str(path)
    info = describe_checkpoint(path)
    if info.get("family") != "var":
        raise CLIError(f"--labels: {path} is {'an' if str(info.get('family'))[0] in 'aeiou' else 'a'} "
                       f"{info.get('family')} model, not a class-conditional VAR one (Infinity takes text prompts)")
    n = int((info.get("transformer") or info).get("num_classes", 0))
    names: dict = {}
    index = Path(path) / "model_index.json"
    if index.is_file():
        from .pipelines.var_pipeline import check_id2label
        id2label = json.loads(index.read_text()).get("id2label")
        names = check_id2label(id2label, f"{index}: \"id2label\"") if id2label is not None else {}
    if not names and n == 1000:
        from .pipelines._imagenet_classes import IMAGENET_CLASSES
        names = dict(enumerate(IMAGENET_CLASSES))
    return names, n, what


def cmd_info(args) -> int:
    if args.backends:
        from .sparse_ops.attention import describe_backends
        print(describe_backends())
        if not args.path and not args.labels:
            return 0
    if args.labels:
        names, n, what = _labels(args.path)
        if args.json:
            print(json.dumps({"num_classes": n, "labels": {str(k): v for k, v in sorted(names.items())}}, indent=2))
        elif not names:
            print(f"{what} has {n} classes and no class names: pass ids 0..{n - 1} to --class")
        else:
            print("\n".join(f"{i}: {names[i]}" for i in sorted(names)))
        return 0
    if not args.path:
        raise CLIError("info needs a checkpoint file or model folder (or --backends, or --labels for the demo "
                       "model's class names)")
    if not Path(args.path).exists():                   # (before the loaders import torch)
        raise FileNotFoundError(f"{args.path} not found — pass the path of a checkpoint file or a model folder")
    from .models.loading import describe_checkpoint
    info = describe_checkpoint(args.path)
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


# ---- bench, train-demo ----------------------------------------------------------------------------
def cmd_bench_quality(args) -> int:
    from .benchmarks.bench_quality import describe_settings, run_from_args
    if args.list_settings:
        print(describe_settings())
        return 0
    _device(args.device)
    _at_least(args.top_k, 0, "--top-k", "give 0 (no limit) or more codes per token (1 = greedy)")
    _number_in(args.top_p, "--top-p", lambda v: 0.0 <= v <= 1.0, "give a probability in [0, 1]")
    _check_cfg(args.cfg, VAR_DEFAULTS.guidance_off)
    _at_least(args.warmup, 0, "--warmup", "give the number of untimed generations, 0 or more")
    _at_least(args.grid_seeds, 1, "--grid-seeds", "give the number of grid rows, 1 or more")
    _check_writable(args.out, "--out", folder=True)
    from .pipelines.var_pipeline import ClassLabelError
    try:
        run_from_args(args)
    except ClassLabelError as e:
        problem = e.problem if e.problem.endswith((".", "?")) else e.problem + "."
        labels = f"`sparsevar info --labels{' ' + str(args.model) if args.model else ''}` lists the names"
        raise CLIError(f"--classes {' '.join(args.classes or [])}: {problem} {labels}; or give class ids") from None
    return 0


def cmd_bench_observe(args) -> int:
    from .benchmarks.bench_observe import run_from_args
    _device(args.device)
    if args.out is not None:
        _check_writable(args.out, "--out")
    run_from_args(args)
    return 0


def cmd_calibrate(args) -> int:
    from .benchmarks.bench_observe import START_CANDIDATES, TAU_CANDIDATES, check_settings, check_taus, run_calibrate
    _device(args.device)
    if args.drafters is not None and not args.scalekv:
        raise CLIError(f"--drafters {args.drafters}: the number of ScaleKV drafter layers goes with --scalekv")
    _at_least(args.drafters, 1, "--drafters", "give the number of drafter layers, 1 or more")
    if args.scalekv:
        _at_least(args.seeds, 2, "--seeds", "--scalekv pairs each layer's gain by seed: give 2 or more")
    try:
        check_settings(args.keep, args.scales, args.seeds)
        check_taus(args.taus, args.starts)
    except ValueError as e:
        flag = str(e).split("=")[0]
        raise CLIError(f"--{flag} {str(e)[len(flag) + 1:]}") from None
    prompts = None
    if args.prompts is not None:
        if not args.prompts.is_file():
            raise CLIError(f"--prompts {args.prompts}: no such file; give a text file with one prompt per line")
        prompts = [line.strip() for line in args.prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not prompts:
            raise CLIError(f"--prompts {args.prompts}: the file has no prompt; give one prompt per line")
    if not args.dry_run and not os.access(args.model, os.W_OK) and Path(args.model).is_dir():
        raise CLIError(f"--model {args.model}: the folder is not writable, so the calibration cannot be stored in "
                       f"it; copy the folder somewhere writable, or pass --dry-run to only measure")
    run_calibrate(args.model, seeds=args.seeds, keep=args.keep, scales=args.scales, prompts=prompts,
                  device=args.device, write=not args.dry_run,
                  taus=() if args.layer_only else (args.taus or TAU_CANDIDATES),
                  starts=args.starts or START_CANDIDATES, drafters=(args.drafters or 0) if args.scalekv else None,
                  height=args.height, width=args.width)
    return 0


def cmd_bench_ops(args) -> int:
    import torch
    _at_least(args.runs, 1, "--runs", "time each op at least once (e.g. --runs 50)")
    if args.out is not None:
        _check_writable(args.out, "--out")
    from .benchmarks.bench_ops import run_ops
    if not torch.cuda.is_available():
        raise CLIError("bench ops times the GPU kernels: no CUDA device is available on this machine "
                       "(the kernels' correctness tests run on CPU: python -m pytest tests/test_sparse_ops.py)")
    out = args.out
    if out is None:
        out = Path("benchmarks/results") / f"ops_{torch.cuda.get_device_name().replace(' ', '_')}.csv"
        _check_writable(out, "--out")
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
        from .benchmarks.bench_speed import METHODS, run_speed
        from .models.infinity import INFINITY_PRESETS
        from .models.var import VAR_PRESETS
        _device(args.device)
        for b in args.batch:
            _at_least(b, 1, "--batch", "give batch sizes of 1 or more")
        _at_least(args.runs, 1, "--runs", "time each setting at least once")
        _at_least(args.warmup, 0, "--warmup", "give the number of untimed runs, 0 or more")
        _at_least(args.resolution, 1, "--resolution", "give a positive image side in pixels (Infinity: 1024)")
        if args.resolution is not None and any(m in INFINITY_PRESETS for m in args.models):
            from .models.infinity import resolve_resolution
            try:
                resolve_resolution(args.resolution, args.resolution)
            except ValueError as e:
                raise CLIError(f"--resolution {args.resolution}: {e}") from None
        from .models.flexvar import FLEXVAR_PRESETS, PATCH
        from .models.hart import HART_PRESETS
        known = sorted(VAR_PRESETS) + sorted(INFINITY_PRESETS) + sorted(HART_PRESETS) + sorted(FLEXVAR_PRESETS)
        unknown = [m for m in args.models if m not in known]
        if unknown:
            raise CLIError(f"--models {' '.join(unknown)}: unknown; choose from {', '.join(known)}")
        if args.resolution is not None and args.resolution % PATCH and any(m in FLEXVAR_PRESETS for m in args.models):
            raise CLIError(f"--resolution {args.resolution}: FlexVAR draws sides that are multiples of {PATCH} px "
                           f"(256 its default, 512 zero-shot)")
        methods = args.methods
        if methods == ["all"]:
            methods = list(METHODS)
        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            raise CLIError(f"--methods {' '.join(unknown)}: unknown; choose from {', '.join(METHODS)} or all")
        out = args.out
        if out is None:
            import torch
            gpu = torch.cuda.get_device_name().replace(" ", "_") if torch.cuda.is_available() else "cpu"
            out = Path("benchmarks/results") / f"speed_{gpu}.csv"
        _check_writable(out, "--out")
        rows = run_speed(args.models, args.batch, runs=args.runs, warmup=args.warmup, methods=methods,
                         dtype=args.dtype, out=out, device=args.device, resolution=args.resolution,
                         vae_dtype=args.vae_dtype, output_type=args.output_type, encode_once=args.encode_once,
                         profile_out=out.with_name(f"{out.stem}_profile.txt") if args.profile else None)
        if not rows:
            raise CLIError("no setting could run (the lines above say why); nothing was written")
        return 0
    if args.what == "memory":
        import torch

        from .benchmarks.bench_memory import SETTINGS, run_memory
        if not torch.cuda.is_available():
            raise CLIError("bench memory measures GPU memory: it needs a CUDA device (this machine has none)")
        unknown = [s for s in args.settings if s not in SETTINGS]
        if unknown:
            raise CLIError(f"--settings {' '.join(unknown)}: unknown; choose from {', '.join(SETTINGS)}")
        total = torch.cuda.get_device_properties(0).total_memory / 1e9
        for gb in args.card_gb:
            if not 0 < gb <= total:
                raise CLIError(f"--card-gb {gb:g}: give a card size in GB between 0 and this GPU's {total:.0f}")
        _at_least(args.runs, 1, "--runs", "time each setting at least once")
        _at_least(args.warmup, 0, "--warmup", "give the number of untimed runs, 0 or more")
        _check_writable(args.out, "--out")
        rows = run_memory(args.models, args.card_gb, args.settings, runs=args.runs, warmup=args.warmup,
                          real_text_encoder=not args.tiny_text_encoder, out=args.out)
        if not rows:
            raise CLIError("no setting could run (the lines above say why); nothing was written")
        return 0
    raise CLIError(f"unknown benchmark {args.what!r}")


def cmd_train_demo(args) -> int:
    from dataclasses import replace

    from .demo.train import DemoTrainConfig, train_demo

    out = Path(args.out) if args.out else DEMO_TRAIN_DIR
    _check_writable(out, "--out", folder=True)
    _check_beside(out)
    if not 0 <= args.seed <= SEED_MAX:
        raise CLIError(f"--seed {args.seed}: seeds are 0 … {SEED_MAX} (64 bits)")
    cfg = DemoTrainConfig(seed=args.seed)
    if args.quick:
        cfg = cfg.quick()
    steps = {k: v for k, v in (("vq_steps", args.vq_steps), ("dec_steps", args.dec_steps),
                               ("var_steps", args.var_steps), ("var_batch", args.var_batch),
                               ("var_lr", args.var_lr),
                               ("cls_steps", args.cls_steps),
                               ("var_data", args.var_data), ("cls_data", args.cls_data)) if v is not None}
    if args.schedule is not None:
        steps["schedule"] = args.schedule
    if args.dec_adv_weight is not None:
        steps["dec_adv_weight"] = args.dec_adv_weight
    if args.var_continue:
        steps["var_continue"] = True
    if args.vq_ch_mult is not None:
        steps["vq_ch_mult"] = tuple(args.vq_ch_mult)
    try:
        cfg = replace(cfg, **steps)
    except ValueError as e:
        raise CLIError(str(e)) from None
    device = _device(args.device)
    say = (lambda m: None) if args.quiet else (lambda m: print(m, flush=True))
    t0 = time.perf_counter()
    train_demo(out, cfg, stages=args.stages, device=device, log=say)
    use = f"; generate with `sparsevar generate --model {out} --class tree`" if (out / "model_index.json").is_file() \
        else ""
    print(f"demo model ({', '.join(args.stages)}) → {out} in {time.perf_counter() - t0:.0f} s{use}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with the command line's one-line errors: ``sparsevar generate: error: --num two: give
    a whole number`` (status 2), not the usage block; ``--help`` is unchanged."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {_argparse_fix(message, self.prog)}\n")


def _argparse_fix(message: str, prog: str) -> str:
    """argparse's message as the flag, the value and what to give instead."""
    m = re.fullmatch(r"argument (\S+): invalid (int|float) value: '(.*)'", message)
    if m:
        return f"{m[1]} {m[3]}: give {'a whole number' if m[2] == 'int' else 'a number'}"
    m = re.fullmatch(r"argument (\S+): invalid choice: '(.*?)' \(choose from (.*)\)", message)
    if m and not m[1].startswith("-"):               # the (sub-)command itself
        return f"{m[2]}: not a command; choose from {m[3]}"
    if m:
        return f"{m[1]} {m[2]}: not one of the choices; choose from {m[3]}"
    m = re.fullmatch(r"argument (\S+): expected (.*)", message)
    if m:
        return f"{m[1]}: expected {m[2]}; `{prog} --help` says what it takes"
    return f"{message}; `{prog} --help` lists the options"


def _unknown_options(parser: argparse.ArgumentParser, args, extra: Sequence[str]) -> str:
    """The error line for arguments no option takes: the command's prog, the first unknown one and
    the nearest option name."""
    import difflib
    sub = parser
    for dest in ("command", "what"):                 # down to the (sub-)command that was parsed
        action = next((a for a in sub._actions if isinstance(a, argparse._SubParsersAction)), None)
        if action is None or getattr(args, dest, None) not in action.choices:
            break
        sub = action.choices[getattr(args, dest)]
    flags = [o for a in sub._actions for o in a.option_strings]
    given = [e for e in extra if e != "--"] or extra
    first = next((e for e in given if e.startswith("-")), given[0])
    near = difflib.get_close_matches(first.split("=")[0], flags, n=1, cutoff=0.6)
    fix = f"did you mean {near[0]}?" if near else f"`{sub.prog} --help` lists the options"
    what = "unknown option" if first.startswith("-") and first != "--" else "an argument no option takes"
    return f"{sub.prog}: error: {first}: {what}; {fix}"


def build_parser(argv: Optional[Sequence[str]] = None) -> argparse.ArgumentParser:
    """The command line's parser. With ``argv``, the options of the benchmark commands that live in
    modules importing torch (``bench quality``, ``observe``, ``gemm-rows``) are added only when
    ``argv`` names that command, so that every other command parses, and refuses a wrong argument,
    before torch and diffusers are imported; without it, every option."""
    def wanted(what: str) -> bool:
        return argv is None or list(argv[:2]) == ["bench", what]

    p = _Parser(prog="sparsevar", description="Fast next-scale-prediction image generation.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate images (class-conditional VAR, or text-to-image Infinity)")
    g.add_argument("--model", help="a folder written by `sparsevar convert` / save_pretrained; with --prompt also an "
                                    "Infinity .pth file or 8B shard folder, or HART's release folder (llm/ + "
                                    "tokenizer/) or its llm/ (default: the built-in demo model)")
    g.add_argument("--var-ckpt", help="official transformer file, e.g. var_d16.pth or FlexVARd24-epo349.pth")
    g.add_argument("--vae-ckpt", help="official VAE file: vae_ch160v4096z32.pth (VAR), FlexVAE.pth (FlexVAR) or "
                                      "infinity_vae_d32reg.pth")
    g.add_argument("--class", dest="class_labels", nargs="+", action="extend",
                   help="class ids or names (the model's labels: ImageNet names, or the demo's 'tree', 'car', …; "
                        "default 0; a repeated --class adds more)")
    g.add_argument("--prompt", nargs="+", action="extend",
                   help="text prompt(s), each in quotes (--prompt \"a red fox\" \"a cat\" is two; a repeated --prompt "
                        "adds more): text-to-image with an Infinity or HART model")
    g.add_argument("--negative-prompt", help="Infinity: what to steer away from")
    g.add_argument("--text-encoder", help="Infinity: a local Flan-T5 folder (T5EncoderModel + tokenizer); HART: a "
                                          "local Qwen2 folder (mit-han-lab/Qwen2-VL-1.5B-Instruct)")
    g.add_argument("--height", type=int, help="Infinity: image height (default 1024); an official size, e.g. 256, 512, "
                                              "768 or 1024 for 1:1 (another size lists those of its aspect ratio)")
    g.add_argument("--width", type=int, help="Infinity: image width (default 1024); FlexVAR: height and width, square, "
                                             "multiples of 16 (default 256; 512 zero-shot)")
    g.add_argument("--steps", type=int, help="FlexVAR: number of scales (default the reference's: 10 at 256 px, 15 "
                                             "at 512 px; e.g. 13)")
    i = INFINITY_DEFAULTS
    said = lambda key: f"VAR default {getattr(VAR_DEFAULTS, key):g}, Infinity {getattr(i, key):g}"  # noqa: E731
    g.add_argument("--temperature", type=float, help=f"Infinity: sampling temperature (default {i.temperature:g}, "
                                                     f"{i.patchify_temperature:g} for 8B)")
    g.add_argument("--seed", type=int, default=0, help="0 … 2^64-1 (default 0)")
    g.add_argument("--cfg", type=float, help=f"guidance scale ({said('guidance_scale')}; VAR's ramped over scales)")
    g.add_argument("--top-k", type=int, help=f"codes kept per token ({said('top_k')}; 0: all, 1: greedy)")
    g.add_argument("--top-p", type=float, help=f"nucleus sampling in [0, 1] ({said('top_p')}; 0: off)")
    g.add_argument("--num", "--num-per-prompt", dest="num", type=int, default=1,
                   help="images per class (per prompt); --num-per-prompt is the same flag")
    g.add_argument("--out", default="out.png", help="image path; several images get _0, _1, …. A folder (a name "
                                                    "ending in /, or an existing folder) gets numbered images, run.json "
                                                    "and manifest.jsonl, and a rerun finishes what is missing")
    g.add_argument("--prompts", help="a text file of prompts, one per line (added to --prompt)")
    g.add_argument("--batch-size", type=int, help="folder output: images per pipeline call (default: as many as fit, "
                                                   "at most 16; 4 on the CPU)")
    g.add_argument("--num-processes", type=int, help="folder output: split the images over N processes (one GPU "
                                                      "each; on the CPU, N processes) with accelerate; "
                                                      "`accelerate launch -m sparsevar generate …` does the same "
                                                      "with an accelerate config")
    g.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    g.add_argument("--dtype", default="auto", choices=DTYPES)
    g.add_argument("--quiet", action="store_true")
    g.add_argument("--stats", action="store_true", help="print the per-scale table")
    a = g.add_argument_group("acceleration")
    a.add_argument("--sparsevar", action="store_true", help="SparseVAR token exclusion (family preset); not with "
                                                             "--fastvar")
    a.add_argument("--tau", type=float, help="SparseVAR change threshold in [0, 1)")
    a.add_argument("--keep-ratio", type=float, help="SparseVAR: fixed share of tokens computed per scale, (0, 1]")
    a.add_argument("--start-scale", type=int, help="SparseVAR: first pruned scale (negative: from the end)")
    a.add_argument("--block", type=int, help="SparseVAR: observed layer")
    a.add_argument("--alpha", type=int, help="SparseVAR: anchor stride")
    a.add_argument("--beta", type=float, help="SparseVAR: anchor-copy similarity threshold")
    a.add_argument("--save-token-maps", metavar="DIR", help="write SparseVAR's token maps as PNGs")
    a.add_argument("--fastvar", type=float, nargs="*", metavar="RATIO",
                   help="FastVAR; optional prune ratios in [0, 1] of the last scales, earliest first (1.0 skips); "
                        "not with --sparsevar")
    a.add_argument("--fastvar-layers", type=int, nargs=2, metavar=("FIRST", "LAST"),
                   help="FastVAR: first and last layer that prune (default: the family preset; Infinity-2B 3 27)")
    a.add_argument("--sparvar", type=float, nargs="?", const=True, metavar="TOP_KEYS",
                   help="SparVAR sparse attention (family preset); optionally the fraction of keys CS4A keeps, "
                        "(0, 1]; not with --sparsevar or --fastvar")
    a.add_argument("--scalekv", type=float, nargs="?", const=True, metavar="BUDGET",
                   help="ScaleKV KV-cache compression (less memory; the model's preset, Infinity: the release's "
                        "10%% budgets); optionally the fraction of the cached tokens each refiner layer keeps after "
                        "every scale, (0, 1]; not with --sparsevar, --fastvar or --sparvar")
    a.add_argument("--skip-last", type=int, default=0, help="skip the last N scales (0 … scales - 1)")
    a.add_argument("--cond-only-from", type=int, help="run from this scale on without guidance (negative: from the end)")
    a.add_argument("--low-vram", action="store_true",
                   help="fit the device's memory: text encoder streaming, model CPU offload, ScaleKV, ScaleKV "
                        "with either, then sequential CPU offload (without and with ScaleKV), as the estimate "
                        "(pipe.estimate_memory) needs; says what it enabled")
    a.add_argument("--kernels", choices=["auto", "triton", "compile", "torch"], default="auto",
                   help="the layers' kernels (pipe.set_kernels): auto (default) runs this package's Triton kernels "
                        "on a GPU that can run them and plain torch elsewhere; triton requires them; compile uses "
                        "torch.compile; torch is plain torch")
    a.add_argument("--compile", action="store_true", help="the same as --kernels triton")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="official files → safetensors pipeline folder (VAR, Infinity with its T5 "
                                        "text encoder, HART with its Qwen2)")
    c.add_argument("--ckpt", "--var-ckpt", dest="ckpt", required=True,
                   help="the transformer: var_d*.pth, infinity_2b_reg.pth, the Infinity 8B shard folder, or HART's "
                        "release folder (llm/ + tokenizer/) (the family is read off its keys)")
    c.add_argument("--vae-ckpt",
                   help="its VAE: vae_ch160v4096z32.pth (VAR) or infinity_vae_d32reg.pth (Infinity); HART: none (its "
                        "tokenizer/ sits beside llm/)")
    c.add_argument("--text-encoder", help="Infinity: a local google/flan-t5-xl folder (T5EncoderModel + tokenizer); "
                                          "HART: a local Qwen2 folder; saved into the pipeline folder")
    c.add_argument("--out", required=True)
    c.add_argument("--dtype", default="auto", choices=DTYPES, help="transformer weight dtype (auto = float32)")
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("info", help="what a checkpoint file or model folder is")
    i.add_argument("path", nargs="?", help="a checkpoint file or model folder")
    i.add_argument("--json", action="store_true")
    i.add_argument("--backends", action="store_true", help="attention / kernel backends available here")
    i.add_argument("--labels", action="store_true", help="the class names `generate --class` takes, of the VAR "
                                                        "model at PATH (default: the built-in demo model)")
    i.set_defaults(func=cmd_info)

    t = sub.add_parser("train-demo", help="train a demo model on procedural scenes (about 24 min on one H100 with no "
                                          "flags; the README lists the shipped model's stages)",
                       description=f"Train a demo model on procedural scenes (about 24 min on one H100 with no flags: "
                                   f"the first, 256-schedule recipe; the README lists the stages of the shipped "
                                   f"512-schedule model), into ./{DEMO_TRAIN_DIR} unless --out says otherwise.")
    t.add_argument("--out", help=f"model folder to write (default: ./{DEMO_TRAIN_DIR}); the demo model that ships "
                                 f"with the package is left as it is")
    t.add_argument("--stages", nargs="+", default=["vqvae", "decoder", "var", "classifier"],
                   choices=["vqvae", "decoder", "var", "classifier"],
                   help="stages to run; later ones read earlier ones from --out")
    t.add_argument("--seed", type=int, default=0, help="0 … 2^64-1 (default 0)")
    t.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    t.add_argument("--quick", action="store_true", help="a few steps of each stage (smoke test; no real pictures)")
    t.add_argument("--vq-steps", type=int)
    t.add_argument("--dec-steps", type=int, help="steps of the decoder stage (the VQVAE's final decoder)")
    t.add_argument("--dec-adv-weight", type=float, metavar="W",
                   help="adversarial term of the decoder stage (patch discriminator; 0: off, 0.1–0.8 typical)")
    t.add_argument("--var-steps", type=int)
    t.add_argument("--var-batch", type=int, help="scenes per transformer step")
    t.add_argument("--var-lr", type=float, help="peak learning rate of the transformer (default 8e-4)")
    t.add_argument("--var-continue", action="store_true",
                   help="stage var trains the transformer already in --out further (with a new --seed: on new "
                        "scenes) instead of starting afresh")
    t.add_argument("--cls-steps", type=int)
    t.add_argument("--var-data", type=int, help="tokenised scenes the transformer trains on")
    t.add_argument("--schedule", type=int, choices=[256, 512],
                   help="token schedule: 256 (1…16, the shipped model) or 512 (1…32; with --vq-ch-mult 1 1 2 4)")
    t.add_argument("--vq-ch-mult", type=int, nargs="+", metavar="M",
                   help="VQVAE channel multipliers, one per level (default 1 1 2 2 4: 16× downsampling)")
    t.add_argument("--cls-data", type=int, help="scenes the classifier trains on")
    t.add_argument("--quiet", action="store_true")
    t.set_defaults(func=cmd_train_demo)

    k = sub.add_parser("calibrate", help="measure which layer SparseVAR should observe on a model and which "
                                         "threshold beats the baselines, and store them in the model folder "
                                         "(enable_sparsevar() then uses them)")
    k.add_argument("--model", required=True, help="pipeline folder (written by save_pretrained / `sparsevar convert`)")
    k.add_argument("--seeds", type=int, default=8, metavar="N", help="seeds 0..N-1, one image each (default 8)")
    k.add_argument("--keep", type=float, default=0.5, help="fraction of each pruned scale's tokens kept (default 0.5)")
    k.add_argument("--scales", type=int, default=3, metavar="N", help="pruned scales: the last N (default 3)")
    k.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                   help="text-to-image models: one prompt per line (repeated to --seeds)")
    k.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:1, …")
    k.add_argument("--height", type=int, default=None, help="Infinity models: the size to measure at (default 1024)")
    k.add_argument("--width", type=int, default=None, help="Infinity models: the size to measure at (default 1024)")
    k.add_argument("--taus", type=float, nargs="+", default=None, metavar="T",
                   help="thresholds to try (default 0.2 … 0.8), each from each of --starts: the fastest setting whose "
                        "pictures are at least as close to dense as the baselines (scale skipping, cond-only, FastVAR) "
                        "at its FLOP speed-up is stored")
    k.add_argument("--starts", type=int, nargs="+", default=None, metavar="S",
                   help="first pruned scales to try, counted from the end (default -1 -2 -3)")
    k.add_argument("--layer-only", action="store_true",
                   help="measure the observed layer only; keep the family's tau and start scale")
    k.add_argument("--dry-run", action="store_true", help="measure and print; leave the folder as it is")
    k.add_argument("--scalekv", action="store_true",
                   help="instead: measure ScaleKV's drafter layers (the layers whose whole cache most improves the "
                        "pictures against dense) and store them (enable_scalekv() then keeps their cache)")
    k.add_argument("--drafters", type=int, default=None, metavar="N",
                   help="with --scalekv: how many drafter layers (default: layers / 16, rounded up)")
    k.set_defaults(func=cmd_calibrate)

    b = sub.add_parser("bench", help="benchmarks: `bench speed` (GPU), `bench memory` (GPU), `bench quality`, `bench observe`, `bench ops` (GPU)")
    bsub = b.add_subparsers(dest="what", required=True)
    q = bsub.add_parser("quality", help="PSNR / SSIM against dense, speed-up and kept ratio per setting; CSV, "
                                         "plot and image grids (default model: the demo)")
    if wanted("quality"):
        from .benchmarks.bench_quality import add_arguments as add_quality_arguments
        add_quality_arguments(q)
    q.set_defaults(func=cmd_bench_quality)
    v = bsub.add_parser("observe", help="capture rate of every layer's change map: which layer SparseVAR should "
                                         "observe (default model: the demo)")
    if wanted("observe"):
        from .benchmarks.bench_observe import add_arguments as add_observe_arguments
        add_observe_arguments(v)
    v.set_defaults(func=cmd_bench_observe)
    o = bsub.add_parser("ops", help="each sparse op (Triton and its torch twin) in GB/s or TFLOP/s against the roof (GPU)")
    o.add_argument("--ops", nargs="+", help="ops to run (default: all)")
    o.add_argument("--runs", type=int, default=50)
    o.add_argument("--out", type=Path, default=None, help="CSV path (default benchmarks/results/ops_<GPU>.csv)")
    o.set_defaults(func=cmd_bench_ops)
    g = bsub.add_parser("gemm-rows", help="sweep cuBLAS over row counts for the layer products and write this GPU's "
                                          "row padding table (GPU; a few minutes)")
    if wanted("gemm-rows"):
        from .benchmarks.bench_gemm_rows import add_arguments as add_gemm_rows_arguments
        add_gemm_rows_arguments(g)
    g.set_defaults(func=cmd_bench_gemm_rows)
    b = bsub.add_parser("speed", help="per-scale speed of dense and accelerated generation at real model sizes")
    b.add_argument("--models", nargs="+", default=["var-d16", "var-d30"],
                   help="VAR_PRESETS (var-tiny, var-d16 … var-d36), INFINITY_PRESETS (infinity-tiny, infinity-2b, "
                        "infinity-8b), HART_PRESETS (hart-tiny, hart-0.7b) or FLEXVAR_PRESETS (flexvar-tiny, "
                        "flexvar-d16/d20/d24; --resolution 256 or 512); random weights at real size")
    b.add_argument("--resolution", type=int, help="Infinity models: square image side (default 1024); FlexVAR: 256 "
                   "(default) or any multiple of 16, e.g. 512 zero-shot; VAR and HART keep their own")
    b.add_argument("--batch", type=int, nargs="+", default=[1])
    b.add_argument("--runs", type=int, default=10)
    b.add_argument("--warmup", type=int, default=3)
    if wanted("speed"):                        # the method names, for the help (bench_speed imports torch)
        from .benchmarks.bench_speed import METHODS as SPEED_METHODS
    else:
        SPEED_METHODS = ("see `sparsevar bench speed --help`",)
    b.add_argument("--methods", nargs="+", default=["dense", "dense-graphs", "dense-eager"],
                   help=", ".join(SPEED_METHODS) + ", or 'all'")
    b.add_argument("--dtype", default="bfloat16", choices=DTYPES[1:])
    b.add_argument("--vae-dtype", default="float32", choices=DTYPES[1:],
                   help="Infinity and HART models: the VAE's dtype (Infinity's bfloat16 decode runs channels-last "
                        "with fused norms)")
    b.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (a functional run; its numbers mean "
                                                     "nothing)")
    b.add_argument("--output-type", default="pt", choices=("pt", "pil"),
                   help="what the timed calls return: 'pt' tensors or 'pil' pictures (the pipelines' default)")
    b.add_argument("--encode-once", action="store_true",
                   help="Infinity and HART: encode the prompt once before the timed calls, so that end to end "
                        "leaves the text encoder out, as the official timings do (its time is its own column)")
    b.add_argument("--profile", action="store_true",
                   help="after each setting, profile one more call: its phases (check, prompt, set-up, scales, "
                        "decode, conversion) with host and GPU time, and where the GPU waited, into "
                        "<out>_profile.txt beside the CSV")
    b.add_argument("--out", type=Path, default=None, help="CSV path (default benchmarks/results/speed_<GPU>.csv)")
    b.set_defaults(func=cmd_bench)
    m = bsub.add_parser("memory", help="peak GPU memory and time per memory setting (offload, ScaleKV) on a "
                                       "simulated card size (GPU)")
    m.add_argument("--models", nargs="+", default=["infinity-2b"],
                   help="infinity-2b, infinity-8b (with Flan-T5-XL's encoder at real size), hart-0.7b (with "
                        "Qwen2-1.5B at real size), var-d30 …; random weights at real size")
    m.add_argument("--card-gb", type=float, nargs="+", default=[80.0], metavar="GB",
                   help="simulated card sizes (torch.cuda.set_per_process_memory_fraction)")
    m.add_argument("--settings", nargs="+", default=["dense", "offload", "scalekv", "scalekv+offload"],
                   help="dense, offload, scalekv, stream, stream+scalekv, scalekv+offload, sequential, "
                        "sequential+scalekv, "
                        "scalekv+offload+cond-only-last-3")
    m.add_argument("--runs", type=int, default=3)
    m.add_argument("--warmup", type=int, default=1)
    m.add_argument("--tiny-text-encoder", action="store_true",
                   help="Infinity, HART: a 1-layer random T5 / Qwen2 instead of Flan-T5-XL's encoder / "
                        "Qwen2-1.5B's size")
    m.add_argument("--out", type=Path, default=Path("benchmarks/results/memory.csv"), help="CSV path")
    m.set_defaults(func=cmd_bench)
    return p


def _raise_terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # the clean-up that follows runs to its end
    raise _Terminated()


EXPANDABLE_SEGMENTS = "expandable_segments:True"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command. User mistakes print one line, ``sparsevar <command>: error: …``, and return 2;
    an error of the system (a full disk, …) the same way with status 1. Ctrl-C and SIGTERM stop the
    command after its clean-up (nothing half-written is left) with status 130 / 143.
    ``SPARSEVAR_DEBUG=1`` shows the traceback instead."""
    given = list(sys.argv[1:] if argv is None else argv)               # the command as given (--num-processes)
    parser = build_parser(given)
    args, extra = parser.parse_known_args(given)
    if extra:
        print(_unknown_options(parser, args, extra), file=sys.stderr)
        raise SystemExit(2)
    args.argv = given
    if getattr(args, "low_vram", False) or (args.command == "bench" and getattr(args, "what", None) == "memory"):
        # small cards: segments that grow in place instead of cached blocks of fixed sizes, which a freed
        # KV cache or weight buffer leaves split (read when CUDA starts; a value the user set is kept)
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", EXPANDABLE_SEGMENTS)
    debug = bool(os.environ.get("SPARSEVAR_DEBUG"))
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        return args.func(args)
    except (CLIError, ValueError, TypeError, FileNotFoundError) as e:
        if debug:
            raise
        print(f"sparsevar {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if debug:
            raise
        print(f"sparsevar {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"sparsevar {args.command}: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print(f"sparsevar {args.command}: stopped by SIGTERM", file=sys.stderr)
        return 143
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
