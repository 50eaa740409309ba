"""Official checkpoints → our modules: read safely, recognise, infer the configuration, validate.

Every file is read with ``torch.load(weights_only=True)`` (or safetensors). Keys are mapped
explicitly (the project's module names are the official key names), derived buffers are
regenerated instead of loaded, training statistics are dropped, and the remaining key set must
match exactly: the official loaders accept mismatches silently, ours names them.
"""
from __future__ import annotations

import pickle
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


def read_state_dict(path, what: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Read a flat {name: tensor} dict from a ``.pth``/``.pt``/``.bin`` or ``.safetensors`` file.

    Accepts the official flat state dicts and the VAR training checkpoint layout
    (``{'trainer': {'var_wo_ddp': …, 'vae_local': …}}`` — the transformer's is taken unless
    ``what`` mentions the VAE). Anything else raises a ValueError naming the file.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{what} not found: {p} — put the file there or pass its path")
    if p.is_dir():
        raise ValueError(f"{what} {p} is a folder; pass the checkpoint file inside it "
                         f"(or load a converted folder with from_pretrained)")
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file
        try:
            return dict(load_file(str(p)))
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"{what} {p} is not a readable safetensors file ({e}); re-download or re-convert it") from e
    if p.stat().st_size == 0:
        raise ValueError(f"{what} {p} is empty (0 bytes): truncated or corrupt — the download or copy did not "
                         f"finish; fetch it again")
    try:
        obj = torch.load(str(p), map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(p))
    except pickle.UnpicklingError as e:
        raise ValueError(f"{what} {p} is not a plain state dict of tensors: it holds Python objects that the "
                         f"safe loader refuses ({str(e).splitlines()[0][:200]}). Re-save it as "
                         f"torch.save(model.state_dict()) or convert it to safetensors") from e
    except (RuntimeError, EOFError, OSError, ValueError, IndexError, KeyError) as e:
        size = p.stat().st_size
        raise ValueError(f"{what} {p} ({size:,} bytes) could not be read — truncated or corrupt? "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:200]}). Download it again") from e
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
    """'var' (class-conditional VAR transformer), 'var-vqvae' (its tokenizer) or 'unknown'."""
    if "class_emb.weight" in sd and "pos_1LC" in sd and any(k.startswith("blocks.") for k in sd):
        return "var"
    if "quantize.embedding.weight" in sd and "encoder.conv_in.weight" in sd and "decoder.conv_out.weight" in sd:
        return "var-vqvae"
    return "unknown"


def _expect_family(sd, family: str, path, what: str) -> None:
    found = detect_family(sd)
    if found == family:
        return
    hints = {"var": "a VAR transformer (var_d16.pth … var_d36.pth)",
             "var-vqvae": "the VAR VQVAE (vae_ch160v4096z32.pth)"}
    if found in hints:
        raise ValueError(f"{path} is {hints[found]}, but it was passed as the {what}; "
                         f"pass it as the {'VAE' if found == 'var-vqvae' else 'transformer'} file instead")
    raise ValueError(f"{path} is not {hints[family]}: none of its {len(sd)} keys look like one "
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
    return model.eval().requires_grad_(False)


def load_var_transformer(path, patch_nums: Optional[Sequence[int]] = None,
                         dtype: torch.dtype = torch.float32) -> VARTransformer:
    """Load an official ``var_d{16,20,24,30,36}.pth`` (or a fine-tune in the same layout)."""
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
    """What a file or a converted folder is: family, configuration, parameter count (for ``info``)."""
    p = Path(path)
    if p.is_dir():
        import json
        index = p / "model_index.json"
        if not index.exists():
            raise ValueError(f"{p} is a folder without model_index.json; pass a checkpoint file or a folder "
                             f"written by `sparsevar convert` / save_pretrained")
        from safetensors import safe_open
        pipeline = json.loads(index.read_text()).get("_class_name")
        info = {"path": str(p), "kind": "pipeline folder", "pipeline": pipeline,
                "family": {"VARPipeline": "var", "InfinityPipeline": "infinity"}.get(pipeline, "unknown"),
                "parameters": 0}
        for sub in ("transformer", "vqvae", "vae"):
            cfg_path = p / sub / "config.json"
            if cfg_path.exists():
                info[sub] = {k: v for k, v in json.loads(cfg_path.read_text()).items() if not k.startswith("_")}
            for f in sorted((p / sub).glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as st:
                    n = 0
                    for k in st.keys():
                        n += int(torch.Size(st.get_slice(k).get_shape()).numel())
                info["parameters"] += n
        return info
    sd = read_state_dict(p, "checkpoint")
    family = detect_family(sd)
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


def _read_sharded(folder: Path, what: str) -> dict[str, torch.Tensor]:
    """A Hugging Face style shard folder (``*.index.json`` + shards), like the 8B release."""
    import json

    indexes = sorted(folder.glob("*.index.json"))
    if not indexes:
        singles = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pth"))
        if len(singles) == 1:
            return read_state_dict(singles[0], what)
        raise ValueError(f"{what} {folder} is a folder without a shard index (*.index.json); pass the checkpoint "
                         f"file, or the folder of the sharded release (index json + shards)")
    weight_map = json.loads(indexes[0].read_text()).get("weight_map", {})
    sd: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
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
    from .infinity import InfinityTransformer, _official_uncond_rows

    what = "Infinity transformer checkpoint"
    p = Path(path)
    if p.is_dir():
        sd = _read_sharded(p, what)
    else:
        sd = _read_nested(p, what, [("trainer", "gpt_fsdp"), ("gpt_fsdp",), ("model",), ("state_dict",)])
    family = detect_infinity_family(sd)
    if family != "infinity":
        hint = {"infinity-vae": "it is the Infinity VAE (infinity_vae_*.pth): pass it as the VAE",
                "var": "it is a VAR transformer: load it with VARPipeline"}.get(
            family if family != "unknown" else detect_family(sd), f"none of its {len(sd)} keys look like one "
                                                                  f"(first keys: {_short(list(sd)[:6])})")
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

    what = "Infinity VAE checkpoint"
    p = Path(path)
    sd = _read_nested(p, what, [("vae",), ("state_dict",)])
    if detect_infinity_family(sd) == "infinity":
        raise ValueError(f"{p} is an Infinity transformer checkpoint, but it was passed as the VAE; pass the "
                         f"infinity_vae_*.pth file as the VAE and this one as the transformer")
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
    family = detect_infinity_family(sd)
    info = {"path": str(p), "family": family, "dtype": str(next(iter(sd.values())).dtype).replace("torch.", "")}
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
    """The family of an official checkpoint from its key names alone: 'var', 'var-vqvae', 'infinity',
    'infinity-vae' or 'unknown'. Reads no tensor data where the format allows it (a shard folder's
    index, safetensors headers, memory-mapped ``.pth`` zip files), so a multi-gigabyte file costs
    little to recognise before it is loaded."""
    import json

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {p} — put the file there or pass its path")
    indexes = sorted(p.glob("*.index.json")) if p.is_dir() else []
    if indexes:                                      # the same index _read_sharded reads
        keys = list(json.loads(indexes[0].read_text()).get("weight_map", {}))
    elif p.is_dir():
        keys = list(_read_sharded(p, "checkpoint"))
    elif p.suffix == ".safetensors":
        from safetensors import safe_open
        try:
            with safe_open(str(p), framework="pt") as st:
                keys = list(st.keys())
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"{p} is not a readable safetensors file ({e}); re-download or re-convert it") from e
    else:
        keys = list(_read_nested(p, "checkpoint", [("vae",), ("trainer", "gpt_fsdp"), ("gpt_fsdp",), ("model",),
                                                   ("state_dict",)]))
    if keys and all(k.startswith("module.") for k in keys):
        keys = [k[len("module."):] for k in keys]
    names = dict.fromkeys(keys)
    family = detect_family(names)
    return family if family != "unknown" else detect_infinity_family(names)
