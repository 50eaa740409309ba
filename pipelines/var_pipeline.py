"""VARPipeline: class-conditional VAR generation, diffusers style.

    pipe = VARPipeline.from_single_file("var_d16.pth", "vae_ch160v4096z32.pth", dtype=torch.bfloat16).to("cuda")
    out = pipe(["golden retriever", 980], guidance_scale=4.0, generator=torch.Generator("cuda").manual_seed(0))
    out.images[0].save("dog.png"); print(out.stats[0].summary())
"""
from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput

from ..engine.contract import Policy
from ..engine.state import GenerationStats
from ..models.loading import load_var_transformer, load_var_vqvae
from ..models.var import VAR_PRESETS, VARAdapter, VARTransformer
from ..models.vqvae import MultiScaleVQVAE
from ._accelerated import AcceleratedPipelineMixin, _dtype_of
from ._accelerated import OUTPUT_TYPES, check_memory, memory_available  # noqa: F401 (importable from here too)
from .defaults import VAR_DEFAULTS


@dataclass
class VARPipelineOutput(BaseOutput):
    """images: list of PIL images, (B, H, W, 3) float array in [0, 1], (B, 3, H, W) tensor in [0, 1],
    or the latent (B, Cvae, h, w); stats: per-scale statistics of the generation (one entry per call)."""

    images: Union[list, np.ndarray, torch.Tensor]
    stats: list


def _imagenet_classes() -> tuple[str, ...]:
    from ._imagenet_classes import IMAGENET_CLASSES
    return IMAGENET_CLASSES


class ClassLabelError(ValueError):
    """A class name the model does not have: ``problem`` says what is wrong with it; the message
    adds what to do from Python (the command line says it in its own terms)."""

    def __init__(self, problem: str, advice: str):
        super().__init__(f"{problem}{advice}")
        self.problem = problem


def class_names(id2label: Optional[Mapping], num_classes: int) -> dict[int, str]:
    """Class id → name: ``id2label`` where given, else the ImageNet names for a 1000-class model, else {}."""
    if id2label:
        return {int(k): v for k, v in id2label.items()}
    if num_classes == 1000:
        return dict(enumerate(_imagenet_classes()))
    return {}


def check_id2label(id2label, where: str) -> dict[int, str]:
    """``id2label`` as {class id: name}: a mapping whose keys are class ids (ints, or strings of
    digits as JSON stores them) and whose values are names; else a ValueError naming ``where``."""
    if not isinstance(id2label, Mapping):
        raise ValueError(f"{where} must map class ids to names, e.g. {{\"0\": \"tench\"}}, got "
                         f"{type(id2label).__name__} {str(id2label)[:60]}")
    out = {}
    for k, v in id2label.items():
        ok_key = (isinstance(k, (int, np.integer)) and not isinstance(k, bool)) or \
            (isinstance(k, str) and k.strip().isdecimal())
        if not ok_key or not isinstance(v, str):
            raise ValueError(f"{where} must map class ids to names, e.g. {{\"0\": \"tench\"}}; the entry "
                             f"{_json_or_repr(k)}: {_json_or_repr(v)} is not an id and a name")
        out[int(k)] = v
    return out


def _json_or_repr(v) -> str:
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


class VARPipeline(AcceleratedPipelineMixin, DiffusionPipeline):
    """Class-conditional next-scale prediction (VAR d16–d36) with pluggable acceleration policies.

    Components: ``transformer`` (:class:`VARTransformer`) and ``vqvae`` (:class:`MultiScaleVQVAE`).
    ``id2label`` maps class ids to names; models with 1000 classes default to the ImageNet names.
    """

    DEFAULTS = VAR_DEFAULTS
    _output_class = VARPipelineOutput
    model_cpu_offload_seq = "transformer->vqvae"
    _callback_tensor_inputs = ["codes", "logits", "latents", "latent"]

    def __init__(self, transformer: VARTransformer, vqvae: MultiScaleVQVAE, id2label: Optional[dict] = None,
                 sparsevar_calibration: Optional[dict] = None,
                 scalekv_calibration: Optional[dict] = None):
        super().__init__()
        self.register_modules(transformer=transformer, vqvae=vqvae)
        if id2label is not None:
            id2label = {str(k): v for k, v in check_id2label(id2label, "id2label").items()}
        self.register_to_config(id2label=id2label)
        self.set_sparsevar_calibration(sparsevar_calibration)
        self.set_scalekv_calibration(scalekv_calibration)

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_single_file(cls, var_ckpt, vae_ckpt, dtype: Union[torch.dtype, str] = torch.float32,
                         vae_dtype: Union[torch.dtype, str] = torch.float32, patch_nums: Optional[Sequence[int]] = None,
                         id2label: Optional[dict] = None) -> "VARPipeline":
        """Load the official files: ``var_d{16,20,24,30,36}.pth`` and ``vae_ch160v4096z32.pth``.

        dtype: the transformer's weight dtype (bfloat16 / float16 halve memory and run faster on GPU);
        vae_dtype: the VQVAE's (float32 keeps the latent arithmetic exact). Both take a torch dtype or
        diffusers' strings ("float16" / "fp16" / "half", "bfloat16" / "bf16", "float32" / "fp32").
        """
        from ..models.loading import local_path, resolve_dtype
        var_ckpt, vae_ckpt = local_path(var_ckpt, "var_ckpt"), local_path(vae_ckpt, "vae_ckpt")
        dtype, vae_dtype = resolve_dtype(dtype, "dtype"), resolve_dtype(vae_dtype, "vae_dtype")
        transformer = load_var_transformer(var_ckpt, patch_nums=patch_nums, dtype=dtype)
        vqvae = load_var_vqvae(vae_ckpt, patch_nums=transformer.config.patch_nums, dtype=vae_dtype)
        return cls(transformer=transformer, vqvae=vqvae, id2label=id2label)

    @classmethod
    def from_path(cls, model, vae=None, dtype: torch.dtype = torch.float32,
                  vae_dtype: torch.dtype = torch.float32) -> "VARPipeline":
        """A converted folder (``model``), or an official transformer file plus its VQVAE file."""
        from ..models.loading import local_path
        p = local_path(model, "model")
        if not p.exists():
            raise FileNotFoundError(f"model={str(model)!r}: no such file or folder; give a converted folder "
                                    f"(`sparsevar convert`, save_pretrained) or the official transformer checkpoint "
                                    f"(var_d16.pth … var_d36.pth)")
        if p.is_dir():
            return cls.from_pretrained(p, dtype=dtype, vae_dtype=vae_dtype)
        if vae is None:
            raise ValueError(f"{p.name} is a transformer checkpoint: also choose its VQVAE file "
                             f"(vae_ch160v4096z32.pth), or a converted model folder")
        return cls.from_single_file(p, vae, dtype=dtype, vae_dtype=vae_dtype)

    def flop_speedup(self, stats: GenerationStats) -> float:
        """The speed-up a generation's token counts allow in FLOPs, versus computing every token."""
        from ..models.var import var_loop_flops
        cfg = self.transformer.config
        rows = [s.rows for s in stats.scales]
        dense = var_loop_flops(cfg, 1, [p * p for p in cfg.patch_nums], rows_per_scale=[max(rows)] * len(rows))
        return dense / var_loop_flops(cfg, 1, [s.tokens_computed for s in stats.scales], kv_per_scale=stats.kv_per_scale(),
                                      rows_per_scale=rows)

    @classmethod
    def from_demo(cls, dtype: Union[torch.dtype, str] = torch.float32) -> "VARPipeline":
        """The demo model that ships inside the package: a small VAR (depth 8) and VQVAE trained by
        ``sparsevar train-demo`` on 12 classes of procedural scenes (disc, box, … car, fish). It
        draws real, simple pictures on any machine in about a second, with nothing to download.
        dtype: the transformer's, as in :meth:`from_pretrained`."""
        from ..demo import DEMO_MODEL_DIR
        from ..models.loading import resolve_dtype
        dtype = resolve_dtype(dtype, "dtype")
        if not (DEMO_MODEL_DIR / "model_index.json").is_file():
            raise FileNotFoundError(
                f"the demo model is missing from {DEMO_MODEL_DIR} (a partial install?): reinstall the package, or "
                f"train it again into the package with `sparsevar train-demo --out {DEMO_MODEL_DIR}` (about 24 minutes "
                f"on one H100)")
        return cls.from_pretrained(DEMO_MODEL_DIR, dtype=dtype)

    @classmethod
    def from_random(cls, preset: str = "var-tiny", seed: int = 0, device: Union[str, torch.device] = "cpu",
                    dtype: Union[torch.dtype, str] = torch.float32, vae_ch: Optional[int] = None) -> "VARPipeline":
        """A model of a known size with random weights (benchmarks, smoke tests). It draws noise.

        preset: one of ``VAR_PRESETS`` (var-tiny, var-d16 … var-d36); vae_ch: VQVAE width
        (default 160, the official, except 32 for var-tiny); dtype: the transformer's, as in
        :meth:`from_single_file`.
        """
        from ..models.loading import resolve_dtype
        if preset not in VAR_PRESETS:
            raise ValueError(f"preset={preset!r} is unknown; choose one of {sorted(VAR_PRESETS)}")
        dtype = resolve_dtype(dtype, "dtype")
        from accelerate import init_empty_weights

        cfg = dict(VAR_PRESETS[preset])
        if vae_ch is None:
            vae_ch = 32 if preset == "var-tiny" else 160
        with init_empty_weights():
            transformer = VARTransformer(**cfg)
            vqvae = MultiScaleVQVAE(ch=vae_ch, patch_nums=cfg["patch_nums"])
        fork = torch.random.fork_rng(devices=[torch.device(device)] if torch.device(device).type == "cuda" else [])
        with fork:
            torch.manual_seed(seed)
            transformer = transformer.to_empty(device=device).init_random_weights()
            vqvae = vqvae.to_empty(device=device)
            vqvae.init_random_weights()
        transformer.rebuild_buffers()
        return cls(transformer=torch.nn.Module.to(transformer, dtype).eval().requires_grad_(False),
                   vqvae=vqvae.eval().requires_grad_(False))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, dtype: Union[torch.dtype, str, None] = None,
                        vae_dtype: Union[torch.dtype, str] = torch.float32,
                        torch_dtype: Union[torch.dtype, str, None] = None, **kwargs) -> "VARPipeline":
        """Load a folder written by :meth:`save_pretrained` or ``sparsevar convert``.

        Components are built with this package's own classes (never resolved through module
        names), so a folder loads the same from a plain Python session and from inside ComfyUI.
        Nothing is downloaded: the path must be a local folder. Before any weight is read the
        folder is checked (``models.loading.check_pipeline_folder``): each ``config.json`` must
        build exactly the tensors its weights hold, and every file must be whole.

        dtype (or diffusers' name ``torch_dtype``): the transformer's (default: as saved);
        vae_dtype: the VQVAE's. Each takes a torch dtype or a string such as "float16" / "fp16",
        "bfloat16" / "bf16", "float32" / "fp32".
        """
        from ..models.loading import load_pretrained_component
        path, index, dtype, vae_dtype, opts = cls._pretrained_arguments(
            pretrained_model_name_or_path, "load the official .pth files with VARPipeline.from_single_file(var_ckpt, "
            "vae_ckpt) (CLI: --var-ckpt FILE --vae-ckpt FILE) or convert them with `sparsevar convert`", kwargs,
            dtype, torch_dtype, vae_dtype=vae_dtype)
        id2label = index.get("id2label")
        if id2label is not None:
            id2label = check_id2label(id2label, f"{path / 'model_index.json'}: \"id2label\"")
        transformer = opts.component("transformer", lambda: load_pretrained_component(
            VARTransformer, path, "transformer", dtype, opts.variant))
        vqvae = opts.component("vqvae", lambda: load_pretrained_component(
            MultiScaleVQVAE, path, "vqvae", vae_dtype, opts.variant))
        return opts.place(cls(transformer=transformer, vqvae=vqvae, id2label=id2label,
                              sparsevar_calibration=opts.sparsevar_calibration,
                              scalekv_calibration=opts.scalekv_calibration))

    # ---- labels ---------------------------------------------------------------------------------
    @property
    def num_classes(self) -> int:
        return self.transformer.config.num_classes

    @property
    def labels(self) -> dict[int, str]:
        """Class id → name ({} when the model has no names)."""
        return class_names(self.config.id2label, self.num_classes)

    def get_label_ids(self, labels: Union[int, str, Sequence[Union[int, str]]]) -> list[int]:
        """Class ids for ids or names. A name matches a full label or any of its comma-separated
        synonyms, case-insensitively; an ambiguous or unknown name raises a ValueError with suggestions."""
        if isinstance(labels, (int, str, np.integer)) or (isinstance(labels, torch.Tensor) and labels.ndim == 0):
            labels = [labels]
        if isinstance(labels, torch.Tensor):
            labels = labels.tolist()
        if isinstance(labels, Mapping) or not isinstance(labels, Iterable):
            raise TypeError(f"class_labels must be a class id, a class name, or a list of them, got "
                            f"{type(labels).__name__} {labels!r}")
        names, num_classes = self.labels, self.num_classes
        ids = []
        for lab in labels:
            if isinstance(lab, (bool, np.bool_)):
                raise TypeError(f"class_labels entries must be ints or names, got {lab!r}")
            if isinstance(lab, (int, np.integer)):
                if not 0 <= int(lab) < num_classes:
                    raise ValueError(f"class label {int(lab)} is out of range: this model has classes "
                                     f"0..{num_classes - 1}")
                ids.append(int(lab))
                continue
            if not isinstance(lab, str):
                raise TypeError(f"class_labels entries must be ints or names, got {type(lab).__name__} {lab!r}")
            ids.append(self._label_id(lab.strip(), names))
        return ids

    def _label_id(self, name: str, names: dict[int, str]) -> int:
        if name.isdecimal():                         # digits of any script, as int() reads them ('²' is no number)
            return self.get_label_ids(int(name))[0]
        if not names:
            raise ClassLabelError(f"class name {name!r} given, but this model has no class names",
                                  f"; pass a class id 0..{self.num_classes - 1} (or construct the pipeline with "
                                  f"id2label=...)")
        key = name.lower()
        full = [i for i, v in names.items() if v.lower() == key]
        if len(full) == 1:
            return full[0]
        syn = sorted({i for i, v in names.items() if key in (s.strip().lower() for s in v.split(","))} | set(full))
        if len(syn) == 1:
            return syn[0]
        if len(syn) > 1:
            opts = "; ".join(f"{i} = {names[i]!r}" for i in syn)
            raise ClassLabelError(f"class name {name!r} is ambiguous: {opts}", ". Pass the id instead")
        vocab = {s.strip().lower(): i for i, v in names.items() for s in v.split(",")}
        close = difflib.get_close_matches(key, list(vocab), n=3, cutoff=0.6)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ClassLabelError(f"unknown class name {name!r}.{hint}",
                              f" See pipe.labels for all {len(names)} names, or pass a class id")

    # ---- diffusers-style properties ----------------------------------------------------------------
    @property
    def num_timesteps(self) -> int:
        return self.transformer.schedule.num_scales

    def adapter(self) -> VARAdapter:
        """The engine adapter over the current modules (rebuilt when a component was replaced)."""
        a = self._adapter
        if a is None or a.transformer is not self.transformer or a.vqvae is not self.vqvae:
            a = self._adapter = VARAdapter(self.transformer, self.vqvae)
        a.set_kernels(self._kernel_kind(a))
        return a

    def _memory_layout(self, batch_size: int, height, width) -> tuple:
        sch = self.transformer.schedule
        side = sch.hw[-1][0] * 2 ** (len(self.vqvae.config.ch_mult) - 1)
        if (height, width) not in ((None, None), (side, side)):
            raise ValueError(f"height={height}, width={width}: this VAR model draws {side}x{side} pictures only; "
                             f"leave height and width out")
        return sch, self.memory_needed(batch_size)

    def memory_needed(self, batch_size: int) -> dict[str, int]:
        """A lower bound of the bytes one call of ``batch_size`` images allocates, by part: the KV cache
        (keys, values and positions of every layer for [cond; uncond] rows, the engine's
        ``KVCache``), the last scale's logits, and the VQVAE decoder's full-resolution activation
        with the output images. Compared with what the device has before a call (check_inputs)."""
        cfg, sch = self.transformer.config, self.transformer.schedule
        R, L, el = 2 * batch_size, sch.total_tokens, self.adapter().dtype.itemsize
        h, w = sch.hw[-1]
        vq = self.vqvae.config
        side = 2 ** (len(vq.ch_mult) - 1)                 # latent → pixels
        pixels = h * side * w * side
        return {"KV cache": cfg.depth * R * L * (2 * cfg.embed_dim * el + 8),
                "logits": R * h * w * cfg.vocab_size * el,
                "decoder": batch_size * pixels * (vq.ch * vq.ch_mult[0] * _dtype_of(self.vqvae).itemsize + 3 * 4)}

    # ---- call -------------------------------------------------------------------------------------
    def check_inputs(self, class_labels, guidance_scale, top_k, top_p, num_images_per_prompt, output_type,
                     generator, callback_on_step_end_tensor_inputs, callback_on_step_end=None,
                     policies=None) -> list[int]:
        if class_labels is None:
            raise ValueError("class_labels is required: pass a class id, a class name, or a list of them")
        if isinstance(class_labels, (list, tuple)) and len(class_labels) == 0:
            raise ValueError("class_labels is empty: pass at least one class id or name")

        def check_call(n):
            self._check_call(n, "class label", self.memory_needed, guidance_scale, top_k, top_p, num_images_per_prompt,
                             output_type, generator, callback_on_step_end, callback_on_step_end_tensor_inputs, policies)

        # where the count is known, the memory bound comes before the labels are read one by one
        counted = isinstance(class_labels, (list, tuple)) or (isinstance(class_labels, torch.Tensor)
                                                              and class_labels.ndim == 1)
        if counted and len(class_labels):
            check_call(len(class_labels))
        ids = self.get_label_ids(class_labels)
        if not ids:
            raise ValueError("class_labels is empty: pass at least one class id or name")
        if not counted:
            check_call(len(ids))
        return ids

    @torch.no_grad()
    def __call__(self, class_labels=None, guidance_scale: float = VAR_DEFAULTS.guidance_scale,
                 top_k: int = VAR_DEFAULTS.top_k, top_p: float = VAR_DEFAULTS.top_p,
                 num_images_per_prompt: int = 1, generator=None, output_type: str = "pil", return_dict: bool = True,
                 callback_on_step_end: Optional[Callable] = None,
                 callback_on_step_end_tensor_inputs: Sequence[str] = ("codes",),
                 use_cuda_graphs: Optional[bool] = None, policies: Optional[Sequence[Policy]] = None):
        """Generate images of the given classes.

        Args:
            class_labels: a class id or name, or a list of them (ImageNet names for 1000-class models).
            guidance_scale: CFG strength, ramped from 0 at the first scale to this value at the last
                (official demo 4.0, FID setting 1.5); 0 disables guidance.
            top_k, top_p: sampling filters per token (official: 900, 0.95–0.96; top_k=1 is greedy).
            num_images_per_prompt: images per class label.
            generator: a ``torch.Generator`` or one per image; every random draw comes from it.
            output_type: "pil", "np" ((B, H, W, 3) in [0, 1]), "pt" ((B, 3, H, W) in [0, 1]) or "latent".
            callback_on_step_end: ``fn(pipe, scale_index, scale_index, callback_kwargs) -> dict`` after
                every computed scale, with the tensors named in ``callback_on_step_end_tensor_inputs``
                ("codes", "logits" = guided logits, "latents" = the latent so far; "latent" is its
                older name; copies, safe to keep). As in diffusers, a returned dict's "latents" (same
                shape) replace the latent: the next scales build on it and it is what gets decoded;
                nothing else can be changed from a callback (this scale's codes are already in it).
                Set ``pipe._interrupt = True`` to stop early: the latent so far is decoded.
            use_cuda_graphs: replay dense scales from CUDA graphs (default: on for CUDA models).
            policies: acceleration policies for this call only, instead of the enabled ones (the
                pipeline is left unchanged — what ComfyUI nodes need, whose outputs are shared).
        Returns:
            :class:`VARPipelineOutput` (images, stats) or the tuple ``(images, stats)``.
        """
        ids = self.check_inputs(class_labels, guidance_scale, top_k, top_p, num_images_per_prompt, output_type,
                                generator, callback_on_step_end_tensor_inputs, callback_on_step_end, policies)
        stack = self._call_policies(policies)
        labels_B = torch.tensor(ids, dtype=torch.long).repeat_interleave(int(num_images_per_prompt))
        return self._generate(labels_B, labels_B.shape[0], stack, guidance_scale, top_k, top_p, generator, output_type,
                              return_dict, callback_on_step_end, callback_on_step_end_tensor_inputs, use_cuda_graphs)


class ClassLabels:
    """A class-conditional model's names and class count without its weights (read from a folder's
    JSON files), with :meth:`VARPipeline.get_label_ids`' rules: the command line turns ``--class``
    names into ids with it before any model is loaded."""

    def __init__(self, labels: dict[int, str], num_classes: int):
        self.labels, self.num_classes = labels, num_classes

    get_label_ids = VARPipeline.get_label_ids
    _label_id = VARPipeline._label_id


__all__ = ["VARPipeline", "VARPipelineOutput", "GenerationStats", "ClassLabels", "check_id2label", "class_names"]
