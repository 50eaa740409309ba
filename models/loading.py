"""Official checkpoints → our modules: read safely, recognise, infer the configuration, validate.

Every file is read with ``torch.load(weights_only=True)`` (or safetensors). Keys are mapped
explicitly (the project's module names are the official key names), derived buffers are
regenerated instead of loaded, training statistics are dropped, and the remaining key set must
match exactly: the official loaders accept mismatches silently, ours names them.

Converted folders (``save_pretrained`` / ``sparsevar convert``) are checked before they are loaded:
every JSON file parses, every weight file is whole (safetensors headers are read, no tensor data),
and each component's ``config.json`` builds exactly the tensors its weights hold
(:func:`check_pipeline_folder`). Dtype arguments of the loading entry points go through
:func:`resolve_dtype`.
"""
from __future__ import annotations

import inspect
import json
import os
import math
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Mapping, Optional, Sequence

import torch

from .var import VAR_SCHEDULES, VARTransformer
from .vqvae import MultiScaleVQVAE

# What the official VAR files hold besides parameters: derived buffers, regenerated on load.
_VAR_DERIVED = ("lvl_1L", "attn_bias_for_masking")
_VAR_DERIVED_SUFFIX = ".attn.zero_k_bias"


def _short(keys, n: int = 6) -> str:
    keys = sorted(keys)
    more = f" … ({len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


# ---- dtypes ------------------------------------------------------------------------------------------------
_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
                "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
                "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
DTYPE_SPELLINGS = ("torch.float32, torch.float16 or torch.bfloat16, or one of the strings 'float32' ('fp32', "
                   "'float'), 'float16' ('fp16', 'half'), 'bfloat16' ('bf16'), also with a 'torch.' prefix")


def resolve_dtype(value, name: str, allow_none: bool = False) -> Optional[torch.dtype]:
    """The torch dtype of a ``dtype`` / ``torch_dtype`` / ``vae_dtype`` / ``text_encoder_dtype`` argument.

    Takes diffusers' spellings: ``torch.float32`` / ``torch.float16`` / ``torch.bfloat16``, or the strings
    "float32" / "fp32" / "float", "float16" / "fp16" / "half", "bfloat16" / "bf16" (any case, with or
    without "torch."). ``None`` is returned as is where ``allow_none``. Anything else raises a TypeError
    naming the argument ``name``, the value and these spellings.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, torch.dtype):
        if value in (torch.float32, torch.float16, torch.bfloat16):
            return value
    elif isinstance(value, str):
        key = value.strip().lower()
        key = key[len("torch."):] if key.startswith("torch.") else key
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
    raise TypeError(f"{name}={value!r} is not a weight dtype; pass {DTYPE_SPELLINGS}")


def local_path(value, name: str) -> Path:
    """``value`` (a path argument named ``name``) as a Path: a str or os.PathLike that is not empty;
    anything else raises a TypeError / ValueError naming the argument (nothing is downloaded, so a
    path is all these loaders take)."""
    if isinstance(value, Path):
        return value
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a local path (str or pathlib.Path), got {type(value).__name__} {value!r}")
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"{name}={value!r} is empty: pass the path of a local file or folder")
    return Path(value)


# ---- reading one file ------------------------------------------------------------------------------------
_LFS_POINTER = b"version https://git-lfs"
_MAX_SAFETENSORS_HEADER = 100 * 2 ** 20          # safetensors' own limit on the JSON header


def _file_format(p: Path) -> Optional[str]:
    """What a file holds, from its first bytes: 'empty', 'lfs' (a Git LFS pointer), 'zip' (torch.save's
    format, possibly truncated), 'pickle' (torch's legacy format), 'safetensors', or None (none of these)."""
    with open(p, "rb") as f:
        head = f.read(32)
    if not head:
        return "empty"
    if head.startswith(_LFS_POINTER):
        return "lfs"
    if head.startswith(b"PK\x03\x04") or zipfile.is_zipfile(p):
        return "zip"
    if head[0] == 0x80 and len(head) > 1 and 2 <= head[1] <= 5:
        return "pickle"
    if len(head) > 8 and 0 < int.from_bytes(head[:8], "little") <= _MAX_SAFETENSORS_HEADER and head[8:9] == b"{":
        return "safetensors"
    return None


def _lfs_error(p: Path, what: str) -> ValueError:
    return ValueError(f"{what} {p} is a Git LFS pointer ({p.stat().st_size} bytes), not the weights: the "
                      f"repository was cloned without its large files; run `git lfs pull` there, or download the file")


def safetensors_shapes(path, what: str = "weights", dtypes: Optional[dict] = None) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a safetensors file, from its header alone (no tensor data is read); with ``dtypes``
    (a dict), each tensor's safetensors dtype name ("F32", "I64", …) is added to it. A file that is
    empty, truncated or not safetensors raises a ValueError naming it."""
    p = Path(path)
    size = p.stat().st_size
    fmt = _file_format(p)
    if fmt == "lfs":
        raise _lfs_error(p, what)
    if fmt == "empty":
        raise ValueError(f"{what} {p} is empty (0 bytes): the copy or conversion did not finish; convert or "
                         f"download it again")
    if fmt != "safetensors":
        kind = "those of a PyTorch (torch.save) file" if fmt in ("zip", "pickle") else \
            "no safetensors header (nor any checkpoint format)"
        raise ValueError(f"{what} {p} ({size:,} bytes) is not a readable safetensors file: its first bytes are "
                         f"{kind}; the file is corrupt or misnamed — convert or download it again")
    with open(p, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
        shapes, end = {}, 0
        for k, v in header.items():
            if k == "__metadata__":
                continue
            shapes[k] = tuple(int(d) for d in v["shape"])
            end = max(end, int(v["data_offsets"][1]))
            if dtypes is not None:
                dtypes[k] = str(v["dtype"])
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise ValueError(f"{what} {p} ({size:,} bytes) is not a readable safetensors file: its header is "
                         f"{'cut off' if len(raw) < n else 'damaged'}; convert or download it again") from None
    if 8 + n + end > size:
        raise ValueError(f"{what} {p} is truncated: it holds {size:,} bytes, its header describes {8 + n + end:,}; "
                         f"the copy or conversion did not finish — convert or download it again")
    return shapes


def read_state_dict(path, what: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Read a flat {name: tensor} dict from a ``.pth``/``.pt``/``.bin`` or ``.safetensors`` file.

    The format is read off the file's first bytes, not its name. Accepts the official flat state
    dicts and the VAR training checkpoint layout (``{'trainer': {'var_wo_ddp': …, 'vae_local': …}}`` —
    the transformer's is taken unless ``what`` mentions the VAE). Anything else (a file that is no
    checkpoint, truncated, or holds Python objects besides tensors) raises a ValueError naming the file.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{what} not found: {p} — put the file there or pass its path")
    if p.is_dir():
        raise ValueError(f"{what} {p} is a folder; pass the checkpoint file inside it "
                         f"(or load a converted folder with from_pretrained)")
    size = p.stat().st_size
    fmt = _file_format(p)
    if fmt == "empty":
        raise ValueError(f"{what} {p} is empty (0 bytes): truncated or corrupt — the download or copy did not "
                         f"finish; fetch it again")
    if fmt == "lfs":
        raise _lfs_error(p, what)
    if fmt is None and p.suffix == ".safetensors":
        safetensors_shapes(p, what)                  # raises: not a safetensors file
    if fmt is None:
        raise ValueError(f"{what} {p} ({size:,} bytes) is not a checkpoint: it is neither a PyTorch file (zip or "
                         f"pickle) nor safetensors — the wrong file, or truncated or corrupt; download it again")
    if fmt == "safetensors":
        safetensors_shapes(p, what)                  # names a truncated or damaged file
        from safetensors.torch import load_file
        try:
            return dict(load_file(str(p)))
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"{what} {p} is not a readable safetensors file ({str(e).splitlines()[0][:200]}); "
                             f"re-download or re-convert it") from e
    try:
        with warnings.catch_warnings():              # torch's "file an issue" note on pickle protocols > 2
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            obj = torch.load(str(p), map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(p))
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        if found is None:                            # not a Python object refused: the pickle itself is broken
            raise ValueError(f"{what} {p} ({size:,} bytes) could not be read: its data is not a valid PyTorch "
                             f"checkpoint — truncated or corrupt; download it again") from None
        raise ValueError(f"{what} {p} is not a plain state dict of tensors: it holds Python objects "
                         f"({found.group(1)}), which this loader never runs. Re-save it as "
                         f"torch.save(model.state_dict(), path) or convert it to safetensors") from None
    except (RuntimeError, EOFError, OSError, ValueError, IndexError, KeyError) as e:
        raise ValueError(f"{what} {p} ({size:,} bytes) could not be read — truncated or corrupt? "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else 'unexpected end'}). "
                         f"Download it again") from None
    if isinstance(obj, Mapping) and "trainer" in obj and isinstance(obj["trainer"], Mapping):
        inner = "vae_local" if "vae" in what.lower() else "var_wo_ddp"
        if inner in obj["trainer"]:
            obj = obj["trainer"][inner]
    if isinstance(obj, Mapping) and set(obj.keys()) == {"vae"}:
        obj = obj["vae"]
    if not isinstance(obj, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                               for k, v in obj.items()):
        kind = type(obj).__name__
        raise ValueError(f"{what} {p} holds a {kind}, not a state dict of tensors; expected the official "
                         f"checkpoint (a flat dict of tensors saved with torch.save)")
    sd = dict(obj)
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


def detect_family(sd: Mapping[str, torch.Tensor]) -> str:
    """'var' (class-conditional VAR transformer), 'var-vqvae' (its tokenizer), 'flexvar' (FlexVAR's
    transformer: VAR's keys without a level embedding), 'flexvar-vq' (its LlamaGen VQ-16) or 'unknown'."""
    if "class_emb.weight" in sd and "pos_1LC" in sd and any(k.startswith("blocks.") for k in sd):
        return "var" if "lvl_embed.weight" in sd else "flexvar"
    if "quantize.embedding.weight" in sd and "encoder.conv_in.weight" in sd and "decoder.conv_out.weight" in sd:
        return "flexvar-vq" if any(k.startswith("encoder.conv_blocks.") for k in sd) else "var-vqvae"
    return "unknown"


# What each family's file is, and where it goes (the Python call, then the CLI flag).
_FAMILY_NAMES = {
    "var": "a VAR transformer (class-conditional, var_d*.pth)",
    "var-vqvae": "the VAR VQVAE (vae_ch160v4096z32.pth)",
    "infinity": "an Infinity transformer (text-to-image, infinity_*.pth)",
    "infinity-vae": "an Infinity VAE (infinity_vae_*.pth)",
    "flexvar": "a FlexVAR transformer (FlexVARd*.pth)",
    "flexvar-vq": "FlexVAR's tokenizer (FlexVAE.pth)",
}
_FAMILY_USE = {
    "var": "load it with VARPipeline.from_single_file(var_ckpt, vae_ckpt) (CLI: --var-ckpt)",
    "var-vqvae": "pass it as VARPipeline.from_single_file's vae_ckpt (CLI: --vae-ckpt, with --var-ckpt)",
    "infinity": "load it with InfinityPipeline.from_single_file(transformer_ckpt, vae_ckpt, text_encoder) "
                "(CLI: generate --model FILE --vae-ckpt infinity_vae_*.pth --text-encoder FOLDER --prompt TEXT)",
    "infinity-vae": "pass it as InfinityPipeline.from_single_file's vae_ckpt (CLI: --vae-ckpt, with an Infinity "
                    "--model and --text-encoder)",
    "flexvar": "load it with FlexVARPipeline.from_single_file(transformer_ckpt, vae_ckpt)",
    "flexvar-vq": "pass it as FlexVARPipeline.from_single_file's vae_ckpt",
}


def _any_family(sd) -> str:
    found = detect_family(sd)
    return found if found != "unknown" else detect_infinity_family(sd)


def _expect_family(sd, family: str, path, what: str) -> None:
    found = _any_family(sd)
    if found == family:
        return
    if {found, family} == {"var", "var-vqvae"}:
        raise ValueError(f"{path} is {_FAMILY_NAMES[found]}, but it was passed as the {what}; "
                         f"pass it as the {'VAE' if found == 'var-vqvae' else 'transformer'} file instead")
    if found in _FAMILY_USE:
        raise ValueError(f"{path} is {_FAMILY_NAMES[found]}, not {_FAMILY_NAMES[family]}: {_FAMILY_USE[found]}")
    raise ValueError(f"{path} is not {_FAMILY_NAMES[family]}: none of its {len(sd)} keys look like one "
                     f"(first keys: {_short(list(sd)[:6])})")


def var_config_from_state_dict(sd: Mapping[str, torch.Tensor], patch_nums: Optional[Sequence[int]] = None,
                               source: str = "checkpoint") -> dict:
    """Constructor arguments of :class:`VARTransformer` inferred from official keys and shapes."""
    try:
        C = sd["word_embed.weight"].shape[0]
        depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
        heads = sd["blocks.0.attn.scale_mul_1H11"].shape[1]
        hidden = sd["blocks.0.ffn.fc1.weight"].shape[0]
        L, S = sd["pos_1LC"].shape[1], sd["lvl_embed.weight"].shape[0]
        cfg = dict(vocab_size=sd["head.weight"].shape[0], z_channels=sd["word_embed.weight"].shape[1],
                   num_classes=sd["class_emb.weight"].shape[0] - 1, depth=depth, embed_dim=C, num_heads=heads,
                   mlp_ratio=hidden / C, norm_eps=1e-6, shared_aln="shared_ada_lin.1.weight" in sd)
    except KeyError as e:
        raise ValueError(f"{source}: missing key {e.args[0]!r} needed to infer the VAR configuration; "
                         f"is this an official var_d*.pth file?") from None
    if patch_nums is not None:
        pn = tuple(int(p) for p in patch_nums)
        if sum(p * p for p in pn) != L or len(pn) != S:
            raise ValueError(f"{source}: patch_nums={list(pn)} gives {sum(p * p for p in pn)} tokens in {len(pn)} "
                             f"scales, but the checkpoint's pos_1LC/lvl_embed hold {L} tokens in {S} scales")
    else:
        matches = [pn for pn in VAR_SCHEDULES.values() if sum(p * p for p in pn) == L and len(pn) == S]
        if not matches:
            options = "; ".join(f"{16 * pn[-1]} px: {sum(p * p for p in pn)} tokens in {len(pn)} scales"
                                for pn in VAR_SCHEDULES.values())
            raise ValueError(f"{source}: depth {depth}, {L} tokens in {S} scales matches no known VAR patch "
                             f"schedule ({options}); pass patch_nums=[…] with the schedule it was trained on")
        pn = matches[0]
    cfg["patch_nums"] = list(pn)
    return cfg


def check_finite(model: torch.nn.Module, path, what: str) -> None:
    """Refuse a model whose floating-point parameters hold NaN or infinity (a damaged or badly converted
    file generates a garbage image otherwise). Buffers are not checked: masks legitimately hold -inf."""
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.device.type != "meta" and not bool(torch.isfinite(param).all()):
            bad = int((~torch.isfinite(param)).sum())
            raise ValueError(f"{what} {path}: {name} holds {bad:,} NaN or infinite values of {param.numel():,}; "
                             f"the file is damaged or was converted from a diverged model — re-download or "
                             f"re-convert it")


def _load_into(model_cls, cfg: dict, sd: dict, path, what: str):
    from accelerate import init_empty_weights

    with init_empty_weights():                       # parameters on meta, buffers real
        model = model_cls(**cfg)
    expected = set(model.state_dict().keys())
    present = set(sd.keys())
    missing, unexpected = expected - present, present - expected
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} keys ({_short(missing)})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} keys ({_short(unexpected)})")
        raise ValueError(f"{what} {path} does not match the architecture inferred from it "
                         f"({cfg}): {'; '.join(parts)}. The file may be from another model or damaged")
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{what} {path}: tensor shapes do not fit the inferred architecture ({cfg}): "
                         f"{str(e).splitlines()[-1].strip()[:300]}") from None
    check_finite(model, path, what)
    return model.eval().requires_grad_(False)


def load_var_transformer(path, patch_nums: Optional[Sequence[int]] = None,
                         dtype: torch.dtype = torch.float32) -> VARTransformer:
    """Load an official ``var_d{16,20,24,30,36}.pth`` (or a fine-tune in the same layout)."""
    dtype = resolve_dtype(dtype, "dtype")
    sd = read_state_dict(path, "VAR transformer checkpoint")
    _expect_family(sd, "var", path, "VAR transformer checkpoint")
    for k in list(sd):
        if k in _VAR_DERIVED:
            del sd[k]
        elif k.endswith(_VAR_DERIVED_SUFFIX):
            if torch.count_nonzero(sd[k]).item():
                raise ValueError(f"{path}: {k} must be zero (the key bias is fixed at 0); the file is not an "
                                 f"official VAR checkpoint")
            del sd[k]
    cfg = var_config_from_state_dict(sd, patch_nums, source=str(path))
    model = _load_into(VARTransformer, cfg, sd, path, "VAR transformer checkpoint")
    return torch.nn.Module.to(model, dtype)   # (ModelMixin.to warns spuriously on any dtype)


def load_var_vqvae(path, patch_nums: Optional[Sequence[int]] = None,
                   dtype: torch.dtype = torch.float32) -> MultiScaleVQVAE:
    """Load the official ``vae_ch160v4096z32.pth`` (or a VQVAE in the same layout)."""
    dtype = resolve_dtype(dtype, "vae_dtype")
    sd = read_state_dict(path, "VQVAE checkpoint")
    _expect_family(sd, "var-vqvae", path, "VQVAE checkpoint")
    for k in MultiScaleVQVAE.official_extra_keys():   # training statistics
        sd.pop(k, None)
    try:
        cfg = MultiScaleVQVAE.config_from_state_dict(sd, patch_nums=patch_nums)
    except ValueError as e:
        raise ValueError(f"VQVAE checkpoint {path}: {e}") from None
    model = _load_into(MultiScaleVQVAE, cfg, sd, path, "VQVAE checkpoint")
    return torch.nn.Module.to(model, dtype)   # (ModelMixin.to warns spuriously on any dtype)


def describe_checkpoint(path) -> dict:
    """What a file or a folder is, for ``sparsevar info``: family, configuration, parameter count.

    Covers every family: official VAR and Infinity files, Infinity shard folders, and converted
    pipeline folders (whose weights may be safetensors, sharded or ``.bin``; each component is
    checked like :func:`check_component_folder` does before a load, so a folder that would not load
    raises the same one-line error here). A file of no known family is described as 'unknown'."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p} not found — pass the path of a checkpoint file or a model folder")
    if p.is_dir():
        if (p / "model_index.json").exists():
            return _describe_pipeline_folder(p)
        hart = hart_folders(p)
        if hart is not None:
            return _describe_hart(*hart)
        if any(p.glob("*.index.json")) or any(p.glob("*.safetensors")) or any(p.glob("*.pth")) \
                or any(p.glob("*.bin")):
            return describe_infinity_checkpoint(p)      # a shard folder (the 8B release)
        raise ValueError(f"{p} is a folder without model_index.json; pass a checkpoint file or a folder "
                         f"written by `sparsevar convert` / save_pretrained")
    sd = _read_nested(p, "checkpoint", [("trainer", "gpt_fsdp"), ("gpt_fsdp",), ("vae",), ("model",),
                                        ("state_dict",)])
    family = _any_family(sd)
    if family in ("infinity", "infinity-vae"):
        return _describe_infinity(p, sd)
    n_params = sum(v.numel() for k, v in sd.items()
                   if k not in _VAR_DERIVED and not k.endswith(_VAR_DERIVED_SUFFIX)
                   and k not in MultiScaleVQVAE.official_extra_keys())
    info = {"path": str(p), "family": family, "parameters": n_params,
            "dtype": str(next(iter(sd.values())).dtype).replace("torch.", "") if sd else None}
    if family == "var":
        cfg = var_config_from_state_dict(sd, source=str(p))
        info.update(cfg)
        info["resolution"] = 16 * cfg["patch_nums"][-1]
        info["tokens"] = sum(q * q for q in cfg["patch_nums"])
    elif family == "var-vqvae":
        info.update(MultiScaleVQVAE.config_from_state_dict(
            {k: v for k, v in sd.items() if k not in MultiScaleVQVAE.official_extra_keys()}))
    return info


def _describe_pipeline_folder(p: Path) -> dict:
    pipeline = pipeline_class_name(read_json_file(p / "model_index.json", "pipeline folder"))
    if pipeline in _PIPELINE_USE:                    # the checks a load makes: every component present and agreeing
        check_pipeline_folder(p, pipeline, pipeline_components(pipeline), "")
    info = {"path": str(p), "kind": "pipeline folder", "pipeline": pipeline,
            "family": {"VARPipeline": "var", "InfinityPipeline": "infinity", "HARTPipeline": "hart",
                       "FlexVARPipeline": "flexvar"}.get(pipeline, "unknown"),
            "parameters": 0}
    for sub in ("transformer", "vqvae", "vae"):
        if not (p / sub).is_dir():
            continue
        config = read_json_file(p / sub / "config.json", f"{sub} folder")
        info[sub] = {k: v for k, v in config.items() if not k.startswith("_")}
        files, shapes = component_weight_shapes(p / sub)
        info["parameters"] += sum(math.prod(s) for s in shapes.values())
        info.setdefault("weights", []).extend(str(f.relative_to(p)) for f in files)
    return info


# ---- Infinity (transformer .pth / shard folders, BSQ-VAE .pth) --------------------------------------------
# Buffers of the official Infinity files that are derived, not learned: regenerated (or zero) on our side.
_INFINITY_DERIVED = ("lvl_1L", "attn_bias_for_masking", "Infinity_visible_kvlen", "Infinity_invisible_qlen")
_INFINITY_ZERO_SUFFIX = ".zero_k_bias"
_INFINITY_TEXT_MAXLEN = 512


def detect_infinity_family(sd: Mapping[str, torch.Tensor]) -> str:
    """'infinity' (the transformer), 'infinity-vae' (its BSQ-VAE) or 'unknown'."""
    if "cfg_uncond" in sd and "text_norm.weight" in sd and "word_embed.weight" in sd:
        return "infinity"
    keys = set(sd)
    if any(k.startswith("encoder.conv_in.") for k in keys) and any(k.startswith("decoder.conv_out.") for k in keys) \
            and any(".lfq." in k or k.startswith("encoder.conv_in.conv.") for k in keys):
        return "infinity-vae"
    return "unknown"


def _read_nested(path, what: str, inner: Sequence[Sequence[str]]) -> dict[str, torch.Tensor]:
    """read_state_dict, or, for containers it does not unwrap, the first ``inner`` key path that holds a
    state dict (e.g. ('vae',) of an Infinity VAE file with an 'ema' entry, ('trainer', 'gpt_fsdp'))."""
    try:
        return read_state_dict(path, what)
    except ValueError as first:
        if "not a state dict of tensors" not in str(first):
            raise
        obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
        for keys in inner:
            cur = obj
            for k in keys:
                cur = cur.get(k) if isinstance(cur, Mapping) else None
            if isinstance(cur, Mapping) and cur and all(isinstance(v, torch.Tensor) for v in cur.values()):
                sd = dict(cur)
                if all(k.startswith("module.") for k in sd):
                    sd = {k[len("module."):]: v for k, v in sd.items()}
                return sd
        raise


def _shard_names(index: Path, weight_map: dict, fix: str) -> list[str]:
    """The shard file names a ``weight_map`` lists, each a plain name beside ``index`` (never a path
    that leads out of its folder); else a ValueError naming the index and the entry."""
    names = sorted({str(f) for f in weight_map.values()})
    odd = [f for f in weight_map.values() if not isinstance(f, str) or Path(f).name != f or f in ("", ".", "..")]
    if odd:
        raise ValueError(f"{index} lists the shard {odd[0]!r}, which is not a file name in {index.parent}: an index "
                         f"names its shards, which lie beside it; {fix}")
    return names


def _read_sharded(folder: Path, what: str) -> dict[str, torch.Tensor]:
    """A Hugging Face style shard folder (``*.index.json`` + shards), like the 8B release, as one state
    dict. Not transformers' ``load_sharded_checkpoint`` / accelerate's ``load_checkpoint_in_model``
    (which the reference uses): those load into a model by the file's key names, and the official keys
    are first mapped, checked and stripped of derived buffers here (``_canonical_infinity_keys``);
    each shard is read by ``read_state_dict`` (safetensors, or ``torch.load(weights_only=True)``)."""
    indexes = sorted(folder.glob("*.index.json"))
    if not indexes:
        singles = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pth"))
        if len(singles) == 1:
            return read_state_dict(singles[0], what)
        raise ValueError(f"{what} {folder} is a folder without a shard index (*.index.json); pass the checkpoint "
                         f"file, or the folder of the sharded release (index json + shards)")
    weight_map = read_json_file(indexes[0], "shard index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{indexes[0]} has no weight_map (the name → shard table); copy the release's index file "
                         f"again")
    sd: dict[str, torch.Tensor] = {}
    for shard in _shard_names(indexes[0], weight_map, "copy the release's index file again"):
        part = folder / shard
        if not part.exists():
            raise FileNotFoundError(f"{what}: shard {part} listed in {indexes[0].name} is missing — copy every shard "
                                    f"of the release into {folder}")
        sd.update(read_state_dict(part, what))
    return sd


def _canonical_infinity_keys(sd: dict, path) -> dict:
    """Official aliases → our names: flat ``blocks.{i}`` (block_chunks=1 checkpoints) → chunk 0; derived
    buffers dropped; zero key biases checked; a (1, 1, H, 1) ``scale_mul_1H11`` (flash-attn layout)
    reshaped to (1, H, 1, 1)."""
    out = {}
    for k, v in sd.items():
        if k in _INFINITY_DERIVED:
            continue
        if k.endswith(_INFINITY_ZERO_SUFFIX):
            if torch.count_nonzero(v).item():
                raise ValueError(f"{path}: {k} must be zero (the key bias is fixed at 0); the file is not an "
                                 f"official Infinity checkpoint")
            continue
        if k.startswith("blocks."):
            i, rest = k[len("blocks."):].split(".", 1)
            k = f"block_chunks.0.module.{i}.{rest}"
        if k.endswith("sa.scale_mul_1H11") and v.ndim == 4 and v.shape[1] == 1:
            v = v.reshape(1, -1, 1, 1)
        out[k] = v
    return out


def infinity_config_from_state_dict(sd: Mapping[str, torch.Tensor], source: str = "checkpoint") -> dict:
    """Constructor arguments of :class:`InfinityTransformer` inferred from official keys and shapes."""
    from .infinity import text_pool_heads
    try:
        C, token_dim = sd["word_embed.weight"].shape
        blocks = {tuple(k.split(".")[1:4:2]) for k in sd if k.startswith("block_chunks.")}
        chunks = {c for c, _ in blocks}
        heads = sd["block_chunks.0.module.0.sa.scale_mul_1H11"].numel()
        hidden = sd["block_chunks.0.module.0.ffn.fc1.weight"].shape[0]
        Ct5 = sd["text_norm.weight"].shape[0]
        pool_q = sd["text_proj_for_sos.ca.mat_q"].shape
        cfg = dict(token_dim=int(token_dim), depth=len(blocks), embed_dim=int(C), num_heads=int(heads),
                   mlp_ratio=hidden / C, norm_eps=1e-6, text_channels=int(Ct5), text_maxlen=_INFINITY_TEXT_MAXLEN,
                   num_block_chunks=len(chunks), num_levels=int(sd["lvl_embed.weight"].shape[0]))
    except KeyError as e:
        raise ValueError(f"{source}: missing key {e.args[0]!r} needed to infer the Infinity configuration; is this an "
                         f"official Infinity transformer checkpoint (infinity_2b_reg.pth, the 8B shards)?") from None
    if cfg["depth"] % cfg["num_block_chunks"]:
        raise ValueError(f"{source}: {cfg['depth']} blocks do not split evenly into {cfg['num_block_chunks']} chunks")
    hp = text_pool_heads(cfg["text_channels"], cfg["embed_dim"])
    if tuple(pool_q) != (1, hp, cfg["embed_dim"] // hp):
        raise ValueError(f"{source}: text_proj_for_sos.ca.mat_q has shape {tuple(pool_q)}, but a width-{C} model with "
                         f"{Ct5}-channel text has a {hp}-head pool (1, {hp}, {cfg['embed_dim'] // hp})")
    return cfg


def load_infinity_transformer(path, dtype: torch.dtype = torch.float32):
    """Load an official Infinity transformer: ``infinity_2b_reg.pth`` (flat state dict), the 8B shard
    folder, a training checkpoint (``['trainer']['gpt_fsdp']``) or a safetensors file of the same keys.

    ``dtype`` is the blocks' dtype; embeddings, text projections, AdaLN and the head stay float32
    (the reference's bf16 mode). The key set is validated: missing or unexpected keys are named.
    """
    from .infinity.transformer import InfinityTransformer, _official_uncond_rows

    dtype = resolve_dtype(dtype, "dtype")
    what = "Infinity transformer checkpoint"
    p = Path(path)
    if p.is_dir():
        sd = _read_sharded(p, what)
    else:
        sd = _read_nested(p, what, [("trainer", "gpt_fsdp"), ("gpt_fsdp",), ("model",), ("state_dict",)])
    family = _any_family(sd)
    if family != "infinity":
        hint = {"infinity-vae": f"it is the Infinity VAE (infinity_vae_*.pth): {_FAMILY_USE['infinity-vae']}"}.get(
            family, f"it is {_FAMILY_NAMES[family]}: {_FAMILY_USE[family]}" if family in _FAMILY_USE else
            f"none of its {len(sd)} keys look like one (first keys: {_short(list(sd)[:6])})")
        raise ValueError(f"{p} is not an Infinity transformer checkpoint: {hint}")
    sd = _canonical_infinity_keys(sd, p)
    cfg = infinity_config_from_state_dict(sd, source=str(p))
    rows = sd["cfg_uncond"].shape[0]
    if rows != _INFINITY_TEXT_MAXLEN:        # the reference loader trims / pads with its constructor's rows
        table = sd["cfg_uncond"].float()
        fill = _official_uncond_rows(_INFINITY_TEXT_MAXLEN, cfg["text_channels"])
        sd["cfg_uncond"] = torch.cat((table, fill[rows:]))[:_INFINITY_TEXT_MAXLEN].to(sd["cfg_uncond"].dtype)
    model = _load_into(InfinityTransformer, cfg, sd, p, what)
    return model.set_block_dtype(dtype)


def _canonical_vae_keys(sd: Mapping[str, torch.Tensor], expected: Optional[set] = None) -> dict:
    """Official VAE keys with the un-wrapped aliases the reference loader also accepts
    (``x.weight`` → ``x.conv.weight``, ``norm1.weight`` → ``norm1.norm.weight``), resolved against the
    ``expected`` key set like the reference (a key that exists is kept as is); without it, a guess good
    enough to infer the configuration. The quantiser's ``lfq.mask`` buffers (powers of two, unused for
    bit labels) are dropped."""
    out = {}
    for k, v in sd.items():
        if ".lfq." in k or k.startswith(("quantizer.", "quantize.")):
            continue
        parent, leaf = k.rsplit(".", 1)
        if expected is not None:
            if k not in expected and leaf in ("weight", "bias"):
                for wrap in (".conv", ".norm"):
                    if f"{parent}{wrap}.{leaf}" in expected:
                        k = f"{parent}{wrap}.{leaf}"
                        break
        else:
            last = parent.rsplit(".", 1)[-1]
            if leaf in ("weight", "bias") and last not in ("conv", "norm"):
                k = f"{parent}{'.norm' if 'norm' in last else '.conv'}.{leaf}"
        out[k] = v
    return out


def load_infinity_vae(path, dtype: torch.dtype = torch.float32):
    """Load Infinity's BSQ-VAE: ``infinity_vae_d32reg.pth`` / ``infinity_vae_d32_reg.pth`` (the
    same file under the two names of the docs), ``infinity_vae_d56_f8_14_patchify.pth``, or a
    safetensors file of the same keys. The state dict is taken from the file's ``'vae'`` entry."""
    from .bsq_vae import BSQVAE

    dtype = resolve_dtype(dtype, "vae_dtype")
    what = "Infinity VAE checkpoint"
    p = Path(path)
    sd = _read_nested(p, what, [("vae",), ("state_dict",)])
    family = _any_family(sd)
    if family == "infinity":
        raise ValueError(f"{p} is an Infinity transformer checkpoint, but it was passed as the VAE; pass the "
                         f"infinity_vae_*.pth file as the VAE and this one as the transformer")
    if family in ("var", "var-vqvae"):
        raise ValueError(f"{p} is {_FAMILY_NAMES[family]}, not an Infinity VAE: {_FAMILY_USE[family]}")
    try:
        cfg = BSQVAE.config_from_state_dict(_canonical_vae_keys(sd), source=str(p))
    except ValueError as e:
        raise ValueError(f"{p} is not an Infinity BSQ-VAE checkpoint: {e}") from None
    from accelerate import init_empty_weights
    with init_empty_weights():
        expected = set(BSQVAE(**cfg).state_dict())
    model = _load_into(BSQVAE, cfg, _canonical_vae_keys(sd, expected), p, what)
    return torch.nn.Module.to(model, dtype)


def describe_infinity_checkpoint(path) -> dict:
    """What an Infinity file or shard folder is (for ``sparsevar info``): family, configuration, size.
    Raises ValueError for files of other families (``describe_checkpoint`` covers VAR)."""
    p = Path(path)
    sd = _read_sharded(p, "checkpoint") if p.is_dir() else _read_nested(p, "checkpoint", [("vae",), ("trainer", "gpt_fsdp")])
    return _describe_infinity(p, sd)


def _describe_infinity(p: Path, sd: dict) -> dict:
    family = detect_infinity_family(sd)
    info = {"path": str(p), "family": family,
            "dtype": str(next(iter(sd.values())).dtype).replace("torch.", "") if sd else None}
    if family == "infinity":
        sd = _canonical_infinity_keys(sd, p)
        info.update(infinity_config_from_state_dict(sd, source=str(p)))
        info["parameters"] = sum(v.numel() for v in sd.values())

    elif family == "infinity-vae":
        from .bsq_vae import BSQVAE
        sd = _canonical_vae_keys(sd)
        info.update(BSQVAE.config_from_state_dict(sd, source=str(p)))
        info["parameters"] = sum(v.numel() for v in sd.values())
    else:
        raise ValueError(f"{p} is neither an Infinity transformer nor its VAE")
    return info


def checkpoint_family(path) -> str:
    """The family of an official checkpoint from its key names alone: 'var', 'var-vqvae', 'flexvar',
    'flexvar-vq', 'infinity', 'infinity-vae' or 'unknown'. Reads no tensor data where the format allows it (a shard folder's
    index, safetensors headers, memory-mapped ``.pth`` zip files), so a multi-gigabyte file costs
    little to recognise before it is loaded."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {p} — put the file there or pass its path")
    indexes = sorted(p.glob("*.index.json")) if p.is_dir() else []
    if indexes:                                      # the same index _read_sharded reads
        keys = list(read_json_file(indexes[0], "shard index").get("weight_map") or {})
    elif p.is_dir():
        keys = list(_read_sharded(p, "checkpoint"))
    elif _file_format(p) == "safetensors":
        keys = list(safetensors_shapes(p, "checkpoint"))
    else:
        keys = list(_read_nested(p, "checkpoint", [("vae",), ("trainer", "gpt_fsdp"), ("gpt_fsdp",), ("model",),
                                                   ("trainer", "var_wo_ddp"), ("state_dict",)]))
    if keys and all(k.startswith("module.") for k in keys):
        keys = [k[len("module."):] for k in keys]
    names = dict.fromkeys(keys)
    family = detect_family(names)
    return family if family != "unknown" else detect_infinity_family(names)


# ---- converted folders (save_pretrained / `sparsevar convert`) ----------------------------------------------
# Weight file names as diffusers (our components) and transformers (the T5) write them: (safetensors, pickle).
_DIFFUSERS_WEIGHTS = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")
_TRANSFORMERS_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
# What loads each pipeline folder (the Python call, then the CLI).
_PIPELINE_USE = {
    "VARPipeline": "VARPipeline.from_pretrained (CLI: sparsevar generate --model FOLDER --class ID)",
    "InfinityPipeline": "InfinityPipeline.from_pretrained (CLI: sparsevar generate --model FOLDER --prompt TEXT)",
    "HARTPipeline": "HARTPipeline.from_pretrained (CLI: sparsevar generate --model FOLDER --prompt TEXT)",
    "FlexVARPipeline": "FlexVARPipeline.from_pretrained (CLI: sparsevar generate --model FOLDER --class ID)",
}
RECONVERT = "convert the model again (`sparsevar convert` or save_pretrained)"
# Where the official files can be fetched by hand (nothing is downloaded here): errors about a
# missing file name the address, and the shipped ComfyUI workflows carry them as model metadata.
_VAR_HUB = "https://huggingface.co/FoundationVision/var/resolve/main/"
_INFINITY_HUB = "https://huggingface.co/FoundationVision/Infinity/resolve/main/"
OFFICIAL_DOWNLOADS = {
    **{f"var_d{d}.pth": f"{_VAR_HUB}var_d{d}.pth" for d in (16, 20, 24, 30, 36)},
    "vae_ch160v4096z32.pth": f"{_VAR_HUB}vae_ch160v4096z32.pth",
    "infinity_2b_reg.pth": f"{_INFINITY_HUB}infinity_2b_reg.pth",
    "infinity_vae_d32reg.pth": f"{_INFINITY_HUB}infinity_vae_d32reg.pth",
}
# The module save_pretrained writes beside model_index.json, named there as ``_class_name`` =
# [module, class] (diffusers' form for a pipeline class defined beside the weights), so that
# diffusers' generic ``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)`` finds
# this package's class; it only imports the class from the installed package.
GENERIC_LOADER_MODULE = "sparsevar_pipeline"


def generic_loader_source(pipeline: str) -> str:
    """The text of ``GENERIC_LOADER_MODULE``.py for ``pipeline``."""
    return ('"""Lets diffusers\' DiffusionPipeline.from_pretrained(this folder, trust_remote_code=True) load it\n'
            'with the class of the installed sparsevar package; nothing else runs here."""\n'
            f"from sparsevar import {pipeline}  # noqa: F401\n")


def pipeline_class_name(index: dict):
    """The pipeline class a ``model_index.json`` names: its ``_class_name``, a class name or
    [module, class name] (the form save_pretrained writes); anything else is returned as it is."""
    named = index.get("_class_name")
    if isinstance(named, list) and len(named) == 2 and all(isinstance(v, str) for v in named):
        return named[1]
    return named


def read_json_file(path, what: str = "file") -> dict:
    """A JSON object from ``path``; a missing file, one that is not JSON, or JSON that is not an object
    raises FileNotFoundError / ValueError naming the file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p} is missing: the {what} is incomplete; {RECONVERT}")
    if p.stat().st_size == 0:
        raise ValueError(f"{p} is empty (0 bytes): the copy or conversion did not finish; {RECONVERT}")
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{p} is not a JSON text file (it holds binary data); {RECONVERT}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); fix the file or "
                         f"{RECONVERT}") from None
    if not isinstance(obj, dict):
        kind = {list: "list", str: "string", int: "number", float: "number", bool: "true/false", type(None): "null"}
        raise ValueError(f"{p} holds a JSON {kind.get(type(obj), type(obj).__name__)}, not an object of settings; "
                         f"{RECONVERT}")
    return obj


def variant_name(name: str, variant: Optional[str]) -> str:
    """diffusers' and transformers' file name of a weight ``variant``: ``model.safetensors`` →
    ``model.fp16.safetensors``, ``model.safetensors.index.json`` → ``model.safetensors.index.fp16.json``."""
    if not variant:
        return name
    stem, ext = name.rsplit(".", 1)
    return f"{stem}.{variant}.{ext}"


def component_weight_shapes(folder, names: Sequence[str] = _DIFFUSERS_WEIGHTS,
                            variant: Optional[str] = None) -> tuple[list[Path], dict]:
    """(files, {key: shape}) of a component folder's weights, in the order diffusers / transformers look for
    them: a safetensors shard index, the single safetensors file, a ``.bin`` shard index, the ``.bin`` file.
    ``names`` = (safetensors name, bin name); ``variant`` (e.g. "fp16") reads ``<name>.<variant>.<ext>``
    instead. Reads safetensors headers only (``.bin`` files are memory-mapped with the safe loader).
    Missing, truncated or unreadable files raise an error naming the file."""
    folder = Path(folder)
    if variant and not any((folder / variant_name(f, variant)).exists()
                           for n in names for f in (n, f"{n}.index.json")):
        plain = [n for n in names if (folder / n).exists() or (folder / f"{n}.index.json").exists()]
        if plain:
            raise FileNotFoundError(f"{folder} has no {variant!r} variant ({variant_name(names[0], variant)}); it holds "
                                    f"{plain[0]}: leave variant= out, or save the variant with "
                                    f"save_pretrained(..., variant={variant!r})")
    for name in names:
        index, single = folder / variant_name(f"{name}.index.json", variant), folder / variant_name(name, variant)
        if index.is_file():
            weight_map = read_json_file(index, "shard index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index} has no weight_map (the name → shard table); {RECONVERT}")
            files = [folder / f for f in _shard_names(index, weight_map, RECONVERT)]
            for f in files:
                if not f.is_file():
                    raise FileNotFoundError(f"shard {f} listed in {index.name} is missing; copy every shard into "
                                            f"{folder}, or {RECONVERT}")
            break
        if single.exists():
            if not single.is_file():
                raise ValueError(f"{single} is a folder, not a weight file; {RECONVERT}")
            files = [single]
            break
    else:
        raise FileNotFoundError(f"{folder / names[0]} is missing: {folder} holds no weights (the folder is "
                                f"incomplete); {RECONVERT}")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        dtypes: dict[str, str] = {}
        if f.name.endswith(".safetensors"):
            shapes.update(safetensors_shapes(f, "weight file", dtypes))
        else:
            sd = read_state_dict(f, "weight file")
            shapes.update({k: tuple(v.shape) for k, v in sd.items()})
            dtypes = {k: str(v.dtype) for k, v in sd.items() if not v.is_floating_point()}
        # every tensor of these models is floating point: integers would be cast to garbage weights
        ints = sorted(k for k, d in dtypes.items() if not d.upper().startswith(("F", "BF", "TORCH.FLOAT",
                                                                               "TORCH.BFLOAT", "TORCH.HALF")))
        if ints:
            raise ValueError(f"{f} holds {dtypes[ints[0]]} integers in {ints[0]}"
                             f"{f' (and {len(ints) - 1} more tensors)' if len(ints) > 1 else ''}, where the model "
                             f"has floating-point weights: the file was not written by save_pretrained; {RECONVERT}")
    return files, shapes


def _default(cls, name: str):
    return inspect.signature(cls.__init__).parameters[name].default


def _init_kwargs(cls, config: dict, cfg_path: Path, weights_say) -> dict:
    """The constructor arguments ``config`` sets, each checked against the type of its default
    (an int field takes an int, a float field a finite number, a flag true/false, a list a list of numbers)."""
    params = inspect.signature(cls.__init__).parameters
    kwargs = {}
    for name, value in config.items():
        if name.startswith("_") or name not in params:
            continue
        default = params[name].default
        if isinstance(default, bool):
            ok, need = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            ok, need = isinstance(value, int) and not isinstance(value, bool), "an integer"
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            need = "a finite number"
        elif isinstance(default, (tuple, list)):
            elem = int if all(isinstance(d, int) for d in default) else (int, float)
            ok = isinstance(value, list) and len(value) > 0 and all(
                isinstance(v, elem) and not isinstance(v, bool) for v in value)
            need = "a non-empty list of integers" if elem is int else "a non-empty list of numbers"
        else:
            ok, need = True, ""
        if not ok:
            said = weights_say(name)
            fix = f"set \"{name}\": {json.dumps(said)}" if said is not None else f"fix it or {RECONVERT}"
            raise ValueError(f"{cfg_path}: \"{name}\": {json.dumps(value)} is not {need}; {fix}")
        kwargs[name] = value
    return kwargs


def _meta_sd(shapes: Mapping[str, tuple]) -> dict[str, torch.Tensor]:
    return {k: torch.empty(s, device="meta") for k, s in shapes.items()}


def _config_from_weights(cls, shapes: Mapping[str, tuple], config: dict, source: str) -> dict:
    """The shape-determining constructor arguments of ``cls`` that weights of these shapes imply."""
    sd = _meta_sd(shapes)
    name = cls.__name__
    if name == "VARTransformer":
        try:
            cfg = var_config_from_state_dict(sd, source=source)
        except ValueError:                           # an unlisted patch schedule: check the config's own
            cfg = var_config_from_state_dict(sd, patch_nums=config.get("patch_nums"), source=source)
    elif name == "MultiScaleVQVAE":
        cfg = MultiScaleVQVAE.config_from_state_dict(sd)
    elif name == "InfinityTransformer":
        cfg = infinity_config_from_state_dict(sd, source=source)
        if "cfg_uncond" in shapes:
            cfg["text_maxlen"] = shapes["cfg_uncond"][0]
    elif name == "BSQVAE":
        from .bsq_vae import BSQVAE
        cfg = BSQVAE.config_from_state_dict(sd, source=source)
    else:
        return {}
    cfg.pop("norm_eps", None)                        # shapes no tensor
    return cfg


def _differs(configured, inferred) -> bool:
    if isinstance(inferred, bool) or isinstance(configured, bool):
        return configured != inferred
    if isinstance(inferred, float) and isinstance(configured, (int, float)):
        return not math.isclose(configured, inferred, rel_tol=1e-3)
    if isinstance(inferred, (list, tuple)) and isinstance(configured, (list, tuple)):
        return [*configured] != [*inferred]
    return configured != inferred


def _shape_mismatch(expected: Mapping[str, tuple], found: Mapping[str, tuple]) -> str:
    missing = set(expected) - set(found)
    unexpected = set(found) - set(expected)
    shaped = sorted(k for k in set(expected) & set(found) if tuple(expected[k]) != tuple(found[k]))
    parts = []
    if shaped:
        k = shaped[0]
        parts.append(f"{k} is {tuple(found[k])} in the weights, {tuple(expected[k])} by the config"
                     + (f" (and {len(shaped) - 1} more tensors differ)" if len(shaped) > 1 else ""))
    if missing:
        parts.append(f"the weights lack {len(missing)} tensors the config builds ({_short(missing, 3)})")
    if unexpected:
        parts.append(f"the weights hold {len(unexpected)} tensors the config does not build ({_short(unexpected, 3)})")
    return "; ".join(parts)


def check_component_folder(folder, cls, names: Sequence[str] = _DIFFUSERS_WEIGHTS,
                           variant: Optional[str] = None) -> list[Path]:
    """Check a diffusers component folder (``config.json`` + weights) before it is loaded: the config is
    a JSON object naming ``cls``, its fields have the right types, the weight files are whole, and the
    model the config builds (on the meta device) has exactly the tensors, of exactly the shapes, that
    the weights hold. A disagreement raises a ValueError naming the file, the field, its value and what
    the weights say. ``variant``: read that weight variant's files. Returns the weight files."""
    from accelerate import init_empty_weights

    folder = Path(folder)
    cfg_path = folder / "config.json"
    config = read_json_file(cfg_path, f"{cls.__name__} folder {folder}")
    named = config.get("_class_name")
    if named is not None and named != cls.__name__:
        raise ValueError(f"{cfg_path} describes a {named!r}, but {folder.name}/ must hold a {cls.__name__}: the "
                         f"folder's parts are mixed up; {RECONVERT}")
    files, shapes = component_weight_shapes(folder, names, variant)
    weights = files[0] if len(files) == 1 else f"the {len(files)} weight shards in {folder}"
    source = "the weights"
    inferred: Optional[dict] = None

    def weights_say(field: str):
        nonlocal inferred
        if inferred is None:
            try:
                inferred = _config_from_weights(cls, shapes, {k: v for k, v in config.items()
                                                              if k != "patch_nums" or isinstance(v, list)}, source)
            except ValueError:
                inferred = {}
        value = inferred.get(field)
        return list(value) if isinstance(value, tuple) else value

    kwargs = _init_kwargs(cls, config, cfg_path, weights_say)
    try:                                             # first what the weights imply, which builds nothing
        implied = _config_from_weights(cls, shapes, kwargs, source)
    except ValueError:
        implied = None
    if implied:
        _refuse_differences(cls, cfg_path, weights, kwargs, implied)
    try:
        with init_empty_weights():
            model = cls(**kwargs)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        del model
        build_error = None
    except Exception as e:  # a constructor refusing the settings, in any of the ways torch / our checks do
        expected, build_error = None, e
    if expected is not None and expected == shapes:
        return files
    try:
        implied = _config_from_weights(cls, shapes, kwargs, source)
    except ValueError as e:                          # the weights are not a cls at all, or the schedule disagrees
        if expected is not None or "patch_nums" in str(e):
            raise ValueError(f"{cfg_path} does not match {weights}: {e}") from None
        implied = {}
    _refuse_differences(cls, cfg_path, weights, kwargs, implied)
    if build_error is not None:
        raise ValueError(f"{cfg_path}: these settings do not build a {cls.__name__} "
                         f"({type(build_error).__name__}: {str(build_error).splitlines()[0][:200] if str(build_error) else ''}); "
                         f"fix the file or {RECONVERT}")
    raise ValueError(f"{cfg_path} does not match {weights}: {_shape_mismatch(expected, shapes)}; {RECONVERT}")


def _refuse_differences(cls, cfg_path: Path, weights, kwargs: dict, implied: dict) -> None:
    """A ValueError naming each field of ``kwargs`` (the config, defaults filled in) that differs from
    what the weights imply, with the value to set; nothing when they agree."""
    diffs = [(k, kwargs.get(k, _default(cls, k)), v) for k, v in implied.items()
             if _differs(kwargs.get(k, _default(cls, k)), v)]
    if diffs:
        said = ", ".join(f"{k} = {json.dumps(list(v) if isinstance(v, tuple) else v)}" for k, _, v in diffs)
        have = ", ".join(f"{k} = {json.dumps(list(c) if isinstance(c, tuple) else c)}"
                         + ("" if k in kwargs else " (the default; the file does not set it)") for k, c, _ in diffs)
        fix = ", ".join(f"\"{k}\": {json.dumps(list(v) if isinstance(v, tuple) else v)}" for k, _, v in diffs)
        raise ValueError(f"{cfg_path} says {have}, but the weights in {weights} are for {said}; set {fix} in "
                         f"config.json, or {RECONVERT}")


def _t5_config_from_weights(shapes: Mapping[str, tuple]) -> dict:
    """d_model, vocab_size, num_layers, d_ff and num_heads of T5 encoder weights of these shapes."""
    cfg = {}
    emb = shapes.get("shared.weight") or shapes.get("encoder.embed_tokens.weight")
    if emb is not None and len(emb) == 2:
        cfg["vocab_size"], cfg["d_model"] = emb
    blocks = {k.split(".")[2] for k in shapes if k.startswith("encoder.block.")}
    if blocks:
        cfg["num_layers"] = len(blocks)
    rel = shapes.get("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    if rel is not None and len(rel) == 2:
        cfg["num_heads"] = rel[1]
    ff = shapes.get("encoder.block.0.layer.1.DenseReluDense.wo.weight")
    if ff is not None and len(ff) == 2:
        cfg["d_ff"] = ff[1]
    return cfg


def check_saved_text_encoder(folder, fix: str = RECONVERT, variant: Optional[str] = None) -> dict:
    """Check a saved T5 encoder folder (``config.json`` + weights) before it is loaded: the JSON parses,
    the weights are whole, and the encoder its config builds (on the meta device) holds the tensors of
    the weights (the shared token embedding may be stored once; a full T5's decoder and LM head, which
    the encoder leaves out, are ignored). ``fix`` ends each message (what to do instead). Returns the config."""
    from accelerate import init_empty_weights
    from transformers import T5Config, T5EncoderModel

    folder = Path(folder)
    cfg_path = folder / "config.json"
    config = read_json_file(cfg_path, f"text encoder folder {folder}")
    files, shapes = component_weight_shapes(folder, _TRANSFORMERS_WEIGHTS, variant)
    weights = files[0] if len(files) == 1 else f"the {len(files)} weight shards in {folder}"
    _refuse_t5_differences(cfg_path, weights, config, _t5_config_from_weights(shapes), True, fix)
    try:
        with init_empty_weights():
            model = T5EncoderModel(T5Config.from_dict(config))
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        del model
    except Exception as e:  # transformers refusing the settings
        raise ValueError(f"{cfg_path}: these settings do not build a T5 encoder ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else ''}); fix the file, or {fix}") from None
    tied = {"shared.weight", "encoder.embed_tokens.weight"}
    found = {k: v for k, v in shapes.items() if not k.startswith(("decoder.", "lm_head."))}
    bad = any(tuple(expected[k]) != tuple(v) for k, v in found.items() if k in expected) \
        or set(found) - set(expected) or (set(expected) - set(found)) - tied or not (tied & set(found))
    if not bad:
        return config
    _refuse_t5_differences(cfg_path, weights, config, _t5_config_from_weights(shapes), False, fix)
    raise ValueError(f"{cfg_path} does not match {weights}: {_shape_mismatch(expected, found)}; {fix}")


def _refuse_t5_differences(cfg_path: Path, weights, config: dict, implied: dict, only_set: bool,
                           fix_tail: str) -> None:
    """A ValueError naming each T5 field of ``config`` that differs from what the weights imply (with
    ``only_set``, only fields the file sets: the others take T5Config's defaults, checked by building)."""
    diffs = [(k, config.get(k), v) for k, v in implied.items()
             if (k in config or not only_set) and config.get(k) != v]
    if diffs:
        have = ", ".join(f"{k} = {json.dumps(c)}" for k, c, _ in diffs)
        said = ", ".join(f"{k} = {v}" for k, _, v in diffs)
        fix = ", ".join(f"\"{k}\": {v}" for k, _, v in diffs)
        raise ValueError(f"{cfg_path} says {have}, but the weights in {weights} are for {said}; set {fix} in "
                         f"config.json, or {fix_tail}")


def pipeline_components(pipeline: str) -> dict:
    """The component map :func:`check_pipeline_folder` takes for ``pipeline`` (``"VARPipeline"``,
    ``"InfinityPipeline"``, ``"HARTPipeline"`` or ``"FlexVARPipeline"``): subfolder → module class,
    ``"text_encoder"`` or None."""
    from .bsq_vae import BSQVAE
    from .flexvar import FlexVARTransformer
    from .flexvar_vq import FlexVQ16
    from .hart import HARTTransformer
    from .infinity import InfinityTransformer
    from .var import VARTransformer
    return {"VARPipeline": {"transformer": VARTransformer, "vqvae": MultiScaleVQVAE},
            "InfinityPipeline": {"transformer": InfinityTransformer, "vae": BSQVAE, "text_encoder": "text_encoder",
                                 "tokenizer": None},
            "HARTPipeline": {"transformer": HARTTransformer, "vqvae": MultiScaleVQVAE,
                             "text_encoder": "qwen2_text_encoder", "tokenizer": None},
            "FlexVARPipeline": {"transformer": FlexVARTransformer, "vqvae": FlexVQ16}}[pipeline]


def check_pipeline_folder(path, pipeline: str, components: Mapping[str, object], official_hint: str,
                          variant: Optional[str] = None, given: Optional[Mapping[str, object]] = None) -> dict:
    """Check a pipeline folder written by ``save_pretrained`` / ``sparsevar convert`` before anything is
    loaded, and return its ``model_index.json``.

    ``components`` maps each subfolder to its class (checked with :func:`check_component_folder`), to
    ``"text_encoder"`` (a T5 folder, :func:`check_saved_text_encoder`) or to None (its JSON files must parse).
    Checks, each failing with one line naming the file: the folder and ``model_index.json`` exist (else
    FileNotFoundError with ``official_hint``, what to pass instead), the index is a JSON object naming
    ``pipeline`` (another pipeline's folder says which class loads it), every component subfolder is
    there and agrees with its weights, and the components agree with each other (VAR: codebook size and
    code width of transformer and VQVAE; Infinity: the T5 width the transformer reads).
    """
    path = Path(path)
    index_path = path / "model_index.json"
    if path.is_file():
        raise ValueError(f"{path} is a file, not a {pipeline} folder: pass the folder written by save_pretrained / "
                         f"`sparsevar convert`, or {official_hint}")
    if not index_path.is_file():
        raise FileNotFoundError(
            f"{path} is not a {pipeline} folder (no model_index.json). Nothing is downloaded: pass a local "
            f"folder written by save_pretrained, or {official_hint}")
    index = read_json_file(index_path, "pipeline folder")
    named = pipeline_class_name(index)
    if named != pipeline:
        use = _PIPELINE_USE.get(named)
        fix = f"load it with {use}" if use else (f"this package loads {' and '.join(_PIPELINE_USE)} folders, written "
                                                  f"by save_pretrained / `sparsevar convert`")
        raise ValueError(f"{index_path} names the pipeline {named!r}, not {pipeline}: {fix}")
    given = dict(given or {})
    components = {k: v for k, v in components.items() if k not in given}
    for sub in components:
        if not (path / sub).is_dir():
            raise FileNotFoundError(f"{path / sub} is missing or not a folder (a {pipeline} folder has "
                                    f"{', '.join(s + '/' for s in components)}); {RECONVERT}")
    configs = {sub: _module_config(module) for sub, module in given.items()}
    for sub, cls in components.items():
        if cls == "text_encoder":
            configs[sub] = check_saved_text_encoder(path / sub, variant=variant)
        elif cls == "qwen2_text_encoder":
            configs[sub] = check_saved_transformers_model(path / sub, "Qwen2", variant=variant)
        elif cls is not None:
            check_component_folder(path / sub, cls, variant=variant)
            configs[sub] = json.loads((path / sub / "config.json").read_text())
        else:                                        # e.g. a tokenizer: its JSON files must parse
            for f in sorted((path / sub).glob("*.json")):
                read_json_file(f, f"{sub} folder")
    _check_components_agree(path, pipeline, configs)
    return index


def _module_config(module) -> dict:
    """The config of a component passed in: a diffusers model's ``config``, a transformers model's
    ``config.to_dict()``; {} for anything without one (a tokenizer)."""
    cfg = getattr(module, "config", None)
    if cfg is None:
        return {}
    return cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)


def _check_components_agree(path: Path, pipeline: str, configs: dict) -> None:
    if pipeline in ("VARPipeline", "FlexVARPipeline") and {"transformer", "vqvae"} <= set(configs):
        from .flexvar import FlexVARTransformer
        from .flexvar_vq import FlexVQ16
        from .var import VARTransformer
        flex = pipeline == "FlexVARPipeline"
        t_cls, v_cls = (FlexVARTransformer, FlexVQ16) if flex else (VARTransformer, MultiScaleVQVAE)
        tokenizer = "the tokenizer the transformer was trained with (FlexVAE.pth)" if flex else \
            "the VQVAE the transformer was trained with"
        for t_field, v_field in (("vocab_size", "vocab_size"), ("z_channels", "embed_dim" if flex else "z_channels")):
            t = configs["transformer"].get(t_field, _default(t_cls, t_field))
            v = configs["vqvae"].get(v_field, _default(v_cls, v_field))
            if t != v:
                raise ValueError(f"{path}: the transformer and the {'VQ-16' if flex else 'VQVAE'} do not match: "
                                 f"transformer/config.json has {t_field} = {t}, vqvae/config.json {v_field} = {v}; put "
                                 f"{tokenizer} in vqvae/, or {RECONVERT}")
    if pipeline == "InfinityPipeline" and {"transformer", "text_encoder"} <= set(configs):
        from .infinity import InfinityTransformer
        t = configs["transformer"].get("text_channels", _default(InfinityTransformer, "text_channels"))
        d = configs["text_encoder"].get("d_model")
        if d is not None and d != t:
            raise ValueError(f"{path}: the text encoder and the transformer do not match: text_encoder/config.json "
                             f"has d_model = {d}, transformer/config.json reads text_channels = {t}; put the T5 the "
                             f"model was trained with (Flan-T5-XL for the released Infinity models) in text_encoder/")


def load_pretrained_component(cls, root, subfolder: str, torch_dtype: Optional[torch.dtype] = None,
                              variant: Optional[str] = None):
    """``cls.from_pretrained`` of a component folder that :func:`check_pipeline_folder` passed: local
    files only, the safetensors weights when the folder has them, else its ``.bin`` (read by diffusers
    with the safe loader, ``weights_only=True``); ``variant``: that weight variant's files. Frozen and
    in eval mode."""
    folder = Path(root) / subfolder
    name = _DIFFUSERS_WEIGHTS[0]
    use_safetensors = any((folder / variant_name(f, variant)).is_file() for f in (name, f"{name}.index.json"))
    kw = {} if torch_dtype is None else {"torch_dtype": torch_dtype}
    if variant:
        kw["variant"] = variant
    model = cls.from_pretrained(root, subfolder=subfolder, local_files_only=True, use_safetensors=use_safetensors,
                                **kw)
    check_finite(model, folder, "the weights in")
    return model.eval().requires_grad_(False)


# ---- HART: the official folders (llm/ and tokenizer/) ------------------------------------------------------
HART_HINT = ("the official HART folders (Hugging Face mit-han-lab/hart-0.7b-1024px): llm/ (config.json and "
             "ema_model.bin or model.safetensors) and tokenizer/ (config.json and model.safetensors)")
_HART_CONFIG_FIELDS = ("context_token", "context_dim", "depth", "embed_dim", "num_heads", "mlp_ratio", "norm_eps",
                       "sep_aln_pooling_mode", "diff_width", "diff_depth", "num_sampling_steps", "patch_nums")


def _hart_weights(folder: Path, names: Sequence[str], what: str) -> Path:
    for n in names:
        if (folder / n).is_file():
            return folder / n
    raise FileNotFoundError(f"{folder} holds none of {', '.join(names)}: the {what} weights are missing; put "
                            f"{HART_HINT} there")


def load_hart_transformer(llm_dir, dtype: torch.dtype = torch.float32):
    """HART's transformer from its official ``llm/`` folder: ``config.json`` (HARTForT2IConfig) and
    the EMA weights ``ema_model.bin`` the reference generates with (else ``model.safetensors`` /
    ``pytorch_model.bin``). Block flavour, level embedding and attention kind are read off the keys;
    the derived buffers (``lvl_1L``, the 380 MB ``attn_bias_for_masking``, ``zero_k_bias``) are
    dropped and rebuilt."""
    from .hart import HARTTransformer

    folder = local_path(llm_dir, "llm folder")
    cfg_file = folder / "config.json"
    if not folder.is_dir() or not cfg_file.is_file():
        raise FileNotFoundError(f"{folder}: no config.json; pass the llm/ folder of {HART_HINT}")
    config = read_json_file(cfg_file, "HART transformer config")
    if config.get("attn_type", "llama") != "llama" or config.get("mlp_type", "llama") != "llama":
        raise ValueError(f"{cfg_file}: attn_type={config.get('attn_type')!r}, mlp_type={config.get('mlp_type')!r}; "
                         f"only HART's llama blocks (the released model's) are supported")
    if config.get("shared_aln") or config.get("use_cross_attn"):
        raise ValueError(f"{cfg_file}: shared_aln / use_cross_attn are set; the released model uses neither and "
                         f"they are not supported")
    path = _hart_weights(folder, ("ema_model.bin", "model.safetensors", "pytorch_model.bin"), "HART transformer")
    sd = read_state_dict(path, "HART transformer")
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    for k in HARTTransformer.official_extra_keys(depth):
        sd.pop(k, None)
    missing_cfg = [f for f in _HART_CONFIG_FIELDS if f not in config and f != "norm_eps"]
    if missing_cfg:
        raise ValueError(f"{cfg_file} lacks {', '.join(missing_cfg)}; pass the llm/ folder of {HART_HINT}")
    if "head.weight" not in sd or "word_embed.weight" not in sd:
        raise ValueError(f"{path} is not a HART transformer (no head.weight / word_embed.weight); pass the llm/ folder "
                         f"of {HART_HINT}")
    cfg = {f: config[f] for f in _HART_CONFIG_FIELDS if f in config}
    cfg.update(vocab_size=sd["head.weight"].shape[0], z_channels=sd["word_embed.weight"].shape[1],
               use_timestep_embed="lvl_embed.mlp.0.weight" in sd, disable_aln="blocks.0.ada_lin.1.weight" not in sd,
               attn_l2_norm="blocks.0.attn.scale_mul_1H11" in sd, num_sampling_steps=int(config["num_sampling_steps"]))
    model = _load_into(HARTTransformer, cfg, sd, path, "HART transformer")
    return model.set_block_dtype(dtype)


def load_hart_tokenizer(tokenizer_dir, dtype: torch.dtype = torch.float32) -> MultiScaleVQVAE:
    """HART's hybrid tokenizer from its official ``tokenizer/`` folder: ``config.json``
    (HARTAutoEncoderWithDiscConfig, for the schedule ``v_patch_nums``) and its weights, whose
    ``vae.*`` tree is VAR's VQVAE (the GAN discriminator ``disc.*`` is dropped)."""
    folder = local_path(tokenizer_dir, "tokenizer folder")
    cfg_file = folder / "config.json"
    if not folder.is_dir() or not cfg_file.is_file():
        raise FileNotFoundError(f"{folder}: no config.json; pass the tokenizer/ folder of {HART_HINT}")
    config = read_json_file(cfg_file, "HART tokenizer config")
    if "v_patch_nums" not in config:
        raise ValueError(f"{cfg_file} has no v_patch_nums (the token schedule); pass the tokenizer/ folder of {HART_HINT}")
    path = _hart_weights(folder, ("model.safetensors", "pytorch_model.bin"), "HART tokenizer")
    sd = {k[len("vae."):]: v for k, v in read_state_dict(path, "HART tokenizer").items() if k.startswith("vae.")}
    if not sd:
        raise ValueError(f"{path} has no vae.* weights: it is not a HART tokenizer; pass the tokenizer/ folder of "
                         f"{HART_HINT}")
    for k in MultiScaleVQVAE.official_extra_keys():
        sd.pop(k, None)
    try:
        cfg = MultiScaleVQVAE.config_from_state_dict(sd, patch_nums=config["v_patch_nums"])
    except ValueError as e:
        raise ValueError(f"HART tokenizer {path}: {e}") from None
    cfg.update(quant_resi=float(config.get("quant_resi", 0.5)), phi_on_last=False)
    model = _load_into(MultiScaleVQVAE, cfg, sd, path, "HART tokenizer")
    return torch.nn.Module.to(model, dtype)


def hart_folders(path) -> Optional[tuple[Path, Path]]:
    """(llm folder, tokenizer folder) when ``path`` is HART's release folder (holding ``llm/`` and
    ``tokenizer/``) or its ``llm/`` folder (the tokenizer is then the sibling ``tokenizer/``, as
    the reference finds it); None for anything else."""
    p = Path(path)
    for llm in (p / "llm", p):
        cfg = llm / "config.json"
        if cfg.is_file():
            try:
                kind = json.loads(cfg.read_text()).get("model_type")
            except (OSError, ValueError, AttributeError):
                continue
            if kind == "hart_transformer_t2i":
                return llm, llm.parent / "tokenizer"
    return None


def check_saved_transformers_model(folder, kind: str, fix: str = RECONVERT, variant: Optional[str] = None) -> dict:
    """Check a saved ``transformers`` model folder (``config.json`` + weights) before it is loaded:
    the JSON parses, the weights are whole, and the base model its config builds (on the meta
    device) holds exactly the tensors of the weights. ``kind`` names the model in messages. Returns
    the config."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModel

    folder = Path(folder)
    cfg_path = folder / "config.json"
    config = read_json_file(cfg_path, f"text encoder folder {folder}")
    files, shapes = component_weight_shapes(folder, _TRANSFORMERS_WEIGHTS, variant)
    weights = files[0] if len(files) == 1 else f"the {len(files)} weight shards in {folder}"
    try:
        with init_empty_weights():
            model = AutoModel.from_config(AutoConfig.from_pretrained(str(folder), local_files_only=True))
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        del model
    except Exception as e:  # transformers refusing the settings
        raise ValueError(f"{cfg_path}: these settings do not build a {kind} model ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else ''}); fix the file, or {fix}") from None
    found = {k.removeprefix("model."): tuple(v) for k, v in shapes.items() if not k.startswith("lm_head.")}
    if found != expected:
        raise ValueError(f"{cfg_path} does not match {weights}: {_shape_mismatch(expected, found)}; {fix}")
    return config


def _describe_hart(llm: Path, tokenizer: Path) -> dict:
    """``sparsevar info`` of HART's official folders: the transformer's config and parameter count
    (read through its loader's checks, on the meta device where the format allows)."""
    config = read_json_file(llm / "config.json", "HART transformer config")
    path = _hart_weights(llm, ("ema_model.bin", "model.safetensors", "pytorch_model.bin"), "HART transformer")
    if _file_format(path) == "safetensors":
        shapes = safetensors_shapes(path, "HART transformer")
    else:
        shapes = {k: tuple(v.shape) for k, v in read_state_dict(path, "HART transformer").items()}
    derived = {"lvl_1L", "attn_bias_for_masking"}
    n = sum(math.prod(s) for k, s in shapes.items() if k not in derived and not k.endswith(".zero_k_bias"))
    keep = ("depth", "embed_dim", "num_heads", "context_token", "context_dim", "patch_nums", "disable_aln",
            "use_timestep_embed", "diff_width", "diff_depth", "num_sampling_steps")
    return {"path": str(llm.parent), "kind": "HART release folders (llm/, tokenizer/)", "family": "hart",
            "transformer": {k: config[k] for k in keep if k in config}, "weights": str(path),
            "tokenizer": str(tokenizer), "parameters": n}


# ---- FlexVAR (FlexVARd*.pth, FlexVAE.pth) -------------------------------------------------------------------
def load_flexvar_vq(path, dtype: torch.dtype = torch.float32):
    """FlexVAR's tokenizer from the official ``FlexVAE.pth`` (``{'model': state_dict}``, or flat):
    sizes read off the weights; the training-only ``quantize.codebook_used`` is dropped."""
    from .flexvar_vq import FlexVQ16

    p = local_path(path, "vae_ckpt")
    sd = _read_nested(p, "FlexVAR tokenizer", [("model",)])
    _expect_family(sd, "flexvar-vq", p, "FlexVAR tokenizer")
    for k in FlexVQ16.official_extra_keys():
        sd.pop(k, None)
    ch = sd["encoder.conv_in.weight"].shape[0]
    levels = sorted({int(k.split(".")[2]) for k in sd if k.startswith("encoder.conv_blocks.")})
    ch_mult = tuple(sd[f"encoder.conv_blocks.{i}.res.0.conv1.weight"].shape[0] // ch for i in levels)
    cfg = dict(vocab_size=sd["quantize.embedding.weight"].shape[0], embed_dim=sd["quantize.embedding.weight"].shape[1],
               z_channels=sd["quant_conv.weight"].shape[1], ch=ch, ch_mult=ch_mult,
               num_res_blocks=len({k.split(".")[4] for k in sd if k.startswith("encoder.conv_blocks.0.res.")}))
    return torch.nn.Module.to(_load_into(FlexVQ16, cfg, sd, p, "FlexVAR tokenizer"), dtype)


def load_flexvar_transformer(path, dtype: torch.dtype = torch.float32):
    """A FlexVAR transformer (``FlexVARd*.pth``: flat, or ``['trainer']['var_wo_ddp']``): depth, width,
    vocabulary and classes read off the weights (heads: width / 64, as released); the training mask
    ``attn_bias_for_masking`` (any shape in released files) is dropped and built per schedule."""
    from .flexvar import FlexVARTransformer

    p = local_path(path, "transformer_ckpt")
    sd = _read_nested(p, "FlexVAR transformer", [("trainer", "var_wo_ddp")])
    _expect_family(sd, "flexvar", p, "FlexVAR transformer")
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    for k in FlexVARTransformer.official_extra_keys(depth):
        v = sd.pop(k, None)
        if k.endswith(".zero_k_bias") and v is not None and (n := int(torch.count_nonzero(v))):
            raise ValueError(f"FlexVAR transformer {p}: {k} must be zero (FlexVAR's key bias is fixed at 0, the model "
                             f"has none to load it into) but {n:,} of its {v.numel():,} values are not; the file "
                             f"is not an official FlexVAR checkpoint")
    C = sd["class_emb.weight"].shape[1]
    cfg = dict(vocab_size=sd["head.weight"].shape[0], z_channels=sd["word_embed.weight"].shape[1],
               num_classes=sd["class_emb.weight"].shape[0] - 1, depth=depth, embed_dim=C, num_heads=max(1, C // 64),
               shared_aln="shared_ada_lin.1.weight" in sd)
    return torch.nn.Module.to(_load_into(FlexVARTransformer, cfg, sd, p, "FlexVAR transformer"), dtype)
