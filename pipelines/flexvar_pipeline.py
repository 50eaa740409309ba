"""FlexVARPipeline: class-conditional FlexVAR at any schedule and size, diffusers style.

    pipe = FlexVARPipeline.from_single_file("FlexVARd24-epo349.pth", "FlexVAE.pth", dtype=torch.bfloat16).to("cuda")
    out = pipe([207, 88], generator=torch.Generator("cuda").manual_seed(0))                 # 10 steps, 256 px
    out = pipe([207], num_scales=13)                                                       # 13 steps
    out = pipe([207], height=512, width=512)                          # zero-shot 512 px, the reference's 15 steps
    out = pipe([207], patch_nums=(1, 2, 4, 6, 8, 12, 16, 20, 24))                         # any schedule: 384 px

The schedule is a call argument (square sides, the first 1; the last side × 16 is the image side);
the defaults follow the evaluation script (VAR-ramp guidance 2.5, top-k 900, top-p 0.95).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput

from ..engine.contract import Policy
from ..engine.schedule import ScaleSchedule
from ..engine.state import GenerationStats
from ..models.flexvar import (FLEXVAR_PRESETS, MAX_PN, PATCH, FlexVARAdapter, FlexVARConditioning, FlexVARTransformer,
                              flexvar_schedule)
from ..models.flexvar_vq import FlexVQ16
from ..models.var import VAR_SCHEDULES, var_loop_flops
from ._accelerated import AcceleratedPipelineMixin, _dtype_of
from .var_pipeline import VARPipeline, class_names
from .defaults import FLEXVAR_DEFAULTS

DEFAULT_SCHEDULE = VAR_SCHEDULES[256]          # the released models' training default: 10 steps, 256 px


@dataclass
class FlexVARPipelineOutput(BaseOutput):
    """images: list of PIL images, (B, H, W, 3) array or (B, 3, H, W) tensor in [0, 1], or the last
    scale's code vectors (B, 32, n, n) for ``output_type="latent"``; stats: one entry per call."""

    images: Union[list, np.ndarray, torch.Tensor]
    stats: list


class FlexVARPipeline(AcceleratedPipelineMixin, DiffusionPipeline):
    """Class-conditional next-scale prediction at any schedule (FlexVAR) with pluggable acceleration.
    Components: ``transformer`` (:class:`FlexVARTransformer`) and ``vqvae`` (:class:`FlexVQ16`)."""

    PRESET_FAMILY = "flexvar"
    DEFAULTS = FLEXVAR_DEFAULTS
    _output_class = FlexVARPipelineOutput
    model_cpu_offload_seq = "transformer->vqvae"
    _callback_tensor_inputs = ["codes", "logits", "latents", "latent"]

    def __init__(self, transformer: FlexVARTransformer, vqvae: FlexVQ16, sparsevar_calibration: Optional[dict] = None,
                 scalekv_calibration: Optional[dict] = None):
        super().__init__()
        self.register_modules(transformer=transformer, vqvae=vqvae)
        self.set_sparsevar_calibration(sparsevar_calibration)
        self.set_scalekv_calibration(scalekv_calibration)

    @classmethod
    def from_single_file(cls, transformer_ckpt, vae_ckpt, dtype: Union[torch.dtype, str] = torch.float32,
                         vae_dtype: Union[torch.dtype, str] = torch.float32) -> "FlexVARPipeline":
        """The official files: ``FlexVARd16-epo179.pth`` / ``d20-epo249`` / ``d24-epo349`` and ``FlexVAE.pth``."""
        from ..models.loading import load_flexvar_transformer, load_flexvar_vq, resolve_dtype
        dtype, vae_dtype = resolve_dtype(dtype, "dtype"), resolve_dtype(vae_dtype, "vae_dtype")
        return cls(transformer=load_flexvar_transformer(transformer_ckpt, dtype),
                   vqvae=load_flexvar_vq(vae_ckpt, vae_dtype))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, dtype: Union[torch.dtype, str, None] = None,
                        vae_dtype: Union[torch.dtype, str] = torch.float32,
                        torch_dtype: Union[torch.dtype, str, None] = None, **kwargs) -> "FlexVARPipeline":
        """Load a folder written by :meth:`save_pretrained` or ``sparsevar convert`` (``transformer/``,
        ``vqvae/``), checked before any weight is read; nothing is downloaded. dtype (or
        ``torch_dtype``): the transformer's (default: as saved); vae_dtype: the VQ-16's."""
        from ..models.loading import load_pretrained_component
        path, _, dtype, vae_dtype, opts = cls._pretrained_arguments(
            pretrained_model_name_or_path, "load the official files with FlexVARPipeline.from_single_file("
            "'FlexVARd24-epo349.pth', 'FlexVAE.pth') (CLI: --var-ckpt FILE --vae-ckpt FILE) or convert them with "
            "`sparsevar convert`", kwargs, dtype, torch_dtype, vae_dtype=vae_dtype)
        transformer = opts.component("transformer", lambda: load_pretrained_component(
            FlexVARTransformer, path, "transformer", dtype, opts.variant))
        vqvae = opts.component("vqvae", lambda: load_pretrained_component(FlexVQ16, path, "vqvae", vae_dtype,
                                                                          opts.variant))
        return opts.place(cls(transformer=transformer, vqvae=vqvae, sparsevar_calibration=opts.sparsevar_calibration,
                              scalekv_calibration=opts.scalekv_calibration))

    @classmethod
    def from_random(cls, preset: str = "flexvar-tiny", seed: int = 0, device: Union[str, torch.device] = "cpu",
                    dtype: Union[torch.dtype, str] = torch.float32) -> "FlexVARPipeline":
        """A model of a known size (``FLEXVAR_PRESETS``) with random weights; it draws noise."""
        from accelerate import init_empty_weights

        from ..models.loading import resolve_dtype
        if preset not in FLEXVAR_PRESETS:
            raise ValueError(f"preset={preset!r} is unknown; choose one of {sorted(FLEXVAR_PRESETS)}")
        spec, dtype, dev = FLEXVAR_PRESETS[preset], resolve_dtype(dtype, "dtype"), torch.device(device)
        with init_empty_weights():
            transformer, vqvae = FlexVARTransformer(**spec["transformer"]), FlexVQ16(**spec["vqvae"])
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(seed)
            transformer = transformer.to_empty(device=dev).init_random_weights()
            vqvae = vqvae.to_empty(device=dev).init_random_weights()
        return cls(transformer=torch.nn.Module.to(transformer, dtype).eval().requires_grad_(False),
                   vqvae=vqvae.eval().requires_grad_(False))

    def adapter(self) -> FlexVARAdapter:
        a = self._adapter
        if a is None or a.transformer is not self.transformer or a.vqvae is not self.vqvae:
            a = self._adapter = FlexVARAdapter(self.transformer, self.vqvae)
        a.set_kernels(self._kernel_kind(a))
        return a

    @property
    def num_classes(self) -> int:
        return self.transformer.config.num_classes

    @property
    def labels(self) -> dict[int, str]:
        """Class id → name: the ImageNet names for a 1000-class model, else {}."""
        return class_names(None, self.num_classes)

    # ids or names → class ids, as VARPipeline (names, synonyms, suggestions)
    get_label_ids = VARPipeline.get_label_ids
    _label_id = VARPipeline._label_id

    @staticmethod
    def schedule(patch_nums: Optional[Sequence[int]] = None) -> ScaleSchedule:
        """The square schedule of ``patch_nums`` (default: the 10-step 256-px one), checked: positive
        increasing sides starting at 1."""
        pn = tuple(DEFAULT_SCHEDULE if patch_nums is None else patch_nums)
        if not pn or pn[0] != 1 or any(not isinstance(p, (int, np.integer)) or isinstance(p, bool) for p in pn) \
                or any(b <= a for a, b in zip(pn, pn[1:])):
            raise ValueError(f"patch_nums={patch_nums!r}: give increasing square sides starting at 1, e.g. "
                             f"{DEFAULT_SCHEDULE} (the last side × 16 is the image side)")
        return ScaleSchedule.square(pn)

    @classmethod
    def resolve_schedule(cls, height: Optional[int] = None, width: Optional[int] = None,
                         num_scales: Optional[int] = None,
                         patch_nums: Optional[Sequence[int]] = None) -> tuple[int, ...]:
        """The schedule of a call: ``patch_nums`` as given, or the one :func:`flexvar_schedule` derives
        for a ``height`` × ``width`` picture (square, a multiple of 16 px; default 256) in
        ``num_scales`` steps (default: the reference's where it has one). ValueError names the
        argument and the valid choices."""
        if patch_nums is not None:
            sides = tuple(h for h, _ in cls.schedule(patch_nums).hw)
            for name, v in (("height", height), ("width", width)):
                if v is not None and v != sides[-1] * PATCH:
                    raise ValueError(f"{name}={v!r} disagrees with patch_nums={tuple(patch_nums)} (a "
                                     f"{sides[-1] * PATCH}-px picture); pass one of them")
            if num_scales is not None and num_scales != len(sides):
                raise ValueError(f"num_scales={num_scales!r} disagrees with patch_nums={tuple(patch_nums)} "
                                 f"({len(sides)} steps); pass one of them")
            return sides
        for name, v in (("height", height), ("width", width)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < PATCH
                                  or v % PATCH):
                raise ValueError(f"{name}={v!r}: FlexVAR draws pictures whose sides are multiples of {PATCH} px "
                                 f"(e.g. 256, 384, 512)")
        height = height or width or DEFAULT_SCHEDULE[-1] * PATCH
        width = width or height
        if height != width:
            raise ValueError(f"height={height}, width={width}: the released FlexVAR models draw square pictures "
                             f"(their position grid is square); pass equal sides")
        try:
            return flexvar_schedule(height // PATCH, num_scales)
        except ValueError as e:
            raise ValueError(f"num_scales={num_scales!r}: " + str(e).split(": ", 1)[1]) from None

    def flop_speedup(self, stats: GenerationStats, patch_nums: Optional[Sequence[int]] = None) -> float:
        """The speed-up a generation's token counts allow in FLOPs, versus computing every token."""
        c = self.transformer.config
        pn = tuple(h for h, _ in self.schedule(patch_nums).hw)
        cfg = SimpleNamespace(embed_dim=c.embed_dim, vocab_size=c.vocab_size, depth=c.depth, mlp_ratio=c.mlp_ratio,
                              patch_nums=pn)
        rows = [s.rows for s in stats.scales]
        dense = var_loop_flops(cfg, 1, [p * p for p in pn], rows_per_scale=[max(rows)] * len(rows))
        return dense / var_loop_flops(cfg, 1, [s.tokens_computed for s in stats.scales],
                                      kv_per_scale=stats.kv_per_scale(), rows_per_scale=rows)

    def _memory_layout(self, batch_size: int, height, width, patch_nums=None) -> tuple:
        pn = patch_nums
        if pn is None and (height is not None or width is not None):
            pn = self.resolve_schedule(height or width, width or height)
        return self.schedule(pn), self.memory_needed(batch_size, pn)

    def memory_needed(self, batch_size: int, patch_nums: Optional[Sequence[int]] = None) -> dict[str, int]:
        """A lower bound of the bytes one call allocates: the KV cache ([cond; uncond] rows), the last
        scale's float32 logits and the decoder's full-resolution activation with the output images."""
        c, sch = self.transformer.config, self.schedule(patch_nums)
        R, el = 2 * batch_size, _dtype_of(self.transformer).itemsize
        last = sch.hw[-1][0] ** 2
        side = sch.hw[-1][0] * self.vqvae.downsample_factor
        return {"KV cache": c.depth * R * sch.total_tokens * (2 * c.embed_dim * el + 8),
                "logits": R * last * c.vocab_size * 4,
                "decoder": batch_size * side * side * (self.vqvae.config.ch * _dtype_of(self.vqvae).itemsize + 12)}

    @torch.no_grad()
    def __call__(self, class_labels: Union[int, Sequence[int]], height: Optional[int] = None,
                 width: Optional[int] = None, num_scales: Optional[int] = None,
                 patch_nums: Optional[Sequence[int]] = None,
                 guidance_scale: float = FLEXVAR_DEFAULTS.guidance_scale, top_k: int = FLEXVAR_DEFAULTS.top_k,
                 top_p: float = FLEXVAR_DEFAULTS.top_p, llamagen_cfg: bool = False, max_pn: int = MAX_PN,
                 num_images_per_prompt: int = 1, generator=None, output_type: str = "pil", return_dict: bool = True,
                 callback_on_step_end: Optional[Callable] = None,
                 callback_on_step_end_tensor_inputs: Sequence[str] = ("codes",),
                 policies: Optional[Sequence[Policy]] = None, use_cuda_graphs: Optional[bool] = None):
        """Generate images of ImageNet classes (or the model's classes).

        Args:
            class_labels: a class id or name, or a list of them (ImageNet names for 1000-class models).
            height, width: the picture's size in pixels (square, a multiple of 16; default 256): the
                schedule is derived (:meth:`resolve_schedule`; 512 is the reference's zero-shot size).
            num_scales: steps of the derived schedule (default: the reference's, 10 at 256 px, 15 at
                512 px; 13 is its README variant).
            patch_nums: the schedule itself instead (default 1, 2, 3, 4, 5, 6, 8, 10, 13, 16); any
                increasing square sides from 1, e.g. the README's 13 steps or 512 px zero-shot up to 32.
            guidance_scale: VAR's ramp t = cfg·k/min(K−1, 9) ((1+t)·cond − t·uncond; the full cfg above
                ``max_pn``), or with ``llamagen_cfg`` uncond + cfg·(cond − uncond) at every scale (the
                demo script's, cfg 4). 0 disables guidance.
            top_k, top_p: per-token filters (sides the model was not trained on, and those above
                ``max_pn``, are drawn greedily, as in the reference).
            num_images_per_prompt, generator, output_type, return_dict, callback_on_step_end,
                callback_on_step_end_tensor_inputs, policies: as in VARPipeline.
            use_cuda_graphs: replay each scale's compute from a CUDA graph (default: on for CUDA models;
                one set of graphs per schedule).
        """
        if class_labels is None or (isinstance(class_labels, (list, tuple)) and not class_labels):
            raise ValueError(f"class_labels={class_labels!r}: give a class id 0..{self.num_classes - 1} or a class "
                             f"name, or a list of them")
        patch_nums = self.resolve_schedule(height, width, num_scales, patch_nums)

        def check_call(n):
            return self._check_call(n, "class label", lambda b: self.memory_needed(b, patch_nums), guidance_scale,
                                    top_k, top_p, num_images_per_prompt, output_type, generator, callback_on_step_end,
                                    callback_on_step_end_tensor_inputs, policies, layout={"patch_nums": patch_nums})

        # where the count is known, the memory bound comes before the labels are read one by one
        counted = isinstance(class_labels, (list, tuple)) or (isinstance(class_labels, torch.Tensor)
                                                              and class_labels.ndim == 1)
        B = check_call(len(class_labels)) if counted and len(class_labels) else None
        labels = self.get_label_ids(class_labels)          # ids or names; a bad one is named
        sched = self.schedule(patch_nums)
        if not isinstance(max_pn, (int, np.integer)) or isinstance(max_pn, bool) or max_pn < 1:
            raise ValueError(f"max_pn={max_pn!r}: give the largest side drawn with top-k / top-p and the ramp, an int "
                             f">= 1 (the reference's {MAX_PN})")
        if not isinstance(llamagen_cfg, bool):
            raise TypeError(f"llamagen_cfg must be True or False, got {llamagen_cfg!r}")
        if B is None:
            B = check_call(len(labels))
        stack = self._call_policies(policies)
        ids = torch.tensor(labels).repeat_interleave(int(num_images_per_prompt))
        cond = FlexVARConditioning(ids, tuple(h for h, _ in sched.hw), llamagen_cfg=llamagen_cfg, max_pn=int(max_pn))
        return self._generate(cond, B, stack, guidance_scale, top_k, top_p, generator, output_type, return_dict,
                              callback_on_step_end, callback_on_step_end_tensor_inputs, use_cuda_graphs, schedule=sched)


__all__ = ["FlexVARPipeline", "FlexVARPipelineOutput", "DEFAULT_SCHEDULE"]
